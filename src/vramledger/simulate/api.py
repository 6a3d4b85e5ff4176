"""``simulate``: the memory of a whole run, step by step, and the probability that it runs out of memory.

The step's allocation stream comes from one trace (``templates``), scaled to each batch's padded length; the
run's batches come from the sample lengths, their order and the collator (``batching``, ``schedule``); the
allocator model sees the whole run (``engine``). With ``shuffles`` > 1 the run is repeated with seeds
``seed … seed + shuffles − 1`` (a new order each; lengths drawn from statistics are drawn again): the fraction
that fails is the OOM probability.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from vramledger.allocator.conf import DEFAULT_CONF, AllocatorConf
from vramledger.analytic.overhead import obtainable_bytes
from vramledger.errors import VramledgerError
from vramledger.simulate.engine import OomAt, Replayer, UnitStats
from vramledger.simulate.lengths import Lengths
from vramledger.simulate.schedule import RunSpec, plan_run
from vramledger.simulate.templates import StepTemplates, build_templates
from vramledger.specs import GPUSpec, ModelSpec, TrainSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class StepPoint:
    """One point of the per-step series: a training step or an evaluation."""

    step: int
    kind: str
    """``train`` or ``eval``."""
    padded_lengths: tuple[int, ...]
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    reserved_end_bytes: int
    segments_end: int
    retries: int


@dataclass(frozen=True, kw_only=True, slots=True)
class RunOutcome:
    """One run (one order of the samples)."""

    seed: int
    points: tuple[StepPoint, ...]
    oom: OomAt | None
    high_water_reserved_bytes: int
    high_water_point: StepPoint | None
    bucket: int

    @property
    def oom_step(self) -> int | None:
        return None if self.oom is None else self.oom.step


@dataclass(frozen=True, kw_only=True, slots=True)
class Simulation:
    """The answer: the main run (seed ``seed``), the Monte Carlo over shuffles, and what it rests on."""

    run: RunOutcome
    oom_probability: float
    shuffles: int
    oom_steps: tuple[int | None, ...]
    """The step each shuffle failed at (``None``: it finished)."""
    capacity_bytes: int | None
    gpu: str | None
    conf: str
    steps: int
    train_lengths: tuple[int, ...]
    """Padded length of every micro-batch of the main run (before bucketing)."""
    sample_lengths: tuple[int, ...]
    """The samples (truncated to the cutoff) of the main run."""
    reference_len: int
    unscaled: int
    replays: int
    memo_hits: int
    versions: str
    source: str
    warnings: tuple[str, ...] = ()


def _points(stats: list[UnitStats]) -> tuple[StepPoint, ...]:
    return tuple(
        StepPoint(
            step=s.unit.step,
            kind=s.unit.kind,
            padded_lengths=s.unit.lengths,
            peak_allocated_bytes=s.peak_allocated_bytes,
            peak_reserved_bytes=s.peak_reserved_bytes,
            reserved_end_bytes=s.reserved_end_bytes,
            segments_end=s.segments_end,
            retries=s.retries,
        )
        for s in stats
        if s.unit.kind != "load"
    )


def _outcome(stats: list[UnitStats], seed: int, bucket: int) -> RunOutcome:
    points = _points(stats)
    hw = max(points, key=lambda p: p.peak_reserved_bytes, default=None)  # max() keeps the first maximum
    load = max((s.peak_reserved_bytes for s in stats if s.unit.kind == "load"), default=0)
    high = max(load, hw.peak_reserved_bytes if hw is not None else 0)
    return RunOutcome(
        seed=seed,
        points=points,
        oom=stats[-1].oom if stats else None,
        high_water_reserved_bytes=high,
        high_water_point=hw,
        bucket=bucket,
    )


def capacity_of(gpu: GPUSpec | None) -> int | None:
    """What torch can obtain on ``gpu`` (:func:`vramledger.analytic.overhead.obtainable_bytes`)."""
    return obtainable_bytes(gpu)


def make_templates(
    model: ModelSpec, train: TrainSpec, spec: RunSpec, *, eval_batch: int | None, config: dict[str, Any] | None = None
) -> StepTemplates:
    """The traced step templates the run needs (with an eval batch when the schedule evaluates)."""
    if train.distributed:
        raise VramledgerError("simulate: one GPU only for now (no DDP/FSDP/ZeRO); drop the distributed settings")
    evaluates = spec.eval_every is not None and spec.eval_batches > 0 and eval_batch is not None
    return build_templates(model, train, eval_batch=eval_batch if evaluates else None, config=config)


def simulate(
    templates: StepTemplates,
    lengths: Lengths,
    spec: RunSpec,
    *,
    gpu: GPUSpec | None = None,
    conf: AllocatorConf = DEFAULT_CONF,
    seed: int = 0,
    shuffles: int = 1,
    replayer: Replayer | None = None,
) -> Simulation:
    """Simulate the run ``shuffles`` times; the first (seed ``seed``) is reported step by step.

    Lengths drawn from summary statistics are drawn again for every other shuffle (``Lengths.redraw``); other
    sources are reordered. ``replayer``: reuse one (and its memo) across calls with the same
    templates, allocator settings and GPU.
    """
    if shuffles < 1:
        raise VramledgerError("--shuffles must be at least 1")
    if spec.eval_every and spec.eval_batches and templates.eval is None:
        raise VramledgerError("simulate: evaluation needs an eval batch (--eval-batch N)")
    cap = capacity_of(gpu)
    rep = replayer or Replayer(
        templates, conf=conf, capacity_bytes=cap, device_total_bytes=None if gpu is None else gpu.memory_bytes
    )
    eval_batch = templates.eval_batch
    main: RunOutcome | None = None
    main_plan = None
    main_samples: list[int] = []
    oom_steps: list[int | None] = []
    for k in range(shuffles):
        s = seed + k
        samples = list(lengths.train if k == 0 else lengths.redraw(len(lengths.train), s))
        plan = plan_run(samples, list(lengths.eval), spec, batch=templates.micro_batch, eval_batch=eval_batch, seed=s)
        outcome = _outcome(rep.run(plan.units), s, plan.bucket)
        oom_steps.append(outcome.oom_step)
        if main is None:
            main, main_plan, main_samples = outcome, plan, samples
    assert main is not None and main_plan is not None
    warnings = lengths.warnings
    if templates.unscaled:
        warnings += (f"{templates.unscaled} traced allocations do not follow their shape; kept at their traced size",)
    if main.bucket > 1 and (spec.bucket is None):
        warnings += (
            f"{len(set(main_plan.train_lengths))} distinct padded lengths: replayed in buckets of "
            f"{main.bucket} tokens (rounded up; --bucket 1 replays them exactly)",
        )
    return Simulation(
        run=main,
        oom_probability=sum(x is not None for x in oom_steps) / shuffles,
        shuffles=shuffles,
        oom_steps=tuple(oom_steps),
        capacity_bytes=cap,
        gpu=None if gpu is None else gpu.name,
        conf=conf.text,
        steps=len(main_plan.train_lengths) // spec.accum,
        train_lengths=tuple(main_plan.train_lengths),
        sample_lengths=tuple(min(x, spec.cutoff) for x in main_samples),
        reference_len=templates.reference_len,
        unscaled=templates.unscaled,
        replays=rep.replays,
        memo_hits=rep.memo_hits,
        versions=templates.versions,
        source=lengths.source,
        warnings=warnings,
    )


def with_spec(spec: RunSpec, **changes: Any) -> RunSpec:
    return dataclasses.replace(spec, **changes)
