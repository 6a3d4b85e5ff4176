"""``trace --snapshot``: the traced step as a ``torch.cuda.memory._dump_snapshot`` pickle, read back by
vramledger's own snapshot reader and by PyTorch's ``torch.cuda._memory_viz`` (its CPU-only functions)."""

from __future__ import annotations

import base64
import json
import pickle
import re
from pathlib import Path
from typing import Any

import pytest

from tests.trace._trace_tiny import TINY, spec
from vramledger.cli import main
from vramledger.explain.snapshot import facts, read_snapshot
from vramledger.specs import Method, TrainSpec
from vramledger.trace.api import trace_step_snapshot

TRAIN = TrainSpec(method=Method.FULL, micro_batch=2, seq_len=40)


@pytest.fixture(scope="module")
def traced() -> tuple[Any, dict[str, Any]]:
    return trace_step_snapshot(spec("llama"), TRAIN, config=TINY["llama"])


def _active(snap: dict[str, Any]) -> list[dict[str, Any]]:
    return [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]


def test_live_blocks_are_the_peak(traced: tuple[Any, dict[str, Any]]) -> None:
    """Taken at the peak: its live blocks add up to the replay's peak allocated (torch's max_memory_allocated,
    block sizes), and its segments to the reserved memory at that moment."""
    ledger, snap = traced
    replay = ledger.settings["allocator"]
    allocated = sum(b["size"] for b in _active(snap))
    print("expected", replay["peak_allocated_bytes"], "got", allocated)
    assert allocated == replay["peak_allocated_bytes"]
    reserved = sum(s["total_size"] for s in snap["segments"])
    assert allocated < reserved <= replay["peak_reserved_bytes"]


def test_trace_and_segments_agree(traced: tuple[Any, dict[str, Any]]) -> None:
    """What memory_viz assumes: replaying ``device_traces`` leaves live exactly the snapshot's active blocks
    (same addresses and requested sizes), and every alloc lies inside a segment that was allocated before it."""
    _, snap = traced
    live: dict[int, int] = {}
    segments: list[tuple[int, int]] = []
    for e in snap["device_traces"][0]:
        if e["action"] == "segment_alloc":
            segments.append((e["addr"], e["addr"] + e["size"]))
        elif e["action"] == "alloc":
            assert e["addr"] not in live
            assert any(lo <= e["addr"] and e["addr"] + e["size"] <= hi for lo, hi in segments)
            live[e["addr"]] = e["size"]
        elif e["action"] == "free_completed":
            assert live.pop(e["addr"]) == e["size"]
    assert live == {b["address"]: b["requested_size"] for b in _active(snap)}
    frames = [f for e in snap["device_traces"][0] if e["action"] == "alloc" for f in e["frames"]]
    assert frames and all(set(f) == {"filename", "line", "name"} for f in frames)
    assert any(f["name"] == "cross-entropy's log-softmax backward (_log_softmax_backward_data)" for f in frames)


def test_pytorch_memory_viz_reads_it(traced: tuple[Any, dict[str, Any]]) -> None:
    viz = pytest.importorskip("torch.cuda._memory_viz")
    _, snap = traced
    summary = viz.segsum(snap)  # raises AssertionError on a segment whose blocks do not add up
    assert f"segments: {len(snap['segments'])}" in summary
    assert viz.trace(snap)  # walks device_traces, matching frees to allocs and segments
    for page in (viz.segment_plot(snap), viz.trace_plot(snap)):
        payload = json.loads(re.search(r"const local_files = (\[.*\])", page).group(1))  # type: ignore[union-attr]
        assert pickle.loads(base64.b64decode(payload[0]["base64"])) == snap


def test_cli_writes_refuses_and_explain_reads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY["llama"]))
    out = tmp_path / "step.pickle"
    common = [str(cfg), "--method", "full", "--batch", "2", "--seq", "40", "--gpu", "420MiB"]
    assert main(["trace", *common, "--json", "--snapshot", str(out)]) == 3
    oom = json.loads(capsys.readouterr().out)["allocator"]["oom"]
    f = facts(read_snapshot(out))  # the safe reader of `vramledger explain`
    assert f.oom_request_bytes is not None and f.oom_request_bytes >= oom["requested_bytes"]
    assert f.allocated_bytes == oom["allocated_bytes"]  # taken at the OOM, as a real post-OOM dump is
    before = out.read_bytes()
    assert main(["trace", *common, "--snapshot", str(out)]) == 2
    assert "--snapshot" in capsys.readouterr().err and out.read_bytes() == before
    assert main(["trace", *common, "--snapshot", str(out), "--force"]) == 3
    assert main(["explain", str(out)]) == 0
