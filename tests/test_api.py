"""The notebook entry point ``vramledger.estimate``: the same ledger as the command line, a rich display."""

from __future__ import annotations

import json

import pytest

import vramledger
from vramledger.cli import main
from vramledger.errors import VramledgerError


def test_estimate_matches_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    r = vramledger.estimate("qwen2.5-0.5b", method="qlora", batch=2, seq=1024, gpu="rtx-4090")
    assert (
        main(
            [
                "estimate",
                "qwen2.5-0.5b",
                "--method",
                "qlora",
                "--batch",
                "2",
                "--seq",
                "1024",
                "--gpu",
                "rtx-4090",
                "--json",
            ]
        )
        == 0
    )
    cli = json.loads(capsys.readouterr().out)
    assert r.to_dict()["device_total_bytes"] == cli["device_total_bytes"]
    assert r.fits is True and r.preset == "llamafactory"


def test_rich_display_in_a_notebook() -> None:
    r = vramledger.estimate("llama-3.1-8b", method="full", gpu="rtx-4090")
    html = r._repr_html_()
    assert html.startswith('<div class="vramledger">') and "DOES NOT FIT" in html and "<table" in html
    assert "matplotlib" not in html and "<svg" not in html  # the table only: instant, no figures
    assert "DOES NOT FIT" in str(r)


def test_unknown_settings_are_named() -> None:
    with pytest.raises(VramledgerError, match="unknown setting 'methd'"):
        vramledger.estimate("qwen2.5-0.5b", methd="lora")
    with pytest.raises(VramledgerError, match="TrainSpec method: unknown value 'lorra'"):
        vramledger.estimate("qwen2.5-0.5b", method="lorra")
