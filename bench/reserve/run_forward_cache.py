"""The free cache at the end of a traced LoRA forward, against analytic/reserve/forward_cache.py, and the load's segment
tails against analytic/reserve/load_residue.py.

For each LoRA config of the grid without checkpointing (bench/reserve/run_grid.py): trace two training steps
(``vramledger.trace``), replay step 1 through the caching-allocator model, and record reserved − allocated at the
start of each decoder layer and once the final norm is done (at lm_head), less what was free before the first
layer; then the first layer's share (W1) and the mean per later layer (r). ``large``: the residual stream's
requests (c·H·T) are above the allocator's 10 MiB threshold, as the bulk of a layer's are, so that the layout
scales with T as analytic/reserve/forward_cache.py assumes; below it, 20 MiB segments serve them. And the large pool's
free blocks once the base is loaded, and those of the load's segments still free at step 2's peak.

Under checkpointing (``CKPT_CONFIGS``), also: the large pool's free blocks at step 2's peak in the segments step 1's
forward made for the layers (every maker but the logits chain's), the figure ``checkpointed_forward_cache`` models;
and the large segments step 1's backward made for anything but the logits chain (none: its recomputed layers are cut
from the freed logits blocks).

Run:  nice -n 10 python bench/reserve/run_forward_cache.py   # traces each config (~10-60 s each)
      nice -n 10 python bench/reserve/run_forward_cache.py --ckpt   # the configs under checkpointing
      python bench/reserve/run_forward_cache.py --analytic   # recompute the analytic columns only (both files)
      python bench/reserve/run_forward_cache.py --table      # the tables of docs/reserve.md
Output: bench/reserve/forward_cache.jsonl and forward_cache_ckpt.jsonl, one JSON object per config (bytes).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).parent))

import run_grid  # noqa: E402

MiB = 2**20
OUT = Path(__file__).with_name("forward_cache.jsonl")
CKPT_OUT = Path(__file__).with_name("forward_cache_ckpt.jsonl")
CONFIGS = [
    "mid/lora/b1/L4096/nockpt/sdpa",
    "gemma-2-2b/lora/b2/L1024/nockpt/eager",
    "tiny/lora/b4/L512/nockpt/sdpa",
    "qwen2.5-0.5b/lora/b1/L2048/nockpt/sdpa",
    "llama-3.2-1b/lora/b1/L1024/nockpt/sdpa",
    "qwen3-0.6b/lora/b4/L512/nockpt/sdpa",
    "qwen2.5-1.5b/lora/b1/L8192/nockpt/sdpa",
    "qwen2.5-3b/lora/b4/L2048/nockpt/sdpa",
    "phi-3-mini-4k/lora/b4/L1024/nockpt/sdpa",
]
CKPT_CONFIGS = [
    "tiny/lora/b1/L2048/ckpt/sdpa",
    "mid/lora/b8/L512/ckpt/sdpa",
    "qwen2.5-0.5b/lora/b4/L1024/ckpt/sdpa",
    "llama-3.2-1b/lora/b2/L2048/ckpt/sdpa",
    "qwen3-1.7b/lora/b1/L4096/ckpt/sdpa",
    "llama-3.2-3b/lora/b2/L4096/ckpt/sdpa",
    "qwen3-8b/lora/b2/L4096/ckpt/sdpa",
    "llama-3-8b/lora/b1/L16384/ckpt/sdpa",
    "qwen2.5-7b/lora/b1/L16384/ckpt/sdpa",
    "qwen3-4b/lora/b1/L16384/ckpt/sdpa",
]
_LAYER = re.compile(r"layers\.(\d+)\.")


def measure(cid: str) -> dict[str, Any]:
    from vramledger.allocator.model import CachingAllocatorModel
    from vramledger.allocator.replay import EventKind
    from vramledger.trace.api import trace_events
    from vramledger.trace.oom import device_events

    rows = {run_grid.config_id(r): r for r in run_grid.GRID}
    model, train, cfg = run_grid.specs(rows[cid])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        events = trace_events(model, train, config=cfg)
    dev = device_events(events, None)
    alloc = CachingAllocatorModel()
    live: dict[int, Any] = {}
    free_at: dict[int | str, int] = {}
    loaded: set[int] = set()  # the segments the load made
    layers_made: set[int] = set()  # the large segments step 1's forward made for anything but the logits chain
    backward_made = 0  # bytes of large segments step 1's backward made for anything but the logits chain
    load_free = load_free_at_peak = layers_free_at_peak = peak = 0
    for ev, src in zip(dev.events, dev.origin, strict=True):
        e = events[src] if src >= 0 else None
        step = e.step if e is not None else 1
        if step >= 1 and not load_free:
            load_free = sum(size for size, _ in alloc.free_layout()[2])
        if e is not None and e.step == 1 and e.phase.value == "forward":
            hit = _LAYER.search(e.module)
            key: int | str | None = int(hit.group(1)) if hit else ("head" if e.module.endswith("lm_head") else None)
            if key is not None and key not in free_at:
                free_at[key] = alloc.reserved - alloc.allocated
        if ev.kind is EventKind.ALLOC:
            before = alloc.reserved
            blk = alloc.malloc(ev.size) if ev.size else None
            live[ev.id] = blk
            if blk is not None and step == 0:
                loaded.add(blk.seg)
            if blk is not None and alloc.reserved > before and step == 1 and not blk.small:
                chain = ev.category is not None and ev.category.value == "logits_loss"
                if e is not None and e.phase.value == "forward" and not chain:
                    layers_made.add(blk.seg)
                elif e is not None and e.phase.value == "backward" and not chain:
                    backward_made += alloc.reserved - before
        else:
            blk = live.pop(ev.id)
            if blk is not None:
                alloc.free(blk)
        if step == 2 and alloc.allocated > peak:  # free blocks of the load's segments at step 2's peak
            peak = alloc.allocated
            load_free_at_peak = sum(b.size for _, a in alloc._large.keys if (b := alloc._large.blocks[a]).seg in loaded)
            layers_free_at_peak = sum(
                b.size for _, a in alloc._large.keys if (b := alloc._large.blocks[a]).seg in layers_made
            )
    n = max(k for k in free_at if isinstance(k, int)) + 1
    c = train.precision.compute.bytes
    return (
        {
            "id": cid,
            "layers": n,
            "trace_free_after_norm": free_at["head"] - free_at[0],
            "trace_w1": free_at[1] - free_at[0],
            "trace_r": (free_at[n - 1] - free_at[1]) // max(n - 2, 1),
            "large": c * model.hidden_size * train.tokens >= 10 * 2**20,
            "trace_load_free": load_free,
            "trace_load_free_at_peak": load_free_at_peak,
        }
        | (
            {"trace_layers_free_at_peak": layers_free_at_peak, "trace_backward_made": backward_made}
            if train.grad_ckpt
            else {}
        )
        | analytic(cid)
    )


def analytic(cid: str) -> dict[str, int]:
    from vramledger.analytic.reserve.forward_cache import adapter_forward_cache, checkpointed_forward_cache
    from vramledger.analytic.reserve.load_residue import load_tails
    from vramledger.analytic.step import step_parts

    model, train, _ = run_grid.specs({run_grid.config_id(r): r for r in run_grid.GRID}[cid])
    p = step_parts(model, train)
    cache = checkpointed_forward_cache(model, train, p) if train.grad_ckpt else adapter_forward_cache(model, train, p)
    return {"analytic": cache or 0, "analytic_load_tails": load_tails(model, train, p)}


def _markdown(header: list[str], recs: list[dict[str, Any]], cells: Callable[[dict[str, Any]], list[str]]) -> str:
    """A markdown table: one row per record, the config (marked where its requests are under 10 MiB), then
    ``cells``."""
    rows = ["| config | " + " | ".join(header) + " |", "|---|" + "---:|" * len(header)]
    for r in recs:
        name = f"{r['id']}{'' if r['large'] else ' (requests < 10 MiB)'}"
        rows.append(f"| {name} | " + " | ".join(cells(r)) + " |")
    return "\n".join(rows)


def _gap(a: int, t: int) -> str:
    return f"{100 * (a / t - 1):+.0f}%"


def table(recs: list[dict[str, Any]]) -> str:
    header = ["layers", "traced W1 MiB", "traced r MiB/layer", "traced free at lm_head MiB", "analytic MiB", "gap"]
    return _markdown(
        header,
        recs,
        lambda r: [
            str(r["layers"]),
            f"{r['trace_w1'] / MiB:.0f}",
            f"{r['trace_r'] / MiB:.1f}",
            f"{r['trace_free_after_norm'] / MiB:.0f}",
            f"{r['analytic'] / MiB:.0f}",
            _gap(r["analytic"], r["trace_free_after_norm"]),
        ],
    )


def ckpt_table(recs: list[dict[str, Any]]) -> str:
    header = [
        "traced free at lm_head, step 1 MiB",
        "traced free at step 2's peak (layers' segments) MiB",
        "analytic MiB",
        "gap",
        "step 1's backward's own segments MiB",
    ]
    return _markdown(
        header,
        recs,
        lambda r: [
            f"{r['trace_free_after_norm'] / MiB:.0f}",
            f"{r['trace_layers_free_at_peak'] / MiB:.0f}",
            f"{r['analytic'] / MiB:.0f}",
            _gap(r["analytic"], r["trace_layers_free_at_peak"]),
            f"{r['trace_backward_made'] / MiB:.0f}",
        ],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", action="store_true", help="print the table (markdown)")
    ap.add_argument("--analytic", action="store_true", help="recompute the analytic columns only (instant)")
    ap.add_argument("--ckpt", action="store_true", help="trace the configs under checkpointing")
    args = ap.parse_args()
    if args.table:
        print(table([json.loads(line) for line in OUT.read_text().splitlines()]))
        print()
        print(ckpt_table([json.loads(line) for line in CKPT_OUT.read_text().splitlines()]))
        return
    if args.analytic:
        for path in (OUT, CKPT_OUT):
            recs = [json.loads(line) | analytic(json.loads(line)["id"]) for line in path.read_text().splitlines()]
            path.write_text("".join(json.dumps(r) + "\n" for r in recs))
        return
    recs = []
    for cid in CKPT_CONFIGS if args.ckpt else CONFIGS:
        recs.append(measure(cid))
        print(json.dumps(recs[-1]), flush=True)
    (CKPT_OUT if args.ckpt else OUT).write_text("".join(json.dumps(r) + "\n" for r in recs))


if __name__ == "__main__":
    main()
