"""Where the fit turns into OOM: the largest micro-batch for a length, the largest length for a micro-batch, and
the batch × length frontier, from the analytic estimate.

The estimate's device total grows with the micro-batch and with the length (every batch- or length-dependent
line is a non-negative multiple of B, L or B·L²), so "fits" is monotone along both axes: true up to a cliff,
false after it. We exploit that with exponential search (double until it fails) and bisection, and along the
frontier the largest length for batch b + 1 can only be at most the one for batch b, so each later search is a
bisection below the previous answer. The tests check every answer against a brute-force scan of the estimator.
A packed run's reserve is its one shape's (analytic/reserve/runs.py ``on_at``) and can fall where a mechanism of the
caching allocator switches off as the shape grows: there a search still reports a shape it found to fit, which may
be short of the largest that does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from vramledger.errors import VramledgerError
from vramledger.ledger import Ledger
from vramledger.plan import memo
from vramledger.specs import GPUSpec, ModelSpec, TrainSpec
from vramledger.specs.gpu import check_headroom

DEFAULT_GRANULARITY = 128
"""Lengths are searched on multiples of this (padding to a multiple of 64-128 is what tokenizers and kernels
favour: transformers ``DataCollatorWithPadding(pad_to_multiple_of=…)``)."""
DEFAULT_MAX_BATCH = 64
BATCH_LIMIT = 1 << 16
"""Upper end of a micro-batch search (a search that reaches it says so: ``FitPoint.at_limit``)."""
LENGTH_LIMIT = 1 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class FitPoint:
    """A (micro-batch, length) that fits, with its device total."""

    micro_batch: int
    seq_len: int
    device_total: int
    """Bytes at the step's peak (nvidia-smi)."""
    at_limit: bool = False
    """The search stopped at its upper limit, not at an OOM: the true cliff lies further."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Frontier:
    """For each micro-batch 1, 2, …, the largest length (a multiple of ``granularity``) that fits.

    ``points`` stops at the first micro-batch for which not even ``granularity`` tokens fit (or at ``max_batch``).
    """

    granularity: int
    max_batch: int
    max_len: int
    points: tuple[FitPoint, ...]
    evaluations: int
    """Estimates the search asked for (cached repeats included)."""

    def max_len_for(self, batch: int) -> int | None:
        for p in self.points:
            if p.micro_batch == batch:
                return p.seq_len
        return None

    def steps(self) -> tuple[tuple[int, int, int], ...]:
        """Runs of micro-batches that share a largest length: (first batch, last batch, length)."""
        out: list[tuple[int, int, int]] = []
        for p in self.points:
            if out and out[-1][2] == p.seq_len and out[-1][1] == p.micro_batch - 1:
                out[-1] = (out[-1][0], p.micro_batch, p.seq_len)
            else:
                out.append((p.micro_batch, p.micro_batch, p.seq_len))
        return tuple(out)


def largest(pred: Callable[[int], bool], limit: int, *, start_hi: int | None = None) -> int:
    """The largest k in [1, limit] with ``pred(k)``, for a predicate that is true up to some k and false after;
    0 when ``pred(1)`` is false. Exponential search from 1 (or a bisection below ``start_hi`` when the answer is
    known to be at most that), then bisection: O(log k) calls."""
    if limit < 1 or not pred(1):
        return 0
    lo = 1  # known true
    if start_hi is not None:
        hi = min(start_hi, limit)
        if pred(hi):
            return hi
        # answer in [lo, hi)
    else:
        k = 1
        while True:
            nxt = min(2 * k, limit)
            if nxt == k:
                return k  # reached the limit and it still holds
            if not pred(nxt):
                hi = nxt
                break
            k = nxt
        lo = k
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if pred(mid):
            lo = mid
        else:
            hi = mid
    return lo


def default_max_len(model: ModelSpec, granularity: int) -> int:
    """The model's trained context (``max_position_embeddings``), or 64 steps of ``granularity`` when unknown."""
    return model.max_position_embeddings or 64 * granularity


def _check(granularity: int, headroom: float) -> None:
    if granularity < 1:
        raise VramledgerError(f"--granularity must be a positive number of tokens (got {granularity}); e.g. 128")
    check_headroom(headroom)


def max_micro_batch(
    model: ModelSpec, train: TrainSpec, gpu: GPUSpec, headroom: float, *, limit: int = BATCH_LIMIT
) -> FitPoint | None:
    """The largest micro-batch that fits at ``train.seq_len`` (None when not even one sequence fits)."""

    def ok(b: int) -> bool:
        return memo.fits(model, dataclasses.replace(train, micro_batch=b), gpu, headroom)

    b = largest(ok, limit)
    if not b:
        return None
    t = dataclasses.replace(train, micro_batch=b)
    return FitPoint(
        micro_batch=b,
        seq_len=train.seq_len,
        device_total=memo.device_total(model, t, gpu, headroom),
        at_limit=b == limit,
    )


def max_seq_len(
    model: ModelSpec,
    train: TrainSpec,
    gpu: GPUSpec,
    headroom: float,
    *,
    granularity: int = DEFAULT_GRANULARITY,
    limit: int | None = None,
) -> FitPoint | None:
    """The largest length, a multiple of ``granularity`` up to ``limit``, that fits at ``train.micro_batch``."""
    _check(granularity, headroom)
    limit = default_max_len(model, granularity) if limit is None else limit
    steps = limit // granularity

    def ok(k: int) -> bool:
        return memo.fits(model, dataclasses.replace(train, seq_len=k * granularity), gpu, headroom)

    k = largest(ok, steps)
    if not k:
        return None
    t = dataclasses.replace(train, seq_len=k * granularity)
    return FitPoint(
        micro_batch=train.micro_batch,
        seq_len=k * granularity,
        device_total=memo.device_total(model, t, gpu, headroom),
        at_limit=k == steps,
    )


def frontier(
    model: ModelSpec,
    train: TrainSpec,
    gpu: GPUSpec,
    headroom: float,
    *,
    max_batch: int = DEFAULT_MAX_BATCH,
    granularity: int = DEFAULT_GRANULARITY,
    max_len: int | None = None,
) -> Frontier:
    """For each micro-batch 1..``max_batch``, the largest length on the ``granularity`` grid that fits."""
    _check(granularity, headroom)
    if max_batch < 1:
        raise VramledgerError(f"--max-batch must be a positive integer (got {max_batch})")
    max_len = default_max_len(model, granularity) if max_len is None else max_len
    steps = max_len // granularity
    calls = 0
    points: list[FitPoint] = []
    prev: int | None = None
    for b in range(1, max_batch + 1):
        base = dataclasses.replace(train, micro_batch=b)

        def ok(k: int, base: TrainSpec = base) -> bool:
            nonlocal calls
            calls += 1
            return memo.fits(model, dataclasses.replace(base, seq_len=k * granularity), gpu, headroom)

        k = largest(ok, steps, start_hi=prev)
        if not k:
            break
        t = dataclasses.replace(base, seq_len=k * granularity)
        points.append(
            FitPoint(
                micro_batch=b,
                seq_len=k * granularity,
                device_total=memo.device_total(model, t, gpu, headroom),
                at_limit=k == steps,
            )
        )
        prev = k
    return Frontier(
        granularity=granularity,
        max_batch=max_batch,
        max_len=steps * granularity,
        points=tuple(points),
        evaluations=calls,
    )


# -- the fit report ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ExactCheck:
    """A frontier point confirmed (or not) by tracing the real model code."""

    micro_batch: int
    seq_len: int
    analytic_total: int
    traced_total: int
    traced_fits: bool
    next_micro_batch: int
    next_seq_len: int
    """The next shape along the cliff's axis, which the analytic frontier says does not fit: one more sequence for
    the largest micro-batch at the given length, the next length on the grid for a point of the frontier."""
    next_traced_total: int
    next_traced_fits: bool

    @property
    def agrees(self) -> bool:
        return self.traced_fits and not self.next_traced_fits


@dataclass(frozen=True, kw_only=True, slots=True)
class FitReport:
    """`vramledger fit`: the user's setup, the cliff along each axis, and the frontier, headroom made explicit."""

    model: str
    gpu: str
    capacity_bytes: int
    headroom: float
    usable_bytes: int
    micro_batch: int
    seq_len: int
    device_total: int
    """Device total of the setup as given."""
    fits: bool
    largest_batch: FitPoint | None
    """Largest micro-batch at the given length."""
    largest_length: FitPoint | None
    """Largest length (on the grid) at the given micro-batch."""
    frontier: Frontier
    exact: tuple[ExactCheck, ...] = ()
    warnings: tuple[str, ...] = ()


def fit(
    model: ModelSpec,
    train: TrainSpec,
    gpu: GPUSpec,
    headroom: float,
    *,
    max_batch: int = DEFAULT_MAX_BATCH,
    granularity: int = DEFAULT_GRANULARITY,
    max_len: int | None = None,
    exact: bool = False,
) -> FitReport:
    """Everything `vramledger fit` shows. ``exact`` confirms the frontier's corners with traces."""
    _check(granularity, headroom)
    led = memo.ledger(model, train, gpu, headroom)
    assert led.verdict is not None
    max_len = default_max_len(model, granularity) if max_len is None else max_len
    front = frontier(model, train, gpu, headroom, max_batch=max_batch, granularity=granularity, max_len=max_len)
    lb = max_micro_batch(model, train, gpu, headroom)
    ll = max_seq_len(model, train, gpu, headroom, granularity=granularity, limit=max(max_len, train.seq_len))
    warnings = list(led.warnings)
    if model.max_position_embeddings and train.seq_len > model.max_position_embeddings:
        warnings.append(
            f"--seq {train.seq_len} exceeds the model's max_position_embeddings ({model.max_position_embeddings})"
        )
    checks: tuple[ExactCheck, ...] = ()
    if exact:
        pts = [(lb.micro_batch, lb.seq_len, lb.micro_batch + 1, lb.seq_len)] if lb is not None else []
        pts += [(p.micro_batch, p.seq_len, p.micro_batch, p.seq_len + granularity) for p in (ll,) if p is not None]
        pts += [(first, L, first, L + granularity) for first, _, L in front.steps()[:4]]
        checks = exact_checks(model, train, gpu, headroom, pts)
    return FitReport(
        model=model.name,
        gpu=gpu.name,
        capacity_bytes=gpu.memory_bytes,
        headroom=headroom,
        usable_bytes=led.verdict.usable_bytes,
        micro_batch=train.micro_batch,
        seq_len=train.seq_len,
        device_total=led.device_total,
        fits=led.verdict.fits,
        largest_batch=lb,
        largest_length=ll,
        frontier=front,
        exact=checks,
        warnings=tuple(warnings),
    )


def _tracer() -> Callable[..., Ledger]:
    try:
        import vramledger.trace as trace_pkg
    except ImportError as exc:  # pragma: no cover - the package exists; its heavy imports may not
        raise VramledgerError(
            f"--exact needs the tracer, which could not be imported ({exc}); run without --exact"
        ) from exc
    fn = getattr(trace_pkg, "trace_step", None)
    if fn is None:
        raise VramledgerError(
            "--exact needs the tracer (vramledger.trace.trace_step), which this build does not have yet; "
            "run without --exact for the analytic frontier"
        )
    return fn


def exact_checks(
    model: ModelSpec,
    train: TrainSpec,
    gpu: GPUSpec,
    headroom: float,
    points: list[tuple[int, int, int, int]],
) -> tuple[ExactCheck, ...]:
    """Trace each point (b, ℓ) and the next shape past its cliff (b', ℓ'): the analytic cliff is confirmed when the
    first fits and the second does not. A shape is traced once however many points share it."""
    trace_step = _tracer()
    traced: dict[tuple[int, int], Ledger] = {}

    def at(b: int, ell: int) -> Ledger:
        if (b, ell) not in traced:
            traced[b, ell] = trace_step(model, train.at_shape(b, ell), gpu=gpu, headroom=headroom)
        return traced[b, ell]

    out: list[ExactCheck] = []
    for b0, l0, b1, l1 in dict.fromkeys(points):
        a, b = at(b0, l0), at(b1, l1)
        out.append(
            ExactCheck(
                micro_batch=b0,
                seq_len=l0,
                analytic_total=memo.device_total(model, train.at_shape(b0, l0), gpu, headroom),
                traced_total=a.device_total,
                traced_fits=a.verdict is not None and a.verdict.fits,
                next_micro_batch=b1,
                next_seq_len=l1,
                next_traced_total=b.device_total,
                next_traced_fits=b.verdict is not None and b.verdict.fits,
            )
        )
    return tuple(out)
