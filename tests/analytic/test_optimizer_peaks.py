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

import pytest

pytest.importorskip("transformers")

from vramledger.analytic import estimate  # noqa: E402
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


@pytest.mark.parametrize("precision", [Precision.BF16, Precision.BF16_MIXED], ids=["bf16-params", "fp32-params"])
def test_adafactor_step_holds_fp32_copies_of_the_largest_tensor(precision: Precision) -> None:
    """Adafactor: the optimizer peak is weights + gradients + states + 4·n·4 for a V×H matrix with bf16 parameters
    (grad.float(), p.float(), and two update tensors at once), 2·n·4 with fp32 ones (``float()`` of an fp32 tensor
    is the tensor itself). Untied: the trace's ledger of a tied bf16 toy fails its own check (a negative parameters
    line), so the V×H matrices here are two."""
    train = TrainSpec(
        method=Method.FULL,
        optimizer=Optimizer.ADAFACTOR,
        precision=precision,
        micro_batch=1,
        seq_len=128,
        grad_ckpt=True,
        packing=True,
    )
    traced, got = _both(train, Phase.OPTIMIZER, {**TIED, "tie_word_embeddings": False})
    print(f"optimizer peak: trace {traced}, estimate {got} ({got / traced - 1:+.2%}); n·4 = {4 * V_H}")
    assert abs(got / traced - 1) <= 0.01
