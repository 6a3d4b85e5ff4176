"""TRL's ``chunked_nll`` loss on the traced model (trl f2cd577 ``trl/trainer/sft_trainer.py``).

``_patch_chunked_ce_lm_head`` replaces the model's forward: the decoder alone (``self.base_model``), then
``_chunked_cross_entropy_loss`` (l. 117-234) on its last hidden state and ``lm_head.weight``: labels shifted, the
target tokens sorted to the front (``argsort``, then ``hidden[order]``), and each chunk of
``_CHUNKED_LM_HEAD_CHUNK_SIZE`` tokens through ``_chunk`` (l. 99-114) under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``. ``SFTTrainer.compute_loss`` keeps only the loss: the
accuracy and entropy sums are dropped before backward. The traced batch has no ``-100`` label, so the number of
target tokens is known without reading a tensor (fake tensors have no values)."""

from __future__ import annotations

from typing import Any


def _chunk(h: Any, w: Any, lbl: Any, logit_scale: float, softcap: float | None) -> tuple[Any, Any, Any]:
    """trl f2cd577 ``sft_trainer.py`` ``_chunk`` (l. 99-114) without a bias and ZeRO-3's gather."""
    import torch
    import torch.nn.functional as F

    logits = h.float() @ w.float().t()
    if logit_scale != 1.0:
        logits = logits * logit_scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    log_p = F.log_softmax(logits, dim=-1)
    chunk_loss = F.nll_loss(log_p, lbl, ignore_index=-100, reduction="sum")
    valid = lbl != -100
    chunk_correct = ((logits.argmax(dim=-1) == lbl) & valid).sum().float()
    chunk_entropy = (-(log_p.exp() * log_p).sum(dim=-1) * valid).sum()
    return chunk_loss, chunk_correct, chunk_entropy


def trl_chunked_nll(hf: Any, input_ids: Any, labels: Any, attention_mask: Any = None) -> Any:
    """The loss ``_chunked_ce_forward`` returns for ``labels`` with no ignored token (module docstring)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from vramledger.specs.train import TRL_CHUNK_TOKENS

    base = hf.get_base_model() if hasattr(hf, "get_base_model") else hf
    config = base.config
    hidden_states = base.base_model(
        input_ids=input_ids, attention_mask=attention_mask, use_cache=False
    ).last_hidden_state
    hidden = hidden_states[..., :-1, :].reshape(-1, hidden_states.size(-1))
    targets = labels[..., 1:].reshape(-1)
    del hidden_states
    n_valid = targets.numel()
    order = (targets != -100).to(torch.int8).argsort(descending=True, stable=True)
    hidden, targets = hidden[order], targets[order]
    k = TRL_CHUNK_TOKENS
    loss = hidden.new_zeros((), dtype=torch.float32)
    scale, softcap = getattr(config, "logit_scale", 1.0), getattr(config, "final_logit_softcapping", None)
    for start in range(0, -(-n_valid // k) * k, k):
        chunk_loss, _, _ = checkpoint(
            _chunk,
            hidden[start : start + k],
            base.lm_head.weight,
            targets[start : start + k],
            scale,
            softcap,
            use_reentrant=False,
        )
        loss = loss + chunk_loss
    return loss / n_valid
