"""The fit, plan and accum commands: exit codes, 100-column tables, JSON."""

from __future__ import annotations

import json

import pytest

from vramledger.cli import main

BASE = ["llama-3-8b", "--method", "lora", "--seq", "2048", "--gpu", "rtx-4090"]


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["fit", *BASE, "--batch", "4", "--grad-ckpt"], id="fit"),
        pytest.param(["plan", *BASE, "--batch", "4"], id="plan"),
        pytest.param(["accum", *BASE, "--global-batch", "16", "--grad-ckpt"], id="accum"),
    ],
)
def test_tables_fit_100_columns(argv: list[str], capsys) -> None:  # type: ignore[no-untyped-def]
    code = main(argv)
    out = capsys.readouterr().out
    assert code == 0, out
    assert max(len(line) for line in out.splitlines()) <= 100
    assert "\x1b[" not in out


@pytest.mark.parametrize("cmd", ["fit", "plan", "accum"])
def test_json(cmd: str, capsys) -> None:  # type: ignore[no-untyped-def]
    extra = ["--global-batch", "8"] if cmd != "fit" else []
    assert main([cmd, *BASE, "--grad-ckpt", "--json", *extra]) == 0
    data = json.loads(capsys.readouterr().out)
    if cmd == "plan":
        assert data["candidates"][0]["device_total"] <= data["usable_bytes"]
    if cmd == "accum":
        sc = data["schedule"]
        assert len(sc["steps"]) == len(sc["per_optimizer_step"])
    if cmd == "fit":
        assert data["frontier"]["points"][0]["micro_batch"] == 1


def test_plan_needs_a_gpu(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["plan", "llama-3-8b"]) == 2
    assert "plan needs a GPU" in capsys.readouterr().err


def test_plan_exit_3_when_nothing_fits(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["plan", "llama-3-70b", "--method", "full", "--gpu", "8GiB"]) == 3
