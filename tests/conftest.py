"""Test-session hooks shared by every test package."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

# CI (``.ci/run`` sets CI=true) draws the property tests' examples from a fixed seed, so that a run is red only for a
# change, not for a draw; a developer's run draws new examples each time and finds what CI would not.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``gpu`` when no CUDA GPU is visible (torch is imported only if such tests exist)."""
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items or _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)
