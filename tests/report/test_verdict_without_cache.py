"""The verdict's second figure: the device total without the allocator's cache (ledger.py ``Verdict.
without_cache_bytes``). It rests on one rule of PyTorch's caching allocator, checked here on vramledger's port of
``CUDACachingAllocator.cpp``: before raising out of memory, ``malloc`` frees every cached block
(``release_cached_blocks``) and retries, so a step whose reserved memory would exceed the card runs as long as
what it holds allocated fits."""

from __future__ import annotations

import json

from vramledger.allocator.model import CachingAllocatorModel
from vramledger.cli import main

MiB = 2**20


def test_the_allocator_frees_its_cache_and_retries_before_failing() -> None:
    # The loss's pattern: weights live, a bf16 logits block made and freed, then a larger fp32 block. Without a
    # limit both blocks stay reserved; on a card with room for the weights and the larger block only, the
    # allocator releases the cached one and retries.
    W, a, b = 400 * MiB, 100 * MiB, 200 * MiB  # multiples of the 2 MiB rounding, each its own segment
    free = CachingAllocatorModel()
    free.malloc(W)
    free.free(free.malloc(a))
    free.malloc(b)
    assert free.peak_reserved == W + a + b and free.num_alloc_retries == 0

    tight = CachingAllocatorModel(capacity_bytes=W + b + 10 * MiB)
    tight.malloc(W)
    tight.free(tight.malloc(a))
    assert tight.malloc(b) is not None  # no out of memory
    assert tight.num_alloc_retries == 1
    assert tight.peak_reserved <= W + b + 10 * MiB


def _verdict(capsys: object, gpu: str) -> tuple[dict, str]:
    args = ["llama-3.2-3b", "--method", "full", "--batch", "4", "--seq", "768", "--precision", "bf16-true"]
    main(["estimate", *args, "--gpu", gpu, "--json"])
    data = json.loads(capsys.readouterr().out)  # type: ignore[attr-defined]
    main(["estimate", *args, "--gpu", gpu])
    return data, capsys.readouterr().out  # type: ignore[attr-defined]


def test_the_verdict_names_the_retry_only_where_the_figure_without_cache_fits(capsys: object) -> None:
    data, _ = _verdict(capsys, "80GiB")
    phases = data["phases"].values()
    # what each phase needs with no cache, from the JSON's own per-phase figures
    without = max(p["device_bytes"] - (p["reserved_bytes"] - p["allocated_bytes"]) for p in phases)
    assert data["verdict"]["without_cache_bytes"] == without < data["device_total_bytes"]

    # a card whose usable 92% lies between the two figures: over, but the retry is named
    between = (without + data["device_total_bytes"]) / 2 / 0.92 / 2**30
    data, text = _verdict(capsys, f"{between:.2f}GiB")
    assert data["fits"] is False and "without the allocator's cache" in " ".join(text.split())
    # a card too small even without the cache: plainly over
    below = without * 0.9 / 0.92 / 2**30
    data, text = _verdict(capsys, f"{below:.2f}GiB")
    assert data["fits"] is False and "without the allocator's cache" not in " ".join(text.split())
