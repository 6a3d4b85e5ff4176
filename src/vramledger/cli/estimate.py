"""`vramledger estimate`: the analytic ledger, instant and offline."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from vramledger.cli.args import tokens
from vramledger.cli.common import (
    Inputs,
    add_gpu_options,
    add_model_options,
    add_output_options,
    add_train_options,
    resolve_inputs,
    show_bars,
    write_outputs,
)

if TYPE_CHECKING:
    from vramledger.ledger import Ledger


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "estimate",
        help="itemised GPU memory of a training step, per category and phase, and the verdict for a GPU",
        description="Estimate the GPU memory of one training step from formulas (instant, offline, no torch).",
    )
    add_model_options(p)
    add_train_options(p)
    add_gpu_options(p)
    p.add_argument("--json", action="store_true", help="print the ledger as JSON")
    p.add_argument("--sources", action="store_true", help="list every line of the peak with its formula and source")
    g = p.add_argument_group("inference (--mode infer)")
    g.add_argument(
        "--mode",
        choices=("train", "infer"),
        default="train",
        help="train (default): a training step; infer: one generate() call (weights + KV cache)",
    )
    g.add_argument(
        "--prompt",
        type=tokens(what="token count"),
        help="infer: prompt tokens per sequence (default: --seq, 2048)",
    )
    g.add_argument("--new-tokens", type=tokens(what="token count"), help="infer: max_new_tokens (default 256)")
    g.add_argument("--static-cache", action="store_true", help="infer: cache_implementation='static' (preallocated)")
    g.add_argument(
        "--cache",
        choices=("dynamic", "static", "legacy"),
        help="the KV cache generation keeps (infer, and eval with --predict-with-generate): dynamic "
        "(DynamicCache, transformers >= 4.36, the default), "
        "static, or legacy (the tuple cache of transformers < 4.36: about twice the cache while decoding)",
    )
    g.add_argument(
        "--max-concurrency",
        action="store_true",
        help="infer: how many sequences of this length fit next to the weights on --gpu",
    )
    add_output_options(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    inputs = resolve_inputs(args)
    if args.mode == "infer":
        return _run_infer(args, inputs)
    if args.cache:  # eval generation (--predict-with-generate) models this cache
        from dataclasses import replace

        from vramledger.specs import CacheKind

        inputs = replace(inputs, train=replace(inputs.train, generation_cache=CacheKind(args.cache)))
    ledger = train_ledger(inputs)
    if args.json:
        from vramledger.report.json_out import dumps

        print(dumps(ledger))
    else:
        from vramledger.report.terminal import render_ledger, render_provenance, render_sources

        print(render_ledger(ledger))
        if show_bars(args):
            from vramledger.report.terminal_bars import render_bars

            print()
            print(render_bars(ledger))
        if any(v != "flag" for v in inputs.provenance.values()):
            print()
            print(render_provenance(inputs.provenance))
        if args.sources:
            print()
            print(render_sources(ledger))
        if "distributed" in ledger.settings and inputs.train.world_size > 1:  # per-rank section: docs/distributed.md
            from vramledger.plan.multigpu import multi_gpu_options
            from vramledger.report.distributed_view import render_distributed

            print()
            print(
                render_distributed(
                    ledger.settings["distributed"],  # type: ignore[arg-type]
                    multi_gpu_options(inputs.model, inputs.train, inputs.gpu),
                )
            )
    for path in write_outputs(args, ledger, inputs=inputs):
        print(f"wrote {path}", file=sys.stderr)
    if ledger.verdict is not None and not ledger.verdict.fits:
        return 3
    return 0


def train_ledger(inputs: Inputs) -> Ledger:
    """The analytic ledger of a training step, with the config's warnings first (what ``--json`` prints)."""
    from vramledger.analytic import estimate

    ledger = estimate(inputs.model, inputs.train, gpu=inputs.gpu, headroom=inputs.headroom)
    if inputs.warnings:
        from dataclasses import replace

        ledger = replace(ledger, warnings=tuple(inputs.warnings) + ledger.warnings)
    return ledger


def _run_infer(args: argparse.Namespace, inputs: Inputs) -> int:
    from vramledger.analytic.inference import InferSpec, infer_ledger, max_concurrency
    from vramledger.errors import VramledgerError
    from vramledger.specs import CacheKind

    t = inputs.train
    cache = CacheKind(args.cache) if args.cache else CacheKind.STATIC if args.static_cache else CacheKind.DYNAMIC
    spec = InferSpec(
        batch=t.micro_batch,
        prompt=args.prompt or t.seq_len,
        new_tokens=args.new_tokens or 256,
        dtype=t.precision.compute,
        quant=t.quant,
        attn=t.attn,
        cache=cache,
    )
    ledger = infer_ledger(inputs.model, spec, gpu=inputs.gpu, headroom=inputs.headroom)
    conc = None
    if args.max_concurrency:
        if inputs.gpu is None:
            raise VramledgerError("--max-concurrency needs a GPU: add --gpu (e.g. --gpu h100-sxm or --gpu 24GiB)")
        conc = max_concurrency(inputs.model, spec, inputs.gpu, headroom=inputs.headroom)
    if args.json:
        import json

        from vramledger.report.infer_view import infer_to_dict

        print(json.dumps(infer_to_dict(ledger, conc), indent=2, default=str))
    else:
        from vramledger.report.infer_view import render_infer

        print(render_infer(ledger, conc))
    return 3 if ledger.verdict is not None and not ledger.verdict.fits else 0
