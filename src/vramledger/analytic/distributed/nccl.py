"""NCCL's device memory on one rank: the communicators a data-parallel engine creates and what each allocates.

NCCL allocates with ``cuMemCreate``, outside PyTorch's caching allocator: these bytes are in neither
``max_memory_allocated`` nor ``max_memory_reserved``, and in what nvidia-smi shows. Its own line of the ledger
(``Category.NCCL``), added to the device total like the CUDA context, for world size > 1 only.

Legend: *granule* = cuMem's minimum allocation granularity (2 MiB; every NCCL device allocation is rounded up to
it); *pair* = one send and one receive endpoint of one channel on this GPU; *coll*, *p2p*, *nvls* = the channel
counts NCCL's topology search settles on (``catalog/nccl.json`` ``topologies``, derived there from its source).

Per communicator, on one GPU (NCCL >= 2.26 with cuMem, read at v2.30.7; every constant sourced in
``catalog/nccl.json``)::

    structures = granule × (2 + 3·max(coll, p2p) [+ nvls + 1 with NVLS])   init.cc devCommSetup, channel.cc initChannel,
                                                                             initNvlsChannel, nvls.cc ncclNvlsSetup
    ring       = coll × pair                                                 generic.cc ncclTransportRingConnect
    tree       = coll × pair   (the engine's group across nodes)             generic.cc ncclTransportTreeConnect
    NVLS       = ⌈nvls × 2 × NVLS_CHUNKSIZE × NCCL_STEPS × heads⌉_granule     nvls.cc ncclNvlsBufferSetup
                 (the engine's group on an NVSwitch board, compute capability >= 9.0, >= 2 GPUs in the node)
    pair       = ⌈4096 [+ SIMPLE in read mode]⌉_2MiB + ⌈4096 + LL + LL128 [+ SIMPLE in write mode]⌉_2MiB
                                                                  transport/p2p.cc p2pSendSetup / p2pRecvSetup

With the default buffers a pair is 12 MiB either way (2 + 10 MiB written, 6 + 6 MiB read); the ring is connected
by the first collective (NCCL_RUNTIME_CONNECT), the tree when all-reduce spans nodes, NVLS when a large collective
first selects it. A group used only for barriers connects the ring and nothing else.

Assumed, not measured (said in the line's source): the kind of node each GPU sits on (``gpu_topology``), the
channel counts of that node, the same counts across nodes (inter-node rings often use fewer channels: an upper
bound), the network transport's buffers at the P2P size, and one NVLS head per GPU of the node.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from vramledger.catalog.nccl import NcclFigures, Topology, engine_groups, nccl_figures, topology
from vramledger.ledger import Basis, Category, LineItem, Phase
from vramledger.specs import GPUSpec, TrainSpec
from vramledger.specs.distributed import Sharding
from vramledger.units import MiB


@dataclass(frozen=True, kw_only=True, slots=True)
class Group:
    """One NCCL communicator this rank holds: a process group of ``ranks`` GPUs over ``nodes`` nodes."""

    name: str
    ranks: int
    local_ranks: int
    """GPUs of the group in this rank's node."""
    nodes: int
    use: str
    """``all``: the engine's collectives; ``barrier``: one small all-reduce now and then."""
    source: str


@dataclass(frozen=True, kw_only=True, slots=True)
class CommunicatorBytes:
    """Device bytes one communicator allocates on this GPU, by what NCCL allocates them for."""

    group: Group
    structures: int
    ring: int
    tree: int
    nvls: int
    channels: tuple[int, int, int]
    """(collective, p2p, NVLS) channels."""

    @property
    def total(self) -> int:
        return self.structures + self.ring + self.tree + self.nvls


@dataclass(frozen=True, kw_only=True, slots=True)
class NcclBill:
    """Every communicator of one rank, on one kind of node."""

    communicators: tuple[CommunicatorBytes, ...]
    topology: Topology
    arch: str

    @property
    def total(self) -> int:
        return sum(c.total for c in self.communicators)


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def pair_bytes(f: NcclFigures, *, simple_bytes: int | None = None, read: bool = False) -> int:
    """One channel's send + receive endpoints on this GPU (transport/p2p.cc ``p2pSendSetup`` /
    ``p2pRecvSetup``: sizes rounded up to CUDA_IPC_MIN, then to the granule by ``ncclCuMemAlloc``).

    >>> pair_bytes(nccl_figures()) // 2**20
    12
    """
    simple = f.simple_bytes if simple_bytes is None else simple_bytes
    send = f.mem_struct_bytes + (simple if read else 0)
    recv = f.mem_struct_bytes + f.ll_bytes + f.ll128_bytes + (0 if read else simple)
    to = max(f.ipc_align_bytes, f.granularity_bytes)
    return _align(send, to) + _align(recv, to)


def _engine(train: TrainSpec) -> str:
    if train.zero_stage:
        return "deepspeed_zero3" if train.zero_stage == 3 else "deepspeed"
    if train.fsdp is Sharding.HYBRID_SHARD:
        return "fsdp_hybrid"
    return "fsdp" if train.fsdp is not None else "ddp"


def process_groups(train: TrainSpec) -> tuple[Group, ...]:
    """The communicators rank 0 holds under ``train``'s engine; none on one GPU (world size 1 makes no
    connections) and none for a group of one rank (a hybrid run inside one node has no replicate group)."""
    n = train.world_size
    if n <= 1:
        return ()
    per_node = min(n, train.gpus_per_node)
    nodes = -(-n // train.gpus_per_node)
    shape = {"world": (n, per_node, nodes), "node": (per_node, per_node, 1), "nodes": (nodes, 1, nodes)}
    out = []
    for g in engine_groups(_engine(train)):
        ranks, local, spans = shape[g.ranks]
        if ranks > 1:
            out.append(Group(name=g.group, ranks=ranks, local_ranks=local, nodes=spans, use=g.use, source=g.source))
    return tuple(out)


def communicator_bytes(
    group: Group,
    topo: Topology,
    arch: str,
    *,
    simple_bytes: int | None = None,
    nvls_enabled: bool = True,
) -> CommunicatorBytes:
    """Device bytes of one communicator on this GPU (the formula in the module docstring).

    ``simple_bytes``: NCCL_BUFFSIZE (default 4 MiB); ``nvls_enabled``: False as with NCCL_NVLS_ENABLE=0.
    """
    f = nccl_figures()
    ch = topo.channels
    nvls_ch = (ch.nvls if group.nodes == 1 else ch.nvls_multinode) if nvls_enabled and group.local_ranks > 1 else 0
    allocs = f.allocs_per_communicator + f.allocs_per_channel * max(ch.coll, ch.p2p)
    if nvls_ch:
        allocs += f.allocs_per_nvls_channel * nvls_ch + f.allocs_nvls_credit
    structures = allocs * f.granularity_bytes
    read = topo.key == "nvswitch" and arch == "ampere"  # graph/paths.cc: P2P read for compute capability 8.0 on NVLink
    pair = pair_bytes(f, simple_bytes=simple_bytes, read=read) if topo.buffers_on_device else 0
    ring = ch.coll * pair
    tree = ch.coll * pair if group.use == "all" and group.nodes > 1 else 0
    nvls = 0
    if nvls_ch and group.use == "all":
        nvls = _align(nvls_ch * 2 * f.nvls_chunk_bytes * f.steps * group.local_ranks, f.granularity_bytes)
    return CommunicatorBytes(
        group=group, structures=structures, ring=ring, tree=tree, nvls=nvls, channels=(ch.coll, ch.p2p, nvls_ch)
    )


def nccl_bill(
    train: TrainSpec,
    gpu: GPUSpec | None,
    *,
    simple_bytes: int | None = None,
    nvls_enabled: bool = True,
) -> NcclBill:
    """Every communicator rank 0 holds, priced on ``gpu``'s kind of node (no GPU: an HGX H100 node)."""
    topo = topology(gpu.key if gpu is not None else None, gpu.arch if gpu is not None else None)
    arch = gpu.arch if gpu is not None else "hopper"
    comms = tuple(
        communicator_bytes(g, topo, arch, simple_bytes=simple_bytes, nvls_enabled=nvls_enabled)
        for g in process_groups(train)
    )
    return NcclBill(communicators=comms, topology=topo, arch=arch)


def _mib(n: int) -> str:
    return f"{n / MiB:,.0f} MiB"


def _terms(c: CommunicatorBytes) -> str:
    f = nccl_figures()
    coll, p2p, nvls_ch = c.channels
    nvls_allocs = f" + {nvls_ch} + 1 for NVLS" if nvls_ch else ""
    terms = [
        f"structures {c.structures // f.granularity_bytes} x 2 MiB granules (2 + 3 x {max(coll, p2p)} channels"
        f"{nvls_allocs}) = {_mib(c.structures)}"
    ]
    for name, n in (("ring", c.ring), ("tree", c.tree)):
        if n:
            terms.append(f"{name} {coll} channels x {_mib(n // coll)} = {_mib(n)}")
    if c.nvls:
        terms.append(
            f"NVLS {nvls_ch} channels x 2 x {_mib(f.nvls_chunk_bytes * f.steps)} x {c.group.local_ranks} "
            f"heads = {_mib(c.nvls)}"
        )
    return " + ".join(terms)


def _source(bill: NcclBill, gpu: GPUSpec | None) -> str:
    f = nccl_figures()
    node = (
        f"{gpu.key} taken on a '{bill.topology.key}' node ({bill.topology.what})"
        if gpu is not None
        else f"no --gpu: an HGX H100 node assumed ('{bill.topology.key}')"
    )
    parts = [
        f"{c.group.name} ({c.group.ranks} ranks on {c.group.nodes} node{'s' if c.group.nodes > 1 else ''}, "
        f"{'collectives' if c.group.use == 'all' else 'barriers only'}): {_mib(c.total)} = {_terms(c)}"
        for c in bill.communicators
    ]
    return (
        f"NCCL's own device memory (cuMemCreate, outside PyTorch's allocator), one communicator per process "
        f"group: {'; '.join(parts)}. {node}. Constants from NCCL's source ({f.source.split(';')[0]}), "
        f"catalog/nccl.json and analytic/distributed/nccl.py; channel counts derived from NCCL's topology search for "
        f"that node, not measured"
    )


def nccl_lines(train: TrainSpec, gpu: GPUSpec | None, phases: Iterable[Phase]) -> list[LineItem]:
    """One NCCL line per phase (the communicators exist from the wrapper's construction to the end of the run);
    none with one GPU."""
    bill = nccl_bill(train, gpu)
    if not bill.communicators:
        return []
    names = ", ".join(c.group.name for c in bill.communicators)
    n = len(bill.communicators)
    label = f"NCCL: {n} communicator{'s' if n > 1 else ''} ({names})"
    source = _source(bill, gpu)
    return [
        LineItem(category=Category.NCCL, phase=p, bytes=bill.total, label=label, source=source, basis=Basis.ASSUMPTION)
        for p in phases
    ]
