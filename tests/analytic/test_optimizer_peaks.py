"""The step's allocated peaks with the optimizers other than foreach AdamW, against the trace of the real step.

Truth: ``vramledger.trace`` (the real transformers model, torch optimizer and autograd engine on fake tensors) of
a small tied-embedding Llama, whose V×H embedding is the largest tensor by far, so a missing V×H tensor shows:
- SGD without momentum (HF's default) has no state, so the step's peak is the end of backward, where the tied
  weight's two gradients and their out-of-place sum are live at once (torch/csrc/autograd/input_buffer.cpp
  ``accumulate``; analytic/step.py ``_tied_gradient_sum``);
- Adafactor (transformers ``optimization.py``) steps one parameter at a time, holding four fp32 copies of the
  largest one with 16-bit parameters (analytic/optimizer.py).
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from vramledger.analytic import estimate  # noqa: E402
from vramledger.catalog import resolve_model  # noqa: E402
from vramledger.catalog.hfconfig import model_spec_from_config  # noqa: E402
from vramledger.ledger import Phase  # noqa: E402
from vramledger.specs import Method, Optimizer, Precision, TrainSpec  # noqa: E402
from vramledger.trace import trace_step  # noqa: E402

TIED = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 32000,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": True,
}
V_H = 32000 * 256


def _both(train: TrainSpec, phase: Phase, config: dict[str, object] = TIED) -> tuple[int, int]:
    """(trace, estimate) allocated bytes at ``phase``'s peak (both with the two threads' cuBLAS workspaces, made by
    the backward's first matmul)."""
    m = model_spec_from_config(config, name="toy", source="tests/analytic/test_optimizer_peaks.py")
    traced = trace_step(m, train, config=config)
    est = estimate(m, train)
    return traced.allocated(phase), est.allocated(phase)


def test_sgd_end_of_backward_holds_three_tied_gradients() -> None:
    """SGD, fp32 weights under bf16 autocast, checkpointing: the backward peak is every gradient plus two more V×H
    fp32 tensors (the embedding's gradient and the sum; lm_head's is the tied weight's .grad-to-be)."""
    train = TrainSpec(
        method=Method.FULL, optimizer=Optimizer.SGD, micro_batch=1, seq_len=128, grad_ckpt=True, packing=True
    )
    traced, got = _both(train, Phase.BACKWARD)
    print(f"backward peak: trace {traced}, estimate {got} ({got / traced - 1:+.2%}); one V×H fp32 = {4 * V_H}")
    assert abs(got / traced - 1) <= 0.01


def test_adafactor_step_holds_four_fp32_copies_of_the_largest_tensor() -> None:
    """Adafactor with bf16 parameters: the optimizer peak is weights + gradients + states + 4·n·4 for a V×H
    matrix (grad.float(), p.float(), and two update tensors at once). Untied: the trace's ledger of a tied bf16
    toy fails its own check (a negative parameters line), so the V×H matrices here are two."""
    train = TrainSpec(
        method=Method.FULL,
        optimizer=Optimizer.ADAFACTOR,
        precision=Precision.BF16,
        micro_batch=1,
        seq_len=128,
        grad_ckpt=True,
        packing=True,
    )
    traced, got = _both(train, Phase.OPTIMIZER, {**TIED, "tie_word_embeddings": False})
    print(f"optimizer peak: trace {traced}, estimate {got} ({got / traced - 1:+.2%}); n·4 = {4 * V_H}")
    assert abs(got / traced - 1) <= 0.01


@settings(max_examples=40, deadline=None)
@example(
    train=TrainSpec(method=Method.FULL, optimizer=Optimizer.ADAMW_FUSED, micro_batch=2, seq_len=1023),
    model="llama-3.2-1b",
    db=0,
    dl=1,
)  # 4·V·T reaches the V×H gradient: the fused step's one re-made fp32 block gives way to ``_relaid_bytes``'s
@example(
    train=TrainSpec(method=Method.FULL, optimizer=Optimizer.SGD, micro_batch=2, seq_len=1023, grad_ckpt=True),
    model="llama-3.2-1b",
    db=0,
    dl=1,
)  # the tied V×H block the SGD run's shorter batches make stops at 2 × 1024
@given(
    train=st.builds(
        TrainSpec,
        method=st.just(Method.FULL),
        optimizer=st.sampled_from([Optimizer.SGD, Optimizer.ADAMW_FUSED, Optimizer.ADAFACTOR]),
        precision=st.sampled_from([Precision.BF16_MIXED, Precision.BF16, Precision.FP32]),
        micro_batch=st.integers(1, 8),
        seq_len=st.integers(1, 3000),
        grad_ckpt=st.booleans(),
        packing=st.booleans(),
    ),
    model=st.sampled_from(["llama-3.2-1b", "qwen2.5-0.5b", "llama-3.2-3b"]),
    db=st.integers(0, 4),
    dl=st.integers(0, 1024),
)
def test_reserved_never_falls_as_batch_or_length_grows(train: TrainSpec, model: str, db: int, dl: int) -> None:
    """The end-of-backward reserve of the optimizers without step temporaries (reserve.py
    ``_end_of_backward_bound``) switches terms off as the shape grows, as the foreach AdamW one does: the estimate's
    reserved must still never fall as the micro-batch or the length grows (the planner's searches rely on it)."""
    m = resolve_model(model)
    more = dataclasses.replace(train, micro_batch=train.micro_batch + db, seq_len=train.seq_len + dl)
    got = [
        max(estimate(m, t).reserved(ph) for ph in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER))
        for t in (train, more)
    ]
    assert got[1] >= got[0]
