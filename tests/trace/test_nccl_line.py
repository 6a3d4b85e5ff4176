"""The trace's ledger carries NCCL's communicators with several GPUs, and none on one."""

from __future__ import annotations

import dataclasses

from tests.trace._trace_tiny import TINY
from vramledger.analytic.distributed import nccl_bill
from vramledger.analytic.overhead import obtainable_bytes
from vramledger.catalog import resolve_gpu
from vramledger.catalog.hfconfig import model_spec_from_config
from vramledger.ledger import Category
from vramledger.report.trace_text import render_allocator
from vramledger.specs import Method, Precision, TrainSpec
from vramledger.trace import trace_step

CFG = dict(TINY["llama"])
M = model_spec_from_config(CFG, name="tiny-llama", source="test")
BASE = TrainSpec(method=Method.FULL, precision=Precision.BF16, micro_batch=2, seq_len=40)


def test_ddp_trace_adds_the_nccl_line_to_the_device_total() -> None:
    gpu = resolve_gpu("a100-80gb")
    ddp = trace_step(M, dataclasses.replace(BASE, world_size=2), config=CFG, gpu=gpu)
    # DDP: the default group only; an HGX A100 node: 3 granules x 32 channels + 2, ring 24 x 12 MiB, no NVLS
    expected = nccl_bill(dataclasses.replace(BASE, world_size=2), gpu).total
    assert expected == (2 + 3 * 32) * 2 * 2**20 + 24 * 12 * 2**20
    for phase in ddp.phases:
        assert ddp.bytes_of(Category.NCCL, phase) == expected
        assert ddp.device(phase) == ddp.reserved(phase) + ddp.bytes_of(Category.CUDA_CONTEXT, phase) + expected
    # the allocator replay can obtain the GPU less the CUDA context and less NCCL's communicators
    replay = ddp.settings["allocator"]
    assert replay["capacity_bytes"] == obtainable_bytes(gpu) - expected and replay["outside_bytes"] == expected
    assert "− NCCL communicators" in render_allocator(ddp)


def test_single_gpu_trace_has_no_nccl_line() -> None:
    assert Category.NCCL not in trace_step(M, BASE, config=CFG).categories()
