"""Step 2's forward spilling into the logits chain (LoRA without checkpointing, SDPA): the trace replay against the
estimate's count, at any shape (analytic/reserve/forward_cache.py ``spilled_chain_blocks``; docs/reserve.md
"Packed runs: full fine-tuning and LoRA without checkpointing").

For each shape: the most of step 2's forward activations the replay keeps in step 1's logits-chain segments (the
c·V·T block and the fp32 4·V·T blocks), the fp32 blocks step 2 makes again, the blocks the estimate counts, and the
packed estimate against the single-shape replay.

Run:  nice -n 10 python bench/reserve/run_second_forward.py llama-3-8b 1x2048 2x2048 1x8192   (≈ 20 s a shape)
Prints one line a shape; writes nothing.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).parent))

import run_grid  # noqa: E402

from vramledger.allocator.model import CachingAllocatorModel  # noqa: E402
from vramledger.analytic import estimate  # noqa: E402
from vramledger.analytic.reserve.forward_cache import spilled_chain_blocks  # noqa: E402
from vramledger.analytic.reserve.runs import on_at  # noqa: E402
from vramledger.analytic.step import step_parts  # noqa: E402
from vramledger.ledger import Phase  # noqa: E402

MiB = 2**20


def replay(model: Any, train: Any, cfg: Any) -> tuple[Counter[str], int, int]:
    """The most of step 2's forward tensors in step 1's chain segments ("hole", "fp32"), the fp32 blocks step 2
    makes, and the replay's peak reserved."""
    F = 4 * model.vocab_size * train.tokens
    alloc = CachingAllocatorModel()
    live: dict[int, Any] = {}
    made: dict[int, tuple[int, str, int]] = {}  # segment → (step, category, bytes)
    step_of: dict[int, int] = {}
    most: Counter[str] = Counter()
    remade = 0
    for ev, step, blk, new in run_grid.replay_device(model, train, cfg, alloc, live):
        if blk is None:
            continue
        cat = ev.category.value if ev.category else ""
        step_of[ev.id] = step
        if new:
            made[blk.seg] = (step, cat, new)
            remade += step == 2 and cat == "logits_loss" and abs(new - F) < 2 * MiB
        if step == 2 and ev.phase is not None and ev.phase.value == "forward" and cat != "logits_loss":
            now: Counter[str] = Counter()
            for k, b in live.items():
                mk = made.get(b.seg) if b is not None else None
                if mk and mk[:2] == (1, "logits_loss") and step_of[k] == 2:
                    now["fp32" if mk[2] >= F * 0.9 else "hole"] += b.size
            most = Counter({k: max(most[k], now[k]) for k in {*most, *now}})
    return most, remade, alloc.peak_reserved


def main() -> None:
    name, shapes = sys.argv[1], sys.argv[2:]
    for shape in shapes:
        b, ell = map(int, shape.split("x"))
        model, train, cfg = run_grid.specs(run_grid._r(name, "lora", b, ell, False))  # noqa: SLF001
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            most, remade, reserved = replay(model, train, cfg)
        packed = dataclasses.replace(train, packing=True)  # the traced batch has no mask
        p = step_parts(model, packed)
        F = 4 * model.vocab_size * train.tokens
        lost = on_at(model, packed, p).workspace
        counted = int(lost) + spilled_chain_blocks(model, packed, p, workspace_lost=lost) // F
        led = estimate(model, packed)
        est = max(led.reserved(ph) for ph in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER))
        in_chain = ", ".join(f"{k} {v / MiB:.0f}" for k, v in sorted(most.items())) or "none"
        print(
            f"{name} {shape}: step 2's forward in the chain (MiB, c·V·T = {F / 2 / MiB:.0f}): {in_chain}; fp32 blocks "
            f"made again: replay {remade}, estimate {counted}; packed {est / 2**30:.2f} GiB against the replay's "
            f"{reserved / 2**30:.2f} ({est / reserved - 1:+.1%})",
            flush=True,
        )


if __name__ == "__main__":
    main()
