"""The whole-run replay on hand-made step streams, where the allocator's rules give the answer by hand.

The step used here allocates two activations of L MiB each (A, then B) and frees them: the simplest stream in
which the order of lengths decides how much memory stays reserved. Requests above 10 MiB are rounded up to
2 MiB and get a segment of exactly that size (CUDACachingAllocator.cpp ``get_allocation_size``); a cached
segment larger than the request is split when more than 1 MiB remains (``should_split``), and at the end of
the step the two halves merge back (``try_merge_blocks``).
"""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from vramledger.allocator.conf import parse_alloc_conf
from vramledger.allocator.replay import AllocEvent
from vramledger.simulate.engine import Replayer, Unit
from vramledger.simulate.templates import Segment, SizeRule, StepTemplates

MiB = 2**20
PER_TOKEN = SizeRule(MiB, ((1, 0, 1),))  # L MiB
FIXED = SizeRule(MiB, ())  # 1 MiB (small pool)


def _seg(name: str, steps: list[tuple[bool, int, SizeRule | None]]) -> Segment:
    return Segment(
        name=name,
        kinds=tuple(k for k, _, _ in steps),
        ids=tuple(i for _, i, _ in steps),
        rules=tuple(r for _, _, r in steps),
        events=tuple(AllocEvent.alloc(i, 0, op=f"op{i}") if k else AllocEvent.free(i) for k, i, _ in steps),
    )


FB = _seg("fb", [(True, 1, PER_TOKEN), (True, 2, PER_TOKEN), (False, 1, None), (False, 2, None)])
EMPTY = _seg("empty", [])
TEMPLATES = StepTemplates(
    load=EMPTY,
    first_fb=FB,
    first_opt=EMPTY,
    fb=FB,
    fb_acc=FB,
    opt=EMPTY,
    eval=None,
    reference_len=16,
    micro_batch=1,
    eval_batch=None,
    unscaled=0,
    versions="hand-made",
)


def _units(lengths: list[int]) -> list[Unit]:
    return [Unit(kind="load", step=0)] + [
        Unit(kind="train", step=k, lengths=(n,)) for k, n in enumerate(lengths, start=1)
    ]


def _reserved_after_each(rep: Replayer, lengths: list[int]) -> list[int]:
    return [s.reserved_end_bytes for s in rep.run(_units(lengths)) if s.unit.kind == "train"]


def test_ascending_lengths_creep_descending_do_not() -> None:
    # Ascending: no cached segment is ever large enough, so every step adds two: 2·20, +2·30, +2·40 MiB.
    expected_up = [40 * MiB, 100 * MiB, 180 * MiB]
    # Descending: the two 40 MiB segments serve every later, shorter step (split, then merged back).
    expected_down = [80 * MiB, 80 * MiB, 80 * MiB]
    got_up = _reserved_after_each(Replayer(TEMPLATES), [20, 30, 40])
    got_down = _reserved_after_each(Replayer(TEMPLATES), [40, 30, 20])
    print("ascending", expected_up, got_up, "descending", expected_down, got_down)
    assert got_up == expected_up
    assert got_down == expected_down


def test_expandable_segments_do_not_creep() -> None:
    # One segment mapped in 20 MiB pages: step 20 maps [0, 40); step 30 puts A at [0, 30) and B at [30, 60),
    # mapping one more page; step 40 puts A at [0, 40) and B at [40, 80): 80 MiB, the descending answer.
    got = _reserved_after_each(Replayer(TEMPLATES, conf=parse_alloc_conf("expandable_segments:True")), [20, 30, 40])
    print("expandable", got)
    assert got == [40 * MiB, 60 * MiB, 80 * MiB]


def test_capacity_release_and_retry_then_oom() -> None:
    # 70 MiB: step 30 needs a 30 MiB segment for B with 70 MiB reserved (20+20+30); the allocator frees its
    # cached 20 MiB segments and retries (one retry), ending with the two 30 MiB segments.
    stats = Replayer(TEMPLATES, capacity_bytes=70 * MiB).run(_units([20, 30]))
    assert [s.retries for s in stats[1:]] == [0, 1]
    assert stats[-1].reserved_end_bytes == 60 * MiB and stats[-1].oom is None
    # 75 MiB: step 40 needs 80 MiB live at once: B fails even after every cached block is freed.
    stats = Replayer(TEMPLATES, capacity_bytes=75 * MiB).run(_units([20, 30, 40, 20]))
    oom = stats[-1].oom
    assert oom is not None and oom.step == 3 and oom.length == 40
    assert oom.requested_bytes == 40 * MiB and oom.allocated_bytes == 40 * MiB and oom.op == "op2"
    assert len(stats) == 4  # load + three steps: the run stops at the failure


def test_memo_replays_each_state_and_length_once() -> None:
    lengths = [40, 30, 20] * 50
    rep = Replayer(TEMPLATES)
    memo = [s.peak_reserved_bytes for s in rep.run(_units(lengths))]
    # Garbage collection switches the memo off; with no memory fraction it does nothing else.
    plain = Replayer(TEMPLATES, conf=parse_alloc_conf("garbage_collection_threshold:0.5"))
    full = [s.peak_reserved_bytes for s in plain.run(_units(lengths))]
    print("replays", rep.replays, "hits", rep.memo_hits)
    assert memo == full
    # load, step 1 (never memoised), then 30, 20 and 40 from the one state step 1 leaves: the rest are hits.
    assert rep.replays == 1 + 1 + 3 and rep.memo_hits == len(lengths) - 4


def test_evaluation_leaves_its_segment_unless_the_cache_is_emptied() -> None:
    # The eval batch allocates one 50 MiB tensor: no cached segment (two of 20 MiB) holds it, so a new one is
    # made and stays cached; emptying the cache after evaluation releases every unused segment (all of them:
    # nothing persistent here).
    ev = _seg("eval", [(True, 9, PER_TOKEN), (False, 9, None)])
    t = dataclasses.replace(TEMPLATES, eval=ev)
    units = [Unit(kind="load", step=0), Unit(kind="train", step=1, lengths=(20,))]
    kept = Replayer(t).run([*units, Unit(kind="eval", step=1, lengths=(50,))])
    emptied = Replayer(t).run([*units, Unit(kind="eval", step=1, lengths=(50,), empty_cache_after=True)])
    assert kept[-1].reserved_end_bytes == 90 * MiB and kept[-1].peak_reserved_bytes == 90 * MiB
    assert emptied[-1].reserved_end_bytes == 0 and emptied[-1].peak_reserved_bytes == 90 * MiB


_rules = st.one_of(
    st.none(),
    st.builds(
        SizeRule,
        st.integers(1, 4 * MiB),
        st.lists(st.tuples(st.integers(1, 8), st.integers(-1, 1), st.sampled_from([1, 16])), max_size=2).map(tuple),
    ),
)


@settings(max_examples=50, deadline=None)
@given(
    rules=st.lists(_rules, max_size=30), repeat=st.integers(1, 4), lengths=st.lists(st.integers(1, 5000), max_size=4)
)
def test_sizes_shared_across_repeated_rules_are_the_segments_own(
    rules: list[SizeRule | None], repeat: int, lengths: list[int]
) -> None:
    # The replayer evaluates each distinct rule once per length (the layers repeat them): the sizes must be the
    # segment's own, event by event (templates.Segment.sizes).
    rules = rules * repeat
    seg = _seg("fb", [(r is not None, i, r) for i, r in enumerate(rules)])
    rep = Replayer(TEMPLATES)
    for n in lengths:
        assert rep._sizes_at(seg, n) == seg.sizes(n)
