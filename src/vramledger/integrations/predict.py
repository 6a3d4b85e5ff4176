"""The setup of a live run as specs: the model's own config, its PEFT config and parameters, and the trainer's
arguments — nothing is read from files.

``TrainingArguments`` go through the HF adapter (``adapters.hf.read_trainer``), so their defaults and the keys we
ignore are the adapter's (one home). What the arguments cannot say, the live model does: PEFT adapters (method,
rank, targets, dropout, DoRA, adapter dtype), a bitsandbytes-quantised base, the dtype the weights were loaded in,
the attention implementation, and whether gradient checkpointing is on (the Trainer enables it on the model before
``on_train_begin``, trainer.py ``_inner_training_loop``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vramledger.errors import VramledgerError
from vramledger.specs import DType, LoraSpec, Method, ModelSpec, Optimizer, QuantSpec, TrainSpec

_TRAIN_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainSpec))
_DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


@dataclass(frozen=True, kw_only=True, slots=True)
class LiveSetup:
    """What the run is, as far as its objects say."""

    model: ModelSpec
    train: TrainSpec
    provenance: dict[str, str] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()


def base_model(model: Any) -> Any:
    """The transformers model under a PEFT wrapper (or the model itself)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def hf_config(model: Any) -> Any | None:
    """The first ``config`` with a ``model_type`` on the model or its submodules (Lightning modules wrap one)."""
    for candidate in (base_model(model), model):
        cfg = getattr(candidate, "config", None)
        if getattr(cfg, "model_type", None):
            return cfg
    for module in getattr(model, "modules", lambda: [])():
        cfg = getattr(module, "config", None)
        if getattr(cfg, "model_type", None):
            return cfg
    return None


def model_spec(model: Any) -> ModelSpec:
    from vramledger.catalog.hfconfig import model_spec_from_config

    cfg = hf_config(model)
    if cfg is None:
        raise VramledgerError("the model has no transformers config (config.model_type); pass train= and model_spec=")
    raw = cfg.to_dict()
    name = str(getattr(cfg, "_name_or_path", "") or raw.get("model_type", "model"))
    return model_spec_from_config(raw, name=name, source="the live model's config")


def _dtype_name(dtype: Any) -> str:
    return _DTYPES.get(str(dtype), str(dtype).replace("torch.", ""))


def _lora(model: Any) -> LoraSpec | None:
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, Mapping) or not configs:
        return None
    cfg = configs.get("default") or next(iter(configs.values()))
    targets = getattr(cfg, "target_modules", None)
    if isinstance(targets, str):
        names: tuple[str, ...] = ("all",) if targets in ("all-linear", "all_linear") else (targets,)
    else:
        names = tuple(sorted(targets or ())) or ("all",)
    adapter = next((p for n, p in model.named_parameters() if "lora_" in n), None)
    return LoraSpec(
        rank=int(getattr(cfg, "r", 8)),
        alpha=float(getattr(cfg, "lora_alpha", 8)),
        targets=names,
        dropout=float(getattr(cfg, "lora_dropout", 0.0) or 0.0),
        dora=bool(getattr(cfg, "use_dora", False)),
        adapter_fp32=adapter is None or _dtype_name(adapter.dtype) == "float32",
    )


_DTYPE_OF = {"float32": DType.FP32, "bfloat16": DType.BF16, "float16": DType.FP16}


def _quant(model: Any) -> QuantSpec | None:
    cfg = hf_config(model)
    q = getattr(cfg, "quantization_config", None)
    if q is None:
        return None
    q = q if isinstance(q, Mapping) else getattr(q, "to_dict", lambda: {})()
    if q.get("load_in_4bit"):
        return QuantSpec(
            bits=4,
            quant_type=str(q.get("bnb_4bit_quant_type", "nf4")),
            double_quant=bool(q.get("bnb_4bit_use_double_quant", False)),
            # to_dict() names it as torch does ("float32", BitsAndBytesConfig's default when none is given).
            compute_dtype=_DTYPE_OF.get(str(q.get("bnb_4bit_compute_dtype", "")).removeprefix("torch.")),
        )
    if q.get("load_in_8bit"):
        return QuantSpec(bits=8)
    return None


def live_fields(model: Any) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """TrainSpec fields the live model decides: method, adapters, quantisation, base dtype, attention, checkpointing."""
    from vramledger.adapters._base import ATTN_NAMES

    fields: dict[str, Any] = {}
    prov: dict[str, str] = {}
    warnings: list[str] = []
    lora, quant = _lora(model), _quant(model)
    params = list(model.parameters())
    frozen = [p for p in params if not p.requires_grad]
    if lora is not None:
        fields["method"] = Method.QLORA if quant is not None else Method.LORA
        fields["lora"] = lora
        prov["method"] = prov["lora"] = "live model: peft_config"
        if quant is not None:
            fields["quant"] = quant
            prov["quant"] = "live model: config.quantization_config"
    else:
        fields["method"] = Method.FULL
        prov["method"] = "live model: no PEFT adapters"
        if frozen:
            warnings.append(f"{len(frozen)} parameters are frozen without PEFT adapters: estimated as full fine-tuning")
    if frozen and quant is None:
        name = _dtype_name(frozen[0].dtype)
        if name in ("float32", "bfloat16", "float16"):
            fields["base_dtype"] = _DTYPE_OF[name]
            prov["base_dtype"] = f"live model: frozen weights are {name}"
    attn = getattr(hf_config(model), "_attn_implementation", None)
    if isinstance(attn, str) and attn.lower() in ATTN_NAMES:
        fields["attn"] = ATTN_NAMES[attn.lower()]
        prov["attn"] = "live model: config._attn_implementation"
    # transformers 5 renamed is_gradient_checkpointing (deprecated) to is_activation_checkpointing
    for attr in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        ckpt = getattr(type(base_model(model)), attr, None) and getattr(base_model(model), attr)
        if isinstance(ckpt, bool):
            fields["grad_ckpt"] = ckpt
            prov["grad_ckpt"] = f"live model: {attr}"
            break
    return fields, prov, warnings


def trainable_dtype(model: Any) -> str | None:
    p = next((p for p in model.parameters() if p.requires_grad), None)
    return None if p is None else _dtype_name(p.dtype)


def setup_from_trainer(model: Any, args: Any, *, micro_batch: int, seq_len: int) -> LiveSetup:
    """The setup of an HF ``Trainer`` run: ``TrainingArguments`` through the HF adapter, then the live model."""
    from vramledger.adapters import hf
    from vramledger.adapters._base import Reader

    r = Reader(args.to_dict(), framework="transformers", source="TrainingArguments")
    flags = hf.read_trainer(r)
    fields, prov, warnings = live_fields(model)
    hf.precision_from_flags(flags, r, method=fields["method"], weights_dtype=trainable_dtype(model))
    if flags.deepspeed or flags.fsdp:
        warnings.append("DeepSpeed/FSDP: the prediction is for one GPU without sharding")
    merged = {k: v for k, v in r.fields.items() if k in _TRAIN_FIELDS} | fields
    merged |= {"micro_batch": micro_batch, "seq_len": seq_len}
    provenance = {**r.provenance, **prov, "micro_batch": "live batch", "seq_len": "longest live batch"}
    if merged.get("method") is not Method.QLORA:
        merged.pop("quant", None)
    return LiveSetup(
        model=model_spec(model),
        train=TrainSpec(**merged),
        provenance=provenance,
        warnings=tuple(r.warnings) + tuple(warnings),
    )


def optimizer_of(optimizer: Any) -> Optimizer | None:
    """The Optimizer spec of a live torch optimizer (AdamW fused/foreach/for-loop, SGD), None when not modelled."""
    if optimizer is None:
        return None
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
    name = type(inner).__name__
    defaults = getattr(inner, "defaults", {})
    if name in ("AdamW", "Adam"):
        if defaults.get("fused"):
            return Optimizer.ADAMW_FUSED
        return Optimizer.ADAMW_FORLOOP if defaults.get("foreach") is False else Optimizer.ADAMW
    if name == "SGD":
        return Optimizer.SGD
    return None


def setup_from_model(
    model: Any, optimizer: Any, base: TrainSpec, *, micro_batch: int, seq_len: int, precision: Any = None
) -> LiveSetup:
    """A plain loop's (or Lightning's) setup: ``base`` with what the live model and optimizer say."""
    fields, prov, warnings = live_fields(model)
    opt = optimizer_of(optimizer)
    if opt is not None:
        fields["optimizer"] = opt
        prov["optimizer"] = f"live optimizer: {type(getattr(optimizer, 'optimizer', optimizer)).__name__}"
    elif optimizer is not None:
        warnings.append(f"optimizer {type(optimizer).__name__} is not modelled: estimated as {base.optimizer.value}")
    if precision is not None:
        fields["precision"] = precision
        prov["precision"] = "the trainer's precision"
    fields |= {"micro_batch": micro_batch, "seq_len": seq_len}
    if fields.get("method") is not Method.QLORA:
        fields.setdefault("quant", None)
    return LiveSetup(
        model=model_spec(model), train=dataclasses.replace(base, **fields), provenance=prov, warnings=tuple(warnings)
    )
