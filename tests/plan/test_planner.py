"""Plans fit with the headroom, keep the global batch, rank by throughput; remedies save memory; a larger GPU is
never slower."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vramledger.analytic import estimate
from vramledger.catalog import resolve_model
from vramledger.errors import VramledgerError
from vramledger.plan.planner import plan
from vramledger.plan.write import write_plan_config
from vramledger.specs import Attention, Loss, Method, Optimizer, Precision, TrainSpec

M8 = resolve_model("llama-3-8b")


@pytest.fixture(scope="module")
def lora_plan(rtx4090):  # type: ignore[no-untyped-def]
    return plan(M8, TrainSpec(method=Method.LORA, micro_batch=4, seq_len=2048), rtx4090, 0.08)


@pytest.mark.parametrize("headroom", [0.0, 0.08, 0.2])
def test_every_plan_fits_with_the_headroom(headroom: float, rtx4090) -> None:  # type: ignore[no-untyped-def]
    p = plan(M8, TrainSpec(method=Method.LORA, micro_batch=4, seq_len=2048), rtx4090, headroom)
    usable = rtx4090.memory_bytes * (1 - headroom)
    assert p.candidates
    for c in (*p.candidates, *p.task_changing):
        # re-estimated here, independently of the planner's cache
        total = estimate(c.model, c.train, gpu=rtx4090, headroom=headroom).device_total
        assert total == c.device_total and total <= usable


def test_plans_keep_the_global_batch_and_are_ranked(lora_plan) -> None:  # type: ignore[no-untyped-def]
    for c in lora_plan.candidates:
        assert c.train.micro_batch * c.train.grad_accum == 4
        assert not c.changes_task
    rates = [c.time.tokens_per_s for c in lora_plan.candidates]
    assert all(a >= b * (1 - 0.005) for a, b in zip(rates, rates[1:], strict=False))
    assert all(c.changes_task for c in lora_plan.task_changing)


def test_remedies_save_memory_and_the_classics_save_a_lot(lora_plan) -> None:  # type: ignore[no-untyped-def]
    saved = {str(e.change): e.memory_saved for e in lora_plan.remedies}
    assert all(e.memory_saved >= 0 for e in lora_plan.remedies)
    # At 4 × 2048 tokens on an 8B model these are the seeds' big levers: each saves at least 1 GiB.
    for change in (
        "gradient checkpointing off -> on",
        "loss standard -> fused",
        "micro-batch x accum 4x1 -> 1x4",
        "attention sdpa -> flash_attention_2",
    ):
        assert saved[change] > 2**30, change
    # QLoRA with today's bitsandbytes (>= 0.43.2 keeps no MatMul4Bit input: ctx.tensors = (None, B)) saves most of
    # the linears' bf16 bytes: Llama-3-8B's decoder linears hold 6.98 B parameters, 2 bytes each in bf16 against
    # about 0.53 in nf4 with double-quantised absmax, about 10 GB. (Under bitsandbytes < 0.43.2 the kept inputs
    # ate that saving at 4 x 2048 tokens: LitGPT's TinyLlama LoRA 13.50 GB, QLoRA 16.24 GB; bench/published
    # rows 123-124.)
    assert saved["method lora -> qlora nf4"] > 9 * 10**9
    # and their prices: checkpointing and accumulation cost time
    cost = {str(e.change): e.time_cost_s for e in lora_plan.remedies}
    assert cost["gradient checkpointing off -> on"] > 0
    assert cost["micro-batch x accum 4x1 -> 1x4"] > 0


def test_ladder_follows_the_seeds_order_and_ends_fitting(lora_plan) -> None:  # type: ignore[no-untyped-def]
    totals = [c.device_total for c in lora_plan.ladder]
    assert totals == sorted(totals, reverse=True)
    assert lora_plan.ladder[-1].fits and not lora_plan.ladder[0].fits


def test_accumulation_warning(lora_plan) -> None:  # type: ignore[no-untyped-def]
    assert lora_plan.best.train.grad_accum > 1
    assert any("per optimizer step" in w for w in lora_plan.warnings)


@pytest.mark.parametrize(
    "train",
    [
        pytest.param(TrainSpec(method=Method.LORA, micro_batch=8, seq_len=2048), id="lora"),
        pytest.param(TrainSpec(method=Method.FULL, micro_batch=2, seq_len=1024), id="full"),
    ],
)
def test_larger_gpu_is_never_slower(train: TrainSpec, rtx4090) -> None:  # type: ignore[no-untyped-def]
    best = []
    for gib in (20, 24, 32, 48):
        p = plan(M8, train, dataclasses.replace(rtx4090, memory_bytes=gib * 2**30), 0.08)
        best.append(p.best.time.tokens_per_s if p.best else 0.0)
    print("best tokens/s by size", best)
    assert best == sorted(best)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    method=st.sampled_from(list(Method)),
    precision=st.sampled_from([Precision.BF16_MIXED, Precision.BF16, Precision.FP32]),
    b=st.sampled_from([1, 2, 4]),
    L=st.sampled_from([128, 512, 1024]),
    ckpt=st.booleans(),
    loss=st.sampled_from(list(Loss)),
    attn=st.sampled_from(list(Attention)),
    opt=st.sampled_from([Optimizer.ADAMW, Optimizer.ADAMW_8BIT, Optimizer.SGD]),
    gib=st.sampled_from([1, 2, 4]),
)
def test_plan_invariants_on_random_setups(method, precision, b, L, ckpt, loss, attn, opt, gib, tiny, rtx4090) -> None:  # type: ignore[no-untyped-def]
    try:
        t = TrainSpec(
            method=method,
            precision=precision,
            micro_batch=b,
            seq_len=L,
            grad_ckpt=ckpt,
            loss=loss,
            attn=attn,
            optimizer=opt,
        )
    except VramledgerError:
        return
    gpu = dataclasses.replace(rtx4090, memory_bytes=gib * 2**30 // 4)
    p = plan(tiny, t, gpu, 0.08)
    assert all(e.memory_saved >= 0 for e in p.remedies)  # remedies never increase memory
    for c in p.candidates:
        assert c.device_total <= p.usable_bytes and c.train.micro_batch * c.train.grad_accum == b


def test_global_batch_must_be_a_multiple_of_the_batch(rtx4090) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(VramledgerError, match="--global-batch 6 is not a multiple"):
        plan(M8, TrainSpec(micro_batch=4), rtx4090, 0.08, global_batch=6)


def test_write_config_llamafactory(lora_plan, tmp_path) -> None:  # type: ignore[no-untyped-def]
    best = lora_plan.best
    out = tmp_path / "plan.yaml"
    write_plan_config(best.model.name, best.train, out)
    cfg = yaml.safe_load(out.read_text())
    # LLaMA-Factory key names (hparams/*_args.py) for what the plan chose
    assert cfg["model_name_or_path"] == "meta-llama/Meta-Llama-3-8B"
    assert cfg["per_device_train_batch_size"] * cfg["gradient_accumulation_steps"] == 4
    assert cfg["cutoff_len"] == 2048
    assert cfg["disable_gradient_checkpointing"] is (not best.train.grad_ckpt)
    assert cfg["finetuning_type"] == "lora"


def test_lora_on_an_moe_model_offers_targets_without_the_experts() -> None:
    """Qwen3-30B-A3B, LoRA all-linear: PEFT adapts the fused experts (ParamWrapper, merged copies every forward);
    the remedy names the modules instead, which PEFT does not convert, and prices exactly what naming them on the
    command line gives. A dense model has no such remedy."""
    from vramledger.analytic.weights import weight_budget
    from vramledger.plan.remedies import adapter_variants
    from vramledger.specs import LoraSpec

    m = resolve_model("qwen3-30b-a3b")
    t = TrainSpec(method=Method.LORA, lora=LoraSpec(rank=8), micro_batch=1, seq_len=4096)
    (v,) = [v for v in adapter_variants(m, t) if v.change.setting == "LoRA targets"]
    assert v.train.lora is not None and v.train.lora.targets == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert all(a.linear.lora_targetable for a in weight_budget(m, v.train).adapted)
    named = dataclasses.replace(t, lora=LoraSpec(rank=8, targets=("q_proj", "k_proj", "v_proj", "o_proj")))
    assert estimate(m, v.train).peak_allocated == estimate(m, named).peak_allocated < estimate(m, t).peak_allocated
    dense = resolve_model("qwen3-8b")
    assert not [v for v in adapter_variants(dense, t) if v.change.setting == "LoRA targets"]
