"""Speed of `vramledger simulate` on an 8B LoRA shape: one trace, then 1,000 and 10,000 steps and a Monte Carlo.

Llama-3-8B, LoRA r16 on all linear layers, bf16 autocast, AdamW (foreach), sdpa, gradient checkpointing,
micro-batch 4, cutoff 4096, sample lengths drawn from a log-normal (p50 600, p99 3000), evaluation every 100
steps (4 batches of 8), on an 80 GB H100. The trace is timed apart: it is paid once per model and setup.

    PYTHONPATH=src nice -n 10 python bench/simulate_bench.py [--png DIR]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from vramledger.allocator.conf import DEFAULT_CONF
from vramledger.catalog import resolve_gpu, resolve_model
from vramledger.simulate.api import make_templates, simulate
from vramledger.simulate.lengths import read_lengths
from vramledger.simulate.schedule import RunSpec
from vramledger.specs import LoraSpec, Method, TrainSpec
from vramledger.units import fmt_bytes

TRAIN = TrainSpec(method=Method.LORA, micro_batch=4, seq_len=4096, grad_ckpt=True, lora=LoraSpec(rank=16))
STATS = "800,600,3000,4096"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--png", type=Path, help="write the figure of the 1,000-step run into this folder")
    args = ap.parse_args()
    model, gpu = resolve_model("llama-3-8b"), resolve_gpu("h100-sxm")
    base = RunSpec(cutoff=4096, steps=1000, eval_every=100, eval_batches=4)
    t0 = time.perf_counter()
    templates = make_templates(model, TRAIN, base, eval_batch=8)
    trace_s = time.perf_counter() - t0
    events = len(templates.fb.kinds)
    print(f"trace once (imports included): {trace_s:.1f} s; {events} events per step at any length")
    print(f"{'run':<34} {'wall s':>7} {'replayed':>9} {'memoised':>9} {'high-water':>11}  OOM")
    sims = {}
    for label, steps, shuffles in (
        ("1,000 steps", 1000, 1),
        ("10,000 steps", 10000, 1),
        ("1,000 steps x 10 shuffles", 1000, 10),
    ):
        spec = RunSpec(cutoff=4096, steps=steps, eval_every=100, eval_batches=4)
        lengths = read_lengths(STATS, n=steps * TRAIN.micro_batch, seed=0)
        t0 = time.perf_counter()
        sim = simulate(templates, lengths, spec, gpu=gpu, conf=DEFAULT_CONF, seed=0, shuffles=shuffles)
        wall = time.perf_counter() - t0
        sims[label] = sim
        oom = "none" if sim.run.oom_step is None else f"step {sim.run.oom_step}"
        print(
            f"{label:<34} {wall:>7.2f} {sim.replays:>9} {sim.memo_hits:>9} "
            f"{fmt_bytes(sim.run.high_water_reserved_bytes):>11}  {oom}, P(OOM) {sim.oom_probability:.0%}"
        )
    if args.png is not None:
        from vramledger.report.simulate_view import write_simulation_png

        print("wrote", write_simulation_png(args.png / "simulate_bench.png", sims["1,000 steps"]))


if __name__ == "__main__":
    main()
