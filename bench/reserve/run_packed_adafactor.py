"""Packed runs of full fine-tuning with transformers' Adafactor: the single-shape replay of the traced step, where the
tied gradients' sum lands and how many segments step 1's optimizer makes for its fp32 temporaries, against the
packed estimate (docs/reserve.md "Adafactor: the tied gradients' sum and the backward workspace").

Run:  nice -n 10 python bench/reserve/run_packed_adafactor.py            # traces the shapes missing from the JSONL
      python bench/reserve/run_packed_adafactor.py --table               # the markdown table, estimates recomputed
Output: bench/reserve/packed_adafactor.jsonl, one record per shape (bytes everywhere): ``replay_reserved`` (the trace
replayed through the caching-allocator model on an unlimited device, ``run_grid.trace_figures``), and from a replay of
the same events (``run_grid.replay_device``): ``sum_in`` (which step-1 loss block AccumulateGrad's out-of-place sum of
the tied head's and embedding's gradients is cut from: ``_to_copy`` is the fp32 copy's, ``_log_softmax`` the next one;
``other`` outside the chain), ``optimizer_segments_step_1`` (bytes of the large-pool segments step 1's
``optimizer.step()`` makes: its states are small-pool vectors) and ``made_in_step_2`` (bytes of every segment step
2 makes). The estimates are not stored: ``--table`` computes them with the code at hand.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run_grid import analytic_figures, replay_device, trace_figures  # noqa: E402

from vramledger.catalog import resolve_model  # noqa: E402
from vramledger.specs import Attention, Method, ModelSpec, Optimizer, Precision, TrainSpec  # noqa: E402

OUT = Path(__file__).with_name("packed_adafactor.jsonl")

# (model, precision, micro-batch, length, checkpointing): the grid's config and the shapes around it, where the fp32
# logits block 4·V·T is 2 to 2.5 times the 16-bit V·H gradient (the tied sum's band), the short shapes of the brief
# (1 × 1024, 2 × 1024, 4 × 512), and models whose tied embedding is smaller (Qwen2.5-0.5B, Qwen3-0.6B) or larger
# (Llama-3.2-3B) against their layers' gradients.
SHAPES: list[tuple[str, str, int, int, bool]] = [
    ("llama-3.2-1b", "bf16-true", 2, 2048, True),
    ("llama-3.2-1b", "bf16-true", 1, 4096, True),
    ("llama-3.2-1b", "bf16-true", 4, 1024, True),
    ("llama-3.2-1b", "bf16-true", 2, 2176, True),
    ("llama-3.2-1b", "bf16-true", 2, 2240, True),
    ("llama-3.2-1b", "bf16-true", 2, 2304, True),
    ("llama-3.2-1b", "bf16-true", 2, 2560, True),
    ("llama-3.2-1b", "bf16-true", 1, 1024, True),
    ("llama-3.2-1b", "bf16-true", 2, 1024, True),
    ("llama-3.2-1b", "bf16-true", 4, 512, True),
    ("llama-3.2-1b", "bf16-mixed", 2, 1024, True),
    ("llama-3.2-1b", "bf16-mixed", 2, 2048, True),
    ("llama-3.2-1b", "bf16-true", 2, 1024, False),
    ("qwen2.5-0.5b", "bf16-true", 1, 1024, True),
    ("qwen2.5-0.5b", "bf16-true", 2, 1024, True),
    ("qwen2.5-0.5b", "bf16-true", 4, 512, True),
    ("qwen2.5-0.5b", "bf16-true", 1, 2048, True),
    ("qwen2.5-0.5b", "bf16-mixed", 2, 1024, True),
    ("qwen2.5-0.5b", "bf16-true", 2, 1024, False),
    ("qwen3-0.6b", "bf16-true", 2, 1024, True),
    ("qwen3-0.6b", "bf16-true", 1, 2304, True),
    ("llama-3.2-3b", "bf16-true", 1, 6144, True),
    ("llama-3.2-3b", "bf16-true", 1, 6656, True),
]


def shape_id(name: str, precision: str, b: int, ell: int, ckpt: bool) -> str:
    return f"{name}/full/b{b}/L{ell}/{'ckpt' if ckpt else 'nockpt'}/sdpa/{precision}/adafactor"


def specs(name: str, precision: str, b: int, ell: int, ckpt: bool) -> tuple[ModelSpec, TrainSpec]:
    train = TrainSpec(
        method=Method.FULL,
        optimizer=Optimizer.ADAFACTOR,
        precision=Precision(precision),
        micro_batch=b,
        seq_len=ell,
        grad_ckpt=ckpt,
        attn=Attention.SDPA,
        packing=True,
    )
    return resolve_model(name), train


def where_it_lands(model: ModelSpec, train: TrainSpec) -> dict[str, Any]:
    """One replay of the traced events: the loss block the tied sum is cut from, the segments step 1's optimizer and
    step 2 make."""
    from vramledger.allocator.model import CachingAllocatorModel

    alloc = CachingAllocatorModel()
    made_by: dict[int, str] = {}  # step 1's loss segments by the op that made them
    out: dict[str, Any] = {"sum_in": None, "optimizer_segments_step_1": 0, "made_in_step_2": 0}
    for ev, step, blk, new in replay_device(model, train, None, alloc):
        if blk is None:
            continue
        cat = ev.category.value if ev.category else ""
        if new and step == 1 and cat == "logits_loss":
            made_by[blk.seg] = ev.op
        if step == 1 and cat == "gradients" and ev.op == "add" and "embed_tokens" in ev.module:
            out["sum_in"] = made_by.get(blk.seg, "other")
        if new and step == 1 and ev.phase and ev.phase.value == "optimizer" and not blk.small:
            out["optimizer_segments_step_1"] += new
        if new and step == 2:
            out["made_in_step_2"] += new
    return out


def measure(name: str, precision: str, b: int, ell: int, ckpt: bool) -> dict[str, Any]:
    model, train = specs(name, precision, b, ell, ckpt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        replay = trace_figures(model, train, None)["replay_peak_reserved"]
        landed = where_it_lands(model, train)
    return {
        "id": shape_id(name, precision, b, ell, ckpt),
        "replay_reserved": replay,
        **landed,
    }


def table(records: list[dict[str, Any]]) -> str:
    rows = [
        "| shape | sum in | step 1 optimizer's segments GiB | replay GiB | packed estimate GiB | gap |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for rec in records:
        model, train = specs(*_key(rec["id"]))
        got = analytic_figures(model, train)["peak_reserved"]
        rows.append(
            f"| {rec['id']} | {rec['sum_in']} | {rec['optimizer_segments_step_1'] / 2**30:.2f} "
            f"| {rec['replay_reserved'] / 2**30:.2f} | {got / 2**30:.2f} | {got / rec['replay_reserved'] - 1:+.1%} |"
        )
    return "\n".join(rows)


def _key(cid: str) -> tuple[str, str, int, int, bool]:
    name, _, b, ell, ckpt, _, precision, _ = cid.split("/")
    return name, precision, int(b[1:]), int(ell[1:]), ckpt == "ckpt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", action="store_true", help="print the table from the JSONL (estimates recomputed)")
    args = ap.parse_args()
    done = [json.loads(line) for line in OUT.read_text().splitlines()] if OUT.exists() else []
    if args.table:
        print(table(done))
        return
    known = {rec["id"] for rec in done}
    for shape in SHAPES:
        if shape_id(*shape) in known:
            continue
        rec = measure(*shape)
        with OUT.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
