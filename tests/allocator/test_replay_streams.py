"""The offline check of real allocation streams (bench/accuracy/replay_streams.py) on hand-written streams.

The streams follow ``CUDACachingAllocator.cpp``'s rules as derived by hand here: a 3 MiB request is a large
block cut from a new 20 MiB segment (``get_allocation_size``: kLargeBuffer for requests up to kMinLargeAlloc
= 10 MiB), a 512 B request a small block from a new 2 MiB segment (kSmallBuffer), and ``emptyCache`` releases
the segments with nothing allocated in them.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

MIB = 2**20
ROOT = Path(__file__).resolve().parents[2]
ACTIONS = ["alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
           "segment_unmap", "oom", "snapshot"]  # fmt: skip
A = {name: i for i, name in enumerate(ACTIONS)}


@pytest.fixture(scope="module")
def replay_streams():  # type: ignore[no-untyped-def]
    path = ROOT / "bench" / "accuracy" / "replay_streams.py"
    spec = importlib.util.spec_from_file_location("replay_streams", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["replay_streams"] = mod
    spec.loader.exec_module(mod)
    return mod


def _stream(events: list[list[int]], empty_cache_at: int | None) -> dict[str, object]:
    return {"id": "hand", "alloc_conf": None, "actions": ACTIONS, "events": events,
            "empty_cache_at": empty_cache_at, "overflowed": False}  # fmt: skip


def test_a_stream_that_follows_the_rules_replays_identically(replay_streams) -> None:  # type: ignore[no-untyped-def]
    events = [
        [A["segment_alloc"], 0x1000, 20 * MIB, 0],
        [A["alloc"], 0x1000, 3 * MIB, 0],
        [A["segment_alloc"], 0x9000, 2 * MIB, 0],
        [A["alloc"], 0x9000, 512, 0],
        [A["free_requested"], 0x1000, 3 * MIB, 0],
        [A["free_completed"], 0x1000, 3 * MIB, 0],
        # empty_cache here (index 6): the 20 MiB segment holds nothing and goes back to the driver
        [A["segment_free"], 0x1000, 20 * MIB, 0],
        [A["segment_alloc"], 0x2000, 20 * MIB, 0],
        [A["alloc"], 0x2000, 4 * MIB, 0],
    ]
    got = replay_streams.compare(_stream(events, empty_cache_at=6))
    print("expected peak 22 MiB, no divergence; got", got)
    assert got.first_divergence is None
    assert got.real_peak_reserved == got.model_peak_reserved == 22 * MIB
    assert got.real_device_allocs == got.model_device_allocs == 3


def test_the_first_divergence_names_the_event(replay_streams) -> None:  # type: ignore[no-untyped-def]
    # A "real" cache that cut the 3 MiB block from a 4 MiB segment: the port (20 MiB) parts at event 1.
    events = [[A["segment_alloc"], 0x1000, 4 * MIB, 0], [A["alloc"], 0x1000, 3 * MIB, 0]]
    got = replay_streams.compare(_stream(events, empty_cache_at=None))
    assert got.first_divergence == 1
    assert "alloc 3145728 B" in got.divergence_event
    assert got.steps_error == pytest.approx((20 - 4) / 4)
