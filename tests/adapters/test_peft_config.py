"""``--peft-config``: PEFT's adapter_config.json read, checked and estimated as the user meets it.

Truths: LoRA given as an adapter config must give the very ledger the equivalent flags give (the flags' path is
checked against traces elsewhere); a bad file is one ``error:`` line naming the field, exit 2; the IA3 and
prefix-tuning counts are hand derivations written here from PEFT 0.21's layer shapes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from vramledger.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def write(tmp_path: Path, cfg: Any, name: str = "adapter_config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(cfg) if not isinstance(cfg, str) else cfg)
    return path


def estimate_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code, out, err = run(capsys, "estimate", "llama-3.2-1b", "--seq", "512", "--json", *argv)
    assert code == 0, err
    return dict(json.loads(out))


def _bill(doc: dict[str, Any]) -> list[tuple[str, str, str, int]]:
    return [(i["category"], i["phase"], i["label"], i["bytes"]) for i in doc["items"]]


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_lora_config_gives_the_same_ledger_as_the_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], dora: bool
) -> None:
    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": 16,
        "lora_alpha": 32,
        "lora_dropout": 0.05,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "use_dora": dora,
        "base_model_name_or_path": "meta-llama/Llama-3.2-1B",
    }
    by_file = estimate_json(capsys, "--peft-config", str(write(tmp_path, cfg)))
    flags = ["--lora-rank", "16", "--lora-alpha", "32", "--lora-dropout", "0.05",
             "--lora-targets", "q_proj,k_proj,v_proj,o_proj"] + (["--dora"] if dora else [])  # fmt: skip
    by_flags = estimate_json(capsys, *flags)
    assert by_file["trainable_params"] == by_flags["trainable_params"]
    assert _bill(by_file) == _bill(by_flags)
    assert by_file["peak_allocated_bytes"] == by_flags["peak_allocated_bytes"]


def test_folder_holding_the_config_is_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path, {"peft_type": "IA3", "task_type": "CAUSAL_LM"})
    doc = estimate_json(capsys, "--peft-config", str(tmp_path))
    # IA3 default targets on Llama (PEFT utils/constants.py): k_proj and v_proj scale their outputs (Dkv = 512
    # each), down_proj (feedforward) its input (I = 8192): 16 layers × (512 + 512 + 8192).
    assert doc["trainable_params"] == 16 * (512 + 512 + 8192)
    assert doc["settings"]["peft_config"]["peft_type"] == "IA3"
    assert any("IA3 (PEFT 0.21)" in w and "vramledger trace --peft-config" in w for w in doc["warnings"])


def test_prefix_tuning_counts_and_adds_virtual_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plain = estimate_json(capsys, "--peft-config", str(write(tmp_path, {"peft_type": "IA3"}, "a.json")))
    doc = estimate_json(
        capsys, "--peft-config", str(write(tmp_path, {"peft_type": "PREFIX_TUNING", "num_virtual_tokens": 30}))
    )
    # PrefixEncoder (tuners/prefix_tuning/model.py): Embedding(n, layers · 2 · kv_heads · head_dim) = 30 × 16 · 2 · 512
    assert doc["trainable_params"] == 30 * 16 * 2 * 512
    assert plain["peak_allocated_bytes"] != doc["peak_allocated_bytes"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"task_type": "CAUSAL_LM"}, "peft_type must be a PEFT method"),
        ({"peft_type": "MAGIC"}, "peft_type must be a PEFT method"),
        ({"peft_type": "LORA", "r": -4}, "r must be an integer ≥ 0"),
        ({"peft_type": "LORA", "r": "8"}, "r must be an integer ≥ 0"),
        ({"peft_type": "IA3", "target_modules": [1, 2]}, "target_modules must be a module name"),
        ({"peft_type": "LORA", "task_type": "SEQ_CLS"}, "task_type must be CAUSAL_LM"),
        ({"peft_type": "PREFIX_TUNING", "prefix_projection": "yes"}, "prefix_projection must be true or false"),
        ('{"peft_type": "IA3",', "is not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ({"peft_type": "FOURIERFT"}, "peft_type FOURIERFT has no formula here"),
        ({"peft_type": "LORA", "rank_pattern": {"q_proj": 4}}, "rank_pattern is not modelled by `estimate`"),
    ],
    ids=["no-type", "unknown-type", "negative-r", "string-r", "bad-targets", "task", "bad-flag", "broken-json",
         "not-object", "no-formula", "rank-pattern"],
)  # fmt: skip
def test_bad_config_is_one_line_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: Any, message: str
) -> None:
    path = write(tmp_path, content)
    before = path.read_text()
    code, out, err = run(capsys, "estimate", "llama-3.2-1b", "--peft-config", str(path))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert message in err
    assert path.read_text() == before  # nothing the user owns is modified


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lora-rank", "8"], "drop --lora-rank"),
        (["--method", "full"], "use --method lora or qlora"),
    ],
    ids=["with-lora-flags", "full"],
)
def test_conflicting_flags_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    path = write(tmp_path, {"peft_type": "IA3"})
    code, _, err = run(capsys, "estimate", "llama-3.2-1b", "--peft-config", str(path), *argv)
    assert code == 2 and message in err


def test_missing_and_non_json_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "estimate", "llama-3.2-1b", "--peft-config", str(tmp_path))
    assert code == 2 and "without adapter_config.json" in err
    yaml_file = write(tmp_path, "peft_type: IA3\n", "adapter.yaml")
    code, _, err = run(capsys, "estimate", "llama-3.2-1b", "--peft-config", str(yaml_file))
    assert code == 2 and "not a .json file" in err


def test_qlora_base_keeps_its_quantisation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, {"peft_type": "IA3"})
    bf16 = estimate_json(capsys, "--peft-config", str(path))
    nf4 = estimate_json(capsys, "--peft-config", str(path), "--method", "qlora")
    assert nf4["settings"]["method"] == "qlora" and nf4["trainable_params"] == bf16["trainable_params"]
    assert nf4["peak_allocated_bytes"] < bf16["peak_allocated_bytes"]


@pytest.mark.parametrize(
    ("head", "key"),
    [
        ("model_name_or_path: meta-llama/Llama-3.2-1B\nfinetuning_type: lora\ncutoff_len: 512\n",
         "adapter_name_or_path"),
        ("base_model: meta-llama/Llama-3.2-1B\nadapter: lora\nlora_r: 8\nlora_target_linear: true\n"
         "sequence_len: 512\nmicro_batch_size: 1\n", "lora_model_dir"),
    ],
    ids=["llamafactory", "axolotl"],
)  # fmt: skip
def test_resumed_local_adapter_is_the_method(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], head: str, key: str
) -> None:
    # LLaMA-Factory model/adapter.py _setup_lora_tuning and axolotl loaders/adapter.py load_lora train on the
    # adapter they load with PeftModel.from_pretrained(..., is_trainable=True).
    folder = tmp_path / "ia3_adapter"
    folder.mkdir()
    write(folder, {"peft_type": "IA3", "task_type": "CAUSAL_LM", "inference_mode": True})
    config = tmp_path / "sft.yaml"
    config.write_text(f"{head}bf16: true\n{key}: {folder}\n")
    code, out, err = run(capsys, "estimate", "--config", str(config), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["trainable_params"] == 16 * (512 + 512 + 8192)  # IA3 on Llama-3.2-1B, as above
    assert doc["settings"]["method"] == "lora"


def test_llamafactory_hub_adapter_is_said_and_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "sft.yaml"
    config.write_text(
        "model_name_or_path: meta-llama/Llama-3.2-1B\nfinetuning_type: lora\ncutoff_len: 512\nbf16: true\n"
        "adapter_name_or_path: someone/llama-lora\nlora_rank: 8\n"
    )
    code, out, err = run(capsys, "estimate", "--config", str(config), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert "settings" in doc and "peft_config" not in doc["settings"]
    assert any("not a local adapter folder (nothing is downloaded)" in w for w in doc["warnings"])


def test_convert_refuses_a_method_the_frameworks_keys_cannot_say(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, {"peft_type": "IA3"})
    code, out, err = run(capsys, "convert", "llama-3.2-1b", "--peft-config", str(path), "--to", "llamafactory")
    assert code == 2 and out == ""
    assert "the PEFT method IA3 (--peft-config) cannot be written as a llamafactory config" in err
