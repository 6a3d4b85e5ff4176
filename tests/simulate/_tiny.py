"""Templates of a tiny Llama (tests/trace/_trace_tiny.py), traced once per test process and shared."""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any

from tests.trace._trace_tiny import TINY, spec
from vramledger.specs import LoraSpec, Method, TrainSpec

TRAIN = TrainSpec(
    method=Method.LORA, micro_batch=2, seq_len=64, grad_ckpt=True, lora=LoraSpec(rank=8, alpha=16.0, dropout=0.1)
)
EVAL_BATCH = 3
HELD_OUT = 50
"""A length the templates were not traced at (their reference is a prime above 60)."""


@cache
def templates() -> Any:
    from vramledger.simulate.templates import build_templates

    return build_templates(spec("llama"), TRAIN, eval_batch=EVAL_BATCH, config=TINY["llama"])


@cache
def real_trace(length: int = HELD_OUT) -> tuple[Any, list[Any]]:
    """The real trace at ``length`` and its device events (cuBLAS workspaces inserted)."""
    from vramledger.trace.api import trace_result
    from vramledger.trace.oom import device_events

    _, events = trace_result(
        spec("llama"), dataclasses.replace(TRAIN, seq_len=length), config=TINY["llama"], eval_shape=(EVAL_BATCH, length)
    )
    return events, device_events(events, None)
