"""Where step 1's AdamW states spill, at the lengths a run with dynamic padding meets: traced single shapes on both
sides of the two bounds of analytic/reserve/spill.py (the c·V·T logits block made again; one fp32 logits block
beside a tied embedding's V·H block), with what the replay of each makes again in step 2.

Run:  nice -n 10 python bench/reserve/run_spill.py           # traces what is missing (~1-4 min a shape, CPU)
      python bench/reserve/run_spill.py --analytic           # recompute the analytic terms only (instant)
      python bench/reserve/run_spill.py --table              # the table of docs/reserve.md "Where the states spill"
Output: bench/reserve/spill_shapes.jsonl, one record per shape: ``run_grid.replay_states`` (the states' bytes in
each logits block, the segments step 2 makes, the replay's peak reserved) and the analytic terms at that shape.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run_grid as g  # noqa: E402

OUT = Path(__file__).with_name("spill_shapes.jsonl")

# (row, the bound it checks). The lengths are those where runs.jsonl's sweep rises by about one block over the
# lengths beside it, and a length beside each where it does not.
SHAPES: list[tuple[g.Row, str]] = [
    (g.Row("qwen2.5-3b", "full", 2, 1984, True, "sdpa", "bf16-true"), "hole"),
    (g.Row("qwen2.5-3b", "full", 2, 2048, True, "sdpa", "bf16-true"), "hole"),
    (g.Row("qwen2.5-0.5b", "full", 1, 2048, True, "sdpa"), "hole"),
    (g.Row("qwen2.5-0.5b", "full", 1, 1024, True, "sdpa"), "hole"),
    (g.Row("llama-3.2-1b", "full", 1, 1856, True, "sdpa"), "tied"),
    (g.Row("llama-3.2-1b", "full", 1, 1024, True, "sdpa"), "tied"),
    (g.Row("qwen3-1.7b", "full", 2, 896, True, "sdpa"), "tied"),
    (g.Row("qwen3-1.7b", "full", 2, 512, True, "sdpa"), "tied"),
]


def analytic_terms(row: g.Row) -> dict[str, int]:
    """The blocks the estimate counts as made again in step 2 at the row's shape (the tied ones where on)."""
    from vramledger.analytic.reserve.full import relaid_counted, tied_gradient_block
    from vramledger.analytic.reserve.runs import switches_on
    from vramledger.analytic.reserve.spill import hole_remade, tied_remade
    from vramledger.analytic.step import step_parts

    model, train, _ = g.specs(row)
    p = step_parts(model, train)
    on = switches_on(model, train, p).tied
    tied = on is not None and on(train.micro_batch, train.seq_len)
    return {
        "relaid_counted": relaid_counted(model, train, p),
        "hole_remade": hole_remade(model, train, p),
        "tied_gradient_block": tied_gradient_block(p) if tied else 0,
        "tied_remade": tied_remade(model, train, p) if tied else 0,
    }


def table(records: list[dict[str, Any]]) -> str:
    rows = [
        "| shape | states / 4·V·T | states in the c·V·T block, the fp32 blocks (/ block) | step 2 makes again "
        "(/ 4·V·T) | replay reserved GiB | the estimate counts again (/ 4·V·T) |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for r in records:
        s, a = r["states"], r["analytic"]
        f = s["fp32_block"]
        chain = ", ".join(f"{b['states'] / b['bytes']:.2f}" for b in s["states_in_logits_blocks"])
        counted = sum(a.values()) / f
        rows.append(
            f"| {r['id']} | {s['states'] / f:.2f} | {chain} | {s['made_in_step_2_fp32_blocks']:.2f} | "
            f"{s['peak_reserved'] / 2**30:.2f} | {counted:.2f} |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", action="store_true", help="print the markdown table")
    ap.add_argument("--analytic", action="store_true", help="recompute the analytic terms only")
    args = ap.parse_args()
    records = [json.loads(line) for line in OUT.read_text().splitlines()] if OUT.exists() else []
    if args.table:
        print(table(records))
        return
    rows = {g.config_id(row): row for row, _ in SHAPES}
    if args.analytic:
        OUT.write_text("".join(json.dumps(r | {"analytic": analytic_terms(rows[r["id"]])}) + "\n" for r in records))
        return
    known = {r["id"] for r in records}
    for cid, row in rows.items():
        if cid in known:
            continue
        model, train, cfg = g.specs(row)
        rec = {"id": cid, "states": g.replay_states(model, train, cfg), "analytic": analytic_terms(row)}
        with OUT.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(cid, rec["states"]["made_in_step_2_fp32_blocks"], flush=True)


if __name__ == "__main__":
    main()
