"""`vramledger accum-check`: is gradient accumulation the same as a large batch, and is my loop right?

Without ``--script``: the equivalence experiment (``vramledger.accum.equivalence``) on a tiny model, on CPU.
With ``--script train.py``: a static check of the script's accumulation loops
(``vramledger.accum.script_check``); exit 1 on findings, 0 when clean, 2 when unreadable or unparsable.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
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
    p.add_argument("--script", metavar="FILE", help="training script to check statically (never run)")
    p.add_argument("--micro-batches", type=int, default=4, metavar="N", help="accumulation steps (default 4)")
    p.add_argument("--seed", type=int, default=0, help="seed for the weights and the synthetic data")
    p.add_argument("--dtype", choices=("fp32", "fp64"), default="fp32", help="compute dtype (default fp32)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    if args.script is not None:
        return _run_script(args)
    from vramledger.accum.equivalence import EquivalenceConfig, run_equivalence

    result = run_equivalence(
        EquivalenceConfig(micro_batches=args.micro_batches, seed=args.seed, dtype=args.dtype)
    )
    if args.json:
        out: dict[str, Any] = dataclasses.asdict(result)
        out["total_target_tokens"] = result.total_target_tokens
        print(json.dumps(out, indent=2))
        return 0
    _print_equivalence(result)
    return 0


def _print_equivalence(r: Any) -> None:
    cfg = r.config
    s = r.tiny_sizes
    m = cfg.micro_batches
    print(
        f"Gradient accumulation vs one large batch: tiny {r.architecture} ({cfg.catalog_model} architecture; "
        f"hidden {s['hidden_size']}, {s['num_hidden_layers']} layers, vocab {s['vocab_size']}; "
        f"{r.num_params:,} params, random weights), {cfg.dtype}, seed {cfg.seed}"
    )
    counts = ", ".join(str(n) for n in r.target_tokens)
    print(
        f"global batch: {m} micro-batches x {r.rows_per_micro_batch} sequences of "
        f"{cfg.min_len}-{cfg.max_len} tokens; target tokens n_i per micro-batch: {counts} "
        f"(N = {r.total_target_tokens})"
    )
    print(
        f"reference g_ref: one backward over all {m * r.rows_per_micro_batch} sequences, "
        f"loss = mean over the {r.total_target_tokens} target tokens"
    )
    print()
    labels = {"mean_of_means": "(a)", "global_token_mean": "(b)"}
    width = max(len(c.description) for c in r.comparisons) + 4
    print(f"{'accumulated loss per micro-batch':<{width}} {'|g-g_ref|/|g_ref|':>17} {'cosine(g, g_ref)':>18}")
    for c in r.comparisons:
        print(f"{labels.get(c.key, '')} {c.description:<{width - 4}} {c.rel_error:>17.2e} {c.cosine:>18.12f}")
    print()
    tol = f"{r.tolerance:.0e} ({cfg.dtype} rounding)"
    for c in r.comparisons:
        verdict = f"matches g_ref (< {tol})" if c.within_rounding else f"differs from g_ref (> {tol})"
        print(f"{labels.get(c.key, '')} {verdict}")
    spread = max(r.target_tokens) / min(r.target_tokens)
    print(
        f"why: (a) weights a token of micro-batch i by 1/({m}*n_i) instead of 1/N, so a token of the "
        f"micro-batch with fewest targets counts {spread:.2f}x one of the micro-batch with most; (b) weights "
        "every token 1/N: the large-batch loss, summed in another order."
    )
    if r.batch_dependent_layers:
        print("batch-dependent or stochastic layers (another source of difference):")
        for layer in r.batch_dependent_layers:
            print(f"  {layer}")
    else:
        print(
            f"batch-dependent layers: none in {r.architecture} (RMSNorm normalises each token; no BatchNorm; "
            "attention dropout 0), so the loss weighting is the only difference."
        )
    print(
        f"(experiment {r.elapsed_s:.2f} s after {r.setup_s:.1f} s of imports and model build; "
        f"torch {r.torch_version}, transformers {r.transformers_version})"
    )


def _run_script(args: argparse.Namespace) -> int:
    from vramledger.accum.script_check import check_script

    report = check_script(args.script)
    if args.json:
        out: dict[str, Any] = dataclasses.asdict(report)
        for f in out["findings"]:
            f["name"] = _rule_name(f["rule"])
        print(json.dumps(out, indent=2))
        return 0 if report.clean else 1
    if report.loops:
        print(f"{report.path}: accumulation loops recognised:")
        for lp in report.loops:
            print(f"  line {lp.line}: {lp.kind} ({lp.detail})")
    else:
        print(f"{report.path}: no manual gradient-accumulation loop recognised (nothing to check).")
    for f in report.findings:
        print(f"{report.path}:{f.line}: {f.rule} {f.name}: {f.message}")
        print(f"    fix: {f.fix}")
    n = len(report.findings)
    print(f"{n} finding{'s' if n != 1 else ''}." if n else "no findings.")
    return 0 if report.clean else 1


def _rule_name(rule: str) -> str:
    from vramledger.accum.script_check import RULES

    return RULES[rule]
