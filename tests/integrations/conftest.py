"""A scriptable stand-in for the CUDA statistics, and a tiny causal LM built from a config (no download)."""

from __future__ import annotations

from typing import Any

import pytest


class FakeStats:
    """Reports the peaks a test scripts for each phase; logs every call so the order can be checked."""

    def __init__(
        self,
        *,
        capacity: int = 80 * 2**30,
        peaks: dict[int, tuple[int, int]] | None = None,
        snapshot: dict[str, Any] | None = None,
    ) -> None:
        self.cap = capacity
        self.script = list((peaks or {}).items())
        self.calls: list[str] = []
        self.resets = 0
        self.snap = snapshot
        self.observer: Any = None
        self.history = False

    def available(self) -> bool:
        return True

    def reset_peaks(self) -> None:
        self.resets += 1
        self.calls.append("reset")

    def peaks(self) -> tuple[int, int] | None:
        self.calls.append("peaks")
        # the n-th read returns the n-th scripted pair (cycling), else a fixed small figure
        if not self.script:
            return (1 << 20, 2 << 20)
        n = sum(1 for c in self.calls if c == "peaks") - 1
        return self.script[n % len(self.script)][1]

    def current(self) -> tuple[int, int] | None:
        return (3 << 20, 4 << 20)

    def capacity(self) -> int | None:
        return self.cap

    def device_name(self) -> str:
        return "Fake GPU"

    def start_history(self, max_entries: int) -> bool:
        self.history = True
        return True

    def stop_history(self) -> None:
        self.history = False

    def snapshot(self) -> dict[str, Any] | None:
        return self.snap

    def attach_oom_observer(self, observer: Any) -> bool:
        self.observer = observer
        return True


@pytest.fixture
def tiny_llama() -> Any:
    """A 2-layer Llama with random weights (transformers' own class, from a config)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg)
