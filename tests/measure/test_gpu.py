"""On a real CUDA GPU (skipped without one): the worker's readings and the OOM isolation."""

from __future__ import annotations

import pytest

from vramledger.catalog import resolve_model
from vramledger.measure.harness import measure
from vramledger.specs import Method, Optimizer, Precision, TrainSpec

pytestmark = pytest.mark.gpu

TINY_PARAMS = 2 * 256 * 64 + 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64  # test_worker.py


def test_tiny_full_bf16_mixed_on_cuda(tiny_model) -> None:  # type: ignore[no-untyped-def]
    train = TrainSpec(
        method=Method.FULL,
        precision=Precision.BF16_MIXED,
        optimizer=Optimizer.ADAMW,
        micro_batch=2,
        seq_len=64,
    )
    m = measure(tiny_model, train, timeout_s=300)
    raw = m.result.raw
    assert m.result.status == "ok", m.result.stderr_tail
    print(raw["phases"], raw["environment"])
    # Mixed precision: trainable weights fp32 (the master weights), so gradients and both Adam moments too.
    assert raw["gradients_bytes"] >= TINY_PARAMS * 4
    assert raw["optimizer_state_bytes"] >= 2 * TINY_PARAMS * 4
    ph = raw["phases"]
    assert ph["optimizer"]["allocated"] >= 4 * TINY_PARAMS * 4
    assert all(f["reserved"] >= f["allocated"] for f in ph.values())
    env = raw["environment"]
    assert env["gpu_total_bytes"] > 0 and env["versions"]["torch"]
    if env.get("nvml_source"):  # NVML or nvidia-smi answered: device totals exist and include a context
        assert all(f["device"] is not None and f["device"] >= f["reserved"] for f in ph.values())
        assert m.ledger is not None and m.ledger.device_total > m.ledger.peak_reserved


def test_lora_eval_generate_on_cuda(tiny_model) -> None:  # type: ignore[no-untyped-def]
    train = TrainSpec(
        method=Method.LORA,
        micro_batch=2,
        seq_len=64,
        eval_batch=2,
        predict_with_generate=True,
        generation_max_new_tokens=8,
        grad_ckpt=True,
    )
    m = measure(tiny_model, train, timeout_s=300)
    assert m.result.status == "ok", m.result.error + m.result.stderr_tail
    assert {"eval", "generate"} <= set(m.result.raw["phases"])


def test_real_oom_does_not_poison_the_next_trial(tiny_model) -> None:  # type: ignore[no-untyped-def]
    # Full fp32 fine-tuning of an 8B model needs 16 bytes per parameter before activations: 128 GB.
    big = TrainSpec(method=Method.FULL, precision=Precision.FP32, micro_batch=8, seq_len=4096)
    oom = measure(resolve_model("llama-3-8b"), big, timeout_s=600)
    assert oom.result.status == "oom", oom.result.error
    ok = measure(tiny_model, TrainSpec(method=Method.LORA, micro_batch=1, seq_len=32), timeout_s=300)
    assert ok.result.status == "ok"
    assert ok.result.raw["counters"]["num_ooms"] == 0
