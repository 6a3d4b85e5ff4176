"""Accumulation splits: every split multiplies to the global batch, memory grows with the micro-batch, the step
counts follow the HF Trainer, and the LR schedules equal transformers' own schedulers."""

from __future__ import annotations

import pytest

from vramledger.catalog import resolve_model
from vramledger.errors import VramledgerError
from vramledger.plan.accum import accum_report, optimizer_steps, schedule
from vramledger.specs import Method, TrainSpec

M8 = resolve_model("llama-3-8b")


@pytest.fixture(scope="module")
def report(rtx4090):  # type: ignore[no-untyped-def]
    return accum_report(
        M8,
        TrainSpec(method=Method.LORA, seq_len=2048, grad_ckpt=True),
        rtx4090,
        0.08,
        global_batch=24,
        dataset_size=1000,
        scheduler="cosine",
        warmup_ratio=0.1,
    )


def test_splits_multiply_to_the_global_batch(report) -> None:  # type: ignore[no-untyped-def]
    assert [s.micro_batch for s in report.splits] == [1, 2, 3, 4, 6, 8, 12, 24]
    assert all(s.micro_batch * s.grad_accum == 24 for s in report.splits)


def test_memory_non_decreasing_in_micro_batch(report) -> None:  # type: ignore[no-untyped-def]
    totals = [s.device_total for s in report.splits]
    assert totals == sorted(totals)
    assert report.splits[0].fits and not report.splits[-1].fits


def test_step_counts_follow_the_hf_trainer() -> None:
    # 1000 samples, micro-batch 3, accumulation 4: ceil(1000/3) = 334 micro-steps; 334 // 4 + (334 % 4 > 0) = 84.
    assert optimizer_steps(1000, 3, 4, 1) == (334, 84)
    assert optimizer_steps(1000, 3, 4, 2) == (668, 168)


@pytest.mark.parametrize("name", ["linear", "cosine", "constant"])
def test_schedules_equal_transformers(name: str) -> None:
    import torch
    import transformers

    total, ratio, k = 50, 0.1, 4
    sc = schedule(name, ratio, total, (1, k))
    warmup = sc.warmup_steps
    assert warmup == 5  # ceil(50 × 0.1), TrainingArguments.get_warmup_steps

    def run(steps_per_opt: int) -> list[float]:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        sched = transformers.get_scheduler(
            name if name != "constant" else "constant_with_warmup",
            opt,
            num_warmup_steps=warmup,
            num_training_steps=total,
        )
        lrs = []
        for _ in range(total):
            lrs.append(opt.param_groups[0]["lr"])
            for _ in range(steps_per_opt):
                opt.step()
                sched.step()
        return lrs

    correct, per_micro = run(1), run(k)
    assert list(sc.steps) == list(range(total))
    assert sc.per_optimizer_step == pytest.approx(correct)
    assert dict(sc.per_micro_batch)[k] == pytest.approx(per_micro)


def test_bad_scheduler() -> None:
    with pytest.raises(VramledgerError, match="--lr-scheduler"):
        schedule("polynomial", 0.0, 10, (1,))
