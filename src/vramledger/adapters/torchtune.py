"""torchtune recipe config (``tune run RECIPE --config FILE key=value``) → TrainSpec fields.

Read against torchtune@bd2a0fc (pytorch/torchtune): ``recipes/configs/llama3/8B_lora_single_device.yaml`` and
its siblings, ``recipes/lora_finetune_single_device.py`` / ``full_finetune_distributed.py`` (``dtype`` sets every
parameter's dtype, no autocast; LoRA weights take the same dtype), ``torchtune/modules/loss/`` (chunked losses,
``num_output_chunks=8``) and ``torchtune/models/*/_model_builders.py`` (model builder names).
"""

from __future__ import annotations

import math
from typing import Any

from vramledger.adapters._base import Reader, as_int
from vramledger.errors import VramledgerError
from vramledger.specs import LoadPath, Loss, Method, Optimizer, Precision, QuantSpec
from vramledger.specs.train import LoraSpec
from vramledger.userfiles import path_exists, user_path

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
    # base/instruct builders (torchtune/models/qwen2_5/__init__.py, models/qwen3/_model_builders.py): Qwen2.5's
    # instruct checkpoints are "-Instruct"; Qwen3's instruct builders load the hybrid "Qwen/Qwen3-8B", the base
    # ones "-Base". The catalog resolves each to its shapes (instruct and base share them).
    "qwen2_5_1_5b_base": "Qwen/Qwen2.5-1.5B",
    "qwen2_5_1_5b_instruct": "Qwen/Qwen2.5-1.5B-Instruct",
    "qwen2_5_7b_base": "Qwen/Qwen2.5-7B",
    "qwen2_5_7b_instruct": "Qwen/Qwen2.5-7B-Instruct",
    "qwen2_5_14b_base": "Qwen/Qwen2.5-14B",
    "qwen2_5_14b_instruct": "Qwen/Qwen2.5-14B-Instruct",
    "qwen2_5_32b_base": "Qwen/Qwen2.5-32B",
    "qwen2_5_32b_instruct": "Qwen/Qwen2.5-32B-Instruct",
    "qwen2_5_72b_base": "Qwen/Qwen2.5-72B",
    "qwen2_5_72b_instruct": "Qwen/Qwen2.5-72B-Instruct",
    "qwen3_0_6b_base": "Qwen/Qwen3-0.6B-Base",
    "qwen3_0_6b_instruct": "Qwen/Qwen3-0.6B",
    "qwen3_1_7b_base": "Qwen/Qwen3-1.7B-Base",
    "qwen3_1_7b_instruct": "Qwen/Qwen3-1.7B",
    "qwen3_4b_base": "Qwen/Qwen3-4B-Base",
    "qwen3_4b_instruct": "Qwen/Qwen3-4B",
    "qwen3_8b_base": "Qwen/Qwen3-8B-Base",
    "qwen3_8b_instruct": "Qwen/Qwen3-8B",
    "qwen3_14b_base": "Qwen/Qwen3-14B-Base",
    "qwen3_14b_instruct": "Qwen/Qwen3-14B",
    "phi3_mini": "microsoft/Phi-3-mini-4k-instruct",
    # recipes/configs/phi4/14B_full.yaml, llama4/scout_17B_16E_full.yaml: their ``tune download`` lines
    "phi4_14b": "microsoft/phi-4",
    "llama4_scout_17b_16e": "meta-llama/Llama-4-Scout-17B-16E-Instruct",
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


MODEL_KEYS = (
    "_component_",
    "lora_attn_modules",
    "apply_lora_to_mlp",
    "apply_lora_to_output",
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "use_dora",
    "quantize_base",
)
"""The builder arguments under ``model:`` that are modelled; any other earns a warning."""
PRECISIONS = {"bf16": Precision.BF16, "fp32": Precision.FP32, "fp16": Precision.FP16}
"""``dtype``: every parameter in this dtype, no autocast."""
TOGGLES = (
    ("enable_activation_offloading", "offload_activations"),
    ("compile", "compile"),
    ("optimizer_in_bwd", "optimizer_in_backward"),
)
"""Recipe switches read as given (key, TrainSpec field)."""


def load(r: Reader) -> str | None:
    builder, model = _component(r.value("model"), "model", r)
    name = builder.rsplit(".", 1)[-1]
    # models/llama3/_model_builders.py: qlora_llama3_8b = partial(lora_llama3_8b, quantize_base=True), so a lora_*
    # builder given quantize_base: True (the QDoRA recipes, llama3/8B_qdora_single_device.yaml) is QLoRA too
    qlora = name.startswith("qlora_") or (name.startswith("lora_") and model.get("quantize_base") is True)
    lora = qlora or name.startswith("lora_")
    base = name.split("_", 1)[1] if lora else name
    model_name = _model_name(r, base)
    if lora:
        _lora(r, name, model, qlora)
    else:
        r.set("method", Method.FULL, r.file(f"model._component_={name}"))
    for key in model:
        if key not in MODEL_KEYS:
            r.warn(f"ignored: model.{key} (not modelled)")
    _precision(r)
    _batch(r)
    _distributed(r)
    r.ignore("tensor_parallel_dim", "tensor parallelism is not modelled")
    _shapes(r)
    _optimizer(r)
    _loss(r)
    if r.has("dataset_val") or r.has("run_val_every_n_steps"):
        r.warn("ignored: validation (torchtune's validation loop is not modelled)")
        r.used.add("dataset_val")
    r.finish(HARMLESS)
    return model_name


def _lora(r: Reader, name: str, model: dict[str, Any], qlora: bool) -> None:
    """The ``lora_*`` / ``qlora_*`` builders: method, the LoRA arguments and, for QLoRA, the NF4 base."""
    r.set("method", Method.QLORA if qlora else Method.LORA, r.file(f"model._component_={name}"))
    attn_mods = model.get("lora_attn_modules") or []
    if not isinstance(attn_mods, list) or not all(isinstance(m, str) for m in attn_mods):
        raise VramledgerError(f"{r.source}: model.lora_attn_modules must be a list of names (got {attn_mods!r})")
    targets: list[str] = [_LORA_NAMES.get(m) or m for m in attn_mods]
    if model.get("apply_lora_to_mlp"):
        targets += ["gate_proj", "up_proj", "down_proj"]
    if model.get("apply_lora_to_output"):
        targets.append("lm_head")
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
        r.file("model.lora_rank", "model.lora_attn_modules", "model.apply_lora_to_mlp", "model.apply_lora_to_output")
        + " (LoRA weights in the model dtype: torchtune has no fp32 adapter upcast)",
    )
    if qlora:
        # torchao NF4Tensor: block size 64, scalers double-quantised to int8 (torchtune/modules/low_precision)
        r.set(
            "quant",
            QuantSpec(bits=4, quant_type="nf4", double_quant=True),
            r.file(f"model._component_={name}"),
        )
        r.set(
            "load_path",
            LoadPath.TORCHTUNE,
            r.file(f"model._component_={name}")
            + " (FrozenNF4Linear built in bf16 on the GPU and quantised there by torchao)",
        )


def _precision(r: Reader) -> None:
    dtype = (r.text("dtype") or "fp32").lower()
    if dtype not in PRECISIONS:
        raise VramledgerError(f"{r.source}: dtype must be bf16, fp16 or fp32 (got {dtype!r})")
    r.set(
        "precision",
        PRECISIONS[dtype],
        r.file("dtype") + " (every parameter in this dtype, no autocast)"
        if r.has("dtype")
        else r.default("recipes: dtype='fp32'"),
    )


def _batch(r: Reader) -> None:
    """Micro-batch, accumulation, activation checkpointing and the recipe switches."""
    r.set("micro_batch", r.integer("batch_size", 1, minimum=1), r.origin("batch_size", "recipes: cfg.batch_size"))
    r.set(
        "grad_accum",
        r.integer("gradient_accumulation_steps", 1, minimum=1),
        r.origin("gradient_accumulation_steps", "recipes: gradient_accumulation_steps=1"),
    )
    r.set(
        "grad_ckpt",
        bool(r.flag("enable_activation_checkpointing", False)),
        r.origin("enable_activation_checkpointing", "recipes: enable_activation_checkpointing=False"),
    )
    for key, field in TOGGLES:
        if r.has(key):
            r.used.add(key)
            r.set(field, bool(r.flag(key, False)), r.file(key))


def _shapes(r: Reader) -> None:
    """Sequence length (tokenizer.max_seq_len) and packing (dataset.packed)."""
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


def _optimizer(r: Reader) -> None:
    comp, opt = _component(r.value("optimizer"), "optimizer", r) if r.has("optimizer") else ("torch.optim.AdamW", {})
    r.set("optimizer", _optimizer_of(comp, opt, r), r.file(f"optimizer._component_={comp}"))
    if comp.endswith("SGD"):
        momentum = opt.get("momentum", 0.0)
        if isinstance(momentum, (int, float)) and not isinstance(momentum, bool) and momentum > 0:
            r.set("sgd_momentum", float(momentum), r.file("optimizer.momentum"))


def _loss(r: Reader) -> None:
    if not r.has("loss"):
        return
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


def _optimizer_of(comp: str, node: dict[str, Any], r: Reader) -> Optimizer:
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
        folder = user_path(str(ck["checkpoint_dir"]))
        if path_exists(str(folder / "config.json")) and (folder / "config.json").is_file():
            return str(folder / "config.json")
    hub = BUILDERS.get(base)
    if hub is not None and isinstance(ck, dict) and isinstance(ck.get("checkpoint_dir"), str):
        hub = _checkpoint_named(hub, str(ck["checkpoint_dir"]))
    if hub is None:
        r.extras["unknown_builder"] = base
        r.warn(
            f"model: torchtune builder {base!r} is not in vramledger's table; pass the model's config.json "
            "as the model argument"
        )
    return hub


def _checkpoint_named(hub: str, checkpoint_dir: str) -> str:
    """The checkpoint a config trains, when its folder names a variant of the builder's model: the recipes build
    ``llama3_2_1b`` and load ``tune download meta-llama/Llama-3.2-1B-Instruct`` from ``/tmp/Llama-3.2-1B-Instruct``.
    The folder's name under the builder's organisation is the model's name if the catalog resolves it to the same
    architecture (the estimate then names the model the file trains), else the builder's hub id stays."""
    from pathlib import PurePosixPath

    from vramledger.catalog import catalog_entry

    folder = PurePosixPath(checkpoint_dir.rstrip("/")).name
    if not folder or folder.startswith("<"):
        return hub
    named = f"{hub.split('/')[0]}/{folder}"
    same, base = catalog_entry(named), catalog_entry(hub)
    return named if same is not None and base is not None and same.key == base.key else hub


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
    r.set(
        "fsdp",
        Sharding.FULL_SHARD if reshard else Sharding.SHARD_GRAD_OP,
        r.origin(
            "fsdp_reshard_after_forward",
            "training/_distributed.py shard_model: fully_shard, reshard_after_forward=True",
        ),
    )
    r.set("fsdp_version", 2, r.default("training/_distributed.py shard_model: FSDP2 fully_shard"))
    if r.flag("fsdp_cpu_offload", False):
        r.set("offload_params", True, r.file("fsdp_cpu_offload") + " (CPUOffloadPolicy)")
        r.set("offload_optimizer", True, r.file("fsdp_cpu_offload") + " (the optimizer steps on the host)")
