"""TRL ``trl sft --config FILE`` YAML (ModelConfig + ScriptArguments + SFTConfig in one mapping) → TrainSpec fields.

Defaults read from TRL 1.10.0.dev0 (huggingface/trl@f2cd577): ``trl/trainer/sft_config.py`` (SFTConfig),
``trl/trainer/base_config.py`` (_BaseConfig: gradient_checkpointing=True, bf16 = not fp16), ``trl/trainer/
model_config.py`` (ModelConfig), ``trl/trainer/utils.py`` (get_peft_config, get_quantization_config) and
``trl/trainer/sft_trainer.py`` (the chunked loss). SFTConfig extends TrainingArguments: the rest follows ``hf.py``.
"""

from __future__ import annotations

from vramledger.adapters import hf
from vramledger.adapters._base import Reader
from vramledger.errors import VramledgerError
from vramledger.specs import DType, LoraSpec, Loss, Method, QuantSpec
from vramledger.specs.train import TRL_CHUNK_TOKENS

# PEFT's default target_modules when lora_target_modules is unset (peft 0.21 utils/constants.py
# TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING): q_proj, v_proj for llama, mistral, mixtral, gemma*, qwen2/3.
PEFT_DEFAULT_TARGETS = {"gpt2": ("c_attn",)}

HARMLESS = hf.HARMLESS_HF | frozenset(
    [
        "model_name_or_path",
        "model_revision",
        "dataset_name",
        "dataset_config",
        "dataset_train_split",
        "dataset_test_split",
        "dataset_streaming",
        "datasets",
        "dataset_text_field",
        "dataset_kwargs",
        "dataset_num_proc",
        "eos_token",
        "pad_token",
        "truncation_mode",
        "shuffle_dataset",
        "packing_strategy",
        "completion_only_loss",
        "assistant_only_loss",
        "chat_template_path",
        "lora_alpha",
        "use_rslora",
        "lora_task_type",
        "router_aux_loss_coef",
        "env",
        "ignore_bias_buffers",
        "trust_remote_code",
        "gradient_checkpointing_use_reentrant",
    ]
)


LORA_KEYS = ("lora_r", "lora_alpha", "lora_dropout", "use_dora", "lora_modules_to_save", "lora_target_parameters")
"""The keys that make the LoraSpec besides its targets, in the order its provenance names them."""
UNMODELLED_SHAPES: tuple[tuple[str, str], ...] = (
    ("padding_free", "padding-free batches are modelled as padded ones of max_length"),
    ("eval_packing", "eval packing is modelled like train packing"),
    ("activation_offloading", "offloaded activations are not modelled"),
    ("pad_to_multiple_of", "padding to a multiple is not modelled"),
)
"""SFTConfig keys about batch shapes that vramledger does not model, each with the reason its warning gives."""


def load(r: Reader, *, family: str | None) -> str | None:
    model = r.text("model_name_or_path")
    method = _method(r)
    _lora(r, method, family)
    flags = hf.read_trainer(
        r,
        bf16_default=True,
        bf16_cite="trainer/base_config.py: bf16 = not fp16 when unset",
        ckpt_default=True,
        ckpt_cite="trainer/base_config.py gradient_checkpointing=True",
    )
    r.extras["trainer"] = flags
    _precision(r, method, flags)
    _shapes(r)
    _loss(r)
    if not r.has("attn_implementation"):  # when set, hf.read_trainer read it
        r.provenance.setdefault("attn", "default: transformers (attn_implementation=None → sdpa)")
    r.finish(HARMLESS)
    return model


def _method(r: Reader) -> Method:
    """use_peft, and QLoRA when the base loads in 4 or 8 bits."""
    use_peft = r.flag("use_peft", False)
    four, eight = r.flag("load_in_4bit", False), r.flag("load_in_8bit", False)
    if four and eight:
        raise VramledgerError(f"{r.source}: load_in_4bit and load_in_8bit are both true; set one")
    method = Method.LORA if use_peft else Method.FULL
    prov = r.origin("use_peft", "trainer/model_config.py use_peft=False")
    if four or eight:
        if not use_peft:
            raise VramledgerError(f"{r.source}: a 4/8-bit base trains only with adapters; add use_peft: true")
        method = Method.QLORA
        qtype = (r.text("bnb_4bit_quant_type") or "nf4").lower()
        r.set(
            "quant",
            QuantSpec(
                bits=4 if four else 8,
                quant_type=qtype,
                double_quant=bool(r.flag("use_bnb_nested_quant", False)) and four,
            ),
            r.file("load_in_4bit" if four else "load_in_8bit") + " (defaults: trainer/model_config.py "
            "bnb_4bit_quant_type='nf4', use_bnb_nested_quant=False)",
        )
        prov += " + file: " + ("load_in_4bit" if four else "load_in_8bit")
    else:
        r.used.update(("bnb_4bit_quant_type", "use_bnb_nested_quant"))
    r.ignore("bnb_4bit_quant_storage", "the storage dtype of 4-bit weights is not modelled")
    r.set("method", method, prov)
    return method


def _lora(r: Reader, method: Method, family: str | None) -> None:
    if method not in (Method.LORA, Method.QLORA):
        r.used.update(("lora_r", "lora_target_modules", "lora_dropout", "use_dora", "lora_target_parameters"))
        return
    rank = r.integer("lora_r", 16)
    # an empty list is PEFT's "no module" (tuners/lora/config.py target_modules), beside target parameters
    targets = () if r.value("lora_target_modules") == [] else r.names("lora_target_modules")
    if targets is None:
        targets = PEFT_DEFAULT_TARGETS.get(family or "", ("q_proj", "v_proj"))
        tprov = f"peft utils/constants.py TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING: {','.join(targets)}"
    else:
        tprov = "file: lora_target_modules"
    r.set(
        "lora",
        LoraSpec(
            rank=rank,
            alpha=r.number("lora_alpha", 32.0),
            targets=("all",) if [t.lower() for t in targets] == ["all-linear"] else targets,
            dropout=r.number("lora_dropout", 0.05),
            dora=r.flag("use_dora", False),
            modules_to_save=r.names("lora_modules_to_save") or (),
            # trainer/utils.py get_peft_config: LoraConfig(target_parameters=model_args.lora_target_parameters)
            parameters=r.names("lora_target_parameters") or (),
        ),
        "; ".join(p for p in (_present(r, *LORA_KEYS), tprov) if p)
        + " (defaults: trainer/model_config.py lora_r=16, lora_alpha=32, lora_dropout=0.05)",
    )


def _precision(r: Reader, method: Method, flags: hf.TrainerFlags) -> None:
    # Model load dtype: ModelConfig.dtype defaults to "float32" (trainer/model_config.py); SFTTrainer also
    # defaults a string model to float32 (sft_trainer.py docstring of `model`).
    init = r.mapping("model_init_kwargs") or {}
    dtype = hf.model_dtype(r)
    if dtype is None and isinstance(init.get("dtype") or init.get("torch_dtype"), str):
        dtype = str(init.get("dtype") or init.get("torch_dtype")).replace("torch.", "")
    if dtype is None:
        dtype = "float32"
        r.provenance["model_dtype"] = r.default("trainer/model_config.py dtype='float32'")
    hf.precision_from_flags(flags, r, method=method, weights_dtype=dtype)
    if dtype == "float32" and method is Method.LORA and (flags.bf16 or flags.fp16):
        # The frozen base stays fp32 under autocast: modelled by TrainSpec.base_dtype.
        r.set("base_dtype", DType.FP32, r.provenance.get("model_dtype") or r.file("dtype"))
    elif dtype == "auto" and method is not Method.FULL:
        r.warn("precision: dtype 'auto' loads the checkpoint's own dtype; modelled as the compute dtype")


def _shapes(r: Reader) -> None:
    """Sequence length (max_length, or max_seq_length before TRL 0.20) and packing."""
    if r.has("max_length"):
        r.set("seq_len", r.integer("max_length", minimum=1), r.file("max_length"))
    elif r.has("max_seq_length"):  # TRL < 0.20 spelling
        r.set("seq_len", r.integer("max_seq_length", minimum=1), r.file("max_seq_length"))
    else:
        r.set("seq_len", 1024, r.default("trainer/sft_config.py max_length=1024"))
    r.used.update(("max_length", "max_seq_length"))
    r.set(
        "packing",
        bool(r.flag("packing", False)),
        r.origin("packing", "trainer/sft_config.py packing=False"),
    )
    for key, reason in UNMODELLED_SHAPES:
        r.ignore(key, reason)


def _loss(r: Reader) -> None:
    loss_type = r.text("loss_type")
    liger = bool(r.flag("use_liger_kernel", False))
    if loss_type is None:
        loss_type = "nll" if liger else "chunked_nll"
        lprov = r.default(
            "trainer/sft_config.py __post_init__: loss_type = 'nll' if use_liger_kernel else 'chunked_nll'"
        )
    else:
        lprov = r.file("loss_type")
    if loss_type == "chunked_nll":
        if liger:
            raise VramledgerError(
                f"{r.source}: loss_type chunked_nll is not compatible with use_liger_kernel (sft_trainer.py); drop one"
            )
        r.set("loss", Loss.CHUNKED_NLL, lprov)
        r.set(
            "loss_chunk_tokens",
            TRL_CHUNK_TOKENS,
            r.default("trainer/sft_trainer.py _CHUNKED_LM_HEAD_CHUNK_SIZE=256"),
        )
    elif loss_type in ("nll", "dft"):
        if not liger:
            r.set("loss", Loss.STANDARD, lprov)
    else:
        raise VramledgerError(f"{r.source}: loss_type must be nll, dft or chunked_nll (got {loss_type!r})")


def _present(r: Reader, *keys: str) -> str:
    given = [k for k in keys if r.has(k)]
    return r.file(*given) if given else ""
