"""Device overhead figures: the sizes follow the upstream rules they cite; every figure is sourced."""

from __future__ import annotations

import json

import pytest

from vramledger.allocator.replay import reserve_for_blocks
from vramledger.catalog.device_overhead import _PATH, device_overhead, known_archs
from vramledger.errors import VramledgerError

MiB = 2**20


@pytest.mark.parametrize(
    ("arch", "cublas"),
    [
        ("ampere", 4096 * 1024 * 2 + 16 * 1024 * 8),  # parseChosenWorkspaceSize default ":4096:2:16:8"
        ("ada", 4096 * 1024 * 2 + 16 * 1024 * 8),
        ("hopper", 4096 * 8 * 1024),  # "32MiB for Hopper and Blackwell" (major 9, 10, 11, 12)
        ("blackwell", 4096 * 8 * 1024),
    ],
)
def test_cublas_workspace_follows_compute_capability(arch: str, cublas: int) -> None:
    d = device_overhead(arch)
    assert d.cublas_workspace.bytes == cublas
    assert d.cublaslt_workspace.bytes == 1024 * 1024  # parseCUDABlasLtWorkspaceSize: 1024 KiB default


def test_every_figure_is_sourced_and_not_yet_ours() -> None:
    for arch in known_archs():
        d = device_overhead(arch)
        for fig in (d.cuda_context, d.cublas_workspace, d.cublaslt_workspace):
            assert fig.source and not fig.measured_by_us and fig.bytes > 0
    raw = json.loads(_PATH.read_text())
    for entry in raw["cuda_context"]:
        assert entry["source"] and entry["measured_by_us"] is False


def test_unknown_arch_is_a_user_error() -> None:
    with pytest.raises(VramledgerError, match="known: volta"):
        device_overhead("cdna3")


def test_workspaces_reserve_through_the_caching_allocator() -> None:
    # Hopper, forward and backward handles: two 32 MiB cuBLAS workspaces get a 32 MiB segment each (>= 10 MiB,
    # 2 MiB-rounded, nothing to spare); the two 1 MiB cuBLASLt workspaces share one 2 MiB small segment.
    assert reserve_for_blocks(device_overhead("hopper").workspace_sizes()) == 0
    # Ampere, one handle: 8.125 MiB cut from a 20 MiB segment, 1 MiB in a 2 MiB segment.
    assert reserve_for_blocks(device_overhead("ampere").workspace_sizes(handles=1)) == 22 * MiB - 8519680 - MiB
