"""Bundled model configs and GPU facts, stored as data files, and the one module that loads them.

Model files: ``catalog/models/<alias>.json`` with keys ``hub_id``, ``aliases``, ``published_params`` (or
``published_params_rounded`` where only a rounded figure is published), ``params_source``, ``config_source``
and ``config`` (the upstream config.json's fields), and optionally ``published_counts_tied_head_twice`` /
``published_includes_vision_tower`` where the published figure counts more than the language model's
parameters, and ``meta_build`` for a model_type without formulas (its meta-device build, stored).
GPUs: ``catalog/gpus.json``.

A model name resolves, in order, to: a path (a config.json file or a directory holding one), a catalog entry
(hub id or alias, case-insensitive), a snapshot in the local Hugging Face cache, or, by pattern, the catalog
model a variant or mirror was made from (printing what was assumed). Nothing is downloaded and
no remote code runs.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass, replace
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

from vramledger.catalog.hfconfig import model_spec_from_config
from vramledger.errors import VramledgerError
from vramledger.specs.gpu import GPUSpec
from vramledger.specs.model import ModelSpec

_HERE = Path(__file__).parent


@dataclass(frozen=True, kw_only=True, slots=True)
class CatalogEntry:
    key: str
    """File stem, the canonical short alias."""
    hub_id: str
    aliases: tuple[str, ...]
    published_params: int | None
    """The exact count as published (the model page's safetensors count, or the model card)."""
    params_source: str
    config_source: str
    config: dict[str, Any]
    published_params_rounded: str = ""
    """Where no exact count is published (gpt-oss: the safetensors figure counts MXFP4 blocks as bytes), the
    figure as the publisher rounds it (``20.91B``)."""
    meta_build: dict[str, Any] | None = None
    """For a model_type without formulas: the spec transformers' meta-device build gave (catalog/inventory.py
    ``spec_to_json``), stored so the catalog stays instant; a test rebuilds it and compares."""
    published_counts_tied_head_twice: bool = False
    """The published checkpoint stores ``lm_head.weight`` as well as the embedding it is tied to (Qwen3-0.6B
    and -1.7B), so the published figure exceeds the model's parameter count by vocab_size × hidden_size."""
    published_includes_vision_tower: bool = False
    """Multimodal checkpoint (Gemma 3 4B/12B/27B): the published figure includes the vision tower and
    projector; the spec, and our count, cover the language model only."""

    def spec(self) -> ModelSpec:
        return _entry_spec(self.key)


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-")


@lru_cache(maxsize=1)
def model_entries() -> dict[str, CatalogEntry]:
    """All bundled models, by canonical key."""
    out: dict[str, CatalogEntry] = {}
    for path in sorted((_HERE / "models").glob("*.json")):
        raw = json.loads(path.read_text())
        out[path.stem] = CatalogEntry(
            key=path.stem,
            hub_id=raw["hub_id"],
            aliases=tuple(raw.get("aliases", ())),
            published_params=raw.get("published_params"),
            params_source=raw.get("params_source", ""),
            config_source=raw.get("config_source", ""),
            config=raw["config"],
            published_params_rounded=str(raw.get("published_params_rounded", "")),
            meta_build=raw.get("meta_build"),
            published_counts_tied_head_twice=bool(raw.get("published_counts_tied_head_twice", False)),
            published_includes_vision_tower=bool(raw.get("published_includes_vision_tower", False)),
        )
    return out


@lru_cache(maxsize=1)
def _name_index() -> dict[str, str]:
    index: dict[str, str] = {}
    for key, entry in model_entries().items():
        for name in (key, entry.hub_id, entry.hub_id.split("/")[-1], *entry.aliases):
            index[_norm(name)] = key
    # A former hub id kept as an alias (meta-llama/Meta-Llama-3.1-8B, renamed Llama-3.1-8B) is also known by its
    # last part, so that mirrors of it (NousResearch/Meta-Llama-3.1-8B) resolve by pattern as well.
    for key, entry in model_entries().items():
        for name in entry.aliases:
            if "/" in name:
                index.setdefault(_norm(name.split("/")[-1]), key)
    return index


@cache
def _entry_spec(key: str) -> ModelSpec:
    entry = model_entries()[key]
    source = f"catalog:{key} ({entry.config_source})"
    if entry.meta_build is not None:
        from vramledger.catalog.inventory import spec_from_json

        return spec_from_json(entry.meta_build, entry.config, name=entry.hub_id, source=source)
    return model_spec_from_config(entry.config, name=entry.hub_id, source=source)


def _hf_cache_dirs() -> list[Path]:
    if os.environ.get("HF_HUB_CACHE"):
        return [Path(os.environ["HF_HUB_CACHE"])]
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    return [home / "hub"]


def _from_hf_cache(name: str) -> Path | None:
    if "/" not in name or len(name) > 200:  # hub ids are at most 96 characters
        return None
    folder = "models--" + name.replace("/", "--")
    for hub in _hf_cache_dirs():
        snapshots = hub / folder / "snapshots"
        if snapshots.is_dir():
            for snap in sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True):
                if (snap / "config.json").is_file():
                    return snap / "config.json"
    return None


def _repo_id_of_snapshot(path: Path) -> str | None:
    """``org/name`` for a config.json inside the HF cache (``models--org--name/snapshots/<hash>/``), whose
    folder name is a commit hash, not a model name (huggingface_hub ``file_download.repo_folder_name``)."""
    parts = path.resolve().parts
    if len(parts) >= 4 and parts[-3] == "snapshots" and parts[-4].startswith("models--"):
        return parts[-4].removeprefix("models--").replace("--", "/")
    return None


def load_config_file(path: Path) -> ModelSpec:
    """Read a local config.json (or a directory holding one)."""
    from vramledger.userfiles import load_mapping_text, path_exists, read_text

    if path_exists(str(path)) and path.is_dir():
        path = path / "config.json"
    if not path_exists(str(path)):
        raise VramledgerError(f"model: no config.json at {path}; pass a config.json file or its directory")
    # bounded reading (regular file, size, nesting): vramledger.userfiles
    raw = load_mapping_text(read_text(path, "model"), "model", path.with_suffix(".json"))
    if not isinstance(raw, dict):
        raise VramledgerError(f"model: {path}: expected a JSON object (a config.json); pass another config.json")
    # a file named for its model (olmo2.json) by its own name; a config.json by its folder's, even when the path is
    # relative (Path("config.json").parent.name is "")
    own = path.stem if path.name != "config.json" else path.resolve().parent.name
    name = raw.get("_name_or_path") or _repo_id_of_snapshot(path) or own
    return model_spec_from_config(_special_floats(raw), name=str(name), source=str(path))


# transformers 5 writes the floats JSON cannot hold as tagged objects (configuration_utils.py
# ``PreTrainedConfig._encode_special_floats``: ``{"__float__": "Infinity"}``, "-Infinity", "NaN"; Bamba's
# ``time_step_limit`` is ``[0.0, inf]``) and reads them back with ``_decode_special_floats``.
_FLOAT_TAGS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def _special_floats(obj: Any) -> Any:
    """``obj`` with transformers' tagged special floats decoded (``_FLOAT_TAGS``)."""
    if isinstance(obj, dict):
        if obj.keys() == {"__float__"} and obj["__float__"] in _FLOAT_TAGS:
            return _FLOAT_TAGS[obj["__float__"]]
        return {k: _special_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_special_floats(v) for v in obj]
    return obj


def resolve_model(name: str) -> ModelSpec:
    """A ModelSpec from a path, a catalog name or the local HF cache; unknown names get close matches."""
    if not name or not name.strip():
        raise VramledgerError("model: empty name; pass a catalog name (see `vramledger models`) or a config.json")
    from vramledger.userfiles import path_exists, user_path

    path = user_path(name)
    if name.endswith(".json") or path_exists(name):
        return load_config_file(path)
    key = _name_index().get(_norm(name))
    if key is not None:
        return _named(name, key)
    cached = _from_hf_cache(name)
    if cached is not None:
        return load_config_file(cached)
    key = _by_pattern(name)
    if key is not None:
        return _named(name, key)
    close = difflib.get_close_matches(_norm(name), list(_name_index()), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise VramledgerError(
        f"model: {name!r} is not in the catalog or the local HF cache{hint} "
        "(pass the path of its config.json, or name a catalog model of the same shapes: "
        "`vramledger estimate <catalog-name> --config FILE`; `vramledger models` lists the catalog)"
    )


def _named(name: str, key: str) -> ModelSpec:
    """The entry's spec under the name the user gave: a variant or mirror keeps its own name (it is another
    model), with ``config_name`` saying whose config stands in for it."""
    spec = _entry_spec(key)
    entry = model_entries()[key]
    canonical = {_norm(key), _norm(entry.hub_id), _norm(entry.hub_id.split("/")[-1])}
    if _norm(name) in canonical:
        return spec
    return replace(spec, name=name.strip(), config_name=entry.hub_id)


# Suffixes that name a variant with the base model's shapes: chat/instruct tunes, dated re-releases
# (Qwen3-4B-Instruct-2507), transformers-format uploads (-hf), and quantised mirrors (unsloth's -bnb-4bit,
# -AWQ, -GPTQ-Int4, -FP8, -bnb-nf4, and half-precision re-uploads such as casperhansen/llama-3-70b-fp16), whose
# storage differs but whose architecture does not; axolotl's "-Linearized" MoE uploads (axolotl-quants/
# Llama-4-Scout-17B-16E-Linearized-bnb-nf4-bf16) store each expert as its own Linear, the same parameters.
_VARIANT = re.compile(
    r"[-.](instruct|chat|it|base|hf|pt|sft|dpo|\d{4}|unsloth|bnb-4bit|bnb-8bit|4bit|8bit|awq|gptq|int4|int8|fp8|fp16"
    r"|bf16|bnb-nf4|linearized)$"
)


def _candidates(name: str) -> list[str]:
    """Spellings to try for a name not found as typed: without the mirror's organisation, without variant
    suffixes, and torchtune builder names (``qwen2_5_7b_instruct``, ``llama3_1_8b``) with their version dots."""
    base = _norm(name.split("/")[-1])
    out: list[str] = []
    stripped = base
    while True:
        out.append(stripped)
        shorter = _VARIANT.sub("", stripped)
        if shorter == stripped or not shorter:
            break
        stripped = shorter
    # torchtune: underscores for dots too; try each version written with dots (2-5 → 2.5, 0-5b → 0.5b).
    dotted = [re.sub(r"(\d)-(\d)", r"\1.\2", c) for c in out]
    return out + dotted + [re.sub(r"(\d)-(\d+b)$", r"\1.\2", d) for d in dotted]


def _by_pattern(name: str) -> str | None:
    index = _name_index()
    for candidate in _candidates(name):
        if candidate in index:
            return index[candidate]
    return None


def variant_note(spec: ModelSpec) -> str | None:
    """The printed note when a name resolved by pattern (None when the name is the catalog model itself)."""
    if not spec.config_name:
        return None
    return (
        f"model {spec.name!r} is not in the catalog as such: sized with the config of {spec.config_name} "
        "(a variant or mirror of the same architecture); pass its own config.json if its shapes differ"
    )


def catalog_entry(name: str) -> CatalogEntry | None:
    """The catalog entry for a name, its variants and mirrors included."""
    key = _name_index().get(_norm(name)) or _by_pattern(name)
    return model_entries()[key] if key else None


@lru_cache(maxsize=1)
def gpu_entries() -> dict[str, GPUSpec]:
    raw = json.loads((_HERE / "gpus.json").read_text())
    out: dict[str, GPUSpec] = {}
    for item in raw["gpus"]:
        item = dict(item)
        item.pop("aliases", None)
        out[item["key"]] = GPUSpec(**item)
    return out


@lru_cache(maxsize=1)
def _gpu_index() -> dict[str, str]:
    raw = json.loads((_HERE / "gpus.json").read_text())
    index: dict[str, str] = {}
    for item in raw["gpus"]:
        for name in (item["key"], item["name"], *item.get("aliases", ())):
            index[_norm(name)] = item["key"]
    return index


def resolve_gpu(name: str) -> GPUSpec:
    """A GPU from the catalog by key, name or alias; or a size (``24GiB``, ``NAME:80GB``) for a custom GPU."""
    from vramledger.units import parse_size

    norm = _norm(name)
    key = _gpu_index().get(norm)
    if key is not None:
        return gpu_entries()[key]
    size_text = name.split(":")[-1]
    size = parse_size(size_text)
    if size is not None and size <= 0:
        raise VramledgerError(f"gpu: {name!r} is no memory; give the card's size, e.g. --gpu 24GiB")
    if size is not None:
        label = name.split(":")[0] if ":" in name else f"custom {size_text}"
        return GPUSpec(
            name=label,
            key="custom",
            memory_bytes=size,
            bf16_tflops=0.0,
            memory_bandwidth_gbs=0.0,
            host_link_gbs=0.0,
            source="given on the command line",
        )
    close = difflib.get_close_matches(norm, list(_gpu_index()), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise VramledgerError(
        f"gpu: {name!r} is not in the catalog{hint} (or give a size such as --gpu 24GiB; `vramledger gpus` lists them)"
    )
