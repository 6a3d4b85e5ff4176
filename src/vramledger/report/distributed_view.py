"""The per-rank section of `estimate` with several GPUs: what rank 0 shards and replicates, and the other
data-parallel engines priced in memory and time (plan/multigpu.py). Text within 100 columns, no colour."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence

from vramledger.plan.multigpu import INTERCONNECT_GBS, PCIE_GBS, MultiGpuOption
from vramledger.units import fmt_bytes

WIDTH = 100


def render_distributed(settings: Mapping[str, object], options: Sequence[MultiGpuOption]) -> str:
    """``settings``: the ledger's ``settings["distributed"]``; ``options``: ``multi_gpu_options``."""
    heaviest = int(settings.get("heaviest_rank", 0))  # type: ignore[call-overload]
    holds = (
        f"rank {heaviest} holds {fmt_bytes(int(settings['heaviest_extra_bytes']))} more: FSDP1's flat shards "  # type: ignore[call-overload]
        "split the adapters unevenly"
        if heaviest
        else "rank 0 holds the largest padded shard"
    )
    lines = [
        f"several GPUs: rank 0 of {settings['world_size']} ({settings['engine']}; shards over "
        f"{settings['shard_ranks']} ranks, {holds})",
        f"  sharded: {', '.join(map(str, settings['sharded'])) or 'nothing'}"  # type: ignore[call-overload]
        f"; replicated: {', '.join(map(str, settings['replicated']))}",  # type: ignore[call-overload]
    ]
    host = int(settings.get("host_bytes", 0))  # type: ignore[call-overload]
    if host:
        lines.append(f"  in host memory (offload): {fmt_bytes(host)} per rank")
    ds = settings.get("deepspeed_estimate_bytes")
    if ds is not None:
        lines.append(
            f"  DeepSpeed's {settings['deepspeed_estimate_source']}: {fmt_bytes(int(ds))} of model states per GPU "  # type: ignore[call-overload]
            f"(ours: {fmt_bytes(int(settings['model_states_bytes']))}; it assumes every parameter trains and "  # type: ignore[call-overload]
            "counts no buckets)"
        )
    if options:
        lines += ["", f"  {'engine':32}{'device total, rank 0':>22}{'communication per step':>26}"]
        for o in options:
            mark = " *" if o.current else ""
            comm = (
                "-"
                if not (o.comm_bytes or o.host_bytes)
                else f"{fmt_bytes(o.comm_bytes + o.host_bytes)} ≈ {o.comm_seconds * 1e3:,.0f} ms"
            )
            lines.append(f"  {o.label + mark:32}{fmt_bytes(o.device_bytes):>22}{comm:>26}")
        lines.append(
            f"  * this run. Time assumes {INTERCONNECT_GBS:g} GB/s NCCL bus bandwidth and {PCIE_GBS:g} GB/s PCIe per "
            "GPU, no overlap (not measured)"
        )
    return "\n".join(w for line in lines for w in (textwrap.wrap(line, WIDTH, subsequent_indent="    ") or [""]))
