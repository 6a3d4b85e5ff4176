"""NCCL's own device memory: the sourced figures of ``catalog/nccl.json``, loaded.

Each NCCL communicator allocates device memory outside PyTorch's caching allocator (``cuMemCreate``), so outside
``memory_reserved`` and inside what nvidia-smi shows. The JSON holds NCCL's constants (protocol buffer sizes, the
allocation granularity, the structures allocated per communicator and per channel), the channel counts NCCL's
topology search gives on each kind of node, the GPUs taken on each kind of node, and the communicators each
data-parallel engine creates. ``analytic/distributed/nccl.py`` turns them into bytes per rank.

Every figure carries its source: ``basis`` ``code`` (a constant in NCCL's source, or derived from it) or
``measured`` (a published measurement); none is measured by vramledger yet, so the ledger line is a
``Basis.ASSUMPTION``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

_PATH = Path(__file__).resolve().parent / "nccl.json"


@dataclass(frozen=True, kw_only=True, slots=True)
class Channels:
    """The channel counts NCCL settles on for one kind of node and GPU architecture."""

    coll: int
    """Collective channels (``comm->nChannels``): ring and tree connections are made on each."""
    p2p: int
    """Channels whose structures are initialised at init (``comm->p2pnChannels`` = pow2Up(coll) by default)."""
    nvls: int
    """NVLS channels in one node (0: no NVLS)."""
    nvls_multinode: int
    """NVLS channels when the communicator spans several nodes."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Topology:
    """One kind of node: how its GPUs talk, and what NCCL's search makes of it."""

    key: str
    what: str
    channels: Channels
    buffers_on_device: bool
    """False for the SHM transport, whose protocol buffers live in host memory."""
    source: str


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupUse:
    """One process group an engine creates on every rank, and what it is used for."""

    group: str
    ranks: str
    """``world``, ``node`` (the GPUs of one node) or ``nodes`` (one rank per node)."""
    use: str
    """``all`` (the engine's collectives: every algorithm NCCL picks) or ``barrier`` (one small all-reduce)."""
    source: str


@dataclass(frozen=True, kw_only=True, slots=True)
class NcclFigures:
    """NCCL's constants, as ``catalog/nccl.json`` gives them (bytes)."""

    ll_bytes: int
    ll128_bytes: int
    simple_bytes: int
    mem_struct_bytes: int
    """``sizeof(ncclSendMem)`` = ``sizeof(ncclRecvMem)`` = MEM_ALIGN."""
    ipc_align_bytes: int
    """CUDA_IPC_MIN: each connection endpoint is rounded up to it."""
    granularity_bytes: int
    """cuMem's minimum allocation granularity: every device allocation is rounded up to it."""
    allocs_per_communicator: int
    allocs_per_channel: int
    allocs_per_nvls_channel: int
    allocs_nvls_credit: int
    nvls_chunk_bytes: int
    steps: int
    """NCCL_STEPS: slots per NVLS buffer (the protocol buffer sizes already include them)."""
    source: str
    """The NCCL revision read."""


@lru_cache(maxsize=1)
def _raw() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(_PATH.read_text())
    return data


@lru_cache(maxsize=1)
def nccl_figures() -> NcclFigures:
    """NCCL's constants.

    >>> f = nccl_figures()
    >>> (f.ll_bytes, f.ll128_bytes, f.simple_bytes)
    (524288, 4915200, 4194304)
    """
    raw = _raw()
    proto, conn, st = raw["protocol_buffers"], raw["connection"], raw["structures"]
    return NcclFigures(
        ll_bytes=int(proto["ll"]["bytes"]),
        ll128_bytes=int(proto["ll128"]["bytes"]),
        simple_bytes=int(proto["simple"]["bytes"]),
        mem_struct_bytes=int(conn["mem_struct_bytes"]["bytes"]),
        ipc_align_bytes=int(conn["ipc_align_bytes"]["bytes"]),
        granularity_bytes=int(raw["granularity"]["bytes"]),
        allocs_per_communicator=int(st["per_communicator"]["allocations"]),
        allocs_per_channel=int(st["per_channel"]["allocations"]),
        allocs_per_nvls_channel=int(st["per_nvls_channel"]["allocations"]),
        allocs_nvls_credit=int(st["nvls_credit"]["allocations"]),
        nvls_chunk_bytes=int(raw["nvls"]["chunk_bytes"]),
        steps=8,  # src/include/device.h #define NCCL_STEPS 8
        source=raw["nccl_source"],
    )


def topology(gpu_key: str | None, arch: str | None) -> Topology:
    """The kind of node ``gpu_key`` is taken on (``gpu_topology`` in the JSON), with its channel counts for
    ``arch``; no GPU: the JSON's ``no_gpu`` choice (an HGX H100 node).

    >>> topology("h100-sxm", "hopper").channels.coll
    24
    >>> topology("l40s", "ada").key
    'pcie'
    """
    raw = _raw()
    placed = raw["gpu_topology"]
    if gpu_key is None:
        key, arch = placed["no_gpu"]["topology"], placed["no_gpu"]["arch"]
    else:
        key = placed["gpus"].get(gpu_key, placed["default"])
    archs: dict[str, dict[str, int]] = raw["topologies"][key]["archs"]
    if (arch or "").strip().lower() not in archs and "*" not in archs:  # no figures for this architecture here
        key = placed["default"]
    entry = raw["topologies"][key]
    archs = entry["archs"]
    ch = archs.get((arch or "").strip().lower(), archs.get("*"))
    assert ch is not None, f"catalog/nccl.json: topology {key!r} needs a '*' entry"
    return Topology(
        key=key,
        what=entry["what"],
        channels=Channels(
            coll=ch["coll_channels"],
            p2p=ch["p2p_channels"],
            nvls=ch["nvls_channels"],
            nvls_multinode=ch["nvls_channels_multinode"],
        ),
        buffers_on_device=bool(entry.get("buffers_on_device", True)),
        source=entry["source"],
    )


def engine_groups(engine: str) -> tuple[GroupUse, ...]:
    """The process groups ``engine`` (``ddp``, ``fsdp``, ``fsdp_hybrid``, ``deepspeed``, ``deepspeed_zero3``) has NCCL
    run on.

    >>> [g.use for g in engine_groups("deepspeed")]
    ['barrier', 'all']
    """
    rows = _raw()["communicators"]["engines"][engine]
    return tuple(GroupUse(group=r["group"], ranks=r["ranks"], use=r["use"], source=r["source"]) for r in rows)
