"""``lora_target_parameters`` (axolotl, TRL), ``target_parameters`` (PEFT's adapter_config.json) and
``--lora-target-parameters``: each reaches ``LoraSpec.parameters`` as the framework hands it to PEFT's LoraConfig.

Truths, the upstream lines: axolotl ``loaders/adapter.py`` ``_build_peft_lora_config``
(``LoraConfig(target_modules=cfg.lora_target_modules or [], target_parameters=cfg.lora_target_parameters or [])``,
so neither key is needed beside the other); TRL ``trainer/utils.py`` ``get_peft_config``
(``LoraConfig(target_modules=model_args.lora_target_modules, target_parameters=model_args.lora_target_parameters)``:
unset target modules are PEFT's defaults for the model type); PEFT 0.21 ``tuners/lora/config.py``
(``target_parameters`` a list of strings or None; ``target_modules=[]`` adapts no module)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramledger.adapters import load_config
from vramledger.cli import main

EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _write(tmp_path: Path, text: str, name: str = "train.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_axolotl_reads_them_beside_the_modules(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "base_model: Qwen/Qwen3-30B-A3B\nadapter: lora\nlora_r: 32\nlora_alpha: 16\nlora_dropout: 0\n"
        "lora_target_modules: [q_proj, k_proj]\n"
        "lora_target_parameters:\n  - mlp.experts.gate_up_proj\n  - mlp.experts.down_proj\n"
        "sequence_len: 2048\nmicro_batch_size: 1\n",
    )
    rc = load_config(path)
    lora = rc.train.lora
    assert lora is not None
    assert (lora.rank, lora.targets, lora.parameters) == (32, ("q_proj", "k_proj"), EXPERTS)
    assert "lora_target_parameters" in rc.provenance["lora"]
    assert not any("lora_target_parameters" in w for w in rc.warnings)  # read, no longer "ignored"


def test_axolotl_parameters_alone_need_no_target_modules(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "base_model: Qwen/Qwen3-30B-A3B\nadapter: lora\nlora_r: 8\nlora_target_parameters: mlp.experts.down_proj\n",
    )
    lora = load_config(path).train.lora
    assert lora is not None and (lora.targets, lora.parameters) == ((), ("mlp.experts.down_proj",))


def test_trl_reads_them_with_peft_s_default_modules(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "model_name_or_path: Qwen/Qwen3-30B-A3B\nuse_peft: true\nlora_dropout: 0.0\n"
        "lora_target_parameters: [mlp.experts.gate_up_proj, mlp.experts.down_proj]\n",
    )
    lora = load_config(path).train.lora
    assert lora is not None
    # model_config.py lora_r=16; PEFT's qwen3_moe default target modules q_proj, v_proj
    assert (lora.rank, lora.targets, lora.parameters) == (16, ("q_proj", "v_proj"), EXPERTS)


def test_trl_keeps_its_default_dropout_which_paramwrapper_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """TRL's lora_dropout defaults to 0.05 (model_config.py) and PEFT's ParamWrapper raises for it: so does the
    estimate, naming the fix."""
    path = _write(
        tmp_path,
        "model_name_or_path: Qwen/Qwen3-30B-A3B\nuse_peft: true\nlora_target_parameters: [mlp.experts.down_proj]\n",
    )
    code = main(["estimate", "--config", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "ParamWrapper does not work with lora_dropout 0.05; set lora_dropout 0" in err[0]


def test_adapter_config_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": [], "target_parameters": list(EXPERTS)}
    path = _write(tmp_path, json.dumps(cfg), "adapter_config.json")
    code = main(["estimate", "qwen3-30b-a3b", "--peft-config", str(path), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    doc = json.loads(out)
    # by hand, r 8, 48 layers of 128 experts: gate_up 8·128·(2048 + 1536), down 8·128·(768 + 2048)
    assert doc["trainable_params"] == 48 * 8 * 128 * ((2048 + 1536) + (768 + 2048))
    assert doc["settings"]["lora"]["target_parameters"] == list(EXPERTS)


def test_adapter_config_json_refuses_a_string(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = {"peft_type": "LORA", "r": 8, "target_parameters": "mlp.experts.down_proj"}
    path = _write(tmp_path, json.dumps(cfg), "adapter_config.json")
    code = main(["estimate", "qwen3-30b-a3b", "--peft-config", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and "target_parameters must be a list of parameter names" in err


def test_flag_and_its_error(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["estimate", "qwen3-30b-a3b", "--lora-targets", "q_proj", "--lora-dropout", "0", "--json"]
    code = main([*base, "--lora-target-parameters", ",".join(EXPERTS)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["settings"]["lora"]["target_parameters"] == list(EXPERTS)
    code = main([*base, "--lora-target-parameters", "mlp.experts.gate_proj"])
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err_lines) == 1
    assert err_lines[0].startswith("error: lora target parameters: mlp.experts.gate_proj match no weight of qwen3_moe")
