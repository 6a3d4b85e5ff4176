"""`vramledger accum-check`: is gradient accumulation the same as a large batch, and is my loop right?

Without ``--script``: the equivalence experiment (``vramledger.accum.equivalence``) on a tiny model, on CPU.
With ``--script train.py``: a static check of the script's accumulation loops
(``vramledger.accum.script_check``); exit 3 on findings, 0 when clean, 2 when unreadable or unparsable
(the exit codes of every command: ``vramledger.errors``).
"""

from __future__ import annotations

import argparse
import json

from vramledger.errors import EXIT_NO, EXIT_OK, VramledgerError

MAX_MICRO_BATCHES = 64
"""The experiment runs one backward per micro-batch on CPU: its time grows with the count."""


def register(sub: argparse._SubParsersAction) -> None:
    from vramledger.cli.args import MAX_SEED, count, in_path

    p = sub.add_parser(
        "accum-check",
        help="gradient accumulation vs one large batch (experiment), or check a training script's loop",
        description=(
            "Without --script: compare, on a tiny random Llama on CPU, the gradient of one large batch with "
            "accumulated micro-batch gradients under (a) the mean of per-micro-batch mean losses and (b) "
            "token losses summed and divided by the global target-token count (transformers' "
            "num_items_in_batch). With --script FILE: read the script (without running it) and point at a "
            "scheduler stepped per micro-batch, an unscaled loss, or zero_grad inside the accumulation loop."
        ),
    )
    p.add_argument("--script", metavar="FILE", type=in_path, help="training script to check statically (never run)")
    p.add_argument(
        "--micro-batches",
        type=count(1, MAX_MICRO_BATCHES, what="count"),
        default=4,
        metavar="N",
        help=f"accumulation steps (default 4, at most {MAX_MICRO_BATCHES})",
    )
    p.add_argument(
        "--seed", type=count(0, MAX_SEED, what="seed"), default=0, help="seed for the weights and the synthetic data"
    )
    p.add_argument("--dtype", choices=("fp32", "fp64"), default="fp32", help="compute dtype (default fp32)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    if args.script is not None:
        return _run_script(args)
    from vramledger.accum.equivalence import EquivalenceConfig, run_equivalence

    result = run_equivalence(EquivalenceConfig(micro_batches=args.micro_batches, seed=args.seed, dtype=args.dtype))
    if args.json:
        from vramledger.report.accum_view import equivalence_to_dict

        print(json.dumps(equivalence_to_dict(result), indent=2))
    else:
        from vramledger.report.accum_view import render_equivalence

        print(render_equivalence(result))
    return EXIT_OK


def _run_script(args: argparse.Namespace) -> int:
    from vramledger.accum.script_check import check_script
    from vramledger.userfiles import MAX_SCRIPT_BYTES, read_text

    read_text(args.script, "--script", max_bytes=MAX_SCRIPT_BYTES)  # a regular file of sane size, readable
    try:
        report = check_script(args.script)
    except (RecursionError, MemoryError):
        raise VramledgerError(
            f"--script: {args.script} holds an expression nested too deeply to check; simplify it"
        ) from None
    if args.json:
        from vramledger.report.accum_view import script_report_to_dict

        print(json.dumps(script_report_to_dict(report), indent=2))
    else:
        from vramledger.report.accum_view import render_script_report

        print(render_script_report(report))
    return EXIT_OK if report.clean else EXIT_NO
