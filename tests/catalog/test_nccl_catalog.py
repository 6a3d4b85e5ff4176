"""catalog/nccl.json: every figure sourced, every GPU it places known to the GPU catalog."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramledger.catalog import resolve_gpu
from vramledger.catalog.nccl import engine_groups, topology

RAW = json.loads((Path(__file__).parents[2] / "src/vramledger/catalog/nccl.json").read_text())


def test_every_figure_names_its_source() -> None:
    sections = [
        *RAW["protocol_buffers"].values(),
        RAW["granularity"],
        *RAW["structures"].values(),
        RAW["nvls"],
        *RAW["topologies"].values(),
        *RAW["connections"].values(),
    ]
    for entry in sections:
        if isinstance(entry, dict):
            assert entry.get("source"), entry
    for engine in RAW["communicators"]["engines"].values():
        for g in engine:
            assert g["source"] and g["ranks"] in ("world", "node", "nodes") and g["use"] in ("all", "barrier")
    for e in RAW["evidence"]:
        assert e["source"].startswith("github:")


@pytest.mark.parametrize("key", sorted(RAW["gpu_topology"]["gpus"]))
def test_placed_gpus_exist_and_have_channel_counts(key: str) -> None:
    gpu = resolve_gpu(key)
    t = topology(gpu.key, gpu.arch)
    assert t.key == RAW["gpu_topology"]["gpus"][key]
    # collective channels are doubled twice by NCCL (ncclTopoDupChannels, ncclTopoPostset); p2p = pow2Up(coll)
    assert t.channels.coll % 2 == 0 and t.channels.p2p == 1 << (t.channels.coll - 1).bit_length()


def test_every_engine_has_the_default_group() -> None:
    for engine in ("ddp", "fsdp", "fsdp_hybrid", "deepspeed", "deepspeed_zero3"):
        assert engine_groups(engine)[0].ranks == "world"
