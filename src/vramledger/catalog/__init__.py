"""Bundled model configs and GPU facts, stored as data files, and the one module that loads them.

Model files: ``catalog/models/<alias>.json`` with keys ``hub_id``, ``aliases``, ``published_params``,
``params_source``, ``config_source`` and ``config`` (the upstream config.json's fields, copied verbatim), and
optionally ``published_counts_tied_head_twice`` / ``published_includes_vision_tower`` where the published
figure counts more than the language model's parameters. GPUs: ``catalog/gpus.json``.

A model name resolves, in order, to: a path (a config.json file or a directory holding one), a catalog entry
(hub id or alias, case-insensitive), or a snapshot in the local Hugging Face cache. Nothing is downloaded and
no remote code runs.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass
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
    return index


@cache
def _entry_spec(key: str) -> ModelSpec:
    entry = model_entries()[key]
    source = f"catalog:{key} ({entry.config_source})"
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
    name = raw.get("_name_or_path")
    return model_spec_from_config(raw, name=str(name or path.parent.name), source=str(path))


def resolve_model(name: str) -> ModelSpec:
    """A ModelSpec from a path, a catalog name or the local HF cache; unknown names get close matches."""
    if not name or not name.strip():
        raise VramledgerError(
            "model: empty name; pass a catalog name (see `vramledger models`) or a config.json"
        )
    from vramledger.userfiles import path_exists, user_path

    path = user_path(name)
    if name.endswith(".json") or path_exists(name):
        return load_config_file(path)
    key = _name_index().get(_norm(name))
    if key is not None:
        return _entry_spec(key)
    cached = _from_hf_cache(name)
    if cached is not None:
        return load_config_file(cached)
    close = difflib.get_close_matches(_norm(name), list(_name_index()), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise VramledgerError(
        f"model: {name!r} is not in the catalog or the local HF cache{hint} "
        "(or pass the path of its config.json; `vramledger models` lists the catalog)"
    )


def catalog_entry(name: str) -> CatalogEntry | None:
    key = _name_index().get(_norm(name))
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
        f"gpu: {name!r} is not in the catalog{hint} "
        "(or give a size such as --gpu 24GiB; `vramledger gpus` lists them)"
    )
