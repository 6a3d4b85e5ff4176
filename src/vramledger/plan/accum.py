"""`vramledger accum`: every split of a global batch into micro-batch × accumulation steps — its memory, its
predicted time per optimizer step, and what changes with it (the step counts and the LR schedule).

Gradient accumulation saves only the activations of the micro-batches not in flight: weights, gradients and
optimizer state stay (the estimate keeps gradients live across micro-steps when accumulating). It costs time:
more, smaller kernels and a fixed cost per micro-step (the time model). And it changes the bookkeeping: an
epoch has ``ceil(N / micro)`` micro-steps but only ``ceil(micro-steps / k)`` optimizer steps (transformers
``Trainer._inner_training_loop``: ``num_update_steps_per_epoch = len_dataloader // k + (len_dataloader % k > 0)``),
so a scheduler configured in optimizer steps but stepped on every micro-batch runs k times too fast.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from vramledger.errors import VramledgerError
from vramledger.plan import memo
from vramledger.plan.remedies import divisors
from vramledger.plan.timemodel import DEFAULT_ASSUMPTIONS, StepTime, TimeAssumptions, step_time
from vramledger.specs import GPUSpec, ModelSpec, TrainSpec

SCHEDULERS = ("linear", "cosine", "constant")
SAMPLES_WITHOUT_DATASET = 1000
"""Without ``--dataset-size`` the counts are given per 1000 samples."""
SCHEDULE_POINTS = 200
"""Points of each schedule returned for plotting (evenly spaced optimizer steps, both ends included)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Split:
    micro_batch: int
    grad_accum: int
    device_total: int
    fits: bool
    time: StepTime
    micro_steps: int
    """Forward/backward passes over the samples (per epoch × epochs)."""
    optimizer_steps: int
    """Optimizer (and scheduler) steps over the samples."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """The LR multiplier at sampled optimizer steps, stepped correctly and stepped per micro-batch."""

    scheduler: str
    warmup_ratio: float
    total_steps: int
    """Optimizer steps the scheduler is configured for (what the HF Trainer passes: ``max_steps``)."""
    warmup_steps: int
    steps: tuple[int, ...]
    """Sampled optimizer-step indices (x axis)."""
    per_optimizer_step: tuple[float, ...]
    """Multiplier of the peak LR when ``scheduler.step()`` follows every ``optimizer.step()``."""
    per_micro_batch: tuple[tuple[int, tuple[float, ...]], ...]
    """(k, multipliers) when ``scheduler.step()`` is called on every micro-batch of a k-step accumulation."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AccumReport:
    model: str
    gpu: str
    capacity_bytes: int
    headroom: float
    usable_bytes: int
    global_batch: int
    seq_len: int
    samples: int
    """Samples counted: the dataset size × epochs, or 1000 when no dataset size was given."""
    per_thousand: bool
    epochs: int
    splits: tuple[Split, ...]
    """Smallest micro-batch first."""
    schedule: Schedule
    warnings: tuple[str, ...] = ()


def lr_multiplier(scheduler: str, step: int, *, warmup: int, total: int) -> float:
    """transformers ``optimization.py``: ``_get_linear_schedule_with_warmup_lr_lambda``,
    ``_get_cosine_schedule_with_warmup_lr_lambda`` (num_cycles 0.5) and
    ``_get_constant_schedule_with_warmup_lr_lambda``, as written there (the cosine keeps turning past the end)."""
    if step < warmup:
        return step / max(1.0, warmup)
    if scheduler == "constant":
        return 1.0
    if scheduler == "linear":
        return max(0.0, (total - step) / max(1, total - warmup))
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))


def optimizer_steps(samples_per_epoch: int, micro_batch: int, grad_accum: int, epochs: int) -> tuple[int, int]:
    """(micro-steps, optimizer steps) over ``epochs``, as the HF Trainer counts them (the last partial
    accumulation still steps; the dataloader keeps a last partial batch: ``dataloader_drop_last=False``)."""
    per_epoch = -(-samples_per_epoch // micro_batch)
    updates = max(per_epoch // grad_accum + int(per_epoch % grad_accum > 0), 1)
    return per_epoch * epochs, updates * epochs


def schedule(scheduler: str, warmup_ratio: float, total: int, accums: tuple[int, ...]) -> Schedule:
    """Both ways of stepping ``scheduler`` over ``total`` optimizer steps, sampled at ``SCHEDULE_POINTS`` steps.
    Warmup steps: ``ceil(total × ratio)`` (``TrainingArguments.get_warmup_steps``)."""
    if scheduler not in SCHEDULERS:
        raise VramledgerError(f"--lr-scheduler: unknown value {scheduler!r}; choose one of {', '.join(SCHEDULERS)}")
    if not 0.0 <= warmup_ratio < 1.0:
        raise VramledgerError(f"--warmup-ratio must be in [0, 1) (got {warmup_ratio}); e.g. --warmup-ratio 0.03")
    warmup = math.ceil(total * warmup_ratio)
    n = min(SCHEDULE_POINTS, total)
    steps = tuple(sorted({round(i * (total - 1) / max(1, n - 1)) for i in range(n)}))
    correct = tuple(lr_multiplier(scheduler, s, warmup=warmup, total=total) for s in steps)
    per_micro = tuple(
        (k, tuple(lr_multiplier(scheduler, s * k, warmup=warmup, total=total) for s in steps))
        for k in sorted(set(accums))
        if k > 1
    )
    return Schedule(
        scheduler=scheduler,
        warmup_ratio=warmup_ratio,
        total_steps=total,
        warmup_steps=warmup,
        steps=steps,
        per_optimizer_step=correct,
        per_micro_batch=per_micro,
    )


def accum_report(
    model: ModelSpec,
    train: TrainSpec,
    gpu: GPUSpec,
    headroom: float,
    *,
    global_batch: int,
    dataset_size: int | None = None,
    epochs: int = 1,
    scheduler: str = "linear",
    warmup_ratio: float = 0.0,
    assumptions: TimeAssumptions = DEFAULT_ASSUMPTIONS,
) -> AccumReport:
    """Every micro-batch × accumulation split of ``global_batch`` (sequences per GPU) at ``train.seq_len``."""
    if global_batch < 1:
        raise VramledgerError(f"--global-batch must be a positive integer (got {global_batch}); e.g. --global-batch 32")
    if dataset_size is not None and dataset_size < 1:
        raise VramledgerError(f"--dataset-size must be a positive number of samples (got {dataset_size})")
    if epochs < 1:
        raise VramledgerError(f"--epochs must be a positive integer (got {epochs})")
    samples = dataset_size if dataset_size is not None else SAMPLES_WITHOUT_DATASET
    ep = epochs if dataset_size is not None else 1
    splits = []
    for d in divisors(global_batch):
        t = dataclasses.replace(train, micro_batch=d, grad_accum=global_batch // d)
        led = memo.ledger(model, t, gpu, headroom)
        assert led.verdict is not None
        micro, opt = optimizer_steps(samples, d, global_batch // d, ep)
        splits.append(
            Split(
                micro_batch=d,
                grad_accum=global_batch // d,
                device_total=led.device_total,
                fits=led.verdict.fits,
                time=step_time(model, t, gpu, assumptions),
                micro_steps=micro,
                optimizer_steps=opt,
            )
        )
    total = optimizer_steps(samples, global_batch, 1, ep)[1]
    sched = schedule(scheduler, warmup_ratio, total, tuple(s.grad_accum for s in splits))
    warnings = []
    if not any(s.fits for s in splits):
        warnings.append(
            "no split fits: accumulation alone cannot save weights, gradients or optimizer state; "
            "see `vramledger plan` for the other remedies"
        )
    if any(s.grad_accum > 1 for s in splits):
        warnings.append(
            "with accumulation, step the LR scheduler once per optimizer step; stepped per micro-batch "
            "it runs k times too fast (the per-micro-batch columns of the table)"
        )
    return AccumReport(
        model=model.name,
        gpu=gpu.name,
        capacity_bytes=gpu.memory_bytes,
        headroom=headroom,
        usable_bytes=memo.usable_bytes(gpu, headroom),
        global_batch=global_batch,
        seq_len=train.seq_len,
        samples=samples * ep,
        per_thousand=dataset_size is None,
        epochs=ep,
        splits=tuple(splits),
        schedule=sched,
        warnings=tuple(warnings),
    )
