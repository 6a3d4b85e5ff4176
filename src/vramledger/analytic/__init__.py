"""The instant path: pure functions of the specs that return bytes, composed into a Ledger.

Imports no torch and no transformers. ``estimate`` is the entry point:

>>> from vramledger.catalog import resolve_model
>>> from vramledger.specs import TrainSpec, Method
>>> ledger = estimate(resolve_model("llama-3-8b"), TrainSpec(method=Method.LORA, micro_batch=1, seq_len=1024))
>>> ledger.peak_phase.value
'forward'
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

from vramledger.analytic.evaluation import eval_advice
from vramledger.analytic.step import ledger_items, step_parts
from vramledger.ledger import Category, Ledger, make_verdict
from vramledger.specs import Attention, GPUSpec, Loss, Method, ModelSpec, TrainSpec
from vramledger.units import fmt_bytes

DEFAULT_HEADROOM = 0.08

__all__ = ["DEFAULT_HEADROOM", "estimate", "step_parts"]


def _warnings(m: ModelSpec, train: TrainSpec) -> list[str]:
    out = list(train.warnings)
    if m.attn_logit_softcapping and train.attn is Attention.SDPA:
        out.append(
            f"{m.family}: transformers' sdpa does not support attention softcapping (it raises); modelled as eager"
        )
    if m.is_moe:
        out.append("MoE activations follow the eager expert loop of modeling_mixtral; not yet cross-checked by a trace")
    if train.distributed:
        from vramledger.analytic.distributed import distributed_warnings

        out.extend(distributed_warnings(m, train, step_parts))
    if train.quant is not None and train.optimizer.value.startswith("paged"):
        out.append("paged optimizer states live in CUDA managed memory: counted on the device, may be paged out")
    from vramledger.analytic.evaluation import eval_warnings

    out.extend(eval_warnings(m, train))
    return out


def _advice(ledger_items_by_cat: dict[Category, int], train: TrainSpec) -> str:
    """One sentence naming the biggest line and what would shrink it."""
    biggest = max(ledger_items_by_cat, key=lambda c: ledger_items_by_cat[c])
    size = fmt_bytes(ledger_items_by_cat[biggest])
    remedies = {
        Category.ACTIVATIONS: "gradient checkpointing (--grad-ckpt)" if not train.grad_ckpt
        else "a smaller micro-batch with gradient accumulation, or a shorter sequence",
        Category.ATTENTION_SCORES: "sdpa or flash_attention_2 instead of eager, or packing instead of padding",
        Category.LOGITS_LOSS: "a fused linear cross-entropy (--loss fused, Liger) or a smaller micro-batch",
        Category.OPTIMIZER_STATE: "an 8-bit optimizer (--optimizer adamw_8bit) or LoRA",
        Category.GRADIENTS: "LoRA, or freezing layers",
        Category.WEIGHTS: "LoRA over a bf16 base, or QLoRA (4-bit base)" if train.method is Method.FULL
        else "a smaller model" if train.method is Method.QLORA
        else "QLoRA (4-bit base) or a smaller model",
        Category.MASTER_WEIGHTS: "ZeRO stage 1+ across more GPUs, or optimizer offload",
        Category.TEMPORARIES: "the fused AdamW (--optimizer adamw_torch_fused)"
        if train.optimizer.value == "adamw_torch"
        else "a smaller micro-batch",
        Category.KV_CACHE: "a smaller eval/generation batch or length",
    }
    remedy = remedies.get(biggest, "a smaller micro-batch")
    if biggest is Category.LOGITS_LOSS and train.loss is Loss.FUSED:
        remedy = "a smaller micro-batch"
    return f"The biggest line is {biggest.display} ({size}) at the peak; {remedy} would shrink it."


def estimate(
    model: ModelSpec,
    train: TrainSpec,
    *,
    gpu: GPUSpec | None = None,
    headroom: float = DEFAULT_HEADROOM,
) -> Ledger:
    """The analytic ledger of one steady-state training step of ``model`` under ``train``."""
    items, names = ledger_items(model, train, gpu)
    wb = step_parts(model, train, gpu).weights
    ledger = Ledger(
        model=model.name,
        params=wb.total_params,
        trainable_params=wb.trainable_params,
        items=items,
        engine="analytic",
        moments=MappingProxyType(dict(names)),
        warnings=tuple(_warnings(model, train)),
        settings=MappingProxyType(_settings(model, train)),
    )
    peak = ledger.peak_phase
    by_cat = {c: ledger.bytes_of(c, peak) for c in ledger.categories() if c.allocated and ledger.bytes_of(c, peak)}
    verdict = None
    if gpu is not None:
        verdict = make_verdict(ledger.device_total, gpu.name, gpu.memory_bytes, headroom)
    advice = eval_advice(ledger, model, train, gpu) or _advice(by_cat, train)
    return replace(ledger, verdict=verdict, advice=advice)


def _settings(m: ModelSpec, train: TrainSpec) -> dict[str, object]:
    s: dict[str, object] = {
        "method": train.method.value,
        "precision": train.precision.value,
        "optimizer": train.optimizer.value,
        "micro_batch": train.micro_batch,
        "seq_len": train.seq_len,
        "grad_accum": train.grad_accum,
        "grad_ckpt": train.grad_ckpt,
        "attn": train.attn.value,
        "loss": train.loss.value,
        "family": m.family,
        "model_source": m.source,
    }
    if train.lora is not None and train.adapters:
        s["lora"] = {
            "rank": train.lora.rank,
            "targets": list(train.lora.targets),
            "dropout": train.lora.dropout,
            "dora": train.lora.dora,
        }
    if train.quant is not None:
        s["quant"] = {"bits": train.quant.bits, "type": train.quant.quant_type, "double": train.quant.double_quant}
    if train.method is Method.FREEZE:
        s["freeze_trainable_layers"] = train.freeze_trainable_layers
    if train.distributed:
        from vramledger.analytic.distributed import distributed_settings

        s["distributed"] = distributed_settings(m, train, step_parts)
    return s

