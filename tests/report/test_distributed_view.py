"""The per-rank header of `estimate` with several GPUs (report/distributed_view.py)."""

from __future__ import annotations

from vramledger.report.distributed_view import render_distributed

SETTINGS = {
    "engine": "fsdp1 full_shard",
    "world_size": 8,
    "shard_ranks": 8,
    "sharded": ["weights"],
    "replicated": ["activations"],
    "host_bytes": 0,
}


def test_header_says_rank_0_holds_the_largest_shard_when_it_does() -> None:
    text = render_distributed({**SETTINGS, "heaviest_rank": 0, "heaviest_extra_bytes": 0}, [])
    assert "rank 0 holds the largest padded shard" in " ".join(text.split())


def test_header_names_the_rank_that_holds_more() -> None:
    """FSDP1 LoRA on the grid's mid model: rank 3 holds 512 KiB more (tests/analytic/test_fsdp1_shards.py)."""
    text = render_distributed({**SETTINGS, "heaviest_rank": 3, "heaviest_extra_bytes": 512 * 1024}, [])
    print(text)
    assert "rank 3 holds 512.0 KiB more" in " ".join(text.split())
    assert "largest padded shard" not in text
