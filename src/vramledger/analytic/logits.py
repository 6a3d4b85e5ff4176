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
- LitGPT under Lightning Fabric (``model_code`` litgpt / lit-gpt-2023, chunked loss): ``_FabricModule.forward``
  passes the model's output through ``precision.convert_output``, which casts every floating tensor to
  ``torch.get_default_dtype()`` (fp32) under each of Fabric's precision plugins (Lightning 71aed751 and
  2.3.0.dev ``plugins/precision/half.py`` ``HalfPrecision.convert_output``, the same in ``amp.py`` and
  ``bitsandbytes.py``; ``fabric/wrappers.py`` ``output = precision.convert_output(output)``). The training loop
  binds the result, ``logits = model(input_ids, lm_head_chunk_size=128)`` (litgpt 43c44323 ``finetune/lora.py``
  l. 276; lit-gpt 8641822 l. 216; ``finetune/full.py`` l. 229 ``logits = model(input_ids)``, lm_head unchunked),
  and rebinds it only when the next micro-step's forward returns: an fp32 list of 4·V·T lives from the loss to
  the end of the next forward (``litgpt_kept_logits_bytes``). ``chunked_cross_entropy`` (43c44323 ``utils.py``
  l. 247-290) then runs on fp32: no upcast per chunk, each chunk's log-softmax saved (4·V·T in all). Its
  ``reshape(-1, V)`` copies what is not contiguous: lora.py's last chunk, sliced ``[..., :-1, :]``, when B > 1
  (4·V·B·128); full.py's whole ``logits[..., :-1, :]`` when B > 1 (4·V·T), alive until the function returns. In
  backward every chunk's 4·V·chunk gradients run first (the engine takes the ready node of highest sequence
  number); full.py's ``split`` then ``cat``s them (4·V·T) and ``slice_backward`` writes a zero-padded copy
  (4·V·T): 12·V·T with the list. The compute-dtype gradient (c·V·T) reaches lm_head beside the list.
- Fused linear cross-entropy (Liger ``LigerFusedLinearCrossEntropyFunction``): logits exist a chunk at a time;
  the gradient of the hidden states (c·H·T) is computed in forward and kept; chunk size
  ⌈T / ⌈V/H⌉⌉ tokens, each chunk holding c·V logits and fp32 softmax and gradient (≈ 10·V bytes per token).
"""

from __future__ import annotations

from dataclasses import dataclass

from vramledger.specs import Loss, Method, ModelSpec, TrainSpec


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
    if train.loss is Loss.CHUNKED and train.model_code.litgpt:
        return _litgpt_chunked(m, train, tokens)
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


def litgpt_kept_logits_bytes(m: ModelSpec, train: TrainSpec) -> int:
    """LitGPT's fp32 ``logits`` (Fabric's ``convert_output``), alive from the loss until the next micro-step's
    forward returns: through backward, the optimizer step and the next forward (module docstring). 0 elsewhere."""
    if train.loss is not Loss.CHUNKED or not train.model_code.litgpt:
        return 0
    return 4 * m.vocab_size * train.tokens


def _litgpt_chunked(m: ModelSpec, train: TrainSpec, tokens: int) -> LogitsBytes:
    """LitGPT's ``chunked_cross_entropy`` on Fabric's fp32 logits, without the list itself (module docstring)."""
    V, B, c = m.vocab_size, train.micro_batch, train.precision.compute.bytes
    whole_head = train.method is Method.FULL  # finetune/full.py: lm_head unchunked, the loss chunked by tokens
    chunk = min(tokens, train.loss_chunk_tokens if whole_head else B * train.loss_chunk_tokens)
    # reshape's copy of what is not contiguous when B > 1: full.py's whole slice, lora.py's last chunk
    copy = (4 * V * (tokens if whole_head else chunk)) if B > 1 else 0
    return LogitsBytes(
        forward_peak=copy + 4 * V * tokens,
        saved=4 * V * tokens,
        backward_peak=(8 * V * tokens) if whole_head else 4 * V * tokens + 8 * V * chunk,
        head_grad_moment=(4 * V * tokens if whole_head else 0) + c * V * tokens,
        source="LitGPT chunked_cross_entropy on Fabric's fp32 logits (convert_output); the fp32 list counted apart",
    )
