"""`vramledger accum-check` in the terminal and as JSON: the equivalence experiment and the script check.

Pure functions of ``accum.equivalence.EquivalenceResult`` and ``accum.script_check.ScriptReport``; the CLI prints
what they return.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def equivalence_to_dict(r: Any) -> dict[str, Any]:
    out: dict[str, Any] = dataclasses.asdict(r)
    out["total_target_tokens"] = r.total_target_tokens
    return out


def render_equivalence(r: Any) -> str:
    """The experiment's report: setup, the two accumulated losses against the reference gradient, and why."""
    cfg = r.config
    s = r.tiny_sizes
    m = cfg.micro_batches
    lines = [
        f"Gradient accumulation vs one large batch: tiny {r.architecture} ({cfg.catalog_model} architecture; "
        f"hidden {s['hidden_size']}, {s['num_hidden_layers']} layers, vocab {s['vocab_size']}; "
        f"{r.num_params:,} params, random weights), {cfg.dtype}, seed {cfg.seed}",
        f"global batch: {m} micro-batches x {r.rows_per_micro_batch} sequences of "
        f"{cfg.min_len}-{cfg.max_len} tokens; target tokens n_i per micro-batch: "
        f"{', '.join(str(n) for n in r.target_tokens)} (N = {r.total_target_tokens})",
        f"reference g_ref: one backward over all {m * r.rows_per_micro_batch} sequences, "
        f"loss = mean over the {r.total_target_tokens} target tokens",
        "",
    ]
    labels = {"mean_of_means": "(a)", "global_token_mean": "(b)"}
    width = max(len(c.description) for c in r.comparisons) + 4
    lines.append(f"{'accumulated loss per micro-batch':<{width}} {'|g-g_ref|/|g_ref|':>17} {'cosine(g, g_ref)':>18}")
    for c in r.comparisons:
        lines.append(f"{labels.get(c.key, '')} {c.description:<{width - 4}} {c.rel_error:>17.2e} {c.cosine:>18.12f}")
    lines.append("")
    tol = f"{r.tolerance:.0e} ({cfg.dtype} rounding)"
    for c in r.comparisons:
        verdict = f"matches g_ref (< {tol})" if c.within_rounding else f"differs from g_ref (> {tol})"
        lines.append(f"{labels.get(c.key, '')} {verdict}")
    spread = max(r.target_tokens) / min(r.target_tokens)
    lines.append(
        f"why: (a) weights a token of micro-batch i by 1/({m}*n_i) instead of 1/N, so a token of the "
        f"micro-batch with fewest targets counts {spread:.2f}x one of the micro-batch with most; (b) weights "
        "every token 1/N: the large-batch loss, summed in another order."
    )
    if r.batch_dependent_layers:
        lines.append("batch-dependent or stochastic layers (another source of difference):")
        lines += [f"  {layer}" for layer in r.batch_dependent_layers]
    else:
        lines.append(
            f"batch-dependent layers: none in {r.architecture} (RMSNorm normalises each token; no BatchNorm; "
            "attention dropout 0), so the loss weighting is the only difference."
        )
    lines.append(
        f"(experiment {r.elapsed_s:.2f} s after {r.setup_s:.1f} s of imports and model build; "
        f"torch {r.torch_version}, transformers {r.transformers_version})"
    )
    return "\n".join(lines)


def script_report_to_dict(report: Any) -> dict[str, Any]:
    from vramledger.accum.script_check import RULES

    out: dict[str, Any] = dataclasses.asdict(report)
    for f in out["findings"]:
        f["name"] = RULES[f["rule"]]
    return out


def render_script_report(report: Any) -> str:
    """The loops recognised and one ``path:line: rule name: message`` line (with its fix) per finding."""
    if report.loops:
        lines = [f"{report.path}: accumulation loops recognised:"]
        lines += [f"  line {lp.line}: {lp.kind} ({lp.detail})" for lp in report.loops]
    else:
        lines = [f"{report.path}: no manual gradient-accumulation loop recognised (nothing to check)."]
    for f in report.findings:
        lines.append(f"{report.path}:{f.line}: {f.rule} {f.name}: {f.message}")
        lines.append(f"    fix: {f.fix}")
    n = len(report.findings)
    lines.append(f"{n} finding{'s' if n != 1 else ''}." if n else "no findings.")
    return "\n".join(lines)
