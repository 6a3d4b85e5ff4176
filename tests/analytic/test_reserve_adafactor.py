"""Adafactor's reserve in full fine-tuning: its states stay out of the logits chain (analytic/reserve/full.py
``large_pool_states``), and the tied gradients' sum takes a fourth temporary's rest (analytic/reserve/optimizers.py
``tied_sum_segments``, ``tied_sum_switch``).

Truths: hand derivations from the models' published shapes (Llama-3.2-1B: V 128256, H 2048, I 8192, 16 layers, q and
o 2048², k and v 2048·512; Qwen2.5-0.5B: V 151936, H 896, I 4864) and the replays of real traced steps committed in
bench/reserve/packed_adafactor.jsonl (``python bench/reserve/run_packed_adafactor.py``: where the sum lands, the
segments step 1's optimizer makes, the reserve of a packed run).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from vramledger.allocator.conf import allocation_size
from vramledger.analytic import estimate
from vramledger.analytic.reserve.full import large_pool_states, relaid_counted
from vramledger.analytic.reserve.optimizers import temporaries_switch, tied_sum_segments, tied_sum_switch
from vramledger.analytic.reserve.shape import workspace_in_chain
from vramledger.analytic.step import step_parts
from vramledger.catalog import resolve_model
from vramledger.ledger import Phase
from vramledger.specs import Attention, Method, Optimizer, Precision, TrainSpec

MiB = 2**20
TRACED = Path(__file__).resolve().parents[2] / "bench" / "reserve" / "packed_adafactor.jsonl"
TOLERANCE = 0.03


def _adafactor(b: int, ell: int, precision: Precision = Precision.BF16, ckpt: bool = True) -> TrainSpec:
    return TrainSpec(
        method=Method.FULL,
        optimizer=Optimizer.ADAFACTOR,
        precision=precision,
        micro_batch=b,
        seq_len=ell,
        grad_ckpt=ckpt,
        attn=Attention.SDPA,
        packing=True,
    )


def test_adafactors_states_are_small_pool_vectors_and_the_workspaces_block_is_made_again() -> None:
    """Adafactor keeps a row and a column vector per matrix: Qwen2.5-0.5B's widest is the embedding's row statistics,
    4·151936 = 607,744 B, under kSmallSize (1 MiB), so no state reaches the chain's blocks. The backward workspace
    (32 MiB) takes the fp32 copy's block at 2 × 1024 (c·I·T = 2·4864·2048 = 19 MiB and 4·H·T = 7 MiB under it), and
    step 2 makes that 4·V·T block again, as with SGD: the trace's replay makes one 1,187 MiB segment in step 2."""
    m = resolve_model("qwen2.5-0.5b")
    train = _adafactor(2, 1024)
    p = step_parts(m, train)
    assert MiB > 4 * 151936
    made_again = relaid_counted(m, train, p, workspace=workspace_in_chain(m, train, p))
    print(f"large-pool states {large_pool_states(m, train, p)}, made again {made_again} (4·V·T = {4 * 151936 * 2048})")
    assert large_pool_states(m, train, p) == 0 < p.state_bytes
    assert made_again == 4 * 151936 * 2048


def test_the_tied_sum_leaves_the_fourth_temporary_without_a_block_by_hand() -> None:
    """Llama-3.2-1B, bf16-true, 2 × 2048: g = 2·V·H = 501 MiB (a 16-bit V×H gradient), t = 4·V·H = 1002 MiB (one of
    Adafactor's fp32 temporaries), the chain's blocks c·V·T = 1002 MiB and F = 4·V·T = 2004 MiB. The layers' gradients,
    2·16·(2·2048² + 2·2048·512 + 3·2048·8192) B = 1856 MiB, fill the c·V·T block and spill 854 MiB into the fp32
    copy's, after lm_head's g (the backward workspace is in an MLP block: c·I·T = 64 MiB ≥ 32 MiB). The copy's block
    then holds g + 854 + g (the embedding's) = 1856 MiB, 148 MiB left: the sum (g) goes to the start of the
    log-softmax's block, which keeps 1503 MiB: one temporary. With the third block's two, three of the four find a
    block and one segment of t is made (the replay: 0.98 GiB made by step 1's optimizer). At 2 × 2304 the copy's block
    (2254.5 MiB) keeps room for the sum, and the other two blocks hold two each."""
    m = resolve_model("llama-3.2-1b")
    per_layer = 2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192
    assert 2 * 16 * per_layer == 1856 * MiB
    got = {}
    for ell in (2048, 2304):
        train = _adafactor(2, ell)
        got[ell] = tied_sum_segments(m, train, step_parts(m, train))
    t = 4 * 128256 * 2048
    print(f"segments: 2 × 2048 {got[2048] / MiB:.0f} MiB (t = {t / MiB:.0f}), 2 × 2304 {got[2304]}")
    assert got == {2048: allocation_size(t), 2304: 0}


def test_the_tied_sum_switch_is_closed_downwards_and_applies_to_16_bit_weights_only() -> None:
    """On at every shorter length of each micro-batch up to its edge (a run with dynamic padding holds the edge), off
    with fp32 weights (two temporaries, which the two freed V×H gradients' blocks of 4·V·H hold) and without
    checkpointing (the layers' gradients are cut from the saved activations' blocks, not the chain's)."""
    m = resolve_model("llama-3.2-1b")
    train = _adafactor(2, 2048)
    on = tied_sum_switch(m, train, step_parts(m, train))
    assert on is not None
    lengths = [ell for ell in range(256, 4096, 61) if on(2, ell)]
    print(f"on at 2 × ℓ up to {max(lengths)}; off at 2 × 2304: {not on(2, 2304)}")
    assert lengths == list(range(256, max(lengths) + 1, 61))
    assert on(2, 2176) and not on(2, 2304)
    for other in (
        dataclasses.replace(train, precision=Precision.BF16_MIXED),
        dataclasses.replace(train, grad_ckpt=False),
    ):
        p = step_parts(m, other)
        switch = tied_sum_switch(m, other, p)
        assert switch is None or not any(switch(b, ell) for b in (1, 2, 4) for ell in (256, 1024, 2048, 4096))


def _records() -> list[dict[str, Any]]:
    return [json.loads(line) for line in TRACED.read_text().splitlines()]


def _specs(cid: str) -> tuple[Any, TrainSpec]:
    name, _, b, ell, ckpt, _, precision, _ = cid.split("/")
    return resolve_model(name), _adafactor(int(b[1:]), int(ell[1:]), Precision(precision), ckpt == "ckpt")


@pytest.mark.parametrize("rec", _records(), ids=lambda r: r["id"])
def test_packed_estimate_never_more_than_3_percent_under_the_traced_replay(rec: dict[str, Any]) -> None:
    """A packed run meets the traced shape at every step: its estimate against the replay of that shape."""
    m, train = _specs(rec["id"])
    led = estimate(m, train)
    got = max(led.reserved(ph) for ph in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER))
    gap = got / rec["replay_reserved"] - 1
    replay = rec["replay_reserved"]
    print(f"{rec['id']}: replay {replay / 2**30:.2f} GiB, packed estimate {got / 2**30:.2f} ({gap:+.1%})")
    assert gap >= -TOLERANCE


@pytest.mark.parametrize("rec", _records(), ids=lambda r: r["id"])
def test_the_tied_sum_segments_against_the_replays_where_the_temporaries_pair_up(rec: dict[str, Any]) -> None:
    """Where the fp32 logits segment holds two temporaries (``temporaries_switch`` off) and the model has a trained
    tied embedding: ``tied_sum_segments`` counts the segments step 1's optimizer makes in the replay, or one segment
    of t more (every layer gradient is counted in the chain, where the replay puts some in the forward's blocks: the
    count errs towards more segments, never fewer). Equal on the shapes where the replay cuts the sum from the
    log-softmax's block, Llama-3.2-1B 2 × 2048 among them; one more at Llama-3.2-1B 2 × 2240 (just past the replay's
    edge) and Llama-3.2-3B 1 × 6144 and 1 × 6656 (whose step 2 makes the second of the two)."""
    m, train = _specs(rec["id"])
    p = step_parts(m, train)
    pairs = temporaries_switch(m, train, p)
    if tied_sum_switch(m, train, p) is None or (pairs is not None and pairs(train.micro_batch, train.seq_len)):
        pytest.skip("no trained tied embedding under checkpointing, or the temporaries cannot pair up")
    got, made = tied_sum_segments(m, train, p), rec["optimizer_segments_step_1"]
    t = allocation_size(4 * m.vocab_size * m.hidden_size)
    print(f"{rec['id']}: sum in {rec['sum_in']}, step 1's optimizer made {made / MiB:.0f} MiB, counted {got / MiB:.0f}")
    assert made <= got <= made + t
