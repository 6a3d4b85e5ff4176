"""Time the batch × length frontier search against a brute-force scan of the same 64 × 64 grid.

Run from the repository root: ``PYTHONPATH=src python bench/plan_bench.py``. Each figure is the best of
``REPEATS`` runs with the estimate cache cleared before each (a cold search).
"""

from __future__ import annotations

import dataclasses
import time

from vramledger.catalog import resolve_gpu, resolve_model
from vramledger.plan import memo
from vramledger.plan.frontier import frontier
from vramledger.specs import Method, TrainSpec

REPEATS = 3
GRID = 64
G = 128  # granularity: lengths 128 … 8192

CASES = [
    ("llama-3-8b LoRA, ckpt, rtx-4090", "llama-3-8b", "rtx-4090", TrainSpec(method=Method.LORA, grad_ckpt=True)),
    (
        "qwen2.5-0.5b full, ckpt, h100 (frontier spans the grid)",
        "qwen2.5-0.5b",
        "h100-sxm",
        TrainSpec(method=Method.FULL, grad_ckpt=True),
    ),
]


def _best(fn) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    best, out = float("inf"), None
    for _ in range(REPEATS):
        memo.ledger.cache_clear()
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    for title, name, gpu_name, train in CASES:
        m, gpu = resolve_model(name), resolve_gpu(gpu_name)
        t_search, f = _best(
            lambda m=m, gpu=gpu, train=train: frontier(
                m, train, gpu, 0.08, max_batch=GRID, granularity=G, max_len=GRID * G
            )
        )

        def brute(m=m, gpu=gpu, train=train) -> int:  # type: ignore[no-untyped-def]
            n = 0
            for b in range(1, GRID + 1):
                for k in range(1, GRID + 1):
                    n += memo.fits(m, dataclasses.replace(train, micro_batch=b, seq_len=k * G), gpu, 0.08)
            return n

        t_brute, _ = _best(brute)
        print(
            f"{title}: frontier {t_search * 1e3:.0f} ms ({f.evaluations} estimates, {len(f.points)} batches fit);"  # type: ignore[attr-defined]
            f" brute-force 64x64 = 4096 estimates {t_brute * 1e3:.0f} ms"
        )


if __name__ == "__main__":
    main()
