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
- TRL's ``chunked_nll`` (SFTTrainer's default loss; trl f2cd577 ``trl/trainer/sft_trainer.py``
  ``_chunked_cross_entropy_loss`` l. 117-234, ``_chunk`` l. 99-114, ``_CHUNKED_LM_HEAD_CHUNK_SIZE = 256``): the
  patched forward (``_patch_chunked_ce_lm_head``) runs the decoder alone, so lm_head is never called and no full
  logits exist. The hidden states are sorted (``hidden[order]``, a copy of r·H·T, the checkpoints' inputs until
  the last chunk's backward) and each chunk of k tokens runs ``_chunk`` under ``torch.utils.checkpoint``
  (non-reentrant): ``h.float() @ w.float().t()`` — ``w.float()`` is a 4·V·H copy of a head that is not fp32,
  and under autocast the matmul casts ``w.float().t()`` again (c·V·H; a view, never cached) and writes the logits
  in the compute dtype (l = c; l = 4 without autocast) — then ``log_softmax`` (4·k·V), ``nll_loss``, and the
  entropy metric ``-(log_p.exp() * log_p).sum(-1)`` (two more 4·k·V): (l + 12)·k·V at once. Nothing is kept: the
  checkpoint stores no saved tensor. Backward recomputes the chunk, keeping mm's saved weight (the cast, or the
  fp32 copy) and the log-softmax (not the entropy's saved tensors: ``SFTTrainer.compute_loss`` drops the outputs
  before backward, and a recompute stores only tensors whose holders are alive), then writes the 4·k·V gradients
  of ``nll_loss`` and ``log_softmax``. The chunks' zero-padded slice gradients of the sorted hidden states are
  summed in place in one r·H·T buffer. A trained head's weight gradient (l·V·H per chunk, then cast to the head's
  dtype) is summed in place into the engine's input buffer of the head's AccumulateGrad (head·V·H), alive from
  the first chunk's backward to the last; with an fp32 head the first sum is out of place (three head·V·H at
  once). Traced on CPU tensors: tests/analytic/test_trl_chunked_nll.py.
- Fused linear cross-entropy (Liger ``LigerFusedLinearCrossEntropyFunction``): logits exist a chunk at a time;
  the gradient of the hidden states (c·H·T) is computed in forward and kept; chunk size
  ⌈T / ⌈V/H⌉⌉ tokens, each chunk holding c·V logits and fp32 softmax and gradient (≈ 10·V bytes per token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from vramledger.specs import Loss, Method, ModelSpec, TrainSpec
from vramledger.specs.train import TRL_CHUNK_TOKENS


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
    if train.loss is Loss.CHUNKED_NLL:
        return _trl_chunked_nll(m, train, tokens)
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


class TrlChunk(NamedTuple):
    """The tensors of TRL's ``chunked_nll`` (module docstring), in bytes: l is the logits' dtype, r the residual's."""

    chunks: int
    hidden: int
    """``hidden[order]``: r·H·T, until the last chunk's backward (and the chunks' summed slice gradients, as big)."""
    h_up: int
    """``h.float()`` (4·k·H unless r = 4) and autocast's cast of it (c·k·H)."""
    head32: int
    """``w.float()``: a 4·V·H copy unless the head is fp32."""
    cast: int
    """Autocast's c·V·H cast of ``w.float().t()`` (a view: never cached)."""
    head_saved: int
    """What mm saves of the head for the hidden states' gradient: the cast, or ``w.float()``."""
    logits: int
    """l·k·V."""
    fp32: int
    """4·k·V: the log-softmax, ``exp``, the entropy's product, each gradient; log_softmax's upcast under autocast."""
    upcast: int
    grad_cast: int
    """The logits' gradient cast back to the compute dtype under autocast (c·k·V)."""
    grad_h: int
    """mm's gradient of the chunk's hidden states (l·k·H)."""
    weight_grad: int
    """A trained head: mm's l·V·H weight gradient."""
    weight_cast: int
    """A trained head: its cast to the head's dtype (0 when the same)."""
    buffer: int
    """A trained head: the engine's input buffer summing the chunks' gradients (head dtype·V·H)."""
    first_sum_out_of_place: bool
    """An fp32 head: the first sum of two chunks' gradients is out of place."""


def trl_chunk(m: ModelSpec, train: TrainSpec, tokens: int) -> TrlChunk:
    """The sizes of TRL's ``chunked_nll`` tensors (module docstring), for the logits terms and the reserve's chain."""
    from vramledger.analytic.activations import residual_bytes
    from vramledger.analytic.weights import weight_budget

    wb = weight_budget(m, train)
    V, H, c, mixed = m.vocab_size, m.hidden_size, train.precision.compute.bytes, train.precision.mixed
    k = min(tokens, TRL_CHUNK_TOKENS)  # TRL rounds the target tokens up to whole chunks
    logit = c if mixed else 4
    head = (train.precision.trainable if wb.head_trainable else train.frozen_dtype).bytes
    head32 = 4 * V * H if head != 4 else 0
    cast = c * V * H if mixed else 0
    r = residual_bytes(train, wb)
    trained = wb.head_trainable
    return TrlChunk(
        chunks=-(-tokens // k),
        hidden=r * H * tokens,
        h_up=((4 if r != 4 else 0) + (c if mixed else 0)) * k * H,
        head32=head32,
        cast=cast,
        head_saved=cast if mixed else head32,
        logits=logit * k * V,
        fp32=4 * k * V,
        upcast=4 * k * V if mixed else 0,
        grad_cast=c * k * V if mixed else 0,
        grad_h=logit * k * H,
        weight_grad=logit * V * H if trained else 0,
        weight_cast=head * V * H if trained and head != logit else 0,
        buffer=head * V * H if trained else 0,
        first_sum_out_of_place=trained and head == 4,
    )


def _trl_chunked_nll(m: ModelSpec, train: TrainSpec, tokens: int) -> LogitsBytes:
    """TRL's ``chunked_nll``: one checkpointed chunk's matmul and loss at a time (module docstring)."""
    t = trl_chunk(m, train, tokens)
    matmul = t.head32 + t.cast + t.h_up + t.logits
    chunk = t.logits + 3 * t.fp32  # logits, log-softmax, exp and the entropy's product
    grads = t.head_saved + 3 * t.fp32  # the log-softmax with nll_loss's and log_softmax's gradients
    # mm's backward beside its saved weight, the logits' gradient, its saved input and the input's gradient; then
    # the cast to the head's dtype, once mm's saved are freed.
    weight_grad = max(t.head_saved + t.logits + 2 * t.grad_h, t.weight_cast) + t.weight_grad if t.buffer else 0
    moments = (matmul, t.head_saved + chunk, grads, weight_grad)
    # An fp32 head (w.float() is w itself): the engine's first sum of two chunks' gradients is out of place
    # (aten::add, then add_ for the later chunks: torch.profiler on plain CPU tensors shows the same), three at once.
    first_sum = 3 * t.buffer if t.first_sum_out_of_place else 0
    backward = 2 * t.hidden + max(t.buffer + max(moments), first_sum)
    return LogitsBytes(
        forward_peak=t.hidden + max(matmul, chunk),
        saved=t.hidden,
        backward_peak=backward,
        head_grad_moment=backward,
        source="TRL chunked_nll: each chunk's lm_head matmul and loss checkpointed; w.float() and its cast per chunk",
    )
