"""The worker process on the CPU test mode: real tiny training steps, bytes counted, failures isolated."""

from __future__ import annotations

import pytest

from vramledger.measure.harness import measure
from vramledger.specs import Method, Optimizer, Precision, TrainSpec

# Hand count of the tiny Llama (tests/measure/conftest.py): embeddings 256×64 and lm_head 64×256 (untied);
# per layer q 64×64, k 64×32, v 64×32, o 64×64, gate/up/down 64×128 each, two RMSNorms of 64; final norm 64.
TINY_PARAMS = 2 * 256 * 64 + 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64
FULL_FP32 = TrainSpec(
    method=Method.FULL, precision=Precision.FP32, optimizer=Optimizer.ADAMW, micro_batch=2, seq_len=32
)


@pytest.fixture(scope="module")
def clean_run(tiny_model):  # type: ignore[no-untyped-def]
    return measure(tiny_model, FULL_FP32, device="cpu", timeout_s=120)


def test_cpu_trial_counts_what_adamw_holds(clean_run) -> None:  # type: ignore[no-untyped-def]
    raw = clean_run.result.raw
    assert clean_run.result.status == "ok", clean_run.result.stderr_tail
    p_bytes = TINY_PARAMS * 4  # fp32
    print(f"params expected {TINY_PARAMS}, got {raw['params']}")
    assert raw["params"] == TINY_PARAMS == raw["trainable_params"]
    # Weights: every fp32 parameter, plus two rotary buffers of head_dim / 2 fp32 values (inv_freq and its
    # clone original_inv_freq: LlamaRotaryEmbedding.__init__, transformers 5 modeling_llama.py).
    assert raw["weights_bytes"] == p_bytes + 2 * (16 // 2) * 4
    # AdamW keeps exp_avg and exp_avg_sq per parameter (torch.optim.AdamW._init_group), plus a 4-byte
    # `step` tensor per parameter tensor (21 tensors here: 2 + 2 × 9 + 1) when not fused/capturable.
    assert raw["optimizer_state_bytes"] == 2 * p_bytes + 21 * 4
    assert raw["gradients_bytes"] == p_bytes
    phases = raw["phases"]
    assert set(phases) == {"load", "forward", "backward", "optimizer"}
    # At the optimizer step weights, gradients and both moments are all live at once.
    assert phases["optimizer"]["allocated"] >= 4 * p_bytes
    # Forward with three steps: from step 2 on, weights + optimizer states are resident before any activation.
    assert phases["forward"]["allocated"] > 3 * p_bytes


def test_ledger_lines_add_up_to_the_measured_peaks(clean_run) -> None:  # type: ignore[no-untyped-def]
    ledger = clean_run.ledger
    assert ledger is not None and ledger.engine == "measure"
    for name, fig in clean_run.result.raw["phases"].items():
        phase = next(p for p in ledger.phases if p.value == name)
        assert ledger.allocated(phase) == fig["allocated"]
        assert ledger.reserved(phase) == fig["reserved"]
    assert all(i.basis.value == "measurement" for i in ledger.items)


def test_injected_oom_does_not_poison_the_next_trial(tiny_model, clean_run, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    bad = measure(tiny_model, FULL_FP32, device="cpu", env={"VRAMLEDGER_WORKER_FAULT": "oom"}, timeout_s=120)
    assert bad.result.status == "oom" and bad.ledger is None
    assert "OutOfMemoryError" in bad.result.error
    again = measure(tiny_model, FULL_FP32, device="cpu", timeout_s=120)
    assert again.result.status == "ok"
    assert again.result.raw["phases"] == clean_run.result.raw["phases"]


def test_crashed_worker_is_reported_and_the_next_trial_runs(tiny_model, clean_run) -> None:  # type: ignore[no-untyped-def]
    dead = measure(tiny_model, FULL_FP32, device="cpu", env={"VRAMLEDGER_WORKER_FAULT": "crash"}, timeout_s=120)
    assert dead.result.status == "crashed"
    assert dead.result.returncode != 0
    again = measure(tiny_model, FULL_FP32, device="cpu", timeout_s=120)
    assert again.result.raw["phases"] == clean_run.result.raw["phases"]


def test_fake_capacity_turns_into_an_oom_status(tiny_model, clean_run) -> None:  # type: ignore[no-untyped-def]
    peak = max(f["allocated"] for f in clean_run.result.raw["phases"].values())
    low = measure(tiny_model, FULL_FP32, device="cpu", fake_capacity_bytes=peak - 1, timeout_s=120)
    assert low.result.status == "oom"
    assert low.result.raw["counters"]["num_ooms"] == 1
    assert low.result.fits is False


def test_hung_worker_times_out(tiny_model) -> None:  # type: ignore[no-untyped-def]
    hung = measure(tiny_model, FULL_FP32, device="cpu", env={"VRAMLEDGER_WORKER_FAULT": "hang"}, timeout_s=1.5)
    assert hung.result.status == "timeout"
    with pytest.raises(Exception, match="timeout"):
        hung.result.fits  # noqa: B018 - a timeout says nothing about memory: the search must stop


def test_unsupported_loss_is_reported_not_run(tiny_model) -> None:  # type: ignore[no-untyped-def]
    from dataclasses import replace

    from vramledger.specs import Loss

    res = measure(tiny_model, replace(FULL_FP32, loss=Loss.FUSED), device="cpu", timeout_s=120)
    assert res.result.status == "unsupported"
    assert "loss fused" in res.result.error
