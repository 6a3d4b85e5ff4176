"""Find the OOM cliff: the largest micro-batch (or sequence length) that runs, in few real trials.

The search works on an integer grid ``value = k × granularity`` (k ≥ 1) and assumes that memory grows with the
value, so that "fits" is monotone: if k fits, every smaller k fits. It starts from the estimator's prediction
and probes its neighbour: when the prediction is right, two trials prove it (k fits, k + 1 does not); when it
is one off, three. Further off, the probes gallop away from it (k ± 1, ± 2, ± 4, ± 8, …) until the answer is
bracketed, then bisect inside the bracket, so the number of trials grows with log2 of the prediction's error,
not of the answer.

The trial runner is injected (a ``Callable[[int], bool]`` on values), so the search runs against a simulated
capacity in the tests and the benchmark, and against real worker processes in ``vramledger find-max``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from vramledger.errors import VramledgerError
from vramledger.specs import ModelSpec, TrainSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class Trial:
    value: int
    """The batch size or sequence length tried."""
    fits: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchResult:
    best: int | None
    """The largest value that ran (None when even the smallest did not)."""
    first_fail: int | None
    """The smallest value that failed (None when none failed up to the upper bound)."""
    trials: tuple[Trial, ...]
    """Every trial run, in order (never the same value twice)."""
    predicted: int | None = None
    """The prediction the search started from (None for the plain search)."""

    @property
    def n_trials(self) -> int:
        return len(self.trials)


class _Runner:
    """Caches trials by value, so a value is never run twice, and records the order."""

    def __init__(self, fits: Callable[[int], bool], granularity: int) -> None:
        self._fits = fits
        self.g = granularity
        self.trials: list[Trial] = []
        self._seen: dict[int, bool] = {}

    def __call__(self, k: int) -> bool:
        if k not in self._seen:
            ok = bool(self._fits(k * self.g))
            self._seen[k] = ok
            self.trials.append(Trial(value=k * self.g, fits=ok))
        return self._seen[k]


def _bisect(run: _Runner, lo: int, hi: int) -> int:
    """Largest k in [lo, hi) that fits, given that lo fits (or lo == 0) and hi does not."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if run(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _result(run: _Runner, best_k: int, k_max: int, predicted: int | None) -> SearchResult:
    fails = [t.value for t in run.trials if not t.fits]
    return SearchResult(
        best=best_k * run.g if best_k >= 1 else None,
        first_fail=(best_k + 1) * run.g if best_k < k_max else (min(fails) if fails else None),
        trials=tuple(run.trials),
        predicted=predicted,
    )


def _check(granularity: int, upper: int) -> int:
    if granularity < 1:
        raise VramledgerError(f"granularity must be a positive integer (got {granularity})")
    k_max = upper // granularity
    if k_max < 1:
        raise VramledgerError(f"upper bound {upper} is below the granularity {granularity}; raise --max")
    return k_max


def _offsets() -> Iterator[int]:
    """Distances from the prediction probed in turn: 1, 2, 4, 8, …"""
    d = 1
    while True:
        yield d
        d *= 2


def find_max(
    fits: Callable[[int], bool], *, predicted: int | None, upper: int, granularity: int = 1
) -> SearchResult:
    """The largest multiple of ``granularity`` in [granularity, upper] for which ``fits`` holds.

    ``predicted`` is the estimator's answer (rounded down to the grid; 0 or None means "start at the bottom").
    Example: ``find_max(lambda b: b <= 13, predicted=12, upper=256).best == 13`` in 3 trials (12, 13, 14).
    """
    k_max = _check(granularity, upper)
    run = _Runner(fits, granularity)
    k = min(max((predicted or 0) // granularity, 1), k_max)
    offsets = _offsets()
    if run(k):
        lo = k
        while True:  # gallop up: k+1, k+2, k+4, k+8, … until a failure or the upper bound
            nxt = min(k + next(offsets), k_max)
            if nxt == lo:
                return _result(run, lo, k_max, predicted)
            if not run(nxt):
                return _result(run, _bisect(run, lo, nxt), k_max, predicted)
            lo = nxt
    hi = k
    while True:  # gallop down: k-1, k-2, k-4, k-8, … until a success or the bottom
        nxt = max(k - next(offsets), 1)
        if nxt == hi:
            return _result(run, 0, k_max, predicted)
        if run(nxt):
            return _result(run, _bisect(run, nxt, hi), k_max, predicted)
        hi = nxt


def find_max_plain(fits: Callable[[int], bool], *, upper: int, granularity: int = 1) -> SearchResult:
    """The baseline without a prediction: double from 1 (1, 2, 4, …) until a failure, then bisect.

    This is what in-process finders do (Lightning's ``BatchSizeFinder`` in its default "power" mode, then a
    binary search; Accelerate's ``find_executable_batch_size`` halves from a start instead).
    """
    k_max = _check(granularity, upper)
    run = _Runner(fits, granularity)
    if not run(1):
        return _result(run, 0, k_max, None)
    lo = 1
    while lo < k_max:
        nxt = min(2 * lo, k_max)
        if not run(nxt):
            return _result(run, _bisect(run, lo, nxt), k_max, None)
        lo = nxt
    return _result(run, lo, k_max, None)


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
    return (
        find_max_plain(
            lambda v: device_total(with_value(train, dim, v)) <= capacity,
            upper=k_max * granularity,
            granularity=granularity,
        ).best
        or 0
    )


def estimate_device_total(model: ModelSpec) -> Callable[[TrainSpec], int] | None:
    """``train -> predicted device total`` from ``vramledger.analytic.estimate`` (None if unavailable)."""
    try:
        from vramledger.analytic import estimate  # type: ignore[attr-defined]
    except ImportError:
        return None
    return lambda t: int(estimate(model, t).device_total)
