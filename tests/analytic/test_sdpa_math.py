"""SDPA's math kernel in fp32 with grouped-query heads (analytic/activations.py ``sdpa_math``).

Without a mask transformers passes ``enable_gqa=True``; on a CUDA GPU with torch 2.13 no fused kernel takes grouped
heads in fp32, and ``_scaled_dot_product_attention_math`` keeps the fp32 probabilities of every layer. Checked
against torch itself (the tensors autograd saves when the math kernel runs on real CPU tensors) and against the
trace (``vramledger trace``, which routes SDPA as CUDA would: trace/shims.py ``sdpa_as_cuda``).
"""

from __future__ import annotations

import dataclasses

import pytest

from vramledger.analytic import estimate
from vramledger.analytic.activations import layer_activations, sdpa_math
from vramledger.analytic.weights import weight_budget
from vramledger.catalog import resolve_model
from vramledger.ledger import Phase
from vramledger.specs import Attention, Method, Precision, TrainSpec

FP32 = TrainSpec(method=Method.FULL, precision=Precision.FP32, micro_batch=1, seq_len=2048)
MATH_PART = "q, k/v repeated, output (SDPA math kernel)"


def test_saved_bytes_are_what_torch_saves() -> None:
    """Run torch's math kernel (and o_proj reading the module's contiguous copy of its output, as transformers'
    ``LlamaAttention`` does) on real tensors of Llama-3.2-1B's head layout, and sum the distinct storages autograd
    saves (``saved_tensors_hooks``), the leaves aside. The estimate's per-token part and length² term must add up
    to exactly that."""
    import torch

    m = resolve_model("llama-3.2-1b")
    B, L, nh, nkv, d = 2, 64, m.num_heads, m.num_kv_heads, m.head_dim
    q = torch.randn(B, nh, L, d, requires_grad=True)
    k = torch.randn(B, nkv, L, d, requires_grad=True)
    v = torch.randn(B, nkv, L, d, requires_grad=True)
    w = torch.randn(m.hidden_size, nh * d, requires_grad=True)
    leaves = {t.untyped_storage().data_ptr() for t in (q, k, v, w)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in leaves:
            saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, None, 0.0, True, None, enable_gqa=True)[0]
        torch.nn.functional.linear(out.transpose(1, 2).contiguous().reshape(B, L, nh * d), w)
    train = dataclasses.replace(FP32, micro_batch=B, seq_len=L, packing=True)
    la = layer_activations(m, train, weight_budget(m, train))
    modelled = dict(la.detail)[MATH_PART] * B * L + la.scores_per_seq * B
    # By hand: q·√scale, K and V repeated to 32 heads (K scaled), o_proj's input: 4 × 4·Dq per token; the fp32
    # probabilities 4·nh·L² per sequence.
    by_hand = 4 * 4 * nh * d * B * L + 4 * nh * L * L * B
    print(f"torch saved {sum(saved.values())} bytes; modelled {modelled}; by hand {by_hand}")
    assert sum(saved.values()) == modelled == by_hand


# `vramledger trace MODEL --method full --precision fp32 --batch 1 --seq 2048 --preset none` (torch 2.13.0+cpu,
# transformers 5.23.0): peak allocated bytes. Before sdpa_math the estimate was 23.08 and 14.01 GiB.
TRACED = [("llama-3.2-1b", 33_671_923_712), ("qwen2.5-0.5b", 20_979_024_384)]


@pytest.mark.parametrize(("name", "traced"), TRACED)
def test_peak_allocated_matches_the_trace(name: str, traced: int) -> None:
    led = estimate(resolve_model(name), FP32)
    got = max(led.allocated(p) for p in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER))
    print(f"{name}: estimate {got}, trace {traced} ({got / traced - 1:+.4%})")
    assert abs(got / traced - 1) < 0.01


def test_padded_batch_is_estimated_at_its_unpadded_batches() -> None:
    """A padded fp32 batch runs the mask path only while some row is padded; a batch of full rows drops the mask and
    runs math, which saves more: the estimate of a padded batch is that of a packed one (the trace of Qwen2.5-0.5B
    fp32 2 × 1024, unpadded, allocates 18,159,927,808 bytes)."""
    m = resolve_model("qwen2.5-0.5b")
    padded = dataclasses.replace(FP32, micro_batch=2, seq_len=1024)
    packed = dataclasses.replace(padded, packing=True)
    peaks = [max(estimate(m, t).allocated(p) for p in (Phase.BACKWARD, Phase.OPTIMIZER)) for t in (padded, packed)]
    print(f"padded {peaks[0]}, packed {peaks[1]}")
    assert peaks[0] == peaks[1]
    assert abs(peaks[0] / 18_159_927_808 - 1) < 0.01


@pytest.mark.parametrize(
    ("name", "train"),
    [
        ("gpt2", FP32),  # multi-head: the efficient kernel takes it in fp32
        ("llama-3.2-1b", dataclasses.replace(FP32, precision=Precision.BF16_MIXED)),  # bf16 q/k/v: flash
        ("llama-3.2-1b", dataclasses.replace(FP32, precision=Precision.BF16)),
        ("llama-3.2-1b", dataclasses.replace(FP32, attn=Attention.EAGER)),  # eager asked for: its own formula
    ],
)
def test_no_math_kernel_where_a_fused_one_runs(name: str, train: TrainSpec) -> None:
    m = resolve_model(name)
    la = layer_activations(m, train, weight_budget(m, train))
    assert not sdpa_math(m, train)
    assert MATH_PART not in dict(la.detail)
