"""Packed runs of the optimizer configs with checkpointing, at the grid's shapes and beyond: the single-shape replay of
the traced step against the packed estimate (docs/reserve.md "Packed runs: optimizers without step temporaries under
checkpointing, and Adafactor's fourth temporary").

Run:  nice -n 10 python bench/reserve/run_packed_optimizers.py   # prints a markdown table (10 to 40 s a shape)
Each row traces two steps (``run_grid.trace_figures``: the events replayed through the caching-allocator model on an
unlimited device) and estimates the same specs with ``packing`` (every step B × L: that one shape's reserve).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run_grid import CUSTOM, analytic_figures, trace_figures  # noqa: E402

from vramledger.catalog import resolve_model  # noqa: E402
from vramledger.specs import Attention, Method, Optimizer, Precision, TrainSpec  # noqa: E402

# (model, optimizer, precision, micro-batch, length): the grid's two configs at their shape (the first of each), then
# the shapes that tell where each mechanism is on.
SHAPES = [
    ("llama-3.2-1b", "sgd", "bf16-mixed", 2, 1024),
    ("llama-3.2-1b", "sgd", "bf16-mixed", 1, 2048),
    ("llama-3.2-1b", "sgd", "fp16-mixed", 4, 512),
    ("llama-3.2-1b", "sgd", "bf16-mixed", 2, 512),
    ("llama-3.2-1b", "sgd", "bf16-mixed", 2, 768),
    ("llama-3.2-1b", "sgd", "bf16-mixed", 2, 1448),
    ("llama-3.2-1b", "sgd", "bf16-mixed", 2, 1720),
    ("llama-3.2-1b", "adamw_torch_fused", "bf16-mixed", 2, 1024),
    ("qwen2.5-0.5b", "sgd", "bf16-mixed", 4, 1024),
    ("qwen2.5-0.5b", "sgd", "bf16-mixed", 4, 800),
    ("qwen3-0.6b", "sgd", "bf16-mixed", 1, 1024),
    ("qwen3-0.6b", "sgd", "bf16-mixed", 2, 1024),
    ("qwen3-0.6b", "sgd", "bf16-mixed", 4, 1024),
    ("llama-3.2-3b", "sgd", "bf16-mixed", 1, 1024),
    ("llama-3.2-1b", "adafactor", "bf16-true", 2, 2048),
    ("llama-3.2-1b", "adafactor", "bf16-true", 1, 4096),
    ("llama-3.2-1b", "adafactor", "bf16-true", 2, 2176),
    ("llama-3.2-1b", "adafactor", "bf16-true", 2, 2304),
    ("llama-3.2-1b", "adafactor", "bf16-true", 2, 2560),
]


def main() -> None:
    print("| model | optimizer | precision | shape | replay reserved GiB | packed estimate GiB | gap |")
    print("|---|---|---|---|---:|---:|---:|")
    for name, opt, precision, b, ell in SHAPES:
        assert name not in CUSTOM
        model = resolve_model(name)
        train = TrainSpec(
            method=Method.FULL,
            optimizer=Optimizer(opt),
            precision=Precision(precision),
            micro_batch=b,
            seq_len=ell,
            grad_ckpt=True,
            attn=Attention.SDPA,
        )
        replay = trace_figures(model, train, None)["replay_peak_reserved"]
        packed = analytic_figures(model, dataclasses.replace(train, packing=True))["peak_reserved"]
        print(
            f"| {name} | {opt} | {precision} | {b} × {ell} | {replay / 2**30:.2f} | {packed / 2**30:.2f} "
            f"| {packed / replay - 1:+.1%} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
