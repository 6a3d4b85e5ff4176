"""Snapshots: every on-disk form reads the same; the live blocks land in the buckets worked out by hand in
conftest.BLOCKS; the fragmentation is found from the blocks; nothing in a pickle can run."""

from __future__ import annotations

import gzip
import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest

from tests.explain.conftest import BLOCKS, REQUEST, MiB, make_snapshot
from vramledger.errors import VramledgerError
from vramledger.explain import explain, read_evidence
from vramledger.explain.attribute import Bucket, attribute, traced_allocs
from vramledger.explain.postmortem import Diagnosis
from vramledger.explain.snapshot import facts


def _write_all(tmp_path: Path, snap: dict[str, Any]) -> list[Path]:
    """The four forms: _dump_snapshot's pickle, gzipped, and oom_fixtures.py's JSON (gzipped and not)."""
    p = tmp_path / "dump_snapshot.pickle"
    p.write_bytes(pickle.dumps(snap))  # torch.cuda.memory._dump_snapshot: pickle.dump(_snapshot(), f)
    pgz = tmp_path / "oom_x.snapshot.pickle.gz"
    with gzip.open(pgz, "wb") as f:
        pickle.dump(snap, f)
    j = tmp_path / "snap.json"
    j.write_text(json.dumps(snap, default=str))
    jgz = tmp_path / "oom_x.snapshot.json.gz"
    with gzip.open(jgz, "wt") as f:
        json.dump(snap, f, default=str)
    return [p, pgz, j, jgz]


def test_every_form_reads_the_same(tmp_path: Path, snapshot: dict[str, Any]) -> None:
    results = []
    for path in _write_all(tmp_path, snapshot):
        ev = read_evidence(path)
        assert ev.snapshot is not None
        results.append((ev.snapshot.reserved_bytes, ev.snapshot.allocated_bytes, ev.shares))
    assert all(r == results[0] for r in results)


def test_totals_and_the_failed_request(snapshot: dict[str, Any]) -> None:
    f = facts(snapshot)
    live = sum(s for _, s, st, *_ in BLOCKS if st != "inactive")
    assert (f.reserved_bytes, f.allocated_bytes) == (sum(s for _, s, *_ in BLOCKS), live)
    assert (f.cached_free_bytes, f.largest_free_block_bytes) == (560 * MiB, 300 * MiB)
    assert (f.oom_request_bytes, f.oom_device_free_bytes) == (REQUEST, 12 * MiB)


def test_blocks_land_in_the_buckets_worked_out_by_hand(snapshot: dict[str, Any]) -> None:
    f = facts(snapshot)
    got = {s.bucket.value: s.bytes for s in attribute(f, traced_addresses=traced_allocs(snapshot))}
    want: dict[str, int] = {}
    for bucket, size, state, *_ in BLOCKS:
        if state != "inactive":
            want[bucket] = want.get(bucket, 0) + size
    print("expected", want, "\ngot     ", got)
    assert got == want


def test_addresses_known_to_the_callback_win_over_frames(snapshot: dict[str, Any]) -> None:
    f = facts(snapshot)
    weights_addr = snapshot["segments"][0]["blocks"][0]["address"]
    shares = {
        s.bucket: s.bytes
        for s in attribute(f, traced_addresses=traced_allocs(snapshot), known={weights_addr + 4096: Bucket.WEIGHTS})
    }
    from_frames = sum(size for bucket, size, *_ in BLOCKS if bucket == "weights")
    assert shares[Bucket.WEIGHTS] == 200 * MiB + from_frames and Bucket.UNRECORDED not in shares


def test_fragmentation_from_the_blocks(snapshot: dict[str, Any], tmp_path: Path) -> None:
    pm = explain(read_evidence(_write_all(tmp_path, snapshot)[0]))
    # 560 MiB free in the cache >= the 400 MiB asked, but the largest free block is 300 MiB
    assert pm.diagnosis is Diagnosis.FRAGMENTATION
    assert (pm.requested_bytes, pm.largest_free_block_bytes) == (REQUEST, 300 * MiB)


def test_one_free_block_large_enough_is_not_fragmentation(tmp_path: Path) -> None:
    snap = make_snapshot()
    blocks = snap["segments"][0]["blocks"]
    blocks[1]["size"] += blocks[3]["size"]  # merge the two holes: 560 MiB in one free block
    del blocks[3]
    snap["device_traces"][0][-1]["size"] = 600 * MiB  # and ask for more than all the cache holds
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(snap))
    assert explain(read_evidence(path)).diagnosis is not Diagnosis.FRAGMENTATION


class _Boom:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned > /dev/null",))


def test_a_pickle_with_code_in_it_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "x": _Boom()}))
    with pytest.raises(VramledgerError, match="refusing posix.system|refusing os.system"):
        read_evidence(path)


def test_the_ground_truth_record_with_its_snapshot(tmp_path: Path, snapshot: dict[str, Any]) -> None:
    """``oom_<case>.json`` + ``oom_<case>.snapshot.pickle.gz``, as bench/ground_truth/oom_fixtures.py
    ``run_case`` and ``save_snapshot`` write them."""
    with gzip.open(tmp_path / "oom_backward.snapshot.pickle.gz", "wb") as f:
        pickle.dump(snapshot, f)
    record = {
        "case": "backward",
        "status": "oom",
        "phase": "backward",
        "message": "CUDA out of memory. Tried to allocate 400.00 MiB. GPU 0 has a total capacity of 79.19 GiB of "
        "which 12.00 MiB is free. Of the allocated memory 464.00 MiB is allocated by PyTorch, and "
        "560.00 MiB is reserved by PyTorch but unallocated.",
        "at_oom": {
            "phase": "backward",
            "requested": REQUEST,
            "observer_limit_or_total": 1100 * MiB,
            "observer_device_free": 12 * MiB,
            "allocated": 464 * MiB,
            "reserved": 1024 * MiB,
        },
        "snapshot_files": {"pickle": "oom_backward.snapshot.pickle.gz", "json": "oom_backward.snapshot.json.gz"},
    }
    (tmp_path / "oom_backward.json").write_text(json.dumps(record))
    ev = read_evidence(tmp_path / "oom_backward.json")
    assert ev.snapshot is not None and ev.message is not None and ev.phase == "backward"
    pm = explain(ev)
    assert (pm.capacity_bytes, pm.diagnosis) == (1100 * MiB, Diagnosis.FRAGMENTATION)


def test_the_ground_truth_record_of_a_cpu_smoke_run(tmp_path: Path) -> None:
    """``oom_fixtures.py --device cpu --smoke`` records a simulated OOM: no CUDA message, no snapshot, the byte
    counter's figures in ``at_oom`` (keys as that script writes them)."""
    record = {
        "case": "backward",
        "status": "oom",
        "phase": "backward",
        "message": "simulated CPU OOM in aten._log_softmax_backward_data.default: tried to allocate 262144 bytes; "
        "2209608 bytes live exceed the fake capacity 2156368",
        "at_oom": {
            "phase": "backward",
            "requested": 262144,
            "allocated": 2209608,
            "reserved": 2209608,
            "max_allocated": 2209608,
            "max_reserved": 2209608,
            "memory_stats": None,
        },
        "requested": 262144,
    }
    (tmp_path / "oom_backward.json").write_text(json.dumps(record))
    pm = explain(read_evidence(tmp_path / "oom_backward.json"))
    assert (pm.requested_bytes, pm.allocated_bytes, pm.evidence.message) == (262144, 2209608, None)
    assert pm.diagnosis is Diagnosis.CAPACITY and pm.evidence.phase == "backward"


def test_the_failing_device_is_found(tmp_path: Path) -> None:
    """A snapshot of GPU 1 (segments say device 1, the oom is in device_traces[1]) reads as GPU 1's."""
    snap = make_snapshot()
    snap["segments"][0]["device"] = 1
    snap["device_traces"] = [[], snap["device_traces"][0]]
    path = tmp_path / "gpu1.pickle"
    path.write_bytes(pickle.dumps(snap))
    ev = read_evidence(path)
    assert ev.snapshot is not None and ev.snapshot.oom_request_bytes == REQUEST
    assert ev.snapshot.allocated_bytes == facts(make_snapshot()).allocated_bytes
