"""Step 1's reserve at its loss's backward under checkpointing, replayed, against ``reserve/ckpt_forward.py``.

For each full fine-tuning config of the grid with checkpointing (bench/reserve/run_grid.py ``GRID``): trace two
steps, replay them through the allocator model (as ``run_grid.py --causes`` does) and record, at step 1's
``_log_softmax_backward_data`` allocation (the loss's backward peak), the reserved and allocated bytes, the
segments step 1's forward made before lm_head and what of them is free there, and the reserved bytes before step
1's optimizer. ``forward_segments`` must never exceed the reserved figure (it is a lower bound).

Run:  python bench/reserve/run_ckpt_forward.py            # traces what is missing from ckpt_forward.jsonl
      python bench/reserve/run_ckpt_forward.py --table    # the markdown table of docs/reserve.md
Output: bench/reserve/ckpt_forward.jsonl, one JSON object per config (bytes everywhere).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run_grid  # noqa: E402

OUT = Path(__file__).with_name("ckpt_forward.jsonl")


def measure(model: Any, train: Any, cfg: dict[str, Any] | None) -> dict[str, Any]:
    from vramledger.allocator.model import CachingAllocatorModel
    from vramledger.allocator.replay import EventKind
    from vramledger.ledger import Phase

    alloc = CachingAllocatorModel()
    forward: set[int] = set()  # segments made by step 1's forward before lm_head
    forward_bytes = 0
    head_seen = False
    out: dict[str, Any] = {}
    for ev, step, blk, new in run_grid.replay_device(model, train, cfg, alloc):
        if step == 1 and ev.phase is Phase.OPTIMIZER and "reserved_before_optimizer" not in out:
            out["reserved_before_optimizer"] = alloc.reserved - new
        if ev.kind is EventKind.FREE:
            continue
        head_seen = head_seen or (step == 1 and ev.module.startswith("lm_head"))
        if blk is not None and new and step == 1 and ev.phase is Phase.FORWARD and not head_seen:
            forward.add(blk.seg)
            forward_bytes += new
        if step == 1 and ev.op == "_log_softmax_backward_data" and "reserved_at_loss_backward" not in out:
            free = 0
            for _, addr in alloc._large.keys + alloc._small.keys:
                b = alloc._large.blocks.get(addr) or alloc._small.blocks[addr]
                free += b.size if b.seg in forward else 0
            out |= {
                "reserved_at_loss_backward": alloc.reserved,
                "allocated_at_loss_backward": alloc.allocated,
                "forward_segments_bytes": forward_bytes,
                "forward_free_at_loss_backward": free,
            }
    return out


def table(done: dict[str, dict[str, Any]]) -> str:
    from vramledger.analytic.reserve.ckpt_forward import forward_segments
    from vramledger.analytic.step import step_parts

    rows = {run_grid.config_id(r): r for r in run_grid.GRID}
    lines = [
        "| config | replayed at step 1's loss backward GB | free in the forward's segments there GB "
        "| before step 1's optimizer GB | `forward_segments` GB | gap |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for cid, rec in done.items():
        model, train, _ = run_grid.specs(rows[cid])
        bound = forward_segments(model, train, step_parts(model, train, run_grid.GPU))
        ref = rec["reserved_at_loss_backward"]
        lines.append(
            f"| {cid} | {ref / 1e9:.2f} | {rec['forward_free_at_loss_backward'] / 1e9:.2f} "
            f"| {rec['reserved_before_optimizer'] / 1e9:.2f} | {bound / 1e9:.2f} | {100 * (bound / ref - 1):+.1f}% |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", action="store_true", help="print the comparison table (markdown)")
    args = ap.parse_args()
    done: dict[str, dict[str, Any]] = {}
    if OUT.exists():
        done = {r["id"]: r for r in map(json.loads, OUT.read_text().splitlines())}
    if args.table:
        print(table(done))
        return
    for row in run_grid.GRID:
        cid = run_grid.config_id(row)
        if row.method != "full" or not row.ckpt or cid in done:
            continue
        model, train, cfg = run_grid.specs(row)
        rec = {"id": cid, **measure(model, train, cfg)}
        with OUT.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(cid, rec["reserved_at_loss_backward"], flush=True)


if __name__ == "__main__":
    main()
