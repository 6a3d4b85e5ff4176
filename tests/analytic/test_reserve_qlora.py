"""QLoRA's estimate against the committed replays of its traced steps (bench/reserve/qlora_grid.jsonl).

The trace runs each 4-bit linear as bitsandbytes' ``Linear4bit`` and PEFT's 4-bit LoRA layer do (trace/shims.py
``bnb_linear4bit``), and its step is replayed through the allocator port; the committed figures are that replay
(regenerate with ``python bench/reserve/qlora_grid.py``; no tracing here). Each configuration is one shape, so the
estimate compared is a packed run's (every step at that shape), as ``test_reserve.py``'s packed column.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from vramledger.analytic import estimate
from vramledger.ledger import Phase

ROOT = Path(__file__).resolve().parents[2]
GRID = ROOT / "bench" / "reserve" / "qlora_grid.jsonl"
TOLERANCE = 0.03
# More than 3% from the replay, each with its measured cause; the one under is the only estimate allowed under -3%.
UNDER = {
    "qwen3-0.6b/qlora/b3/L2048/nockpt/sdpa/all": (
        "the backward thread's cuBLAS workspace takes an fp32 logits block: at the end of forward no other free block "
        "holds 32 MiB, since the final norm's fp32 input (4·H·T, 24 MiB) is cut from the last MLP block freed "
        "(c·I·T, 36 MiB) where the dequantised weights have cut the post-attention norm's; the estimate's rivals "
        "(q_norm's 48 MiB, the adapter's 36 MiB scaled output) count them whole (docs/reserve.md, \"QLoRA's grid\")"
    ),
}
MISSES = {
    "llama-3.2-1b/qlora/b1/L2048/ckpt/sdpa/dora/bf16-true": (
        "DoRA under checkpointing: its layer sequence (DoraLinearVariant.forward) is not replayed, so the one-layer "
        "bound of stranded_bytes stands (forward_cache.py), as for LoRA's DoRA"
    ),
    "qwen2.5-1.5b/qlora/b2/L1024/ckpt/eager/all": (
        "eager attention under checkpointing: its score blocks grow with length², the layer sequence is not "
        "replayed and the one-layer bound stands; the same setup with LoRA is +3.4% over its replay"
    ),
}


def _records() -> list[dict[str, Any]]:
    return [json.loads(line) for line in GRID.read_text().splitlines()]


def _grid():  # noqa: ANN202
    sys.path.insert(0, str(ROOT / "bench" / "reserve"))
    try:
        import qlora_grid
    finally:
        sys.path.pop(0)
    return qlora_grid


def _packed(cid: str) -> tuple[Any, Any]:
    g = _grid()
    model, train = g.specs({g.config_id(r): r for r in g.ROWS}[cid])
    return model, dataclasses.replace(train, packing=True)


def _peaks(cid: str) -> tuple[int, int]:
    model, train = _packed(cid)
    led = estimate(model, train)
    phases = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)
    return max(led.allocated(p) for p in phases), max(led.reserved(p) for p in phases)


def test_the_grid_covers_what_the_issue_asks() -> None:
    """At least 25 configurations: checkpointing on and off, SDPA and eager, 256 to 16k tokens, 0.5B to 8B shapes,
    bf16-mixed and bf16-true, LoRA and DoRA adapters."""
    ids = [r["id"] for r in _records()]
    assert len(ids) >= 25
    for part in ("/ckpt/", "/nockpt/", "/sdpa/", "/eager/", "/L256/", "/L16384/", "qwen2.5-0.5b/", "llama-3-8b/"):
        assert any(part in cid for cid in ids), part
    assert any(cid.endswith("bf16-true") for cid in ids) and any("/dora" in cid for cid in ids)


@pytest.mark.parametrize("rec", _records(), ids=lambda r: r["id"])
def test_allocated_within_half_a_percent_of_the_trace(rec: dict[str, Any]) -> None:
    allocated, _ = _peaks(rec["id"])
    assert abs(allocated / rec["trace"]["peak_allocated"] - 1) <= 0.005


@pytest.mark.parametrize("rec", _records(), ids=lambda r: r["id"])
def test_reserved_within_3_percent_of_the_replay(rec: dict[str, Any]) -> None:
    _, reserved = _peaks(rec["id"])
    gap = reserved / rec["trace"]["replay_peak_reserved"] - 1
    print(f"{rec['id']}: replay {rec['trace']['replay_peak_reserved'] / 2**30:.3f} GiB, estimate {gap:+.1%}")
    if rec["id"] in UNDER:
        assert gap < -TOLERANCE, "no longer under: take it out of UNDER"
        pytest.xfail(f"{gap:+.1%}: {UNDER[rec['id']]}")
    assert gap >= -TOLERANCE, "under the replay: only the listed one"
    if rec["id"] in MISSES:
        assert gap > TOLERANCE, "no longer a miss: take it out of MISSES"
        pytest.xfail(f"{gap:+.1%}: {MISSES[rec['id']]}")
    assert gap <= TOLERANCE
