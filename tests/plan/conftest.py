"""Shared fixtures for the plan tests: a tiny Llama written out here, and a GPU of a chosen size."""

from __future__ import annotations

import pytest

from vramledger.catalog import resolve_gpu
from vramledger.catalog.hfconfig import model_spec_from_config
from vramledger.specs import GPUSpec

TINY_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "tie_word_embeddings": False,
    "max_position_embeddings": 4096,
}


@pytest.fixture(scope="session")
def tiny():  # type: ignore[no-untyped-def]
    return model_spec_from_config(TINY_CONFIG, name="tiny-llama", source="test")


@pytest.fixture(scope="session")
def rtx4090() -> GPUSpec:
    return resolve_gpu("rtx-4090")
