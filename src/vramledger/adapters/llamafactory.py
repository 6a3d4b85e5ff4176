"""LLaMA-Factory train YAML (``llamafactory-cli train FILE key=value …``) → TrainSpec fields.

Defaults read from LLaMA-Factory 0.9.6.dev0 (hiyouga/LLaMA-Factory@ff6d4d1), ``src/llamafactory/``:
``hparams/model_args.py``, ``hparams/finetuning_args.py``, ``hparams/data_args.py``, ``hparams/parser.py``,
``model/adapter.py``, ``model/model_utils/checkpointing.py`` and ``model/model_utils/attention.py``. Its
TrainingArguments extend transformers' (``hparams/training_args.py``), so the trainer keys follow ``hf.py``.
"""

from __future__ import annotations

from vramledger.adapters import hf
from vramledger.adapters._base import Reader
from vramledger.adapters.peft_config import resumed_adapter
from vramledger.errors import VramledgerError
from vramledger.specs import Attention, LoraSpec, Loss, Method, Precision, QuantSpec

LF = "llamafactory"

HARMLESS = hf.HARMLESS_HF | frozenset(
    [
        "model_name_or_path",
        "trust_remote_code",
        "dataset",
        "eval_dataset",
        "dataset_dir",
        "media_dir",
        "template",
        "max_samples",
        "overwrite_cache",
        "preprocessing_num_workers",
        "preprocessing_batch_size",
        "plot_loss",
        "ddp_timeout",
        "train_on_prompt",
        "mask_history",
        "streaming",
        "buffer_size",
        "mix_strategy",
        "interleave_probs",
        "ignore_pad_token_for_loss",
        "tool_format",
        "default_system",
        "enable_thinking",
        "tokenized_path",
        "cache_dir",
        "use_fast_tokenizer",
        "split_special_tokens",
        "model_revision",
        "low_cpu_mem_usage",
        "hf_hub_token",
        "ms_hub_token",
        "om_hub_token",
        "print_param_status",
        "compute_accuracy",
        "disable_shuffling",
        "early_stopping_steps",
        "include_effective_tokens_per_second",
        "use_swanlab",
        "swanlab_project",
        "swanlab_workspace",
        "swanlab_run_name",
        "swanlab_mode",
        "swanlab_api_key",
        "swanlab_logdir",
        "lora_alpha",
        "use_rslora",
        "loraplus_lr_ratio",
        "loraplus_lr_embedding",
        "create_new_adapter",
        "eval_on_each_dataset",
        "val_size",
        "pref_beta",
        "pref_ftx",
        "pref_loss",
        "dpo_label_smoothing",
        "kto_chosen_weight",
        "kto_rejected_weight",
        "simpo_gamma",
        "eval_num_beams",
        "data_shared_file_system",
        "moe_aux_loss_coef",
        "use_reentrant_gc",
        "infer_backend",
        "infer_dtype",
        "do_sample",
        "temperature",
        "top_p",
        "top_k",
        "num_beams",
        "repetition_penalty",
        "length_penalty",
        "skip_special_tokens",
        "default_system",
        "preserve_thinking",
        "upcast_layernorm",
    ]
)
# use_reentrant_gc: reentrant or not, both checkpoint per decoder layer. upcast_layernorm: 1-D norm weights only.


UNMODELLED: tuple[tuple[str, str], ...] = (
    ("use_galore", "GaLore's projected optimizer states are not modelled"),
    ("use_apollo", "APOLLO's optimizer states are not modelled"),
    ("use_badam", "BAdam's block-wise optimizer is not modelled"),
    ("use_adam_mini", "Adam-mini's reduced second moments are not modelled"),
    ("use_muon", "Muon's optimizer states are not modelled"),
    ("use_llama_pro", "LLaMA Pro's expanded blocks are not modelled"),
    ("use_unsloth", "Unsloth's kernels are not modelled"),
    ("use_unsloth_gc", "Unsloth's offloaded checkpointing is not modelled"),
    ("upcast_lmhead_output", "fp32 logits from lm_head are not modelled"),
    ("shift_attn", "LongLoRA shift attention is not modelled"),
    ("mixture_of_depths", "mixture-of-depths is not modelled"),
    ("rope_scaling", "RoPE scaling leaves memory unchanged but may imply a longer cutoff_len"),
    ("train_from_scratch", "random init is not modelled (memory is the same)"),
    ("fp8", "fp8 training is not modelled"),
    ("use_kt", "KTransformers CPU experts are not modelled"),
    ("use_mca", "Megatron-Core training is not modelled"),
    ("use_megatron_bridge", "Megatron Bridge training is not modelled"),
    ("use_hyper_parallel", "hyper-parallel training is not modelled"),
    ("resize_vocab", "a resized vocabulary is not modelled"),
    ("add_tokens", "added tokens are not modelled"),
    ("add_special_tokens", "added tokens are not modelled"),
    ("ref_model", "the reference model is not modelled"),
    ("reward_model", "the reward model is not modelled"),
    ("enable_torch_profiler", "the profiler's buffers are not modelled"),
)
"""Memory-relevant keys vramledger does not model, each with the reason its warning gives."""
LORA_KEYS = ("lora_rank", "lora_alpha", "lora_target", "lora_dropout", "use_dora", "pure_bf16", "additional_target")
"""The keys that make the LoraSpec, in the order its provenance names them."""
ATTENTION = {
    "auto": Attention.SDPA,
    "sdpa": Attention.SDPA,
    "disabled": Attention.EAGER,
    "fa2": Attention.FLASH2,
    "fa3": Attention.FLASH2,
}
"""``flash_attn`` values (hparams/model_args.py ``AttentionFunction``); ``auto`` leaves transformers' choice."""


def load(r: Reader) -> str | None:
    model = r.text("model_name_or_path")
    stage = _stage(r)
    method = _method(r)
    pure_bf16 = r.flag("pure_bf16", False)
    _lora(r, method, pure_bf16)
    _freeze(r, method)
    for key, reason in UNMODELLED:
        r.ignore(key, reason)
    flags = _trainer(r)
    _precision(r, method, flags, pure_bf16)
    _shapes(r, stage)
    _attention(r)
    _evaluation(r)
    _images(r)
    r.finish(HARMLESS)
    return model


def _stage(r: Reader) -> str:
    stage = (r.text("stage") or "sft").lower()
    if stage not in ("pt", "sft", "rm", "ppo", "dpo", "kto"):
        raise VramledgerError(f"{r.source}: stage must be one of pt, sft, rm, ppo, dpo, kto (got {stage!r})")
    if stage in ("ppo", "dpo", "kto", "rm"):
        r.warn(
            f"stage {stage}: reference/reward/value models and paired batches are not modelled; estimated as "
            "supervised fine-tuning of one model"
        )
    return stage


def _method(r: Reader) -> Method:
    """finetuning_type, and QLoRA when quantization_bit is set."""
    ftype = (r.text("finetuning_type") or "lora").lower()
    prov_method = r.origin("finetuning_type", "hparams/finetuning_args.py finetuning_type='lora'")
    if ftype not in ("lora", "freeze", "full"):
        raise VramledgerError(f"{r.source}: finetuning_type {ftype!r} is not modelled; use lora, freeze or full")

    bits = r.integer("quantization_bit")
    qmethod = (r.text("quantization_method") or "bnb").lower()
    method = {"lora": Method.LORA, "freeze": Method.FREEZE, "full": Method.FULL}[ftype]
    if bits is not None:
        if qmethod != "bnb":
            raise VramledgerError(
                f"{r.source}: quantization_method {qmethod!r} is not modelled; use bnb (bitsandbytes)"
            )
        if bits not in (4, 8):
            raise VramledgerError(f"{r.source}: quantization_bit must be 4 or 8 for bitsandbytes (got {bits})")
        if method is not Method.LORA:
            raise VramledgerError(
                f"{r.source}: quantised models train only with finetuning_type: lora "
                "(model/adapter.py); remove quantization_bit or use lora"
            )
        method = Method.QLORA
        qtype = (r.text("quantization_type") or "nf4").lower()
        r.set(
            "quant",
            QuantSpec(bits=bits, quant_type=qtype, double_quant=r.flag("double_quantization", True)),
            r.file("quantization_bit")
            + (" (defaults: hparams/model_args.py quantization_type='nf4', double_quantization=True)"),
        )
    else:
        for key in ("quantization_type", "double_quantization", "quantization_method"):
            r.used.add(key)
    r.set("method", method, prov_method + (" + file: quantization_bit" if bits is not None else ""))
    r.ignore("quantization_device_map", "device map of a quantised model is not modelled")
    return method


def _lora(r: Reader, method: Method, pure_bf16: bool) -> None:
    if method not in (Method.LORA, Method.QLORA):
        r.used.update(("lora_rank", "lora_target", "lora_dropout", "use_dora", "additional_target"))
        r.used.add("adapter_name_or_path")
        return
    rank = r.integer("lora_rank", 8)
    alpha = r.number("lora_alpha")
    r.set(
        "lora",
        LoraSpec(
            rank=rank,
            alpha=alpha if alpha is not None else 2.0 * rank,  # finetuning_args.py: lora_alpha or lora_rank * 2
            targets=r.names("lora_target") or ("all",),
            dropout=r.number("lora_dropout", 0.0),
            dora=r.flag("use_dora", False),
            # model/adapter.py passes autocast_adapter_dtype=cast_trainable_params_to_fp32, False under pure_bf16
            adapter_fp32=not pure_bf16,
            # model/adapter.py _setup_lora_tuning: additional_target becomes PEFT's modules_to_save
            modules_to_save=r.names("additional_target") or (),
        ),
        _present(r, *LORA_KEYS)
        + " (defaults: hparams/finetuning_args.py lora_rank=8, lora_alpha=2·rank, lora_target='all', "
        "lora_dropout=0)",
    )
    r.ignore("pissa_init", "PiSSA's SVD at start-up is not modelled")
    _resumed_adapter(r, method)


def _resumed_adapter(r: Reader, method: Method) -> None:
    """model/adapter.py _setup_lora_tuning: with ``adapter_name_or_path`` (and no ``create_new_adapter``) the last
    adapter listed is loaded with ``PeftModel.from_pretrained(..., is_trainable=True)`` and trained on; the others
    are merged into the base."""
    paths = r.names("adapter_name_or_path")
    if not paths:
        return
    if r.flag("create_new_adapter", False):
        r.warn("adapter_name_or_path with create_new_adapter: the given adapters are merged and a new LoRA trains")
        return
    resumed_adapter(r, "adapter_name_or_path", paths[-1], method)


def _freeze(r: Reader, method: Method) -> None:
    """finetuning_type: freeze trains the last freeze_trainable_layers layers."""
    if method is not Method.FREEZE:
        r.used.update(("freeze_trainable_layers", "freeze_trainable_modules", "freeze_extra_modules"))
        return
    n = r.integer("freeze_trainable_layers", 2)
    if n < 0:
        r.warn(f"freeze_trainable_layers={n}: the first {-n} layers train; modelled as {-n} trainable layers")
    r.set(
        "freeze_trainable_layers",
        abs(n),
        r.origin("freeze_trainable_layers", "hparams/finetuning_args.py freeze_trainable_layers=2"),
    )
    mods = r.names("freeze_trainable_modules")
    if mods and mods != ("all",):
        r.warn(f"ignored: freeze_trainable_modules={','.join(mods)} (modelled as whole layers training)")
    r.ignore("freeze_extra_modules", "extra trainable modules are not modelled")


def _trainer(r: Reader) -> hf.TrainerFlags:
    """The HF TrainingArguments keys, and LLaMA-Factory's own switch for gradient checkpointing."""
    flags = hf.read_trainer(
        r,
        bf16_cite=f"{hf.TA} bf16=False",
        ckpt_default=True,
        ckpt_cite="model/model_utils/checkpointing.py prepare_model_for_training: on unless "
        "disable_gradient_checkpointing (hparams/model_args.py default False)",
    )
    if r.has("disable_gradient_checkpointing"):
        r.set(
            "grad_ckpt",
            not r.flag("disable_gradient_checkpointing"),
            r.file("disable_gradient_checkpointing"),
        )
    elif r.has("gradient_checkpointing") or r.has("activation_checkpointing"):
        # LLaMA-Factory enables checkpointing itself; the Trainer flag only adds to it.
        r.set(
            "grad_ckpt",
            True,
            r.default("model/model_utils/checkpointing.py: on unless disable_gradient_checkpointing"),
        )
    r.extras["trainer"] = flags
    return flags


def _precision(r: Reader, method: Method, flags: hf.TrainerFlags, pure_bf16: bool) -> None:
    # parser.py sets compute_dtype bf16 if bf16 or pure_bf16; model/adapter.py keeps trainable params fp32
    # (cast_trainable_params_to_fp32) unless pure_bf16.
    if pure_bf16:
        r.set("precision", Precision.BF16, r.file("pure_bf16"))
    elif flags.bf16 or flags.fp16:
        r.set(
            "precision",
            Precision.BF16_MIXED if flags.bf16 else Precision.FP16_MIXED,
            r.file(*flags.precision_keys) + " (model/adapter.py: trainable params upcast to fp32 unless pure_bf16)",
        )
    elif method is Method.FULL:
        r.set(
            "precision",
            Precision.FP32,
            r.default("no bf16/fp16: every parameter trains in fp32 (model/adapter.py cast_trainable_params_to_fp32)"),
        )
    else:
        r.set(
            "precision",
            Precision.BF16_MIXED,
            r.default(
                "no bf16/fp16: model/patcher.py infers a bf16 compute dtype for the frozen weights, trainable ones "
                "upcast to fp32"
            ),
        )
        r.warn(
            "precision: no bf16/fp16 in the file; LLaMA-Factory loads frozen weights in the inferred dtype "
            "(bf16 where supported) without autocast; modelled as bf16-mixed"
        )


def _shapes(r: Reader, stage: str) -> None:
    """Sequence length and packing: data_args.py cutoff_len=2048; parser.py packing = stage == "pt" when unset."""
    r.set(
        "seq_len",
        r.integer("cutoff_len", 2048, minimum=1),
        r.origin("cutoff_len", "hparams/data_args.py cutoff_len=2048"),
    )
    if r.has("packing"):
        r.set("packing", r.flag("packing"), r.file("packing"))
    else:
        r.set("packing", stage == "pt", r.default(f"hparams/parser.py packing = stage == 'pt' (stage {stage})"))
    if r.flag("neat_packing", False):
        r.set("packing", True, r.file("neat_packing"))


def _attention(r: Reader) -> None:
    """flash_attn, and Liger's fused loss."""
    fa = (r.text("flash_attn") or "auto").lower()
    if fa not in ATTENTION:
        raise VramledgerError(f"{r.source}: flash_attn must be auto, disabled, sdpa, fa2 or fa3 (got {fa!r})")
    r.set(
        "attn",
        ATTENTION[fa],
        r.origin("flash_attn", "hparams/model_args.py flash_attn='auto' → transformers' default sdpa"),
    )
    if r.flag("enable_liger_kernel", False):
        r.set("loss", Loss.FUSED, r.file("enable_liger_kernel"))


def _evaluation(r: Reader) -> None:
    """Generation during evaluation (the rest of evaluation is HF's, read by ``hf.read_trainer``)."""
    if r.fields.get("predict_with_generate") or r.extras.get("evaluates") and r.flag("predict_with_generate", False):
        n = r.integer("max_new_tokens", 1024, minimum=1)
        r.set(
            "generation_max_new_tokens",
            n,
            r.origin("max_new_tokens", "hparams/generating_args.py max_new_tokens=1024"),
        )
    else:
        r.used.update(("max_new_tokens", "max_length"))


# Templates (data/template.py register_template) whose mm_plugin feeds a vision tower vramledger models.
_IMAGE_TEMPLATES = ("qwen2_vl", "qwen2_vl_nothink", "qwen3_vl", "qwen3_vl_nothink", "gemma3", "llama4")


def _images(r: Reader) -> None:
    """Images per sample and their size (hparams/model_args.py ``image_max_pixels`` 768², ``image_min_pixels``
    32², applied by data/mm_plugin.py ``_preprocess_image`` before the processor), the frozen tower
    (hparams/finetuning_args.py ``freeze_vision_tower``/``freeze_multi_modal_projector`` true), and
    ``cutoff_len``, which counts the image tokens (data/processor/supervised.py truncates after the mm_plugin
    expanded the placeholders). How many images a sample holds is the dataset's: not in the config. A text-only
    config (no multimodal template, no image key) is left as it is; the flag-only preset takes the defaults."""
    template = (r.text("template") or "").lower()
    keys = ("image_max_pixels", "image_min_pixels", "freeze_vision_tower", "freeze_multi_modal_projector")
    if not (template in _IMAGE_TEMPLATES or any(r.has(k) for k in keys) or r.source.startswith("--preset")):
        r.used.update(keys)
        return
    r.set(
        "image_max_pixels",
        r.integer("image_max_pixels", 768 * 768, minimum=1),
        r.origin("image_max_pixels", "hparams/model_args.py image_max_pixels=768*768"),
    )
    r.set(
        "image_min_pixels",
        r.integer("image_min_pixels", 32 * 32, minimum=1),
        r.origin("image_min_pixels", "hparams/model_args.py image_min_pixels=32*32"),
    )
    tower, projector = r.flag("freeze_vision_tower", True), r.flag("freeze_multi_modal_projector", True)
    r.set(
        "freeze_vision_tower",
        bool(tower),
        r.origin("freeze_vision_tower", "hparams/finetuning_args.py freeze_vision_tower=True"),
    )
    if tower and not projector:
        r.warn(
            "freeze_multi_modal_projector: false with a frozen vision tower: the projector's adapters are not "
            "modelled (the tower and projector are modelled frozen together)"
        )
    r.set("seq_includes_images", True, r.default("data/processor/supervised.py: cutoff_len counts image tokens"))
    if template in _IMAGE_TEMPLATES:
        r.set("images", 1, r.default(f"assumed: template {template} is multimodal; the dataset decides"))
        r.warn(
            f"images per sample: template {template} takes images, but how many a sample holds is the dataset's, "
            "not the config's; assumed 1 image of at least image_max_pixels (pass --images N, 0 for text only)"
        )
    r.ignore("video_max_pixels", "videos are not modelled")
    r.ignore("video_fps", "videos are not modelled")
    r.ignore("video_maxlen", "videos are not modelled")


def _present(r: Reader, *keys: str) -> str:
    given = [k for k in keys if r.has(k)]
    return r.file(*given) if given else f"default: {LF}"
