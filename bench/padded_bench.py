"""The cost of a padded run's replayed envelope (analytic/reserve/runs.py ``replayed_envelope``): full fine-tuning
without checkpointing, where a run with dynamic padding searches the replays of the shapes it meets.

Three figures, each in a fresh process (nothing cached from another): a 64 × 64 batch × length frontier (lengths
128 … 8192) of Qwen2.5-0.5B, Qwen3-0.6B and Llama-3.2-1B, bf16-true, on an H100 (bench/plan_bench.py's search);
200 random such setups (those three and Qwen2.5-1.5B; bf16-true, bf16-mixed, fp32; batch 1-8, length 128-4096);
``vramledger plan qwen3-0.6b --method full --preset none --gpu h100-sxm``. Each line gives wall and CPU seconds (the
machine is shared: CPU seconds vary less) and a digest of what was computed (a frontier's points, the 200 ledgers,
the plan's text).

    PYTHONPATH=src python bench/padded_bench.py                            # this checkout, once each
    PYTHONPATH=src python bench/padded_bench.py --against OTHER/src -n 3   # alternately with another checkout's

A speed change must change no figure: the digests must agree, and ``bench/estimate_check.py --against OTHER/src``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import subprocess
import sys
import time
from pathlib import Path

MODELS = ("qwen2.5-0.5b", "qwen3-0.6b", "llama-3.2-1b")
CASES = (*(f"frontier:{name}" for name in MODELS), "random", "plan")
SRC = Path(__file__).resolve().parents[1] / "src"


def frontier_case(name: str) -> tuple[float, str]:
    """Seconds for the 64 × 64 frontier of ``name`` and a digest of its points."""
    from vramledger.catalog import resolve_gpu, resolve_model
    from vramledger.plan.frontier import frontier
    from vramledger.specs import Method, Precision, TrainSpec

    train = TrainSpec(method=Method.FULL, grad_ckpt=False, precision=Precision.BF16)
    m, gpu = resolve_model(name), resolve_gpu("h100-sxm")
    t0 = time.perf_counter()
    f = frontier(m, train, gpu, 0.08, max_batch=64, granularity=128, max_len=64 * 128)
    seconds = time.perf_counter() - t0
    points = ";".join(f"{p.micro_batch},{p.seq_len},{p.device_total}" for p in f.points)
    return seconds, hashlib.sha256(points.encode()).hexdigest()[:12]


def random_setups(count: int = 200, seed: int = 0) -> tuple[float, str]:
    """Seconds for ``count`` random estimates of full fine-tuning without checkpointing, and a digest of their ledgers
    (``--json``'s text)."""
    from vramledger.analytic import estimate
    from vramledger.catalog import resolve_gpu, resolve_model
    from vramledger.specs import Method, Precision, TrainSpec

    rng = random.Random(seed)
    gpu = resolve_gpu("h100-sxm")
    setups = []
    for _ in range(count):
        m = resolve_model(rng.choice((*MODELS, "qwen2.5-1.5b")))
        precision = Precision(rng.choice(("bf16-true", "bf16-mixed", "fp32")))
        batch, length = rng.randint(1, 8), int(2 ** rng.uniform(7, 12))
        train = TrainSpec(method=Method.FULL, grad_ckpt=False, precision=precision, micro_batch=batch, seq_len=length)
        setups.append((m, train))
    t0 = time.perf_counter()
    ledgers = [estimate(m, train, gpu=gpu) for m, train in setups]
    seconds = time.perf_counter() - t0
    from vramledger.report.json_out import dumps

    return seconds, hashlib.sha256("\n".join(map(dumps, ledgers)).encode()).hexdigest()[:12]


def plan_cli() -> tuple[float, str]:
    """Seconds for ``vramledger plan qwen3-0.6b --method full --preset none`` (a process of its own) and a digest of
    its output."""
    args = ["plan", "qwen3-0.6b", "--method", "full", "--preset", "none", "--gpu", "h100-sxm"]
    cmd = [sys.executable, "-m", "vramledger", *args]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return time.perf_counter() - t0, hashlib.sha256(out.encode()).hexdigest()[:12]


def run_case(case: str) -> None:
    """One case in this process: prints wall seconds, CPU seconds and the digest."""
    if case.startswith("frontier:"):
        seconds, digest = frontier_case(case.split(":", 1)[1])
    elif case == "random":
        seconds, digest = random_setups()
    else:
        seconds, digest = plan_cli()
    cpu = time.process_time() + (os.times().children_user + os.times().children_system)
    print(f"{seconds:.2f} {cpu:.2f} {digest}")


def in_process(src: Path, case: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, __file__, "--case", case]
    return subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", help="run one case in this process (used by the driver)")
    ap.add_argument("--against", type=Path, help="another checkout's src, run alternately with this one's")
    ap.add_argument("-n", type=int, default=1, help="runs of each case and checkout (default 1)")
    ap.add_argument("--only", nargs="*", default=list(CASES), help=f"cases (default: {' '.join(CASES)})")
    args = ap.parse_args()
    if args.case:
        run_case(args.case)
        return
    sides = [("this", SRC)] + ([("other", args.against)] if args.against else [])
    for case in args.only:
        for i in range(args.n):
            for side, src in sides[:: 1 if i % 2 == 0 else -1]:  # alternate which goes first
                wall, cpu, digest = in_process(src, case).split()
                print(f"{case:24s} {side:5s} run {i + 1}: {wall} s wall, {cpu} s CPU, digest {digest}", flush=True)


if __name__ == "__main__":
    main()
