"""How many real trials find-max needs, seeded with a noisy estimate, vs plain doubling + bisection from 1.

Each simulated configuration has a true memory curve and a GPU capacity; a trial "runs" iff the true peak
fits. The estimator sees the same curve with relative errors drawn from N(0, sigma) on each of its terms
(fixed part: weights and optimizer states; per-sample or per-token part), as an analytic estimate errs.

  batch: peak(b) = F + a·b                      true maximum 1 … 128, step 1
  seq:   peak(s) = F + a·s + q·s² (q > 0: eager) true maximum 512 … 32768 tokens, step 256

Strategies:
  plain    double from 1 until a failure, then bisect (Lightning's BatchSizeFinder: power, then binsearch)
  seeded   start at the estimate's prediction, gallop ±1, ±2, ±4 … then bisect (trials say yes/no only)
  secant   seeded, and each trial that runs reports its measured peak: the next trial goes where the
           estimate's *growth* from that measured point reaches the capacity (what `vramledger find-max` does)
  secant-3% the same, started from the prediction for 97% of the capacity, so the first trial almost
           always runs and yields a measurement

Every search is checked against brute force. Run:  PYTHONPATH=src python bench/find_max_bench.py [--n 2000]
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from vramledger.measure.search import Outcome, find_max, find_max_plain

GIB = 2**30


@dataclass(frozen=True)
class Case:
    true_peak: Callable[[int], float]
    est_peak: Callable[[int], float]
    capacity: float
    upper: int
    granularity: int


def _largest(peak: Callable[[int], float], cap: float, upper: int, g: int) -> int:
    best = 0
    for k in range(1, upper // g + 1):
        if peak(k * g) <= cap:
            best = k * g
        else:
            break
    return best


def batch_case(rng: random.Random, sigma: float) -> Case:
    cap = rng.choice([24, 40, 48, 80, 141]) * GIB
    fixed = rng.uniform(0.1, 0.8) * cap
    true_max = rng.randint(1, 128)
    a = (cap - fixed) / (true_max + rng.uniform(0.0, 0.999))  # true_max fits, true_max + 1 does not
    f_e, a_e = fixed * (1 + rng.gauss(0, sigma)), a * (1 + rng.gauss(0, sigma))
    return Case(lambda b: fixed + a * b, lambda b: f_e + a_e * b, cap, 1024, 1)


def seq_case(rng: random.Random, sigma: float) -> Case:
    cap = rng.choice([24, 40, 48, 80, 141]) * GIB
    fixed = rng.uniform(0.1, 0.8) * cap
    s_star = rng.uniform(512, 32768)
    quad = rng.choice([0.0, 0.0, 0.3, 0.7])  # share of the room taken by s² terms (eager attention scores)
    room = cap - fixed
    q, a = quad * room / s_star**2, (1 - quad) * room / s_star
    f_e, a_e, q_e = (x * (1 + rng.gauss(0, sigma)) for x in (fixed, a, q))
    return Case(lambda s: fixed + a * s + q * s * s, lambda s: f_e + a_e * s + q_e * s * s, cap, 131072, 256)


def trials(case: Case, strategy: str) -> int:
    cap, g, upper = case.capacity, case.granularity, case.upper
    truth = _largest(case.true_peak, cap, upper, g)

    def yes_no(v: int) -> bool:
        return case.true_peak(v) <= cap

    def measured(v: int) -> Outcome:
        p = case.true_peak(v)
        return Outcome(fits=p <= cap, peak=int(p) if p <= cap else None)

    def predict(v: int) -> int:
        return int(case.est_peak(v))

    if strategy == "plain":
        r = find_max_plain(yes_no, upper=upper, granularity=g)
    elif strategy == "seeded":
        r = find_max(yes_no, predicted=_largest(case.est_peak, cap, upper, g), upper=upper, granularity=g)
    else:
        start_cap = cap * (0.97 if strategy == "secant-3%" else 1.0)
        r = find_max(
            measured,
            predicted=_largest(case.est_peak, start_cap, upper, g),
            upper=upper,
            granularity=g,
            predict=predict,
            capacity=int(cap),
        )
    assert (r.best or 0) == truth, (strategy, r, truth)
    return r.n_trials


STRATEGIES = ("plain", "seeded", "secant", "secant-3%")


def run(n: int, seed: int, sigmas: tuple[float, ...]) -> None:
    print(f"{'case':<6}{'sigma':>6}  " + "".join(f"{s + ': median/mean/≤3':>26}" for s in STRATEGIES))
    for name, make in (("batch", batch_case), ("seq", seq_case)):
        for sigma in sigmas:
            rng = random.Random(seed)
            cases = [make(rng, sigma) for _ in range(n)]
            cols = []
            for strategy in STRATEGIES:
                xs = [trials(c, strategy) for c in cases]
                le3 = 100 * sum(1 for x in xs if x <= 3) / len(xs)
                cols.append(f"{statistics.median(xs):g} / {statistics.mean(xs):.2f} / {le3:.0f}%")
            print(f"{name:<6}{sigma:>6.0%}  " + "".join(f"{c:>26}" for c in cols))


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--n", type=int, default=2000, help="simulated configurations per row")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    run(args.n, args.seed, (0.01, 0.02, 0.03, 0.05, 0.10))


if __name__ == "__main__":
    main()
