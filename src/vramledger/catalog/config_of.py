"""The config.json a model is built from when real code runs it (``trace`` on fake tensors, ``measure`` on a GPU).

One home for both engines; nothing is downloaded: the config comes from the catalog, the user's file, the
meta-device inventory, or the spec itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vramledger.catalog.hfconfig import language_model
from vramledger.specs import ModelSpec


def config_of(model: ModelSpec, *, vision: bool = False) -> dict[str, Any]:
    """The config.json mapping a ModelSpec came from: its meta-device build's, the catalog entry, the file named in
    ``source`` (a multimodal file's ``text_config``, typed ``<model_type>_text``, unless ``vision``: then the whole
    multimodal config, tower and projector included), or (for a spec built by hand) a mapping rebuilt from the
    spec's fields. What ``trace`` and ``measure`` build their models from."""
    from vramledger.catalog import catalog_entry

    pick = dict if vision else language_model
    if model.inventory is not None:  # built on the meta device once already: the very config it came from
        return dict(json.loads(model.inventory.config_json))
    entry = catalog_entry(model.config_name or model.name)
    if entry is not None and entry.hub_id in (model.name, model.config_name):
        return dict(pick(entry.config))
    src = Path(model.source) if model.source else None
    if src is not None and src.suffix == ".json" and src.is_file():
        return dict(pick(json.loads(src.read_text())))
    return config_from_spec(model)


def config_from_spec(m: ModelSpec) -> dict[str, Any]:
    """config.json keys rebuilt from a ModelSpec (the inverse of ``catalog.hfconfig.model_spec_from_config``)."""
    if m.family == "gpt2":
        return {
            "model_type": "gpt2",
            "vocab_size": m.vocab_size,
            "n_embd": m.hidden_size,
            "n_layer": m.num_layers,
            "n_head": m.num_heads,
            "n_inner": m.intermediate_size,
            "n_positions": m.learned_positions or m.max_position_embeddings or 1024,
            "activation_function": m.hidden_act,
            "tie_word_embeddings": m.tie_word_embeddings,
        }
    cfg: dict[str, Any] = {
        "model_type": m.family,
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.intermediate_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads,
        "head_dim": m.head_dim,
        "tie_word_embeddings": m.tie_word_embeddings,
        "max_position_embeddings": m.max_position_embeddings or 4096,
        "hidden_act": m.hidden_act,
        "attention_bias": m.qkv_bias,
        "mlp_bias": m.mlp_bias,
    }
    if m.sliding_window:
        cfg["sliding_window"] = m.sliding_window
    if m.num_experts:
        cfg.update(
            num_experts=m.num_experts,
            num_local_experts=m.num_experts,
            num_experts_per_tok=m.experts_per_token,
            moe_intermediate_size=m.moe_intermediate_size,
        )
    if m.final_logit_softcapping:
        cfg["final_logit_softcapping"] = m.final_logit_softcapping
    if m.attn_logit_softcapping:
        cfg["attn_logit_softcapping"] = m.attn_logit_softcapping
    return cfg
