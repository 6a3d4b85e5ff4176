"""FLOPs against hand calculations for the tiny Llama of conftest.py, and the time model's qualitative laws."""

from __future__ import annotations

import dataclasses

import pytest

from vramledger.catalog import resolve_gpu, resolve_model
from vramledger.plan.timemodel import flops_per_token, step_time
from vramledger.specs import Attention, LoraSpec, Loss, Method, Optimizer, Precision, TrainSpec

# The tiny Llama: H=64, I=176, 4 heads × 16 (Dq=64), 2 KV heads (Dkv=32), V=1000, 2 layers, untied lm_head.
H, I, Dq, Dkv, V, NL = 64, 176, 64, 32, 1000, 2
LAYER_W = H * Dq + 2 * H * Dkv + Dq * H + 3 * H * I  # q, k, v, o, gate, up, down
N = NL * LAYER_W + V * H  # matmul weights (embedding lookup is not a matmul; lm_head is)


def test_full_eager_is_palm_appendix_b(tiny) -> None:  # type: ignore[no-untyped-def]
    # PaLM Appendix B (and nanoGPT estimate_mfu): 6N + 12·n_layer·(heads·head_dim)·L per token, eager attention
    # computing the whole L×L matrix.
    L = 256
    f = flops_per_token(tiny, TrainSpec(method=Method.FULL, attn=Attention.EAGER, seq_len=L, micro_batch=2))
    expected = 6 * N + 12 * NL * Dq * L
    print("expected", expected, "got", f.total)
    assert f.total == pytest.approx(expected)


def test_causal_kernel_halves_attention_and_backward_is_2_5x(tiny) -> None:  # type: ignore[no-untyped-def]
    # SDPA without a mask (one sequence) runs the causal flash kernel: forward 4·Dq·L/2 per layer per token,
    # backward 2.5× that (flash-attention benchmark_flash_attention.py flops()).
    L = 512
    f = flops_per_token(tiny, TrainSpec(method=Method.FULL, attn=Attention.SDPA, seq_len=L, micro_batch=1))
    attn_fwd = NL * 4 * Dq * L / 2
    assert f.attention_forward == pytest.approx(attn_fwd)
    assert f.total == pytest.approx(6 * N + attn_fwd * 3.5)


def test_lora_skips_frozen_weight_gradients(tiny) -> None:  # type: ignore[no-untyped-def]
    # LoRA r=8 on q and v only: adapters A (H→8) and B (8→out) per layer.
    r = 8
    A = NL * (r * (H + Dq) + r * (H + Dkv))
    t = TrainSpec(
        method=Method.LORA, lora=LoraSpec(rank=r, targets=("q_proj", "v_proj")), attn=Attention.EAGER, seq_len=128
    )
    f = flops_per_token(tiny, t)
    attn = NL * 4 * Dq * 128
    # forward 2(N + A); backward: input gradients of everything 2(N + A), weight gradients of adapters only 2A
    expected = 2 * (N + A) + 2 * (N + A) + 2 * A + 3 * attn
    assert f.total == pytest.approx(expected)
    assert f.total < flops_per_token(tiny, dataclasses.replace(t, method=Method.FULL, lora=None)).total


def test_checkpointing_adds_one_forward_of_the_layers(tiny) -> None:  # type: ignore[no-untyped-def]
    t = TrainSpec(method=Method.FULL, attn=Attention.EAGER, seq_len=128)
    plain, ckpt = flops_per_token(tiny, t), flops_per_token(tiny, dataclasses.replace(t, grad_ckpt=True))
    layers_fwd = NL * (2 * LAYER_W + 4 * Dq * 128)  # not lm_head: checkpointing wraps decoder layers only
    assert ckpt.total - plain.total == pytest.approx(layers_fwd)


def test_freeze_runs_backward_only_through_trained_layers(tiny) -> None:  # type: ignore[no-untyped-def]
    t = TrainSpec(method=Method.FREEZE, freeze_trainable_layers=1, attn=Attention.EAGER, seq_len=128)
    f = flops_per_token(tiny, t)
    attn_layer = 4 * Dq * 128
    expected_bwd = 2 * (LAYER_W + V * H) + 2 * LAYER_W + 2 * attn_layer  # one layer + lm_head input grads
    assert f.backward == pytest.approx(expected_bwd)


M8 = resolve_model("llama-3-8b")
G4090 = resolve_gpu("rtx-4090")


def test_many_small_micro_batches_are_slower() -> None:
    big = TrainSpec(micro_batch=16, grad_accum=1, seq_len=512, attn=Attention.FLASH2)
    small = dataclasses.replace(big, micro_batch=1, grad_accum=16)
    assert step_time(M8, small, G4090).step_s > step_time(M8, big, G4090).step_s
    # same tokens, same FLOPs per token
    assert step_time(M8, small, G4090).tokens_per_step == step_time(M8, big, G4090).tokens_per_step


def test_offload_pays_pcie_and_cpu_time() -> None:
    t = TrainSpec(method=Method.FULL, precision=Precision.BF16, micro_batch=1, seq_len=1024)
    off = dataclasses.replace(t, zero_stage=2, offload_optimizer=True)
    s = step_time(M8, off, G4090)
    P = 8_030_261_248
    # at least the fp32 gradients to the host over the link (4·P bytes at 32 GB/s)
    assert s.offload_s >= 4 * P / 32e9
    assert s.step_s > step_time(M8, t, G4090).step_s


def test_optimizer_step_is_bandwidth_bound() -> None:
    # Full bf16-true, fused AdamW: 7 passes of 2 bytes + clipping 3 passes, 8.03e9 parameters at 1008 GB/s.
    t = TrainSpec(method=Method.FULL, precision=Precision.BF16, optimizer=Optimizer.ADAMW_FUSED)
    s = step_time(M8, t, G4090)
    expected = 8_030_261_248 * (7 * 2 + 3 * 2) / 1008e9
    assert s.optimizer_s == pytest.approx(expected, rel=0.01, abs=0.01)


def test_faster_gpu_is_faster() -> None:
    t = TrainSpec(micro_batch=2, seq_len=2048, grad_ckpt=True)
    assert step_time(M8, t, resolve_gpu("h100-sxm")).step_s < step_time(M8, t, G4090).step_s


def test_size_only_gpu_uses_stated_fallbacks() -> None:
    s = step_time(M8, TrainSpec(), resolve_gpu("24GiB"))
    assert s.assumed_gpu and s.peak_flops == 100e12


def test_offloading_adapters_costs_their_per_tensor_work() -> None:
    """LoRA's optimizer state is tiny, so its GPU update costs next to nothing, but ZeRO-Offload still walks every
    trainable tensor on the GPU (DeepSpeed stage_1_and_2.py ``copy_grads_in_partition``: at the boundary a norm in
    fp64, the overflow check, the fp32 cast and the copy to the host; on other micro-steps the copy out and the
    partial sum back). Counted by hand for Llama-3-8B, LoRA r8 on its seven linears: 7 × 2 × 32 = 448 tensors, at
    least 5 + 3 × 7 launches each over 8 micro-steps. Without them the plan for an RTX 4090 cut to 20 GiB chose
    QLoRA with the optimizer offloaded (1,506 tokens/s), faster than the same QLoRA on the GPU that a 24 GiB card
    gets (1,502; tests/plan/test_planner.py test_larger_gpu_is_never_slower)."""
    m, gpu = resolve_model("llama-3-8b"), resolve_gpu("rtx-4090")
    t = TrainSpec(method=Method.QLORA, micro_batch=1, seq_len=2048, grad_accum=8, loss=Loss.FUSED)
    on_gpu = step_time(m, t, gpu)
    off = step_time(m, dataclasses.replace(t, zero_stage=2, offload_optimizer=True), gpu)
    launches = 448 * (5 + 3 * 7) * 8e-6
    print(f"tokens/s: optimizer on the GPU {on_gpu.tokens_per_s:,.0f}, offloaded {off.tokens_per_s:,.0f}")
    assert off.offload_s >= launches
    assert off.tokens_per_s < on_gpu.tokens_per_s
