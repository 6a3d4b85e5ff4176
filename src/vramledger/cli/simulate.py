"""``vramledger simulate MODEL --lengths …``: the whole run, step by step, through the caching allocator."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from vramledger.cli.common import add_gpu_options, add_model_options, add_train_options

if TYPE_CHECKING:
    from vramledger.allocator.conf import AllocatorConf
    from vramledger.simulate.api import Simulation
    from vramledger.simulate.remedies import RemedyOutcome
    from vramledger.simulate.schedule import RunSpec
    from vramledger.specs import TrainSpec

HF_EVAL_BATCH = 8
"""transformers ``TrainingArguments.per_device_eval_batch_size`` default."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate a whole run: dynamic padding, evaluation, fragmentation, and the step it runs out of memory",
        description="Replay every step of a run at its padded length through PyTorch's caching allocator "
        "(traced once on fake tensors, scaled to each length): reserved memory over the run, its high-water "
        "mark and the batch that causes it, whether and when the run OOMs on --gpu, the OOM probability over "
        "--shuffles orders, and the remedies, each re-simulated.",
        conflict_handler="resolve",  # --eval-steps means eval_steps (every N steps) here, as in the HF Trainer
    )
    add_model_options(p)
    add_train_options(p)
    add_gpu_options(p)
    g = p.add_argument_group("the run")
    g.add_argument(
        "--lengths",
        required=True,
        metavar="FILE|mean,p50,p99,max",
        help="sample token lengths: a file (one per line, JSON list, {'lengths': [...]}, the ground "
        "truth's lengths.json), a dataset (.jsonl/.json/.csv/.parquet with a length or text column), "
        "or summary statistics mean,p50,p99,max",
    )
    g.add_argument("--cutoff", type=int, help="truncate samples to this many tokens (default: --seq / cutoff_len)")
    g.add_argument("--steps", type=int, help="optimizer steps (default: --epochs over the samples)")
    g.add_argument("--epochs", type=float, default=1.0, help="epochs over the samples when --steps is not given")
    g.add_argument(
        "--order",
        choices=("shuffle", "group_by_length", "sorted", "given"),
        help="sample order: the Trainer's RandomSampler (default), LengthGroupedSampler, longest "
        "first, or as in the file (default for a ground-truth lengths.json)",
    )
    g.add_argument(
        "--pad-to-multiple-of",
        type=int,
        metavar="N",
        help="the collator's pad_to_multiple_of (LLaMA-Factory: 8 when training)",
    )
    g.add_argument(
        "--eval-steps",
        dest="eval_every",
        type=int,
        metavar="N",
        help="evaluate every N optimizer steps (HF eval_steps)",
    )
    g.add_argument("--eval-batches", type=int, default=4, help="batches per evaluation (default 4)")
    g.add_argument("--empty-cache-steps", type=int, metavar="N", help="HF torch_empty_cache_steps")
    g.add_argument("--empty-cache-after-eval", action="store_true", help="torch.cuda.empty_cache() after each eval")
    g.add_argument(
        "--alloc-conf",
        metavar="CONF",
        help="PYTORCH_CUDA_ALLOC_CONF (default: the environment's, else torch's defaults)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the order (and of lengths drawn from statistics)")
    g.add_argument("--shuffles", type=int, default=1, help="runs with seeds seed…seed+K−1: the OOM probability")
    g.add_argument(
        "--bucket",
        type=int,
        help="round padded lengths up to a multiple of this for the replay (default: only beyond 32 "
        "distinct lengths; 1: exact)",
    )
    g.add_argument("--no-remedies", action="store_true", help="skip re-simulating the remedies")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--png", type=Path, metavar="DIR", help="write simulate.png (reserved over the run) into DIR")
    p.add_argument("--html", type=Path, metavar="FILE", help="write a self-contained HTML page (summary + figure)")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    import dataclasses

    from vramledger.cli.common import resolve_inputs
    from vramledger.errors import VramledgerError
    from vramledger.simulate.api import make_templates, simulate
    from vramledger.simulate.lengths import read_lengths
    from vramledger.simulate.remedies import try_remedies

    inputs = resolve_inputs(args)
    train = inputs.train
    conf = _alloc_conf(args.alloc_conf)
    micro = (args.steps or 1000) * train.micro_batch * train.grad_accum
    lengths = read_lengths(args.lengths, n=micro, seed=args.seed, tokenizer_name=inputs.model.name)
    eval_batch = train.eval_batch or (HF_EVAL_BATCH if args.eval_every else None)
    spec = _run_spec(args, train, ordered=lengths.ordered)
    if args.shuffles < 1:
        raise VramledgerError("--shuffles must be at least 1")
    templates = make_templates(inputs.model, train, spec, eval_batch=eval_batch)
    sim = simulate(templates, lengths, spec, gpu=inputs.gpu, conf=conf, seed=args.seed, shuffles=args.shuffles)
    extra = [*inputs.warnings, *_not_simulated(train)]
    if extra:
        sim = dataclasses.replace(sim, warnings=(*extra, *sim.warnings))
    remedies = (
        []
        if args.no_remedies
        else try_remedies(
            templates, lengths, spec, sim, gpu=inputs.gpu, conf=conf, seed=args.seed, shuffles=args.shuffles
        )
    )
    title = (
        f"{inputs.model.name}  (simulate: {train.method.value}, batch {train.micro_batch}, "
        f"accum {train.grad_accum}, cutoff {spec.cutoff})"
    )
    _show(args, sim, remedies, title=title, headroom=inputs.headroom)
    return 3 if sim.run.oom is not None else 0


def _alloc_conf(text: str | None) -> AllocatorConf:
    """``--alloc-conf``, else the environment's ``PYTORCH_CUDA_ALLOC_CONF``, else torch's defaults."""
    from vramledger.allocator.conf import parse_alloc_conf

    if text is None and os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        text = os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    return parse_alloc_conf(text or "")


def _run_spec(args: argparse.Namespace, train: TrainSpec, *, ordered: bool) -> RunSpec:
    """The run around the step, from the flags: the order defaults to the file's when it has one
    (a ground-truth lengths.json), else the Trainer's shuffle."""
    from vramledger.simulate.batching import Order
    from vramledger.simulate.schedule import RunSpec

    order = Order(args.order) if args.order else (Order.GIVEN if ordered else Order.SHUFFLE)
    return RunSpec(
        cutoff=args.cutoff or train.seq_len,
        steps=args.steps,
        epochs=args.epochs,
        accum=train.grad_accum,
        order=order,
        pad_multiple=args.pad_to_multiple_of,
        packing=train.packing,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches if args.eval_every else 0,
        empty_cache_steps=args.empty_cache_steps,
        empty_cache_after_eval=args.empty_cache_after_eval,
        bucket=args.bucket,
    )


def _not_simulated(train: TrainSpec) -> list[str]:
    """A warning naming the evaluation settings the simulation ignores, if any is set."""
    ignored = [
        flag
        for flag, on in (
            ("--predict-with-generate", train.predict_with_generate),
            ("--eval-logits", train.eval_logits.value != "none"),
            ("--eval-seq", train.eval_seq_len is not None),
        )
        if on
    ]
    if not ignored:
        return []
    return [f"{', '.join(ignored)}: not simulated (evaluation keeps the loss only; eval lengths come from --lengths)"]


def _show(
    args: argparse.Namespace, sim: Simulation, remedies: list[RemedyOutcome], *, title: str, headroom: float
) -> None:
    """The summary (or its JSON) on stdout, and the HTML page and PNG figure asked for."""
    from vramledger.report.simulate_view import (
        render_simulation,
        simulation_to_dict,
        write_simulation_html,
        write_simulation_png,
    )

    if args.json:
        import json

        print(json.dumps(simulation_to_dict(sim, remedies), indent=2))
    else:
        print(render_simulation(sim, remedies, title=title))
    if args.html is not None:
        path = write_simulation_html(args.html, sim, remedies, title=title, headroom=headroom)
        print(f"wrote {path}", file=sys.stderr)
    if args.png is not None:
        path = write_simulation_png(args.png / "simulate.png", sim, headroom=headroom)
        print(f"wrote {path}", file=sys.stderr)
