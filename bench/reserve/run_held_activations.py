"""Where the saved activations stay cached at step 1's optimizer peak (full fine-tuning, no checkpointing): the
replay behind analytic/reserve/held_activations.py.

For each (config, length) below, the config's step templates (bench/reserve/run_runs.py ``templates_of``: one trace,
every allocation re-derived at any length) are replayed through the allocator model, load and three steps at that
one length, recording who made each segment; written out:
- step 1's optimizer peak: allocated, and the free cached bytes in the segments forward made (activations, forward
  temporaries, autocast's casts; the logits chain's left out);
- the segments step 2 makes, and the peak reserved.

Run:  nice -n 10 python bench/reserve/run_held_activations.py   # ~1 min on a shared CPU (traces once per config)
Output: bench/reserve/held_activations.jsonl (bytes).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "src"))
sys.path.insert(0, str(HERE))

import run_runs  # noqa: E402

from vramledger.allocator.model import CachingAllocatorModel  # noqa: E402
from vramledger.simulate.engine import Replayer, Unit  # noqa: E402

OUT = HERE / "held_activations.jsonl"
SHAPES: dict[str, tuple[int, ...]] = {
    "llama-3.2-3b/full/b4/L768/nockpt/sdpa/bf16-true": (456, 552, 648, 720, 736, 737),
    "llama-3-8b/full/b1/L4096/nockpt/sdpa/bf16-true": (2048, 3968),
    "llama-3.2-1b/full/b2/L512/nockpt/sdpa": (512,),
    "llama-3.2-3b/full/b1/L1024/nockpt/sdpa": (1024,),
    "llama-3.2-1b/full/b1/L512/nockpt/sdpa/fp32": (448, 512),
}


def measure(cid: str, length: int) -> dict[str, Any]:
    t, _ = run_runs.templates_of(cid)
    units = [Unit(kind="load", step=0)] + [Unit(kind="train", step=k, lengths=(length,)) for k in (1, 2, 3)]
    rep = Replayer(t)
    alloc = CachingAllocatorModel()
    made_by: dict[int, str] = {}
    made_in_step_2 = 0
    opt1: tuple[int, Counter[str]] = (-1, Counter())
    for _, unit, ev, blk, new in run_runs.replay_mallocs(rep, alloc, units):
        phase, cat = (ev.phase.value if ev.phase else ""), (ev.category.value if ev.category else "")
        if new:
            made_by[blk.seg] = f"{phase} {cat}"
            made_in_step_2 += new if unit.step == 2 else 0
        if unit.step == 1 and phase == "optimizer" and alloc.allocated > opt1[0]:
            opt1 = (alloc.allocated, run_runs.free_by_maker(alloc, made_by))
    allocated, free = opt1
    forward = sum(v for k, v in free.items() if k.startswith("forward") and "logits_loss" not in k)
    return {
        "id": cid,
        "length": length,
        "opt1_allocated": allocated,
        "opt1_free_in_forward_segments": forward,
        "opt1_free": sum(free.values()),
        "made_in_step_2": made_in_step_2,
        "peak_reserved": alloc.peak_reserved,
    }


def main() -> None:
    with OUT.open("w") as f:
        for cid, lengths in SHAPES.items():
            for n in lengths:
                rec = measure(cid, n)
                f.write(json.dumps(rec) + "\n")
                print(cid, n, {k: round(v / 2**30, 3) for k, v in rec.items() if isinstance(v, int) and k != "length"})


if __name__ == "__main__":
    main()
