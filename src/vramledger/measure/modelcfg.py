"""The Hugging Face config mapping a trial builds its model from (random weights, nothing downloaded): the one
``trace`` builds from (``catalog/config_of.py``), less the keys that describe a checkpoint."""

from __future__ import annotations

from typing import Any

from vramledger.specs import ModelSpec

# Keys that describe a checkpoint rather than an architecture; from_config must not see them.
_DROP = ("architectures", "transformers_version", "_name_or_path", "auto_map", "quantization_config")


def _clean(cfg: dict[str, Any]) -> dict[str, Any]:
    cfg = {k: v for k, v in cfg.items() if k not in _DROP}
    if "text_config" in cfg and isinstance(cfg["text_config"], dict):
        # Multimodal wrappers (Gemma 3): we train the language model alone, as ModelSpec describes it.
        text = dict(cfg["text_config"])
        text.setdefault("model_type", f"{cfg.get('model_type', '')}_text")
        cfg = {k: v for k, v in text.items() if k not in _DROP}
    return cfg


def hf_config_for(spec: ModelSpec) -> dict[str, Any]:
    """The config to build ``spec`` from (:func:`vramledger.catalog.config_of.config_of`, the one home shared with
    ``trace``), less the keys that describe a checkpoint rather than an architecture."""
    from vramledger.catalog.config_of import config_of

    return _clean(config_of(spec))
