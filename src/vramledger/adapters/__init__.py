"""Turn the configs people already have (LLaMA-Factory, HF, TRL, axolotl, torchtune, DeepSpeed, FSDP) into specs.

One module per format maps its keys onto TrainSpec fields, using the framework's own default (cited) where a key
is absent. ``load_config`` reads the file, applies ``key=value`` overrides, follows the DeepSpeed/accelerate
config it names (or that ``--deepspeed``/``--accelerate-config`` give) and returns the spec with the provenance
of every field and a warning for every memory-relevant key we do not model.

Example::

    >>> rc = load_config(Path("llama3_lora_sft.yaml"), overrides=["cutoff_len=4096"])
    >>> rc.train.seq_len, rc.provenance["seq_len"]
    (4096, 'override: cutoff_len')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vramledger.adapters.deepspeed import DeepSpeedConfig
from vramledger.errors import VramledgerError
from vramledger.specs import Method, TrainSpec

if TYPE_CHECKING:
    from vramledger.adapters._base import Reader
    from vramledger.adapters.hf import TrainerFlags


@dataclass(frozen=True, kw_only=True, slots=True)
class ResolvedConfig:
    """A config file read into specs, with where each value came from."""

    model: str
    """The model name or path the config points to ("" when it names none, e.g. a DeepSpeed JSON alone)."""
    train: TrainSpec
    provenance: dict[str, str] = field(default_factory=dict)
    """TrainSpec field → ``file: key`` | ``override: key`` | ``default: framework (cite)`` ."""
    warnings: tuple[str, ...] = ()
    """Keys ignored or not modelled, each with the reason."""
    format: str = ""
    """The detected (or given) format: llamafactory, hf, trl, axolotl, torchtune, deepspeed, fsdp."""
    deepspeed: DeepSpeedConfig | None = None
    """The resolved DeepSpeed settings, including the buffers TrainSpec does not model."""


_MODEL_KEYS = {
    "llamafactory": "model_name_or_path",
    "hf": "model_name_or_path",
    "trl": "model_name_or_path",
    "axolotl": "base_model",
    "torchtune": "model._component_",
}
_TRAIN_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainSpec))


@dataclass
class _Merged:
    """What the configs read so far set: fields and provenance (a later config wins) and warnings (each once)."""

    fields: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)

    def add(self, r: Reader) -> None:
        self.fields.update(r.fields)
        self.provenance.update(r.provenance)
        for w in r.warnings:
            if w not in self.seen:
                self.seen.add(w)
                self.warnings.append(w)


def load_config(
    path: Path | None,
    *,
    fmt: str | None = None,
    overrides: Sequence[str] = (),
    deepspeed: Path | None = None,
    accelerate_config: Path | None = None,
    require_model: bool = True,
) -> ResolvedConfig:
    """Read a training config (and the DeepSpeed/accelerate configs it uses) into a TrainSpec.

    ``require_model=False`` when the caller already has the model (a positional argument): a missing or
    unresolvable model in the file is then not an error.
    """
    from vramledger.adapters import fsdp
    from vramledger.adapters._base import Reader
    from vramledger.adapters.detect import normalise_format

    m = _Merged()
    kind = normalise_format(fmt) if fmt else ""
    model: str | None = None
    main: Reader | None = None
    if path is None and overrides:
        raise VramledgerError(f"unexpected argument {overrides[0]!r}: KEY=VALUE overrides need --config FILE")
    if path is not None:
        kind, main, model = _read_main(path, kind, overrides, m)
        if kind == "deepspeed":
            deepspeed = deepspeed or path
        elif kind == "fsdp":
            accelerate_config = accelerate_config or path
    trainer = main.extras.get("trainer") if main is not None else None
    hidden = _hidden_size(model)

    if accelerate_config is not None:
        deepspeed = _read_accelerate(accelerate_config, trainer, deepspeed, m)
    ds_source = _deepspeed_source(deepspeed, trainer, path)
    ds_config: DeepSpeedConfig | None = None
    if ds_source is not None:
        ds_config = _read_deepspeed(ds_source, trainer, hidden, m)
    elif trainer is not None and trainer.fsdp not in (None, False, "", []):
        fr = Reader({}, framework="fsdp", source=str(path))
        fsdp.read_trainer_fsdp(fr, trainer.fsdp, trainer.fsdp_config)
        m.add(fr)

    fields, provenance = m.fields, m.provenance
    # TRL: ZeRO-3 with a non-quantised PEFT model passes autocast_adapter_dtype=False (sft_trainer.py), so the
    # adapters stay in the model dtype.
    if kind == "trl" and fields.get("zero_stage") == 3 and fields.get("method") is Method.LORA and fields.get("lora"):
        fields["lora"] = dataclasses.replace(fields["lora"], adapter_fp32=False)
        provenance["lora"] += "; default: trl (sft_trainer.py: ZeRO-3 + PEFT → autocast_adapter_dtype=False)"
    if (fields.get("zero_stage", 0) > 0 or fields.get("fsdp") is not None) and "world_size" not in fields:
        m.warnings.append(
            "world_size: not given in the configs (the launcher decides); ZeRO/FSDP shards are "
            "estimated for 1 GPU — add world_size=N after the config file"
        )
    model_name = model or ""
    if path is not None and kind not in ("deepspeed", "fsdp") and require_model:
        _require_model(path, kind, main, model_name)
    return _resolved(m, path, model=model_name, kind=kind, ds_config=ds_config)


def _read_main(path: Path, kind: str, overrides: Sequence[str], m: _Merged) -> tuple[str, Reader, str | None]:
    """The file given with --config, overrides applied; returns its format, its reader and the model it names.
    A DeepSpeed or accelerate file is only detected here: the caller reads it as such."""
    from vramledger.adapters._base import Reader, apply_overrides, read_mapping
    from vramledger.adapters.detect import detect

    raw = read_mapping(path)
    raw, touched = apply_overrides(raw, overrides)
    kind = kind or detect(raw, str(path))
    world = raw.pop("world_size", None) if kind != "axolotl" or "world_size" in touched else None
    main = Reader(raw, framework=kind, source=str(path), overridden=touched)
    model = None
    if kind not in ("deepspeed", "fsdp"):
        model = _load_main(kind, main)
        m.add(main)
    if world is not None:
        m.fields["world_size"] = _world(world, str(path))
        m.provenance["world_size"] = ("override" if "world_size" in touched else "file") + ": world_size"
    return kind, main, model


def _read_accelerate(path: Path, trainer: TrainerFlags | None, deepspeed: Path | None, m: _Merged) -> Path | None:
    """An accelerate config (FSDP, mixed precision); returns the DeepSpeed config to read, given or named in it."""
    from vramledger.adapters import fsdp
    from vramledger.adapters._base import Reader, read_mapping, resolve_relative

    ar = Reader(read_mapping(path, "accelerate config"), framework="accelerate", source=str(path))
    fsdp.read_accelerate(ar)
    mp = ar.extras.get("mixed_precision")
    if trainer is None and mp is not None:
        ar.set("precision", mp, f"file: {path} mixed_precision")
    m.add(ar)
    if deepspeed is None and isinstance(ar.extras.get("deepspeed_file"), str):
        deepspeed = resolve_relative(ar.extras["deepspeed_file"], path)
    return deepspeed


def _deepspeed_source(deepspeed: Path | None, trainer: TrainerFlags | None, path: Path | None) -> Any:
    """The DeepSpeed config to read: the one given, else the training config's ``deepspeed`` (a path, resolved as
    the framework does, or an inline mapping); None when there is none."""
    from vramledger.adapters._base import resolve_relative

    if deepspeed is not None or trainer is None or trainer.deepspeed is None:
        return deepspeed
    if not isinstance(trainer.deepspeed, str):
        return trainer.deepspeed
    ds_path = resolve_relative(trainer.deepspeed, path)
    if not ds_path.is_file():
        raise VramledgerError(
            f"{path}: deepspeed names {trainer.deepspeed}, which does not exist here; pass the file with "
            "--deepspeed PATH"
        )
    return ds_path


def _read_deepspeed(source: Any, trainer: TrainerFlags | None, hidden: int | None, m: _Merged) -> DeepSpeedConfig:
    from vramledger.adapters import deepspeed as ds
    from vramledger.adapters._base import Reader, read_mapping

    if isinstance(source, dict):
        dr = Reader({str(k): v for k, v in source.items()}, framework="deepspeed", source="deepspeed")
    else:
        dr = Reader(read_mapping(Path(source), "deepspeed config"), framework="deepspeed", source=str(source))
    ds_config = ds.read(
        dr,
        trainer=trainer,
        micro_batch=m.fields.get("micro_batch"),
        grad_accum=m.fields.get("grad_accum"),
        hidden_size=hidden,
    )
    if "world_size" in m.fields:  # world_size=N given with the training config wins over train_batch_size
        dr.fields.pop("world_size", None)
        dr.provenance.pop("world_size", None)
    m.add(dr)
    return ds_config


def _require_model(path: Path, kind: str, main: Reader | None, model_name: str) -> None:
    unknown = main.extras.get("unknown_builder") if main is not None else None
    if not model_name and unknown:
        raise VramledgerError(
            f"{path}: the torchtune builder {unknown!r} (model._component_) is not in vramledger's table; pass "
            f"the model's config.json before --config (vramledger estimate /path/to/config.json --config {path})"
        )
    if not model_name:
        raise VramledgerError(
            f"{path}: names no model ({_MODEL_KEYS.get(kind, 'model')}); add it to the file or pass the model "
            "(a catalog name or a config.json path) before --config"
        )
    _check_model(model_name, _MODEL_KEYS.get(kind, "model"), path)


def _resolved(
    m: _Merged, path: Path | None, *, model: str, kind: str, ds_config: DeepSpeedConfig | None
) -> ResolvedConfig:
    train_fields = {k: v for k, v in m.fields.items() if k in _TRAIN_FIELDS}
    if train_fields.get("method") not in (Method.QLORA,):
        train_fields.pop("quant", None)
    try:
        # warnings travel in ResolvedConfig (the CLI adds them to the result), not TrainSpec.warnings, so
        # they are shown once
        train = TrainSpec(**train_fields)
    except TypeError as exc:  # a value of the wrong type slipped through: still one clear line
        raise VramledgerError(f"{path}: a value has the wrong type ({exc}); check the file") from None
    provenance = {k: v for k, v in m.provenance.items() if k in _TRAIN_FIELDS or k == "model_dtype"}
    return ResolvedConfig(
        model=model,
        train=train,
        provenance=provenance,
        warnings=tuple(m.warnings),
        format=kind,
        deepspeed=ds_config,
    )


PRESETS: dict[str, dict[str, Any]] = {
    # The least a user writes to fine-tune with LoRA in each framework; every other key is the framework's own
    # default, cited by its adapter (checkpointing, optimizer, rank, length...). bf16 is set where the framework
    # leaves fp32 as the default: every example config of these frameworks turns it on.
    "hf": {"output_dir": "out", "bf16": True},
    "llamafactory": {"stage": "sft", "finetuning_type": "lora", "bf16": True},
    "trl": {"use_peft": True},
    "axolotl": {"adapter": "lora", "lora_r": 16, "lora_alpha": 32, "lora_target_linear": True, "bf16": True},
}
"""``--preset``: a flag-only estimate with a framework's defaults instead of vramledger's bare ones."""
DEFAULT_PRESET = "llamafactory"
"""The preset a flag-only estimate uses when none is given: LLaMA-Factory's defaults (gradient checkpointing on,
the fused AdamW, rank 8 on every linear layer), what its example configs train with."""


def preset_config(kind: str, model: str) -> ResolvedConfig:
    """The TrainSpec a framework builds from ``PRESETS[kind]`` for ``model``, with the provenance of each field."""
    from vramledger.adapters._base import Reader

    if kind not in PRESETS:
        raise VramledgerError(f"--preset: unknown preset {kind!r}; choose one of {', '.join(PRESETS)}")
    raw = dict(PRESETS[kind]) | {_MODEL_KEYS[kind]: model}
    r = Reader(raw, framework=kind, source=f"--preset {kind}")
    _load_main(kind, r)
    # how the framework trains, not the shapes: batch, length and evaluation stay the flags' (or vramledger's)
    keep = _TRAIN_FIELDS - _SHAPE_FIELDS
    train_fields = {k: v for k, v in r.fields.items() if k in keep}
    # "file: bf16" would name a file the user never wrote: the preset's own keys are said to be the preset's
    provenance = {k: v.replace("file: ", f"preset {kind}: ", 1) for k, v in r.provenance.items() if k in keep}
    return ResolvedConfig(model=model, train=TrainSpec(**train_fields), provenance=provenance, format=kind)


_SHAPE_FIELDS = frozenset(
    {
        "micro_batch",
        "seq_len",
        "grad_accum",
        "packing",
        "eval_batch",
        "eval_seq_len",
        "eval_accumulation_steps",
        "eval_steps_total",
        "eval_logits",
        "predict_with_generate",
        "generation_max_new_tokens",
        "world_size",
        "zero_stage",
        "loss_chunk_tokens",
        "images",
        "image_size",
        "seq_includes_images",
    }
)


def _load_main(kind: str, r: Any) -> str | None:
    from vramledger.adapters import axolotl, hf, llamafactory, torchtune, trl

    if kind == "llamafactory":
        return llamafactory.load(r)
    if kind == "hf":
        return hf.load(r)
    if kind == "trl":
        return trl.load(r, family=_family(r.raw.get("model_name_or_path")))
    if kind == "axolotl":
        return axolotl.load(r)
    if kind == "torchtune":
        return torchtune.load(r)
    raise AssertionError(kind)


def _world(value: Any, source: str) -> int:
    from vramledger.adapters._base import as_int

    n = as_int(value)
    if n is None or n < 1:
        raise VramledgerError(f"{source}: world_size must be a positive integer (got {value!r})")
    return n


def _resolve(name: Any) -> Any:
    if not isinstance(name, str) or not name.strip():
        return None
    from vramledger.catalog import resolve_model

    try:
        return resolve_model(name)
    except VramledgerError:
        return None


def _family(name: Any) -> str | None:
    spec = _resolve(name)
    return spec.family if spec is not None else None


def _hidden_size(name: str | None) -> int | None:
    spec = _resolve(name)
    return spec.hidden_size if spec is not None else None


def _check_model(name: str, key: str, path: Path) -> None:
    """The model must be resolvable offline: a local path, a catalog name, or a snapshot in the HF cache."""
    from vramledger import catalog
    from vramledger.userfiles import path_exists

    if path_exists(name) or catalog.catalog_entry(name) is not None:
        return
    if catalog._from_hf_cache(name) is not None:
        return
    raise VramledgerError(
        f"{path}: model {name!r} ({key}) is not in the catalog, the local HF cache or on disk, and vramledger works "
        "offline; download its config.json and pass its path before --config (vramledger estimate "
        f"/path/to/config.json --config {path}) or override {key.split('.')[0]}=/path/to/config.json"
    )
