"""Inference alone: weights, the KV cache of generate(), last-token logits, and how many sequences fit."""

from __future__ import annotations

from dataclasses import replace

import pytest

from vramledger.analytic.inference import InferSpec, infer_ledger, max_concurrency
from vramledger.catalog import resolve_gpu, resolve_model
from vramledger.cli import main
from vramledger.errors import VramledgerError
from vramledger.ledger import Category, Phase


def test_weights_cache_and_logits_by_hand() -> None:
    m = resolve_model("llama-2-7b")  # 6,738,415,616 parameters (published), MHA 32 × 128, 32 layers, V = 32,000
    spec = InferSpec(batch=8, prompt=4000, new_tokens=97)  # S = 4096 cached tokens at the end
    ledger = infer_ledger(m, spec)
    assert ledger.bytes_of(Category.WEIGHTS, Phase.GENERATE) == 6_738_415_616 * 2
    cache = ledger.bytes_of(Category.KV_CACHE, Phase.GENERATE)
    # The peak is the prefill (the MLP working set of 8 × 4000 tokens) or the end (S = 4096 tokens).
    assert cache in (2 * 32 * 32 * 128 * 2 * 8 * 4000, 2 * 32 * 32 * 128 * 2 * 8 * 4096)
    # generate sets logits_to_keep=1: logits of the last token only, bf16 and an fp32 copy: (2 + 4)·B·V.
    assert ledger.bytes_of(Category.LOGITS_LOSS, Phase.GENERATE) == 6 * 8 * 32_000
    assert Category.OPTIMIZER_STATE not in ledger.categories() and Category.GRADIENTS not in ledger.categories()


def test_quantised_weights_are_smaller() -> None:
    from vramledger.specs import QuantSpec

    m = resolve_model("llama-3.1-8b")
    bf16 = infer_ledger(m, InferSpec()).bytes_of(Category.WEIGHTS, Phase.LOAD)
    nf4 = infer_ledger(m, InferSpec(quant=QuantSpec())).bytes_of(Category.WEIGHTS, Phase.LOAD)
    assert nf4 < bf16 / 2.5  # 4-bit linears; embeddings and lm_head stay bf16


def test_max_concurrency_is_the_largest_batch_that_fits() -> None:
    m, gpu = resolve_model("llama-3.1-8b"), resolve_gpu("a100-80gb")
    spec = InferSpec(prompt=4096, new_tokens=512)
    c = max_concurrency(m, spec, gpu)
    assert c.max_batch > 1
    assert infer_ledger(m, replace(spec, batch=c.max_batch), gpu=gpu).verdict.fits
    assert not infer_ledger(m, replace(spec, batch=c.max_batch + 1), gpu=gpu).verdict.fits
    # Per sequence at its peak: 4096 + 512 − 1 tokens, 32 layers × 8 KV heads × 128 × (K + V) × bf16.
    assert c.cache_per_sequence == 2 * 32 * 8 * 128 * 2 * 4607


def test_max_concurrency_zero_when_one_sequence_does_not_fit() -> None:
    c = max_concurrency(resolve_model("llama-3-70b"), InferSpec(), resolve_gpu("rtx-4090"))
    assert c.max_batch == 0


def test_bad_input_names_the_flag() -> None:
    with pytest.raises(VramledgerError, match="--new-tokens"):
        InferSpec(new_tokens=0)


def test_cli_infer(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "estimate",
            "llama-3.1-8b",
            "--mode",
            "infer",
            "--batch",
            "8",
            "--prompt",
            "4096",
            "--new-tokens",
            "512",
            "--gpu",
            "h100-sxm",
            "--max-concurrency",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "KV cache" in out and "max concurrency on NVIDIA H100" in out
    rc = main(["estimate", "llama-3.1-8b", "--mode", "infer", "--max-concurrency"])
    assert rc == 2
    assert "--max-concurrency needs a GPU" in capsys.readouterr().err
