"""The estimate command as a user meets it: output, JSON keys, exit codes, one-line errors."""

import json
from pathlib import Path

import pytest

from vramledger.cli import main

JSON_KEYS = {
    "model",
    "params",
    "trainable_params",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "device_total_bytes",
    "peak_phase",
    "fits",
    "items",
}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_table_names_the_peak_and_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys,
        "estimate",
        "llama-3.1-8b",
        "--method",
        "qlora",
        "--batch",
        "1",
        "--seq",
        "1024",
        "--grad-ckpt",
        "--gpu",
        "rtx-4090",
    )
    assert code == 0
    assert "FITS on NVIDIA GeForce RTX 4090" in out
    assert "peak:" in out and "biggest line" in out
    assert max(len(line) for line in out.splitlines()) <= 100
    assert "\x1b[" not in out  # no colour codes


def test_json_has_the_documented_keys_and_adds_up(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys,
        "estimate",
        "meta-llama/Llama-3.1-8B",
        "--method",
        "lora",
        "--batch",
        "2",
        "--seq",
        "2048",
        "--gpu",
        "h100",
        "--json",
    )
    assert code == 0
    data = json.loads(out)
    assert data.keys() >= JSON_KEYS
    assert data["params"] > data["trainable_params"] > 0
    peak = data["peak_phase"]
    allocated = sum(
        i["bytes"]
        for i in data["items"]
        if i["phase"] == peak and i["category"] not in ("allocator_reserve", "cuda_context")
    )
    assert allocated == data["phases"][peak]["allocated_bytes"]
    assert {"category", "phase", "bytes", "source"} <= data["items"][0].keys()


def test_does_not_fit_exits_3(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "estimate", "llama-3.1-8b", "--method", "full", "--gpu", "rtx-4090")
    assert code == 3
    assert "DOES NOT FIT" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["estimate", "llama-9-8b"], "not in the catalog"),
        (["estimate", "llama-3.1-8b", "--batch", "-2"], "argument --batch: -2 is out of range; give a batch in [1,"),
        (["estimate", "llama-3.1-8b", "--method", "full", "--quant", "nf4"], "use --method qlora"),
        (["estimate", "llama-3.1-8b", "--precision", "bf17"], "--precision: unknown value"),
        (["estimate", "llama-3.1-8b", "--gpu", "rtx-9090"], "gpu: 'rtx-9090' is not in the catalog"),
        (["estimate", "llama-3.1-8b", "--lora-targets", "qkv"], "lora targets: qkv not found"),
        (["estimate"], "model: none given"),
        (["estimate", "llama-3.1-8b", "--bogus"], "unrecognized arguments"),
    ],
    ids=[
        "unknown-model",
        "negative-batch",
        "qlora-full",
        "bad-precision",
        "bad-gpu",
        "bad-target",
        "no-model",
        "bad-flag",
    ],
)
def test_bad_input_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert message in err
    assert "Traceback" not in err


def test_unknown_model_suggests_close_names(capsys: pytest.CaptureFixture[str]) -> None:
    _, _, err = run(capsys, "estimate", "llama-3.1-8")
    assert "did you mean" in err and "llama-3.1-8b" in err


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["estimate", "llama-3.1-8b", "--seq-len", "4096"], "--seq-len: did you mean --seq? (see `vramledger estimate"),
        (["fit", "llama-3.1-8b", "--batch-size=4"], "--batch-size: did you mean --batch? (see `vramledger fit"),
        (["plan", "llama-3.1-8b", "--grad-checkpointing"], "did you mean --grad-ckpt?"),
    ],
)
def test_a_mistyped_flag_names_the_commands_closest_one(
    capsys: pytest.CaptureFixture[str], argv: list[str], hint: str
) -> None:
    """Flags as other tools spell them (``--seq-len``, ``--batch-size``) get the command's own flag, one line."""
    code, _, err = run(capsys, *argv)
    assert code == 2 and err.count("\n") == 1
    assert hint in err


def test_a_flag_far_from_every_known_one_gets_no_guess(capsys: pytest.CaptureFixture[str]) -> None:
    _, _, err = run(capsys, "estimate", "llama-3.1-8b", "--lr", "1e-4")
    assert "unrecognized arguments: --lr 1e-4 (see `vramledger estimate --help`)" in err
    assert "did you mean" not in err


def test_malformed_config_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama", "hidden_size": ')
    before = bad.read_text()
    code, _, err = run(capsys, "estimate", str(bad))
    assert code == 2 and "not valid JSON" in err
    assert bad.read_text() == before  # nothing the user had is modified


def test_config_json_with_wrong_type(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": "4096",
                "num_attention_heads": 32,
                "num_hidden_layers": 2,
                "vocab_size": 100,
                "intermediate_size": 64,
            }
        )
    )
    code, _, err = run(capsys, "estimate", str(cfg))
    assert code == 2 and "'hidden_size' must be an integer" in err


def test_models_and_gpus_list(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "models", "--json")
    assert code == 0 and len(json.loads(out)) >= 25
    code, out, _ = run(capsys, "gpus", "--json")
    assert code == 0 and len(json.loads(out)) >= 20


def test_instant_path_imports_no_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys; from vramledger.cli import main; main(['estimate','gpt2','--json']); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'"
    )
    src = str(Path(__file__).resolve().parents[2] / "src")
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin"}
    )
    assert res.returncode == 0, res.stderr


def test_settings_list_what_the_flags_changed_and_only_what_applies(capsys: pytest.CaptureFixture[str]) -> None:
    """``--zero 3`` clears FSDP only where the setup had it; full fine-tuning has no LoRA settings to list."""
    code, out, _ = run(capsys, "estimate", "llama-3.1-8b", "--method", "full", "--world-size", "8", "--zero", "3")
    block = out.split("settings:\n", 1)[1].split("\n\n", 1)[0]
    settings = [line.split()[0] for line in block.splitlines() if line.startswith("  ") and line[2] != " "]
    assert code == 0
    assert "zero_stage" in settings and "world_size" in settings
    assert "fsdp" not in settings and "lora" not in settings
