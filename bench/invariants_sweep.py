"""Brute-force sweep of the estimate's shape invariants, over setups the reserve's property tests draw too rarely.

For each setup (QLoRA, DoRA, modules_to_save, freeze, chunked/fused losses, other optimizers, MoE and other families,
a vision model, DDP / FSDP1 / FSDP2 / ZeRO-1/2/3 with and without offload, evaluation and generation), at each
micro-batch it steps the length and reports:

- ``FALL reserved`` / ``FALL device``: a padded run's peak reserved or device total fell as the length or the batch
  grew (``fit`` and ``plan`` bisect on it never falling);
- ``FALL allocated``: the same for peak allocated (a kernel that changes with the shape may explain it: say which);
- ``PACKED``: a packed run's reserved above the padded run's at the same shape;
- ``WORLD``: rank 0's allocated or reserved rose as a sharded setup's world size grew.

Each figure is the largest over the training phases (forward, backward, optimizer); the ``eval`` group sweeps the
evaluation shape (``eval_batch`` × ``eval_seq_len``) at a 1 × 256 training step and checks the evaluation and
generation phases instead. Run it niced, one group at a time: at ``--step 131`` a group takes two
to six minutes on one shared core (``losses`` and ``distributed`` the longest; ``--step`` trades coverage for
time, ``--model`` changes the model of the groups that do not name their own)::

    PYTHONPATH=src nice -n 15 python bench/invariants_sweep.py --group methods --step 131
    PYTHONPATH=src nice -n 15 python bench/invariants_sweep.py --group distributed --step 173 --model llama-3.2-1b

Groups: dense (small dense models, fp32 too; the largest group), methods, losses,
optimizers, models, distributed, eval, world. It prints one line per finding and a count
per group; no timing is asserted.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Iterator
from typing import Any

from vramledger.analytic import estimate
from vramledger.catalog import resolve_model
from vramledger.ledger import Ledger, Phase
from vramledger.specs import Sharding
from vramledger.specs.model import ModelSpec
from vramledger.specs.train import (
    Attention,
    EvalLogits,
    LoraSpec,
    Loss,
    Method,
    Optimizer,
    Precision,
    QuantSpec,
    TrainSpec,
)

TRAIN = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)
AFTER = (Phase.EVAL, Phase.GENERATE)
BATCHES = (1, 2, 3, 4, 6, 8)
Setup = tuple[str, str, dict[str, Any]]
"""(label, catalog model, TrainSpec fields)."""


def _figures(led: Ledger, phases: tuple[Phase, ...]) -> tuple[int, int, int] | None:
    have = [p for p in phases if p in led.phases]
    if not have:
        return None
    return (
        max(led.allocated(p) for p in have),
        max(led.reserved(p) for p in have),
        max(led.device(p) for p in have),
    )


def _setups(group: str, small: str = "qwen2.5-0.5b") -> Iterator[Setup]:
    """The group's setups; ``small``: the model of the groups that do not name their own."""
    if group == "methods":
        for model in (small, "llama-3.2-1b"):
            for dq in (True, False):
                yield f"qlora dq={dq}", model, dict(method=Method.QLORA, quant=QuantSpec(double_quant=dq))
            yield "dora", model, dict(method=Method.LORA, lora=LoraSpec(dora=True))
            yield "dora qlora", model, dict(method=Method.QLORA, lora=LoraSpec(dora=True))
            save = ("embed_tokens", "lm_head")
            yield "lora modules_to_save", model, dict(method=Method.LORA, lora=LoraSpec(modules_to_save=save))
            for n in (1, 4):
                yield f"freeze {n} layers", model, dict(method=Method.FREEZE, freeze_trainable_layers=n)
    elif group == "losses":
        for loss in (Loss.CHUNKED, Loss.CHUNKED_NLL, Loss.FUSED):
            for method in (Method.FULL, Method.LORA, Method.QLORA):
                yield f"{loss.value} {method.value}", small, dict(method=method, loss=loss)
    elif group == "optimizers":
        for opt in (
            Optimizer.ADAFACTOR,
            Optimizer.SGD,
            Optimizer.ADAMW_8BIT,
            Optimizer.PAGED_ADAMW_8BIT,
            Optimizer.PAGED_ADAMW_32BIT,
            Optimizer.ADAMW_FUSED,
        ):
            for method in (Method.FULL, Method.LORA):
                yield f"{opt.value} {method.value}", small, dict(method=method, optimizer=opt)
    elif group == "models":
        for model in ("qwen3-30b-a3b", "mixtral-8x7b", "gemma-2-2b", "phi-3-mini-4k", "gpt2", "deepseek-v2-lite"):
            for method in (Method.LORA, Method.QLORA):
                yield f"{method.value}", model, dict(method=method)
        yield "full", "gpt2", dict(method=Method.FULL)
        yield "full", "gemma-2-2b", dict(method=Method.FULL)
        for model in ("qwen2.5-vl-7b", "qwen3-vl-4b"):
            yield "lora images=1", model, dict(method=Method.LORA, images=1)
    elif group == "distributed":
        yield from _distributed(small)
    elif group == "dense":  # where the session-30 falls were found: small dense models, fp32 among the precisions
        for model in ("qwen2.5-0.5b", "llama-3.2-1b", "qwen3-0.6b", "gemma-3-1b", "qwen2.5-1.5b", "llama-3.2-3b"):
            for method in (Method.FULL, Method.LORA, Method.FREEZE):
                yield method.value, model, dict(method=method)
                yield f"{method.value} fp32", model, dict(method=method, precision=Precision.FP32)
    elif group == "eval":
        for method in (Method.FULL, Method.LORA):
            yield f"eval {method.value}", small, dict(method=method, eval_logits=EvalLogits.FULL)
            yield f"eval argmax {method.value}", small, dict(method=method, eval_logits=EvalLogits.ARGMAX)
            yield (
                f"generate {method.value}",
                small,
                dict(method=method, predict_with_generate=True, generation_max_new_tokens=128),
            )


def _distributed(model: str) -> Iterator[Setup]:
    for method in (Method.FULL, Method.LORA):
        yield f"ddp {method.value}", model, dict(method=method, world_size=4)
        for version in (1, 2):
            for sharding in (Sharding.FULL_SHARD, Sharding.SHARD_GRAD_OP):
                yield (
                    f"fsdp{version} {sharding.value} {method.value}",
                    model,
                    dict(method=method, world_size=4, fsdp=sharding, fsdp_version=version),
                )
        for stage in (1, 2, 3):
            yield f"zero{stage} {method.value}", model, dict(method=method, world_size=4, zero_stage=stage)
            yield (
                f"zero{stage} offload-opt {method.value}",
                model,
                dict(method=method, world_size=4, zero_stage=stage, offload_optimizer=True),
            )
        yield (
            f"zero3 offload-param {method.value}",
            model,
            dict(method=method, world_size=4, zero_stage=3, offload_optimizer=True, offload_params=True),
        )


def _variants(fields: dict[str, Any]) -> Iterator[dict[str, Any]]:
    precisions = (fields["precision"],) if "precision" in fields else (Precision.BF16_MIXED, Precision.BF16)
    for precision in precisions:
        for ckpt in (False, True):
            for attn in (Attention.SDPA, Attention.EAGER):
                yield dict(fields, precision=precision, grad_ckpt=ckpt, attn=attn)


def _eval_shape(fields: dict[str, Any], batch: int, length: int) -> dict[str, Any]:
    """Evaluation setups sweep the eval shape at a fixed training shape."""
    if "eval_logits" in fields or "predict_with_generate" in fields:
        return dict(fields, micro_batch=1, seq_len=256, eval_batch=batch, eval_seq_len=length)
    return dict(fields, micro_batch=batch, seq_len=length)


def sweep_shapes(setups: Iterator[Setup], step: int, report: Callable[[str], None]) -> int:
    """Steps the length at each batch, and the batch at a few lengths; returns the number of findings."""
    found = 0
    models: dict[str, ModelSpec] = {}
    for label, name, fields in setups:
        model = models.setdefault(name, resolve_model(name))
        for variant in _variants(fields):
            tag = f"{name} {label} {variant['precision'].value} ckpt={variant['grad_ckpt']} {variant['attn'].value}"
            max_tokens = 8192 if variant["attn"] is Attention.SDPA else 4096
            try:
                found += _sweep_one(model, tag, variant, step, max_tokens, report)
            except Exception as e:  # a setup the estimate refuses is a finding of its own
                report(f"ERROR {tag}: {type(e).__name__}: {e}")
                found += 1
    return found


def _at(model: ModelSpec, fields: dict[str, Any], batch: int, length: int, phases: tuple[Phase, ...]) -> Any:
    led = estimate(model, TrainSpec(**_eval_shape(fields, batch, length)))
    return _figures(led, phases)


def _sweep_one(
    model: ModelSpec, tag: str, fields: dict[str, Any], step: int, max_tokens: int, report: Callable[[str], None]
) -> int:
    found = 0
    evals = "eval_logits" in fields or "predict_with_generate" in fields
    phases = AFTER if evals else TRAIN
    rng = random.Random(tag)
    for batch in BATCHES:
        prev: tuple[int, Any] | None = None
        for length in range(rng.randint(1, step), max_tokens // batch + 1, step):
            now = _at(model, fields, batch, length, phases)
            if prev is not None and now is not None:
                found += _compare(f"{tag} B={batch} L {prev[0]}->{length}", prev[1], now, report)
            if not evals and now is not None and length % 3 == 0:
                found += _packed(model, fields, batch, length, now, tag, report)
            prev = (length, now)
    for length in (rng.randint(64, 512), rng.randint(512, 2048)):
        prev = None
        for batch in range(1, 9):
            now = _at(model, fields, batch, length, phases)
            if prev is not None and now is not None:
                found += _compare(f"{tag} L={length} B {prev[0]}->{batch}", prev[1], now, report)
            prev = (batch, now)
    return found


def _compare(
    where: str, before: tuple[int, int, int], after: tuple[int, int, int], report: Callable[[str], None]
) -> int:
    found = 0
    for name, a, b in zip(("allocated", "reserved", "device"), before, after, strict=True):
        if b < a:
            report(f"FALL {name} {where}: {a / 2**20:.1f} -> {b / 2**20:.1f} MiB ({(b - a) / 2**20:+.1f})")
            found += 1
    return found


def _packed(
    model: ModelSpec,
    fields: dict[str, Any],
    batch: int,
    length: int,
    padded: tuple[int, int, int],
    tag: str,
    report: Callable[[str], None],
) -> int:
    packed = _at(model, dict(fields, packing=True), batch, length, TRAIN)
    if packed is not None and packed[1] > padded[1]:
        report(
            f"PACKED {tag} B={batch} L={length}: packed reserved {packed[1] / 2**20:.1f} > padded "
            f"{padded[1] / 2**20:.1f} MiB"
        )
        return 1
    return 0


def sweep_world(report: Callable[[str], None]) -> int:
    """Rank 0's allocated as the world size of a sharded setup grows (more ranks never hold more of a shard)."""
    found = 0
    model = resolve_model("qwen2.5-1.5b")
    for _, _, fields in _distributed("qwen2.5-1.5b"):
        if fields.get("fsdp") is None and not fields.get("zero_stage"):
            continue
        for batch, length in ((1, 512), (4, 2048)):
            prev: tuple[int, Any] | None = None
            for world in (1, 2, 3, 4, 6, 8, 12, 16, 32, 64):
                led = estimate(model, TrainSpec(**dict(fields, world_size=world, micro_batch=batch, seq_len=length)))
                now = _figures(led, TRAIN)
                if prev is not None and now is not None:
                    tag = f"{fields} {batch}x{length} world {prev[0]}->{world}"
                    # the device total adds NCCL's communicators, which do grow with the ranks: not checked here
                    for name, a, b in zip(("allocated", "reserved"), prev[1][:2], now[:2], strict=True):
                        if b > a:
                            report(f"WORLD {name} {tag}: {a / 2**20:.1f} -> {b / 2**20:.1f} MiB")
                            found += 1
                prev = (world, now)
    return found


GROUPS = ("dense", "methods", "losses", "optimizers", "models", "distributed", "eval", "world")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", choices=(*GROUPS, "all"), default="all")
    parser.add_argument("--step", type=int, default=97, help="length step (a prime spreads the lengths)")
    parser.add_argument("--model", default="qwen2.5-0.5b", help="the model of the groups that do not name their own")
    args = parser.parse_args()
    for group in GROUPS if args.group == "all" else (args.group,):
        found = sweep_world(print) if group == "world" else sweep_shapes(_setups(group, args.model), args.step, print)
        print(f"{group}: {found} findings", flush=True)


if __name__ == "__main__":
    main()
