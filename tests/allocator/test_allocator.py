"""The caching-allocator model against rules read in torch 2.13's c10/cuda/CUDACachingAllocator.cpp.

Each test builds a small event sequence whose outcome follows by hand from the cited rule; the expected
numbers
are derived in the test, not taken from the model.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vramledger.allocator.conf import AllocatorConf, parse_alloc_conf, round_size
from vramledger.allocator.model import CachingAllocatorModel
from vramledger.allocator.replay import AllocEvent, EventKind, replay, reserve_for_blocks
from vramledger.errors import VramledgerError
from vramledger.ledger import Category, Phase

MiB = 2**20
A, F = AllocEvent.alloc, AllocEvent.free


def run(events: list[AllocEvent], conf: str = "", capacity: int | None = None):  # type: ignore[no-untyped-def]
    return replay(events, capacity_bytes=capacity, conf=parse_alloc_conf(conf))


# ---- PYTORCH_CUDA_ALLOC_CONF parsing (AcceleratorAllocatorConfig::parseArgs) -------------------------------


def test_parse_the_usual_string() -> None:
    conf = parse_alloc_conf("expandable_segments:True,max_split_size_mb:128,garbage_collection_threshold:0.8")
    assert conf.expandable_segments is True
    assert conf.max_split_size_bytes == 128 * MiB
    assert conf.garbage_collection_threshold == 0.8
    assert conf.max_non_split_rounding == 20 * MiB  # parseArgs: defaults to large_segment_size_
    assert parse_alloc_conf("") == AllocatorConf(text="")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("expandable_segment:True", "unrecognized key 'expandable_segment'"),
        ("expandable_segments:true", "True or False"),  # ConfigTokenizer::toBool accepts only True/False
        ("max_split_size_mb:19", "too small"),  # parseMaxSplitSize: must be >= large_segment_size_ / MB
        ("max_split_size_mb:big", "whole number"),
        ("garbage_collection_threshold:1.0", r"\(0.0, 1.0\)"),  # parseGarbageCollectionThreshold
        ("large_segment_size_mb:10", "must be > 10"),  # parseLargeSegmentSize: > kMinLargeAlloc / MB
        ("roundup_power2_divisions:3", "power of 2"),
        ("max_split_size_mb", "no value"),
        ("backend:cudaMallocAsync", "not modelled"),
        ("per_process_memory_fraction:1.5", r"\[0.0, 1.0\]"),
    ],
    ids=[
        "typo",
        "lowercase-bool",
        "split-too-small",
        "not-a-number",
        "gc-1",
        "segment-10",
        "div-3",
        "no-value",
        "async-backend",
        "fraction",
    ],
)
def test_parse_rejects_bad_input_in_one_line(text: str, match: str) -> None:
    with pytest.raises(VramledgerError, match=match) as err:
        parse_alloc_conf(text)
    assert "\n" not in str(err.value)


def test_parse_keeps_keys_without_device_memory_effect() -> None:
    conf = parse_alloc_conf("pinned_use_cuda_host_register:True,expandable_segments:True")
    assert conf.ignored_keys == ("pinned_use_cuda_host_register",)


def test_max_split_bound_follows_large_segment_size() -> None:
    # parseArgs reads large_segment_size_mb first; max_split_size_mb must then be >= it.
    with pytest.raises(VramledgerError, match=">= 40"):
        parse_alloc_conf("max_split_size_mb:30,large_segment_size_mb:40")
    assert parse_alloc_conf("large_segment_size_mb:40,max_split_size_mb:40").max_split_size_bytes == 40 * MiB


def test_roundup_power2_divisions_list() -> None:
    # parseRoundUpPower2Divisions: sizes in MB index log2(size); the first value also fills the intervals
    # below;
    # ">" fills every interval after the last one named.
    divs = parse_alloc_conf("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]").roundup_power2_divisions
    assert divs == (1,) * 9 + (2, 4) + (8,) * 5


# ---- round_size --------------------------------------------------------------------------------------------


def test_round_size_512_byte_granularity() -> None:
    # round_size: "sizes < kMinBlockSize return kMinBlockSize", else the next multiple of 512.
    assert [round_size(n) for n in (1, 512, 513, 1200)] == [512, 512, 1024, 1536]


def test_round_size_power2_divisions() -> None:
    # roundup_power2_next_division's own example, scaled to MiB: 1200 with 4 divisions of [1024, 2048) → 1280.
    conf = parse_alloc_conf("roundup_power2_divisions:4")
    assert round_size(1200 * MiB + 1, conf) == 1280 * MiB
    assert round_size(1024 * MiB, conf) == 1024 * MiB  # powers of two are kept


# ---- pools, segment sizes, splitting -----------------------------------------------------------------------


def test_just_over_1mib_goes_to_large_pool_and_gets_20mib_segment() -> None:
    # get_pool: size > kSmallSize (1 MiB) → large pool; get_allocation_size: < kMinLargeAlloc → kLargeBuffer.
    r = run([A(1, MiB + 1)])
    assert r.peak_reserved_bytes == 20 * MiB
    assert r.peak_allocated_bytes == MiB + 512  # round_size, then split (20 MiB − that > 1 MiB)
    assert r.num_device_alloc == 1


def test_1mib_goes_to_small_pool_and_two_share_one_2mib_segment() -> None:
    # kSmallSize is inclusive; small requests are packed in kSmallBuffer (2 MiB) segments, split if ≥ 512 B
    # remain.
    r = run([A(1, MiB), A(2, MiB)])
    assert r.peak_reserved_bytes == 2 * MiB
    assert r.num_device_alloc == 1


def test_12mib_request_gets_its_own_12mib_cudamalloc() -> None:
    # get_allocation_size: ≥ kMinLargeAlloc → rounded up to kRoundLarge (2 MiB): 12 MiB exactly.
    r = run([A(1, 12 * MiB), A(2, 12 * MiB)])
    assert r.peak_reserved_bytes == 24 * MiB
    assert r.num_device_alloc == 2


def test_unsplit_tail_counts_as_allocated() -> None:
    # 11.5 MiB → a 12 MiB segment; the 0.5 MiB rest is not split off (large pool needs remaining >
    # kSmallSize),
    # so the block, and torch's memory_allocated, is the whole 12 MiB.
    r = run([A(1, 11 * MiB + MiB // 2)])
    assert (r.peak_allocated_bytes, r.peak_reserved_bytes) == (12 * MiB, 12 * MiB)


def test_freed_20mib_segment_is_split_for_two_8mib_requests() -> None:
    # free_block merges the split pieces back into one 20 MiB block; get_free_block then serves both 8 MiB
    # requests from it (best fit), splitting it each time (remaining 12 MiB, then 4 MiB, both > 1 MiB).
    r = run([A(1, 8 * MiB), F(1), A(2, 8 * MiB), A(3, 8 * MiB)])
    assert r.peak_reserved_bytes == 20 * MiB
    assert r.num_device_alloc == 1
    assert r.final_allocated_bytes == 16 * MiB


def test_best_fit_takes_the_smallest_block_that_fits() -> None:
    # get_free_block: lower_bound on (size, address) → the smallest cached block ≥ the request.
    ev = [A(1, 30 * MiB), A(9, 1), A(2, 16 * MiB), F(1), F(2), A(3, 14 * MiB)]
    m = CachingAllocatorModel()
    blocks = {}
    for e in ev:
        if e.kind is EventKind.ALLOC:
            blocks[e.id] = m.malloc(e.size)
        else:
            m.free(blocks.pop(e.id))
    assert blocks[3].seg == 3  # the 16 MiB segment (third cudaMalloc: 30 MiB, 2 MiB small, 16 MiB), not the 30


def test_peak_reserve_and_largest_free_block() -> None:
    # A 3 MiB request in a fresh 20 MiB segment leaves a 17 MiB cached remainder.
    r = run([A(1, 3 * MiB)])
    assert r.reserve_at_peak_bytes == 17 * MiB
    assert r.largest_free_block_at_peak_bytes == 17 * MiB
    assert r.segments_at_peak == 1


# ---- max_split_size_mb and max_non_split_rounding_mb -------------------------------------------------------


def test_oversize_block_is_not_split_for_a_smaller_request() -> None:
    # get_free_block: "Do not return an oversized block for a large request" (request < max_split_size ≤
    # block).
    ev = [A(1, 100 * MiB), F(1), A(2, 30 * MiB)]
    assert run(ev).peak_reserved_bytes == 100 * MiB  # default: the cached 100 MiB block is split
    assert run(ev, "max_split_size_mb:40").peak_reserved_bytes == 130 * MiB


def test_oversize_block_serves_requests_within_the_rounding_limit() -> None:
    # get_free_block: an oversize request takes an oversize block only if block < request + 20 MiB
    # (max_non_split_rounding_size, default large_segment_size), and should_split refuses to split it.
    near = run([A(1, 100 * MiB), F(1), A(2, 90 * MiB)], "max_split_size_mb:40")
    assert (near.peak_reserved_bytes, near.final_allocated_bytes) == (100 * MiB, 100 * MiB)
    far = run([A(1, 100 * MiB), F(1), A(2, 80 * MiB)], "max_split_size_mb:40")
    assert far.peak_reserved_bytes == 180 * MiB
    wider = run([A(1, 100 * MiB), F(1), A(2, 80 * MiB)], "max_split_size_mb:40,max_non_split_rounding_mb:30")
    assert wider.peak_reserved_bytes == 100 * MiB


def test_release_available_cached_blocks_frees_one_oversize_block_without_a_retry() -> None:
    # malloc: alloc_block fails → release_available_cached_blocks frees the cached oversize block ≥ the
    # request
    # → alloc_block again (not counted as a retry; only the release_cached_blocks path is).
    ev = [A(1, 100 * MiB), A(2, 60 * MiB), F(1), A(3, 80 * MiB)]
    r = run(ev, "max_split_size_mb:40", capacity=200 * MiB)
    assert r.oom is None
    assert r.final_reserved_bytes == 140 * MiB
    assert r.num_alloc_retries == 0


# ---- out of memory -----------------------------------------------------------------------------------------


def test_oom_after_release_reports_the_failing_event() -> None:
    # malloc: alloc_block fails → release_cached_blocks frees the cached 60 MiB segment → retry succeeds
    # (num_alloc_retries = 1). The next request cannot fit even after releasing: OOM at that event.
    ev = [
        A(1, 60 * MiB),
        F(1),
        A(2, 70 * MiB),
        A(
            3,
            40 * MiB,
            op="aten::mm",
            module="model.lm_head",
            phase=Phase.FORWARD,
            category=Category.LOGITS_LOSS,
        ),
        A(4, MiB),
    ]
    r = run(ev, capacity=100 * MiB)
    assert r.num_alloc_retries == 2  # the 70 MiB retry, then the failing 40 MiB one
    assert r.oom is not None
    assert r.oom.event_index == 3
    assert (r.oom.event.module, r.oom.event.op, r.oom.event.phase) == (
        "model.lm_head",
        "aten::mm",
        Phase.FORWARD,
    )
    assert r.oom.requested_bytes == 40 * MiB
    assert (r.oom.allocated_bytes, r.oom.reserved_bytes) == (70 * MiB, 70 * MiB)
    assert r.oom.unusable_free_bytes == 30 * MiB  # nothing cached; 30 MiB of device memory, too little
    assert r.num_events == 4  # replay stops at the failure


def test_fragmentation_oom_that_expandable_segments_avoid() -> None:
    # Without expandable segments: A's 30 MiB segment stays split by C (10 MiB live), so release_cached_blocks
    # can only return B's segment; 30 + 36 > 64 → OOM although 20 (cached) + 34 (device) MiB are free.
    ev = [A(1, 30 * MiB), A(2, 30 * MiB), F(1), A(3, 10 * MiB), F(2), A(4, 36 * MiB)]
    plain = run(ev, capacity=64 * MiB)
    assert plain.oom is not None and plain.oom.event_index == 5
    assert plain.oom.free_cached_bytes == 20 * MiB
    assert plain.oom.unusable_free_bytes == 54 * MiB
    # With expandable_segments:True the blocks tile one segment mapped in 20 MiB pages (3 pages = 60 MiB):
    # C reuses the front of A's space, B's freed space merges with the rest, and D fits without new pages.
    es = run(ev, "expandable_segments:True", capacity=64 * MiB)
    assert es.oom is None
    assert es.peak_reserved_bytes == 60 * MiB


def test_expandable_segment_maps_pages_as_it_grows() -> None:
    # try_allocate_expandable_block maps whole pages (kSmallBuffer for the small pool, the large segment size
    # for the large pool) covering the request; the next request first uses the mapped free tail.
    r = run([A(1, 30 * MiB), A(2, 5 * MiB), A(3, MiB)], "expandable_segments:True")
    assert r.peak_reserved_bytes == 40 * MiB + 2 * MiB
    assert r.num_device_alloc == 2  # one map call per pool


def test_empty_cache_unmaps_free_pages_of_expandable_segments() -> None:
    # release_blocks → unmap_block returns the whole free pages of the segment to the driver.
    ev = [A(1, 30 * MiB), A(2, 30 * MiB), F(2), AllocEvent(kind=EventKind.EMPTY_CACHE)]
    r = run(ev, "expandable_segments:True")
    assert r.final_reserved_bytes == 40 * MiB  # pages [0, 40) hold A; [40, 60) was free and is unmapped


def test_garbage_collection_frees_old_cached_blocks_before_cudamalloc() -> None:
    # garbage_collect_cached_blocks runs only with a memory fraction < 1 (allowed_memory_maximum). Allowed =
    # 0.99 × 100 MiB; with threshold 0.5 the 90 MiB reserved exceed 49.5 MiB, so before the 60 MiB cudaMalloc
    # it frees the cached blocks (oldest by get_free_block calls first), and no synchronizing retry is needed.
    ev = [A(1, 40 * MiB), F(1), A(2, 50 * MiB), F(2), A(3, 60 * MiB)]
    without = run(ev, "per_process_memory_fraction:0.99", capacity=100 * MiB)
    with_gc = run(ev, "per_process_memory_fraction:0.99,garbage_collection_threshold:0.5", capacity=100 * MiB)
    assert (without.num_alloc_retries, with_gc.num_alloc_retries) == (1, 0)
    assert without.final_reserved_bytes == with_gc.final_reserved_bytes == 60 * MiB


def test_memory_fraction_caps_reserved_memory() -> None:
    # alloc_block: total_allocated_memory + size > allowed_memory_maximum → fail, even with device memory
    # left.
    r = run([A(1, 60 * MiB)], "per_process_memory_fraction:0.5", capacity=100 * MiB)
    assert r.oom is not None and r.oom.requested_bytes == 60 * MiB


# ---- replay input checks -----------------------------------------------------------------------------------


def test_replay_rejects_unknown_frees_and_ignores_empty_storages() -> None:
    with pytest.raises(VramledgerError, match="not live"):
        run([F(7)])
    with pytest.raises(VramledgerError, match="still live"):
        run([A(1, 8), A(1, 8)])
    r = run([A(1, 0), F(1)])  # allocate(0) returns nullptr without touching the allocator
    assert r.peak_reserved_bytes == 0


# ---- invariants (hypothesis) -------------------------------------------------------------------------------

_sizes = st.one_of(st.integers(1, 2 * MiB), st.integers(MiB, 12 * MiB), st.integers(10 * MiB, 64 * MiB))
_ops = st.lists(st.tuples(st.booleans(), _sizes, st.integers(0, 1000)), min_size=1, max_size=60)
_confs = st.sampled_from(["", "expandable_segments:True", "max_split_size_mb:32", "roundup_power2_divisions:4"])


@settings(max_examples=60, deadline=None)
@given(ops=_ops, conf=_confs)
def test_reserved_covers_allocated_and_empty_cache_returns_everything(
    ops: list[tuple[bool, int, int]], conf: str
) -> None:
    m = CachingAllocatorModel(parse_alloc_conf(conf))
    live = []
    for is_free, size, pick in ops:
        if is_free and live:
            m.free(live.pop(pick % len(live)))
        else:
            b = m.malloc(size)
            assert b is not None
            live.append(b)
        assert m.reserved >= m.allocated >= 0
        assert m.allocated == sum(b.size for b in live)
    for b in live:
        m.free(b)
    m.empty_cache()
    assert (m.allocated, m.reserved) == (0, 0)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.one_of(_sizes, st.integers(0, 4096)), max_size=40), conf=_confs)
def test_reserve_for_blocks_equals_replay_of_the_same_order(sizes: list[int], conf: str) -> None:
    c = parse_alloc_conf(conf)
    order = sorted(sizes, reverse=True)  # the documented assumption: one pass, largest first
    r = replay([A(i, s) for i, s in enumerate(order)], capacity_bytes=None, conf=c)
    assert reserve_for_blocks(sizes, c) == r.final_reserved_bytes - sum(sizes)


def test_reserve_for_blocks_by_hand() -> None:
    # cuBLAS workspace 8.125 MiB (≥ 1 MiB, < 10 MiB → a 20 MiB segment) + cuBLASLt 1 MiB (small → 2 MiB).
    assert reserve_for_blocks([8519680, MiB]) == 22 * MiB - 8519680 - MiB
    # Two 12 MiB tensors: 2 MiB-rounded segments, nothing to spare.
    assert reserve_for_blocks([12 * MiB, 12 * MiB]) == 0
    # Expandable segments: 30 + 5 MiB tile one segment of two 20 MiB pages.
    assert reserve_for_blocks([30 * MiB, 5 * MiB], parse_alloc_conf("expandable_segments:True")) == 5 * MiB


def test_reserve_for_blocks_is_cheap() -> None:
    sizes = [(i * 7919) % (64 * MiB) + 1 for i in range(1000)]
    reserve_for_blocks(sizes)
    t = time.perf_counter()
    reserve_for_blocks(sizes)
    elapsed = time.perf_counter() - t
    print(f"reserve_for_blocks, 1000 sizes: {elapsed * 1e3:.2f} ms (target < 1 ms, test allows 20 on a busy CI)")
    assert elapsed < 0.02
