"""LoRA on fused MoE experts (PEFT 0.21's ``all-linear`` conversion: ParamWrapper on the 3-D expert weights and the
router) against the real step on fake tensors: every forward builds a merged copy of each adapted expert stack,
which backward needs (analytic/activations.py ``merged_experts``). Small configs of three families whose merged
copies are most of what the layers save."""

from __future__ import annotations

from typing import Any

import pytest

from vramledger.analytic import estimate
from vramledger.analytic.activations import merged_experts
from vramledger.analytic.weights import weight_budget
from vramledger.catalog import resolve_model
from vramledger.catalog.hfconfig import model_spec_from_config
from vramledger.specs import LoraSpec, Method, TrainSpec

pytest.importorskip("transformers")
pytest.importorskip("peft")

_SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
    vocab_size=1000,
    torch_dtype="bfloat16",
    tie_word_embeddings=False,
)
CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(
        _SHAPE, model_type="qwen3_moe", num_hidden_layers=2, head_dim=64, num_experts=32, moe_intermediate_size=1024
    ),
    "mixtral": dict(_SHAPE, model_type="mixtral", num_hidden_layers=2, num_local_experts=32, intermediate_size=1024),
    "deepseek_v2": dict(
        _SHAPE,
        model_type="deepseek_v2",
        num_hidden_layers=3,
        num_key_value_heads=4,
        first_k_dense_replace=1,
        n_routed_experts=32,
        n_shared_experts=1,
        moe_intermediate_size=1024,
        q_lora_rank=None,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_group=1,
        topk_group=1,
    ),
}


@pytest.mark.parametrize("ckpt", [False, True], ids=["saved", "checkpointed"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_peak_allocated_with_the_merged_expert_weights(name: str, ckpt: bool) -> None:
    from vramledger.trace import trace_step

    cfg = CONFIGS[name]
    m = model_spec_from_config(cfg, name=f"small-{name}", source="test")
    train = TrainSpec(method=Method.LORA, lora=LoraSpec(rank=8), micro_batch=2, seq_len=64, grad_ckpt=ckpt)
    traced = trace_step(m, train, config=cfg)
    analytic = estimate(m, train)
    merged = merged_experts(m, train, weight_budget(m, train))
    got, want = analytic.peak_allocated, traced.peak_allocated
    print(name, ckpt, "estimate", got, "trace", want, f"{got / want - 1:+.2%}", "merged", merged)
    assert (merged.one_layer if ckpt else merged.all_layers) > 0.05 * want  # leaving them out fails the check
    assert abs(got / want - 1) <= 0.01


def test_the_merged_copies_of_qwen3_30b_a3b_by_hand() -> None:
    """``_LoraFactorsProxy.forward`` returns ``baddbmm(W, lhs, rhs)``: W's shape and dtype. Qwen3-30B-A3B (128
    experts, H 2048, moe_intermediate 768, 48 layers), bf16: gate_up 128·1536·2048·2 B = 768 MiB and down
    128·2048·768·2 B = 384 MiB a layer, plus the router's 128·2048·2 B; backward makes down's gradient beside both
    copies, then gate_up's beside its own: 384 MiB more either way."""
    m = resolve_model("qwen3-30b-a3b")
    train = TrainSpec(method=Method.LORA, lora=LoraSpec(rank=8), micro_batch=1, seq_len=1024)
    got = merged_experts(m, train, weight_budget(m, train))
    MiB = 2**20
    layer = 768 * MiB + 384 * MiB + 128 * 2048 * 2
    assert got == (layer, 48 * layer, 384 * MiB)


def test_full_fine_tuning_with_fp32_experts_traces() -> None:
    """Full fine-tuning under bf16-mixed keeps fp32 expert weights, which transformers 5's grouped_mm experts pass
    to ``aten._grouped_mm`` as they are; CUDA's kernel takes them (its fallback path), the fake tensors' meta
    function did not (trace/shims.py ``grouped_mm_as_cuda``): the step traces, and its peak is the estimate's."""
    from vramledger.trace import trace_step

    cfg = CONFIGS["qwen3_moe"]
    m = model_spec_from_config(cfg, name="small-qwen3_moe", source="test")
    train = TrainSpec(method=Method.FULL, micro_batch=2, seq_len=64, grad_ckpt=False)
    traced = trace_step(m, train, config=cfg)
    assert abs(estimate(m, train).peak_allocated / traced.peak_allocated - 1) <= 0.01
