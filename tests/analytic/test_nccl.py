"""NCCL's device memory per rank, against hand derivations from NCCL's own constants (NVIDIA/nccl v2.30.7, written
out below as NCCL defines them) and against the allocation sizes NCCL logged on H100s (nccl#1685)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vramledger.analytic import estimate
from vramledger.analytic.distributed.nccl import nccl_bill, nccl_lines, pair_bytes, process_groups
from vramledger.catalog import resolve_gpu, resolve_model
from vramledger.catalog.nccl import nccl_figures
from vramledger.ledger import Basis, Category, Phase
from vramledger.specs import Method, Precision, Sharding, TrainSpec
from vramledger.units import MiB

# NCCL's #defines, verbatim (src/include/device.h, src/init.cc, src/include/comm.h, src/transport/nvls.cc).
NCCL_STEPS = 8
NCCL_LL_LINES_PER_THREAD, NCCL_LL_MAX_NTHREADS, SIZEOF_LL_FIFO_LINE = 8, 512, 16
NCCL_LL128_ELEMS_PER_THREAD, NCCL_LL128_MAX_NTHREADS = 120, 640
DEFAULT_BUFFSIZE = 1 << 22  # /* 4MiB */
MEM_ALIGN = 4096  # sizeof(ncclSendMem) == sizeof(ncclRecvMem)
CUDA_IPC_MIN = 2097152
GRANULE = 2 * MiB  # cuMemGetAllocationGranularity(MINIMUM) on NVIDIA GPUs
NVLS_CHUNKSIZE = 128 * 1024
LL = NCCL_LL_LINES_PER_THREAD * NCCL_LL_MAX_NTHREADS * NCCL_STEPS * SIZEOF_LL_FIFO_LINE
LL128 = NCCL_LL128_ELEMS_PER_THREAD * NCCL_LL128_MAX_NTHREADS * NCCL_STEPS * 8

H100 = resolve_gpu("h100-sxm")
M = resolve_model("llama-3.1-8b")
FSDP8 = TrainSpec(method=Method.FULL, precision=Precision.BF16, world_size=8, fsdp=Sharding.FULL_SHARD)


def up(n: int, to: int) -> int:
    return math.ceil(n / to) * to


def test_the_catalog_holds_nccls_constants() -> None:
    f = nccl_figures()
    assert (f.ll_bytes, f.ll128_bytes, f.simple_bytes) == (LL, LL128, DEFAULT_BUFFSIZE)
    assert (f.mem_struct_bytes, f.ipc_align_bytes, f.nvls_chunk_bytes) == (MEM_ALIGN, CUDA_IPC_MIN, NVLS_CHUNKSIZE)


def test_a_ring_channel_is_the_two_allocations_nccl_logged_on_h100() -> None:
    # p2p.cc, write mode: the sender holds ncclSendMem, the receiver ncclRecvMem + LL + LL128 + SIMPLE, each
    # rounded up to CUDA_IPC_MIN. nccl#1685 (8 x H100, NCCL_DEBUG_SUBSYS=ALLOC) logged exactly these two sizes.
    send, recv = up(MEM_ALIGN, CUDA_IPC_MIN), up(MEM_ALIGN + LL + LL128 + DEFAULT_BUFFSIZE, CUDA_IPC_MIN)
    assert (send, recv) == (2097152, 10485760)
    assert pair_bytes(nccl_figures()) == send + recv
    # read mode (A100 over NVLink): SIMPLE moves to the sender; the pair is 6 + 6 MiB, the same 12 MiB
    read = up(MEM_ALIGN + DEFAULT_BUFFSIZE, CUDA_IPC_MIN) + up(MEM_ALIGN + LL + LL128, CUDA_IPC_MIN)
    assert pair_bytes(nccl_figures(), read=True) == read == 12 * MiB


def test_fsdp_on_eight_h100s_by_hand() -> None:
    # One communicator (FSDP's default group), an HGX H100 node: 24 collective channels, 32 p2p channels, 16 NVLS
    # channels, 8 NVLS heads (one per GPU).
    structures = GRANULE * (2 + 3 * 32 + 16 + 1)  # devCommSetup 2, initChannel 3 per channel, nvlsDevPeers, credit
    ring = 24 * (2 * MiB + 10 * MiB)
    nvls = 16 * 2 * (NVLS_CHUNKSIZE * NCCL_STEPS) * 8
    expected = structures + ring + nvls
    got = nccl_bill(FSDP8, H100).total
    print("expected", expected / MiB, "MiB; got", got / MiB, "MiB")
    assert got == expected == 774 * MiB
    ledger = estimate(M, FSDP8, gpu=H100)
    for phase in ledger.phases:
        assert ledger.bytes_of(Category.NCCL, phase) == expected
        assert ledger.device(phase) == (
            ledger.reserved(phase) + ledger.bytes_of(Category.CUDA_CONTEXT, phase) + expected
        )
    line = next(i for i in ledger.items if i.category is Category.NCCL)
    assert line.basis is Basis.ASSUMPTION and "catalog/nccl.json" in line.source


def test_world_size_one_has_no_nccl_line() -> None:
    one = dataclasses.replace(FSDP8, world_size=1)
    assert process_groups(one) == ()
    ledger = estimate(M, one, gpu=H100)
    assert Category.NCCL not in ledger.categories()


def test_nccl_buffsize_and_nvls_off() -> None:
    # NCCL_BUFFSIZE=1 MiB: recv = ⌈4096 + LL + LL128 + 1 MiB⌉ = 8 MiB, send 2 MiB.
    small = nccl_bill(FSDP8, H100, simple_bytes=1 * MiB).communicators[0]
    assert small.ring == 24 * (up(MEM_ALIGN, CUDA_IPC_MIN) + up(MEM_ALIGN + LL + LL128 + MiB, CUDA_IPC_MIN))
    assert small.ring == 24 * 10 * MiB
    # NCCL_NVLS_ENABLE=0: no NVLS buffers and no NVLS structures
    off = nccl_bill(FSDP8, H100, nvls_enabled=False).communicators[0]
    assert (off.nvls, off.structures) == (0, GRANULE * (2 + 3 * 32))


def test_deepspeed_clones_the_world_group() -> None:
    # deepspeed/utils/groups.py _clone_world_group: ZeRO-1/2's collectives run on a second communicator; the
    # default group only sees barriers, which connect the ring and no NVLS buffers.
    zero2 = dataclasses.replace(FSDP8, fsdp=None, zero_stage=2)
    barrier, engine = nccl_bill(zero2, H100).communicators
    assert (barrier.group.use, engine.group.use) == ("barrier", "all")
    assert barrier.nvls == 0 and barrier.ring == engine.ring == 24 * 12 * MiB
    assert engine.total == 774 * MiB and barrier.total == 774 * MiB - 256 * MiB
    # ZeRO-3: transformers' from_pretrained runs deepspeed.zero.Init without a data_parallel_group, so the
    # parameters are all-gathered on the world group (partition_parameters.py): both communicators are used in full
    zero3 = dataclasses.replace(zero2, zero_stage=3)
    assert [c.total for c in nccl_bill(zero3, H100).communicators] == [774 * MiB, 774 * MiB]


def test_across_nodes_the_tree_is_connected() -> None:
    two_nodes = dataclasses.replace(FSDP8, world_size=16)
    (c,) = nccl_bill(two_nodes, H100).communicators
    assert (c.group.nodes, c.group.local_ranks) == (2, 8)
    assert c.tree == c.ring == 24 * 12 * MiB


def test_hybrid_shard_groups() -> None:
    # FSDP1 _init_intra_and_inter_node_groups: a shard group per node, a replicate group of one rank per node.
    hybrid = dataclasses.replace(FSDP8, world_size=16, fsdp=Sharding.HYBRID_SHARD)
    world, shard, replicate = nccl_bill(hybrid, H100).communicators
    assert (world.group.ranks, shard.group.ranks, replicate.group.ranks) == (16, 8, 2)
    assert shard.group.nodes == 1 and shard.tree == 0 and shard.nvls == 256 * MiB
    assert replicate.group.local_ranks == 1 and replicate.nvls == 0 and replicate.tree == replicate.ring
    # within one node the replicate group would have one rank: no communicator
    assert len(process_groups(dataclasses.replace(hybrid, world_size=8))) == 2


def test_a100_40gb_pcie_is_a_pcie_node_by_hand() -> None:
    # A100-PCIE-40GB cards talk over PCIe (NVLink bridges pair two cards at most): graph/search.cc settles on one
    # ring at 20 GB/s over a PCIe Gen4 x16 path, doubled by connect.cc ncclTopoPostset to 2 collective channels
    # (2 p2p channels). Write mode (read mode needs NVLink, paths.cc ncclTopoCheckP2p): 2 + 10 MiB per ring pair.
    structures = GRANULE * (2 + 3 * 2)  # devCommSetup 2, initChannel 3 per channel; no NVLS before sm90
    ring = 2 * (up(MEM_ALIGN, CUDA_IPC_MIN) + up(MEM_ALIGN + LL + LL128 + DEFAULT_BUFFSIZE, CUDA_IPC_MIN))
    pcie, sxm = resolve_gpu("NVIDIA A100-PCIE-40GB"), resolve_gpu("NVIDIA A100-SXM4-40GB")
    (c,) = nccl_bill(FSDP8, pcie).communicators
    print("expected", (structures + ring) / MiB, "MiB; got", c.total / MiB, "MiB")
    assert (c.structures, c.ring, c.nvls) == (structures, ring, 0)
    assert c.total == 40 * MiB
    # the same 40 GiB card (nvidia-smi: 40536MiB on both), on an NVSwitch board when it is the SXM4 part
    assert pcie.key == "a100-40gb-pcie" and pcie.memory_bytes == sxm.memory_bytes == 40536 * MiB
    assert nccl_bill(FSDP8, sxm).communicators[0].total == 484 * MiB


def test_geforce_cards_keep_the_buffers_in_host_memory() -> None:
    # No peer access: the SHM transport (shm.cc) keeps the protocol buffers in host shared memory; 2 channels.
    (c,) = nccl_bill(FSDP8, resolve_gpu("rtx-4090")).communicators
    assert (c.ring, c.nvls, c.structures) == (0, 0, GRANULE * (2 + 3 * 2))


@settings(max_examples=40, deadline=None)
@given(
    world=st.integers(2, 64),
    per_node=st.sampled_from([1, 2, 4, 8]),
    engine=st.sampled_from(["ddp", "fsdp", "hybrid", "zero"]),
    gpu=st.sampled_from(["h100-sxm", "a100-80gb", "b200", "l40s", "rtx-4090", None]),
    buff=st.sampled_from([None, 1 * MiB, 8 * MiB]),
)
def test_every_communicator_costs_granules_and_more_buffer_never_costs_less(
    world: int, per_node: int, engine: str, gpu: str | None, buff: int | None
) -> None:
    train = TrainSpec(
        world_size=world,
        gpus_per_node=per_node,
        fsdp={"fsdp": Sharding.FULL_SHARD, "hybrid": Sharding.HYBRID_SHARD}.get(engine),
        zero_stage=3 if engine == "zero" else 0,
    )
    spec = resolve_gpu(gpu) if gpu else None
    bill = nccl_bill(train, spec, simple_bytes=buff)
    assert bill.communicators, "world size > 1 always has the default group"
    for c in bill.communicators:
        assert c.total % GRANULE == 0 and c.structures >= GRANULE * (2 + 3 * c.channels[0])
    bigger = nccl_bill(train, spec, simple_bytes=16 * MiB)
    assert bigger.total >= bill.total
    lines = nccl_lines(train, spec, (Phase.FORWARD, Phase.BACKWARD))
    assert {i.bytes for i in lines} == {nccl_bill(train, spec).total}


@pytest.mark.parametrize("flags", [("--fsdp", "full_shard"), ("--zero", "3"), ()], ids=["fsdp", "zero3", "ddp"])
def test_sources_show_the_line(capsys: pytest.CaptureFixture[str], flags: tuple[str, ...]) -> None:
    from vramledger.cli import main

    code = main(
        ["estimate", "llama-3.1-8b", "--method", "lora", "--world-size", "8", "--gpu", "h100-sxm", "--sources", *flags]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "+ NCCL communicators" in out
    nccl = out[out.index("  nccl ") :]
    assert "assumption: NCCL's own device memory" in nccl and "catalog/nccl.json" in nccl
