"""The Hugging Face config mapping a trial builds its model from (random weights, nothing downloaded).

Preferred source: the verbatim config.json fields bundled in the catalog, or the user's config.json file.
Fallback: a config written back from the ModelSpec, for the families whose transformers config takes the
standard keys (``LlamaConfig``, ``MistralConfig``, ``Qwen2Config``, ``Qwen3Config``, ``Gemma2Config`` …).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vramledger.errors import VramledgerError
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


def spec_to_hf_config(spec: ModelSpec) -> dict[str, Any]:
    """config.json keys rebuilt from a ModelSpec (inverse of ``catalog.hfconfig.model_spec_from_config``)."""
    if spec.family == "gpt2":
        return {
            "model_type": "gpt2",
            "vocab_size": spec.vocab_size,
            "n_embd": spec.hidden_size,
            "n_head": spec.num_heads,
            "n_layer": spec.num_layers,
            "n_inner": spec.intermediate_size,
            "n_positions": spec.learned_positions or spec.max_position_embeddings or 1024,
            "tie_word_embeddings": spec.tie_word_embeddings,
        }
    if spec.is_moe or spec.fused_qkv:
        raise VramledgerError(
            f"model {spec.name}: measuring needs its config.json (family {spec.family}); pass its path"
        )
    cfg: dict[str, Any] = {
        "model_type": spec.family,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "max_position_embeddings": spec.max_position_embeddings or 4096,
        "hidden_act": spec.hidden_act,
    }
    if spec.family in ("llama", "mistral", "qwen3", "gemma2", "gemma3_text"):
        cfg["attention_bias"] = spec.qkv_bias
    if spec.family == "llama":
        cfg["mlp_bias"] = spec.mlp_bias
    if spec.sliding_window:
        cfg["sliding_window"] = spec.sliding_window
        if spec.family == "qwen2":
            cfg["use_sliding_window"] = True
    if spec.final_logit_softcapping:
        cfg["final_logit_softcapping"] = spec.final_logit_softcapping
    if spec.attn_logit_softcapping:
        cfg["attn_logit_softcapping"] = spec.attn_logit_softcapping
    return cfg


def hf_config_for(spec: ModelSpec) -> dict[str, Any]:
    """The config to build ``spec`` from: the catalog entry, else its config.json, else the spec itself."""
    from vramledger.catalog import catalog_entry

    entry = catalog_entry(spec.name)
    if entry is not None:
        return _clean(dict(entry.config))
    src = Path(spec.source) if spec.source else None
    if src is not None and src.is_file():
        try:
            return _clean(json.loads(src.read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise VramledgerError(f"model: cannot read {src} ({exc}); pass a valid config.json") from exc
    return spec_to_hf_config(spec)
