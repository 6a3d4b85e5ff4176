"""Images through the real Qwen2.5-VL code on fake tensors: the estimate's image terms against the trace.

The trace itself checks the token count independently: transformers' ``get_placeholder_mask`` refuses a batch whose
``<|image_pad|>`` count differs from what the tower makes of ``image_grid_thw`` (``torch_compilable_check``), so a
trace that runs is one whose token count the model agrees with.
"""

from __future__ import annotations

import collections

import pytest

from tests.trace._tiny_vl import TINY_QWEN2_VL, TINY_QWEN3_VL, tiny_vl
from vramledger.analytic import estimate
from vramledger.ledger import Category, Ledger, Phase
from vramledger.specs import ModelSpec, TrainSpec
from vramledger.trace.api import trace_result, trace_step

# 224×168 → smart_resize 224×168 (multiples of 28): 16×12 patches, 48 tokens; windows of 8×8 patches (Qwen3-VL's
# 16-pixel patches: 224×160, 14×10 patches, 35 tokens).
IMAGE = (224, 168)


def _by_category(ledger: Ledger, phase: Phase) -> dict[Category, int]:
    out: collections.Counter[Category] = collections.Counter()
    for item in ledger.items:
        if item.phase is phase and item.category.allocated:
            out[item.category] += item.bytes
    return dict(out)


def _saved_and_peak(m: ModelSpec, train: TrainSpec) -> tuple[int, int]:
    """From one trace: the bytes allocated in the second step's forward and alive when its backward begins, and
    the peak of live device bytes (host-side counters skipped)."""
    result, events = trace_result(m, train)
    saved = sum(
        s.bytes
        for s in result.storages.values()
        if s.step == 2 and s.phase is Phase.FORWARD and s.category == Category.ACTIVATIONS.value
    )
    live = peak = 0
    for e in events:
        if e.category != "host":
            live += e.bytes if e.kind == "alloc" else -e.bytes
            peak = max(peak, live)
    return saved, peak


def assert_agree(est: Ledger, m: ModelSpec, train: TrainSpec, *, saved_rel: float, peak_rel: float) -> None:
    """The estimate's saved activations and its peak less the cuBLAS workspaces (they would hide any difference in
    a model this small) against one trace's, within the given relative tolerances."""
    t_saved, t_peak = _saved_and_peak(m, train)
    e_saved = _by_category(est, Phase.FORWARD)[Category.ACTIVATIONS]
    print(f"saved: estimate {e_saved:,}, trace {t_saved:,}, ratio {e_saved / t_saved:.3f}")
    assert e_saved == pytest.approx(t_saved, rel=saved_rel)
    e_peak = est.peak_allocated - _by_category(est, Phase.FORWARD)[Category.WORKSPACE]
    print(f"peak less workspaces: estimate {e_peak:,}, trace {t_peak:,}, ratio {e_peak / t_peak:.3f}")
    assert e_peak == pytest.approx(t_peak, rel=peak_rel)


@pytest.mark.parametrize(
    ("config", "setup", "tolerance"),
    [
        pytest.param(None, {}, 0.02, id="qwen2.5-vl-lora-all-linear-adapts-the-tower"),
        pytest.param(None, {"grad_ckpt": True, "freeze_vision_tower": True}, 0.02, id="qwen2.5-vl-llamafactory-ckpt"),
        pytest.param(None, {"method": "full"}, 0.02, id="qwen2.5-vl-full"),
        pytest.param(TINY_QWEN2_VL, {"grad_ckpt": True, "freeze_vision_tower": True}, 0.02, id="qwen2-vl-frozen-ckpt"),
        # The generic estimate of Qwen3-VL's language model (q/k norms, interleaved M-RoPE) is 1.2% under the
        # trace on text alone; the image terms add no more than that.
        pytest.param(TINY_QWEN3_VL, {}, 0.03, id="qwen3-vl-lora-all-linear-deepstack"),
    ],
)
def test_image_activations_and_peak_agree_with_the_trace(config: dict | None, setup: dict, tolerance: float) -> None:
    m = tiny_vl(config)
    train = TrainSpec(seq_len=64, images=1, image_size=IMAGE, **setup)
    # Saved for backward (tower, merger, language model over 64 + 48 positions); the peak without the 66 MiB of
    # cuBLAS workspaces the estimate adds: weights, states, logits, the tower's autocast copies, the pixels: 5%.
    assert_agree(estimate(m, train), m, train, saved_rel=tolerance, peak_rel=0.05)


def test_trace_refuses_images_with_the_chunked_loss() -> None:
    """The chunked loss runs the decoder alone (trace/step.py chunked_loss): refused before any model is built."""
    from vramledger.catalog import resolve_model
    from vramledger.errors import VramledgerError
    from vramledger.specs import Loss

    with pytest.raises(VramledgerError, match="--loss chunked"):
        trace_step(resolve_model("gemma-3-4b"), TrainSpec(seq_len=300, images=1, loss=Loss.CHUNKED))
