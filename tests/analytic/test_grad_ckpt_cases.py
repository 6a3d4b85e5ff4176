"""Gradient checkpointing never raises the estimate's device total: the two setups the safety trial found.

Two causes were located:
- fixed: ``analytic/reserve.py stranded_bytes`` under checkpointing added one layer's recompute and backward
  transients (+ eager's (c+4)·nh·L²·B) on top of the loss's peak as "stranded"; with a fused or chunked loss the
  loss makes no 4·V·T request, so those cached blocks are reused (best fit splits large blocks) and nothing is
  stranded. This was the whole of the phi-4 case.
- open (strict xfail on the gemma-3-4b case): ``analytic/step.py``, the backward of the top layer under
  checkpointing: ``add_activations`` already holds the checkpoints of every trained layer (the top one's
  included, and eager's mask), and "one layer recomputed" adds that layer's whole saved set again, input and
  mask included; ``torch.utils.checkpoint`` recomputes from the checkpointed input itself, so the top layer's
  input and mask are counted twice (visible with one trained layer).
When that lands, the gemma case passes and its strict marker fails: remove it then.
"""

from __future__ import annotations

import dataclasses

import pytest

from vramledger.analytic import estimate
from vramledger.catalog import resolve_model
from vramledger.specs import TrainSpec

CASES = {
    "phi-4/freeze/paged8bit/eager/fused/59x413/accum59": (
        "phi-4",
        dict(
            method="freeze",
            optimizer="paged_adamw_8bit",
            attn="eager",
            loss="fused",
            micro_batch=59,
            seq_len=413,
            grad_accum=59,
        ),
    ),
    "gemma-3-4b/freeze1/fp16-true/adafactor/eager/fused/packed/1x1400": (
        "gemma-3-4b",
        dict(
            method="freeze",
            freeze_trainable_layers=1,
            precision="fp16-true",
            optimizer="adafactor",
            attn="eager",
            loss="fused",
            packing=True,
            micro_batch=1,
            seq_len=1400,
        ),
    ),
}


_OPEN = "gemma-3-4b/freeze1/fp16-true/adafactor/eager/fused/packed/1x1400"


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=pytest.mark.xfail(strict=True, reason="the recomputed top layer counts its checkpointed "
                                                "input and eager mask twice (analytic/step.py)"))
        if c == _OPEN else c
        for c in sorted(CASES)
    ],
)
def test_checkpointing_does_not_raise_the_peak(case: str) -> None:
    name, kw = CASES[case]
    model, train = resolve_model(name), TrainSpec(**kw)  # type: ignore[arg-type]
    off = estimate(model, dataclasses.replace(train, grad_ckpt=False))
    on = estimate(model, dataclasses.replace(train, grad_ckpt=True))
    print(f"{case}: off {off.device_total / 2**30:.3f} GiB, on {on.device_total / 2**30:.3f} GiB")
    assert on.device_total <= off.device_total
