"""fp32 full fine-tuning shapes whose attention runs SDPA's math kernel (grouped heads, no mask), traced and replayed:
the truth behind the written-out fp32 math layer (analytic/reserve/math_layer.py ``MathLayer``, replayed by spill.py's
two steps) beyond the grid of run_grid.py.

For each shape below (fp32, no checkpointing, SDPA, AdamW foreach or fused, every step B × L): trace two steps
(``vramledger.trace``) and replay the device events through the caching-allocator model on an unlimited device, as
run_grid.py does; written out: the replay's peak reserved and allocated, reserved at the end of step 1, the bytes of
the segments step 2 makes, and the segments step 1 makes of one length² block's size (4·nh·L² per sequence: the math
kernel's scores and masked scores). tests/analytic/test_reserve_math_layer.py holds the packed estimate and the two
steps replayed against them.

Run:  nice -n 10 python bench/reserve/run_fp32_math.py   # ~20 s a shape on a shared CPU; written shapes kept
Output: bench/reserve/fp32_math.jsonl (bytes).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "src"))
sys.path.insert(0, str(HERE))

import run_grid  # noqa: E402

from vramledger.catalog import resolve_model  # noqa: E402
from vramledger.specs import Method, ModelSpec, Optimizer, Precision, TrainSpec  # noqa: E402

OUT = HERE / "fp32_math.jsonl"
# (model, optimizer, micro-batch, length): the grid's Qwen2.5-0.5B 2 × 1024 and the shapes around it, Qwen3-0.6B,
# Qwen2.5-1.5B and Llama-3.2-1B (whose layers are written out where T ≥ H: below, its MLP tensors fit no activation)
SHAPES: tuple[tuple[str, str, int, int], ...] = (
    ("qwen2.5-0.5b", "adamw_torch", 2, 1024),
    ("qwen2.5-0.5b", "adamw_torch", 1, 1024),
    ("qwen2.5-0.5b", "adamw_torch", 2, 512),
    ("qwen2.5-0.5b", "adamw_torch", 4, 512),
    ("qwen2.5-0.5b", "adamw_torch", 8, 256),
    ("qwen2.5-0.5b", "adamw_torch", 1, 2048),
    ("qwen2.5-0.5b", "adamw_torch", 4, 1024),
    ("qwen2.5-0.5b", "adamw_torch", 2, 2048),
    ("qwen2.5-0.5b", "adamw_torch", 3, 700),
    ("qwen2.5-0.5b", "adamw_torch", 1, 4096),
    ("qwen2.5-0.5b", "adamw_torch_fused", 2, 1024),
    ("qwen3-0.6b", "adamw_torch", 1, 1024),
    ("qwen3-0.6b", "adamw_torch", 2, 1024),
    ("qwen3-0.6b", "adamw_torch", 4, 512),
    ("qwen2.5-1.5b", "adamw_torch", 1, 2048),
    ("llama-3.2-1b", "adamw_torch", 1, 2048),
    ("llama-3.2-1b", "adamw_torch", 2, 2048),
    ("llama-3.2-1b", "adamw_torch", 4, 1024),
)


def shape_id(model: str, optimizer: str, b: int, ell: int) -> str:
    return f"{model}/full/b{b}/L{ell}/nockpt/sdpa/fp32/{optimizer}/packed"


def train_spec(optimizer: str, b: int, ell: int) -> TrainSpec:
    return TrainSpec(
        method=Method.FULL,
        precision=Precision.FP32,
        optimizer=Optimizer(optimizer),
        micro_batch=b,
        seq_len=ell,
        grad_ckpt=False,
        packing=True,
    )


def measure(model: ModelSpec, train: TrainSpec) -> dict[str, Any]:
    """The replay of the traced two steps (run_grid.py ``replay_device``): its peaks, step 1's reserve, what step 2
    makes and step 1's length²-sized segments."""
    from vramledger.allocator.model import CachingAllocatorModel

    alloc = CachingAllocatorModel()
    # one length² block as the allocator rounds it (a multiple of 512 bytes, ``round_size``)
    scores = -(-4 * model.num_heads * train.seq_len**2 * train.micro_batch // 512) * 512
    end_of_step_1, step2_made, scores_segments = None, 0, 0
    for _, step, blk, new in run_grid.replay_device(model, train, None, alloc):
        if step == 2 and end_of_step_1 is None:
            end_of_step_1 = alloc.reserved
        if blk is not None and new:
            step2_made += new if step == 2 else 0
            scores_segments += int(step == 1 and blk.size == scores)
    return {
        "replay_peak_reserved": alloc.peak_reserved,
        "replay_peak_allocated": alloc.peak_allocated,
        "reserved_end_of_step_1": end_of_step_1,
        "made_in_step_2": step2_made,
        "step_1_scores_segments": scores_segments,
    }


def main() -> None:
    known = set()
    if OUT.exists():
        known = {json.loads(line)["id"] for line in OUT.read_text().splitlines()}
    for model, optimizer, b, ell in SHAPES:
        sid = shape_id(model, optimizer, b, ell)
        if sid in known:
            continue
        rec = {
            "id": sid,
            "model": model,
            "optimizer": optimizer,
            "micro_batch": b,
            "seq_len": ell,
            **measure(resolve_model(model), train_spec(optimizer, b, ell)),
        }
        with OUT.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(sid, f"{rec['replay_peak_reserved'] / 2**30:.2f} GiB reserved", flush=True)


if __name__ == "__main__":
    main()
