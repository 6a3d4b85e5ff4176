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

from vramledger.advice import advice_sentence
from vramledger.analytic.activations import activation_basis
from vramledger.analytic.evaluation import eval_advice, eval_warnings
from vramledger.analytic.loop import COMPILE_NOTE
from vramledger.analytic.step import ledger_items, step_parts
from vramledger.analytic.vision import lm_view, vision_items, vision_notes, vision_settings
from vramledger.analytic.vision_params import uncounted_tower_params
from vramledger.ledger import Ledger, ledger_verdict
from vramledger.specs import DEFAULT_HEADROOM, Attention, GPUSpec, Method, ModelSpec, TrainSpec

__all__ = ["DEFAULT_HEADROOM", "estimate", "step_parts"]


def _warnings(m: ModelSpec, train: TrainSpec) -> list[str]:
    out = list(train.warnings)
    basis = activation_basis(m, train)
    if basis is not None:
        out.append(basis)
    if train.peft_config is not None:
        from vramledger.analytic.peft_memory import peft_basis

        out.extend(note for note in (peft_basis(m, train),) if note is not None)
    if m.attn_logit_softcapping and train.attn is Attention.SDPA:
        out.append(
            f"{m.family}: transformers' sdpa does not support attention softcapping (it raises); modelled as eager"
        )
    if m.is_moe:
        out.append("MoE activations follow the eager expert loop of modeling_mixtral; not yet cross-checked by a trace")
    if train.distributed:
        from vramledger.analytic.distributed import distributed_warnings

        out.extend(distributed_warnings(m, train, step_parts))
    if train.optimizer.value.startswith("paged"):
        out.append(
            "paged optimizer states live in CUDA managed memory outside PyTorch's allocator: shown on their "
            "own line, in the device total but not in allocated or reserved; the driver may page them out"
        )
    if train.compile:
        out.append(COMPILE_NOTE)
    if train.offload_activations:
        out.append(
            "activation offloading: two layers' saved tensors counted on the GPU, the rest in pinned host "
            "memory (torchtune OffloadActivations)"
        )
    out.extend(eval_warnings(m, train))
    return out


def estimate(
    model: ModelSpec,
    train: TrainSpec,
    *,
    gpu: GPUSpec | None = None,
    headroom: float = DEFAULT_HEADROOM,
) -> Ledger:
    """The analytic ledger of one steady-state training step of ``model`` under ``train``."""
    asked = train
    if train.peft_config is not None:  # prompt methods run n virtual tokens more: analytic/peft_memory.py
        from vramledger.analytic.peft_memory import step_train

        train = step_train(train)
    lm = lm_view(model, train)  # the language model sees the images' tokens too (analytic/vision.py)
    items, names = ledger_items(model, lm, gpu)
    items += vision_items(model, train)
    parts = step_parts(model, lm, gpu)
    wb = parts.weights
    ledger = Ledger(
        model=model.name,
        params=wb.total_params + uncounted_tower_params(model, train),
        trainable_params=wb.trainable_params,
        items=items,
        engine="analytic",
        moments=MappingProxyType(dict(names)),
        warnings=tuple(_warnings(model, asked) + vision_notes(model, asked)),
        settings=MappingProxyType({**_settings(model, asked), **vision_settings(model, asked)}),
    )
    verdict = None
    if gpu is not None:
        verdict = ledger_verdict(ledger, gpu.name, gpu.memory_bytes, headroom)
    advice = eval_advice(ledger, model, lm, parts) or advice_sentence(ledger, lm)
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
    if m.config_name:
        s["model_config"] = m.config_name
    if train.peft_config is not None:
        import json

        s["peft_config"] = json.loads(train.peft_config)
    if train.lora is not None and train.adapters and train.peft_type in (None, "LORA"):
        s["lora"] = {
            "rank": train.lora.rank,
            "targets": list(train.lora.targets),
            "dropout": train.lora.dropout,
            "dora": train.lora.dora,
        }
        if train.lora.parameters:
            s["lora"]["target_parameters"] = list(train.lora.parameters)  # type: ignore[index]
    if train.quant is not None:
        q = train.quant
        quant: dict[str, object] = {"bits": q.bits, "type": q.quant_type if q.bits == 4 else "int8"}
        quant["double"] = q.double_quant
        if q.compute_dtype is not None:
            quant["compute_dtype"] = q.compute_dtype.value
        s["quant"] = quant
    if train.method is Method.FREEZE:
        s["freeze_trainable_layers"] = train.freeze_trainable_layers
    if train.distributed:
        from vramledger.analytic.distributed import distributed_settings

        s["distributed"] = distributed_settings(m, train, step_parts)
    for key in ("optimizer_in_backward", "offload_activations", "compile"):
        if getattr(train, key):
            s[key] = True
    if train.quant is not None:
        s["load_path"] = train.load_path.value
    if train.lora is not None and train.adapters and train.lora.modules_to_save:
        s["modules_to_save"] = list(train.lora.modules_to_save)
    if train.model_code.value != "transformers":  # analytic/litgpt.py
        s["model_code"] = train.model_code.value
    return s
