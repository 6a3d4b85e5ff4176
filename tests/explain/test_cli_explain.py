"""`vramledger explain` as a user meets it: a message, a log, standard input, --json, --html, the setup's fixes
in the user's own keys (checked by reading them back through the adapter), one-line errors."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import pytest

from tests.explain.conftest import make_snapshot
from tests.explain.test_oom_message import CASES
from vramledger.cli import main

ROOT = Path(__file__).resolve().parents[2]
LERF = CASES[4].values[0]  # kerrj/lerf#73, torch 2.1
ISSUE_16417 = CASES[6].values[0]  # pytorch/pytorch#16417, torch >= 2.2
OLD = CASES[2].values[0]  # pytorch/pytorch#59778, torch 1.4-2.0: no NVML line
JSON_KEYS = {
    "requested_bytes",
    "capacity_bytes",
    "free_bytes",
    "process_bytes",
    "allocated_bytes",
    "reserved_bytes",
    "diagnosis",
}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_pasted_message(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "explain", LERF)
    assert code == 0
    assert out.startswith("out of memory: fragmentation")
    assert "reserved but unallocated        4.84 GiB" in out and "message wording                 torch 2.1" in out
    assert max(len(line) for line in out.splitlines()) <= 100


def test_fragmentation_without_a_setup_still_names_its_fix(capsys: pytest.CaptureFixture[str]) -> None:
    """The cache held 4.84 GiB free for a 3.00 GiB request (kerrj/lerf#73): expandable segments need no setup;
    the remedies priced against a setup wait for --config, and the message says so."""
    _, out, _ = run(capsys, "explain", LERF, "--json")
    fixes = json.loads(out)["fixes"]
    assert [f["keys"] for f in fixes] == [{"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}]
    assert fixes[0]["memory_saved_bytes"] is None
    _, text, _ = run(capsys, "explain", LERF)
    assert "pass --config" in text
    _, old, _ = run(capsys, "explain", OLD, "--json")
    assert json.loads(old)["fixes"] == []  # the driver refused: no allocator setting helps


def test_json_has_the_documented_keys(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "explain", OLD, "--json")
    data = json.loads(out)
    assert code == 0 and set(data) >= JSON_KEYS
    assert data["process_bytes"] is None  # the 1.4-2.0 wording has no NVML line
    assert data["reserved_bytes"] == round(1.24 * 2**30) and data["diagnosis"] == "driver_refused"


def test_a_log_file_and_standard_input(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "train.log"
    log.write_text("{'loss': 1.2}\nTraceback (most recent call last):\n" + ISSUE_16417 + "\n")
    _, from_file, _ = run(capsys, "explain", str(log), "--json")
    monkeypatch.setattr("sys.stdin", io.StringIO(ISSUE_16417))
    _, from_stdin, _ = run(capsys, "explain", "-", "--json")
    a, b = json.loads(from_file), json.loads(from_stdin)
    assert {k: a[k] for k in JSON_KEYS} == {k: b[k] for k in JSON_KEYS}


def test_a_snapshot_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(make_snapshot()))
    code, out, _ = run(capsys, "explain", str(path))
    assert code == 0 and "where the memory went" in out and "adamw.py:160 _init_group" in out


def test_html_is_written_once_never_over_a_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    page = tmp_path / "pm.html"
    code, _, err = run(capsys, "explain", LERF, "--html", str(page))
    assert code == 0 and page.is_file() and "http" not in page.read_text().replace("https://pytorch.org", "")
    before = page.read_text()
    code, _, err = run(capsys, "explain", LERF, "--html", str(page))
    assert code == 2 and err.startswith("error: --html:") and page.read_text() == before


def test_fixes_in_llamafactory_keys_read_back_to_the_saving(capsys: pytest.CaptureFixture[str]) -> None:
    """Each fix's keys, applied to the user's LLaMA-Factory file as overrides and read back by the adapter,
    give a setup whose estimate is smaller by the saving the fix claims."""
    from vramledger.adapters import load_config
    from vramledger.analytic import estimate
    from vramledger.catalog import resolve_gpu, resolve_model

    config = ROOT / "examples" / "llama3_lora_sft.yaml"
    base_overrides = ["cutoff_len=4096", "per_device_train_batch_size=2"]
    code, out, _ = run(
        capsys, "explain", ISSUE_16417, *base_overrides, "--config", str(config), "--gpu", "rtx-4090", "--json"
    )
    data = json.loads(out)
    assert code == 0 and data["prediction"]["predicted_fits"] is False
    gpu = resolve_gpu("rtx-4090")
    model = resolve_model("meta-llama/Meta-Llama-3-8B-Instruct")

    def device_total(overrides: list[str]) -> int:
        rc = load_config(config, overrides=overrides)
        return estimate(model, rc.train, gpu=gpu).device_total

    base = device_total(base_overrides)
    checked = 0
    for fix in data["fixes"]:
        keys = {k: v for k, v in fix["keys"].items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
        if not keys:
            continue
        after = device_total(base_overrides + [f"{k}={json.dumps(v)}" for k, v in keys.items()])
        print(fix["change"], "claimed", fix["memory_saved_bytes"], "read back", base - after)
        assert base - after == fix["memory_saved_bytes"]
        checked += 1
    assert checked >= 1


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["explain", "/nonexistent/oom.log"], "no file at /nonexistent/oom.log"),
        (["explain", "pyproject.toml"], "no CUDA out-of-memory message found"),
    ],
    ids=["missing-file", "no-message"],
)
def test_bad_input_is_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "" and err.startswith("error: ") and needle in err and err.count("\n") == 1
