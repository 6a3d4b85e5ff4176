"""Packed full fine-tuning shapes without checkpointing, traced and replayed: the truth behind the two steps replayed
(analytic/reserve/spill.py ``displaced_remade``, ``two_steps_reserve``) beyond the grid of run_grid.py.

For each shape below (bf16-true or bf16-mixed, AdamW foreach or fused, SDPA, every step B × L): trace two steps
(``vramledger.trace``) and replay them through the caching-allocator model on an unlimited device, as run_grid.py does;
written out: the replay's peak reserved and peak allocated. tests/analytic/test_reserve_displaced.py holds the packed
estimate against them.

Run:  nice -n 10 python bench/reserve/run_two_steps.py   # ~10 s a shape on a shared CPU; written shapes kept
Output: bench/reserve/two_steps.jsonl (bytes).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "src"))
sys.path.insert(0, str(HERE))

import run_grid  # noqa: E402

from vramledger.catalog import resolve_model  # noqa: E402
from vramledger.specs import Method, Optimizer, Precision, TrainSpec  # noqa: E402

OUT = HERE / "two_steps.jsonl"
# (model, precision, optimizer, micro-batch, length)
SHAPES: tuple[tuple[str, str, str, int, int], ...] = (
    ("llama-3.2-1b", "bf16-true", "adamw_torch", 4, 900),
    ("llama-3.2-1b", "bf16-true", "adamw_torch", 2, 2048),
    ("llama-3.2-1b", "bf16-true", "adamw_torch", 8, 768),
    ("llama-3.2-1b", "bf16-mixed", "adamw_torch", 8, 1024),
    ("qwen2.5-1.5b", "bf16-true", "adamw_torch", 4, 1024),
    ("qwen2.5-1.5b", "bf16-true", "adamw_torch", 8, 700),
    ("qwen2.5-1.5b", "bf16-true", "adamw_torch", 2, 4096),
    ("qwen2.5-1.5b", "bf16-true", "adamw_torch", 5, 2100),
    ("qwen2.5-1.5b", "bf16-true", "adamw_torch", 5, 2277),
    ("qwen2.5-1.5b", "bf16-true", "adamw_torch", 5, 2405),
    ("qwen3-1.7b", "bf16-true", "adamw_torch", 2, 2048),
    ("qwen3-1.7b", "bf16-true", "adamw_torch", 4, 1500),
    ("qwen3-1.7b", "bf16-mixed", "adamw_torch", 4, 2048),
    ("llama-3.2-3b", "bf16-true", "adamw_torch", 4, 1024),
    ("llama-3.2-3b", "bf16-true", "adamw_torch", 2, 2048),
    ("qwen2.5-0.5b", "bf16-true", "adamw_torch", 8, 1024),
    ("qwen2.5-0.5b", "bf16-true", "adamw_torch", 4, 2048),
    ("qwen2.5-0.5b", "bf16-true", "adamw_torch", 7, 1015),
    ("qwen2.5-0.5b", "bf16-mixed", "adamw_torch", 4, 2048),
    ("qwen3-0.6b", "bf16-true", "adamw_torch", 8, 1024),
    ("qwen3-4b", "bf16-true", "adamw_torch", 2, 2048),
    # around Qwen3-4B's edges (docs/reserve.md, "States in every MLP segment beyond Qwen2.5-1.5B"): the rest beside an
    # MLP gradient holds no k state after a q state (T = 3800), holds both (3968), holds no MLP state (5000) and does
    # (5120); bf16-mixed at 2 × 2048 (the autocast layer); Qwen3-8B at 8192 tokens
    ("qwen3-4b", "bf16-true", "adamw_torch", 2, 1900),
    ("qwen3-4b", "bf16-true", "adamw_torch", 1, 3968),
    ("qwen3-4b", "bf16-true", "adamw_torch", 2, 2500),
    ("qwen3-4b", "bf16-true", "adamw_torch", 2, 2560),
    ("qwen3-4b", "bf16-mixed", "adamw_torch", 2, 2048),
    ("qwen3-8b", "bf16-true", "adamw_torch", 1, 8192),
    # bf16-mixed shapes whose estimate the autocast layer (amp_layer.py) moved most in a random sweep of 150
    ("qwen2.5-1.5b", "bf16-mixed", "adamw_torch", 4, 2232),
    ("qwen3-1.7b", "bf16-mixed", "adamw_torch", 3, 1419),
    ("llama-3.2-3b", "bf16-mixed", "adamw_torch", 8, 3136),
    ("mistral-7b-v0.3", "bf16-mixed", "adamw_torch", 8, 1317),
    # shapes where leaving the c·V·T hole to the replay (shape.py, term 7) lowered the packed estimate most
    ("llama-3.2-1b", "bf16-true", "adamw_torch", 7, 3821),
    ("qwen2.5-1.5b", "bf16-true", "adamw_torch", 8, 3436),
    ("qwen2.5-0.5b", "bf16-mixed", "adamw_torch", 8, 2631),
    ("llama-3.2-1b", "bf16-true", "adamw_torch_fused", 4, 1024),
    ("qwen2.5-1.5b", "bf16-true", "adamw_torch_fused", 8, 512),
    ("qwen3-1.7b", "bf16-true", "adamw_torch_fused", 4, 2048),
    ("llama-3.2-3b", "bf16-true", "adamw_torch_fused", 4, 768),
    ("qwen2.5-0.5b", "bf16-true", "adamw_torch_fused", 8, 1024),
    # the residual stream's requests under 10 MiB (c·H·T < kMinLargeAlloc: they share 20 MiB segments), replayed once
    # each layer's input lives to the layer's end (docs/reserve.md, "Under 10 MiB")
    ("qwen2.5-0.5b", "bf16-true", "adamw_torch", 4, 512),
    ("qwen2.5-0.5b", "bf16-true", "adamw_torch", 2, 1024),
    ("qwen2.5-0.5b", "bf16-true", "adamw_torch", 8, 256),
    ("qwen2.5-0.5b", "bf16-true", "adamw_torch", 1, 1024),
    ("qwen2.5-0.5b", "bf16-true", "adamw_torch", 5, 1000),
    ("qwen2.5-0.5b", "bf16-true", "adamw_torch_fused", 4, 512),
    ("qwen2.5-0.5b", "bf16-mixed", "adamw_torch", 4, 512),
    ("qwen2.5-0.5b", "bf16-mixed", "adamw_torch", 2, 1024),
    ("qwen2.5-0.5b", "bf16-mixed", "adamw_torch", 8, 256),
    ("qwen3-0.6b", "bf16-true", "adamw_torch", 2, 1024),
    ("llama-3.2-1b", "bf16-true", "adamw_torch", 1, 1024),
    ("llama-3.2-1b", "bf16-true", "adamw_torch", 2, 1024),
    ("llama-3.2-1b", "bf16-true", "adamw_torch", 4, 512),
    ("llama-3.2-1b", "bf16-mixed", "adamw_torch", 2, 1024),
    ("llama-3.2-1b", "bf16-mixed", "adamw_torch", 1, 1024),
    ("qwen3-0.6b", "bf16-mixed", "adamw_torch", 2, 1024),
    ("qwen2.5-0.5b", "bf16-true", "adamw_torch", 2, 512),
    ("qwen2.5-0.5b", "bf16-true", "adamw_torch", 1, 256),
    ("qwen2.5-0.5b", "bf16-mixed", "adamw_torch", 1, 512),
    # the shape where Qwen3-1.7B bf16-true 4 × 2048's padded envelope peaks (tests/analytic/test_reserve.py)
    ("qwen3-1.7b", "bf16-true", "adamw_torch", 4, 1920),
    # Gemma 3's layer written out (analytic/reserve/gemma_layer.py; docs/reserve.md, "Gemma 3's layer"): the grid's
    # shape, the sliding window's edge (L = 512), one sequence of 4096 tokens (the sliding layers' L² masks), and
    # shapes the MLP-fit condition leaves to the closed forms (1 × 1024, 2 × 1024 bf16-mixed)
    ("gemma-3-1b", "bf16-true", "adamw_torch", 4, 1024),
    ("gemma-3-1b", "bf16-true", "adamw_torch", 2, 1024),
    ("gemma-3-1b", "bf16-true", "adamw_torch", 4, 512),
    ("gemma-3-1b", "bf16-true", "adamw_torch", 8, 512),
    ("gemma-3-1b", "bf16-true", "adamw_torch", 2, 2048),
    ("gemma-3-1b", "bf16-true", "adamw_torch", 1, 2048),
    ("gemma-3-1b", "bf16-true", "adamw_torch", 1, 4096),
    ("gemma-3-1b", "bf16-true", "adamw_torch", 1, 1024),
    ("gemma-3-1b", "bf16-mixed", "adamw_torch", 4, 1024),
    ("gemma-3-1b", "bf16-mixed", "adamw_torch", 4, 512),
    ("gemma-3-1b", "bf16-mixed", "adamw_torch", 2, 2048),
    ("gemma-3-1b", "bf16-mixed", "adamw_torch", 2, 1024),
    ("gemma-3-1b", "bf16-mixed", "adamw_torch", 1, 1024),
)


def shape_id(model: str, precision: str, optimizer: str, b: int, ell: int) -> str:
    return f"{model}/full/b{b}/L{ell}/nockpt/sdpa/{precision}/{optimizer}/packed"


def train_spec(precision: str, optimizer: str, b: int, ell: int) -> TrainSpec:
    return TrainSpec(
        method=Method.FULL,
        precision=Precision(precision),
        optimizer=Optimizer(optimizer),
        micro_batch=b,
        seq_len=ell,
        grad_ckpt=False,
        packing=True,
    )


def main() -> None:
    known = set()
    if OUT.exists():
        known = {json.loads(line)["id"] for line in OUT.read_text().splitlines()}
    for model, precision, optimizer, b, ell in SHAPES:
        sid = shape_id(model, precision, optimizer, b, ell)
        if sid in known:
            continue
        figures = run_grid.trace_figures(resolve_model(model), train_spec(precision, optimizer, b, ell), None)
        rec = {
            "id": sid,
            "model": model,
            "precision": precision,
            "optimizer": optimizer,
            "micro_batch": b,
            "seq_len": ell,
            "replay_peak_reserved": figures["replay_peak_reserved"],
            "replay_peak_allocated": figures["replay_peak_allocated"],
        }
        with OUT.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(sid, f"{rec['replay_peak_reserved'] / 2**30:.2f} GiB reserved", flush=True)


if __name__ == "__main__":
    main()
