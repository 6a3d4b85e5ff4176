"""The CPU-checkable pieces of bench/ground_truth: the length sequence, snapshot trimming, derived numbers.

The scripts themselves are proven by ``--device cpu --smoke`` runs (see bench/ground_truth/run_all.sh).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "ground_truth"))

whole_run = pytest.importorskip("whole_run")
oom_fixtures = pytest.importorskip("oom_fixtures")
constants = pytest.importorskip("constants")


def test_lengths_are_reproducible_and_clipped() -> None:
    a = whole_run.sample_lengths(800, seed=0, mu=math.log(300), sigma=0.8, lo=16, hi=2048)
    b = whole_run.sample_lengths(800, seed=0, mu=math.log(300), sigma=0.8, lo=16, hi=2048)
    assert a == b
    assert min(a) >= 16 and max(a) <= 2048
    median = sorted(a)[len(a) // 2]
    print("expected median ~300, got", median)
    assert 240 < median < 370


def test_lengths_record_pads_each_batch_to_its_longest() -> None:
    cfg = whole_run.RunConfig(steps=5, micro_batch=4)
    rec = whole_run.lengths_record(cfg)
    assert len(rec["train_lengths"]) == 20
    assert rec["train_batch_padded_len"] == [max(rec["train_lengths"][i : i + 4]) for i in range(0, 20, 4)]


def test_trim_snapshot_keeps_blocks_cuts_trace_and_frames() -> None:
    frames = [{"filename": "f.py", "line": i, "name": "g"} for i in range(20)]
    snap = {
        "segments": [
            {
                "total_size": 100,
                "allocated_size": 40,
                "blocks": [
                    {"size": 40, "state": "active_allocated", "frames": frames},
                    {"size": 60, "state": "inactive", "frames": []},
                ],
            }
        ],
        "device_traces": [[{"action": "alloc", "size": 1, "frames": frames}] * 10],
        "allocator_settings": {"x": 1},
    }
    t = oom_fixtures.trim_snapshot(snap, keep_trace=3, keep_frames=8)
    assert len(t["segments"][0]["blocks"]) == 2
    assert len(t["segments"][0]["blocks"][0]["frames"]) == 8
    assert len(t["device_traces"][0]) == 3 and len(t["device_traces"][0][0]["frames"]) == 8
    assert t["allocator_settings"] == {"x": 1}
    assert len(snap["segments"][0]["blocks"][0]["frames"]) == 20  # the original is untouched
    facts = oom_fixtures.snapshot_facts(t)
    assert facts == {
        "segments": 1,
        "reserved": 100,
        "allocated": 40,
        "free_blocks": 1,
        "largest_free_block": 60,
        "free_in_segments": 60,
    }


def test_derive_ratios() -> None:
    base = {"model": "m", "method": "lora", "batch": 8, "seq": 1024}
    rows = [
        {**base, "grad_ckpt": False, "grad_accum": 1, "median_step_s": 1.0},
        {**base, "grad_ckpt": True, "grad_accum": 1, "median_step_s": 1.3},
        {**base, "grad_ckpt": False, "grad_accum": 4, "median_step_s": 1.6},
        {**base, "grad_ckpt": False, "grad_accum": 2, "error": "OutOfMemoryError"},
    ]
    d = constants.derive(rows)
    assert d["grad_ckpt"][0]["ckpt_over_plain_time"] == pytest.approx(1.3)
    assert d["grad_accum"] == [
        {**base, "k": 4, "step_s_k": 1.6, "step_s_1": 1.0, "overhead_per_extra_micro_step_s": pytest.approx(0.2)}
    ]
