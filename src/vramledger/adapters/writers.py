"""Write a TrainSpec as a LLaMA-Factory, TRL or axolotl config that the matching reader maps back to the same spec.

Only the keys that decide memory are written, always explicitly (a default can change between framework
versions). A spec the target framework cannot express raises VramledgerError naming the setting.
"""

from __future__ import annotations

from typing import Any

from vramledger.errors import VramledgerError
from vramledger.specs import Attention, Loss, Method, Precision, TrainSpec
from vramledger.specs.train import TRL_CHUNK_TOKENS

TARGETS = ("llamafactory", "trl", "axolotl")


def _deepspeed(t: TrainSpec) -> dict[str, Any] | None:
    """An inline DeepSpeed config (TrainingArguments and axolotl accept a mapping for ``deepspeed``)."""
    if t.zero_stage == 0 and t.world_size == 1 and not (t.offload_optimizer or t.offload_params):
        return None
    if t.offload_params and t.zero_stage != 3:
        raise VramledgerError("parameter offload needs ZeRO-3 in DeepSpeed; set the ZeRO stage to 3")
    zero: dict[str, Any] = {"stage": t.zero_stage}
    if t.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if t.offload_params:
        zero["offload_param"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        # a number here tells the reader the world size: train_batch_size = micro × accumulation × GPUs
        "train_batch_size": t.micro_batch * t.grad_accum * t.world_size if t.world_size > 1 else "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "zero_optimization": zero,
    }


def _no(what: str, fmt: str, fix: str) -> VramledgerError:
    return VramledgerError(f"convert --to {fmt}: {what} cannot be written as a {fmt} config; {fix}")


def _common_checks(t: TrainSpec, fmt: str) -> None:
    if t.peft_type not in (None, "LORA"):  # the frameworks' LoRA keys cannot say another PEFT method
        raise _no(
            f"the PEFT method {t.peft_type} (--peft-config)",
            fmt,
            "name a saved adapter folder in the config instead (LLaMA-Factory adapter_name_or_path, axolotl "
            "lora_model_dir)",
        )
    if t.sgd_momentum:
        raise _no("SGD momentum", fmt, "drop --sgd-momentum")
    if t.eval_seq_len is not None and t.eval_seq_len != t.seq_len and fmt != "axolotl":
        raise _no("an eval sequence length different from the training one", fmt, "drop --eval-seq")


def to_llamafactory(model: str, t: TrainSpec) -> dict[str, Any]:
    _common_checks(t, "llamafactory")
    out: dict[str, Any] = {"model_name_or_path": model, "stage": "sft", "do_train": True}
    out["finetuning_type"] = {Method.FULL: "full", Method.FREEZE: "freeze"}.get(t.method, "lora")
    if t.method is Method.QLORA and t.quant is not None:
        out |= {
            "quantization_bit": t.quant.bits,
            "quantization_method": "bnb",
            "quantization_type": t.quant.quant_type,
            "double_quantization": t.quant.double_quant,
        }
    if t.precision is Precision.BF16:
        out["pure_bf16"] = True
    elif t.precision is Precision.BF16_MIXED:
        out["bf16"] = True
    elif t.precision is Precision.FP16_MIXED:
        out["fp16"] = True
    elif t.precision is Precision.FP32 and t.method is Method.FULL:
        out |= {"bf16": False, "fp16": False}
    else:
        raise _no(
            f"precision {t.precision.value} with method {t.method.value}",
            "llamafactory",
            "use bf16-mixed, fp16-mixed or bf16-true",
        )
    if t.lora is not None and t.adapters:
        if t.lora.adapter_fp32 == (t.precision is Precision.BF16):
            raise _no(
                "adapter dtype other than LLaMA-Factory's (fp32, bf16 under pure_bf16)",
                "llamafactory",
                "keep the default adapter dtype",
            )
        if t.lora.parameters:  # hparams/finetuning_args.py has no target_parameters
            raise _no(
                "LoRA target parameters (PEFT target_parameters)",
                "llamafactory",
                "write it as trl or axolotl (lora_target_parameters), or drop --lora-target-parameters",
            )
        out |= {
            "lora_rank": t.lora.rank,
            "lora_alpha": t.lora.alpha,
            "lora_dropout": t.lora.dropout,
            "lora_target": "all" if t.lora.all_linear else ",".join(t.lora.targets),
            "use_dora": t.lora.dora,
        }
    if t.method is Method.FREEZE:
        out["freeze_trainable_layers"] = t.freeze_trainable_layers
    out |= {
        "per_device_train_batch_size": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        "cutoff_len": t.seq_len,
        "packing": t.packing,
        "disable_gradient_checkpointing": not t.grad_ckpt,
        "optim": t.optimizer.value,
        "flash_attn": {Attention.EAGER: "disabled", Attention.SDPA: "sdpa", Attention.FLASH2: "fa2"}[t.attn],
    }
    if t.loss is Loss.FUSED:
        out["enable_liger_kernel"] = True
    elif t.loss in (Loss.CHUNKED, Loss.CHUNKED_NLL):
        raise _no("a chunked loss", "llamafactory", "use --loss fused (Liger) or standard")
    _eval_hf(out, t, "llamafactory")
    ds = _deepspeed(t)
    if ds is not None:
        out["deepspeed"] = ds
    return out


def _eval_hf(out: dict[str, Any], t: TrainSpec, fmt: str) -> None:
    if t.eval_batch is None:
        return
    out |= {
        "do_eval": True,
        "eval_strategy": "steps",
        "eval_steps": 500,
        "per_device_eval_batch_size": t.eval_batch,
    }
    if fmt == "llamafactory":
        out["val_size"] = 0.1
    if t.eval_accumulation_steps is not None:
        out["eval_accumulation_steps"] = t.eval_accumulation_steps
    if t.predict_with_generate:
        if fmt != "llamafactory":
            raise _no("generation during evaluation", fmt, "drop predict_with_generate")
        out["predict_with_generate"] = True
        out["max_new_tokens"] = t.generation_max_new_tokens or 1024


def to_trl(model: str, t: TrainSpec) -> dict[str, Any]:
    _common_checks(t, "trl")
    if t.method is Method.FREEZE:
        raise _no("method freeze", "trl", "use full or lora")
    out: dict[str, Any] = {"model_name_or_path": model, "use_peft": t.adapters}
    if t.method is Method.QLORA and t.quant is not None:
        out["load_in_4bit" if t.quant.bits == 4 else "load_in_8bit"] = True
        if t.quant.bits == 4:
            out |= {"bnb_4bit_quant_type": t.quant.quant_type, "use_bnb_nested_quant": t.quant.double_quant}
    if t.lora is not None and t.adapters:
        if not t.lora.adapter_fp32 and t.zero_stage != 3:
            raise _no("bf16 adapters without ZeRO-3", "trl", "keep the default fp32 adapters")
        out |= {
            "lora_r": t.lora.rank,
            "lora_alpha": t.lora.alpha,
            "lora_dropout": t.lora.dropout,
            "lora_target_modules": "all-linear" if t.lora.all_linear else list(t.lora.targets),
            "use_dora": t.lora.dora,
        }
        if t.lora.parameters:
            out["lora_target_parameters"] = list(t.lora.parameters)
    half = t.precision.compute.value
    out |= {"bf16": half == "bf16", "fp16": half == "fp16"}
    # the load dtype decides whether trainable weights are fp32 (mixed) or half (true)
    if t.adapters:
        if not t.precision.mixed and t.precision is not Precision.FP32:
            raise _no(f"precision {t.precision.value} with adapters", "trl", "use bf16-mixed")
        out["dtype"] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[half]
    else:
        out["dtype"] = (
            "float32"
            if t.precision.mixed or t.precision is Precision.FP32
            else ("bfloat16" if half == "bf16" else "float16")
        )
    out |= {
        "per_device_train_batch_size": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        "max_length": t.seq_len,
        "packing": t.packing,
        "gradient_checkpointing": t.grad_ckpt,
        "optim": t.optimizer.value,
        "attn_implementation": t.attn.value,
    }
    if t.loss is Loss.FUSED:
        out |= {"use_liger_kernel": True, "loss_type": "nll"}
    elif t.loss in (Loss.CHUNKED, Loss.CHUNKED_NLL):
        out["loss_type"] = "chunked_nll"
    else:
        out["loss_type"] = "nll"
    _eval_hf(out, t, "trl")
    ds = _deepspeed(t)
    if ds is not None:
        out["deepspeed"] = ds
    return out


def to_axolotl(model: str, t: TrainSpec) -> dict[str, Any]:
    _common_checks(t, "axolotl")
    if t.method is Method.FREEZE:
        raise _no("method freeze", "axolotl", "use full, lora or qlora")
    out: dict[str, Any] = {"base_model": model}
    if t.adapters:
        out["adapter"] = "qlora" if t.method is Method.QLORA and t.quant and t.quant.bits == 4 else "lora"
        if t.quant is not None:
            out["load_in_4bit" if t.quant.bits == 4 else "load_in_8bit"] = True
            if t.quant.bits == 4 and (t.quant.quant_type != "nf4" or not t.quant.double_quant):
                out["bnb_config_kwargs"] = {
                    "bnb_4bit_quant_type": t.quant.quant_type,
                    "bnb_4bit_use_double_quant": t.quant.double_quant,
                }
        assert t.lora is not None
        if not t.lora.adapter_fp32:
            raise _no("bf16 adapters", "axolotl", "keep the default fp32 adapters")
        out |= {
            "lora_r": t.lora.rank,
            "lora_alpha": t.lora.alpha,
            "lora_dropout": t.lora.dropout,
            "peft_use_dora": t.lora.dora,
        }
        if t.lora.all_linear:
            out["lora_target_linear"] = True
        elif t.lora.targets:
            out["lora_target_modules"] = list(t.lora.targets)
        if t.lora.parameters:
            out["lora_target_parameters"] = list(t.lora.parameters)
        ok = {
            Precision.BF16_MIXED: {"bf16": True},
            Precision.FP16_MIXED: {"bf16": False, "fp16": True},
            Precision.FP32: {"bf16": False},
        }
    else:
        ok = {
            Precision.BF16: {"bf16": True},
            Precision.FP16: {"bf16": False, "fp16": True},
            Precision.FP32: {"bf16": False},
        }
    if t.precision not in ok:
        raise _no(
            f"precision {t.precision.value} with method {t.method.value}",
            "axolotl",
            f"use {' or '.join(p.value for p in ok)} (axolotl loads weights in the bf16/fp16 dtype)",
        )
    out |= ok[t.precision]
    out |= {
        "micro_batch_size": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        "sequence_len": t.seq_len,
        "sample_packing": t.packing,
        "gradient_checkpointing": t.grad_ckpt,
        "optimizer": t.optimizer.value,
        "attn_implementation": t.attn.value,
    }
    if t.loss is Loss.FUSED:
        out |= {
            "plugins": ["axolotl.integrations.liger.LigerPlugin"],
            "liger_fused_linear_cross_entropy": True,
        }
    elif t.loss in (Loss.CHUNKED, Loss.CHUNKED_NLL):
        raise _no("a chunked loss", "axolotl", "use --loss fused (Liger) or standard")
    if t.eval_batch is not None:
        out |= {"val_set_size": 0.05, "eval_batch_size": t.eval_batch}
        if t.eval_seq_len is not None:
            out["eval_sequence_len"] = t.eval_seq_len
        if t.eval_accumulation_steps is not None:
            out["eval_accumulation_steps"] = t.eval_accumulation_steps
        if t.predict_with_generate:
            raise _no("generation during evaluation", "axolotl", "drop predict_with_generate")
    else:
        out["val_set_size"] = 0
    ds = _deepspeed(t)
    if ds is not None:
        out["deepspeed"] = ds
    return out


def write_config(model: str, train: TrainSpec, fmt: str) -> tuple[dict[str, Any], list[str]]:
    """The config mapping for ``fmt`` and notes on what the target cannot carry exactly."""
    notes: list[str] = []
    if fmt == "llamafactory":
        out = to_llamafactory(model, train)
    elif fmt == "trl":
        out = to_trl(model, train)
        if train.loss is Loss.CHUNKED and train.loss_chunk_tokens != TRL_CHUNK_TOKENS:
            notes.append(f"TRL's chunked_nll uses chunks of {TRL_CHUNK_TOKENS} tokens (not {train.loss_chunk_tokens})")
    elif fmt == "axolotl":
        out = to_axolotl(model, train)
    else:
        raise VramledgerError(f"convert --to: unknown format {fmt!r}; choose one of {', '.join(TARGETS)}")
    if train.world_size > 1 and "deepspeed" in out:
        notes.append(f"launch on {train.world_size} GPUs (the inline DeepSpeed train_batch_size assumes it)")
    return out, notes


def dump(config: dict[str, Any], header: list[str]) -> str:
    """YAML text with ``#`` header lines (``yaml.safe_dump``; keys in the order written)."""
    import yaml

    body = yaml.safe_dump(config, sort_keys=False, default_flow_style=False, width=110)
    return "".join(f"# {line}\n" for line in header) + body
