"""Export: the page's setup written back as the user's framework config (read back by the adapters, the model
untouched), as the CLI's JSON, and as the HTML report. The server answers with text; nothing is written by it."""

from __future__ import annotations

import json

import pytest

from tests.ui.conftest import EXAMPLE, run_cli
from vramledger.adapters import load_config
from vramledger.specs import Method


def _export(client, body):
    status, raw = client.post("export", body)
    assert status == 200, raw
    return json.loads(raw)


def test_the_config_comes_back_in_its_format_with_the_sliders_applied(client, tmp_path):
    """The server's --config (LLaMA-Factory), micro-batch 4 and length 4096 moved on the page: the export is a
    LLaMA-Factory file that the adapters read back to the same setup, with the model the file named."""
    out = _export(client, {"startup_config": True, "batch": 4, "seq": 4096, "as": "config"})
    assert out["filename"].endswith("-llamafactory.yaml")
    path = tmp_path / out["filename"]
    path.write_text(out["content"])
    back = load_config(path)
    original = load_config(EXAMPLE)
    print(back.train)
    assert back.model == "meta-llama/Meta-Llama-3-8B-Instruct" == original.model
    assert back.format == "llamafactory"
    assert (back.train.micro_batch, back.train.seq_len) == (4, 4096)
    # everything else as the file had it
    assert back.train.grad_accum == original.train.grad_accum == 8
    assert back.train.method is Method.LORA and back.train.lora is not None and back.train.lora.rank == 8
    assert back.train.precision is original.train.precision
    assert back.train.grad_ckpt is original.train.grad_ckpt


@pytest.mark.parametrize("fmt", ["trl", "axolotl"])
def test_other_formats_read_back(client, tmp_path, fmt):
    out = _export(
        client,
        {"model": "meta-llama/Llama-3.1-8B", "method": "qlora", "batch": 2, "seq": 2048, "grad_ckpt": True, "as": fmt},
    )
    path = tmp_path / out["filename"]
    path.write_text(out["content"])
    back = load_config(path)
    assert back.format == fmt
    assert back.model == "meta-llama/Llama-3.1-8B"
    assert (back.train.method, back.train.micro_batch, back.train.seq_len, back.train.grad_ckpt) == (
        Method.QLORA,
        2,
        2048,
        True,
    )


def test_json_export_is_the_clis_json(client, capsys):
    _, out, _ = run_cli(capsys, ["estimate", "llama-3.2-1b", "--batch", "2", "--gpu", "rtx-4090", "--json"])
    got = _export(client, {"model": "llama-3.2-1b", "batch": 2, "gpu": "rtx-4090", "as": "json"})
    assert got["content"] == out


def test_html_export_is_the_report(client, capsys):
    pytest.importorskip("matplotlib")
    got = _export(client, {"model": "llama-3.2-1b", "batch": 2, "gpu": "rtx-4090", "as": "html"})
    ledger = json.loads(run_cli(capsys, ["estimate", "llama-3.2-1b", "--batch", "2", "--gpu", "rtx-4090", "--json"])[1])
    page = got["content"]
    assert got["media_type"] == "text/html"
    assert page.startswith("<!DOCTYPE html>")
    assert f"params {ledger['params']:,}" in page
    assert 'data-figure="bill"' in page and 'data-figure="cliff_grid"' in page
    assert 'src="http' not in page and 'href="http' not in page  # nothing loaded (sources cited as text are)


def test_unknown_export_names_the_choices(client):
    status, raw = client.post("export", {"model": "gpt2", "as": "docx"})
    assert status == 400
    assert "as: unknown export 'docx'" in json.loads(raw)["error"]
