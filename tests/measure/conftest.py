from __future__ import annotations

import json
from pathlib import Path

import pytest

# A 2-layer Llama small enough to train on a CPU in a second (GQA: 4 query heads, 2 key/value heads).
TINY_LLAMA = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


@pytest.fixture(scope="session")
def tiny_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return path


@pytest.fixture(scope="session")
def tiny_model(tiny_config: Path):  # type: ignore[no-untyped-def]
    from vramledger.catalog import resolve_model

    return resolve_model(str(tiny_config))
