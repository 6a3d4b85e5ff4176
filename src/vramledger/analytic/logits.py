"""Logits and the loss: the B·L·V terms, usually the largest single tensors of a step.

Legend: T = B·L tokens, V vocabulary, H hidden, c compute-dtype bytes.

- Standard (transformers 5.23 ``loss/loss_utils.py`` ``ForCausalLMLoss``): lm_head writes c·V·T logits;
  ``logits.float()`` makes an fp32 copy (none when already fp32); ``cross_entropy`` = ``log_softmax`` (output
  saved, 4·V·T) + ``nll_loss``. The forward peak holds all three. In backward ``nll_loss_backward`` writes a
  4·V·T gradient and ``_log_softmax_backward_data`` another while the saved output is still live: 12·V·T.
  The HF Trainer's ``compute_loss`` drops ``outputs`` before backward, so the c·V·T logits are gone by then.
  Gemma 2's ``final_logit_softcapping`` (``logits / cap; tanh; * cap``) keeps tanh's output (c·V·T).
- Chunked (torchtune ``CEWithChunkedOutputLoss``; LitGPT ``chunked_cross_entropy``): the fp32 upcast happens a
  chunk at a time, but every chunk's log-softmax output is still saved (4·V·T).
- Fused linear cross-entropy (Liger ``LigerFusedLinearCrossEntropyFunction``): logits exist a chunk at a time;
  the gradient of the hidden states (c·H·T) is computed in forward and kept; chunk size
  ⌈T / ⌈V/H⌉⌉ tokens, each chunk holding c·V logits and fp32 softmax and gradient (≈ 10·V bytes per token).
"""

from __future__ import annotations

from dataclasses import dataclass

from vramledger.specs import Loss, ModelSpec, TrainSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class LogitsBytes:
    forward_peak: int
    """Live at the forward peak inside the loss."""
    saved: int
    """Kept from forward into backward."""
    backward_peak: int
    """Live at the backward peak inside the loss' backward (replaces ``saved``)."""
    head_grad_moment: int
    """Live while lm_head's backward runs (the logits' gradient in the compute dtype)."""
    source: str


def _standard(train: TrainSpec) -> TrainSpec:
    from dataclasses import replace

    return replace(train, loss=Loss.STANDARD)


def logits_bytes(m: ModelSpec, train: TrainSpec, tokens: int) -> LogitsBytes:
    V, H = m.vocab_size, m.hidden_size
    c = train.precision.compute.bytes
    upcast = 4 if c != 4 else 0
    softcap = c * V * tokens if m.final_logit_softcapping else 0
    if train.loss is Loss.FUSED:
        chunk = -(-tokens // max(1, -(-V // H)))
        per_chunk = (c + 4 + 4) * V * chunk
        kept = c * H * tokens
        return LogitsBytes(
            forward_peak=kept + per_chunk,
            saved=kept,
            backward_peak=kept,
            head_grad_moment=kept,
            source="Liger fused linear cross-entropy: chunk ⌈T/⌈V/H⌉⌉ tokens × (c+8)·V bytes; grad of hidden kept",
        )
    if train.loss is Loss.CHUNKED:
        chunk = min(tokens, train.loss_chunk_tokens)
        # One chunk covering every token is the standard loss: never count more than it.
        standard = logits_bytes(m, _standard(train), tokens)
        return LogitsBytes(
            forward_peak=min(c * V * tokens + 4 * V * tokens + upcast * V * chunk + softcap, standard.forward_peak),
            saved=4 * V * tokens + softcap,
            backward_peak=min(4 * V * tokens + c * V * tokens + 8 * V * chunk + softcap, standard.backward_peak),
            head_grad_moment=c * V * tokens,
            source="chunked CE (torchtune CEWithChunkedOutputLoss): fp32 upcast per chunk, log-softmax kept 4·V·T",
        )
    return LogitsBytes(
        forward_peak=(c + upcast + 4) * V * tokens + softcap,
        saved=4 * V * tokens + softcap,
        backward_peak=12 * V * tokens + softcap,
        head_grad_moment=c * V * tokens + (upcast * V * tokens if softcap else 0),
        source="transformers ForCausalLMLoss: c·V·T logits + fp32 copy + log-softmax; backward 12·V·T",
    )
