"""TRL's ``chunked_nll`` loss (analytic/logits.py ``_trl_chunked_nll``), measured on torch itself by running the
upstream code on CPU tensors.

``_chunk`` and ``_chunked_cross_entropy_loss`` are copied below from trl f2cd577 ``trl/trainer/sft_trainer.py``
(cited at each); every tensor an op makes is recorded with vramledger's trace recorder (under autocast with CUDA's
op lists, trace/shims.py ``autocast_as_cuda``), and the peak of live bytes is compared with the analytic model's
logits terms. A 4096 vocabulary and hidden size 64 make the chunk's k·V terms and the head's V·H copies dominate;
the rest (labels, masks, the sort's indices) is a small remainder."""

# ruff: noqa: E501 (TRL's lines, verbatim)

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from vramledger.analytic.logits import logits_bytes
from vramledger.catalog.hfconfig import model_spec_from_config
from vramledger.specs import DType, LoraSpec, Loss, Method, ModelSpec, Optimizer, Precision, TrainSpec
from vramledger.trace.recorder import Recorder, dispatch_mode
from vramledger.trace.shims import autocast_as_cuda
from vramledger.trace.step import _backward

V, H = 4096, 64


def _model(hidden_size: int) -> ModelSpec:
    return model_spec_from_config(
        {
            "model_type": "llama",
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "num_hidden_layers": 1,
            "vocab_size": V,
            "tie_word_embeddings": False,
        },
        name=f"wide-vocab-{hidden_size}",
        source="test",
    )


M = _model(H)
# A real head's V·H (128256 × 2048) is eight times a 256-token chunk's k·V: at hidden size 1024 (four times) the
# head's copies, casts and gradients set the peak here too.
WIDE = _model(1024)


@contextlib.contextmanager
def maybe_gather_lm_head_ctx(w: Any, b: Any) -> Iterator[None]:
    """trl f2cd577 ``trl/trainer/utils.py`` l. 188: gathers a ZeRO-3 partitioned head; a null context without it."""
    yield


def _chunk(h, w, b, lbl, logit_scale, final_logit_softcapping):  # type: ignore[no-untyped-def]
    """trl f2cd577 ``trl/trainer/sft_trainer.py`` l. 99-114, verbatim."""
    with maybe_gather_lm_head_ctx(w, b):
        logits = h.float() @ w.float().t()
        if b is not None:
            logits = logits + b.float()
    if logit_scale != 1.0:
        logits = logits * logit_scale
    if final_logit_softcapping is not None:
        logits = final_logit_softcapping * torch.tanh(logits / final_logit_softcapping)
    log_p = F.log_softmax(logits, dim=-1)
    # A chunk's tail may be `-100` padding: `ignore_index` zeroes their loss; `valid` does the same for accuracy/entropy.
    chunk_loss = F.nll_loss(log_p, lbl, ignore_index=-100, reduction="sum")
    valid = lbl != -100
    chunk_correct = ((logits.argmax(dim=-1) == lbl) & valid).sum().float()
    chunk_entropy = (-(log_p.exp() * log_p).sum(dim=-1) * valid).sum()
    return chunk_loss, chunk_correct, chunk_entropy


def _chunked_cross_entropy_loss(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    chunk_size: int,
    labels: torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    logit_scale: float = 1.0,
    final_logit_softcapping: float | None = None,
    lm_head_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """trl f2cd577 ``trl/trainer/sft_trainer.py`` l. 117-234, verbatim but for this docstring."""
    if labels is None and shift_labels is None:
        raise ValueError("At least one of `labels` or `shift_labels` must be provided.")

    if shift_labels is not None:
        hidden = hidden_states.reshape(-1, hidden_states.size(-1))
        labels = shift_labels.reshape(-1)
    else:
        hidden = hidden_states[..., :-1, :].reshape(-1, hidden_states.size(-1))
        labels = labels[..., 1:].reshape(-1)

    valid = labels != -100
    n_valid_tensor = valid.sum()

    correct = hidden.new_zeros((), dtype=torch.float32)
    entropy_sum = hidden.new_zeros((), dtype=torch.float32)
    if n_valid_tensor == 0:
        # Whole micro-batch masked (e.g. completion-only loss + truncation). Keep the loss connected
        # to the autograd graph through every trainable parameter so `.backward()` succeeds and DDP /
        # FSDP gradient sync doesn't hang on a missing param.
        with maybe_gather_lm_head_ctx(lm_head_weight, lm_head_bias):
            loss = (hidden_states.float().sum() + lm_head_weight.float().sum()) * 0.0
            if lm_head_bias is not None:
                loss = loss + lm_head_bias.float().sum() * 0.0
        return loss, correct, entropy_sum, n_valid_tensor

    # Pack valid tokens to the front so masked positions form whole trailing chunks. `argsort` on the boolean mask is
    # a static-shape op (unlike `hidden[valid]`, whose output shape is data-dependent and poisons XLA compilation).
    order = valid.to(torch.int8).argsort(descending=True, stable=True)
    hidden = hidden[order]
    labels = labels[order]

    # Process only the whole chunks covering the valid prefix: bounds XLA recompiles and drops fully-masked chunks on GPU.
    n_padded = (n_valid_tensor / chunk_size).ceil().to(torch.int64) * chunk_size

    loss = hidden.new_zeros((), dtype=torch.float32)

    for start in range(0, n_padded, chunk_size):
        h_chunk = hidden[start : start + chunk_size]
        lbl_chunk = labels[start : start + chunk_size]
        chunk_loss, chunk_correct, chunk_entropy = torch.utils.checkpoint.checkpoint(
            _chunk,
            h_chunk,
            lm_head_weight,
            lm_head_bias,
            lbl_chunk,
            logit_scale,
            final_logit_softcapping,
            use_reentrant=False,
        )
        loss = loss + chunk_loss
        correct = correct + chunk_correct
        entropy_sum = entropy_sum + chunk_entropy

    if num_items_in_batch is None:
        loss = loss / n_valid_tensor
    else:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss, correct, entropy_sum, n_valid_tensor


def _peak_live_bytes(train: TrainSpec, m: ModelSpec = M, *, evaluating: bool = False) -> int:
    """One training step's loss as SFTTrainer runs it: ``_chunked_cross_entropy_loss`` on the decoder's hidden
    states, inside the (autocast) forward; ``compute_loss`` returns only the loss (the outputs, with the entropy and
    accuracy tensors, are dropped before ``loss.backward()``). Every tensor an op makes inside is recorded.
    ``evaluating``: the Trainer's ``prediction_step`` instead: the same call under ``torch.no_grad()`` (transformers
    5.23 trainer.py l. 3239), no backward, no gradients (None after ``zero_grad(set_to_none=True)``)."""
    torch.manual_seed(0)
    mixed = train.precision.mixed
    full = train.method is Method.FULL
    fp32_head = (train.precision.trainable if full else train.frozen_dtype) is DType.FP32
    head_dtype = torch.float32 if fp32_head else torch.bfloat16
    # The residual stream: fp32 when bf16 matmul outputs are added to an fp32 embedding's output under autocast.
    hidden_dtype = torch.float32 if train.precision is Precision.FP32 or (mixed and fp32_head) else torch.bfloat16
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if mixed else contextlib.nullcontext()
    rec = Recorder()
    with autocast_as_cuda(), dispatch_mode(rec):
        w = torch.randn(V, m.hidden_size, dtype=head_dtype).requires_grad_(full)
        hidden = torch.randn(train.micro_batch, train.seq_len, m.hidden_size, dtype=hidden_dtype).requires_grad_(True)
        labels = torch.randint(0, V, (train.micro_batch, train.seq_len))
        # the head's gradient as a second micro-batch finds it (accumulated in place)
        if w.requires_grad and not evaluating:
            w.grad = torch.zeros_like(w)

        def compute_loss() -> torch.Tensor:
            with amp, torch.no_grad() if evaluating else contextlib.nullcontext():
                loss, correct, entropy_sum, n_valid = _chunked_cross_entropy_loss(hidden, w, 256, labels=labels)
            return loss

        loss = compute_loss()
        if not evaluating:
            _backward(loss)  # loss.backward(), with the recomputes under the shims (trace/step.py)
        del loss
    # The step's other lines, left out: the head (a weight), the final hidden states (final_hidden_bytes) and a
    # trained head's gradient (grad_bytes). Made under the recorder (a view of an unseen storage would count as new).
    others = {rec.sid_of(t) for t in (w, hidden, labels, w.grad) if t is not None}
    live = peak = 0
    for e in rec.events:
        if e.storage not in others:
            live += e.bytes if e.kind == "alloc" else -e.bytes
            peak = max(peak, live)
    return peak


def _train(precision: Precision, method: Method = Method.LORA, base: DType | None = None, B: int = 1) -> TrainSpec:
    return TrainSpec(
        method=method,
        precision=precision,
        optimizer=Optimizer.ADAMW,
        micro_batch=B,
        seq_len=1024,
        loss=Loss.CHUNKED_NLL,
        loss_chunk_tokens=256,
        packing=True,
        base_dtype=base,
        lora=LoraSpec(rank=8, alpha=16, targets=("q_proj", "v_proj"), dropout=0.0, adapter_fp32=False)
        if method is Method.LORA
        else None,
    )


CASES = {
    "lora-bf16-true": _train(Precision.BF16),
    "lora-bf16-mixed-bf16-base": _train(Precision.BF16_MIXED),
    "lora-bf16-mixed-fp32-base": _train(Precision.BF16_MIXED, base=DType.FP32),  # TRL's default dtype
    "lora-fp32": _train(Precision.FP32),
    "lora-bf16-mixed-B2": _train(Precision.BF16_MIXED, B=2),
    "full-bf16-mixed": _train(Precision.BF16_MIXED, Method.FULL),
    "full-bf16-true": _train(Precision.BF16, Method.FULL),
}


@pytest.mark.parametrize("m", [M, WIDE], ids=["H64", "H1024"])
@pytest.mark.parametrize("train", CASES.values(), ids=CASES.keys())  # type: ignore[arg-type]
def test_modelled_logits_match_the_traced_loss(train: TrainSpec, m: ModelSpec) -> None:
    lg = logits_bytes(m, train, train.tokens)
    modelled = max(lg.forward_peak, lg.backward_peak, lg.head_grad_moment)
    traced = _peak_live_bytes(train, m)
    err = modelled / traced - 1
    print(f"expected (traced) {traced:,} got {modelled:,} ({err:+.1%})")
    assert abs(err) < 0.03


def test_peak_is_one_chunk_not_the_sequence() -> None:
    """The hand derivation from TRL's code: nothing of a chunk is kept, so four times the tokens keep the logits
    peak (bf16-true, a bf16 head: w.float() 4·V·H, then 16·k·V for the chunk) within the hidden states' r·H·T."""
    short, long = _train(Precision.BF16), replace(_train(Precision.BF16), seq_len=4096)
    grown = _peak_live_bytes(long) - _peak_live_bytes(short)
    assert 0 <= grown < 4 * 2 * H * (4096 - 1024)
    k = 256
    assert logits_bytes(M, long, long.tokens).forward_peak == 2 * H * 4096 + 16 * k * V
