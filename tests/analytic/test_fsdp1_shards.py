"""FSDP1's flat shards of a LoRA layer's unit (analytic/distributed/fsdp1_shards.py): the registration order against a
real PEFT model, rank 0's optimizer state against the traces of FSDP1, and the rank that holds most derived by hand."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from tests.analytic._distributed_grid import records, runner, specs
from vramledger.analytic import estimate
from vramledger.analytic.distributed.fsdp1_shards import layer_unit_tensors, trainable_per_rank
from vramledger.analytic.weights import weight_budget
from vramledger.catalog.hfconfig import model_spec_from_config
from vramledger.ledger import Category, Phase
from vramledger.specs import LoraSpec, Method, Precision, Sharding, TrainSpec


def _lora(world: int, rank: int = 8) -> TrainSpec:
    return TrainSpec(
        method=Method.LORA,
        precision=Precision.BF16,
        micro_batch=1,
        seq_len=64,
        world_size=world,
        fsdp=Sharding.FULL_SHARD,
        fsdp_version=1,
        lora=LoraSpec(rank=rank, adapter_fp32=False),
    )


def test_layer_unit_order_is_the_peft_models_parameter_order() -> None:
    """FSDP1 flattens ``module.parameters()`` in order: a real PEFT LoRA model (all linears) of the grid's mid
    model, on the meta device."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**runner().MID)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    peft_model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"))
    layer = peft_model.base_model.model.model.layers[0]
    want = tuple((p.numel(), p.requires_grad) for p in layer.parameters())
    m = model_spec_from_config(runner().MID, name="mid", source="test")
    t = _lora(2)
    got = layer_unit_tensors(m, t, weight_budget(m, t))
    # the norms are one frozen tail in ours (their order among themselves does not move a chunk boundary)
    want_merged = want[:-2] + ((want[-2][0] + want[-1][0], False),)
    print("expected", want_merged, "got", got)
    assert got == want_merged


def test_rank_shares_by_hand() -> None:
    """The grid's mid model (H 1024, KV 256, MLP 2816), LoRA r=16 on every linear, 8 ranks, bf16 (8-element
    alignment; every size below is a multiple of 8, so no padding). One layer's unit, in order:
    q 1,048,576 | A 16,384 B 16,384 | k 262,144 | A 16,384 B 4,096 | v 262,144 | A 16,384 B 4,096 | o 1,048,576 |
    A 16,384 B 16,384 | gate 2,883,584 | A 16,384 B 45,056 | up (same) | down 2,883,584 | A 45,056 B 16,384 |
    norms 2,048: 11,755,520 elements, chunks of 1,469,440. Rank 0 [0, 1,469,440) ends inside v's base (which
    starts at 1,363,968): q's and k's adapters, 53,248. Rank 1 [1,469,440, 2,938,880) holds v's and o's adapters
    (v's A starts at 1,626,112; o's B ends at 2,742,272): 53,248. Gate's adapters start at 5,625,856 (rank 3,
    [4,408,320, 5,877,760)): 61,440; up's at 8,571,392 (rank 5); down's at 11,692,032 (rank 7). Ranks 2, 4, 6
    hold none."""
    m = model_spec_from_config(runner().MID, name="mid", source="test")
    t = _lora(8, rank=16)
    got = trainable_per_rank(layer_unit_tensors(m, t, weight_budget(m, t)), 8, 2)
    want = (53_248, 53_248, 0, 61_440, 0, 61_440, 0, 61_440)
    print("expected", want, "got", got)
    assert got == want
    ledger = estimate(m, t)
    extra = ledger.settings["distributed"]["heaviest_extra_bytes"]  # type: ignore[index]
    assert ledger.settings["distributed"]["heaviest_rank"] == 3  # type: ignore[index]
    # rank 3 holds 8,192 more trainable elements per layer: its bf16 weight, AdamW's two bf16 moments (torch keeps
    # them in the parameter's dtype) and foreach AdamW's one bf16 step temporary: 2 + 4 + 2 bytes each
    assert extra == 8 * 8_192 * (2 + 4 + 2)


def _fsdp1_lora() -> list[Any]:
    return [pytest.param(r, id=r["id"]) for r in records() if "/fsdp1" in r["id"] and "/lora/" in r["id"]]


@pytest.mark.parametrize("rec", _fsdp1_lora())
def test_rank0_optimizer_state_is_the_traces(rec: dict[str, Any]) -> None:
    """Rank 0's optimizer state at the step, against the trace of FSDP1 (each state tensor rounded to 512 B there);
    the even share was 0.5 MiB under it on 8 ranks."""
    m, t = specs(rec)
    got = estimate(m, t).bytes_of(Category.OPTIMIZER_STATE, Phase.OPTIMIZER)
    want = rec["trace"]["phases"]["optimizer"]["by_category"]["optimizer_state"]
    print(rec["id"], "estimate", got, "trace", want)
    assert abs(got - want) <= 64 * 512


def test_even_when_nothing_trains_in_the_layers() -> None:
    """Full fine-tuning has no adapters to split: rank 0 holds the even share and nobody holds more."""
    m = model_spec_from_config(runner().MID, name="mid", source="test")
    t = replace(_lora(8), method=Method.FULL, lora=None)
    assert estimate(m, t).settings["distributed"]["heaviest_rank"] == 0  # type: ignore[index]
