"""The OOM-cliff search against simulated capacities: always the exact boundary, in few trials."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vramledger.errors import VramledgerError
from vramledger.measure.search import Outcome, find_max, find_max_plain, predicted_max
from vramledger.specs import TrainSpec


def brute_force(fits, upper: int, g: int) -> int | None:  # type: ignore[no-untyped-def]
    best = None
    for v in range(g, upper + 1, g):
        if not fits(v):
            break
        best = v
    return best


@settings(max_examples=300, deadline=None)
@given(
    cap=st.integers(0, 400),
    predicted=st.one_of(st.none(), st.integers(0, 500)),
    upper=st.integers(1, 300),
    g=st.integers(1, 8),
)
def test_seeded_search_equals_brute_force(cap: int, predicted: int | None, upper: int, g: int) -> None:
    if upper < g:
        return
    calls: list[int] = []

    def fits(v: int) -> bool:
        calls.append(v)
        return v <= cap

    r = find_max(fits, predicted=predicted, upper=upper, granularity=g)
    assert r.best == brute_force(lambda v: v <= cap, upper, g)
    assert len(calls) == len(set(calls)) == r.n_trials  # never the same value twice
    assert all(v % g == 0 and g <= v <= upper for v in calls)
    plain = find_max_plain(lambda v: v <= cap, upper=upper, granularity=g)
    assert plain.best == r.best


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(st.integers(1, 50), min_size=1, max_size=120),
    cap=st.integers(0, 3000),
    fixed=st.integers(0, 2000),
    slope_err=st.floats(-0.3, 0.3),
    fixed_err=st.integers(-500, 500),
)
def test_secant_search_equals_brute_force_on_any_increasing_curve(
    steps: list[int], cap: int, fixed: int, slope_err: float, fixed_err: int
) -> None:
    # True memory: any increasing curve; the predictor: a wrong straight line.
    curve = [fixed]
    for s in steps:
        curve.append(curve[-1] + s)
    upper = len(curve) - 1

    def run(v: int) -> Outcome:
        ok = curve[v] <= cap
        return Outcome(fits=ok, peak=curve[v] if ok else None)

    mean_step = (curve[-1] - fixed) / upper

    def predict(v: int) -> int:
        return int(fixed + fixed_err + v * mean_step * (1 + slope_err))

    start = predicted_max(lambda t: predict(t.micro_batch), TrainSpec(), dim="batch", capacity=cap, upper=upper)
    r = find_max(run, predicted=start, upper=upper, predict=predict, capacity=cap)
    assert r.best == brute_force(lambda v: curve[v] <= cap, upper, 1)


@pytest.mark.parametrize(
    ("cap", "trials"),
    [
        (12, [12, 13]),  # right: it runs, the next does not
        (13, [12, 13, 14]),  # one low
        (11, [12, 11]),  # one high
        (14, [12, 13, 14, 16, 15]),  # gallop +1, +2, +4, then bisect
    ],
    ids=["exact", "one-low", "one-high", "three-low"],
)
def test_trials_from_a_prediction_of_12(cap: int, trials: list[int]) -> None:
    r = find_max(lambda b: b <= cap, predicted=12, upper=256)
    assert [t.value for t in r.trials] == trials
    assert r.best == cap and r.first_fail == cap + 1


def test_secant_step_lands_on_the_answer() -> None:
    # True peak 50 + 1.3·b ≤ 100 → b ≤ 38; the estimate (45 + 1.35·b) is off in both terms. After the first
    # trial measures 89 at b = 30, 89 + 1.35·(b − 30) ≤ 100 gives b = 38: the next trial is the answer.
    def run(b: int) -> Outcome:
        p = 50 + 1.3 * b
        return Outcome(fits=p <= 100, peak=int(p) if p <= 100 else None)

    r = find_max(run, predicted=30, upper=1024, predict=lambda b: int(45 + 1.35 * b), capacity=100)
    assert [(t.value, t.fits) for t in r.trials] == [(30, True), (38, True), (39, False)]


def test_nothing_fits_and_everything_fits() -> None:
    none = find_max(lambda b: False, predicted=3, upper=64)
    assert none.best is None and none.first_fail == 1
    allfit = find_max(lambda b: True, predicted=3, upper=64)
    assert allfit.best == 64 and allfit.first_fail is None


def test_plain_search_doubles_then_bisects() -> None:
    r = find_max_plain(lambda b: b <= 12, upper=256)
    assert [t.value for t in r.trials] == [1, 2, 4, 8, 16, 12, 14, 13]


def test_bad_bounds_are_user_errors() -> None:
    with pytest.raises(VramledgerError, match="upper bound 100 is below the granularity 256"):
        find_max(lambda s: True, predicted=0, upper=100, granularity=256)
    with pytest.raises(VramledgerError, match="granularity must be a positive integer"):
        find_max_plain(lambda s: True, upper=100, granularity=0)
