"""Does a dynamic-padding run keep what its shorter batches left cached? The run replay against the single shape.

Three reserve mechanisms measured in the grid's replays switch off as the shape grows (docs/reserve.md,
"Measured, but left out"): the backward thread's cuBLAS workspace cut from a freed fp32 logits block (adapters),
activation blocks too small for the optimizer (full, no checkpointing), a tied embedding's gradient block (full).
A single shape's reserved memory therefore falls from one length to the next. A run with dynamic padding sees
batches of many lengths, one after the other, through one caching allocator: whether the segments a shorter
batch's mechanism made stay cached (and unused) when the longer batches come is what this measures.

For each config of the grid (first the 12 misses the switching mechanisms explained, tests/analytic/test_reserve.py):
- the run is traced once (``vramledger.simulate.templates.build_templates``: one trace at a reference length,
  each allocation re-derived at any length; checked byte for byte against real traces in tests/simulate/), and
  the templates are saved (``.streams/``, not committed) so nothing is traced twice;
- real traces at L/4 and L/2 (L: the grid's length; the grid's own trace at L is committed in
  replay_grid.jsonl) check the templates' single-shape replay at those lengths;
- single shape: load + 3 steps at one length, for a sweep of lengths (L/4 … 8L): where reserved falls;
- runs: load + 8 steps at mixed lengths in three orders (short first, long first, interleaved), replayed through
  the simulate engine (``simulate.engine.Replayer``, its allocator state carried from step to step), for the
  grid's lengths {L/4, L/2, L} and, where the sweep shows a fall, for lengths around it ({ℓ_on/2, ℓ_on,
  ℓ_off}: the mechanism on at the two shorter ones, off at the longest);
- for each run, where its extra reserve came from: the segments each step made, and at the moment of the last
  longest step's peak allocated, the free cached blocks grouped by the step (length, phase, op) that made their
  segment.

Run:  nice -n 10 python bench/reserve/run_runs.py           # traces what is missing, replays, writes runs.jsonl
      python bench/reserve/run_runs.py --table              # the markdown tables of docs/reserve.md
      python bench/reserve/run_runs.py --only ID            # one config, printed, not saved
Output: bench/reserve/runs.jsonl, one JSON object per config (bytes everywhere). No GPU: an unlimited device,
Hopper's cuBLAS workspaces (as run_grid.py).
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "src"))
sys.path.insert(0, str(HERE))

import run_grid  # noqa: E402

from vramledger.simulate.engine import Replayer, Unit  # noqa: E402
from vramledger.simulate.templates import StepTemplates  # noqa: E402

OUT = HERE / "runs.jsonl"
STREAMS = HERE / ".streams"
GiB = 2**30

# The grid's misses classed "measured, left out" (tests/analytic/test_reserve.py KNOWN_MISSES), by mechanism.
CONFIGS: dict[str, str] = {
    "llama-3.2-1b/lora/b1/L512/nockpt/eager": "workspace",
    "qwen2.5-0.5b/lora/b2/L512/ckpt/eager": "workspace",
    "qwen3-1.7b/lora/b2/L512/nockpt/sdpa": "workspace",
    "mid/lora/b2/L1024/nockpt/eager": "workspace",
    "llama-3.2-1b/full/b2/L512/nockpt/sdpa": "act_unused",
    "llama-3.2-1b/full/b8/L256/nockpt/sdpa": "act_unused",
    "qwen2.5-0.5b/full/b2/L256/nockpt/eager": "act_unused",
    "qwen3-0.6b/full/b1/L1024/nockpt/sdpa": "act_unused",
    "qwen3-1.7b/full/b1/L256/nockpt/sdpa": "act_unused",
    "llama-3.2-3b/full/b1/L1024/nockpt/sdpa": "act_unused",
    "llama-3.2-1b/full/b1/L512/nockpt/sdpa/fp32": "act_unused",
    "llama-3.2-3b/full/b1/L2048/ckpt/sdpa": "tied_grad",
}
# Every other grid config whose estimate the held mechanisms change (analytic/reserve/); the rest of the grid
# follows (``_order``): each config's runs are the reference the grid test compares a dynamic-padding estimate with.
HELD: tuple[str, ...] = (
    "llama-3.2-1b/lora/b1/L1024/nockpt/sdpa",
    "llama-3.2-1b/full/b1/L2048/ckpt/sdpa",
    "qwen2.5-0.5b/lora/b4/L1024/ckpt/sdpa",
    "qwen2.5-0.5b/lora/b1/L2048/nockpt/sdpa",
    "qwen2.5-0.5b/lora/b8/L256/nockpt/sdpa",
    "qwen2.5-0.5b/full/b8/L512/ckpt/sdpa",
    "qwen2.5-0.5b/full/b1/L4096/nockpt/sdpa",
    "qwen3-0.6b/lora/b2/L2048/ckpt/sdpa",
    "qwen3-0.6b/lora/b4/L512/nockpt/sdpa",
    "qwen3-0.6b/lora/b1/L1024/nockpt/eager",
    "qwen3-0.6b/full/b4/L4096/ckpt/sdpa",
    "qwen3-1.7b/full/b2/L1024/ckpt/sdpa",
    "tiny/full/b1/L256/nockpt/sdpa",
    "tiny/lora/b4/L512/nockpt/sdpa",
    "tiny/lora/b1/L2048/ckpt/sdpa",
    "mid/full/b2/L1024/nockpt/sdpa",
    "mid/lora/b8/L512/ckpt/sdpa",
    "mid/lora/b1/L4096/nockpt/sdpa",
    "llama-3.2-3b/full/b4/L768/nockpt/sdpa/bf16-true",
    "llama-3.2-3b/full/b2/L2048/ckpt/eager/bf16-true",
    "llama-3.2-3b/full/b4/L512/nockpt/sdpa/bf16-true/sgd",
    "llama-3.2-1b/full/b4/L1024/nockpt/sdpa/bf16-true",
    "llama-3.2-1b/full/b2/L1024/nockpt/sdpa/adamw_torch_fused",
    "qwen2.5-0.5b/full/b16/L256/nockpt/sdpa/bf16-true",
    "qwen2.5-0.5b/full/b4/L1024/ckpt/sdpa/fp16-mixed",
    "qwen2.5-1.5b/full/b4/L1024/nockpt/sdpa",
    "qwen2.5-1.5b/full/b8/L512/nockpt/sdpa/bf16-true",
    "qwen2.5-3b/full/b2/L2048/ckpt/sdpa/bf16-true",
    "qwen3-0.6b/full/b8/L1024/ckpt/eager/bf16-true",
    "qwen3-1.7b/full/b4/L2048/nockpt/sdpa/bf16-true",
    "qwen3-4b/full/b1/L4096/ckpt/sdpa/bf16-true",
    "llama-3-8b/full/b1/L4096/nockpt/sdpa/bf16-true",
    "gemma-3-1b/full/b4/L1024/nockpt/sdpa/bf16-true",
    "llama-3.2-1b/lora/b8/L256/nockpt/eager",
    "qwen2.5-3b/lora/b2/L1024/nockpt/eager/fp16-mixed",
    "gemma-2-2b/lora/b2/L1024/nockpt/eager",
)
SWEEP = tuple(2 ** (k / 4) for k in range(-8, 13))
"""Single-shape lengths, as multiples of the grid's length: L/4 … 8L in steps of 2^(1/4)."""
FINE = 32
"""The fine envelope: single shapes at every L/FINE from L/2 to L (rounded to 8), where the coarse sweep steps over
a switch (Llama-3.2-1B LoRA 1 × 1024: 6.40 GiB at 960 tokens, 6.04 at 1000, 6.08 at 1024; the sweep has 864 and
1024)."""
SINGLE_STEPS = 3
ORDERS: dict[str, tuple[int, ...]] = {
    # indices into the sorted lengths (0 the shortest, 2 the longest); every order ends on the longest.
    "short_first": (0, 0, 1, 1, 2, 2, 0, 2),
    "long_first": (2, 2, 1, 1, 0, 0, 2, 0, 2),
    "interleaved": (1, 2, 0, 2, 1, 0, 2, 2),
    "middle_first": (1, 1, 2, 2, 0, 2),
}
RUN_SETS = ("grid", "held")
"""The length sets that end at the grid's length L: a dynamic-padding run of that config."""


def _rows() -> dict[str, run_grid.Row]:
    return {run_grid.config_id(r): r for r in run_grid.GRID}


def _order() -> list[str]:
    """CONFIGS, HELD, then every other grid config (the grid test's reference for each)."""
    first = [*CONFIGS, *HELD]
    return first + [c for c in _rows() if c not in first]


def _stream_path(cid: str, what: str) -> Path:
    return STREAMS / (cid.replace("/", "_") + f".{what}.pkl")


def templates_of(cid: str, what: str = "templates", reference: int | None = None) -> tuple[StepTemplates, float]:
    """The config's step templates (one trace at a reference length: ``reference``, or build_templates' choice),
    from .streams/ (``what`` names the cache) when traced before."""
    path = _stream_path(cid, what)
    if path.exists():
        t, seconds = pickle.loads(path.read_bytes())
        return t, seconds
    from vramledger.simulate.templates import build_templates

    model, train, cfg = run_grid.specs(_rows()[cid])
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = build_templates(model, train, config=cfg, reference=reference)
    seconds = round(time.perf_counter() - t0, 1)
    STREAMS.mkdir(exist_ok=True)
    path.write_bytes(pickle.dumps((t, seconds)))
    return t, seconds


def traced_single(cid: str, length: int, what: str = "") -> dict[str, Any]:
    """A real trace at ``length`` (two steps), replayed on an unlimited device; cached in .streams/ (``what``
    prefixes the cache's name)."""
    path = _stream_path(cid, f"{what}L{length}")
    if path.exists():
        return json.loads(path.read_text())
    import dataclasses

    from vramledger.allocator.replay import replay
    from vramledger.trace.api import trace_events
    from vramledger.trace.oom import device_events

    model, train, cfg = run_grid.specs(_rows()[cid])
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        events = trace_events(model, dataclasses.replace(train, seq_len=length), config=cfg)
    r = replay(device_events(events, None).events, capacity_bytes=None)
    out = {
        "seconds": round(time.perf_counter() - t0, 1),
        "peak_reserved": r.peak_reserved_bytes,
        "peak_allocated": r.peak_allocated_bytes,
    }
    STREAMS.mkdir(exist_ok=True)
    path.write_text(json.dumps(out))
    return out


def _units(lengths: list[int]) -> list[Unit]:
    return [Unit(kind="load", step=0)] + [Unit(kind="train", step=k, lengths=(n,)) for k, n in enumerate(lengths, 1)]


def single(t: StepTemplates, length: int, steps: int = SINGLE_STEPS) -> dict[str, int]:
    """Load and ``steps`` steps at one length (a packed run): peak reserved and allocated, and after 2 steps (what
    the grid's trace replays)."""
    stats = Replayer(t).run(_units([length] * steps))
    return {
        "peak_reserved": max(s.peak_reserved_bytes for s in stats),
        "peak_allocated": max(s.peak_allocated_bytes for s in stats),
        "peak_reserved_2_steps": max(s.peak_reserved_bytes for s in stats[:3]),
    }


def _maker(unit: Unit, phase: Any, op: str, category: Any) -> str:
    return (
        f"step {unit.step} L{unit.lengths[0] if unit.lengths else 0} {phase.value if phase else ''} {op} "
        f"({category.value if category else ''})"
    )


def replay_mallocs(rep: Replayer, alloc: Any, units: list[Unit]) -> Iterator[tuple[int, Unit, Any, Any, int]]:
    """Replay ``units`` through ``alloc`` as the simulate engine decomposes them (``Replayer._parts``,
    ``Segment.sizes``), yielding after each allocation: the unit's index, the unit, its template event, the block
    and the bytes it newly reserved (0: served from the cache)."""
    live: dict[int, Any] = {}
    for k, unit in enumerate(units):
        for seg, length in rep._parts(unit):  # noqa: SLF001 - the engine's own decomposition of a unit
            for i, (is_alloc, sid, size) in enumerate(zip(seg.kinds, seg.ids, seg.sizes(length), strict=True)):
                if not is_alloc:
                    blk = live.pop(sid)
                    if blk is not None:
                        alloc.free(blk)
                elif size == 0:
                    live[sid] = None
                else:
                    before = alloc.reserved
                    blk = live[sid] = alloc.malloc(size)
                    yield k, unit, seg.events[i], blk, alloc.reserved - before


def free_by_maker(alloc: Any, made_by: dict[int, str]) -> Counter[str]:
    """The cached free bytes now, by the maker recorded for their segment (``?``: none recorded)."""
    free: Counter[str] = Counter()
    for _, addr in alloc._large.keys + alloc._small.keys:  # noqa: SLF001
        b = alloc._large.blocks.get(addr) or alloc._small.blocks[addr]  # noqa: SLF001
        free[made_by.get(b.seg, "?")] += b.size
    return free


def run(t: StepTemplates, lengths: list[int]) -> dict[str, Any]:
    """A run of one step per entry of ``lengths``: the simulate engine's per-step figures, and (a second replay
    of the same units, recording who made each segment) where the cache came from."""
    from vramledger.allocator.model import CachingAllocatorModel

    units = _units(lengths)
    rep = Replayer(t)
    stats = rep.run(units)
    # Attribution: the engine's own units and segments (Replayer._parts, ``Segment.sizes``), replayed once more
    # with the maker of every new segment recorded.
    alloc = CachingAllocatorModel()
    made_by: dict[int, str] = {}
    made_in_step: list[Counter[str]] = [Counter() for _ in units]
    longest = max(lengths)
    last_long = max(k for k, n in enumerate(lengths, 1) if n == longest)
    free_at_peak: Counter[str] = Counter()
    best = -1
    for k, unit, ev, blk, new in replay_mallocs(rep, alloc, units):
        if new:
            made_by[blk.seg] = _maker(unit, ev.phase, ev.op, ev.category)
            made_in_step[k][made_by[blk.seg]] += new
        if unit.step == last_long and alloc.allocated > best:
            best, free_at_peak = alloc.allocated, free_by_maker(alloc, made_by)
    peak = max(s.peak_reserved_bytes for s in stats)
    assert alloc.peak_reserved == peak, (alloc.peak_reserved, peak)
    return {
        "lengths": lengths,
        "peak_reserved": peak,
        "peak_allocated": max(s.peak_allocated_bytes for s in stats),
        "reserved_after_step": [s.reserved_end_bytes for s in stats[1:]],
        "made_in_step": [sum(m.values()) for m in made_in_step[1:]],
        "made_by_shorter_steps": sum(
            v for m in made_in_step[1:] for k, v in m.items() if k.split()[2] != f"L{longest}"
        ),
        "free_at_last_longest_peak": [{"made_by": k, "bytes": v} for k, v in free_at_peak.most_common(6) if v >= 2**20],
        "free_at_last_longest_peak_bytes": sum(free_at_peak.values()),
        # The same free bytes by the length of the step that made their segment (0: the load).
        "free_at_last_longest_peak_by_length": _by_length(free_at_peak),
    }


def _by_length(free: Counter[str]) -> dict[str, int]:
    out: Counter[str] = Counter()
    for k, v in free.items():
        out[k.split()[2] if k != "?" else "?"] += v
    return dict(out.most_common())


def _round8(x: float) -> int:
    return max(8, int(round(x / 8)) * 8)


def switch_points(sweep: dict[int, dict[str, int]]) -> list[tuple[int, int, int]]:
    """(ℓ_on, ℓ_off, fall): consecutive sweep lengths where single-shape reserved falls by more than 1%."""
    lens = sorted(sweep)
    out = []
    for a, b in zip(lens, lens[1:], strict=False):
        ra, rb = sweep[a]["peak_reserved"], sweep[b]["peak_reserved"]
        if rb < ra * 0.99:
            out.append((a, b, ra - rb))
    return out


def record(cid: str, *, check: bool = True) -> dict[str, Any]:
    t, seconds = templates_of(cid)
    grid = {json.loads(line)["id"]: json.loads(line) for line in run_grid.OUT.read_text().splitlines()}[cid]
    L = grid["seq_len"]
    sweep = {n: single(t, n) for n in sorted({_round8(L * f) for f in SWEEP})}
    checks = {
        "grid_trace_L": {
            "length": L,
            "traced_peak_reserved": grid["trace"]["replay_peak_reserved"],
            "templates_peak_reserved": single(t, L, 2)["peak_reserved"],
        }
    }
    if check:
        for n in (L // 4, L // 2):
            checks[f"trace_L{n}"] = {
                "length": n,
                "traced_peak_reserved": traced_single(cid, n)["peak_reserved"],
                "templates_peak_reserved": single(t, n, 2)["peak_reserved"],
            }
    sets = {"grid": [L // 4, L // 2, L]}
    shorter = [n for n in sweep if n < L]
    top = max(shorter, key=lambda n: sweep[n]["peak_reserved"])
    if sweep[top]["peak_reserved"] > checks["grid_trace_L"]["traced_peak_reserved"]:
        sets["held"] = [_round8(top / 2), top, L]  # the length below L that reserves the most on its own
    falls = switch_points(sweep)
    if falls:
        on, off, _ = max(falls, key=lambda x: x[2])
        sets["switch"] = [_round8(on / 2), on, off]
    runs: dict[str, Any] = {}
    for name, lens in sets.items():
        for n in lens:
            if n not in sweep:
                sweep[n] = single(t, n)
        runs[name] = {order: run(t, [lens[i] for i in idx]) for order, idx in ORDERS.items()}
    fine = fine_single(t, L)
    rec = {
        "id": cid,
        "mechanism": CONFIGS.get(cid, "held"),
        "trace_seconds": seconds,
        "reference_len": t.reference_len,
        "checks": checks,
        "single": {str(n): sweep[n] for n in sorted(sweep)},
        "fine": fine,
        "falls": [{"on": a, "off": b, "bytes": f} for a, b, f in falls],
        "sets": sets,
        "runs": runs,
    }
    return rec | {"reference": reference(rec)}


def fine_single(t: StepTemplates, L: int) -> dict[str, int]:
    """Single-shape peak reserved (3 steps) at every L/FINE from L/2 to L."""
    lens = sorted({_round8(L * k / FINE) for k in range(FINE // 2, FINE + 1)})
    return {str(n): single(t, n)["peak_reserved"] for n in lens}


def reference(rec: dict[str, Any]) -> dict[str, Any]:
    """What an estimate of the config is compared with.

    ``run``: the run of batches ≤ L that begins with two steps at the length reserving the most on its own (the
    ``held`` set's ``middle_first``; without a held set that length is L: the grid set's ``long_first``), the
    run the estimate of a dynamic-padding run describes; ``worst``: the most any measured order of batches ≤ L
    reserved (ascending lengths add each length's own segments: creep, which ``vramledger simulate`` models and
    the estimate does not); ``single``: the single shape at L (a packed run; the grid's trace); ``envelope``: the
    most any single length ≤ L of the sweep reserves on its own; ``envelope_fine``: the same over the sweep and
    every L/FINE from L/2 to L (what a run whose first steps are at that length keeps: the estimate of a
    dynamic-padding run is compared with it).
    """
    L = rec["checks"]["grid_trace_L"]["length"]
    runs = rec["runs"]
    held = "held" in runs
    return {
        "run": runs["held"]["middle_first"]["peak_reserved"] if held else runs["grid"]["long_first"]["peak_reserved"],
        "run_order": "held/middle_first" if held else "grid/long_first",
        "worst": max(x["peak_reserved"] for name in RUN_SETS if name in runs for x in runs[name].values()),
        "single": rec["checks"]["grid_trace_L"]["traced_peak_reserved"],
        "envelope": max(v["peak_reserved"] for n, v in rec["single"].items() if int(n) <= L),
        "envelope_fine": max(
            [v["peak_reserved"] for n, v in rec["single"].items() if int(n) <= L]
            + list(rec.get("fine", {}).values())
            + [rec["checks"]["grid_trace_L"]["traced_peak_reserved"]]  # the templates can fall short of the trace
        ),
    }


def _gib(x: int) -> str:
    return f"{x / GiB:.2f}"


def table(recs: list[dict[str, Any]]) -> str:
    """Per config and length set: single-shape reserved at each length, each order's run peak, and the run's
    peak against the single shape at its longest length and against the most any of its lengths reserves."""
    rows = [
        "| config | set | single-shape reserved GiB (by length) | "
        + " | ".join(o.replace("_", " ") for o in ORDERS)
        + " | worst run − single(longest) | worst run − max single |",
        "|---|---|---|" + "---:|" * (len(ORDERS) + 2),
    ]
    for rec in recs:
        for name, lens in rec["sets"].items():
            singles = {n: rec["single"][str(n)]["peak_reserved"] for n in lens}
            r = rec["runs"][name]
            worst = max(x["peak_reserved"] for x in r.values())
            rows.append(
                f"| {rec['id']} | {name} | "
                + ", ".join(f"{n}: {_gib(v)}" for n, v in singles.items())
                + " | "
                + " | ".join(_gib(r[o]["peak_reserved"]) for o in ORDERS)
                + f" | {(worst - singles[max(lens)]) / GiB:+.2f} | {(worst - max(singles.values())) / GiB:+.2f} |"
            )
    return "\n".join(rows)


def mechanisms(cid: str) -> str:
    """The switching mechanisms the estimate applies to the config (analytic/reserve/runs.py ``switches_on``)."""
    from vramledger.analytic.reserve.runs import switches_on
    from vramledger.analytic.step import step_parts

    model, train, _ = run_grid.specs(_rows()[cid])
    on = switches_on(model, train, step_parts(model, train))
    return "+".join(name for name, f in on._asdict().items() if f is not None) or "none"


def kept_bytes(rec: dict[str, Any]) -> int:
    """The most any measured order leaves free at its last longest step's peak in segments shorter steps made."""
    out = 0
    for name, r in rec["runs"].items():
        longest = f"L{max(rec['sets'][name])}"
        for x in r.values():
            by = x["free_at_last_longest_peak_by_length"]
            out = max(out, sum(v for k, v in by.items() if k not in (longest, "L0", "?")))
    return out


def summary(recs: list[dict[str, Any]]) -> str:
    """Per config: the single shape at L, the most any length ≤ L reserves on its own, the run that begins with
    its longest batch, the run that begins with the length ≤ L reserving the most, the worst order measured, and
    the bytes shorter steps' segments still hold free at the last longest step's peak; then per mechanism, how
    many runs reserve more than the single shape."""
    rows = [
        "| config | mechanisms (estimate) | single at L GiB | most any ℓ ≤ L alone | run, L first | "
        "run, that ℓ first (L if none) | worst order | kept free at the last L peak GiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    by: dict[str, list[dict[str, Any]]] = {}
    for rec in recs:
        ref, mech = rec["reference"], mechanisms(rec["id"])
        by.setdefault(mech, []).append(rec)
        single = ref["single"]
        first = rec["runs"]["grid"]["long_first"]["peak_reserved"]

        def pct(x: int, single: int = single) -> str:
            return f"{_gib(x)} ({x / single - 1:+.1%})"

        rows.append(
            f"| {rec['id']} | {mech} | {_gib(single)} | {pct(ref['envelope_fine'])} | {pct(first)} | "
            f"{pct(ref['run'])} | {pct(ref['worst'])} | {_gib(kept_bytes(rec))} |"
        )
    rows += [
        "",
        "| mechanisms | configs | most any ℓ ≤ L alone > single at L (+1%) | run, that ℓ first > single (+1%) | "
        "worst order > single (+1%) | segments of shorter steps kept free (≥ 64 MiB) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mech, group in sorted(by.items()):

        def count(key: str, group: list[dict[str, Any]] = group) -> int:
            return sum(r["reference"][key] > 1.01 * r["reference"]["single"] for r in group)

        kept = sum(kept_bytes(r) >= 64 * 2**20 for r in group)
        rows.append(
            f"| {mech} | {len(group)} | {count('envelope_fine')} | {count('run')} | {count('worst')} | {kept} |"
        )
    return "\n".join(rows)


def checks_table(recs: list[dict[str, Any]]) -> str:
    rows = ["| config | length | traced replay GiB | templates GiB | equal |", "|---|---:|---:|---:|---|"]
    for rec in recs:
        for c in rec["checks"].values():
            a, b = c["traced_peak_reserved"], c["templates_peak_reserved"]
            rows.append(
                f"| {rec['id']} | {c['length']} | {_gib(a)} | {_gib(b)} | {'yes' if a == b else f'{b - a:+,}'} |"
            )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", action="store_true", help="print the markdown tables")
    ap.add_argument("--only", help="one config id, printed, not saved")
    ap.add_argument("--refresh", action="store_true", help="recompute the reference figures only (no replay)")
    ap.add_argument("--fine", action="store_true", help="add the fine envelope where a record lacks it")
    ap.add_argument("--no-check", action="store_true", help="skip the real traces at L/4 and L/2")
    args = ap.parse_args()
    done: dict[str, dict[str, Any]] = {}
    if OUT.exists():
        done = {json.loads(line)["id"]: json.loads(line) for line in OUT.read_text().splitlines()}
    if args.fine:  # add the fine envelope to records written without it
        for cid, r in done.items():
            if "fine" not in r:
                r["fine"] = fine_single(templates_of(cid)[0], r["checks"]["grid_trace_L"]["length"])
                print(cid, flush=True)
        args.refresh = True
    if args.refresh:
        OUT.write_text("".join(json.dumps(r | {"reference": reference(r)}) + "\n" for r in done.values()))
        return
    if args.table:
        recs = [done[c] for c in _order() if c in done]
        print(summary(recs))
        print()
        print(checks_table(recs))
        print()
        print(table(recs))
        return
    if args.only:
        print(json.dumps(record(args.only, check=not args.no_check), indent=1))
        return
    for cid in _order():
        if cid in done:
            continue
        t0 = time.perf_counter()
        rec = record(cid, check=cid in CONFIGS and not args.no_check)
        done[cid] = rec
        with OUT.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"{cid:48s} {time.perf_counter() - t0:6.1f}s", flush=True)
        for name, r in rec["runs"].items():
            print(
                f"  {name}: {rec['sets'][name]} " + ", ".join(f"{o} {_gib(x['peak_reserved'])}" for o, x in r.items())
            )


if __name__ == "__main__":
    main()
