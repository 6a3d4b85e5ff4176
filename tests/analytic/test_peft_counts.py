"""Trainable-parameter counts against the figures PEFT prints (``print_trainable_parameters``)."""

import pytest

from vramledger.analytic.weights import weight_budget
from vramledger.catalog import resolve_model
from vramledger.catalog.hfconfig import model_spec_from_config
from vramledger.specs import LoraSpec, Method, TrainSpec

# Llama-2-7B's config.json (huggingface.co/meta-llama/Llama-2-7b-hf), written here so the test stands alone.
LLAMA2_7B = model_spec_from_config(
    {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "num_hidden_layers": 32,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
    },
    name="llama-2-7b",
    source="test",
)


def test_llama2_7b_lora_r8_q_v() -> None:
    # PEFT on Llama-2-7B, r=8, target q_proj and v_proj:
    # "trainable params: 4,194,304 || all params: 6,742,609,920 || trainable%: 0.0622"
    t = TrainSpec(method=Method.LORA, lora=LoraSpec(rank=8, targets=("q_proj", "v_proj")))
    wb = weight_budget(LLAMA2_7B, t)
    assert wb.trainable_params == 4_194_304
    assert wb.total_params == 6_742_609_920


def test_llama3_8b_lora_r16_all_linear() -> None:
    # PEFT on Meta-Llama-3-8B, r=16, target_modules="all-linear": "trainable params: 41,943,040"
    t = TrainSpec(method=Method.LORA, lora=LoraSpec(rank=16))
    assert weight_budget(resolve_model("llama-3-8b"), t).trainable_params == 41_943_040


def test_unknown_target_is_a_clear_error() -> None:
    from vramledger.errors import VramledgerError

    t = TrainSpec(method=Method.LORA, lora=LoraSpec(rank=8, targets=("query_key_value",)))
    with pytest.raises(VramledgerError, match="query_key_value not found"):
        weight_budget(LLAMA2_7B, t)
