"""HF ``TrainingArguments`` (as JSON or YAML) → TrainSpec fields. Also used by LLaMA-Factory and TRL, whose
argument classes extend it.

Defaults are transformers 5.23's (``src/transformers/training_args.py``, class ``TrainingArguments``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vramledger.adapters._base import Reader, attn_from_name, optimizer_from_name, set_optimizer
from vramledger.errors import VramledgerError
from vramledger.specs import Loss, Method, Precision

TA = "transformers training_args.py TrainingArguments"

# TrainingArguments keys with no effect on device memory (schedules, logging, saving, data order).
HARMLESS_HF = frozenset(
    [
        "output_dir",
        "overwrite_output_dir",
        "run_name",
        "report_to",
        "logging_dir",
        "logging_strategy",
        "logging_steps",
        "logging_first_step",
        "logging_nan_inf_filter",
        "log_level",
        "log_level_replica",
        "log_on_each_node",
        "save_strategy",
        "save_steps",
        "save_total_limit",
        "save_only_model",
        "save_safetensors",
        "save_on_each_node",
        "resume_from_checkpoint",
        "push_to_hub",
        "hub_model_id",
        "hub_strategy",
        "hub_token",
        "hub_private_repo",
        "hub_always_push",
        "hub_revision",
        "learning_rate",
        "num_train_epochs",
        "max_steps",
        "lr_scheduler_type",
        "lr_scheduler_kwargs",
        "warmup_ratio",
        "warmup_steps",
        "weight_decay",
        "adam_beta1",
        "adam_beta2",
        "adam_epsilon",
        "max_grad_norm",
        "label_smoothing_factor",
        "seed",
        "data_seed",
        "full_determinism",
        "ddp_timeout",
        "ddp_backend",
        "ddp_find_unused_parameters",
        "ddp_bucket_cap_mb",
        "ddp_broadcast_buffers",
        "dataloader_num_workers",
        "dataloader_prefetch_factor",
        "dataloader_drop_last",
        "dataloader_persistent_workers",
        "dataloader_pin_memory",
        "remove_unused_columns",
        "label_names",
        "group_by_length",
        "length_column_name",
        "do_train",
        "eval_steps",
        "eval_delay",
        "eval_on_start",
        "load_best_model_at_end",
        "metric_for_best_model",
        "greater_is_better",
        "disable_tqdm",
        "tf32",
        "include_num_input_tokens_seen",
        "include_tokens_per_second",
        "average_tokens_across_devices",
        "skip_memory_metrics",
        "prediction_loss_only",
        "eval_do_concat_batches",
        "eval_use_gather_object",
        "batch_eval_metrics",
        "local_rank",
        "ignore_data_skip",
        "accelerator_config",
        "restore_callback_states_from_checkpoint",
        "use_cpu",
        "trust_remote_code",
        "dataset_name",
        "dataset_config_name",
        "optim_target_modules",
        "generation_config",
        "generation_num_beams",
        "sortish_sampler",
        "project",
        "trackio_space_id",
    ]
)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerFlags:
    """What the HF Trainer part of a config says, for the DeepSpeed ``auto`` values and the precision choice."""

    bf16: bool
    fp16: bool
    precision_keys: tuple[str, ...]
    """The keys that decided bf16/fp16 (empty: the framework's default)."""
    deepspeed: str | dict[str, Any] | None
    fsdp: Any
    fsdp_config: dict[str, Any] | None


UNMODELLED_TRAINER: tuple[tuple[str, str], ...] = (
    ("auto_find_batch_size", "the Trainer halves the batch after an OOM; estimated at the given batch"),
    ("bf16_full_eval", "evaluation with weights cast to bf16 is not modelled"),
    ("fp16_full_eval", "evaluation with weights cast to fp16 is not modelled"),
    ("torch_empty_cache_steps", "periodic torch.cuda.empty_cache() is not modelled"),
    ("include_for_metrics", "extra tensors kept for metrics are not modelled"),
    ("neftune_noise_alpha", "NEFTune's noise tensor is not modelled"),
)
"""Memory-relevant TrainingArguments keys vramledger does not model, each with the reason its warning gives."""


def read_trainer(
    r: Reader,
    *,
    bf16_default: bool = False,
    bf16_cite: str = f"{TA} bf16=False",
    batch_default: int = 8,
    batch_cite: str = f"{TA} per_device_train_batch_size=8",
    ckpt_default: bool = False,
    ckpt_cite: str = f"{TA} activation_checkpointing=None → False",
    optim_default: str = "adamw_torch_fused",
    optim_cite: str = f"{TA} optim (adamw_torch_fused with torch ≥ 2.8)",
) -> TrainerFlags:
    """Map the TrainingArguments keys onto ``r``; return the precision flags and the distributed settings."""
    _shapes(r, batch_default, batch_cite)
    _checkpointing(r, ckpt_default, ckpt_cite)
    _optimizer(r, optim_default, optim_cite)
    bf16, fp16, keys = _precision_flags(r, bf16_default, bf16_cite)
    _read_eval(r)
    if r.flag("torch_compile", False):  # accepted; estimated as eager with the assumption stated (analytic/loop.py)
        r.set("compile", True, r.file("torch_compile"))
    for key, reason in UNMODELLED_TRAINER:
        r.ignore(key, reason)
    if r.has("attn_implementation"):
        r.set(
            "attn",
            attn_from_name(r.value("attn_implementation"), "attn_implementation", r.source),
            r.file("attn_implementation"),
        )
    deepspeed, fsdp, fsdp_config = _distributed(r)
    return TrainerFlags(
        bf16=bool(bf16),
        fp16=bool(fp16),
        precision_keys=keys,
        deepspeed=deepspeed,
        fsdp=fsdp,
        fsdp_config=fsdp_config,
    )


def _shapes(r: Reader, batch_default: int, batch_cite: str) -> None:
    r.set(
        "micro_batch",
        r.integer("per_device_train_batch_size", batch_default, minimum=1),
        r.origin("per_device_train_batch_size", batch_cite),
    )
    r.set(
        "grad_accum",
        r.integer("gradient_accumulation_steps", 1, minimum=1),
        r.origin("gradient_accumulation_steps", f"{TA} gradient_accumulation_steps=1"),
    )


def _checkpointing(r: Reader, ckpt_default: bool, ckpt_cite: str) -> None:
    # activation_checkpointing is transformers 5's name; gradient_checkpointing its deprecated alias, used only
    # when the new name is unset (TrainingArguments.__post_init__).
    for key in ("activation_checkpointing", "gradient_checkpointing"):
        if r.has(key):
            r.set("grad_ckpt", r.flag(key), r.file(key))
            r.used.update(("activation_checkpointing", "gradient_checkpointing"))
            break
    else:
        r.set("grad_ckpt", ckpt_default, r.default(ckpt_cite))
    for key in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
        kwargs = r.value(key)
        if isinstance(kwargs, dict):
            for sub in ("every_n_layers", "offload"):
                if kwargs.get(sub) not in (None, False, 1):
                    r.warn(f"ignored: {key}.{sub}={kwargs[sub]} (partial or offloaded checkpointing not modelled)")


def _optimizer(r: Reader, optim_default: str, optim_cite: str) -> None:
    """optim, and Liger's fused loss."""
    if r.has("optim"):
        set_optimizer(r, "optim", r.value("optim"), r.file("optim"))
    else:
        r.set("optimizer", optimizer_from_name(optim_default, "optim", r.source), r.default(optim_cite))
    r.ignore("optim_args", "optimizer arguments are not modelled")

    if r.flag("use_liger_kernel", False):
        r.set("loss", Loss.FUSED, r.file("use_liger_kernel"))
    r.ignore("liger_kernel_config", "per-kernel Liger switches are not modelled")


def _precision_flags(r: Reader, bf16_default: bool, bf16_cite: str) -> tuple[bool, bool, tuple[str, ...]]:
    """bf16/fp16 and the keys that set them; the precision itself is the caller's (``precision_from_flags``)."""
    bf16 = r.flag("bf16")
    fp16 = r.flag("fp16", False)
    keys = tuple(k for k in ("bf16", "fp16") if r.has(k))
    if bf16 is None:
        bf16 = bf16_default and not fp16
    if bf16 and fp16:
        raise VramledgerError(
            f"{r.source}: bf16 and fp16 are both true; set one of them (TrainingArguments allows one)"
        )
    if not keys:
        r.provenance["precision"] = r.default(bf16_cite)
    return bf16, fp16, keys


def _distributed(r: Reader) -> tuple[Any, Any, Any]:
    """deepspeed (a path or an inline mapping), fsdp and fsdp_config, handed on to the DeepSpeed/FSDP readers."""
    deepspeed = r.value("deepspeed")
    if deepspeed is not None and not isinstance(deepspeed, (str, dict)):
        raise VramledgerError(f"{r.source}: deepspeed must be a path or a mapping (got {deepspeed!r})")
    fsdp = r.value("fsdp")
    fsdp_config = r.value("fsdp_config")
    if fsdp_config is not None and not isinstance(fsdp_config, dict):
        if isinstance(fsdp_config, str):
            r.warn(
                f"ignored: fsdp_config={fsdp_config} (an FSDP config file path is not read; pass --accelerate-config)"
            )
        else:
            raise VramledgerError(f"{r.source}: fsdp_config must be a mapping (got {fsdp_config!r})")
        fsdp_config = None
    return deepspeed, fsdp, fsdp_config


def _read_eval(r: Reader) -> None:
    """Evaluation runs when do_eval/do_predict is set or eval_strategy is not "no" (TrainingArguments.__post_init__
    sets do_eval=True in that case)."""
    strategy = r.text("eval_strategy") or r.text("evaluation_strategy")
    if strategy is not None and strategy.lower() not in ("no", "steps", "epoch"):
        raise VramledgerError(f"{r.source}: eval_strategy must be no, steps or epoch (got {strategy!r})")
    do_eval = r.flag("do_eval", False)
    do_predict = r.flag("do_predict", False)
    evaluates = do_eval or do_predict or (strategy is not None and strategy.lower() != "no")
    r.extras["evaluates"] = evaluates
    batch = r.integer("per_device_eval_batch_size", minimum=1)
    acc = r.integer("eval_accumulation_steps", minimum=1)
    gen = r.flag("predict_with_generate", False)
    if not evaluates:
        return
    why = [k for k in ("do_eval", "do_predict", "eval_strategy") if r.has(k)]
    if batch is not None:
        r.set("eval_batch", batch, r.file("per_device_eval_batch_size"))
    else:
        r.set(
            "eval_batch",
            8,
            r.default(f"{TA} per_device_eval_batch_size=8; evaluation on via {', '.join(why)}"),
        )
    if acc is not None:
        r.set("eval_accumulation_steps", acc, r.file("eval_accumulation_steps"))
    else:
        r.provenance["eval_accumulation_steps"] = r.default(
            f"{TA} eval_accumulation_steps=None: eval logits stay on the GPU until the loop ends"
        )
    if gen:
        r.set("predict_with_generate", True, r.file("predict_with_generate"))


def precision_from_flags(flags: TrainerFlags, r: Reader, *, method: Method, weights_dtype: str | None) -> None:
    """HF autocast semantics: ``bf16``/``fp16`` autocast the forward; the parameters keep the dtype the model was
    loaded in. ``weights_dtype`` is that load dtype when the config states it (``dtype``/``torch_dtype``)."""
    src = r.file(*flags.precision_keys) if flags.precision_keys else r.provenance.get("precision", "")
    if flags.bf16:
        mixed, true = Precision.BF16_MIXED, Precision.BF16
    elif flags.fp16:
        mixed, true = Precision.FP16_MIXED, Precision.FP16
    else:
        mixed = true = Precision.FP32
    if weights_dtype in ("bfloat16", "float16") and method in (Method.FULL, Method.FREEZE) and mixed.mixed:
        # Trainable weights loaded in half precision stay so: no fp32 master copy under plain autocast.
        r.set("precision", true, f"{src} + file: dtype={weights_dtype}")
    else:
        r.set("precision", mixed, src)


def model_dtype(r: Reader) -> str | None:
    for key in ("dtype", "torch_dtype"):
        if r.has(key):
            v = r.text(key).lower().replace("torch.", "")
            v = {
                "bf16": "bfloat16",
                "fp16": "float16",
                "fp32": "float32",
                "half": "float16",
                "float": "float32",
            }.get(v, v)
            if v not in ("bfloat16", "float16", "float32", "auto"):
                raise VramledgerError(f"{r.source}: {key} must be bfloat16, float16, float32 or auto (got {v!r})")
            r.used.update(("dtype", "torch_dtype"))
            return v
    return None


def load(r: Reader) -> str | None:
    """Plain TrainingArguments (plus the ``model_name_or_path``/``dtype``/``attn_implementation`` keys of the
    example scripts' ModelArguments, when present). Returns the model name if the file names one."""
    flags = read_trainer(r)
    dtype = model_dtype(r)
    r.set(
        "method",
        Method.FULL,
        "default: transformers (the Trainer trains every parameter of a model without PEFT adapters)",
    )
    r.warn(
        "method: TrainingArguments does not say whether the model has PEFT adapters; estimated as full "
        "fine-tuning (pass --method lora if your script wraps it with PEFT)"
    )
    precision_from_flags(flags, r, method=Method.FULL, weights_dtype=dtype)
    if dtype is None and flags.bf16 | flags.fp16:
        r.warn(
            "precision: TrainingArguments does not say how your script loads the model; bf16-mixed assumes "
            "fp32 trainable weights, but transformers 5 loads the checkpoint's dtype by default "
            "(from_pretrained dtype='auto'); if that is bf16, pass --precision bf16-true"
        )
    r.extras["trainer"] = flags
    model = r.text("model_name_or_path")
    r.finish(HARMLESS_HF)
    return model
