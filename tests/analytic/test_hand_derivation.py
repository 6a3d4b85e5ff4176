"""Activation, logits and weight bytes of a small config, derived by hand in each test from the model code."""

import pytest

from vramledger.analytic import estimate
from vramledger.analytic.activations import layer_activations
from vramledger.analytic.logits import logits_bytes
from vramledger.analytic.params import count_params
from vramledger.analytic.weights import quantised_bytes, weight_budget
from vramledger.catalog.hfconfig import model_spec_from_config
from vramledger.ledger import Category, Phase
from vramledger.specs import Attention, LoraSpec, Method, Optimizer, Precision, QuantSpec, TrainSpec

# A tiny Llama: H=64, I=176, 4 heads of 16, 2 KV heads (GQA), vocab 1000, 2 layers, untied.
TINY = model_spec_from_config(
    {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": 1000,
        "tie_word_embeddings": False,
    },
    name="tiny-llama",
    source="test",
)
H, I, Dq, Dkv, nh, V = 64, 176, 64, 32, 4, 1000


def test_tiny_param_count() -> None:
    # embed V·H + per layer (q H·Dq + k H·Dkv + v H·Dkv + o Dq·H + 3·H·I + 2 norms H) + final norm H + lm_head V·H
    per_layer = H * Dq + 2 * H * Dkv + Dq * H + 3 * H * I + 2 * H
    assert count_params(TINY) == V * H + 2 * per_layer + H + V * H


def test_full_pure_bf16_sdpa_layer() -> None:
    # Two RMSNorms: fp32 copy (4H) + bf16 normalised value saved by weight·h (2H) → 12H.
    # q/k/v input (2H, shared) and MLP input (2H); SDPA saves q (2Dq), k, v (2Dkv each), out (2Dq), lse (4·nh);
    # MLP saves gate, act, up, product (4 × 2I).
    t = TrainSpec(method=Method.FULL, precision=Precision.BF16, micro_batch=1, seq_len=32)
    la = layer_activations(TINY, t, weight_budget(TINY, t))
    expected = 12 * H + 4 * H + 2 * (2 * Dq + 2 * Dkv) + 4 * nh + 8 * I
    print("expected", expected, "got", la.per_token)
    assert la.per_token == expected


def test_full_amp_layer_has_fp32_residual_and_per_consumer_casts() -> None:
    # AMP, fp32 weights: residual stream fp32. Norms save the fp32 input (4H) and the fp32 normalised value (4H);
    # q, k, v, gate, up each cast their fp32 input to bf16 (5 × 2H). Attention and MLP tensors are bf16 as above.
    t = TrainSpec(method=Method.FULL, precision=Precision.BF16_MIXED, micro_batch=1, seq_len=32)
    la = layer_activations(TINY, t, weight_budget(TINY, t))
    expected = 2 * (4 * H + 4 * H) + 5 * 2 * H + 2 * (2 * Dq + 2 * Dkv) + 4 * nh + 8 * I
    assert la.per_token == expected


def test_lora_amp_layer() -> None:
    # LoRA r=8 on all 7 projections under autocast, dropout 0.1, base bf16 frozen:
    # norms keep only the fp32 copy (4H each, weight frozen); each adapter saves its input re-cast to bf16
    # (2·in) + a bool dropout mask (1·in) + lora_A's bf16 output (2r); SDPA as before; MLP saves gate, act, up
    # (3 × 2I): the frozen down projection keeps no input of its own.
    r = 8
    t = TrainSpec(method=Method.LORA, micro_batch=1, seq_len=32, lora=LoraSpec(rank=r, dropout=0.1))
    ins = [H, H, H, Dq, H, H, I]  # q k v o gate up down
    adapters = sum(3 * i + 2 * r for i in ins)
    expected = 2 * 4 * H + adapters + 2 * (2 * Dq + 2 * Dkv) + 4 * nh + 3 * 2 * I
    la = layer_activations(TINY, t, weight_budget(TINY, t))
    assert la.per_token == expected


def test_eager_scores_per_sequence() -> None:
    # eager: fp32 softmax (4) + bf16 probabilities (2) per head per L² → 6·nh·L² bytes per sequence per layer.
    t = TrainSpec(method=Method.FULL, precision=Precision.BF16, micro_batch=1, seq_len=32, attn=Attention.EAGER)
    la = layer_activations(TINY, t, weight_budget(TINY, t))
    assert la.scores_per_seq == 6 * nh * 32 * 32


def test_standard_loss_bytes() -> None:
    # bf16 logits (2V) + fp32 copy (4V) + log-softmax (4V) per token in forward; 12V in its backward.
    t = TrainSpec(method=Method.FULL, precision=Precision.BF16, micro_batch=2, seq_len=32)
    lb = logits_bytes(TINY, t, t.tokens)
    assert lb.forward_peak == 10 * V * 64
    assert lb.backward_peak == 12 * V * 64
    assert lb.saved == 4 * V * 64


def test_fp32_has_no_upcast_copy() -> None:
    t = TrainSpec(method=Method.FULL, precision=Precision.FP32, micro_batch=1, seq_len=32)
    assert logits_bytes(TINY, t, 32).forward_peak == 8 * V * 32


def test_nf4_double_quant_storage() -> None:
    # 4096×4096 weight: 8,388,608 packed bytes + 262,144 uint8 absmax (one per 64) + 1,024 fp32 second-level absmax.
    q = QuantSpec(bits=4, quant_type="nf4", double_quant=True)
    assert quantised_bytes(4096 * 4096, 4096, q) == 8_388_608 + 262_144 + 4 * 1024
    q2 = QuantSpec(bits=4, quant_type="nf4", double_quant=False)
    assert quantised_bytes(4096 * 4096, 4096, q2) == 8_388_608 + 4 * 262_144
    q8 = QuantSpec(bits=8)
    assert quantised_bytes(4096 * 4096, 4096, q8) == 4096 * 4096 + 4 * 4096


def test_adamw_states_in_param_dtype_and_foreach_temporary() -> None:
    # Pure bf16 full fine-tuning: weights 2P, grads 2P, exp_avg + exp_avg_sq 4P, _foreach_sqrt 2P at the step.
    t = TrainSpec(method=Method.FULL, precision=Precision.BF16, micro_batch=1, seq_len=32)
    led = estimate(TINY, t)
    P = count_params(TINY)
    assert led.bytes_of(Category.OPTIMIZER_STATE, Phase.OPTIMIZER) == 4 * P
    assert led.bytes_of(Category.GRADIENTS, Phase.OPTIMIZER) == 2 * P
    assert led.bytes_of(Category.TEMPORARIES, Phase.OPTIMIZER) == 2 * P
    fused = estimate(TINY, TrainSpec(method=Method.FULL, precision=Precision.BF16, optimizer=Optimizer.ADAMW_FUSED))
    assert fused.bytes_of(Category.TEMPORARIES, Phase.OPTIMIZER) == 0


def test_gradients_absent_in_forward_unless_accumulating() -> None:
    t = TrainSpec(method=Method.FULL, precision=Precision.BF16, micro_batch=1, seq_len=32)
    assert estimate(TINY, t).bytes_of(Category.GRADIENTS, Phase.FORWARD) == 0
    P = count_params(TINY)
    acc = estimate(TINY, TrainSpec(method=Method.FULL, precision=Precision.BF16, seq_len=32, grad_accum=4))
    assert acc.bytes_of(Category.GRADIENTS, Phase.FORWARD) == 2 * P


@pytest.mark.parametrize("rank", [4, 16, 64])
def test_lora_weights_are_fp32_over_bf16_base(rank: int) -> None:
    t = TrainSpec(method=Method.LORA, micro_batch=1, seq_len=32, lora=LoraSpec(rank=rank))
    wb = weight_budget(TINY, t)
    per_layer = rank * ((H + Dq) + 2 * (H + Dkv) + (Dq + H) + 2 * (H + I) + (I + H))
    assert wb.trainable_params == 2 * per_layer
    assert wb.trainable_bytes == 4 * 2 * per_layer
    assert wb.frozen_bytes == 2 * count_params(TINY)
