"""The frontier search against a brute-force scan of the estimator, and the search helper against known cliffs."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vramledger.analytic import estimate
from vramledger.catalog import resolve_model
from vramledger.errors import VramledgerError
from vramledger.plan.frontier import fit, frontier, largest, max_micro_batch, max_seq_len
from vramledger.specs import Attention, Method, TrainSpec


def sized(gpu, memory_bytes):  # type: ignore[no-untyped-def]
    return dataclasses.replace(gpu, memory_bytes=memory_bytes)


def _fits(m, t, gpu, h):  # type: ignore[no-untyped-def]
    """Independent of plan.memo: the estimate's own verdict."""
    return estimate(m, t, gpu=gpu, headroom=h).verdict.fits


@given(threshold=st.integers(0, 300), limit=st.integers(1, 300), hint=st.one_of(st.none(), st.integers(1, 300)))
def test_largest_finds_the_cliff(threshold: int, limit: int, hint: int | None) -> None:
    calls = []

    def pred(k: int) -> bool:
        calls.append(k)
        return k <= threshold

    # a hint is only valid when the answer is at most the hint (as along the frontier)
    if hint is not None and hint < min(threshold, limit):
        hint = None
    got = largest(pred, limit, start_hi=hint)
    assert got == min(threshold, limit)
    assert len(calls) <= 2 * limit.bit_length() + 3  # logarithmic, not a scan


CASES = [
    pytest.param("llama-3-8b", TrainSpec(method=Method.LORA, grad_ckpt=True), 24 * 2**30, id="8b-lora-ckpt-24GiB"),
    pytest.param("llama-3-8b", TrainSpec(method=Method.QLORA, attn=Attention.EAGER), 24 * 2**30, id="8b-qlora-eager"),
    pytest.param("qwen3-0.6b", TrainSpec(method=Method.FULL, grad_ckpt=True), 40 * 2**30, id="0.6b-full-40GiB"),
]


@pytest.mark.parametrize(("name", "train", "memory"), CASES)
def test_frontier_matches_brute_force(name: str, train: TrainSpec, memory: int, rtx4090) -> None:  # type: ignore[no-untyped-def]
    m, gpu, h, g = resolve_model(name), sized(rtx4090, memory), 0.08, 256
    B, K = 12, 32  # micro-batches 1..12, lengths 256..8192
    f = frontier(m, train, gpu, h, max_batch=B, granularity=g, max_len=K * g)
    for b in range(1, B + 1):
        ok = [
            k * g for k in range(1, K + 1) if _fits(m, dataclasses.replace(train, micro_batch=b, seq_len=k * g), gpu, h)
        ]
        expected = max(ok) if ok else None
        print(name, "batch", b, "expected", expected, "got", f.max_len_for(b))
        assert f.max_len_for(b) == expected
        if ok:  # monotone: every shorter length fits too
            assert ok == list(range(g, expected + 1, g))


def test_max_micro_batch_and_length_match_brute_force(rtx4090) -> None:  # type: ignore[no-untyped-def]
    m, gpu, h = resolve_model("llama-3-8b"), sized(rtx4090, 24 * 2**30), 0.08
    t = TrainSpec(method=Method.LORA, grad_ckpt=True, seq_len=1024, micro_batch=2)
    scan_b = max(b for b in range(1, 40) if _fits(m, dataclasses.replace(t, micro_batch=b), gpu, h))
    got = max_micro_batch(m, t, gpu, h)
    assert got is not None and got.micro_batch == scan_b and not got.at_limit
    scan_l = max(k * 128 for k in range(1, 64) if _fits(m, dataclasses.replace(t, seq_len=k * 128), gpu, h))
    got_l = max_seq_len(m, t, gpu, h, granularity=128)
    assert got_l is not None and got_l.seq_len == scan_l


def test_nothing_fits_gives_none_and_empty_frontier(rtx4090) -> None:  # type: ignore[no-untyped-def]
    m, gpu = resolve_model("llama-3-8b"), sized(rtx4090, 8 * 2**30)
    t = TrainSpec(method=Method.FULL)
    assert max_micro_batch(m, t, gpu, 0.08) is None
    assert max_seq_len(m, t, gpu, 0.08) is None
    assert frontier(m, t, gpu, 0.08).points == ()


def test_fit_report_states_the_headroom(rtx4090) -> None:  # type: ignore[no-untyped-def]
    m = resolve_model("llama-3-8b")
    r = fit(m, TrainSpec(method=Method.LORA, grad_ckpt=True, micro_batch=2), rtx4090, 0.10, max_batch=8)
    assert r.usable_bytes == int(rtx4090.memory_bytes * 0.9)
    for p in r.frontier.points:
        assert p.device_total <= r.usable_bytes


def test_exact_checks_each_cliff_along_its_own_axis(rtx4090, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """With a stand-in tracer that returns the estimate itself, every cliff the analytic fit reports is confirmed:
    the largest micro-batch at the given length is checked against one more sequence at that length, and each
    frontier point against the next length (the largest micro-batch's row used to be checked against the next
    length, which fits wherever the frontier reaches further at that micro-batch, and read "NO")."""
    import vramledger.trace as trace_pkg

    def same_as_estimate(model, train, gpu, headroom):  # type: ignore[no-untyped-def]
        return estimate(model, train, gpu=gpu, headroom=headroom)

    monkeypatch.setattr(trace_pkg, "trace_step", same_as_estimate)
    train = TrainSpec(method=Method.LORA, micro_batch=4, seq_len=2048, grad_ckpt=True)
    r = fit(resolve_model("llama-3-8b"), train, rtx4090, 0.08, max_batch=4, exact=True)
    assert r.largest_batch is not None
    first = r.exact[0]
    assert (first.micro_batch, first.seq_len) == (r.largest_batch.micro_batch, 2048)
    assert (first.next_micro_batch, first.next_seq_len) == (r.largest_batch.micro_batch + 1, 2048)
    assert all(c.next_seq_len == c.seq_len + 128 for c in r.exact[1:])
    assert all(c.agrees for c in r.exact), [(c.micro_batch, c.seq_len, c.next_traced_fits) for c in r.exact]


def test_exact_without_tracer_is_one_clear_error(rtx4090, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import vramledger.trace as trace_pkg

    monkeypatch.delattr(trace_pkg, "trace_step", raising=False)
    with pytest.raises(VramledgerError, match="--exact needs the tracer"):
        fit(resolve_model("llama-3-8b"), TrainSpec(grad_ckpt=True), rtx4090, 0.08, max_batch=2, exact=True)


def test_bad_granularity(rtx4090) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(VramledgerError, match="--granularity"):
        frontier(resolve_model("gpt2"), TrainSpec(), rtx4090, 0.08, granularity=0)


@settings(max_examples=15, deadline=None)
@given(b=st.integers(1, 8), k=st.integers(1, 32), ckpt=st.booleans(), attn=st.sampled_from(list(Attention)))
def test_estimate_is_monotone_in_batch_and_length(b: int, k: int, ckpt: bool, attn: Attention, tiny) -> None:  # type: ignore[no-untyped-def]
    # The searches rely on this: more sequences or longer ones never need less memory.
    t = TrainSpec(method=Method.FULL, micro_batch=b, seq_len=64 * k, grad_ckpt=ckpt, attn=attn)
    base = estimate(tiny, t).device_total
    assert estimate(tiny, dataclasses.replace(t, micro_batch=b + 1)).device_total >= base
    assert estimate(tiny, dataclasses.replace(t, seq_len=64 * (k + 1))).device_total >= base
