"""The images' fake-mode constants (trace/vision_inputs.py) against a run on real tensors."""

from __future__ import annotations

import pytest

from tests.trace._tiny_vl import tiny_vl
from vramledger.analytic.vision import lm_view
from vramledger.specs import TrainSpec


@pytest.mark.slow
def test_fake_trace_equals_a_real_run() -> None:
    """The fake-mode constants (trace/vision_inputs.py) change no allocation: the same events on real tensors."""
    from vramledger.trace.step import run_trace

    m = tiny_vl()
    train = lm_view(m, TrainSpec(seq_len=16, images=1, image_size=(112, 56), grad_ckpt=True))
    fake, real = run_trace(m, train), run_trace(m, train, fake=False)
    assert [(e.kind, e.bytes, e.module) for e in fake.events] == [(e.kind, e.bytes, e.module) for e in real.events]
