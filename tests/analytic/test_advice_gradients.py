"""The advice for gradients names a change the run has not made: under FSDP1 with accumulation (no_sync keeps the
unsharded gradients, analytic/distributed/fsdp_no_sync.py) the sync on every micro-step, never "LoRA" for a LoRA run."""

from __future__ import annotations

from vramledger.advice import remedy
from vramledger.analytic import estimate
from vramledger.catalog import resolve_model
from vramledger.ledger import Category
from vramledger.specs import LoraSpec, Loss, Method, ModelCode, Precision, Sharding, TrainSpec


def test_litgpt_two_gpu_lora_row_gets_the_no_sync_remedy() -> None:
    """LitGPT's Llama-2-7B LoRA on two GPUs (published row 42: FSDP1, micro-batch 1, 128 accumulation steps):
    the kept unsharded gradients are the biggest line, and the advice is to sync every micro-step."""
    train = TrainSpec(
        method=Method.LORA,
        precision=Precision.BF16,
        # LitGPT keeps its adapters in the model dtype, so they share FSDP1 units (flat gradients) with the base
        lora=LoraSpec(rank=8, alpha=16, targets=("q_proj", "v_proj"), adapter_fp32=False),
        micro_batch=1,
        seq_len=1304,
        grad_accum=128,
        grad_ckpt=True,
        loss=Loss.CHUNKED,
        world_size=2,
        fsdp=Sharding.FULL_SHARD,
        fsdp_version=1,
        model_code=ModelCode.LIT_GPT_2023,
    )
    ledger = estimate(resolve_model("llama-2-7b"), train)
    assert "sync_each_batch=True" in ledger.advice
    assert "LoRA," not in ledger.advice


def test_gradients_remedy_never_proposes_what_the_run_does() -> None:
    lora = TrainSpec(method=Method.LORA)
    assert "LoRA," not in remedy(Category.GRADIENTS, lora)
    assert "LoRA," in remedy(Category.GRADIENTS, TrainSpec(method=Method.FULL))
    # one GPU, or FSDP2, or no accumulation: no no_sync remedy
    for t in (
        TrainSpec(method=Method.FULL, grad_accum=8),
        TrainSpec(method=Method.FULL, grad_accum=8, world_size=8, fsdp=Sharding.FULL_SHARD, fsdp_version=2),
        TrainSpec(method=Method.FULL, grad_accum=1, world_size=8, fsdp=Sharding.FULL_SHARD, fsdp_version=1),
    ):
        assert "sync_each_batch" not in remedy(Category.GRADIENTS, t)
