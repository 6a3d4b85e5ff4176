"""`fit`, `plan` and `accum` in the terminal (tables within 100 columns, no colour) and as JSON.

The library returns typed results (``plan.frontier.FitReport``, ``plan.planner.Plan``, ``plan.accum.AccumReport``);
this module is the only place that turns them into text.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import textwrap
from collections.abc import Sequence
from typing import Any

from vramledger.plan.accum import AccumReport
from vramledger.plan.frontier import FitReport
from vramledger.plan.planner import Candidate, Plan
from vramledger.plan.timemodel import StepTime, TimeAssumptions
from vramledger.report.verdict import fit_status
from vramledger.units import fmt_bytes

WIDTH = 100


def _table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], *, right: Sequence[bool] | None = None, indent: int = 2
) -> list[str]:
    """Columns sized to their content; the last column wraps to keep every line within ``WIDTH``."""
    n = len(headers)
    right = right or [False] * n
    widths = [max(len(headers[i]), *(len(r[i]) for r in rows)) if rows else len(headers[i]) for i in range(n)]
    lead = sum(widths[:-1]) + 2 * (n - 1) + indent
    widths[-1] = max(12, min(widths[-1], WIDTH - lead))

    def fmt(cells: Sequence[str]) -> list[str]:
        last = textwrap.wrap(cells[-1], widths[-1]) or [""]
        head = "  ".join(c.rjust(widths[i]) if right[i] else c.ljust(widths[i]) for i, c in enumerate(cells[:-1]))
        out = [(" " * indent + head + ("  " if n > 1 else "") + last[0]).rstrip()]
        pad = " " * (indent + len(head) + (2 if n > 1 else 0))
        out += [(pad + x).rstrip() for x in last[1:]]
        return out

    lines = fmt(headers)
    lines.append(" " * indent + "-" * min(WIDTH - indent, sum(widths) + 2 * (n - 1)))
    for r in rows:
        lines += fmt(r)
    return lines


def _gpu_line(gpu: str, capacity: int, headroom: float, usable: int) -> str:
    return f"{gpu}: {fmt_bytes(capacity)}, keeping {headroom:.0%} headroom = {fmt_bytes(usable)} usable"


def _secs(s: float) -> str:
    return f"{s:.2f} s" if s < 100 else f"{s:.0f} s"


def _signed_secs(s: float) -> str:
    return ("+" if s >= 0.005 else "") + f"{s:.2f} s"


# -- fit ----------------------------------------------------------------------------------------------------------


def render_fit(r: FitReport) -> str:
    lines = [f"{r.model}", _gpu_line(r.gpu, r.capacity_bytes, r.headroom, r.usable_bytes), ""]
    lines.append(
        f"setup: micro-batch {r.micro_batch} x {r.seq_len} tokens: device total {fmt_bytes(r.device_total)}"
        f" -> {fit_status(r.device_total, r.usable_bytes)}"
    )
    lb, ll = r.largest_batch, r.largest_length
    if lb is None:
        lines.append(f"largest micro-batch at {r.seq_len} tokens: none (one sequence needs more than fits)")
    else:
        more = " (search limit reached)" if lb.at_limit else ""
        lines.append(
            f"largest micro-batch at {r.seq_len} tokens: {lb.micro_batch}{more} ({fmt_bytes(lb.device_total)})"
        )
    g = r.frontier.granularity
    if ll is None:
        lines.append(f"largest length at micro-batch {r.micro_batch}: none (not even {g} tokens fit)")
    else:
        more = " (search limit reached)" if ll.at_limit else ""
        lines.append(
            f"largest length at micro-batch {r.micro_batch}: {ll.seq_len} tokens{more}"
            f" ({fmt_bytes(ll.device_total)}; lengths on multiples of {g})"
        )
    lines.append("")
    f = r.frontier
    lines.append(
        f"frontier: largest length for each micro-batch (multiples of {g}, up to {f.max_len}; "
        f"micro-batches 1-{f.max_batch})"
    )
    if not f.points:
        lines.append("  nothing fits: not one sequence of the smallest length")
    else:
        by_batch = {p.micro_batch: p for p in f.points}
        rows = []
        for first, last, L in f.steps():
            span = str(first) if first == last else f"{first}-{last}"
            p = by_batch[first]
            tokens = f"{first * L:,}" if first == last else f"{first * L:,}-{last * L:,}"
            rows.append([span, f"{L:,}" + (" +" if p.at_limit else ""), tokens, fmt_bytes(p.device_total)])
        lines += _table(
            ["micro-batch", "max length", "tokens/micro-batch", "device total (first)"],
            rows,
            right=[True, True, True, False],
        )
        last = f.points[-1].micro_batch
        if last < f.max_batch:
            lines.append(f"  micro-batch {last + 1} and above: not even {g} tokens fit")
        if any(p.at_limit for p in f.points):
            lines.append(f"  + the length limit ({f.max_len}) was reached, not the memory cliff")
    if r.exact:
        lines.append("")
        lines.append("confirmed by tracing the real model code (--exact):")
        rows = [
            [
                str(c.micro_batch),
                str(c.seq_len),
                fmt_bytes(c.analytic_total),
                fmt_bytes(c.traced_total),
                "fits" if c.traced_fits else "OOM",
                f"{c.next_micro_batch} × {c.next_seq_len}: " + ("fits" if c.next_traced_fits else "OOM"),
                "yes" if c.agrees else "NO",
            ]
            for c in r.exact
        ]
        lines += _table(
            ["batch", "length", "analytic", "traced", "traced", "next", "agrees"],
            rows,
            right=[True, True, True, True, False, False, False],
        )
    for w in r.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines)


# -- plan ---------------------------------------------------------------------------------------------------------


def _changes(c: Candidate) -> str:
    return "; ".join(str(x) for x in c.changes) or "(your setup)"


def _cand_rows(cands: Sequence[Candidate], usable: int) -> list[list[str]]:
    return [
        [
            str(i),
            fmt_bytes(c.device_total),
            fmt_bytes(usable - c.device_total),
            _secs(c.time.step_s),
            f"{c.time.tokens_per_s:,.0f}",
            _changes(c),
        ]
        for i, c in enumerate(cands, 1)
    ]


def render_plan(p: Plan, *, top: int = 8, config_keys: tuple[str, Sequence[str]] = ("", ())) -> str:
    """``config_keys``: (format, lines) — plan 1 written in the user's framework keys, shown under the plans."""
    b = p.baseline
    lines = [
        f"{p.model}: global batch {p.global_batch} x {p.seq_len} tokens per optimizer step",
        _gpu_line(p.gpu, p.capacity_bytes, p.headroom, p.usable_bytes),
        "",
    ]
    lines.append(
        f"your setup: micro-batch {b.train.micro_batch} x accumulation {b.train.grad_accum}: "
        f"{fmt_bytes(b.device_total)} -> {fit_status(b.device_total, p.usable_bytes)}"
    )
    lines.append(
        f"  predicted {_secs(b.time.step_s)} per optimizer step, {b.time.tokens_per_s:,.0f} tokens/s "
        f"(MFU {b.time.mfu:.0%})"
    )
    lines.append("")
    lines.append("remedies, each alone on your setup (the seeds' order; time per optimizer step vs yours)")
    rows = [
        [e.title, fmt_bytes(e.memory_saved), _signed_secs(e.time_cost_s), "fits" if e.fits else "-", str(e.change)]
        for e in p.remedies
    ]
    lines += _table(["remedy", "saves", "time", "alone", "change"], rows, right=[False, True, True, False, False])
    for k, v in _prices(p):
        lines += textwrap.wrap(f"{k}: {v}", WIDTH, initial_indent="  price of ", subsequent_indent="    ")
    lines.append("")
    lines.append("ladder: remedies applied in that order until it fits (micro-batch regrown each step)")
    rows = [
        [
            str(i),
            fmt_bytes(c.device_total),
            "fits" if c.fits else "OOM",
            _secs(c.time.step_s),
            f"{c.time.tokens_per_s:,.0f}",
            _changes(c),
        ]
        for i, c in enumerate(p.ladder)
    ]
    lines += _table(
        ["#", "device", "", "s/step", "tokens/s", "changes"], rows, right=[True, True, False, True, True, False]
    )
    lines.append("")
    if p.candidates:
        lines.append(
            f"plans that fit, fastest first ({len(p.candidates)} of {p.combinations} combinations searched;"
            f" top {min(top, len(p.candidates))})"
        )
        lines += _table(
            ["#", "device", "spare", "s/step", "tokens/s", "changes"],
            _cand_rows(p.candidates[:top], p.usable_bytes),
            right=[True, True, True, True, True, False],
        )
        fmt, keys = config_keys
        if keys:
            lines += textwrap.wrap(
                f"plan 1 in your {fmt} config: {'; '.join(keys)}", WIDTH, initial_indent="  ", subsequent_indent="    "
            )
    else:
        lines.append(f"no plan that keeps the task fits ({p.combinations} combinations searched)")
    if p.task_changing:
        lines.append("")
        lines.append("these CHANGE THE TASK (shorter samples or a smaller model), for comparison only:")
        lines += _table(
            ["#", "device", "spare", "s/step", "tokens/s", "changes"],
            _cand_rows(p.task_changing[:top], p.usable_bytes),
            right=[True, True, True, True, True, False],
        )
    lines.append("")
    lines.append(_assumptions_line(p.assumptions))
    for w in p.warnings:
        lines += textwrap.wrap(f"warning: {w}", WIDTH, subsequent_indent="  ")
    return "\n".join(lines)


def _prices(p: Plan) -> list[tuple[str, str]]:
    from vramledger.plan.remedies import PRICE

    seen: list[str] = []
    for e in p.remedies:
        if e.remedy not in seen and e.remedy in ("micro_batch", "grad_ckpt", "offload"):
            seen.append(e.remedy)
    return [(k, PRICE[k]) for k in seen]


def _assumptions_line(a: TimeAssumptions) -> str:
    return (
        f"times: time model (plan/timemodel.py), MFU up to {a.mfu_max:.0%}, {a.micro_step_fixed_s * 1e3:g} ms "
        f"per micro-step,\n  {a.launch_s * 1e6:g} us per kernel launch; stated assumptions, not yet calibrated "
        "on a GPU"
    )


# -- accum --------------------------------------------------------------------------------------------------------


def render_accum(r: AccumReport, *, points: int = 6) -> str:
    unit = "per 1000 samples" if r.per_thousand else f"over {r.samples:,} samples ({r.epochs} epoch(s))"
    lines = [
        f"{r.model}: global batch {r.global_batch} x {r.seq_len} tokens",
        _gpu_line(r.gpu, r.capacity_bytes, r.headroom, r.usable_bytes),
        "",
    ]
    rows = []
    for s in r.splits:
        rows.append(
            [
                f"{s.micro_batch} x {s.grad_accum}",
                fmt_bytes(s.device_total),
                "fits" if s.fits else "OOM",
                _secs(s.time.step_s),
                f"{s.time.tokens_per_s:,.0f}",
                f"{s.micro_steps:,}",
                f"{s.optimizer_steps:,}",
            ]
        )
    lines.append(f"splits of the global batch (micro-batch x accumulation); steps {unit}")
    lines += _table(
        ["micro x accum", "device", "", "s/opt step", "tokens/s", "micro-steps", "optimizer steps"],
        rows,
        right=[True, True, False, True, True, True, True],
    )
    sc = r.schedule
    lines.append("")
    lines.append(
        f"LR schedule ({sc.scheduler}, warmup {sc.warmup_steps} of {sc.total_steps} optimizer steps), "
        "as a fraction of the peak LR:"
    )
    idx = sorted({round(i * (len(sc.steps) - 1) / max(1, points - 1)) for i in range(points)})
    headers = ["optimizer step", "per opt step"] + [f"per micro (k={k})" for k, _ in sc.per_micro_batch[:4]]
    rows = []
    for i in idx:
        row = [f"{sc.steps[i]:,}", f"{sc.per_optimizer_step[i]:.3f}"]
        row += [f"{vals[i]:.3f}" for _, vals in sc.per_micro_batch[:4]]
        rows.append(row)
    lines += _table(headers, rows, right=[True] * len(headers))
    if sc.per_micro_batch:
        lines.append("  per micro: a scheduler configured in optimizer steps but stepped on every micro-batch")
    lines.append("")
    lines.append(_assumptions_line(DEFAULT_TIME))
    for w in r.warnings:
        lines += textwrap.wrap(f"warning: {w}", WIDTH, subsequent_indent="  ")
    return "\n".join(lines)


DEFAULT_TIME = TimeAssumptions()


# -- JSON ---------------------------------------------------------------------------------------------------------


def _plain(x: Any) -> Any:
    """Dataclasses → dicts (specs by their fields, ModelSpec by name), enums → values, tuples → lists."""
    from vramledger.specs import ModelSpec

    if isinstance(x, ModelSpec):
        return x.name
    if isinstance(x, (StepTime, Candidate)):
        d = {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, StepTime):
            d["mfu"] = x.mfu
        else:
            d["changes_task"] = x.changes_task
        return d
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, enum.Enum):
        return x.value
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    return x


def to_json(result: FitReport | Plan | AccumReport) -> str:
    return json.dumps(_plain(result), indent=2, default=str)
