"""Llama 4 with images through the real code on fake tensors: ``Llama4ForConditionalGeneration`` fed the image
processor's tiles (trace/vision_inputs.py ``_tile_inputs``), against the estimate's tower terms.

The trace checks the token count itself: ``Llama4Model.get_placeholder_mask`` refuses a batch whose ``<|patch|>``
count differs from the pixel-shuffled tower output, so a trace that runs is one whose tiles and tokens agree.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.trace.test_vision_trace import assert_agree
from vramledger.analytic import estimate
from vramledger.analytic.vision import image_tokens
from vramledger.catalog.hfconfig import model_spec_from_config
from vramledger.specs import LoraSpec, ModelSpec, TrainSpec

transformers = pytest.importorskip("transformers")

# transformers 5.24.0's Llama4ForConditionalGeneration.forward returns ``outputs.image_outputs`` of its language
# model's output, a MoeCausalLMOutputWithPast that has no such field (modeling_llama4.py, the forward's return): every
# forward of the model raises AttributeError there, in a real run as on fake tensors.
pytestmark = pytest.mark.skipif(
    transformers.__version__ == "5.24.0",
    reason="transformers 5.24.0: Llama4ForConditionalGeneration.forward reads a field its output lacks",
)

# Llama 4's classes at toy sizes: 2 MoE decoder layers, a 2-layer tower over 56² tiles of 14-pixel patches (16
# patches and a class token per tile), pixel shuffle 0.5 (4 tokens per tile); the pixel-shuffle MLP's input width
# (intermediate_size) is the tower's width over the shuffle ratio², as in Scout (1408 / 0.25 = 5632).
TINY_LLAMA4: dict[str, Any] = {
    "architectures": ["Llama4ForConditionalGeneration"],
    "model_type": "llama4",
    "torch_dtype": "bfloat16",
    "boi_token_index": 500,
    "eoi_token_index": 501,
    "image_token_index": 502,
    "tie_word_embeddings": False,
    "text_config": {"model_type": "llama4_text", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                    "intermediate_size_mlp": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 2, "num_experts_per_tok": 1,
                    "interleave_moe_layer_step": 1, "attention_chunk_size": 64, "max_position_embeddings": 4096,
                    "no_rope_layers": [1, 0]},
    "vision_config": {"model_type": "llama4_vision_model", "hidden_size": 64, "image_size": 56,
                      "intermediate_size": 256, "num_attention_heads": 4, "num_hidden_layers": 2, "patch_size": 14,
                      "pixel_shuffle_ratio": 0.5, "projector_input_dim": 64, "projector_output_dim": 64,
                      "vision_output_dim": 64},
}  # fmt: skip
# PEFT's all-linear would wrap Llama4Router, whose forward returns two tensors (trace/build.py refuses it).
PROJECTIONS = LoraSpec(targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))


@pytest.fixture(scope="module")
def tiny_llama4(tmp_path_factory: pytest.TempPathFactory) -> ModelSpec:
    path: Path = tmp_path_factory.mktemp("llama4") / "config.json"
    path.write_text(json.dumps(TINY_LLAMA4))
    return model_spec_from_config(TINY_LLAMA4, name="tiny-llama4", source=str(path))


def test_llama4_tiles_trace_and_agree(tiny_llama4: ModelSpec) -> None:
    """LLaMA-Factory's setup (LoRA, tower frozen, checkpointing): one 112×56 image is 1×2 tiles plus the global
    tile, 3 × (16 + 1) tower positions and 3 × 4 = 12 tokens. Saved activations within 10%: the trace files the
    language model's scattered input embeddings and their placeholder mask (9.7 kB + 512 B here: the estimate is 8%
    over) under logits and loss, as Llama4ForConditionalGeneration makes them at its top level, where the loss is
    computed (trace/classify.py); the estimate counts them as saved activations, as for Qwen-VL and Gemma 3."""
    train = TrainSpec(seq_len=64, images=1, image_size=(112, 56), grad_ckpt=True, freeze_vision_tower=True,
                      lora=PROJECTIONS)  # fmt: skip
    assert image_tokens(tiny_llama4, train) == 12
    est = estimate(tiny_llama4, train)
    assert_agree(est, tiny_llama4, train, saved_rel=0.10, peak_rel=0.06)


def test_llama4_full_fine_tuning_freezes_the_tower_in_the_trace_too(tiny_llama4: ModelSpec) -> None:
    """Full fine-tuning with the tower frozen: the trace's trainable count (requires_grad after trace/build.py) is
    the estimate's, the tower's parameters fewer than with it training."""
    from vramledger.trace.api import trace_result

    counts = {}
    for frozen in (True, False):
        train = TrainSpec(seq_len=64, images=1, image_size=(56, 56), method="full", freeze_vision_tower=frozen)
        est = estimate(tiny_llama4, train)
        result, _ = trace_result(tiny_llama4, train)
        print(f"frozen={frozen}: trainable estimate {est.trainable_params:,}, trace {result.trainable_params:,}")
        assert est.trainable_params == result.trainable_params
        assert est.params == result.params
        counts[frozen] = est.trainable_params
    from vramledger.analytic.vision_params import tower_params

    assert counts[False] - counts[True] == tower_params(tiny_llama4) > 0
