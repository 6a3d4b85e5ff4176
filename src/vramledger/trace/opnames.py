"""The aten ops the trace reports at peaks and OOM points, named as the user wrote them.

The trace sees aten ops (``_to_copy``, ``mm``); a user wrote ``logits.float()`` or ``nn.Linear``. Each name
below holds only where it is unambiguous in context: ``_to_copy`` is ``logits.float()`` only among the logits
and loss tensors (anywhere else it is a dtype cast of something else, and keeps its aten name). Every label keeps
the aten name in parentheses, so nothing the trace knows is lost.

Sources of the wordings:
- transformers ``loss/loss_utils.py`` ``ForCausalLMLoss``: ``logits = logits.float()`` (the fp32 upcast), then
  ``fixed_cross_entropy`` → ``nn.functional.cross_entropy``;
- torch ``nn/functional.py`` ``cross_entropy`` → ``torch._C._nn.cross_entropy_loss``, which decomposes into
  ``log_softmax`` + ``nll_loss`` (aten/src/ATen/native/LossNLL.cpp ``cross_entropy_loss_symint``); their
  backwards are ``_log_softmax_backward_data`` and ``nll_loss_backward``;
- ``nn.Linear`` → ``F.linear`` → ``addmm`` (with bias) or ``mm`` (aten/src/ATen/native/Linear.cpp ``linear``);
  its backward is ``mm`` too;
- ``nn.Dropout`` → ``F.dropout`` → ``native_dropout`` (aten/src/ATen/native/Dropout.cpp);
- ``F.scaled_dot_product_attention`` → one of the ``_scaled_dot_product_*_attention`` kernels
  (aten/src/ATen/native/transformers/attention.cpp ``scaled_dot_product_attention``).
"""

from __future__ import annotations

from vramledger.ledger import Category, Phase

_PLAIN: dict[str, str] = {
    "_log_softmax": "cross-entropy's log-softmax",
    "_log_softmax_backward_data": "cross-entropy's log-softmax backward",
    "nll_loss_forward": "cross-entropy's NLL loss",
    "nll_loss_backward": "cross-entropy's NLL loss backward",
    "mm": "matmul",
    "addmm": "matmul",
    "bmm": "batched matmul",
    "baddbmm": "batched matmul",
    "native_dropout": "dropout",
    "native_dropout_backward": "dropout backward",
}
"""aten op → the user's words, wherever it appears."""

_UPCAST = "logits.float() in the loss"
_UPCAST_OR_OUTPUTS = "an fp32 copy of the logits: logits.float() in the loss or accelerate's convert_outputs_to_fp32"
_UPCAST_BACKWARD = "the backward of logits.float() in the loss"
"""``_to_copy`` among the logits and loss tensors (``Category.LOGITS_LOSS``), by where it runs. The trace of a
step has three: autocast's cast of ``lm_head``'s input (in ``lm_head``: no user term), the loss's
``logits.float()`` (inside the causal-LM module), and accelerate's ``convert_outputs_to_fp32`` of the returned
logits (outside every module; accelerate/utils/operations.py). When the causal-LM module is the root (a full
fine-tune, module path ``""``) the last two share a module path, so neither is named alone. In the backward only
the loss's ``.float()`` is differentiated (its gradient cast back to the logits' dtype)."""
_SDPA = "_scaled_dot_product_"


def user_term(op: str, category: str = "", phase: str = "", module: str = "") -> str | None:
    """The user's words for ``op`` (``category``: the ``Category`` value of what it allocated; ``phase``: the
    ``Phase`` value it ran in; ``module``: its module path), or ``None`` where the aten name is all that can be
    said."""
    if op.startswith(_SDPA):
        return "attention backward (SDPA)" if op.endswith("_backward") else "attention (SDPA)"
    if op == "_to_copy":
        if category != Category.LOGITS_LOSS.value or module.rsplit(".", 1)[-1] == "lm_head":
            return None
        if phase == Phase.BACKWARD.value:
            return _UPCAST_BACKWARD
        return _UPCAST if module else _UPCAST_OR_OUTPUTS
    return _PLAIN.get(op)


def op_label(op: str, category: str = "", phase: str = "", module: str = "") -> str:
    """``op`` as the user wrote it, the aten name kept in parentheses.

    >>> op_label("_to_copy", "logits_loss", "forward", "base_model.model")
    'logits.float() in the loss (_to_copy)'
    >>> op_label("_to_copy", "weights")
    '_to_copy'
    """
    term = user_term(op, category, phase, module)
    return op if term is None else f"{term} ({op})"
