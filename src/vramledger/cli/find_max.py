"""`vramledger find-max`: the largest micro-batch or sequence length that runs on this GPU, by real trials."""

from __future__ import annotations

import argparse
import sys

from vramledger.cli.common import add_gpu_options, add_model_options, add_train_options, resolve_inputs
from vramledger.cli.measure import add_trial_options
from vramledger.errors import VramledgerError


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "find-max",
        help="find the largest batch or length that runs on this GPU (real trials, seeded by the estimate)",
        description="Runs real training steps, each in a fresh process, starting from the estimate's "
        "predicted maximum and its neighbours, then bisecting; prints the answer and the number of trials.",
    )
    add_model_options(p)
    add_train_options(p)
    add_gpu_options(p)
    add_trial_options(p)
    p.add_argument("--dim", choices=("batch", "seq"), default="batch", help="what to grow (default batch)")
    p.add_argument("--granularity", type=int, help="step of the search (default 1 for batch, 256 for seq)")
    p.add_argument(
        "--max",
        dest="upper",
        type=int,
        help="upper bound (default 1024 for batch; the model's context for seq)",
    )
    p.add_argument("--predicted", type=int, help="start from this value instead of the estimate's prediction")
    p.set_defaults(run=_run)


def _probe_capacity(timeout_s: float) -> int:
    """The GPU's total memory, read by a worker process (this process never creates a CUDA context)."""
    from vramledger.measure.harness import run_worker

    res = run_worker({"probe_only": True}, timeout_s=timeout_s)
    total = res.raw.get("environment", {}).get("gpu_total_bytes")
    if not total:
        raise VramledgerError(
            f"find-max: could not read the GPU's memory ({res.status}: {res.error})", exit_code=1
        )
    return int(total)


def _run(args: argparse.Namespace) -> int:
    from vramledger.measure.harness import measure, require_gpu
    from vramledger.measure.search import (
        estimate_device_total,
        find_max,
        find_max_plain,
        predicted_max,
        with_value,
    )
    from vramledger.units import fmt_bytes

    inputs = resolve_inputs(args)
    require_gpu("find-max")
    dim = args.dim
    g = args.granularity or (1 if dim == "batch" else 256)
    upper = args.upper or (1024 if dim == "batch" else (inputs.model.max_position_embeddings or 131072))
    predicted = args.predicted
    source = "--predicted"
    if predicted is None:
        device_total = estimate_device_total(inputs.model)
        if device_total is None:
            source = "none (no estimator available: plain search from 1)"
        else:
            capacity = inputs.gpu.memory_bytes if inputs.gpu else _probe_capacity(args.timeout)
            predicted = predicted_max(
                device_total, inputs.train, dim=dim, capacity=capacity, upper=upper, granularity=g
            )
            source = f"estimate (capacity {fmt_bytes(capacity)})"
    unit = "batch" if dim == "batch" else "tokens"
    print(f"{inputs.model.name}: searching the largest {dim} that runs; prediction {predicted} from {source}")

    def fits(value: int) -> bool:
        m = measure(
            inputs.model, with_value(inputs.train, dim, value), steps=args.steps, timeout_s=args.timeout
        )
        ok = m.result.fits
        peak = f" (peak allocated {fmt_bytes(m.ledger.peak_allocated)})" if m.ledger else ""
        print(f"  trial: {unit} {value}: {'runs' + peak if ok else 'out of memory'}")
        sys.stdout.flush()
        return ok

    if predicted is None:
        res = find_max_plain(fits, upper=upper, granularity=g)
    else:
        res = find_max(fits, predicted=predicted, upper=upper, granularity=g)
    if res.best is None:
        print(f"even {dim} {g} does not fit ({res.n_trials} trials)")
        return 1
    tail = f"; {res.first_fail} does not" if res.first_fail else f" (the upper bound {upper})"
    print(f"largest {dim} that runs: {res.best}{tail} — {res.n_trials} trials")
    return 0
