"""Where step 1's AdamW states sit in the MLP activation segments, and what those segments leave free at step 2's peak.

For each shape: the grid config's step templates (bench/reserve/run_runs.py ``templates_of``: one trace, every
allocation re-derived at any length; cached in .streams/), replayed for the load and two steps at that length
through the allocator model (``simulate.engine.Replayer``); recorded: peak reserved, the MLP activation segments
step 1 made (the activations' segments of seg(c·I·T) bytes), how many of them hold a state of step 1, and their
free bytes at step 2's peak allocated. The measurement behind analytic/reserve/state_rests.py (docs/reserve.md,
"States in every MLP activation segment") and tests/analytic/test_reserve_state_rests.py.

Run:  nice -n 10 python bench/reserve/run_state_rests.py          # replays what is missing (a minute a config)
      python bench/reserve/run_state_rests.py --table             # the markdown table of docs/reserve.md
Output: bench/reserve/state_rests.jsonl, one JSON object per shape (bytes everywhere).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "src"))
sys.path.insert(0, str(HERE))

import run_grid  # noqa: E402
import run_runs  # noqa: E402

OUT = HERE / "state_rests.jsonl"
# (grid config, lengths at its micro-batch): the band of Qwen2.5-1.5B and both sides of it, and Llama-3.2-1B
# shapes where the rests only hold the states at some segments (the band's conditions fail).
SHAPES: dict[str, tuple[int, ...]] = {
    "qwen2.5-1.5b/full/b4/L1024/nockpt/sdpa": (896, 906, 907, 920, 928, 936, 937, 960),
    "llama-3.2-1b/full/b4/L1024/nockpt/sdpa/bf16-true": (640, 656, 672),
    "llama-3.2-1b/full/b2/L512/nockpt/sdpa": (2624, 2656, 2688),
}


def measure(cid: str, length: int) -> dict[str, Any]:
    """Replay the load and two steps of ``cid`` at ``length``; see the module docstring."""
    from vramledger.allocator.conf import allocation_size, round_size
    from vramledger.allocator.model import CachingAllocatorModel
    from vramledger.simulate.engine import Replayer

    templates, _ = run_runs.templates_of(cid)
    model, train, _ = run_grid.specs({run_grid.config_id(r): r for r in run_grid.GRID}[cid])
    seg = allocation_size(
        round_size(train.precision.compute.bytes * model.intermediate_size * train.micro_batch * length)
    )
    rep = Replayer(templates)
    alloc = CachingAllocatorModel()
    made: dict[int, tuple[int, str, int]] = {}  # segment → (step, category, bytes)
    states: Counter[int] = Counter()
    peak_allocated, free_at_peak = -1, 0
    for _, unit, ev, blk, new in run_runs.replay_mallocs(rep, alloc, run_runs._units([length, length])):  # noqa: SLF001
        cat = ev.category.value if ev.category else ""
        if new:
            made[blk.seg] = (unit.step, cat, new)
        if unit.step == 1 and cat == "optimizer_state":
            states[blk.seg] += 1
        if unit.step == 2 and alloc.allocated > peak_allocated:
            peak_allocated, free_at_peak = alloc.allocated, _free_in(alloc, made, seg)
    mlp = [s for s, (step, cat, size) in made.items() if step == 1 and cat == "activations" and size == seg]
    return {
        "id": cid,
        "micro_batch": train.micro_batch,
        "seq_len": length,
        "peak_reserved": alloc.peak_reserved,
        "mlp_segment": seg,
        "mlp_segments": len(mlp),
        "mlp_segments_with_states": sum(1 for s in mlp if states[s]),
        "free_in_them_at_step_2_peak": free_at_peak,
    }


def _free_in(alloc: Any, made: dict[int, tuple[int, str, int]], seg: int) -> int:
    """Free bytes now in the MLP activation segments step 1 made."""
    free = 0
    for _, addr in alloc._large.keys:  # noqa: SLF001
        blk = alloc._large.blocks[addr]  # noqa: SLF001
        step, cat, size = made.get(blk.seg, (0, "", 0))
        if step == 1 and cat == "activations" and size == seg:
            free += blk.size
    return free


def analytic(rec: dict[str, Any]) -> dict[str, Any]:
    """The estimate at the record's shape: the band, its term, and the single shape's reserve with every mechanism
    on there, without and with it."""
    from vramledger.analytic.reserve.runs import _closed_switches
    from vramledger.analytic.reserve.shape import single_shape
    from vramledger.analytic.reserve.state_rests import rests_band, state_rests_cached
    from vramledger.analytic.reserve.switches import Switching
    from vramledger.analytic.step import _ShapePeaks

    model, train, _ = run_grid.specs({run_grid.config_id(r): r for r in run_grid.GRID}[rec["id"]])
    t = dataclasses.replace(train, seq_len=rec["seq_len"])
    p, loss, step, opt = _ShapePeaks(model, None)(t)
    b, ell = t.micro_batch, t.seq_len
    on = Switching(relaid=True, **{k: True for k, holds in _closed_switches(model, t, p).items() if holds(b, ell)})
    band = rests_band(model, t, p)
    return {
        "band": bool(band and band(b, ell)),
        "term": state_rests_cached(model, t, p),
        "without": single_shape(model, t, p, loss, step, opt, on),
        "with": single_shape(model, t, p, loss, step, opt, on._replace(state_rests=True)),
    }


def table(recs: list[dict[str, Any]]) -> str:
    gb = 1e9
    rows = [
        "| shape | MLP segments holding a state | free in them at step 2's peak GB | replay reserved GB | band | "
        "counted GB | estimate without, with it |",
        "|---|---:|---:|---:|---|---:|---|",
    ]
    for r in recs:
        a = analytic(r)
        name = (
            r["id"].split("/")[0]
            + f"/full {r['micro_batch']} × {r['seq_len']}"
            + (" bf16-true" if "bf16-true" in r["id"] else "")
        )
        rows.append(
            f"| {name} | {r['mlp_segments_with_states']} of {r['mlp_segments']} | "
            f"{r['free_in_them_at_step_2_peak'] / gb:.2f} | {r['peak_reserved'] / gb:.2f} | "
            f"{'on' if a['band'] else 'off'} | {a['term'] / gb if a['band'] else 0:.2f} | "
            f"{a['without'] / r['peak_reserved'] - 1:+.1%}, {a['with'] / r['peak_reserved'] - 1:+.1%} |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", action="store_true", help="print the markdown table")
    args = ap.parse_args()
    done = [json.loads(line) for line in OUT.read_text().splitlines()] if OUT.exists() else []
    if args.table:
        print(table(done))
        return
    known = {(r["id"], r["seq_len"]) for r in done}
    for cid, lengths in SHAPES.items():
        for length in lengths:
            if (cid, length) in known:
                continue
            rec = measure(cid, length)
            with OUT.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            print(cid, length, rec["mlp_segments_with_states"], rec["free_in_them_at_step_2_peak"], flush=True)


if __name__ == "__main__":
    main()
