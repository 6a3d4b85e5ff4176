"""The replay half of `bench/simulate_bench.py` alone, on templates traced once and kept in a pickle.

The trace of Llama-3-8B LoRA takes minutes on a shared CPU; the replay is what changes when the allocator model
or the Replayer does. This traces the bench's setup once (``--templates FILE``: written when absent, read when
present), then times the runs and prints a digest of every run's per-step series, so that a faster replay can
be checked to give byte-identical results (same digest before and after).

    PYTHONPATH=src nice -n 10 python bench/simulate_replay_bench.py --templates /tmp/tpl8b.pkl [--profile N]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import pickle
import time
from pathlib import Path

from simulate_bench import STATS, TRAIN

from vramledger.allocator.conf import DEFAULT_CONF, AllocatorConf, parse_alloc_conf
from vramledger.catalog import resolve_gpu, resolve_model
from vramledger.simulate.api import Simulation, make_templates, simulate
from vramledger.simulate.lengths import read_lengths
from vramledger.simulate.schedule import RunSpec
from vramledger.simulate.templates import StepTemplates
from vramledger.units import fmt_bytes

RUNS = {
    "1k": ("1,000 steps", 1000, 1),
    "10k": ("10,000 steps", 10000, 1),
    "mc": ("1,000 steps x 10 shuffles", 1000, 10),
}


def load_templates(path: Path) -> StepTemplates:
    """The bench's templates from ``path``, traced and written there first when it does not exist."""
    if path.exists():
        with path.open("rb") as f:
            templates: StepTemplates = pickle.load(f)
        return templates
    base = RunSpec(cutoff=4096, steps=1000, eval_every=100, eval_batches=4)
    templates = make_templates(resolve_model("llama-3-8b"), TRAIN, base, eval_batch=8)
    with path.open("xb") as f:
        pickle.dump(templates, f)
    return templates


def digest(sim: Simulation) -> str:
    """sha256 of everything the simulation reports (its points, OOM, high-water mark, OOM steps ...) but how
    many steps were replayed or memoised."""
    h = hashlib.sha256(repr(dataclasses.replace(sim, replays=0, memo_hits=0)).encode())
    return h.hexdigest()[:16]


def run(
    templates: StepTemplates, steps: int, shuffles: int, gpu: str = "h100-sxm", conf: AllocatorConf = DEFAULT_CONF
) -> Simulation:
    spec = RunSpec(cutoff=4096, steps=steps, eval_every=100, eval_batches=4)
    lengths = read_lengths(STATS, n=steps * TRAIN.micro_batch, seed=0)
    return simulate(templates, lengths, spec, gpu=resolve_gpu(gpu), conf=conf, seed=0, shuffles=shuffles)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--templates", type=Path, required=True, help="pickle of the traced templates (made if absent)")
    ap.add_argument("--runs", default="1k,10k", help="comma-separated: 1k, 10k, mc (default 1k,10k)")
    ap.add_argument("--gpu", default="h100-sxm", help="a smaller one (rtx-4090) makes the runs fail: the OOM path")
    ap.add_argument("--alloc-conf", default="", help="PYTORCH_CUDA_ALLOC_CONF for the runs (default: torch's)")
    ap.add_argument("--profile", type=int, metavar="N", help="cProfile the 1,000-step run; print the top N")
    args = ap.parse_args()
    templates = load_templates(args.templates)
    conf = parse_alloc_conf(args.alloc_conf) if args.alloc_conf else DEFAULT_CONF
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.runcall(run, templates, 1000, 1, args.gpu, conf)
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
        return
    print(f"{'run':<34} {'wall s':>7} {'replayed':>9} {'memoised':>9} {'high-water':>11}  {'OOM':<18} digest")
    for name in args.runs.split(","):
        label, steps, shuffles = RUNS[name]
        t0 = time.perf_counter()
        sim = run(templates, steps, shuffles, args.gpu, conf)
        wall = time.perf_counter() - t0
        oom = "none" if sim.run.oom_step is None else f"step {sim.run.oom_step}"
        print(
            f"{label:<34} {wall:>7.2f} {sim.replays:>9} {sim.memo_hits:>9} "
            f"{fmt_bytes(sim.run.high_water_reserved_bytes):>11}  {oom + f', P(OOM) {sim.oom_probability:.0%}':<18} "
            f"{digest(sim)}"
        )


if __name__ == "__main__":
    main()
