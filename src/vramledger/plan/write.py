"""Hand a plan back as a training config. The config writers belong to ``vramledger.adapters.writers``
(``write_config(model, train, fmt) -> (mapping, notes)`` and ``dump(mapping, header)``); until they are in this
build, a LLaMA-Factory YAML is written here with the keys that decide memory (LLaMA-Factory 0.9
``hparams/model_args.py``, ``finetuning_args.py``, ``data_args.py``; its TrainingArguments are transformers')."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vramledger.errors import VramledgerError
from vramledger.specs import Attention, Loss, Method, Precision, TrainSpec

HEADER = [
    "written by `vramledger plan --write-config`: the fastest plan that fits, keys that decide memory only;",
    "add your dataset, template, learning rate and output_dir. With gradient_accumulation_steps > 1, step the",
    "LR schedule per optimizer step (the HF Trainer does).",
]


def llamafactory_yaml(model: str, t: TrainSpec) -> dict[str, Any]:
    """A LLaMA-Factory train config for ``t`` (the fallback writer)."""
    out: dict[str, Any] = {"model_name_or_path": model, "stage": "sft", "do_train": True}
    out["finetuning_type"] = {Method.FULL: "full", Method.FREEZE: "freeze"}.get(t.method, "lora")
    if t.method is Method.QLORA and t.quant is not None:
        out |= {"quantization_bit": t.quant.bits, "quantization_method": "bnb",
                "quantization_type": t.quant.quant_type, "double_quantization": t.quant.double_quant}
    if t.precision is Precision.BF16:
        out["pure_bf16"] = True
    elif t.precision is Precision.BF16_MIXED:
        out["bf16"] = True
    elif t.precision is Precision.FP16_MIXED:
        out["fp16"] = True
    elif t.precision is not Precision.FP32:
        raise VramledgerError(f"--write-config: precision {t.precision.value} has no LLaMA-Factory key")
    if t.lora is not None and t.adapters:
        out |= {"lora_rank": t.lora.rank, "lora_alpha": t.lora.alpha, "lora_dropout": t.lora.dropout,
                "lora_target": "all" if t.lora.all_linear else ",".join(t.lora.targets), "use_dora": t.lora.dora}
    if t.method is Method.FREEZE:
        out["freeze_trainable_layers"] = t.freeze_trainable_layers
    out |= {
        "per_device_train_batch_size": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        "cutoff_len": t.seq_len,
        "packing": t.packing,
        # LLaMA-Factory checkpoints by default (model_args.disable_gradient_checkpointing = False)
        "disable_gradient_checkpointing": not t.grad_ckpt,
        "optim": t.optimizer.value,
        "flash_attn": {Attention.EAGER: "disabled", Attention.SDPA: "sdpa", Attention.FLASH2: "fa2"}[t.attn],
    }
    if t.loss is Loss.FUSED:
        out["enable_liger_kernel"] = True
    elif t.loss is Loss.CHUNKED:
        raise VramledgerError("--write-config: LLaMA-Factory has no chunked loss; choose a plan with a fused loss")
    if t.zero_stage or t.offload_optimizer:
        zero: dict[str, Any] = {"stage": t.zero_stage}
        if t.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        out["deepspeed"] = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                            "train_batch_size": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
                            "zero_optimization": zero}
    return out


def write_plan_config(model: str, train: TrainSpec, path: Path, *, fmt: str = "llamafactory") -> str:
    """Write ``train`` for ``model`` to ``path`` in ``fmt``; returns a short note on how it was written."""
    try:
        from vramledger.adapters import writers  # type: ignore[attr-defined]
    except ImportError:
        writers = None  # type: ignore[assignment]
    if writers is not None and hasattr(writers, "write_config"):
        fmt = fmt if fmt in getattr(writers, "TARGETS", (fmt,)) else "llamafactory"
        mapping, notes = writers.write_config(model, train, fmt)
        text = writers.dump(mapping, HEADER + [f"note: {n}" for n in notes])
        how = f"{fmt}, vramledger.adapters.writers"
    else:
        import yaml

        mapping = llamafactory_yaml(model, train)
        text = "".join(f"# {h}\n" for h in HEADER) + yaml.safe_dump(mapping, sort_keys=False, width=110)
        how = "llamafactory (built-in writer: vramledger.adapters.writers is not in this build)"
    try:
        path.write_text(text)
    except OSError as exc:
        raise VramledgerError(f"--write-config: cannot write {path} ({exc.strerror}); pick another path") from exc
    return how
