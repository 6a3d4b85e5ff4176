"""`vramledger find-max`: the largest micro-batch or sequence length that runs on this GPU, by real trials."""

from __future__ import annotations

import argparse
import sys

from vramledger.cli.args import MAX_BATCH, MAX_TOKENS, count, real, tokens
from vramledger.cli.common import add_gpu_options, add_model_options, add_train_options, resolve_inputs
from vramledger.cli.measure import add_trial_options
from vramledger.errors import EXIT_NO, VramledgerError


def register(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument(
        "--granularity",
        type=count(hi=MAX_BATCH, what="step"),
        help="step of the search (default 1 for batch, 256 for seq)",
    )
    p.add_argument(
        "--max",
        dest="upper",
        type=tokens(what="bound"),
        help="upper bound (default 1024 for batch; the model's context for seq)",
    )
    p.add_argument(
        "--predicted",
        type=count(hi=MAX_TOKENS, what="value"),
        help="start from this value instead of the estimate's prediction",
    )
    p.add_argument(
        "--margin",
        type=real(0.0, 0.5, hi_open=True, what="fraction"),
        default=0.03,
        help="start from the prediction for this fraction less memory, so that the first trial runs and "
        "is measured (default 0.03)",
    )
    p.set_defaults(run=_run)


def _probe_capacity(timeout_s: float) -> int:
    """The GPU's total memory, read by a worker process (this process never creates a CUDA context)."""
    from vramledger.measure.harness import run_worker

    res = run_worker({"probe_only": True}, timeout_s=timeout_s)
    total = res.raw.get("environment", {}).get("gpu_total_bytes")
    if not total:
        raise VramledgerError(f"find-max: could not read the GPU's memory ({res.status}: {res.error})", exit_code=1)
    return int(total)


def _run(args: argparse.Namespace) -> int:
    from vramledger.measure.harness import measure, require_gpu
    from vramledger.measure.search import (
        Outcome,
        estimate_device_total,
        find_max,
        find_max_plain,
        predicted_max,
        value_predictor,
        with_value,
    )
    from vramledger.units import fmt_bytes

    inputs = resolve_inputs(args)
    require_gpu("find-max")
    if not 0.0 <= args.margin < 0.5:
        raise VramledgerError(f"--margin must be a fraction in [0, 0.5) (got {args.margin}); e.g. --margin 0.03")
    dim = args.dim
    g = args.granularity or (1 if dim == "batch" else 256)
    upper = args.upper or (1024 if dim == "batch" else (inputs.model.max_position_embeddings or 131072))
    capacity = _probe_capacity(args.timeout)
    device_total = estimate_device_total(inputs.model)
    predicted = args.predicted
    source = "--predicted"
    if predicted is None:
        if device_total is None:
            source = "none (no estimator available: plain search from 1)"
        else:
            start_cap = int(capacity * (1.0 - args.margin))
            predicted = predicted_max(
                device_total, inputs.train, dim=dim, capacity=start_cap, upper=upper, granularity=g
            )
            source = f"the estimate for {fmt_bytes(start_cap)}, {args.margin:.0%} below the GPU's {fmt_bytes(capacity)}"
    unit = "batch" if dim == "batch" else "tokens"
    print(f"{inputs.model.name}: searching the largest {dim} that runs; starting at {predicted} from {source}")

    def run(value: int) -> Outcome:
        m = measure(inputs.model, with_value(inputs.train, dim, value), steps=args.steps, timeout_s=args.timeout)
        ok = m.result.fits
        peak = None
        if m.ledger is not None:
            has_device = m.result.raw.get("phases", {}) and all(
                f.get("device") is not None for f in m.result.raw["phases"].values()
            )
            peak = m.ledger.device_total if has_device else None
        shown = f" (device total {fmt_bytes(peak)})" if peak is not None else ""
        print(f"  trial: {unit} {value}: {'runs' + shown if ok else 'out of memory'}")
        sys.stdout.flush()
        return Outcome(fits=ok, peak=peak)

    if predicted is None:
        res = find_max_plain(run, upper=upper, granularity=g)
    else:
        res = find_max(
            run,
            predicted=predicted,
            upper=upper,
            granularity=g,
            predict=value_predictor(device_total, inputs.train, dim) if device_total else None,
            capacity=capacity,
        )
    if res.best is None:
        print(f"even {dim} {g} does not fit ({res.n_trials} trials)")
        return EXIT_NO
    tail = f"; {res.first_fail} does not" if res.first_fail else f" (the upper bound {upper})"
    print(f"largest {dim} that runs: {res.best}{tail} — {res.n_trials} trials")
    return 0
