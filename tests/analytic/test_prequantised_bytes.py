"""Storage of pre-quantised checkpoints against the tensors the loaders register, written out by hand.

Each expected figure is the buffer shapes of the loading layer (cited), with element sizes, for one Llama-3-8B
q_proj (in = out = 4096) or down_proj (in = 14336, out = 4096)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramledger.analytic.weights import awq_bytes, fp8_block_bytes, gptq_bytes, mxfp4_bytes, quantised_bytes
from vramledger.catalog import resolve_model
from vramledger.errors import VramledgerError
from vramledger.specs import ModelSpec, QuantSpec


def test_gptq_4bit_group_128() -> None:
    # qweight (4096·4/32, 4096) int32, qzeros (32, 4096·4/32) int32, scales (32, 4096) fp16, g_idx (4096) int32.
    hand = 512 * 4096 * 4 + 32 * 512 * 4 + 32 * 4096 * 2 + 4096 * 4
    assert gptq_bytes(4096, 4096, bits=4, group_size=128) == hand
    # 4 bits + 16/128 (scale) + 4/128 (zero) + 32/4096 (g_idx) = 4.164 bits per weight
    assert 8 * hand / 4096**2 == pytest.approx(4 + 16 / 128 + 4 / 128 + 32 / 4096)


def test_gptq_8bit_per_channel_with_bias() -> None:
    # group_size -1: one group; qweight (14336·8/32, 4096); bias fp16.
    hand = 3584 * 4096 * 4 + 1 * 1024 * 4 + 1 * 4096 * 2 + 14336 * 4 + 4096 * 2
    assert gptq_bytes(14336, 4096, bits=8, group_size=-1, bias=True) == hand


def test_awq_gemm_4bit() -> None:
    # qweight (14336, 4096/8) int32, qzeros (112, 512) int32, scales (112, 4096) fp16.
    hand = 14336 * 512 * 4 + 112 * 512 * 4 + 112 * 4096 * 2
    assert awq_bytes(14336, 4096, bits=4, group_size=128) == hand


def test_fp8_block_scales() -> None:
    assert fp8_block_bytes(14336, 4096) == 14336 * 4096 + 32 * 112 * 4
    assert fp8_block_bytes(4096, 4096, block=None) == 4096 * 4096 + 4


def test_mxfp4_is_four_and_a_quarter_bits() -> None:
    # gpt-oss-20b gate_up_proj of one expert: 5760 × 2880 values, blocks 5760·90·16 bytes, scales 5760·90.
    assert mxfp4_bytes(5760 * 2880) == 5760 * 90 * 16 + 5760 * 90
    assert 8 * mxfp4_bytes(5760 * 2880) / (5760 * 2880) == pytest.approx(4.25)


def test_bitsandbytes_int8_is_weights_plus_row_scales() -> None:
    # bitsandbytes Int8Params: int8 (out, in) and SCB fp32 (out); outliers (threshold 6.0) are a run-time split of
    # the activations in LLM.int8, not stored.
    assert quantised_bytes(4096 * 14336, 4096, QuantSpec(bits=8)) == 4096 * 14336 + 4 * 4096


def test_gpt_oss_20b_loads_its_experts_in_mxfp4() -> None:
    # integrations/mxfp4.py Mxfp4GptOssExperts: per layer, 32 experts of gate_up (5760 × 2880) and down
    # (2880 × 2880) in MXFP4, their biases in fp32; everything else (attention, router, embeddings, lm_head,
    # norms, sinks) stays bf16 (modules_to_not_convert).
    from vramledger.analytic.params import count_params
    from vramledger.analytic.weights import checkpoint_storage_bytes
    from vramledger.catalog import resolve_model

    m = resolve_model("gpt-oss-20b")
    experts = 32 * (5760 * 2880 + 2880 * 2880)
    packed = 32 * (mxfp4_bytes(5760 * 2880) + mxfp4_bytes(2880 * 2880))
    bias_fp32 = 32 * (5760 + 2880) * 4
    bias_numel = 32 * (5760 + 2880)
    hand = 24 * (packed + bias_fp32) + (count_params(m) - 24 * (experts + bias_numel)) * 2
    assert checkpoint_storage_bytes(m, 2) == hand
    assert 12.7 < hand / 2**30 < 12.9  # the checkpoint's safetensors files total about 13.8 GB


def _llama_with(tmp_path: Path, quantization_config: dict[str, object]) -> ModelSpec:
    """A tiny Llama config.json carrying ``quantization_config``, resolved as a user's file would be."""
    cfg = {
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "torch_dtype": "float16",
        "quantization_config": quantization_config,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return resolve_model(str(tmp_path / "config.json"))


def test_gptq_checkpoint_under_lora(tmp_path: Path) -> None:
    from vramledger.analytic.weights import weight_budget
    from vramledger.specs import LoraSpec, Method, TrainSpec

    m = _llama_with(tmp_path, {"quant_method": "gptq", "bits": 4, "group_size": 64})
    linears = [(128, 128)] * 4 + [(128, 256), (128, 256), (256, 128)]  # q k v o gate up down (in, out)
    packed = 2 * sum(gptq_bytes(i, o, bits=4, group_size=64) for i, o in linears)
    rest = 2 * 256 * 128 + 2 * (2 * 128) + 128  # embed + untied lm_head, 2 norms per layer, final norm
    train = TrainSpec(method=Method.LORA, lora=LoraSpec(rank=4), micro_batch=1, seq_len=16)
    assert weight_budget(m, train).frozen_bytes == packed + rest * 2


def test_unmodelled_checkpoint_quantisation_is_named(tmp_path: Path) -> None:
    with pytest.raises(VramledgerError, match=r"quant_method 'hqq' is not modelled; modelled: gptq, awq, fp8, mxfp4"):
        _llama_with(tmp_path, {"quant_method": "hqq"})
