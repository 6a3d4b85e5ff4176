"""Speed of the instant path: cold CLI time of `vramledger estimate ... --json`, and 1,000 estimates in-process.

Run: python bench/estimate_bench.py   (targets: cold CLI < 0.3 s; 1,000 estimates < 1 s)

A change made for speed must change no figure: ``bench/estimate_check.py --against OTHER/src`` compares the ledgers
of a few hundred random setups with another checkout's, byte for byte.
"""

from __future__ import annotations

import dataclasses
import statistics
import subprocess
import sys
import time
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")


def cold_cli(runs: int = 11) -> float:
    cmd = [
        sys.executable,
        "-m",
        "vramledger",
        "estimate",
        "llama-3.1-8b",
        "--method",
        "lora",
        "--batch",
        "4",
        "--seq",
        "2048",
        "--gpu",
        "rtx-4090",
        "--json",
    ]
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=False, capture_output=True, env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"})
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def thousand_estimates() -> float:
    sys.path.insert(0, SRC)
    from vramledger.analytic import estimate
    from vramledger.catalog import resolve_gpu, resolve_model
    from vramledger.specs import Method, TrainSpec

    model, gpu = resolve_model("llama-3.1-8b"), resolve_gpu("rtx-4090")
    base = TrainSpec(method=Method.LORA)
    specs = [dataclasses.replace(base, micro_batch=1 + i % 32, seq_len=256 * (1 + i // 32)) for i in range(1000)]
    t0 = time.perf_counter()
    for spec in specs:
        estimate(model, spec, gpu=gpu)
    return time.perf_counter() - t0


if __name__ == "__main__":
    print(f"cold CLI estimate --json (median of 11): {cold_cli():.3f} s")
    print(f"1,000 distinct estimates in one process: {thousand_estimates():.3f} s")
