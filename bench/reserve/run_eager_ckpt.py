"""LoRA with eager attention under checkpointing: the trace replay's peak reserved at shapes where the length² blocks
outgrow the logits blocks, for tests/analytic/test_reserve_eager_ckpt.py (analytic/reserve/eager_ckpt.py).

For each shape: trace two training steps (``vramledger.trace``), replay the device events through the
caching-allocator model on an unlimited device (Hopper's cuBLAS workspaces, as run_grid.py), and record peak
allocated, peak reserved and the segments of 100 MiB or more the two steps made (step, phase, op, bytes): which of
the chain's blocks (eager's nh·ℓ² scores, the loss's V·T logits) needed a segment of its own.

Run:  nice -n 10 python bench/reserve/run_eager_ckpt.py        # traces what is missing (about 1 min a shape)
Output: bench/reserve/eager_ckpt.jsonl, one JSON object per shape (bytes everywhere).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "src"))
sys.path.insert(0, str(HERE))

import run_grid  # noqa: E402

OUT = HERE / "eager_ckpt.jsonl"
MiB = 2**20
# Llama-3.2-1B (32 heads, V = 128256): the fp32 logits (4·V·T) and the fp32 scores (4·nh·ℓ²·b) are equal at
# ℓ = V/nh ≈ 4008, the bf16 scores reach the fp32 logits at ℓ = 2·V/nh ≈ 8016.
SHAPES: tuple[run_grid.Row, ...] = (
    run_grid.Row("llama-3.2-1b", "lora", 2, 2048, True, "eager"),  # the logits blocks the larger
    run_grid.Row("llama-3.2-1b", "lora", 1, 4096, True, "eager"),  # the fp32 scores the larger
    run_grid.Row("llama-3.2-1b", "lora", 1, 8192, True, "eager"),  # the bf16 scores too
    run_grid.Row("llama-3.2-1b", "lora", 1, 4128, True, "eager"),  # the same at a length off 2 MiB steps
    run_grid.Row("llama-3.2-1b", "lora", 1, 2048, True, "eager"),  # saved inputs 8 MiB: under kMinLargeAlloc
    run_grid.Row("llama-3.2-1b", "lora", 1, 1024, True, "eager"),  # scores 64 MiB, saved inputs 4 MiB
    run_grid.Row("llama-3.2-1b", "lora", 2, 1024, True, "eager"),  # scores 128 MiB, saved inputs 8 MiB
    run_grid.Row("llama-3.2-1b", "lora", 1, 512, True, "eager"),  # scores 16 MiB, saved inputs 2 MiB
    run_grid.Row("llama-3.2-1b", "lora", 1, 448, True, "eager"),  # scores 12.25 MiB: just over kMinLargeAlloc
    run_grid.Row("qwen3-1.7b", "lora", 1, 1024, True, "eager"),  # 16 heads: scores 32 MiB, saved inputs 4 MiB
)


def measure(row: run_grid.Row) -> dict[str, Any]:
    from vramledger.allocator.model import CachingAllocatorModel

    model, train, cfg = run_grid.specs(row)
    t0 = time.perf_counter()
    alloc = CachingAllocatorModel()
    segments = []
    for ev, step, _, new in run_grid.replay_device(model, train, cfg, alloc):
        if new >= 100 * MiB:
            phase = ev.phase.value if ev.phase else ""
            segments.append({"step": step, "phase": phase, "op": ev.op, "bytes": new})
    return {
        "id": run_grid.config_id(row),
        "seconds": round(time.perf_counter() - t0, 1),
        "replay_peak_allocated": alloc.peak_allocated,
        "replay_peak_reserved": alloc.peak_reserved,
        "segments": segments,
    }


def main() -> None:
    known = set()
    if OUT.exists():
        known = {json.loads(line)["id"] for line in OUT.read_text().splitlines()}
    for row in SHAPES:
        if run_grid.config_id(row) in known:
            continue
        rec = measure(row)
        with OUT.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(rec["id"], rec["replay_peak_reserved"] / 2**30, flush=True)


if __name__ == "__main__":
    main()
