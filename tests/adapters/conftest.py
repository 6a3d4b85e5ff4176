"""A private Hugging Face cache holding the config.json of the hub models the fixtures name, so that model
resolution works offline exactly as it would for a user who has downloaded them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
CATALOG = Path(__file__).parents[2] / "src" / "vramledger" / "catalog" / "models"

# Qwen2-0.5B's config.json (https://huggingface.co/Qwen/Qwen2-0.5B/blob/main/config.json), the fields that matter.
QWEN2_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
}


@pytest.fixture(autouse=True)
def hf_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path_factory.getbasetemp() / "hf-hub"
    if not root.exists():
        llama3 = json.loads((CATALOG / "llama-3-8b.json").read_text())["config"]  # same shape as the Instruct one
        for hub, cfg in (
            ("meta-llama/Meta-Llama-3-8B-Instruct", llama3),
            ("NousResearch/Meta-Llama-3-8B", llama3),
            ("NousResearch/Meta-Llama-3.1-8B", llama3),
            ("Qwen/Qwen2-0.5B", QWEN2_05B),
            ("Qwen/Qwen2.5-0.5B", QWEN2_05B),
        ):
            snap = root / ("models--" + hub.replace("/", "--")) / "snapshots" / "0"
            snap.mkdir(parents=True)
            (snap / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    return root
