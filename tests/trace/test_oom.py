"""The trace's events replayed through the caching-allocator model: reserve lines, BLAS workspaces, the OOM
point on a GPU of a chosen capacity, the expandable-segments comparison, and estimate's JSON keys."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from tests.trace._trace_tiny import TINY, spec
from vramledger.allocator.conf import parse_alloc_conf
from vramledger.allocator.replay import replay
from vramledger.analytic.overhead import cuda_context_bytes
from vramledger.cli import main
from vramledger.ledger import Category, Phase
from vramledger.specs import GPUSpec, Method, TrainSpec
from vramledger.trace import trace_events, trace_step
from vramledger.trace.ledger_build import replay as ledger_build_replay
from vramledger.trace.oom import device_events, replay_outcome

MiB = 2**20
TRAIN = TrainSpec(method=Method.FULL, micro_batch=2, seq_len=40)
ES = parse_alloc_conf("expandable_segments:True")


ADA_CONTEXT = 446_693_376
"""The CUDA context on Ada as catalog/device_overhead.json gives it (426 MiB: unsloth-zoo#1053, RTX 6000 Ada,
torch.cuda.mem_get_info), the one figure every ledger reads."""


def _gpu(memory_bytes: int, arch: str = "ada") -> GPUSpec:
    return GPUSpec(
        name="test gpu",
        key="test",
        memory_bytes=memory_bytes,
        bf16_tflops=1.0,
        memory_bandwidth_gbs=1.0,
        host_link_gbs=1.0,
        arch=arch,
    )


ADA = _gpu(24 * 2**30)  # an RTX 4090-class card


@pytest.fixture(scope="module")
def events() -> list[Any]:
    return trace_events(spec("llama"), TRAIN, config=TINY["llama"])


@pytest.fixture(scope="module")
def ledger() -> Any:
    return trace_step(spec("llama"), TRAIN, config=TINY["llama"], gpu=ADA, alloc_conf=ES)


def _first_event_reserving_more_than(dev: Any, capacity: int) -> int:
    """Bisect the shortest prefix whose unlimited replay reserves more than ``capacity`` (reserved only grows
    without a capacity limit: nothing releases the cache)."""
    lo, hi = 1, len(dev.events)  # invariant: prefix hi exceeds the capacity, prefix lo - 1 does not
    assert replay(dev.events, capacity_bytes=None).peak_reserved_bytes > capacity
    while lo < hi:
        mid = (lo + hi) // 2
        if replay(dev.events[:mid], capacity_bytes=None).peak_reserved_bytes > capacity:
            hi = mid
        else:
            lo = mid + 1
    return hi - 1


def test_oom_just_below_peak_reserved_and_not_at_it(events: list[Any]) -> None:
    dev = device_events(events, ADA)
    unlimited = replay_outcome(dev, events)
    peak = unlimited.peak_reserved_bytes
    ctx = cuda_context_bytes(ADA)
    # At exactly the peak: a capacity-limited replay is the unlimited one until some allocation would exceed
    # the capacity, and none does.
    at = replay_outcome(dev, events, gpu=_gpu(peak + ctx))
    assert at.oom is None and at.peak_reserved_bytes == peak
    # Just below: the allocation that first pushed reserved past the capacity fails, frees the cache, retries
    # and fails again (every segment still holds a live block on this step), so the OOM is that event.
    below = replay_outcome(dev, events, gpu=_gpu(peak - 512 + ctx))
    assert below.oom is not None
    k = _first_event_reserving_more_than(dev, peak - 512)
    expected = events[dev.origin[k]]
    got = below.oom
    print("expected", expected.phase, expected.step, expected.op, "got", got.phase, got.step, got.op)
    assert (got.phase, got.step, got.op, got.module) == (expected.phase, expected.step, expected.op, expected.module)
    assert got.report.requested_bytes == expected.bytes
    assert got.report.capacity_bytes == peak - 512
    # Free but unusable = capacity − live blocks, by definition (cached pieces + what the driver has left).
    assert got.report.unusable_free_bytes == got.report.capacity_bytes - got.report.allocated_bytes
    assert got.report.unusable_free_bytes > 0


def test_capacity_is_gpu_memory_minus_context(events: list[Any]) -> None:
    out = replay_outcome(device_events(events, ADA), events, gpu=ADA)
    assert out.capacity_bytes == 24 * 2**30 - ADA_CONTEXT
    assert out.oom is None


def test_expandable_segments_one_segment_per_pool(events: list[Any]) -> None:
    """Note [Expandable Segments] (CUDACachingAllocator.cpp): one segment per pool, mapped in pages of 2 MiB
    (small pool) or the large segment size (20 MiB). Page granularity can *add* reserve on a small step, so
    expandable segments are not always smaller than the defaults; on this step the workspaces fill the large
    pages and they reserve no more."""
    dev = device_events(events, ADA)
    default = replay_outcome(dev, events)
    es = replay_outcome(dev, events, conf=ES)
    print("default", default.peak_reserved_bytes, default.segments_at_peak, "es", es.peak_reserved_bytes)
    assert es.segments_at_peak <= 2 < default.segments_at_peak
    assert es.peak_allocated_bytes == default.peak_allocated_bytes  # same blocks, different segments
    assert es.peak_reserved_bytes <= default.peak_reserved_bytes
    assert es.peak_reserved_bytes % (2 * MiB) == 0


def test_ledger_reserve_workspace_and_context(ledger: Any, events: list[Any]) -> None:
    s = ledger.settings
    assert s["alloc_conf"] == "expandable_segments:True"
    # The reserve line at the peak is reserved − allocated right after the peak event, from a plain replay
    # (vramledger.allocator.replay.replay) of the events up to it; never above the replay's max_memory_reserved.
    peak = ledger.peak_phase
    peak_event = ledger_build_replay(events)[0][peak].index
    dev = device_events(events, ADA)
    upto = dev.origin.index(peak_event) + 1
    reserved_then = replay(dev.events[:upto], capacity_bytes=None, conf=ES).final_reserved_bytes
    assert ledger.bytes_of(Category.ALLOCATOR_RESERVE, peak) == reserved_then - ledger.allocated(peak)
    assert ledger.reserved(peak) == reserved_then
    assert s["allocator"]["oom"] is None
    assert ledger.peak_reserved <= s["allocator"]["peak_reserved_bytes"]
    # The default-settings replay is reported beside it, and is a plain replay of the same step.
    assert s["allocator_default"]["conf"] == ""
    assert s["allocator_default"]["peak_allocated_bytes"] == s["allocator"]["peak_allocated_bytes"]
    # Workspaces on Ada (compute capability 8.9): cuBLAS ":4096:2:16:8" = 2 × 4096 KiB + 8 × 16 KiB and a 1 MiB
    # cuBLASLt workspace per handle (CublasHandlePool.cpp getChosenWorkspaceSize /
    # getCUDABlasLtWorkspaceSize); the forward thread's handle only in forward, both in backward and after.
    per_handle = 2 * 4096 * 1024 + 8 * 16 * 1024 + 1 * MiB
    assert ledger.bytes_of(Category.WORKSPACE, Phase.LOAD) == 0
    assert ledger.bytes_of(Category.WORKSPACE, Phase.FORWARD) in (per_handle, 2 * per_handle)
    assert ledger.bytes_of(Category.WORKSPACE, Phase.BACKWARD) == 2 * per_handle
    assert ledger.bytes_of(Category.WORKSPACE, Phase.OPTIMIZER) == 2 * per_handle
    for p in ledger.phases:
        assert ledger.bytes_of(Category.CUDA_CONTEXT, p) == ADA_CONTEXT
        assert ledger.device(p) == ledger.reserved(p) + ADA_CONTEXT
    assert ledger.verdict is not None and ledger.verdict.device_total_bytes == ledger.device_total


def test_json_has_estimate_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY["llama"]))
    common = [str(cfg), "--method", "full", "--batch", "2", "--seq", "40", "--gpu", "rtx-4090", "--json"]
    main(["estimate", *common])
    est = json.loads(capsys.readouterr().out)
    assert main(["trace", *common, "--alloc-conf", "expandable_segments:True"]) == 0
    tr = json.loads(capsys.readouterr().out)
    assert set(est) <= set(tr)
    assert set(est["verdict"]) == set(tr["verdict"])
    assert set(next(iter(est["phases"].values()))) == set(next(iter(tr["phases"].values())))
    assert set(est["items"][0]) == set(tr["items"][0])
    assert tr["engine"] == "trace" and tr["allocator"]["conf"] == "expandable_segments:True"
    assert tr["allocator_default"]["conf"] == ""
    assert tr["peak_reserved_bytes"] == max(p["reserved_bytes"] for p in tr["phases"].values())


def test_cli_reads_env_alloc_conf(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY["llama"]))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    # 400 MiB of context (a custom GPU: the "*" figure) + 20 MiB: far too little for this step's 8 MiB workspaces
    # and tensors.
    assert main(["trace", str(cfg), "--method", "full", "--batch", "2", "--seq", "40", "--gpu", "420MiB"]) == 3
    out = capsys.readouterr().out
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in out
    assert "[expandable_segments:True]" in out and "[default]" in out
    assert out.count("OOM at ") == 2


def test_gpu_smaller_than_context_is_an_error(events: list[Any]) -> None:
    from vramledger.errors import VramledgerError

    with pytest.raises(VramledgerError, match="no memory left after the CUDA context"):
        replay_outcome(
            device_events(events, None), events, gpu=dataclasses.replace(ADA, memory_bytes=ADA_CONTEXT - MiB)
        )
