"""The plain-loop context manager, the Lightning hooks with stand-ins for Lightning's objects, and the OOM
post-mortem the watcher writes from the allocator's observer (fed a synthetic snapshot)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest

from tests.explain.conftest import REQUEST, make_snapshot
from tests.integrations.conftest import FakeStats

MiB = 2**20


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _step(model: Any, opt: Any, w: Any, step: int) -> None:
    import torch

    ids = torch.randint(0, 128, (3, 12), generator=torch.Generator().manual_seed(step))
    w.batch(ids.shape)
    with w.phase("forward"):
        loss = model(input_ids=ids, labels=ids).loss
    with w.phase("backward"):
        loss.backward()
    with w.phase("optimizer"):
        opt.step()
        opt.zero_grad()
    w.end_step(step)


def test_plain_loop(tiny_llama: Any, tmp_path: Path) -> None:
    import torch

    from vramledger.integrations.loop import watch_memory

    opt = torch.optim.AdamW(tiny_llama.parameters(), lr=1e-3, foreach=False)
    stats = FakeStats(peaks={0: (5 * MiB, 6 * MiB), 1: (7 * MiB, 8 * MiB), 2: (6 * MiB, 9 * MiB)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with watch_memory(tiny_llama, opt, out=tmp_path / "m.jsonl", stats=stats) as w:
            for step in range(2):
                _step(tiny_llama, opt, w, step)
    recs = _records(tmp_path / "m.jsonl")
    predict = next(r for r in recs if r["event"] == "predict")
    # the optimizer's class and flags decide the spec: AdamW(foreach=False) is the for-loop AdamW
    assert predict["settings"]["optimizer"] == "adamw_torch_forloop" and predict["batch"] == [3, 12]
    steps = [r for r in recs if r["event"] == "step"]
    assert steps[0]["phases"]["backward"] == {"max_allocated": 7 * MiB, "max_reserved": 8 * MiB}


def test_the_jsonl_never_overwrites(tiny_llama: Any, tmp_path: Path) -> None:
    from vramledger.integrations.loop import watch_memory

    mine = tmp_path / "m.jsonl"
    mine.write_text("mine\n")
    with watch_memory(tiny_llama, out=mine, stats=FakeStats()) as w:
        assert w.watcher.out == tmp_path / "m.1.jsonl"
    assert mine.read_text() == "mine\n"


class _Trainer:
    precision = "bf16-mixed"
    accumulate_grad_batches = 4
    global_step = 0

    def __init__(self, opt: Any) -> None:
        self.optimizers = [opt]


class _Module:
    """A LightningModule stand-in: holds the HF model, records ``log`` calls."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.logged: dict[str, float] = {}

    def modules(self) -> Any:
        return self.model.modules()

    def parameters(self) -> Any:
        return self.model.parameters()

    def named_parameters(self) -> Any:
        return self.model.named_parameters()

    def log(self, name: str, value: float) -> None:
        self.logged[name] = value


def test_lightning_hooks(tiny_llama: Any, tmp_path: Path) -> None:
    import torch

    from vramledger.integrations.lightning import LightningWatch

    opt = torch.optim.AdamW(tiny_llama.parameters(), fused=False)
    trainer, module = _Trainer(opt), _Module(tiny_llama)
    cb = LightningWatch(out=tmp_path / "l.jsonl", stats=FakeStats())
    batch = {"input_ids": torch.zeros(2, 20, dtype=torch.long)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cb.on_train_start(trainer, module)
        cb.on_train_batch_start(trainer, module, batch, 0)
        cb.on_before_backward(trainer, module, None)
        cb.on_before_optimizer_step(trainer, module, opt)
        cb.on_train_batch_end(trainer, module, None, batch, 0)
        cb.on_train_end(trainer, module)
    recs = _records(tmp_path / "l.jsonl")
    predict = next(r for r in recs if r["event"] == "predict")
    # Lightning's precision name and accumulation reach the spec; the HF config inside the module is found
    assert (predict["settings"]["precision"], predict["settings"]["grad_accum"]) == ("bf16-mixed", 4)
    assert predict["batch"] == [2, 20]
    assert set(next(r for r in recs if r["event"] == "step")["phases"]) == {"forward", "backward", "optimizer"}
    assert module.logged["vram/longest_seq"] == 20.0


def test_lightning_callback_without_lightning_says_what_to_install() -> None:
    from vramledger.errors import VramledgerError
    from vramledger.integrations import lightning

    if lightning._Callback is not None:
        pytest.skip("lightning is installed here")
    with pytest.raises(VramledgerError, match="needs Lightning.*pip install lightning"):
        lightning.VramledgerLightningCallback()


def test_oom_observer_writes_snapshot_and_postmortem(tiny_llama: Any, tmp_path: Path) -> None:
    import pickle

    import torch

    from vramledger.integrations.loop import watch_memory

    opt = torch.optim.AdamW(tiny_llama.parameters())
    stats = FakeStats(capacity=1100 * MiB, snapshot=make_snapshot())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with watch_memory(tiny_llama, opt, out=tmp_path / "m.jsonl", stats=stats, record_history=True) as w:
            w.batch((2, 16))
            w.watcher.enter("backward")
            assert stats.history and stats.observer is not None
            stats.observer(0, REQUEST, 1100 * MiB, 12 * MiB)  # what the allocator calls before raising
    assert not stats.history  # recording stopped at the end
    oom = next(r for r in _records(tmp_path / "m.jsonl") if r["event"] == "oom")
    assert (oom["diagnosis"], oom["phase"], oom["batch"]["shape"]) == ("fragmentation", "backward", [2, 16])
    assert pickle.loads((tmp_path / oom["snapshot"]).read_bytes()) == make_snapshot()
    text = (tmp_path / oom["postmortem_text"]).read_text()
    assert text.startswith("out of memory: fragmentation")
    assert "<h1>Out of memory: fragmentation</h1>" in (tmp_path / oom["postmortem_html"]).read_text()
    assert any("CUDA out of memory: fragmentation" in str(c.message) for c in caught)
    # explain reads the JSONL back to the same cause
    from vramledger.explain import explain, read_evidence

    assert explain(read_evidence(tmp_path / "m.jsonl")).diagnosis.value == "fragmentation"


def test_explain_rebuilds_the_prediction_from_the_jsonl(tiny_llama: Any, tmp_path: Path) -> None:
    """The JSONL alone gives the same comparison and fixes as the post-mortem written at the OOM."""
    import torch

    from vramledger.explain import explain, read_evidence
    from vramledger.integrations.loop import watch_memory
    from vramledger.report.postmortem import postmortem_to_dict

    opt = torch.optim.AdamW(tiny_llama.parameters())
    stats = FakeStats(capacity=1100 * MiB, snapshot=make_snapshot())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with watch_memory(tiny_llama, opt, out=tmp_path / "m.jsonl", stats=stats, record_history=True) as w:
            w.batch((2, 16))
            w.watcher.enter("forward")
            stats.observer(0, REQUEST, 1100 * MiB, 12 * MiB)
    oom = next(r for r in _records(tmp_path / "m.jsonl") if r["event"] == "oom")
    later = postmortem_to_dict(explain(read_evidence(tmp_path / "m.jsonl")))
    assert later["prediction"]["phase"] == "forward"
    assert [f["change"] for f in later["fixes"]] == [f["change"] for f in oom["fixes"]]
    assert later["by_category"] == oom["by_category"]


def test_a_failing_postmortem_never_replaces_the_oom(tiny_llama: Any, tmp_path: Path) -> None:
    """The observer runs inside the allocator's failure: an error of ours is recorded, not raised."""
    from vramledger.integrations.loop import watch_memory

    class Broken(FakeStats):
        def snapshot(self) -> dict[str, Any] | None:
            raise RuntimeError("snapshot failed")

    stats = Broken()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with watch_memory(tiny_llama, out=tmp_path / "m.jsonl", stats=stats, record_history=True):
            stats.observer(0, REQUEST, 1100 * MiB, 12 * MiB)  # must not raise
    oom = next(r for r in _records(tmp_path / "m.jsonl") if r["event"] == "oom")
    assert "postmortem_error" in oom and any("post-mortem failed" in str(c.message) for c in caught)


def test_a_model_without_a_transformers_config_trains_on_with_one_warning(tmp_path: Path) -> None:
    import torch

    from vramledger.integrations.loop import watch_memory

    model = torch.nn.Linear(4, 4)  # no config.model_type: nothing to predict from
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with watch_memory(model, out=tmp_path / "m.jsonl", stats=FakeStats()) as w:
            for step in range(2):
                w.batch((2, 4 + step))
                with w.phase("forward"):
                    model(torch.ones(2, 4)).sum()
                w.end_step(step)
    notes = [str(c.message) for c in caught if c.category.__name__ == "MemoryWarning"]
    assert len(notes) == 1 and notes[0].startswith("no prediction:")
    assert len([r for r in _records(tmp_path / "m.jsonl") if r["event"] == "step"]) == 2
