"""Invariants that must hold for every input (hypothesis)."""

import dataclasses
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from vramledger.analytic import estimate
from vramledger.catalog import resolve_model
from vramledger.ledger import Category
from vramledger.specs import Attention, LoraSpec, Loss, Method, Optimizer, Precision, TrainSpec

MODELS = ["gpt2", "llama-3-8b"]

specs = st.builds(
    TrainSpec,
    method=st.sampled_from([Method.FULL, Method.LORA, Method.QLORA, Method.FREEZE]),
    precision=st.sampled_from([Precision.BF16_MIXED, Precision.BF16, Precision.FP32]),
    optimizer=st.sampled_from(list(Optimizer)),
    micro_batch=st.integers(1, 16),
    seq_len=st.integers(1, 8192),
    grad_accum=st.integers(1, 8),
    grad_ckpt=st.booleans(),
    attn=st.sampled_from([Attention.EAGER, Attention.SDPA]),
    lora=st.builds(LoraSpec, rank=st.integers(1, 128), dropout=st.sampled_from([0.0, 0.05])),
)


@settings(max_examples=150, deadline=None)
@given(spec=specs, model=st.sampled_from(MODELS), db=st.integers(0, 8), dl=st.integers(0, 4096))
def test_peak_never_falls_as_batch_or_length_grows(spec: TrainSpec, model: str, db: int, dl: int) -> None:
    m = resolve_model(model)
    base = estimate(m, spec)
    more = estimate(m, dataclasses.replace(spec, micro_batch=spec.micro_batch + db, seq_len=spec.seq_len + dl))
    assert more.peak_allocated >= base.peak_allocated
    assert more.device_total >= base.device_total


# The spaces of the setups where checkpointing was found to raise the peak: freeze with few trained layers,
# eager attention, the fused loss, packing, adafactor and paged optimizers, fp16-true, large accumulation.
ckpt_specs = st.builds(
    TrainSpec,
    method=st.sampled_from(list(Method)),
    freeze_trainable_layers=st.integers(1, 4),
    precision=st.sampled_from(list(Precision)),
    optimizer=st.sampled_from(list(Optimizer)),
    micro_batch=st.integers(1, 64),
    seq_len=st.integers(1, 4096),
    grad_accum=st.integers(1, 64),
    attn=st.sampled_from([Attention.EAGER, Attention.SDPA]),
    loss=st.sampled_from(list(Loss)),
    packing=st.booleans(),
    lora=st.builds(LoraSpec, rank=st.integers(1, 128), dropout=st.sampled_from([0.0, 0.05])),
)
CKPT_MODELS = ["gpt2", "llama-3-8b", "gemma-3-4b", "phi-4"]


@settings(max_examples=300, deadline=None)
@example(
    spec=TrainSpec(
        method=Method.FREEZE,
        optimizer=Optimizer.PAGED_ADAMW_8BIT,
        attn=Attention.EAGER,
        loss=Loss.FUSED,
        micro_batch=59,
        seq_len=413,
        grad_accum=59,
    ),
    model="phi-4",
)
@example(
    spec=TrainSpec(
        method=Method.FREEZE,
        freeze_trainable_layers=1,
        precision=Precision.FP16,
        optimizer=Optimizer.ADAFACTOR,
        attn=Attention.EAGER,
        loss=Loss.FUSED,
        packing=True,
        seq_len=1400,
    ),
    model="gemma-3-4b",
)
@given(spec=ckpt_specs, model=st.sampled_from(CKPT_MODELS))
def test_checkpointing_never_raises_activations(spec: TrainSpec, model: str) -> None:
    """With two or more trained layers, checkpointing drops more saved tensors than the recomputed layer brings
    back. With one, it drops nothing and keeps that layer's input, eager's masks and the fp32 copy its input norm
    saves once the input requires grad (tests/analytic/test_grad_ckpt_cases.py, measured on the trace): at most
    4·H·T + 4·H·T + 2 masks of 4·B·L² bytes. The device total is not asserted here: the allocator reserve can
    grow under checkpointing (analytic/reserve/: one layer's recompute and backward transients stay cached)."""
    m = resolve_model(model)
    on = estimate(m, dataclasses.replace(spec, grad_ckpt=True))
    off = estimate(m, dataclasses.replace(spec, grad_ckpt=False))
    one_layer = spec.method is Method.FREEZE and spec.freeze_trainable_layers == 1
    keep = 8 * m.hidden_size * spec.tokens + 8 * spec.micro_batch * spec.seq_len**2 if one_layer else 0

    # Each phase reports the moment of its own peak, and the two runs can peak at different moments (with a fused
    # loss and no checkpointing, backward peaks at its end, where nothing is saved any more): compare the most
    # that is saved at any moment. Under checkpointing backward also holds one recomputed layer: never more than
    # all layers saved.
    def most_saved(led: Any) -> int:
        return max(
            led.bytes_of(Category.ACTIVATIONS, p) + led.bytes_of(Category.ATTENTION_SCORES, p) for p in led.phases
        )

    assert most_saved(on) <= most_saved(off) + keep
    assert on.peak_allocated <= off.peak_allocated + keep


@settings(max_examples=100, deadline=None)
@given(spec=specs, model=st.sampled_from(MODELS))
def test_lines_add_up(spec: TrainSpec, model: str) -> None:
    led = estimate(resolve_model(model), spec)
    for phase in led.phases:
        assert sum(i.bytes for i in led.items if i.phase is phase and i.category.allocated) == led.allocated(phase)
        assert led.device(phase) == sum(i.bytes for i in led.items if i.phase is phase)
    assert led.peak_allocated == max(led.allocated(p) for p in led.phases)
    assert led.device_total >= led.peak_reserved >= led.peak_allocated
