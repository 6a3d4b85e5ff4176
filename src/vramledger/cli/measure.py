"""`vramledger measure`: real training steps on this GPU, the measured ledger beside the estimate."""

from __future__ import annotations

import argparse
import json

from vramledger.cli.args import count, out_path, real
from vramledger.cli.common import (
    add_force_option,
    add_gpu_options,
    add_model_options,
    add_train_options,
    resolve_inputs,
)
from vramledger.errors import EXIT_NO, EXIT_OK, EXIT_UNEXPECTED, VramledgerError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "measure",
        help="measure a training step on this GPU (random weights, no download) beside the estimate",
        description="Builds the model from its config with random weights on the GPU, runs real training "
        "steps in a fresh process, and prints peak allocated / reserved / device memory per phase beside the "
        "estimate.",
    )
    add_model_options(p)
    add_train_options(p)
    add_gpu_options(p)
    add_trial_options(p)
    p.add_argument(
        "--snapshot", type=out_path, help="also write a CUDA memory snapshot (pickle for pytorch.org/memory_viz)"
    )
    add_force_option(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=_run)


def add_trial_options(p: argparse.ArgumentParser) -> None:
    from vramledger.measure.harness import DEFAULT_STEPS, DEFAULT_TIMEOUT_S

    g = p.add_argument_group("trials")
    g.add_argument(
        "--steps",
        type=count(hi=10_000, what="step count"),
        default=DEFAULT_STEPS,
        help=f"optimizer steps per trial (default {DEFAULT_STEPS})",
    )
    g.add_argument(
        "--timeout",
        type=real(0, 86_400, lo_open=True, what="number of seconds"),
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds per trial (default {DEFAULT_TIMEOUT_S:g})",
    )


def _run(args: argparse.Namespace) -> int:
    from vramledger.measure.harness import measure, require_gpu
    from vramledger.measure.results import predictions

    inputs = resolve_inputs(args)
    require_gpu()
    m = measure(inputs.model, inputs.train, steps=args.steps, snapshot=args.snapshot, timeout_s=args.timeout)
    if not m.result.ok or m.ledger is None:
        if m.result.status == "oom":
            raise VramledgerError(
                f"measure: the step does not fit on this GPU ({m.result.error}); try `vramledger find-max` for the "
                "largest batch that does",
                exit_code=EXIT_NO,
            )
        raise VramledgerError(f"measure: trial {m.result.status}: {m.result.error}", exit_code=EXIT_UNEXPECTED)
    preds, notes = predictions(inputs.model, inputs.train, gpu=inputs.gpu, headroom=inputs.headroom)
    if args.json:
        from vramledger.report.measure_view import measure_to_dict

        print(json.dumps(measure_to_dict(m.ledger, m.result.raw, preds, notes), indent=2, default=str))
    else:
        from vramledger.report.measure_view import render_measure

        print(render_measure(inputs.model, inputs.train, m.ledger, m.result.raw, preds, notes, steps=args.steps))
    return EXIT_OK
