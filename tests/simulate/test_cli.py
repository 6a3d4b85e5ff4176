"""``vramledger simulate``: the JSON keys the issue names, the terminal summary, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from tests.trace._trace_tiny import TINY  # noqa: E402
from vramledger.cli import main  # noqa: E402

KEYS = {"high_water_reserved_bytes", "high_water_step", "oom_step", "oom_probability", "series", "remedies"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("sim")
    (d / "config.json").write_text(json.dumps(TINY["llama"]))
    (d / "lengths.json").write_text(
        json.dumps({"train_lengths": [30, 90, 12, 60, 44, 70, 20, 100] * 2, "eval_lengths": [50, 64, 33, 10]})
    )
    return d / "config.json", d / "lengths.json"


def test_json(setup: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    config, lengths = setup
    rc = main(
        [
            "simulate",
            str(config),
            "--method",
            "lora",
            "--batch",
            "2",
            "--seq",
            "128",
            "--lengths",
            str(lengths),
            "--steps",
            "6",
            "--eval-steps",
            "3",
            "--eval-batch",
            "2",
            "--eval-batches",
            "2",
            "--gpu",
            "24GiB",
            "--shuffles",
            "2",
            "--json",
            "--html",
            str(config.parent / "sim.html"),
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert set(out) >= KEYS
    series = out["series"]
    # The ground-truth file's order is kept: batches of 2 padded to max(30, 90), max(12, 60), …
    assert series["kind"] == ["train"] * 3 + ["eval"] + ["train"] * 3 + ["eval"]
    assert series["padded_len"][:3] == [90, 60, 70] and series["padded_len"][3] == 64
    assert out["oom_step"] is None and out["oom_probability"] == 0.0
    assert out["high_water_reserved_bytes"] == max(series["peak_reserved_bytes"])
    assert len(out["remedies"]) >= 3 and all("high_water_reserved_bytes" in r for r in out["remedies"])
    page = (config.parent / "sim.html").read_text()
    assert "<svg" in page and "high-water reserved" in page and "http://" not in page and "https://" not in page


def test_bad_lengths_is_one_line(setup: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    config, _ = setup
    rc = main(["simulate", str(config), "--lengths", "1,2,3", "--steps", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: --lengths")
