"""The one sentence of advice under a bill: its biggest line at the peak and the change that shrinks it.

One home for the wording and for the remedy of each category, used by every engine (``analytic.estimate`` and
``trace``) so that the same bill gets the same advice whichever engine drew it.
"""

from __future__ import annotations

from vramledger.ledger import Category, Ledger
from vramledger.specs import Loss, Method, Optimizer, TrainSpec
from vramledger.units import fmt_bytes


def remedy(category: Category, train: TrainSpec) -> str:
    """What shrinks ``category`` for this setup (the flag to pass where there is one)."""
    if category is Category.ACTIVATIONS:
        return (
            "gradient checkpointing (--grad-ckpt)"
            if not train.grad_ckpt
            else "a smaller micro-batch with gradient accumulation, or a shorter sequence"
        )
    if category is Category.LOGITS_LOSS:
        return (
            "a smaller micro-batch"
            if train.loss is Loss.FUSED
            else "a fused linear cross-entropy (--loss fused, Liger) or a smaller micro-batch"
        )
    if category is Category.WEIGHTS:
        if train.method is Method.FULL:
            return "LoRA over a bf16 base, or QLoRA (4-bit base)"
        return "a smaller model" if train.method is Method.QLORA else "QLoRA (4-bit base) or a smaller model"
    if category is Category.GRADIENTS:
        if train.keeps_unsharded_grads:
            return (
                "a gradient sync on every micro-step (accelerate's GradientAccumulationPlugin(sync_each_batch=True);"
                " LitGPT: no no_backward_sync) or less accumulation with a larger micro-batch"
            )
        return "a lower LoRA rank or fewer targets" if train.adapters else "LoRA, or freezing layers"
    if category is Category.TEMPORARIES:
        return (
            "the fused AdamW (--optimizer adamw_torch_fused)"
            if train.optimizer is Optimizer.ADAMW
            else "a smaller micro-batch"
        )
    return _REMEDIES.get(category, "a smaller micro-batch")


_REMEDIES = {
    Category.ATTENTION_SCORES: "sdpa or flash_attention_2 instead of eager, or packing instead of padding",
    Category.OPTIMIZER_STATE: "an 8-bit optimizer (--optimizer adamw_8bit) or LoRA",
    Category.MASTER_WEIGHTS: "ZeRO stage 1+ across more GPUs, or optimizer offload",
    Category.KV_CACHE: "a smaller eval/generation batch or length",
}


def advice_sentence(ledger: Ledger, train: TrainSpec) -> str:
    """``The biggest line at the peak (backward) is activations (3.2 GiB); gradient checkpointing (--grad-ckpt)
    would shrink it.`` — empty when the peak holds no allocated line."""
    peak = ledger.peak_phase
    by_cat = {c: n for c, n in ledger.by_category(peak).items() if c.allocated}
    if not by_cat:
        return ""
    biggest = max(by_cat, key=lambda c: by_cat[c])
    return (
        f"The biggest line at the peak ({peak.value}) is {biggest.display} ({fmt_bytes(by_cat[biggest])}); "
        f"{remedy(biggest, train)} would shrink it."
    )
