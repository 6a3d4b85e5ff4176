"""``simulate``'s outputs: the terminal summary, the JSON, and the figure of reserved memory over the run."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vramledger.errors import VramledgerError
from vramledger.simulate.api import Simulation, StepPoint
from vramledger.simulate.remedies import RemedyOutcome
from vramledger.units import fmt_bytes


def _where(p: StepPoint | None) -> str:
    if p is None:
        return "the load"
    lens = "×".join(str(n) for n in p.padded_lengths[:4]) + ("…" if len(p.padded_lengths) > 4 else "")
    if p.kind == "eval":
        return f"the evaluation after step {p.step} (eval batches padded to {lens})"
    return f"step {p.step} (batch padded to {lens} tokens)"


def _percentiles(xs: Sequence[int]) -> str:
    s = sorted(xs)
    if not s:
        return "no samples"

    def q(f: float) -> int:
        return s[min(len(s) - 1, int(f * len(s)))]

    return f"p50 {q(0.5)}, p99 {q(0.99)}, max {s[-1]}"


def render_simulation(sim: Simulation, remedies: Sequence[RemedyOutcome] = (), *, title: str = "") -> str:
    """The terminal summary: the run, its high-water mark and where, whether and when it fails, the remedies."""
    run = sim.run
    lines = [title] if title else []
    lines.append(
        f"samples: {len(sim.sample_lengths)} ({sim.source}); truncated lengths {_percentiles(sim.sample_lengths)}"
    )
    lines.append(
        f"run: {sim.steps} optimizer steps, batches padded to {_percentiles(sim.train_lengths)} tokens; "
        f"allocator {sim.conf or 'default settings'}"
    )
    lines.append(f"high-water reserved {fmt_bytes(run.high_water_reserved_bytes)} at {_where(run.high_water_point)}")
    longest = max((p for p in run.points if p.kind == "train"), key=lambda p: max(p.padded_lengths), default=None)
    if longest is not None and run.high_water_point is not None and longest.step != run.high_water_point.step:
        lines.append(
            f"  the longest batch is at step {longest.step} ({max(longest.padded_lengths)} tokens): the "
            "high-water mark is elsewhere, where cached blocks of other sizes were already held"
        )
    creep = [p for p in run.points if p.kind == "train"]
    if len(creep) > 1:
        first = creep[0].reserved_end_bytes
        last = creep[-1].reserved_end_bytes
        lines.append(
            f"reserved after step 1 {fmt_bytes(first)}, after the last step {fmt_bytes(last)} "
            f"({fmt_bytes(last - first, signed=True)}; {creep[-1].segments_end} segments)"
        )
    if sim.capacity_bytes is None:
        lines.append("no --gpu: no capacity to run out of")
    elif run.oom is None:
        spare = sim.capacity_bytes - run.high_water_reserved_bytes
        lines.append(
            f"FITS on {sim.gpu}: no OOM in {sim.steps} steps "
            f"({fmt_bytes(spare)} below the {fmt_bytes(sim.capacity_bytes)} torch can obtain)"
        )
    else:
        o = run.oom
        where = "evaluation after step" if o.kind == "eval" else "step"
        lines.append(
            f"OOM at {where} {o.step} of {sim.steps} (batch padded to {o.length}): {o.op} in "
            f"{o.module or '(top level)'} ({o.phase}) asked for {fmt_bytes(o.requested_bytes)}"
        )
        lines.append(
            f"  allocated {fmt_bytes(o.allocated_bytes)}, reserved {fmt_bytes(o.reserved_bytes)} of "
            f"{fmt_bytes(o.capacity_bytes)}; largest free block {fmt_bytes(o.largest_free_block_bytes)}"
        )
    if sim.shuffles > 1:
        fails = [s for s in sim.oom_steps if s is not None]
        lines.append(
            f"OOM probability {sim.oom_probability:.0%} over {sim.shuffles} shuffles"
            + (f" (failing steps: {', '.join(str(s) for s in sorted(fails)[:8])})" if fails else "")
        )
    if remedies:
        lines.append("remedies (each re-simulated on the same samples and seeds):")
        width = max(len(r.label) for r in remedies)
        for r in remedies:
            verdict = "no OOM" if r.oom_step is None else f"OOM at step {r.oom_step}"
            prob = f", P(OOM) {r.oom_probability:.0%}" if sim.shuffles > 1 else ""
            lines.append(
                f"  {r.label:<{width}}  high-water {fmt_bytes(r.high_water_reserved_bytes):>10}  "
                f"({fmt_bytes(r.high_water_reserved_bytes - run.high_water_reserved_bytes, signed=True)})"
                f"  {verdict}{prob}   [{r.setting}]"
            )
    lines.append(
        f"replayed {sim.replays} step(s), {sim.memo_hits} memoised; traced once at length "
        f"{sim.reference_len} ({sim.versions})"
    )
    lines += [f"warning: {w}" for w in sim.warnings]
    return "\n".join(lines)


def simulation_to_dict(sim: Simulation, remedies: Sequence[RemedyOutcome] = ()) -> dict[str, Any]:
    """The JSON of ``simulate --json``: bytes everywhere."""
    run = sim.run
    hw = run.high_water_point
    return {
        "high_water_reserved_bytes": run.high_water_reserved_bytes,
        "high_water_step": None if hw is None else hw.step,
        "high_water_kind": None if hw is None else hw.kind,
        "high_water_padded_lengths": None if hw is None else list(hw.padded_lengths),
        "oom_step": run.oom_step,
        "oom": None if run.oom is None else {k: getattr(run.oom, k) for k in run.oom.__slots__},
        "oom_probability": sim.oom_probability,
        "shuffles": sim.shuffles,
        "oom_steps": list(sim.oom_steps),
        "steps": sim.steps,
        "capacity_bytes": sim.capacity_bytes,
        "gpu": sim.gpu,
        "alloc_conf": sim.conf,
        "bucket": run.bucket,
        "reference_len": sim.reference_len,
        "source": sim.source,
        "series": {
            "step": [p.step for p in run.points],
            "kind": [p.kind for p in run.points],
            "padded_len": [max(p.padded_lengths) for p in run.points],
            "padded_lengths": [list(p.padded_lengths) for p in run.points],
            "peak_allocated_bytes": [p.peak_allocated_bytes for p in run.points],
            "peak_reserved_bytes": [p.peak_reserved_bytes for p in run.points],
            "reserved_end_bytes": [p.reserved_end_bytes for p in run.points],
            "alloc_retries": [p.retries for p in run.points],
        },
        "remedies": [
            {
                "label": r.label,
                "setting": r.setting,
                "high_water_reserved_bytes": r.high_water_reserved_bytes,
                "oom_step": r.oom_step,
                "oom_probability": r.oom_probability,
            }
            for r in remedies
        ],
        "replays": sim.replays,
        "memo_hits": sim.memo_hits,
        "warnings": list(sim.warnings),
    }


def _figure(sim: Simulation, headroom: float) -> Any:
    """Reserved and allocated peaks over the run (evaluations marked, the high-water step annotated, capacity
    and headroom lines) beside the histogram of the samples' lengths."""
    from vramledger.report.plots import _gpu_lines, _new

    run = sim.run
    gib = 2**30
    fig, (ax, hx) = _new(12.0, 4.6, ncols=2)
    train = [p for p in run.points if p.kind == "train"]
    ev = [p for p in run.points if p.kind == "eval"]
    ax.plot(
        [p.step for p in train],
        [p.peak_reserved_bytes / gib for p in train],
        color="#004488",
        lw=1.2,
        label="peak reserved per step",
    )
    ax.plot(
        [p.step for p in train],
        [p.peak_allocated_bytes / gib for p in train],
        color="#DDAA33",
        lw=0.9,
        label="peak allocated per step",
    )
    if ev:
        ax.scatter(
            [p.step for p in ev],
            [p.peak_reserved_bytes / gib for p in ev],
            marker="v",
            color="#BB5566",
            zorder=6,
            label="evaluation (peak reserved)",
        )
    hw = run.high_water_point
    if hw is not None:
        left = 2 * hw.step < max(p.step for p in run.points)
        ax.annotate(
            f"high-water {run.high_water_reserved_bytes / gib:.2f} GiB\n{hw.kind} step {hw.step}",
            (hw.step, hw.peak_reserved_bytes / gib),
            xytext=(30, -45) if left else (-150, -45),
            textcoords="offset points",
            arrowprops={"arrowstyle": "->"},
            fontsize=8.5,
        )
    if sim.capacity_bytes is not None:
        _gpu_lines(ax, sim.capacity_bytes, int(sim.capacity_bytes * (1 - headroom)), sim.gpu)
    if run.oom is not None:
        ax.axvline(run.oom.step, color="#BB5566", lw=1.5, ls=":", label=f"OOM at step {run.oom.step}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("GiB")
    ax.set_title("reserved and allocated over the run")
    ax.legend(loc="lower right", frameon=True, framealpha=0.9)
    hx.hist(sim.sample_lengths, bins=40, color="#004488")
    hx.set_xlabel("sample length (tokens, truncated)")
    hx.set_ylabel("samples")
    hx.set_title("length histogram")
    return fig


def _render(sim: Simulation, fmt: str, headroom: float) -> bytes:
    import io

    from vramledger.report.plots import require_matplotlib, style

    require_matplotlib()
    with style():
        buf = io.BytesIO()
        _figure(sim, headroom).savefig(buf, format=fmt, dpi=110)
    return buf.getvalue()


def write_simulation_png(path: Path, sim: Simulation, *, headroom: float = 0.08) -> Path:
    """``--png DIR``: the figure as ``DIR/simulate.png``."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_render(sim, "png", headroom))
    except OSError as exc:
        raise VramledgerError(f"--png: cannot write {path}: {exc.strerror}") from exc
    return path


def write_simulation_html(
    path: Path, sim: Simulation, remedies: Sequence[RemedyOutcome] = (), *, title: str = "", headroom: float = 0.08
) -> Path:
    """``--html FILE``: one self-contained page, the terminal summary and the figure as inline SVG."""
    import html

    from vramledger.report.html import _CSS, inline_svg

    svg = inline_svg(_render(sim, "svg", headroom).decode("utf-8"), "sim")
    text = html.escape(render_simulation(sim, remedies, title=title))
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title or 'simulate')}</title>"
        f"<style>{_CSS}</style></head><body><h1>{html.escape(title or 'simulate')}</h1>"
        f"<figure class='vl-figure'>{svg}<figcaption id='sim-caption'>reserved and allocated over the run; "
        f"the samples' lengths</figcaption></figure><pre>{text}</pre></body></html>"
    )
    try:
        path.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise VramledgerError(f"--html: cannot write {path}: {exc.strerror}; pass a writable file path") from exc
    return path
