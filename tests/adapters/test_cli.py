"""`vramledger estimate --config FILE` end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramledger.cli import main

F = Path(__file__).parent / "fixtures"


def test_estimate_llamafactory_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--config", str(F / "lf_llama3_lora_sft.yaml"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # LoRA r=8 on every linear layer of Llama-3-8B (hidden 4096, kv 1024, MLP 14336, 32 layers), by hand:
    # q,o: 8·(4096+4096) each; k,v: 8·(4096+1024) each; gate,up,down: 8·(4096+14336) each
    per_layer = 2 * 8 * 8192 + 2 * 8 * 5120 + 3 * 8 * 18432
    assert out["trainable_params"] == 32 * per_layer == 20_971_520


def test_estimate_flags_override_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--config", str(F / "lf_llama3_lora_sft.yaml"), "--lora-rank", "16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["trainable_params"] == 2 * 20_971_520  # r doubles every adapter


def test_estimate_trl_lora_keeps_an_fp32_base(capsys: pytest.CaptureFixture[str]) -> None:
    # TRL loads the model in float32 by default (trainer/model_config.py dtype='float32'): the frozen base
    # weighs 4 bytes per parameter, not 2. Qwen2-0.5B has 494,032,768 parameters (tied embeddings).
    assert main(["estimate", "--config", str(F / "trl_sft_lora.yaml"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    frozen = [i for i in out["items"] if i["phase"] == "load" and i["label"].startswith("frozen")]
    assert frozen[0]["bytes"] == 4 * 494_032_768
    assert len(out["warnings"]) == len(set(out["warnings"]))  # no warning printed twice


def test_estimate_unresolvable_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model_name_or_path: someone/private-13b\nstage: sft\nfinetuning_type: lora\n")
    assert main(["estimate", "--config", str(cfg)]) == 2
    assert "download its config.json" in capsys.readouterr().err
    # the model given on the command line wins, so the file's unresolvable one is no longer an error
    assert main(["estimate", "llama-3-8b", "--config", str(cfg), "--json"]) == 0
