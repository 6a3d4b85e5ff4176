"""--preset: a flag-only setup takes a framework's defaults (each cited by its adapter), and says which."""

from __future__ import annotations

import json

import pytest

from vramledger.cli import main


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[dict[str, object], str]:
    assert main(["estimate", "llama-3.1-8b", "--json", *argv]) == 0
    out, err = capsys.readouterr()
    return json.loads(out), err


def test_the_default_is_llamafactory_and_is_named(capsys) -> None:
    doc, err = run_json(capsys)
    s = doc["settings"]
    # LLaMA-Factory: checkpointing on unless disable_gradient_checkpointing; lora_rank 8 (finetuning_args.py)
    assert s["grad_ckpt"] is True and s["lora"]["rank"] == 8 and s["optimizer"] == "adamw_torch_fused"
    assert err.startswith("note: preset: llamafactory defaults (the default;") and err.count("note: ") == 1


def test_presets_differ_where_the_frameworks_do(capsys) -> None:
    trl, err = run_json(capsys, "--preset", "trl")
    assert "note: preset: trl defaults:" in err
    assert trl["settings"]["lora"]["rank"] == 16  # TRL ModelConfig lora_r=16
    none, err = run_json(capsys, "--preset", "none")
    assert err == ""  # vramledger's bare defaults, nothing to say
    assert none["settings"]["grad_ckpt"] is False and none["settings"]["optimizer"] == "adamw_torch"


def test_flags_override_the_preset(capsys) -> None:
    doc, _ = run_json(capsys, "--no-grad-ckpt", "--lora-rank", "32")
    assert doc["settings"]["grad_ckpt"] is False and doc["settings"]["lora"]["rank"] == 32


def test_an_unknown_preset_is_one_error(capsys) -> None:
    assert main(["estimate", "llama-3.1-8b", "--preset", "banana"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --preset: unknown format 'banana'") and err.count("\n") == 1


def test_preset_with_a_config_is_refused(capsys, tmp_path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model_name_or_path: qwen2.5-0.5b\nstage: sft\nfinetuning_type: lora\n")
    assert main(["estimate", "--config", str(cfg), "--preset", "trl"]) == 2
    assert "--preset: only for setups given by flags" in capsys.readouterr().err
