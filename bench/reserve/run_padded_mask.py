"""Padded batches traced with their attention mask, against the padded estimate (docs/reserve.md "The padded batch
traced with its mask").

The estimate of a padded run (batch > 1, SDPA, not packed) prices the worst padded batch: transformers' 4-D boolean
mask, ``repeat_kv``'s copies of K and V, and the additive mask each layer's SDPA makes of it
(analytic/activations.py). The grid's references (run_grid.py ``trace_figures``) trace the packed single shape, which
builds none of these; here the same specs are traced as the padded batch the trace now feeds (trace/step.py
``padding_mask``: the last row ends in one pad token), and, for comparison, as the packed single shape.

Run:  nice -n 10 python bench/reserve/run_padded_mask.py            # traces the shapes missing from the JSONL
      python bench/reserve/run_padded_mask.py --table               # the markdown table, estimates recomputed
Output: bench/reserve/padded_mask.jsonl, one record per shape (bytes everywhere): ``padded`` and ``packed``, each the
trace replayed on an unlimited device (``replay_peak_allocated``: max_memory_allocated; ``replay_peak_reserved``:
max_memory_reserved, over both traced steps) and the trace ledger's ``peak_allocated``; ``padded_fine`` (the grid's
rows and those without checkpointing), the padded batch's replayed reserved at every L/32 from L/2 to L;
``estimate``, the padded estimate's peak allocated and reserved when the record was made (``--table`` recomputes
them with the code at hand).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run_grid import GPU, Row, analytic_figures, config_id, specs  # noqa: E402

from vramledger.specs import ModelSpec, TrainSpec  # noqa: E402

OUT = Path(__file__).with_name("padded_mask.jsonl")

# The grid's padded over-estimates attributed to the mask (docs/reserve.md "a padded batch's mask", and the 2-layer
# toy's full 2 × 4096), then small padded shapes that trace in seconds: full and LoRA, checkpointing on and off,
# K/V repeated 7× (Qwen2.5-0.5B), 4× (Llama-3.2-1B) and 2× (Qwen3-0.6B).
GRID_ROWS: list[Row] = [
    Row("qwen2.5-3b", "lora", 4, 2048, False, "sdpa"),
    Row("qwen3-1.7b", "full", 4, 2048, False, "sdpa", "bf16-true"),
    Row("tiny", "full", 2, 4096, False, "sdpa"),
]
ROWS: list[Row] = [
    *GRID_ROWS,
    Row("qwen2.5-0.5b", "full", 4, 512, False, "sdpa"),
    Row("llama-3.2-1b", "lora", 4, 1024, True, "sdpa"),
    Row("qwen3-0.6b", "lora", 2, 2048, True, "sdpa"),
]


def traced(model: ModelSpec, train: TrainSpec, cfg: dict[str, Any] | None) -> dict[str, Any]:
    """``trace_step`` of ``train`` as given (padded or packed), replayed on an unlimited device."""
    from vramledger.trace import trace_step

    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        led = trace_step(model, train, gpu=GPU, config=cfg)
    alloc = led.settings["allocator"]
    return {
        "seconds": round(time.perf_counter() - t0, 2),
        "replay_peak_allocated": alloc["peak_allocated_bytes"],
        "replay_peak_reserved": alloc["peak_reserved_bytes"],
        "peak_allocated": led.peak_allocated,
    }


def padded_fine(model: ModelSpec, train: TrainSpec, cfg: dict[str, Any] | None) -> dict[str, int]:
    """Reserved of the padded batch at every L/FINE from L/2 to L (run_runs.py's ``fine`` lengths, whose maximum
    with the sweep's is the packed run's ``envelope_fine``, the grid's "now vs the run's envelope")."""
    from run_runs import FINE

    step = train.seq_len // FINE
    lengths = range(train.seq_len // 2, train.seq_len + 1, step)
    return {str(n): traced(model, dataclasses.replace(train, seq_len=n), cfg)["replay_peak_reserved"] for n in lengths}


def measure(row: Row) -> dict[str, Any]:
    model, train, cfg = specs(row)
    assert not train.packing and train.micro_batch > 1, "a padded batch"
    a = analytic_figures(model, train)
    rec = {
        "id": config_id(row),
        "padded": traced(model, train, cfg),
        "packed": traced(model, dataclasses.replace(train, packing=True), cfg),
        "estimate": {"peak_allocated": a["peak_allocated"], "peak_reserved": a["peak_reserved"]},
    }
    if row in GRID_ROWS or not row.ckpt:
        rec["padded_fine"] = padded_fine(model, train, cfg)
    return rec


def table(records: list[dict[str, Any]]) -> str:
    """Allocated: the estimate's peak against the padded trace ledger's (the same lines at each phase's peak;
    max_memory_allocated adds block rounding and workspaces). Reserved: against the padded single shape at L, the
    most the padded batch reserves at any recorded length ≤ L (``padded_fine``: a dynamic-padding run's envelope,
    as ``envelope_fine`` is the packed run's) and the packed single shape (the grid's reference)."""
    gib = 2**30

    def pct(x: int, ref: int, digits: int = 1) -> str:
        return f"{100 * (x / ref - 1):+.{digits}f}%"

    rows = [
        "| config | estimate alloc GiB | padded trace alloc (vs) | packed trace alloc (vs) | estimate reserved GiB "
        "| padded at L (vs) | padded envelope (vs) | packed at L (vs) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by_id = {r["id"]: r for r in records}
    for row in ROWS:
        rec = by_id.get(config_id(row))
        if rec is None:
            continue
        model, train, _ = specs(row)
        a = analytic_figures(model, train)
        pad, pk = rec["padded"], rec["packed"]
        fine = rec.get("padded_fine", {})
        env = max([pad["replay_peak_reserved"], *fine.values()])
        env_at = max(fine, key=lambda n: fine[n]) if fine and env > pad["replay_peak_reserved"] else str(row.seq)
        rows.append(
            f"| {rec['id']} | {a['peak_allocated'] / gib:.2f} "
            f"| {pad['peak_allocated'] / gib:.2f} ({pct(a['peak_allocated'], pad['peak_allocated'], 2)}) "
            f"| {pk['peak_allocated'] / gib:.2f} ({pct(a['peak_allocated'], pk['peak_allocated'])}) "
            f"| {a['peak_reserved'] / gib:.2f} "
            f"| {pad['replay_peak_reserved'] / gib:.2f} ({pct(a['peak_reserved'], pad['replay_peak_reserved'])}) "
            + (f"| {env / gib:.2f} at {env_at} ({pct(a['peak_reserved'], env)}) " if fine else "| — ")
            + f"| {pk['replay_peak_reserved'] / gib:.2f} ({pct(a['peak_reserved'], pk['replay_peak_reserved'])}) |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", action="store_true", help="print the markdown table of the recorded shapes")
    args = ap.parse_args()
    known = [json.loads(line) for line in OUT.read_text().splitlines()] if OUT.exists() else []
    if args.table:
        print(table(known))
        return
    done = {r["id"] for r in known}
    for row in ROWS:
        if config_id(row) in done:
            continue
        rec = measure(row)
        with OUT.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(rec["id"], rec["padded"], rec["estimate"], flush=True)


if __name__ == "__main__":
    main()
