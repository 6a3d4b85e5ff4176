"""torchtune recipe config (``tune run RECIPE --config FILE key=value``) → TrainSpec fields.

Read against torchtune@bd2a0fc (pytorch/torchtune): ``recipes/configs/llama3/8B_lora_single_device.yaml`` and
its siblings, ``recipes/lora_finetune_single_device.py`` / ``full_finetune_distributed.py`` (``dtype`` sets every
parameter's dtype, no autocast; LoRA weights take the same dtype), ``torchtune/modules/loss/`` (chunked losses,
``num_output_chunks=8``) and ``torchtune/models/*/_model_builders.py`` (model builder names).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from vramledger.adapters._base import Reader, as_int
from vramledger.errors import VramledgerError
from vramledger.specs import Loss, Method, Optimizer, Precision, QuantSpec
from vramledger.specs.train import LoraSpec

# torchtune builder → Hugging Face hub id of the checkpoint it loads (the ``tune download`` line of each config).
BUILDERS: dict[str, str] = {
    "llama3_8b": "meta-llama/Meta-Llama-3-8B",
    "llama3_70b": "meta-llama/Meta-Llama-3-70B",
    "llama3_1_8b": "meta-llama/Llama-3.1-8B",
    "llama3_1_70b": "meta-llama/Llama-3.1-70B",
    "llama3_2_1b": "meta-llama/Llama-3.2-1B",
    "llama3_2_3b": "meta-llama/Llama-3.2-3B",
    "llama2_7b": "meta-llama/Llama-2-7b-hf",
    "llama2_13b": "meta-llama/Llama-2-13b-hf",
    "mistral_7b": "mistralai/Mistral-7B-v0.1",
    "gemma_2b": "google/gemma-2b",
    "gemma_7b": "google/gemma-7b",
    "gemma2_2b": "google/gemma-2-2b",
    "gemma2_9b": "google/gemma-2-9b",
    "qwen2_5_0_5b": "Qwen/Qwen2.5-0.5B",
    "qwen2_5_1_5b": "Qwen/Qwen2.5-1.5B",
    "qwen2_5_3b": "Qwen/Qwen2.5-3B",
    "qwen2_5_7b": "Qwen/Qwen2.5-7B",
    "qwen2_5_14b": "Qwen/Qwen2.5-14B",
    "qwen3_0_6b": "Qwen/Qwen3-0.6B",
    "qwen3_1_7b": "Qwen/Qwen3-1.7B",
    "qwen3_4b": "Qwen/Qwen3-4B",
    "qwen3_8b": "Qwen/Qwen3-8B",
    "phi3_mini": "microsoft/Phi-3-mini-4k-instruct",
}
# torchtune module names → transformers' (torchtune/models/convert_weights.py _FROM_HF)
_LORA_NAMES = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj"}

HARMLESS = frozenset(
    [
        "output_dir",
        "tokenizer",
        "checkpointer",
        "resume_from_checkpoint",
        "save_adapter_weights_only",
        "seed",
        "shuffle",
        "epochs",
        "max_steps_per_epoch",
        "clip_grad_norm",
        "lr_scheduler",
        "metric_logger",
        "log_every_n_steps",
        "log_peak_memory_stats",
        "log_level",
        "device",
        "profiler",
        "low_cpu_ram",
        "run_val_every_n_steps",
        "custom_sharded_layers",
    ]
)
TT = "torchtune"


def _component(node: Any, key: str, r: Reader) -> tuple[str, dict[str, Any]]:
    if not isinstance(node, dict) or not isinstance(node.get("_component_"), str):
        raise VramledgerError(f"{r.source}: {key} must be a mapping with a _component_ (got {node!r})")
    return node["_component_"], node


def load(r: Reader) -> str | None:
    builder, model = _component(r.value("model"), "model", r)
    name = builder.rsplit(".", 1)[-1]
    qlora = name.startswith("qlora_")
    lora = qlora or name.startswith("lora_")
    base = name.split("_", 1)[1] if lora else name
    model_name = _model_name(r, base)

    if lora:
        r.set("method", Method.QLORA if qlora else Method.LORA, r.file(f"model._component_={name}"))
        attn_mods = model.get("lora_attn_modules") or []
        if not isinstance(attn_mods, list) or not all(isinstance(m, str) for m in attn_mods):
            raise VramledgerError(f"{r.source}: model.lora_attn_modules must be a list of names (got {attn_mods!r})")
        targets: list[str] = [_LORA_NAMES.get(m) or m for m in attn_mods]
        if model.get("apply_lora_to_mlp"):
            targets += ["gate_proj", "up_proj", "down_proj"]
        if model.get("apply_lora_to_output"):
            r.warn("ignored: model.apply_lora_to_output (LoRA on the output projection is not modelled)")
        rank = as_int(model.get("lora_rank", 8))
        alpha = model.get("lora_alpha", 16)
        dropout = model.get("lora_dropout", 0.0)
        if (
            rank is None
            or isinstance(alpha, bool)
            or not isinstance(alpha, (int, float))
            or isinstance(dropout, bool)
            or not isinstance(dropout, (int, float))
        ):
            raise VramledgerError(f"{r.source}: model.lora_rank/lora_alpha/lora_dropout must be numbers")
        if not targets:
            raise VramledgerError(f"{r.source}: model.lora_attn_modules is empty and apply_lora_to_mlp is off")
        r.set(
            "lora",
            LoraSpec(
                rank=rank,
                alpha=float(alpha),
                targets=tuple(targets),
                dropout=float(dropout),
                dora=bool(model.get("use_dora", False)),
                adapter_fp32=False,
            ),
            r.file("model.lora_rank", "model.lora_attn_modules", "model.apply_lora_to_mlp")
            + " (LoRA weights in the model dtype: torchtune has no fp32 adapter upcast)",
        )
        if qlora:
            # torchao NF4Tensor: block size 64, scalers double-quantised to int8 (torchtune/modules/low_precision)
            r.set(
                "quant",
                QuantSpec(bits=4, quant_type="nf4", double_quant=True),
                r.file(f"model._component_={name}"),
            )
    else:
        r.set("method", Method.FULL, r.file(f"model._component_={name}"))
    for key in model:
        if key not in (
            "_component_",
            "lora_attn_modules",
            "apply_lora_to_mlp",
            "apply_lora_to_output",
            "lora_rank",
            "lora_alpha",
            "lora_dropout",
            "use_dora",
            "quantize_base",
        ):
            r.warn(f"ignored: model.{key} (not modelled)")

    dtype = (r.text("dtype") or "fp32").lower()
    table = {"bf16": Precision.BF16, "fp32": Precision.FP32, "fp16": Precision.FP16}
    if dtype not in table:
        raise VramledgerError(f"{r.source}: dtype must be bf16, fp16 or fp32 (got {dtype!r})")
    r.set(
        "precision",
        table[dtype],
        r.file("dtype") + " (every parameter in this dtype, no autocast)"
        if r.has("dtype")
        else r.default("recipes: dtype='fp32'"),
    )

    r.set(
        "micro_batch",
        r.integer("batch_size", 1, minimum=1),
        r.file("batch_size") if r.has("batch_size") else r.default("recipes: cfg.batch_size"),
    )
    r.set(
        "grad_accum",
        r.integer("gradient_accumulation_steps", 1, minimum=1),
        r.file("gradient_accumulation_steps")
        if r.has("gradient_accumulation_steps")
        else r.default("recipes: gradient_accumulation_steps=1"),
    )
    r.set(
        "grad_ckpt",
        bool(r.flag("enable_activation_checkpointing", False)),
        r.file("enable_activation_checkpointing")
        if r.has("enable_activation_checkpointing")
        else r.default("recipes: enable_activation_checkpointing=False"),
    )
    r.ignore("enable_activation_offloading", "offloaded activations are not modelled")
    r.ignore("compile", "torch.compile changes activation memory; estimated without it")
    r.ignore("optimizer_in_bwd", "optimizer steps fused into backward (gradients freed early) are not modelled")
    _distributed(r)
    r.ignore("tensor_parallel_dim", "tensor parallelism is not modelled")

    tok = r.raw.get("tokenizer")
    seq = as_int(tok.get("max_seq_len")) if isinstance(tok, dict) and tok.get("max_seq_len") is not None else None
    if seq is not None and seq < 1:
        raise VramledgerError(f"{r.source}: tokenizer.max_seq_len must be a positive integer")
    if seq is not None:
        r.set("seq_len", seq, r.file("tokenizer.max_seq_len"))
    else:
        r.warn(
            "seq_len: tokenizer.max_seq_len is null, so torchtune does not truncate and the length depends on "
            "your data; estimated at vramledger's default (pass --seq N)"
        )

    data = r.raw.get("dataset")
    packed = isinstance(data, dict) and data.get("packed") is True
    r.set(
        "packing",
        packed,
        r.file("dataset.packed")
        if isinstance(data, dict) and "packed" in data
        else r.default("datasets: packed=False"),
    )
    if packed and seq is None:
        raise VramledgerError(f"{r.source}: dataset.packed needs tokenizer.max_seq_len (torchtune's rule); set it")
    r.used.add("dataset")

    comp, opt = _component(r.value("optimizer"), "optimizer", r) if r.has("optimizer") else ("torch.optim.AdamW", {})
    r.set("optimizer", _optimizer(comp, opt, r), r.file(f"optimizer._component_={comp}"))
    if comp.endswith("SGD"):
        momentum = opt.get("momentum", 0.0)
        if isinstance(momentum, (int, float)) and not isinstance(momentum, bool) and momentum > 0:
            r.set("sgd_momentum", float(momentum), r.file("optimizer.momentum"))

    if r.has("loss"):
        comp, node = _component(r.value("loss"), "loss", r)
        short = comp.rsplit(".", 1)[-1]
        if short in ("LinearCrossEntropyLoss", "CEWithChunkedOutputLoss"):
            chunks = as_int(node.get("num_output_chunks", 8)) or 8
            r.set("loss", Loss.CHUNKED, r.file(f"loss._component_={short}"))
            # chunks split the tokens of a micro-batch (modules/loss/cross_entropy_loss.py num_output_chunks=8)
            tokens = r.fields["micro_batch"] * r.fields.get("seq_len", 2048)
            r.set(
                "loss_chunk_tokens",
                max(1, math.ceil(tokens / chunks)),
                f"default: {TT} (modules/loss num_output_chunks={chunks}: micro batch tokens / chunks)",
            )
        elif short in ("CrossEntropyLoss",):
            r.set("loss", Loss.STANDARD, r.file(f"loss._component_={short}"))
        else:
            r.warn(f"ignored: loss._component_={comp} (not modelled; standard cross-entropy assumed)")
    if r.has("dataset_val") or r.has("run_val_every_n_steps"):
        r.warn("ignored: validation (torchtune's validation loop is not modelled)")
        r.used.add("dataset_val")
    r.finish(HARMLESS)
    return model_name


def _optimizer(comp: str, node: dict[str, Any], r: Reader) -> Optimizer:
    short = comp.rsplit(".", 1)[-1]
    if short in ("AdamW", "Adam"):
        if "bitsandbytes" in comp or "torchao" in comp:
            raise VramledgerError(
                f"{r.source}: optimizer {comp} is not modelled; use torch.optim.AdamW, "
                "bitsandbytes.optim.PagedAdamW8bit/AdamW8bit/PagedAdamW or torch.optim.SGD"
            )
        return (
            Optimizer.ADAMW_FUSED
            if node.get("fused") is True
            else (Optimizer.ADAMW_FORLOOP if node.get("foreach") is False else Optimizer.ADAMW)
        )
    table = {
        "PagedAdamW8bit": Optimizer.PAGED_ADAMW_8BIT,
        "AdamW8bit": Optimizer.ADAMW_8BIT,
        "PagedAdamW": Optimizer.PAGED_ADAMW_32BIT,
        "PagedAdamW32bit": Optimizer.PAGED_ADAMW_32BIT,
        "SGD": Optimizer.SGD,
        "Adafactor": Optimizer.ADAFACTOR,
        "Lion": Optimizer.LION,
    }
    if short in table and (short in ("SGD",) or "bitsandbytes" in comp or short == "Adafactor"):
        return table[short]
    raise VramledgerError(
        f"{r.source}: optimizer {comp} is not modelled; use torch.optim.AdamW, torch.optim.SGD, "
        "bitsandbytes.optim.PagedAdamW8bit, AdamW8bit or PagedAdamW"
    )


def _model_name(r: Reader, base: str) -> str | None:
    """The checkpoint folder when it holds a config.json, else the hub id of the builder."""
    ck = r.raw.get("checkpointer")
    r.used.add("checkpointer")
    if isinstance(ck, dict) and isinstance(ck.get("checkpoint_dir"), str):
        folder = Path(ck["checkpoint_dir"]).expanduser()
        if (folder / "config.json").is_file():
            return str(folder / "config.json")
    hub = BUILDERS.get(base)
    if hub is None:
        r.warn(
            f"model: torchtune builder {base!r} is not in vramledger's table; pass the model's config.json "
            "as the model argument"
        )
    return hub


def _distributed(r: Reader) -> None:
    """The ``*_distributed`` recipes (``full_finetune_distributed.py``, ``lora_finetune_distributed.py``) wrap the
    model with FSDP2 (torchtune training/_distributed.py ``shard_model``: ``fully_shard`` per layer and at the root,
    ``reshard_after_forward=True`` unless ``fsdp_reshard_after_forward: False``; ``fsdp_cpu_offload`` passes
    ``CPUOffloadPolicy``, which keeps parameters, gradients and the optimizer step on the host). Their configs carry
    ``fsdp_cpu_offload``; single-device configs do not. The GPU count comes from ``tune run --nproc_per_node``."""
    from vramledger.specs import Sharding

    if not (r.has("fsdp_cpu_offload") or r.has("fsdp_reshard_after_forward")):
        return
    reshard = r.flag("fsdp_reshard_after_forward", True)
    r.set("fsdp", Sharding.FULL_SHARD if reshard else Sharding.SHARD_GRAD_OP,
          r.file("fsdp_reshard_after_forward") if r.has("fsdp_reshard_after_forward")
          else r.default("training/_distributed.py shard_model: fully_shard, reshard_after_forward=True"))
    r.set("fsdp_version", 2, r.default("training/_distributed.py shard_model: FSDP2 fully_shard"))
    if r.flag("fsdp_cpu_offload", False):
        r.set("offload_params", True, r.file("fsdp_cpu_offload") + " (CPUOffloadPolicy)")
        r.set("offload_optimizer", True, r.file("fsdp_cpu_offload") + " (the optimizer steps on the host)")
