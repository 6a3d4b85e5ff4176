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
from typing import Any

from vramledger.adapters.deepspeed import DeepSpeedConfig
from vramledger.errors import VramledgerError
from vramledger.specs import Method, TrainSpec


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
    from vramledger.adapters import deepspeed as ds
    from vramledger.adapters import fsdp
    from vramledger.adapters._base import Reader, apply_overrides, read_mapping, resolve_relative
    from vramledger.adapters.detect import detect, normalise_format

    fields: dict[str, Any] = {}
    provenance: dict[str, str] = {}
    warnings: list[str] = []
    kind = normalise_format(fmt) if fmt else ""
    model: str | None = None
    trainer = None
    ds_config: DeepSpeedConfig | None = None
    main: Reader | None = None

    def merge(r: Reader) -> None:
        fields.update(r.fields)
        provenance.update(r.provenance)
        for w in r.warnings:
            if w not in warnings:
                warnings.append(w)

    if path is None and overrides:
        raise VramledgerError(f"unexpected argument {overrides[0]!r}: KEY=VALUE overrides need --config FILE")
    if path is not None:
        raw = read_mapping(path)
        raw, touched = apply_overrides(raw, overrides)
        kind = kind or detect(raw, str(path))
        world = raw.pop("world_size", None) if kind != "axolotl" or "world_size" in touched else None
        main = Reader(raw, framework=kind, source=str(path), overridden=touched)
        if kind == "deepspeed":
            deepspeed = deepspeed or path
        elif kind == "fsdp":
            accelerate_config = accelerate_config or path
        else:
            model = _load_main(kind, main)
            trainer = main.extras.get("trainer")
            merge(main)
        if world is not None:
            fields["world_size"] = _world(world, str(path))
            provenance["world_size"] = ("override" if "world_size" in touched else "file") + ": world_size"

    hidden = _hidden_size(model)

    if accelerate_config is not None:
        ar = Reader(
            read_mapping(accelerate_config, "accelerate config"),
            framework="accelerate",
            source=str(accelerate_config),
        )
        fsdp.read_accelerate(ar)
        mp = ar.extras.get("mixed_precision")
        if trainer is None and mp is not None:
            ar.set("precision", mp, f"file: {accelerate_config} mixed_precision")
        merge(ar)
        if deepspeed is None and isinstance(ar.extras.get("deepspeed_file"), str):
            deepspeed = resolve_relative(ar.extras["deepspeed_file"], accelerate_config)

    ds_source: Any = deepspeed
    if ds_source is None and trainer is not None and trainer.deepspeed is not None:
        ds_source = trainer.deepspeed
        if isinstance(ds_source, str):
            ds_path = resolve_relative(ds_source, path)
            if not ds_path.is_file():
                raise VramledgerError(
                    f"{path}: deepspeed names {ds_source}, which does not exist here; pass the file with "
                    "--deepspeed PATH"
                )
            ds_source = ds_path
    if ds_source is not None:
        if isinstance(ds_source, dict):
            dr = Reader({str(k): v for k, v in ds_source.items()}, framework="deepspeed", source="deepspeed")
        else:
            dr = Reader(
                read_mapping(Path(ds_source), "deepspeed config"),
                framework="deepspeed",
                source=str(ds_source),
            )
        ds_config = ds.read(
            dr,
            trainer=trainer,
            micro_batch=fields.get("micro_batch"),
            grad_accum=fields.get("grad_accum"),
            hidden_size=hidden,
        )
        if "world_size" in fields:
            dr.fields.pop("world_size", None)
            dr.provenance.pop("world_size", None)
        merge(dr)
    elif trainer is not None and trainer.fsdp not in (None, False, "", []):
        fr = Reader({}, framework="fsdp", source=str(path))
        fsdp.read_trainer_fsdp(fr, trainer.fsdp, trainer.fsdp_config)
        merge(fr)

    # TRL: ZeRO-3 with a non-quantised PEFT model passes autocast_adapter_dtype=False (sft_trainer.py), so the
    # adapters stay in the model dtype.
    if kind == "trl" and fields.get("zero_stage") == 3 and fields.get("method") is Method.LORA and fields.get("lora"):
        fields["lora"] = dataclasses.replace(fields["lora"], adapter_fp32=False)
        provenance["lora"] += "; default: trl (sft_trainer.py: ZeRO-3 + PEFT → autocast_adapter_dtype=False)"

    if (fields.get("zero_stage", 0) > 0 or fields.get("fsdp") is not None) and "world_size" not in fields:
        warnings.append(
            "world_size: not given in the configs (the launcher decides); ZeRO/FSDP shards are "
            "estimated for 1 GPU — add world_size=N after the config file"
        )
    model_name = model or ""
    if path is not None and kind not in ("deepspeed", "fsdp") and require_model:
        if not model_name:
            raise VramledgerError(
                f"{path}: names no model ({_MODEL_KEYS.get(kind, 'model')}); add it to the file or pass the model "
                "(a catalog name or a config.json path) before --config"
            )
        _check_model(model_name, _MODEL_KEYS.get(kind, "model"), path)

    train_fields = {k: v for k, v in fields.items() if k in _TRAIN_FIELDS}
    if train_fields.get("method") not in (Method.QLORA,):
        train_fields.pop("quant", None)
    try:
        # warnings travel in ResolvedConfig (the CLI adds them to the result), not TrainSpec.warnings, so
        # they are shown once
        train = TrainSpec(**train_fields)
    except TypeError as exc:  # a value of the wrong type slipped through: still one clear line
        raise VramledgerError(f"{path}: a value has the wrong type ({exc}); check the file") from None
    provenance = {k: v for k, v in provenance.items() if k in _TRAIN_FIELDS or k == "model_dtype"}
    return ResolvedConfig(
        model=model_name,
        train=train,
        provenance=provenance,
        warnings=tuple(warnings),
        format=kind,
        deepspeed=ds_config,
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

    if Path(name).expanduser().exists() or catalog.catalog_entry(name) is not None:
        return
    if catalog._from_hf_cache(name) is not None:
        return
    raise VramledgerError(
        f"{path}: model {name!r} ({key}) is not in the catalog, the local HF cache or on disk, and vramledger works "
        "offline; download its config.json and pass its path before --config (vramledger estimate "
        f"/path/to/config.json --config {path}) or override {key.split('.')[0]}=/path/to/config.json"
    )
