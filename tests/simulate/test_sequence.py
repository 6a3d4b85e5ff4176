"""A run of varying lengths simulated from the templates equals the allocator replay of real traced steps at
those lengths, stitched together, step by step and byte for byte (memoised steps included)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from tests.simulate._tiny import real_trace, templates  # noqa: E402
from vramledger.allocator.conf import DEFAULT_CONF, parse_alloc_conf  # noqa: E402
from vramledger.allocator.replay import AllocEvent, EventKind, replay  # noqa: E402
from vramledger.simulate.api import simulate  # noqa: E402
from vramledger.simulate.batching import Order  # noqa: E402
from vramledger.simulate.lengths import Lengths  # noqa: E402
from vramledger.simulate.schedule import RunSpec  # noqa: E402

ORDER = [50, 40, 50, 72, 40, 72, 50, 40]  # padded length of each step
OFFSET = 10**7  # keeps the ids of each stitched step apart from the first trace's persistent ones


def _steady_step(length: int, k: int) -> list[AllocEvent]:
    """The real trace at ``length``: its second step's own allocations and frees (what every later step of a
    run does), with ids moved out of the way."""
    events, dev = real_trace(length)
    own = {
        ev.id
        for ev, src in zip(dev.events, dev.origin, strict=True)
        if src >= 0 and ev.kind is EventKind.ALLOC and events[src].step == 2
    }
    out = []
    for ev, src in zip(dev.events, dev.origin, strict=True):
        if src >= 0 and events[src].step == 2 and ev.id in own:
            out.append(AllocEvent(kind=ev.kind, id=ev.id + k * OFFSET, size=ev.size))
    return out


def _stitched(order: list[int]) -> list[list[AllocEvent]]:
    """Load and first step of the real trace at ``order[0]``, then the real second step at each length."""
    events, dev = real_trace(order[0])
    first = [ev for ev, src in zip(dev.events, dev.origin, strict=True) if src < 0 or events[src].step <= 1]
    return [first] + [_steady_step(n, k) for k, n in enumerate(order[1:], start=1)]


@pytest.mark.parametrize(
    "conf", [DEFAULT_CONF, parse_alloc_conf("expandable_segments:True")], ids=["default", "expandable"]
)
def test_varying_lengths_equal_the_stitched_real_steps(conf: object) -> None:
    steps = _stitched(ORDER)
    expected = [
        replay([e for s in steps[: k + 1] for e in s], capacity_bytes=None, conf=conf).peak_reserved_bytes  # type: ignore[arg-type]
        for k in range(len(steps))
    ]
    # Batches of 2 in the given order, each padded to its longer sample: the lengths above.
    samples = Lengths(train=tuple(x for n in ORDER for x in (n, 8)))
    sim = simulate(templates(), samples, RunSpec(cutoff=128, steps=len(ORDER), order=Order.GIVEN, bucket=1), conf=conf)  # type: ignore[arg-type]
    got, running = [], 0
    for p in sim.run.points:
        running = max(running, p.peak_reserved_bytes)
        got.append(running)
    print("expected", expected, "got", got, "memo hits", sim.memo_hits)
    assert [max(p.padded_lengths) for p in sim.run.points] == ORDER
    assert got == expected
