"""A fake trace against the same loop run on real CPU tensors, and the determinism of the tracer.

The real run allocates real (uninitialised) tensors and computes; the fake run allocates nothing. Both use the
same shims, so any difference at a phase peak would come from fake-tensor semantics (storage sharing, views,
in-place ops) or from the tracer extending lifetimes.
"""

from __future__ import annotations

import gc

import pytest

from tests.trace._trace_tiny import TINY, spec
from vramledger.specs import Attention, LoraSpec, Method, TrainSpec
from vramledger.trace import trace_events, trace_step
from vramledger.trace.ledger_build import replay
from vramledger.trace.step import run_trace

CASES = {
    "full-sdpa": TrainSpec(method=Method.FULL, micro_batch=2, seq_len=48),
    "lora-dora-dropout-ckpt": TrainSpec(
        method=Method.LORA, micro_batch=2, seq_len=48, grad_ckpt=True, lora=LoraSpec(dropout=0.1, dora=True)
    ),
    "lora-eager": TrainSpec(method=Method.LORA, micro_batch=2, seq_len=48, attn=Attention.EAGER),
}


@pytest.mark.parametrize("case", sorted(CASES), ids=sorted(CASES))
def test_fake_matches_real_cpu_run(case: str) -> None:
    m, cfg = spec("llama_tied"), TINY["llama_tied"]
    fake = replay(run_trace(m, CASES[case], config=cfg, fake=True).events)[0]
    real = replay(run_trace(m, CASES[case], config=cfg, fake=False).events)[0]
    for phase in real:
        print(case, phase.value, "real", real[phase].live, "fake", fake[phase].live)
        assert abs(fake[phase].live - real[phase].live) <= 512
        assert fake[phase].op == real[phase].op


def test_two_traces_identical_and_gc_independent() -> None:
    m, cfg = spec("llama_tied"), TINY["llama_tied"]
    train = CASES["lora-dora-dropout-ckpt"]
    first = trace_events(m, train, config=cfg)
    second = trace_events(m, train, config=cfg)
    gc.disable()
    try:
        no_gc = trace_events(m, train, config=cfg)
    finally:
        gc.enable()
    assert first == second == no_gc


def test_global_state_restored() -> None:
    import torch
    import transformers.masking_utils as mu

    before = (
        torch.clear_autocast_cache,
        mu.find_packed_sequence_indices,
        torch._C._len_torch_function_stack(),
    )
    trace_step(spec("llama"), CASES["full-sdpa"], config=TINY["llama"])
    after = (
        torch.clear_autocast_cache,
        mu.find_packed_sequence_indices,
        torch._C._len_torch_function_stack(),
    )
    assert before == after
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    assert _get_current_dispatch_mode() is None
