"""Batches as the frameworks build them, and the lengths readers, against hand derivations and the upstream
algorithms' stated properties."""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vramledger.errors import VramledgerError
from vramledger.simulate.batching import Order, greedy_knapsack, length_grouped_indices, pad_to, padded_batches
from vramledger.simulate.lengths import CHARS_PER_TOKEN, read_lengths


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 4096), min_size=1, max_size=400),
    batch=st.integers(1, 8),
    seed=st.integers(0, 10**6),
)
def test_length_grouped_indices_as_transformers_states(lengths: list[int], batch: int, seed: int) -> None:
    # trainer_pt_utils.get_length_grouped_indices: a permutation; mega-batches of mult·batch sorted descending;
    # the longest sample first.
    idx = length_grouped_indices(lengths, batch, random.Random(seed))
    assert sorted(idx) == list(range(len(lengths)))
    assert lengths[idx[0]] == max(lengths)
    mult = min(len(lengths) // (batch * 4), 50) or 1
    size = mult * batch
    for start in range(0, len(idx), size):
        mega = [lengths[i] for i in idx[start : start + size]]
        assert mega[1:] == sorted(mega[1:], reverse=True)  # the first may be the swapped-in longest


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 512), min_size=1, max_size=200), capacity=st.integers(512, 2048))
def test_greedy_knapsack_keeps_every_sample_within_capacity(lengths: list[int], capacity: int) -> None:
    rows = greedy_knapsack(lengths, capacity)
    assert Counter(x for r in rows for x in r) == Counter(lengths)
    assert all(sum(r) <= capacity for r in rows)


def test_greedy_knapsack_by_hand() -> None:
    # Sorted [2, 3, 5, 7, 9], capacity 10: take 9 (1 left, nothing fits); then 7, then 3 (0 left); then 5, 2.
    assert greedy_knapsack([5, 9, 2, 7, 3], 10) == [[9], [7, 3], [5, 2]]


def test_padding_truncation_and_epochs_by_hand() -> None:
    # Cut to 8: [5, 8, 3, 7]; batches of 2 in the given order: max(5, 8) = 8, max(3, 7) = 7 → 8 with a
    # multiple of 4; the second epoch starts again at the first batch.
    got = padded_batches([5, 9, 3, 7], batch=2, micro_steps=3, cutoff=8, order=Order.GIVEN, pad_multiple=4)
    assert got == [8, 8, 8]
    assert padded_batches([5, 9, 3, 7], batch=2, micro_steps=2, cutoff=8, order=Order.SORTED) == [8, 5]
    assert pad_to(1495, 64) == 1536 and pad_to(1495, None) == 1495


def test_packing_gives_rows_of_the_cutoff() -> None:
    assert set(padded_batches(list(range(1, 300)), batch=4, micro_steps=20, cutoff=256, packing=True)) == {256}


# -- lengths -------------------------------------------------------------------------------------------------
def test_ground_truth_lengths_json(tmp_path: Path) -> None:
    # The keys bench/ground_truth/whole_run.py lengths_record writes.
    path = tmp_path / "lengths.json"
    path.write_text(
        json.dumps(
            {
                "seed": 0,
                "micro_batch": 4,
                "train_lengths": [300, 16, 2048, 77],
                "train_batch_padded_len": [2048],
                "eval_lengths": [40, 50],
                "cutoff": 2048,
            }
        )
    )
    got = read_lengths(str(path), n=0)
    assert got.train == (300, 16, 2048, 77) and got.eval == (40, 50) and got.ordered


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[3, 4, 5]", (3, 4, 5)),
        ('{"lengths": [7, 8]}', (7, 8)),
    ],
    ids=["list", "object"],
)
def test_json_lengths(tmp_path: Path, text: str, expected: tuple[int, ...]) -> None:
    path = tmp_path / "l.json"
    path.write_text(text)
    assert read_lengths(str(path), n=0).train == expected


def test_text_csv_and_jsonl(tmp_path: Path) -> None:
    (tmp_path / "l.txt").write_text("12\n\n40\n")
    assert read_lengths(str(tmp_path / "l.txt"), n=0).train == (12, 40)
    (tmp_path / "d.csv").write_text("num_tokens,text\n100,a\n250,b\n")
    assert read_lengths(str(tmp_path / "d.csv"), n=0).train == (100, 250)
    # No tokenizer of this name exists locally: the documented characters-per-token fallback, with a warning.
    (tmp_path / "d.jsonl").write_text(json.dumps({"instruction": "x" * 10, "output": "y" * 29}) + "\n")
    got = read_lengths(str(tmp_path / "d.jsonl"), n=0, tokenizer_name="no-such/tokenizer")
    assert got.train == (math.ceil((10 + 1 + 29) / CHARS_PER_TOKEN),) and got.warnings


def test_summary_statistics_draw_a_lognormal() -> None:
    got = read_lengths("420,300,1800,2048", n=20000, seed=1)
    s = sorted(got.train)
    print("p50", s[len(s) // 2], "p99", s[int(0.99 * len(s))], "max", s[-1])
    assert abs(s[len(s) // 2] - 300) < 15 and abs(s[int(0.99 * len(s))] - 1800) < 120 and s[-1] <= 2048
    assert got.redraw(5, 2) != got.redraw(5, 3)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("10,300,200,2048", "p50 <= p99"),
        ("nope.json", "neither a file"),
    ],
    ids=["stats", "missing"],
)
def test_bad_lengths_name_the_flag(spec: str, message: str) -> None:
    with pytest.raises(VramledgerError, match=message):
        read_lengths(spec, n=10)


def test_bad_file_content(tmp_path: Path) -> None:
    (tmp_path / "l.txt").write_text("12\nabc\n")
    with pytest.raises(VramledgerError, match="line 2"):
        read_lengths(str(tmp_path / "l.txt"), n=0)
