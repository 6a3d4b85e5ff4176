"""Per-rank memory under DDP, FSDP and DeepSpeed ZeRO, derived by hand in each test from the engines' code."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vramledger.analytic import estimate
from vramledger.analytic.distributed import deepspeed_estimate
from vramledger.analytic.step import step_parts
from vramledger.catalog import resolve_model
from vramledger.ledger import Category, Phase
from vramledger.specs import Method, Precision, Sharding, TrainSpec, ZeroBuffers

L8B = resolve_model("llama-3.1-8b")
L70B = resolve_model("llama-3.1-70b")
P8B = 8_030_261_248  # Llama-3.1-8B, the published parameter count (model card: 8.03B)


def _line(ledger, phase: Phase, label_start: str) -> int:  # type: ignore[no-untyped-def]
    return sum(i.bytes for i in ledger.items if i.phase is phase and i.label.startswith(label_start))


def test_fsdp_shards_the_frozen_base_of_a_70b_lora() -> None:
    # FSDP FULL_SHARD shards every parameter, frozen ones included: the bf16 base is 2·P_frozen/8 per rank, not
    # 2·P_frozen (the divide-the-trainable-only model kept the whole base, ~140 GB on every rank).
    t = TrainSpec(
        method=Method.LORA, micro_batch=1, seq_len=2048, grad_ckpt=True, world_size=8, fsdp=Sharding.FULL_SHARD
    )
    p = step_parts(L70B, t)
    frozen = p.weights.total_params - p.weights.trainable_params
    assert p.frozen_bytes == -(-frozen * 2 // 8)
    ledger = estimate(L70B, t)
    print("peak allocated per rank", ledger.peak_allocated / 1e9, "GB")
    assert ledger.peak_allocated < 40e9  # 140 GB of base over 8 ranks + buffers + activations


def test_fsdp_mixed_precision_has_no_master_copy_and_no_autocast_copies() -> None:
    t = TrainSpec(method=Method.FULL, precision=Precision.BF16_MIXED, world_size=8, fsdp=Sharding.FULL_SHARD)
    p = step_parts(L8B, t)
    assert p.master_bytes == 0 and p.autocast_copy_bytes == 0
    # sharded fp32 parameters are the optimizer's parameters: 4·P/8 each for weights and grads, 8·P/8 for AdamW
    assert p.trainable_bytes == -(-4 * P8B // 8) and p.grad_bytes == -(-4 * P8B // 8)
    assert p.state_bytes == -(-8 * P8B // 8)


def test_fsdp_buffers_are_the_root_and_one_layer_at_the_loss() -> None:
    t = TrainSpec(method=Method.FULL, precision=Precision.BF16_MIXED, world_size=8, fsdp=Sharding.FULL_SHARD)
    ledger = estimate(L8B, t)
    H, I, V = 4096, 14336, 128256
    layer = 2 * H * H + 2 * H * 1024 + 3 * H * I + 2 * H  # q, o (H·H), k, v (H·1024), MLP, two norms
    # at the loss: the last decoder layer, all-gathered in bf16 (the mixed-precision policy's param dtype)
    assert _line(ledger, Phase.FORWARD, "one decoder layer unsharded") == layer * 2
    assert _line(ledger, Phase.FORWARD, "root unit unsharded") == (2 * V * H + H) * 2  # embed, lm_head, final norm
    assert _line(ledger, Phase.OPTIMIZER, "one decoder layer unsharded") == 0  # freed after backward


def test_ddp_adds_a_second_copy_of_the_gradients() -> None:
    # DDP(gradient_as_bucket_view=False): reducer.cpp allocates the buckets' flat gradients at construction, so every
    # phase holds one extra gradient-sized buffer; nothing else changes.
    one = TrainSpec(method=Method.LORA, micro_batch=2, seq_len=1024)
    ddp = dataclasses.replace(one, world_size=4)
    grads = step_parts(L8B, one).grad_bytes
    for phase in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER):
        a, b = estimate(L8B, one).allocated(phase), estimate(L8B, ddp).allocated(phase)
        assert b - a == grads, phase


def test_zero2_buffers_by_hand() -> None:
    # stage_1_and_2.py: bf16 flat model copy 2P (whole), fp32 master 4P/N, AdamW 8P/N, grads_in_partition 2P/N,
    # one ipg bucket of reduce_bucket_size bf16 elements (overlap_comm off), fp32 grad partition 4P/N in step().
    N = 8
    t = TrainSpec(
        method=Method.FULL,
        precision=Precision.BF16_MIXED,
        world_size=N,
        zero_stage=2,
        zero_buffers=ZeroBuffers(reduce_bucket_size=4096 * 4096),
    )
    p = step_parts(L8B, t)
    ceil = lambda n: -(-n // N)  # noqa: E731
    assert (p.trainable_bytes, p.master_bytes, p.state_bytes, p.grad_bytes) == (
        2 * P8B,
        ceil(4 * P8B),
        ceil(8 * P8B),
        ceil(2 * P8B),
    )
    ledger = estimate(L8B, t)
    assert _line(ledger, Phase.BACKWARD, "reduce bucket") == 4096 * 4096 * 2
    assert _line(ledger, Phase.OPTIMIZER, "fp32 gradient partition") == ceil(4 * P8B)
    with_overlap = dataclasses.replace(t, zero_buffers=ZeroBuffers(reduce_bucket_size=4096 * 4096, overlap_comm=True))
    assert _line(estimate(L8B, with_overlap), Phase.BACKWARD, "reduce bucket") == 2 * 4096 * 4096 * 2


def test_zero3_partitions_frozen_weights_and_keeps_small_ones_whole() -> None:
    # LoRA under ZeRO-3: the frozen base is partitioned too; norms (4096 < 100,000 elements) stay whole.
    N = 8
    t = TrainSpec(method=Method.LORA, world_size=N, zero_stage=3)
    p = step_parts(L8B, t)
    persistent = 32 * 2 * 4096 + 4096  # two RMSNorm weights per layer + the final norm
    frozen = p.weights.total_params - p.weights.trainable_params
    assert p.frozen_bytes == -(-(frozen - persistent) * 2 // N) + persistent * 2


def test_hf_auto_buckets_resolve_from_hidden() -> None:
    # transformers integrations/deepspeed.py trainer_config_finalize: reduce_bucket_size = hidden²
    zb = ZeroBuffers(auto=("reduce_bucket_size", "stage3_prefetch_bucket_size")).resolved(4096)
    assert zb.reduce_bucket_size == 4096**2 and zb.prefetch_bucket_size == int(0.9 * 4096**2)


@pytest.mark.parametrize(
    ("stage", "offload", "expected"),
    [
        (2, False, lambda P, N: 2 * P + int(18 * P / N)),
        (2, True, lambda P, N: 2 * P),
        (3, False, lambda P, N: 4 * 128256 * 4096 + int(18 * P / N)),  # largest "layer": the embedding
    ],
    ids=["zero2", "zero2-offload", "zero3"],
)
def test_deepspeed_own_formula(stage: int, offload: bool, expected) -> None:  # type: ignore[no-untyped-def]
    # deepspeed stage_1_and_2.py estimate_zero2_model_states_mem_needs, stage3.py estimate_zero3_..., verbatim terms
    t = TrainSpec(method=Method.FULL, world_size=8, zero_stage=stage, offload_optimizer=offload)
    assert deepspeed_estimate(L8B, t, P8B) == expected(P8B, 8)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 63), engine=st.sampled_from(["fsdp", "zero3", "zero2"]))
def test_more_ranks_never_hold_more_model_state(n: int, engine: str) -> None:
    base = TrainSpec(method=Method.FULL, micro_batch=1, seq_len=512)
    kw = {"fsdp": {"fsdp": Sharding.FULL_SHARD}, "zero3": {"zero_stage": 3}, "zero2": {"zero_stage": 2}}[engine]

    def states(world: int) -> int:
        p = step_parts(L8B, dataclasses.replace(base, world_size=world, **kw))
        return p.frozen_bytes + p.trainable_bytes + p.master_bytes + p.grad_bytes + p.state_bytes

    assert states(n + 1) <= states(n)


def test_offload_moves_states_to_the_host() -> None:
    t = TrainSpec(method=Method.FULL, world_size=8, zero_stage=3, offload_optimizer=True, offload_params=True)
    ledger = estimate(L8B, t)
    assert ledger.bytes_of(Category.OPTIMIZER_STATE, Phase.OPTIMIZER) == 0
    assert ledger.bytes_of(Category.MASTER_WEIGHTS, Phase.OPTIMIZER) == 0
    assert ledger.settings["distributed"]["host_bytes"] > 8 * P8B // 8  # type: ignore[index]
