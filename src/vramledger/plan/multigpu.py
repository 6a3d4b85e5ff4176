"""Remedies that exist only with several GPUs: another data-parallel engine, priced in memory and in time.

Memory comes from the estimate of each variant (analytic/distributed/core.py). Time is the communication one step adds:
bytes each rank sends per optimizer step over the interconnect's bus bandwidth. Ring collectives send
(N−1)/N of the message per rank (NCCL docs, "Performance": algorithm bandwidth vs bus bandwidth), so with B the
bus bandwidth a collective of S bytes takes S·(N−1)/N / B:
- DDP: one all-reduce of the gradients (2× a reduce-scatter's traffic);
- FSDP FULL_SHARD / ZeRO-3: an all-gather of the parameters in forward, another in backward, and a
  reduce-scatter of the gradients; SHARD_GRAD_OP gathers once;
- ZeRO-1/2: a reduce-scatter of the gradients and an all-gather of the updated parameters;
- offload: the gradient and parameter partitions cross PCIe each step.
Overlap with compute is ignored (an upper bound on the added time). The bandwidths are assumptions until measured.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vramledger.specs import GPUSpec, ModelSpec, Sharding, TrainSpec

INTERCONNECT_GBS = 100.0
"""Assumed NCCL bus bandwidth per GPU, GB/s: an 8-GPU NVLink node reaches a few hundred on large messages; PCIe-only
nodes 10-20. Not measured here."""
PCIE_GBS = 25.0
"""Assumed host↔device bandwidth per GPU for offload, GB/s (PCIe 4.0 x16 in practice)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MultiGpuOption:
    """One data-parallel engine for the same step: rank 0's memory and the communication it adds."""

    label: str
    train: TrainSpec
    device_bytes: int
    """Rank 0's device total (reserved + CUDA context), from the estimate."""
    comm_bytes: int
    """Bytes rank 0 sends per optimizer step over the interconnect."""
    host_bytes: int
    """Bytes crossing PCIe per optimizer step (offload)."""
    comm_seconds: float
    """Added time per optimizer step, without overlap: comm_bytes / interconnect + host_bytes / PCIe."""
    current: bool = False


def comm_bytes(m: ModelSpec, train: TrainSpec) -> tuple[int, int]:
    """(interconnect bytes, PCIe bytes) rank 0 moves per optimizer step under ``train``'s engine."""
    from vramledger.analytic.weights import weight_budget

    wb = weight_budget(m, train)
    N = train.world_size
    if N == 1 and not (train.offload_optimizer or train.offload_params):
        return 0, 0
    u = train.precision.compute.bytes if train.precision.mixed else wb.trainable_dtype.bytes
    params = wb.total_params * u
    grads = wb.trainable_params * (u if (train.fsdp or train.zero_stage) else wb.trainable_dtype.bytes)
    ring = (N - 1) / N
    if train.fsdp in (Sharding.FULL_SHARD, Sharding.HYBRID_SHARD) or train.zero_stage == 3:
        wire = (2 * params + grads) * ring
    elif train.fsdp is Sharding.SHARD_GRAD_OP:
        wire = (params + grads) * ring
    elif train.zero_stage in (1, 2):
        wire = 2 * grads * ring
    else:  # DDP and NO_SHARD: an all-reduce is a reduce-scatter and an all-gather
        wire = 2 * grads * ring
    host = 0
    if train.offload_optimizer or train.offload_params:
        host = -(-(wb.trainable_params * (4 + u)) // N)  # fp32 gradients down, updated parameters up
    return int(wire * train.grad_accum if train.fsdp or train.zero_stage == 3 else wire), host


def _variants(train: TrainSpec) -> list[tuple[str, TrainSpec]]:
    base = replace(train, zero_stage=0, fsdp=None, offload_optimizer=False, offload_params=False)
    return [
        ("DDP", base),
        ("ZeRO-1", replace(base, zero_stage=1)),
        ("ZeRO-2", replace(base, zero_stage=2)),
        ("ZeRO-3", replace(base, zero_stage=3)),
        ("FSDP shard_grad_op", replace(base, fsdp=Sharding.SHARD_GRAD_OP)),
        ("FSDP full_shard", replace(base, fsdp=Sharding.FULL_SHARD)),
        ("ZeRO-2 + optimizer offload", replace(base, zero_stage=2, offload_optimizer=True)),
        (
            "FSDP full_shard + CPU offload",
            replace(base, fsdp=Sharding.FULL_SHARD, offload_optimizer=True, offload_params=True),
        ),
    ]


def multi_gpu_options(
    m: ModelSpec,
    train: TrainSpec,
    gpu: GPUSpec | None = None,
    *,
    interconnect_gbs: float = INTERCONNECT_GBS,
    pcie_gbs: float = PCIE_GBS,
) -> list[MultiGpuOption]:
    """Every engine for ``train``'s step on ``train.world_size`` GPUs, smallest rank-0 device total first."""
    from vramledger.analytic import estimate

    current = replace(train, warnings=())
    out = []
    for label, t in _variants(train):
        t = replace(t, fsdp_version=train.fsdp_version, zero_buffers=train.zero_buffers, warnings=())
        wire, host = comm_bytes(m, t)
        out.append(
            MultiGpuOption(
                label=label,
                train=t,
                device_bytes=estimate(m, t, gpu=gpu).device_total,
                comm_bytes=wire,
                host_bytes=host,
                comm_seconds=wire / (interconnect_gbs * 1e9) + host / (pcie_gbs * 1e9),
                current=t == current,
            )
        )
    return sorted(out, key=lambda o: o.device_bytes)
