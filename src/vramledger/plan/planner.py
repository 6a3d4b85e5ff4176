"""`vramledger plan`: configurations that fit, ranked by predicted throughput, and what each remedy saves and costs.

Three views of the same search:
- remedies: each remedy's variants applied alone to the user's setup — memory saved, time cost per optimizer
  step (in the seeds' order);
- ladder: the remedies applied cumulatively in the seeds' order until the setup fits, the micro-batch regrown to
  the largest divisor of the global batch that fits after each step;
- candidates: every combination of the task-preserving remedies (precision, checkpointing, loss, optimizer,
  adapters, offload, attention), each at its fastest fitting micro-batch × accumulation split of the global batch,
  ranked by predicted tokens/s. Candidates that change the task (a shorter sequence, a smaller model) are kept
  apart. The enumeration does not depend on the GPU's memory, so a larger GPU can only add candidates: its best
  plan is never slower.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vramledger.errors import VramledgerError
from vramledger.plan import memo, remedies
from vramledger.plan.frontier import DEFAULT_GRANULARITY, largest
from vramledger.plan.remedies import ORDER, TITLES, Change, Remedy, Variant
from vramledger.plan.timemodel import DEFAULT_ASSUMPTIONS, StepTime, TimeAssumptions, step_time
from vramledger.specs import GPUSpec, ModelSpec, TrainSpec
from vramledger.specs.gpu import check_headroom

ACCUM_WARNING = (
    "plan {rank} accumulates over {k} micro-batches: the loop runs {k} forward/backward passes per optimizer "
    "step, so optimizer steps fall to 1/{k} of the micro-steps; step the LR scheduler (and count warmup and total "
    "steps) per optimizer step, not per micro-batch (the HF Trainer does; a hand-written loop must)"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One configuration with its memory and predicted time."""

    model: ModelSpec
    train: TrainSpec
    changes: tuple[Change, ...]
    device_total: int
    fits: bool
    time: StepTime

    @property
    def changes_task(self) -> bool:
        return any(c.changes_task for c in self.changes)


@dataclass(frozen=True, kw_only=True, slots=True)
class RemedyEffect:
    """One remedy variant applied alone to the user's setup."""

    remedy: str
    title: str
    change: Change
    device_total: int
    memory_saved: int
    """Baseline device total − this variant's (≥ 0: variants that would not save memory are not listed)."""
    step_s: float
    time_cost_s: float
    """Seconds per optimizer step added (negative: faster)."""
    fits: bool
    price: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    model: str
    gpu: str
    capacity_bytes: int
    headroom: float
    usable_bytes: int
    global_batch: int
    seq_len: int
    baseline: Candidate
    remedies: tuple[RemedyEffect, ...]
    ladder: tuple[Candidate, ...]
    """Cumulative in the seeds' order; the last one fits unless nothing does."""
    candidates: tuple[Candidate, ...]
    """Task-preserving configurations that fit, fastest first."""
    task_changing: tuple[Candidate, ...]
    warnings: tuple[str, ...]
    assumptions: TimeAssumptions
    combinations: int
    """Remedy combinations searched."""

    @property
    def best(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None


class _Ctx:
    """The fixed inputs of one planning run, with the two evaluations everything else uses."""

    def __init__(self, base: TrainSpec, gpu: GPUSpec, headroom: float, global_batch: int, a: TimeAssumptions) -> None:
        self.gpu, self.headroom, self.global_batch, self.a = gpu, headroom, global_batch, a
        self.base_split = f"{base.micro_batch}x{base.grad_accum}"
        self.splits = remedies.divisors(global_batch)

    def split_change(self, d: int) -> tuple[Change, ...]:
        """The micro-batch change relative to the user's split (none when it is the same)."""
        after = f"{d}x{self.global_batch // d}"
        if after == self.base_split:
            return ()
        return (Change(remedy=Remedy.MICRO_BATCH, setting="micro-batch x accum", before=self.base_split, after=after),)

    def candidate(self, m: ModelSpec, t: TrainSpec, changes: Iterable[Change]) -> Candidate:
        led = memo.ledger(m, t, self.gpu, self.headroom)
        assert led.verdict is not None
        changes = sorted(changes, key=lambda c: ORDER.index(c.remedy))
        return Candidate(
            model=m,
            train=t,
            changes=tuple(changes),
            device_total=led.device_total,
            fits=led.verdict.fits,
            time=step_time(m, t, self.gpu, self.a),
        )

    def fastest_split(self, m: ModelSpec, t: TrainSpec, changes: tuple[Change, ...]) -> Candidate | None:
        """The fastest micro-batch × accumulation split of the global batch that fits (None if none fits).

        Memory is monotone in the micro-batch, so the fitting splits are the divisors up to the largest fitting
        one (found by bisection); time is not always monotone (a padded SDPA batch loses the causal skip), so
        every fitting split is timed."""
        splits = self.splits

        def ok(i: int) -> bool:
            return memo.fits(m, self._split(t, splits[i - 1]), self.gpu, self.headroom)

        n = largest(ok, len(splits))
        if not n:
            return None
        best: Candidate | None = None
        kept = tuple(c for c in changes if c.remedy != "micro_batch")
        for d in splits[:n]:
            c = self.candidate(m, self._split(t, d), kept + self.split_change(d))
            if best is None or c.time.tokens_per_s > best.time.tokens_per_s:
                best = c
        return best

    def _split(self, t: TrainSpec, d: int) -> TrainSpec:
        return dataclasses.replace(t, micro_batch=d, grad_accum=self.global_batch // d)


def baseline_train(train: TrainSpec, global_batch: int | None, *, batch_given: bool) -> tuple[TrainSpec, int]:
    """The user's setup and its global batch (per GPU). With ``--global-batch`` and no explicit micro-batch,
    the naive setup is one micro-batch of the whole global batch."""
    if global_batch is None:
        return train, train.micro_batch * train.grad_accum
    if global_batch < 1:
        raise VramledgerError(f"--global-batch must be a positive integer (got {global_batch}); e.g. --global-batch 32")
    if not batch_given:
        return dataclasses.replace(train, micro_batch=global_batch, grad_accum=1), global_batch
    if global_batch % train.micro_batch:
        raise VramledgerError(
            f"--global-batch {global_batch} is not a multiple of the micro-batch {train.micro_batch}; "
            f"pass a multiple (e.g. {train.micro_batch * max(1, global_batch // train.micro_batch)}) or drop --batch"
        )
    return dataclasses.replace(train, grad_accum=global_batch // train.micro_batch), global_batch


def _axes(m: ModelSpec, t: TrainSpec, gpu: GPUSpec) -> list[list[Variant | None]]:
    """Per task-preserving remedy, the options: None (leave it) and its variants."""
    axes: list[list[Variant | None]] = []
    for key in ("precision", "grad_ckpt", "loss", "adapters", "offload", "attention"):
        vs: list[Variant] = remedies.variants(key, m, t, gpu, global_batch=1)
        if key == "adapters":
            vs += _lower_rank_of(m, t, vs)
        axes.append([None, *vs])
    axes.append([None, *remedies.optimizer_variants(m, t, include_paged=False)])
    return axes


def _lower_rank_of(m: ModelSpec, t: TrainSpec, vs: list[Variant]) -> list[Variant]:
    """The method-changing adapter variants again at half their rank (e.g. full -> qlora r8)."""
    out = []
    for v in vs:
        if v.change.setting != "method":
            continue
        for w in remedies.adapter_variants(m, v.train):
            if w.change.setting == "LoRA rank" and w.train.lora is not None:
                after = f"{w.train.method.value} r{w.train.lora.rank}" + (" nf4" if w.train.quant else "")
                out.append(Variant(model=m, train=w.train, change=dataclasses.replace(v.change, after=after)))
    return out


def _combine(m: ModelSpec, t: TrainSpec, picks: tuple[Variant | None, ...]) -> tuple[TrainSpec, tuple[Change, ...]]:
    """Apply the picked variants' changed fields to ``t`` (each variant was built from ``t`` alone)."""
    fields: dict[str, Any] = {}
    changes: list[Change] = []
    for v in picks:
        if v is None:
            continue
        for f in dataclasses.fields(TrainSpec):
            new, old = getattr(v.train, f.name), getattr(t, f.name)
            if new != old:
                fields[f.name] = new
        changes.append(v.change)
    if fields.get("offload_optimizer") and "optimizer" in fields:
        raise VramledgerError("offload runs its own optimizer")  # skipped by the caller
    return dataclasses.replace(t, **fields), tuple(changes)


LADDER_MIN_SAVING = 0.01
"""The ladder takes a remedy only if it saves at least 1% of the device total (or makes the setup fit)."""

TIE = 0.005
"""Throughputs within 0.5% are a tie (far inside the time model's uncertainty): the simpler plan ranks first."""


def _rank(c: Candidate) -> tuple[int, int, int]:
    return (-round(math.log(c.time.tokens_per_s) / math.log1p(TIE)), len(c.changes), c.device_total)


def _prune(ranked: list[Candidate]) -> list[Candidate]:
    """Drop a candidate when a kept one makes a subset of its changes at least as fast (within ``TIE``): the
    extra remedy buys nothing."""
    kept: list[Candidate] = []
    for c in ranked:
        mine = {str(x) for x in c.changes}
        if not any(
            {str(x) for x in k.changes} <= mine and k.time.tokens_per_s >= c.time.tokens_per_s * (1 - TIE) for k in kept
        ):
            kept.append(c)
    return kept


def plan(
    model: ModelSpec,
    train: TrainSpec,
    gpu: GPUSpec,
    headroom: float,
    *,
    global_batch: int | None = None,
    batch_given: bool = True,
    granularity: int = DEFAULT_GRANULARITY,
    assumptions: TimeAssumptions = DEFAULT_ASSUMPTIONS,
) -> Plan:
    """Search the remedies for ``train`` on ``gpu`` keeping ``headroom`` free (see the module docstring)."""
    check_headroom(headroom)
    base_t, g = baseline_train(train, global_batch, batch_given=batch_given)
    ctx = _Ctx(base_t, gpu, headroom, g, assumptions)
    base = ctx.candidate(model, base_t, ())
    warnings: list[str] = list(memo.ledger(model, base_t, gpu, headroom).warnings)

    # 1. each remedy alone
    effects: list[RemedyEffect] = []
    skipped: list[str] = []
    for key in ORDER:
        vs = remedies.variants(key, model, base_t, gpu, global_batch=g)
        if key == "seq_len":
            vs = remedies.seq_variants(model, base_t, _shorter_lengths(model, base_t, ctx, granularity))
        for v in vs:
            c = ctx.candidate(v.model, v.train, (v.change,))
            saved = base.device_total - c.device_total
            if saved < 0:
                skipped.append(f"{v.change} would add {-saved:,} bytes here")
                continue
            effects.append(
                RemedyEffect(
                    remedy=key,
                    title=TITLES[key],
                    change=v.change,
                    device_total=c.device_total,
                    memory_saved=saved,
                    step_s=c.time.step_s,
                    time_cost_s=c.time.step_s - base.time.step_s,
                    fits=c.fits,
                    price=remedies.PRICE[key],
                )
            )
    if skipped:
        warnings.append("not offered (no saving in the estimate): " + "; ".join(skipped))

    # 2. the ladder
    ladder = _ladder(model, base_t, base, ctx, granularity)

    # 3. every combination of the task-preserving remedies, each at its fastest fitting split
    seen: dict[TrainSpec, Candidate] = {}
    combos = 0
    for picks in itertools.product(*_axes(model, base_t, gpu)):
        try:
            t, changes = _combine(model, base_t, picks)
        except VramledgerError:
            continue
        if t in seen:
            continue
        combos += 1
        found = ctx.fastest_split(model, t, changes)
        if found is not None:
            prev = seen.get(found.train)
            if prev is None or _rank(found) < _rank(prev):
                seen[found.train] = found
    candidates = _prune(sorted(seen.values(), key=_rank))

    # 4. what changes the task: shorter sequences and smaller models, with and without the full remedy stack
    task = _task_changing(model, base_t, ladder, ctx, granularity)

    for i, c in enumerate(candidates[:3], 1):
        if c.train.grad_accum > 1:
            warnings.append(ACCUM_WARNING.format(rank=i, k=c.train.grad_accum))
            break
    if base.time.assumed_gpu:
        warnings.append(
            f"{gpu.name} has no throughput figures: times assume {assumptions.fallback_tflops:g} bf16 TFLOP/s and "
            f"{assumptions.fallback_bandwidth_gbs:g} GB/s (pick a catalog GPU for real figures)"
        )
    usable = memo.usable_bytes(gpu, headroom)
    return Plan(
        model=model.name,
        gpu=gpu.name,
        capacity_bytes=gpu.memory_bytes,
        headroom=headroom,
        usable_bytes=usable,
        global_batch=g,
        seq_len=base_t.seq_len,
        baseline=base,
        remedies=tuple(effects),
        ladder=tuple(ladder),
        candidates=tuple(candidates),
        task_changing=tuple(task),
        warnings=tuple(warnings),
        assumptions=assumptions,
        combinations=combos,
    )


def _regrow(m: ModelSpec, t: TrainSpec, changes: tuple[Change, ...], ctx: _Ctx) -> Candidate:
    """The largest fitting split (or micro-batch 1 when none fits), keeping the global batch."""
    c = ctx.fastest_split(m, t, changes)
    if c is not None:
        return c
    kept = tuple(c for c in changes if c.remedy != "micro_batch")
    return ctx.candidate(m, ctx._split(t, 1), kept + ctx.split_change(1))


def _ladder(m: ModelSpec, t: TrainSpec, base: Candidate, ctx: _Ctx, granularity: int) -> list[Candidate]:
    """Remedies in the seeds' order, cumulatively, until the setup fits: the task-preserving ones in passes until
    none helps any more (a remedy can matter only once another has moved the peak), then the task-changing ones."""
    steps = [base]
    cur = base
    preserving = [k for k in ORDER if k not in remedies.TASK_CHANGING]
    progress = True
    while not cur.fits and progress:
        progress = False
        for key in preserving:
            if cur.fits:
                break
            nxt = _ladder_step(key, cur, ctx, granularity)
            if nxt is not None:
                steps.append(nxt)
                cur, progress = nxt, True
    for key in ORDER:
        if key in remedies.TASK_CHANGING and not cur.fits:
            nxt = _ladder_step(key, cur, ctx, granularity)
            if nxt is not None:
                steps.append(nxt)
                cur = nxt
    return steps


def _ladder_step(key: str, cur: Candidate, ctx: _Ctx, granularity: int) -> Candidate | None:
    """The most useful variant of one remedy on top of ``cur`` (fits first, then least memory), or None when it
    saves less than ``LADDER_MIN_SAVING``."""
    if key == "micro_batch":
        cands = [_regrow(cur.model, cur.train, cur.changes, ctx)]
    else:
        if key == "seq_len":
            lengths = _shorter_lengths(cur.model, cur.train, ctx, granularity, at_micro_one=True)
            vs = remedies.seq_variants(cur.model, cur.train, lengths[:1])
        else:
            vs = remedies.variants(key, cur.model, cur.train, ctx.gpu, global_batch=ctx.global_batch)
        cands = [_regrow(v.model, v.train, cur.changes + (v.change,), ctx) for v in vs]
    best = max(cands, key=lambda c: (c.fits, -c.device_total), default=None)
    if best is None or not (best.fits or best.device_total < cur.device_total * (1 - LADDER_MIN_SAVING)):
        return None
    return best


def _shorter_lengths(
    m: ModelSpec, t: TrainSpec, ctx: _Ctx, granularity: int, *, at_micro_one: bool = False
) -> list[int]:
    """The largest grid length below ``t.seq_len`` that fits (at micro-batch 1 when asked), else half the length."""
    base = ctx._split(t, 1) if at_micro_one else t
    steps = (t.seq_len - 1) // granularity

    def ok(k: int) -> bool:
        return memo.fits(m, dataclasses.replace(base, seq_len=k * granularity), ctx.gpu, ctx.headroom)

    k = largest(ok, steps)
    if k:
        return [k * granularity]
    return [max(1, t.seq_len // 2)] if t.seq_len > 1 else []


def _task_changing(m: ModelSpec, t: TrainSpec, ladder: list[Candidate], ctx: _Ctx, granularity: int) -> list[Candidate]:
    """Shorter sequences (for the setup as given and for the ladder's last step) and smaller models."""
    out: dict[tuple[str, TrainSpec], Candidate] = {}
    last = [c for c in ladder if not c.changes_task][-1]
    stacks = [(t, ()), (last.train, last.changes)]
    for st, changes in stacks:
        for L in _shorter_lengths(m, st, ctx, granularity, at_micro_one=True):
            ch = Change(remedy=Remedy.SEQ_LEN, setting="sequence length", before=str(t.seq_len), after=str(L))
            c = ctx.fastest_split(m, dataclasses.replace(st, seq_len=L), changes + (ch,))
            if c is not None:
                out[(m.name, c.train)] = c
    for small in remedies.smaller_models(m):
        ch = Change(remedy=Remedy.MODEL, setting="model", before=m.name, after=small.name)
        for st, changes in stacks:
            c = ctx.fastest_split(small, st, changes + (ch,))
            if c is not None:
                out[(small.name, c.train)] = c
                break
    return _prune(sorted(out.values(), key=_rank))
