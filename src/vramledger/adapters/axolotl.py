"""axolotl YAML → TrainSpec fields.

Defaults read from axolotl@067b021 (axolotl-ai-cloud/axolotl): ``src/axolotl/utils/schemas/config.py``,
``schemas/training.py``, ``schemas/peft.py``, ``utils/config/__init__.py`` (``normalize_config``,
``resolve_dtype``) and ``loaders/model.py`` (the model is loaded in ``cfg.torch_dtype``; the QLoRA
``BitsAndBytesConfig``).
"""

from __future__ import annotations

import re

from vramledger.adapters._base import Reader, attn_from_name, optimizer_from_name, set_optimizer
from vramledger.adapters.hf import TrainerFlags
from vramledger.adapters.peft_config import resumed_adapter
from vramledger.errors import VramledgerError
from vramledger.specs import Attention, LoraSpec, Loss, Method, Precision, QuantSpec

HARMLESS = frozenset(
    [
        "base_model",
        "base_model_config",
        "model_type",
        "tokenizer_type",
        "tokenizer_config",
        "revision_of_model",
        "trust_remote_code",
        "datasets",
        "test_datasets",
        "dataset_prepared_path",
        "dataset_processes",
        "shuffle_merged_datasets",
        "output_dir",
        "hub_model_id",
        "hub_strategy",
        "push_dataset_to_hub",
        "wandb_project",
        "wandb_entity",
        "wandb_watch",
        "wandb_name",
        "wandb_log_model",
        "wandb_run_id",
        "mlflow_tracking_uri",
        "mlflow_experiment_name",
        "use_tensorboard",
        "comet_api_key",
        "num_epochs",
        "max_steps",
        "learning_rate",
        "lr_scheduler",
        "lr_scheduler_kwargs",
        "cosine_min_lr_ratio",
        "warmup_ratio",
        "warmup_steps",
        "weight_decay",
        "adam_beta1",
        "adam_beta2",
        "adam_epsilon",
        "max_grad_norm",
        "logging_steps",
        "evals_per_epoch",
        "eval_steps",
        "saves_per_epoch",
        "save_steps",
        "save_strategy",
        "save_total_limit",
        "save_first_step",
        "save_safetensors",
        "save_only_model",
        "early_stopping_patience",
        "resume_from_checkpoint",
        "auto_resume_from_checkpoints",
        "special_tokens",
        "tokens",
        "chat_template",
        "default_system_message",
        "train_on_inputs",
        "group_by_length",
        "seed",
        "strict",
        "debug",
        "local_rank",
        "tf32",
        "lora_alpha",
        "lora_fan_in_fan_out",
        "peft_use_rslora",
        "lora_on_cpu",
        "dataloader_num_workers",
        "dataloader_pin_memory",
        "dataloader_prefetch_factor",
        "ddp_timeout",
        "ddp_bucket_cap_mb",
        "ddp_broadcast_buffers",
        "is_llama_derived_model",
        "is_mistral_derived_model",
        "is_falcon_derived_model",
        "is_qwen_derived_model",
        "plugins",
        "gradient_checkpointing_kwargs",
        "eval_table_size",
        "eval_causal_lm_metrics",
        "do_causal_lm_eval",
        "loss_watchdog_threshold",
        "loss_watchdog_patience",
        "include_tokens_per_second",
        "pad_to_sequence_len",
        "sample_packing_eff_est",
        "sample_packing_group_size",
        "sample_packing_bin_size",
        "sequence_len_overflow_handling",
        "excess_length_strategy",
        "skip_prepare_dataset",
        "remove_unused_columns",
        "deduplicate",
        "dataset_exact_deduplication",
        "embeddings_skip_upcast",
        "bnb_config_kwargs",
        "multipack_real_batches",
        "curriculum_sampling",
        "use_wandb",
        "val_set_size",
    ]
)
AX = "axolotl"

LORA_KEYS = (
    "lora_r",
    "lora_alpha",
    "lora_target_linear",
    "lora_target_modules",
    "lora_dropout",
    "peft_use_dora",
    "lora_modules_to_save",
    "lora_target_parameters",
)
"""The keys that make the LoraSpec, in the order its provenance names them."""
IGNORED_ATTENTION = ("xformers_attention", "flex_attention", "s2_attention")
"""Attention implementations axolotl patches in that vramledger does not model."""
IGNORED_KERNELS = (
    "liger_rope",
    "liger_rms_norm",
    "liger_glu_activation",
    "liger_layer_norm",
    "liger_cross_entropy",
    "chunked_cross_entropy",
    "chunked_cross_entropy_num_chunks",
    "tiled_mlp",
    "torch_compile",
)
"""Kernels whose activation savings vramledger does not model."""
UNMODELLED: tuple[tuple[str, str], ...] = (
    ("rl", "preference/RL training (reference model, paired batches) is not modelled"),
    ("reward_model", "reward model training is not modelled"),
    ("relora", "ReLoRA is not modelled"),
    ("context_parallel_size", "context parallelism is not modelled"),
    ("tensor_parallel_size", "tensor parallelism is not modelled"),
    ("sequence_parallel_degree", "sequence parallelism is not modelled"),
    ("fp8", "fp8 training is not modelled"),
    ("qat", "quantisation-aware training is not modelled"),
    ("gptq", "GPTQ bases are not modelled"),
    ("neftune_noise_alpha", "NEFTune's noise is not modelled"),
    ("resize_token_embeddings_to_32x", "resized embeddings are not modelled"),
    ("unsloth_lora_mlp", "Unsloth kernels are not modelled"),
    ("unsloth_lora_qkv", "Unsloth kernels are not modelled"),
    ("unsloth_lora_o", "Unsloth kernels are not modelled"),
    ("lora_mlp_kernel", "LoRA kernels are not modelled"),
    ("lora_qkv_kernel", "LoRA kernels are not modelled"),
    ("lora_o_kernel", "LoRA kernels are not modelled"),
    ("torch_empty_cache_steps", "periodic empty_cache is not modelled"),
    ("auto_find_batch_size", "batch halving after an OOM is not modelled"),
    ("world_size", "axolotl reads WORLD_SIZE from the launcher; pass world_size=N as an override"),
)
"""Memory-relevant keys vramledger does not model, each with the reason its warning gives."""


def load(r: Reader) -> str | None:
    model = r.text("base_model")
    method, adapter, eight = _method(r)
    if adapter:
        _lora(r, adapter)
    prec = _precision(r, method, eight)
    _shapes(r)
    _checkpointing(r)
    _optimizer(r)
    _attention(r)
    _evaluation(r)
    for key, reason in UNMODELLED:
        r.ignore(key, reason)
    _distributed(r, prec)
    r.finish(HARMLESS)
    return model


def _method(r: Reader) -> tuple[Method, str, bool]:
    """The method (full, LoRA, QLoRA) and the quantised base; returns the method, the adapter and 8-bit."""
    adapter = (r.text("adapter") or "").lower()
    four, eight = r.flag("load_in_4bit", False), r.flag("load_in_8bit", False)
    if adapter not in ("", "lora", "qlora"):
        raise VramledgerError(f"{r.source}: adapter {adapter!r} is not modelled; use lora or qlora (or none for full)")
    if four and eight:
        raise VramledgerError(f"{r.source}: load_in_4bit and load_in_8bit are both true; set one")
    if adapter == "qlora" and not four:
        raise VramledgerError(f"{r.source}: adapter: qlora needs load_in_4bit: true (axolotl's rule); add it")
    if not adapter and (four or eight):
        raise VramledgerError(f"{r.source}: a 4/8-bit base trains only with an adapter; add adapter: lora or qlora")
    if not adapter:
        r.set("method", Method.FULL, r.default("schemas/peft.py adapter=None: full fine-tuning"))
        r.ignore("unfrozen_parameters", "training only some parameters is modelled as full fine-tuning")
        return Method.FULL, adapter, eight
    method = Method.QLORA if (four or eight) else Method.LORA
    r.set(
        "method",
        method,
        r.file("adapter", *(["load_in_4bit"] if four else ["load_in_8bit"] if eight else [])),
    )
    if four or eight:
        # loaders/model.py: qlora + load_in_4bit → BitsAndBytesConfig(nf4, bnb_4bit_use_double_quant=True)
        kwargs = r.mapping("bnb_config_kwargs") or {}
        qtype = str(kwargs.get("bnb_4bit_quant_type", "nf4")).lower()
        dq = kwargs.get("bnb_4bit_use_double_quant", True)
        r.set(
            "quant",
            QuantSpec(bits=4 if four else 8, quant_type=qtype, double_quant=bool(dq) and four),
            r.file("load_in_4bit" if four else "load_in_8bit")
            + (
                f" (loaders/model.py BitsAndBytesConfig: {qtype}{', double quant' if dq else ''})"
                if four
                else " (loaders/model.py BitsAndBytesConfig(load_in_8bit=True): int8 LLM.int8() Linear8bitLt)"
            ),
        )
    return method, adapter, eight


def _lora(r: Reader, adapter: str) -> None:
    rank = r.integer("lora_r")
    if rank is None:
        raise VramledgerError(f"{r.source}: lora_r is required with adapter: {adapter}; add e.g. lora_r: 16")
    raw_targets = r.value("lora_target_modules")
    if isinstance(raw_targets, str) and re.search(r"[\\\[\](){}|*+?^$]", raw_targets):
        # loaders/adapter.py _build_peft_lora_config hands a string to PEFT's LoraConfig as it is, and PEFT
        # matches a string in full against every module's name (tuners_utils.py check_target_module_exists)
        raise VramledgerError(
            f"{r.source}: lora_target_modules '{raw_targets}' is a regular expression (PEFT matches it against whole "
            "module names), which vramledger does not evaluate; name the modules it selects instead, e.g. "
            "lora_target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"
        )
    targets = ("all",) if r.flag("lora_target_linear", False) else r.names("lora_target_modules")
    # loaders/adapter.py _build_peft_lora_config: LoraConfig(target_modules=cfg.lora_target_modules or [],
    # target_parameters=cfg.lora_target_parameters or []), which PEFT matches as analytic/target_parameters.py reads
    parameters = r.names("lora_target_parameters") or ()
    if targets is None and not parameters:
        raise VramledgerError(
            f"{r.source}: set lora_target_linear: true, lora_target_modules or lora_target_parameters (axolotl needs "
            "one)"
        )
    r.used.update(("lora_target_modules", "lora_target_parameters"))
    alpha = r.number("lora_alpha")
    r.set(
        "lora",
        LoraSpec(
            rank=rank,
            alpha=alpha if alpha is not None else float(rank),
            targets=targets or (),
            dropout=r.number("lora_dropout", 0.0),
            dora=bool(r.flag("peft_use_dora", False)),
            modules_to_save=r.names("lora_modules_to_save") or (),
            parameters=parameters,
        ),
        r.file(*[k for k in LORA_KEYS if r.has(k)]),
    )
    lora_dir = r.text("lora_model_dir")
    if lora_dir:
        # loaders/adapter.py load_lora: PeftModel.from_pretrained(model, cfg.lora_model_dir, is_trainable=True)
        resumed_adapter(r, "lora_model_dir", lora_dir, r.fields.get("method", Method.LORA))
    r.ignore("peft_layers_to_transform", "adapters on a subset of layers are not modelled")


def _precision(r: Reader, method: Method, eight: bool) -> Precision:
    # resolve_dtype turns bf16: auto into true on a bf16-capable GPU; the model loads in cfg.torch_dtype
    # (bf16 → bfloat16) and the Trainer autocasts, so full fine-tuning keeps bf16 weights; PEFT adapters stay fp32.
    bf16 = r.value("bf16")
    fp16 = r.flag("fp16", False)
    if bf16 is None:
        bf16 = "auto"
    if bf16 != "auto":
        bf16 = r.flag("bf16")
    float32 = r.flag("float32", False)
    bfloat16, float16 = r.flag("bfloat16", False), r.flag("float16", False)
    if bf16 == "auto":
        bf16 = not fp16
        bprov = (
            r.file("bf16") + " (auto: utils/config resolve_dtype → true on a bf16 GPU)"
            if r.has("bf16")
            else r.default("schemas/config.py bf16='auto' → true on a bf16 GPU")
        )
    else:
        bprov = r.file("bf16")
    if bf16 or bfloat16:
        prec = Precision.BF16 if method is Method.FULL else Precision.BF16_MIXED
    elif fp16 or float16 or eight:
        prec = Precision.FP16 if method is Method.FULL else Precision.FP16_MIXED
    else:
        prec = Precision.FP32
    if float32 and prec is not Precision.FP32:
        prec = Precision.BF16_MIXED if bf16 else Precision.FP16_MIXED
    r.set(
        "precision",
        prec,
        bprov + (" + file: fp16" if fp16 else "") + " (loaders/model.py loads weights in cfg.torch_dtype)",
    )
    return prec


def _shapes(r: Reader) -> None:
    """Micro-batch, accumulation, sequence length and packing."""
    r.set(
        "micro_batch",
        r.integer("micro_batch_size", 1, minimum=1),
        r.origin("micro_batch_size", "schemas/training.py micro_batch_size=1"),
    )
    if r.has("gradient_accumulation_steps"):
        r.set(
            "grad_accum",
            r.integer("gradient_accumulation_steps", minimum=1),
            r.file("gradient_accumulation_steps"),
        )
    elif r.has("batch_size"):
        total = r.integer("batch_size", minimum=1)
        r.set(
            "grad_accum",
            max(1, total // r.fields["micro_batch"]),
            r.file("batch_size") + " / micro_batch_size",
        )
    else:
        r.set("grad_accum", 1, r.default("schemas/training.py gradient_accumulation_steps=1"))
    r.used.add("batch_size")
    r.set(
        "seq_len",
        r.integer("sequence_len", 512, minimum=1),
        r.origin("sequence_len", "schemas/config.py sequence_len=512"),
    )
    r.set(
        "packing",
        bool(r.flag("sample_packing", False)),
        r.origin("sample_packing", "schemas/config.py sample_packing=None (off)"),
    )


def _checkpointing(r: Reader) -> None:
    gc = r.value("gradient_checkpointing")
    if gc in ("offload", "offload_disk"):
        r.set("grad_ckpt", True, r.file("gradient_checkpointing"))
        r.warn(
            f"ignored: gradient_checkpointing={gc} (offloading the checkpoints is not modelled; estimated as "
            "plain checkpointing)"
        )
    else:
        r.set(
            "grad_ckpt",
            bool(r.flag("gradient_checkpointing", False)),
            r.origin("gradient_checkpointing", "schemas/config.py gradient_checkpointing=False"),
        )
    r.ignore("activation_offloading", "offloaded activations are not modelled")


def _optimizer(r: Reader) -> None:
    if r.has("optimizer"):
        set_optimizer(r, "optimizer", r.value("optimizer"), r.file("optimizer"))
    else:
        r.set(
            "optimizer",
            optimizer_from_name("adamw_torch_fused", "optimizer", r.source),
            r.default("schemas/training.py optimizer='adamw_torch_fused'"),
        )
    r.ignore("optim_args", "optimizer arguments are not modelled")


def _attention(r: Reader) -> None:
    """The attention implementation and the fused loss kernels."""
    if r.has("attn_implementation"):
        r.set(
            "attn",
            attn_from_name(r.value("attn_implementation"), "attn_implementation", r.source),
            r.file("attn_implementation"),
        )
    elif r.flag("flash_attention", False):
        r.set("attn", Attention.FLASH2, r.file("flash_attention"))
    elif r.flag("sdp_attention", False):
        r.set("attn", Attention.SDPA, r.file("sdp_attention"))
    else:
        r.set("attn", Attention.SDPA, "default: transformers (attn_implementation unset → sdpa)")
    for key in IGNORED_ATTENTION:
        r.ignore(key, "this attention implementation is not modelled")
    r.ignore("eager_attention", "modelled as sdpa unless attn_implementation: eager")

    if r.flag("liger_fused_linear_cross_entropy", False) or r.flag("cut_cross_entropy", False):
        key = "liger_fused_linear_cross_entropy" if r.has("liger_fused_linear_cross_entropy") else "cut_cross_entropy"
        r.set("loss", Loss.FUSED, r.file(key))
    for key in IGNORED_KERNELS:
        r.ignore(key, "this kernel's activation savings are not modelled")


def _evaluation(r: Reader) -> None:
    """val_set_size > 0 or test_datasets; eval_batch_size defaults to micro_batch_size (utils/config
    normalize_config)."""
    val = r.number("val_set_size", 0.0)
    evaluates = (val or 0) > 0 or r.has("test_datasets")
    strategy = r.text("eval_strategy")
    if strategy is not None and strategy.lower() == "no":
        evaluates = False
    if evaluates:
        if r.has("eval_batch_size"):
            r.set("eval_batch", r.integer("eval_batch_size", minimum=1), r.file("eval_batch_size"))
        else:
            r.set(
                "eval_batch",
                r.fields["micro_batch"],
                r.default("utils/config normalize_config eval_batch_size = micro_batch_size"),
            )
        if r.has("eval_sequence_len"):
            r.set("eval_seq_len", r.integer("eval_sequence_len", minimum=1), r.file("eval_sequence_len"))
        if r.has("eval_accumulation_steps"):
            r.set(
                "eval_accumulation_steps",
                r.integer("eval_accumulation_steps", minimum=1),
                r.file("eval_accumulation_steps"),
            )
    r.used.update(
        ("eval_batch_size", "eval_sequence_len", "eval_accumulation_steps", "eval_sample_packing", "test_datasets")
    )
    r.ignore("eval_max_new_tokens", "generation during eval is not modelled")


def _distributed(r: Reader, prec: Precision) -> None:
    """DeepSpeed and FSDP, handed on as the Trainer flags the DeepSpeed/FSDP readers take."""
    ds = r.value("deepspeed")
    if ds is not None and not isinstance(ds, (str, dict)):
        raise VramledgerError(f"{r.source}: deepspeed must be a path or a mapping (got {ds!r})")
    fc = r.value("fsdp_config")
    if fc is not None and not isinstance(fc, dict):
        raise VramledgerError(f"{r.source}: fsdp_config must be a mapping (got {fc!r})")
    if isinstance(fc, dict) and fc.get("fsdp_version") is None and r.has("fsdp_version"):
        fc = {**fc, "fsdp_version": r.integer("fsdp_version")}
    r.used.add("fsdp_version")
    half = prec.compute
    r.extras["trainer"] = TrainerFlags(
        bf16=half.value == "bf16",
        fp16=half.value == "fp16",
        precision_keys=("bf16",),
        deepspeed=ds,
        fsdp=r.value("fsdp") or (["full_shard"] if fc else None),
        fsdp_config=fc,
    )
