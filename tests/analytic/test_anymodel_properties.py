"""Invariants of the any-model helpers that must hold for every input."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from vramledger.analytic.peft_methods import factorization
from vramledger.analytic.weights import awq_bytes, gptq_bytes, mxfp4_bytes
from vramledger.catalog import _candidates


@given(st.integers(min_value=1, max_value=1 << 16), st.sampled_from([-1, 2, 4, 8, 16]))
def test_factorization_factors_the_dimension(dimension: int, factor: int) -> None:
    m, n = factorization(dimension, factor)
    assert m * n == dimension
    if factor == -1 or dimension % factor:  # a factor that divides is returned first as given, as PEFT does
        assert 1 <= m <= n


@given(st.integers(1, 64).map(lambda k: 128 * k), st.integers(1, 64).map(lambda k: 128 * k), st.sampled_from([4, 8]))
def test_packed_int_storage_is_between_the_bits_and_twice_them(i: int, o: int, bits: int) -> None:
    # Scales, zeros (and GPTQ's g_idx) add less than the packed weights themselves at group size 128.
    for storage in (gptq_bytes(i, o, bits=bits), awq_bytes(i, o, bits=bits)):
        assert i * o * bits // 8 < storage < 2 * i * o * bits // 8


@given(st.integers(1, 1 << 20).map(lambda k: 32 * k))
def test_mxfp4_is_four_and_a_quarter_bits(numel: int) -> None:
    assert 8 * mxfp4_bytes(numel) == numel * 4 + numel // 4


@given(st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_./", min_size=1, max_size=40))
def test_pattern_candidates_start_with_the_name_itself(name: str) -> None:
    # The spelling as typed (without its organisation) is tried first, so an exact alias always wins.
    got = _candidates(name)
    assert got[0] == name.split("/")[-1].strip().lower().replace("_", "-")
