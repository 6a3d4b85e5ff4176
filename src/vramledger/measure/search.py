"""Find the OOM cliff: the largest micro-batch (or sequence length) that runs, in few real trials.

The search works on an integer grid ``value = k × granularity`` (k ≥ 1) and assumes that memory grows with the
value, so that "fits" is monotone: if k fits, every smaller k fits. It keeps a bracket (the largest value that
ran, the smallest that failed) and each trial lands strictly inside it, so it ends, with the exact answer.

Where each trial lands:

- first, the estimator's prediction;
- after a trial that ran *and reported its measured peak*, the secant step: the largest value whose predicted
  growth from that point still fits, ``measured(k) + predict(v) − predict(k) ≤ capacity``. The estimator's
  error in its fixed part (weights, optimizer states) cancels; only its error in the slope over the short
  remaining distance is left, so the next trial is usually the answer, and its neighbour proves it;
- when the guess equals the bracket's bottom, the value just above it (the proof);
- without measurements (a runner that only says yes or no), it gallops away from the last trial
  (± 1, ± 2, ± 4, …) until the answer is bracketed;
- after ``model_trials`` guided trials that did not close the bracket, plain bisection.

A right prediction costs two trials (it, and the one above it); one off by a few costs about three.

The trial runner is injected (values → bool, or → :class:`Outcome` with the measured peak), so the search runs
against a simulated capacity in the tests and the benchmark, and against real worker processes in
``vramledger find-max``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from vramledger.errors import VramledgerError
from vramledger.specs import ModelSpec, TrainSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    """What one trial says: whether it ran, and (optionally) the memory it measured, in bytes."""

    fits: bool
    peak: int | None = None
    """Measured peak, on the same basis as the ``predict`` given to :func:`find_max` (None: unknown)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Trial:
    value: int
    """The batch size or sequence length tried."""
    fits: bool
    peak: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchResult:
    best: int | None
    """The largest value that ran (None when even the smallest did not)."""
    first_fail: int | None
    """The smallest value that failed (None when every value up to the upper bound ran)."""
    trials: tuple[Trial, ...]
    """Every trial run, in order (never the same value twice)."""
    predicted: int | None = None
    """The prediction the search started from (None for the plain search)."""

    @property
    def n_trials(self) -> int:
        return len(self.trials)


Runner = Callable[[int], "bool | Outcome"]


class _Runner:
    """Runs trials on grid indices, caching them so a value is never run twice, and records the order."""

    def __init__(self, run: Runner, granularity: int) -> None:
        self._run = run
        self.g = granularity
        self.trials: list[Trial] = []
        self._seen: dict[int, Outcome] = {}

    def __call__(self, k: int) -> Outcome:
        if k not in self._seen:
            out = self._run(k * self.g)
            out = out if isinstance(out, Outcome) else Outcome(fits=bool(out))
            self._seen[k] = out
            self.trials.append(Trial(value=k * self.g, fits=out.fits, peak=out.peak))
        return self._seen[k]


def _check(granularity: int, upper: int) -> int:
    if granularity < 1:
        raise VramledgerError(f"granularity must be a positive integer (got {granularity})")
    k_max = upper // granularity
    if k_max < 1:
        raise VramledgerError(f"upper bound {upper} is below the granularity {granularity}; raise --max")
    return k_max


def _largest(ok: Callable[[int], bool], lo: int, hi: int) -> int:
    """Largest k in [lo, hi] with ok(k), for monotone ok; lo − 1 when none (a cheap bisection, no trials)."""
    if not ok(lo):
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def find_max(
    run: Runner,
    *,
    predicted: int | None,
    upper: int,
    granularity: int = 1,
    predict: Callable[[int], int] | None = None,
    capacity: int | None = None,
    model_trials: int = 4,
) -> SearchResult:
    """The largest multiple of ``granularity`` in [granularity, upper] that ``run`` says fits.

    ``predicted``: where to start (rounded down to the grid; 0 or None = the bottom). ``predict`` (value →
    predicted bytes) and ``capacity`` (bytes) enable the secant step on measured peaks.
    Example: ``find_max(lambda b: b <= 13, predicted=12, upper=256).best == 13`` in 3 trials (12, 13, 14).
    """
    k_max = _check(granularity, upper)
    g = granularity
    trial = _Runner(run, g)
    lo, hi = 0, k_max + 1  # k = lo ran (0: nothing yet), k = hi failed (k_max + 1: nothing yet)
    cand = min(max((predicted or 0) // g, 1), k_max)
    anchor, d, guided = cand, 1, 0
    secant = predict is not None and capacity is not None
    while hi - lo > 1:
        closed = lo >= 1 and hi <= k_max
        c = (lo + hi) // 2 if closed and guided >= model_trials else min(max(cand, lo + 1), hi - 1)
        guided += 1
        out = trial(c)
        if out.fits:
            lo = c
            if secant and out.peak is not None:
                base = predict(c * g)  # type: ignore[misc]
                peak = out.peak

                def room(k: int, peak: int = peak, base: int = base) -> bool:
                    return peak + predict(k * g) - base <= capacity  # type: ignore[misc,operator]

                guess = _largest(room, c, k_max)
                cand = guess if guess > c else c + 1
                anchor, d = cand, 1
            elif hi <= k_max:
                cand = (lo + hi) // 2
            else:  # gallop up from the anchor: +1, +2, +4, …
                cand, d = anchor + d, d * 2
        else:
            hi = c
            if lo >= 1:
                # A guess that just failed is most often one too far: try below it, else bisect.
                cand = c - 1 if secant and guided <= model_trials else (lo + hi) // 2
            else:  # gallop down from the anchor: −1, −2, −4, …
                cand, d = anchor - d, d * 2
    best = lo
    return SearchResult(
        best=best * g if best >= 1 else None,
        first_fail=hi * g if hi <= k_max else None,
        trials=tuple(trial.trials),
        predicted=predicted,
    )


def find_max_plain(run: Runner, *, upper: int, granularity: int = 1) -> SearchResult:
    """The baseline without a prediction: double from 1 (1, 2, 4, …) until a failure, then bisect.

    What in-process finders do: Lightning's ``BatchSizeFinder`` doubles ("power" mode) then bisects
    ("binsearch"); Accelerate's ``find_executable_batch_size`` halves down from a starting size.
    """
    k_max = _check(granularity, upper)
    trial = _Runner(run, granularity)
    lo, hi = 0, k_max + 1
    c = 1
    while hi - lo > 1:
        if trial(c).fits:
            lo = c
            c = min(2 * c, k_max) if hi == k_max + 1 else (lo + hi) // 2
        else:
            hi = c
            c = (lo + hi) // 2
        if hi - lo > 1:
            c = min(max(c, lo + 1), hi - 1)
    return SearchResult(
        best=lo * granularity if lo >= 1 else None,
        first_fail=hi * granularity if hi <= k_max else None,
        trials=tuple(trial.trials),
    )


# -- the estimator's prediction ------------------------------------------------------------------------------


def with_value(train: TrainSpec, dim: str, value: int) -> TrainSpec:
    """``train`` with its micro-batch (``dim="batch"``) or its sequence length (``dim="seq"``) = ``value``."""
    if dim == "batch":
        return replace(train, micro_batch=value)
    if dim == "seq":
        return replace(train, seq_len=value)
    raise VramledgerError(f"--dim must be batch or seq (got {dim!r})")


def predicted_max(
    device_total: Callable[[TrainSpec], int],
    train: TrainSpec,
    *,
    dim: str,
    capacity: int,
    upper: int,
    granularity: int = 1,
) -> int:
    """The largest grid value whose predicted device total fits in ``capacity`` (0 when none does).

    ``device_total`` is the estimator (e.g. ``lambda t: estimate(model, t).device_total``); it is cheap, so a
    plain bisection over it costs nothing. No headroom here: the search wants the real cliff, not a safe
    point.
    """
    k_max = _check(granularity, upper)
    return granularity * max(
        0, _largest(lambda k: device_total(with_value(train, dim, k * granularity)) <= capacity, 1, k_max)
    )


def value_predictor(device_total: Callable[[TrainSpec], int], train: TrainSpec, dim: str) -> Callable[[int], int]:
    """value → predicted device total, for :func:`find_max`'s secant step."""
    return lambda v: device_total(with_value(train, dim, v))


def estimate_device_total(model: ModelSpec) -> Callable[[TrainSpec], int] | None:
    """``train -> predicted device total`` from ``vramledger.analytic.estimate`` (None if unavailable)."""
    try:
        from vramledger.analytic import estimate
    except ImportError:
        return None
    return lambda t: int(estimate(model, t).device_total)
