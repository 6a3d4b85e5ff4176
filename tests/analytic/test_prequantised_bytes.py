"""Storage of pre-quantised checkpoints against the tensors the loaders register, written out by hand.

Each expected figure is the buffer shapes of the loading layer (cited), with element sizes, for one Llama-3-8B
q_proj (in = out = 4096) or down_proj (in = 14336, out = 4096)."""

from __future__ import annotations

import pytest

from vramledger.analytic.weights import awq_bytes, fp8_block_bytes, gptq_bytes, mxfp4_bytes, quantised_bytes
from vramledger.specs import QuantSpec


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
