"""The equivalence experiment: naive accumulation differs from the large batch, num_items_in_batch matches it.

Truths used here, all independent of the implementation:
* Algebra: with n_i target tokens in micro-batch i of M and N = Σ n_i, the naive loop weights a token of
  micro-batch i by 1/(M·n_i), the large batch by 1/N. So (a) ≠ g_ref whenever the n_i differ, and (a) = g_ref
  when they are all equal or M = 1. The num_items_in_batch loss weights every token 1/N: (b) = g_ref always.
* Floating point: reordering a sum of n terms changes it by at most ~n·u relative (Higham, Accuracy and
  Stability of Numerical Algorithms, §4.2), u = 2**-53 ≈ 1.1e-16 (float64) and 2**-24 ≈ 6e-8 (float32).
  The gradient entries are sums over ≤ a few hundred tokens and 64-128 hidden features, so a few hundred u
  bounds the reordering error generously: < 1e-10 in float64 (≈ 10⁶ u, measured ≈ 3.6e-16) and < 1e-5 in
  float32 (≈ 170 u, measured ≈ 2e-7). (a)'s error is a weighting error of order (spread of n_i)/N ≈ 0.1-0.6,
  so > 1e-3 separates it from rounding by two orders of magnitude even in float32.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from vramledger.accum.equivalence import (  # noqa: E402
    EquivalenceConfig,
    _batch_dependent_layers,
    _count_targets,
    run_equivalence,
)
from vramledger.errors import VramledgerError  # noqa: E402

FP64_ROUNDING = 1e-10
FP32_ROUNDING = 1e-5
WEIGHTING_ERROR = 1e-3


@pytest.fixture(scope="module")
def fp64():
    return run_equivalence(EquivalenceConfig(dtype="fp64", micro_batches=4, seed=0))


@pytest.fixture(scope="module")
def fp32():
    return run_equivalence(EquivalenceConfig(dtype="fp32", micro_batches=4, seed=0))


def _report(r) -> None:
    for c in r.comparisons:
        print(f"{r.config.dtype} {c.key}: rel_error={c.rel_error:.3e} cosine={c.cosine:.15f}")


def test_fp64_num_items_in_batch_matches_and_naive_differs(fp64) -> None:
    _report(fp64)
    # Precondition for (a) to differ: the micro-batches hold different numbers of target tokens.
    assert len(set(fp64.target_tokens)) > 1, fp64.target_tokens
    a, b = fp64.comparison("mean_of_means"), fp64.comparison("global_token_mean")
    assert b.rel_error < FP64_ROUNDING
    assert b.cosine > 1 - FP64_ROUNDING
    assert b.within_rounding
    assert a.rel_error > WEIGHTING_ERROR
    assert a.cosine < 1 - 1e-6
    assert not a.within_rounding


def test_fp32_num_items_in_batch_matches_and_naive_differs(fp32) -> None:
    _report(fp32)
    assert len(set(fp32.target_tokens)) > 1, fp32.target_tokens
    a, b = fp32.comparison("mean_of_means"), fp32.comparison("global_token_mean")
    assert b.rel_error < FP32_ROUNDING
    assert a.rel_error > WEIGHTING_ERROR
    assert not a.within_rounding and b.within_rounding


def test_same_data_in_both_dtypes(fp32, fp64) -> None:
    # The seed fixes the data; the dtype only changes rounding, so (a)'s weighting error is the same to ~1e-5.
    assert fp32.target_tokens == fp64.target_tokens
    a32, a64 = fp32.comparison("mean_of_means"), fp64.comparison("mean_of_means")
    assert a32.rel_error == pytest.approx(a64.rel_error, rel=1e-4)


def test_equal_token_counts_make_the_naive_loop_exact_too() -> None:
    r = run_equivalence(EquivalenceConfig(dtype="fp64", micro_batches=3, vary_lengths=False, max_len=16))
    _report(r)
    assert len(set(r.target_tokens)) == 1  # every micro-batch: 2 rows x 15 shifted targets
    assert r.target_tokens[0] == 2 * 15
    for c in r.comparisons:
        assert c.rel_error < FP64_ROUNDING, c


def test_one_micro_batch_is_the_large_batch() -> None:
    r = run_equivalence(EquivalenceConfig(dtype="fp64", micro_batches=1, seed=5))
    for c in r.comparisons:
        assert c.rel_error < FP64_ROUNDING, c


def test_llama_has_no_batch_dependent_layers(fp64) -> None:
    assert fp64.architecture == "LlamaForCausalLM"
    assert fp64.batch_dependent_layers == ()


def test_batchnorm_and_dropout_are_reported() -> None:
    class Cfg:
        attention_dropout = 0.0

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.1))
    model.config = Cfg()
    found = _batch_dependent_layers(model, torch)
    assert any("BatchNorm1d" in f for f in found) and any("Dropout" in f for f in found)


def test_target_count_follows_the_causal_shift() -> None:
    # Hand count: labels[..., 1:] of [-100, 5, 6, -100] and [7, 8, -100, -100] hold 5, 6 and 8: 3 targets
    # (the 7 at position 0 is never predicted). Trainer._get_num_items_in_batch counts the same way.
    labels = torch.tensor([[-100, 5, 6, -100], [7, 8, -100, -100]])
    assert _count_targets(labels) == 3


def test_global_rng_is_left_alone() -> None:
    before = torch.random.get_rng_state()
    run_equivalence(EquivalenceConfig(micro_batches=2, max_len=8))
    assert torch.equal(before, torch.random.get_rng_state())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"micro_batches": 0}, "--micro-batches must be at least 1"),
        ({"dtype": "bf16"}, "--dtype must be one of fp32, fp64"),
        ({"min_len": 10, "max_len": 5}, "min_len <= max_len"),
    ],
    ids=["no-micro-batches", "bad-dtype", "bad-lengths"],
)
def test_bad_config(kwargs, match) -> None:
    with pytest.raises(VramledgerError, match=match):
        EquivalenceConfig(**kwargs)
