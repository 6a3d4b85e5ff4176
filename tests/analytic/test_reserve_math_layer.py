"""fp32 full fine-tuning whose attention runs SDPA's math kernel, without checkpointing: the layer written out
(analytic/reserve/math_layer.py ``MathLayer``) and the two steps spill.py replays with it, against the trace.

Truths used:
- bench/reserve/fp32_math.jsonl: real transformers steps traced on fake tensors (fp32, grouped heads, no mask, so
  SDPA's math kernel) and replayed through the allocator model (``python bench/reserve/run_fp32_math.py``; no tracing
  here): the replay's peak reserved, and how many segments of one length² block's size step 1 makes;
- the allocator's rules alone (allocator/model.py, a port of CUDACachingAllocator.cpp), for the layer's own layout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from vramledger.analytic import estimate
from vramledger.analytic.params import layer_linears
from vramledger.analytic.reserve.forward_cache import _leaf, _Replay
from vramledger.analytic.reserve.math_layer import MathLayer
from vramledger.analytic.reserve.spill import displaced_remade, two_steps_reserve
from vramledger.analytic.step import step_parts
from vramledger.catalog import resolve_model
from vramledger.ledger import Phase
from vramledger.specs import Method, ModelSpec, Optimizer, Precision, TrainSpec

MiB = 2**20
ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "bench" / "reserve" / "fp32_math.jsonl"
TRAIN = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)
# Shapes the packed estimate still misses by more than 3%, with what the replays show.
MISSES = {
    "qwen2.5-0.5b/full/b2/L1024/nockpt/sdpa/fp32/adamw_torch_fused/packed": (
        "a packed run's figure is at most the padded run's (runs.py peak_reserved: the padded run meets B × L too), "
        "and the padded run's closed forms are under here: fused AdamW has no foreach temporaries, whose term 1 covers "
        "the same 0.8 GiB for foreach AdamW (step 1's forward rests in the 20 MiB segments of the 7 MiB requests, the "
        "activations the states displace in step 2), so term 1 is the loss peak 16.91 + the stranded length² block "
        "0.11 + the weights' tails 0.11 = 17.13 GiB, where the two steps replayed with the math layer give 17.77 "
        "(trace 17.89: −0.7%)"
    ),
}


def _records() -> list[dict[str, Any]]:
    return [json.loads(line) for line in DATA.read_text().splitlines()]


def _spec(rec: dict[str, Any]) -> tuple[ModelSpec, TrainSpec]:
    train = TrainSpec(
        method=Method.FULL,
        precision=Precision.FP32,
        optimizer=Optimizer(rec["optimizer"]),
        micro_batch=rec["micro_batch"],
        seq_len=rec["seq_len"],
        grad_ckpt=False,
        packing=True,
    )
    return resolve_model(rec["model"]), train


@pytest.mark.parametrize("rec", _records(), ids=lambda r: r["id"])
def test_packed_fp32_math_within_3_percent_of_the_traced_replay(rec: dict[str, Any]) -> None:
    """A packed run's estimate (the two steps replayed with the fp32 math layer, where they are written out) within 3%
    of the trace's replay; before the layer was written out the closed forms put Qwen2.5-0.5B 6 to 11% over (term 1's
    foreach temporaries, which the trace cuts from the freed length² and MLP segments at these shapes)."""
    m, t = _spec(rec)
    got, replay = max(estimate(m, t).reserved(p) for p in TRAIN), rec["replay_peak_reserved"]
    gap = got / replay - 1
    print(f"{rec['id']}: replay {replay / 2**30:.2f} GiB, estimate {got / 2**30:.2f} GiB ({gap:+.1%})")
    if rec["id"] in MISSES:
        assert abs(gap) > 0.03, "no longer a miss: take it out of MISSES"
        pytest.xfail(f"{gap:+.1%}: {MISSES[rec['id']]}")
    assert abs(gap) <= 0.03


@pytest.mark.parametrize("rec", _records(), ids=lambda r: r["id"])
def test_the_two_steps_replayed_with_the_math_layer_against_the_trace(rec: dict[str, Any]) -> None:
    """Where the layer is written out (T ≥ H: below, no MLP tensor fits an activation segment and the sequence is not
    used), the two steps replayed reserve within 3% of the trace's replay at step 2's peak."""
    m, t = _spec(rec)
    p = step_parts(m, t)
    reserved = two_steps_reserve(m, t, p)
    if reserved is None:
        assert t.tokens < m.hidden_size, "written out wherever an MLP tensor fits an activation segment"
        pytest.skip("not written out: the closed forms (held_activations.py)")
    replay = rec["replay_peak_reserved"]
    print(f"{rec['id']}: trace {replay / 2**30:.2f} GiB, two steps replayed {reserved / 2**30:.2f} GiB")
    assert abs(reserved / replay - 1) <= 0.03
    assert displaced_remade(m, t, p) is not None


@pytest.mark.parametrize("rec", _records(), ids=lambda r: r["id"])
def test_each_layer_makes_two_length2_segments_as_the_trace_does(rec: dict[str, Any]) -> None:
    """Step 1's forward makes segments of one length² block (P = 4·nh·L²·B) in the trace: two a layer where the MLP's
    blocks are smaller than P (the scores' and the masked scores'; the softmax takes the scores' once they are freed,
    and the MLP's first blocks are cut from the masked scores', best fit, so the next layer finds neither whole), fewer
    where they are not (Llama-3.2-1B 1 × 2048: 30 for 16 layers; Qwen2.5-0.5B 1 × 4096: 37 for 24). The written-out
    forward, replayed through the allocator model alone, makes as many as the trace."""
    m, t = _spec(rec)
    P = 4 * m.num_heads * t.seq_len**2 * t.micro_batch
    made = []

    class Counting(_Replay):
        def alloc(self, size: int) -> int:
            before = self.model.reserved
            i = super().alloc(size)
            if size == P and self.model.reserved > before:
                made.append(i)
            return i

    r = Counting()
    shapes = {_leaf(lin.name): (lin.in_features, lin.out_features) for lin in layer_linears(m)}
    layer = MathLayer(r, m, shapes, batch=t.micro_batch, seq_len=t.seq_len)
    x = r.alloc(4 * m.hidden_size * t.tokens)
    for _ in range(m.num_layers):
        x = layer.forward(x, False)
    print(f"{rec['id']}: {len(made)} segments of {P / MiB:.1f} MiB, trace {rec['step_1_scores_segments']}")
    assert len(made) == rec["step_1_scores_segments"]


def test_the_math_layers_masked_scores_segment_holds_the_mlps_first_blocks() -> None:
    """A hand derivation from the allocator's rules (CUDACachingAllocator.cpp ``get_free_block``: the smallest free
    block at least as large; ``alloc_found_block`` splits it; ``get_allocation_size``: a segment of its own from
    10 MiB, 20 MiB shared below): Qwen2.5-0.5B fp32, 2 × 1024, P = 4·14·1024²·2 = 112 MiB, the MLP's blocks
    4·4864·2048 = 38 MiB, the residual stream's 4·896·2048 = 7 MiB. After the first layer's forward the scores'
    segment holds the probabilities (the softmax takes it back once the add has freed the scores), the masked scores'
    holds gate and act_fn (76 MiB of it) and the layer's output (7 MiB, cut from its 36 MiB rest: the 20 MiB segments
    have 6 MiB left beside two 7 MiB blocks); up and the product get 38 MiB segments of their own."""
    m = resolve_model("qwen2.5-0.5b")
    r = _Replay()
    shapes = {_leaf(lin.name): (lin.in_features, lin.out_features) for lin in layer_linears(m)}
    layer = MathLayer(r, m, shapes, batch=2, seq_len=1024)
    layer.forward(r.alloc(4 * m.hidden_size * 2048), False)
    P, mlp, stream = 112 * MiB, 4 * 4864 * 2048, 4 * 896 * 2048
    segments: dict[int, list[int]] = {}
    for blk in r.live.values():
        segments.setdefault(blk.seg, []).append(blk.size)
    large = sorted(sorted(s) for s in segments.values() if max(s) >= mlp)
    assert large == sorted([[P], [stream, mlp, mlp], [mlp], [mlp]]), large
    assert all(s == [stream, stream] for s in segments.values() if max(s) < mlp)
