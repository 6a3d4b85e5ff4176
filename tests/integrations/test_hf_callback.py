"""The HF Trainer callback end to end on CPU: a real ``Trainer.train()`` of a tiny Llama for 3 steps, with the CUDA
statistics behind a scripted stand-in (tests/integrations/conftest.py ``FakeStats``)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.conftest import FakeStats

MiB = 2**20


def _train(model: Any, tmp_path: Path, stats: FakeStats, **cb: Any) -> tuple[Any, Any, list[str]]:
    import torch
    from transformers import Trainer, TrainingArguments

    from vramledger.integrations.hf import VramledgerCallback

    g = torch.Generator().manual_seed(0)
    ds = [
        {"input_ids": torch.randint(0, 128, (16,), generator=g), "labels": torch.randint(0, 128, (16,), generator=g)}
        for _ in range(12)
    ]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=3,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=ds)
    callback = VramledgerCallback.attach(trainer, out=tmp_path / "memory.jsonl", stats=stats, **cb)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return trainer, callback, [str(w.message) for w in caught if w.category.__name__ == "MemoryWarning"]


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_three_steps_record_every_phase_and_the_batch(tiny_llama: Any, tmp_path: Path) -> None:
    # per phase read: forward, backward (x2 micro-batches), then the optimizer: scripted peaks in that order
    stats = FakeStats(
        peaks={
            0: (10 * MiB, 12 * MiB),
            1: (20 * MiB, 24 * MiB),
            2: (11 * MiB, 13 * MiB),
            3: (21 * MiB, 25 * MiB),
            4: (15 * MiB, 26 * MiB),
        }
    )
    trainer, cb, _ = _train(tiny_llama, tmp_path, stats)
    recs = _records(cb.watcher.out)
    steps = [r for r in recs if r["event"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    first = steps[0]
    assert (first["batch"], first["micro_batches"], first["longest"]) == ([2, 16], 2, [2, 16])
    # each phase keeps the larger of its two micro-batches' peaks
    assert first["phases"] == {
        "forward": {"max_allocated": 11 * MiB, "max_reserved": 13 * MiB},
        "backward": {"max_allocated": 21 * MiB, "max_reserved": 25 * MiB},
        "optimizer": {"max_allocated": 15 * MiB, "max_reserved": 26 * MiB},
    }
    # peaks reset at every phase start: 2 x (forward, backward) + optimizer per step
    assert stats.resets == 3 * 5
    # the prediction is for the live model: its parameter count is the model's own
    predict = next(r for r in recs if r["event"] == "predict")
    ledger_params = sum(p.numel() for p in tiny_llama.parameters())
    from vramledger.integrations.predict import model_spec

    assert predict["model"] == model_spec(tiny_llama).name and predict["batch"] == [2, 16]
    assert predict["settings"]["grad_accum"] == 2 and predict["settings"]["method"] == "full"
    print("expected params", ledger_params, "got", predict["params"])
    assert predict["params"] == ledger_params
    # the trainer's own log history carries the scalars
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged and logged[0]["vram/max_reserved_gib"] == pytest.approx(26 * MiB / 2**30)


def test_warns_before_step_zero_when_it_will_not_fit(tiny_llama: Any, tmp_path: Path) -> None:
    stats = FakeStats(capacity=64 * MiB)
    _, cb, warned = _train(tiny_llama, tmp_path, stats)
    recs = _records(cb.watcher.out)
    kinds = [r["event"] for r in recs]
    assert warned and warned[0].startswith("predicted NOT to fit")
    assert kinds.index("warning") < kinds.index("step")
    # the warning came before the first forward's peaks were reset (the batch had not run)
    assert stats.calls[0] == "reset" and stats.resets >= 1


def test_warns_when_measured_exceeds_the_prediction(tiny_llama: Any, tmp_path: Path) -> None:
    stats = FakeStats(peaks={0: (8 * 2**30, 8 * 2**30)})
    _, _, warned = _train(tiny_llama, tmp_path, stats)
    over = [w for w in warned if "over the predicted" in w]
    assert {w.split(":")[0] for w in over} == {"forward", "backward", "optimizer"}  # once per phase, not per step


def test_degrades_without_cuda(tiny_llama: Any, tmp_path: Path) -> None:
    from vramledger.integrations.stats import NoStats

    trainer, cb, warned = _train(tiny_llama, tmp_path, NoStats())  # type: ignore[arg-type]
    recs = _records(cb.watcher.out)
    assert recs[0]["measuring"] is False and not warned
    steps = [r for r in recs if r["event"] == "step"]
    assert len(steps) == 3 and all(r["phases"] == {} and r["batch"] == [2, 16] for r in steps)
    assert next(r for r in recs if r["event"] == "predict")["fits"] is None  # no GPU, no verdict


def test_a_peft_model_is_predicted_as_lora_with_its_own_settings(tiny_llama: Any, tmp_path: Path) -> None:
    """The live PEFT config decides method, rank, targets, dropout and the adapters' dtype — not defaults."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_llama, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.05)
    )
    _, cb, _ = _train(model, tmp_path, FakeStats())
    predict = next(r for r in _records(cb.watcher.out) if r["event"] == "predict")
    lora = predict["setup"]["train"]["lora"]
    assert predict["setup"]["train"]["method"] == "lora"
    assert (lora["rank"], sorted(lora["targets"]), lora["dropout"], lora["adapter_fp32"]) == (
        4,
        ["q_proj", "v_proj"],
        0.05,
        True,
    )
    # trainable parameters: the ledger's count equals the live model's
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    from vramledger.analytic import estimate
    from vramledger.explain import setup_from_record

    spec_model, spec_train = setup_from_record(predict["setup"], "test")
    print("expected trainable", trainable, "got", estimate(spec_model, spec_train).trainable_params)
    assert estimate(spec_model, spec_train).trainable_params == trainable
