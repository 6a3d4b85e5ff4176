"""Every crash, hang and silent acceptance the safety trial found, as it reproduced: now one `error:` line, exit 2,
quickly, with the flag or file named. Each case failed before the fix (a traceback, minutes of work, or an answer
to a question the user did not ask)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from vramledger.catalog import model_entries
from vramledger.cli import main

QWEN05 = model_entries()["qwen2.5-0.5b"].config
LF = "model_name_or_path: qwen2.5-0.5b\nstage: sft\nfinetuning_type: lora\ncutoff_len: 512\n"


def run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def bad(capsys: pytest.CaptureFixture[str], *argv: object, says: str) -> None:
    code, out, err = run(capsys, *argv)
    print(err)
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert says in err, err


# -- tracebacks --------------------------------------------------------------------------------------------------
def test_a_256_character_model_name(capsys) -> None:
    bad(capsys, "estimate", "a" * 256, says="is not in the catalog")


def test_a_256_character_model_override(capsys, tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(LF)
    bad(capsys, "estimate", "--config", cfg, "model_name_or_path=" + "b" * 256, says="is not in the catalog")


def test_a_config_json_nested_100k_deep(capsys, tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    bad(capsys, "estimate", path, says="nested too deeply")


@pytest.mark.parametrize("command", ["estimate", "trace"])
def test_zero_attention_heads(capsys, tmp_path: Path, command: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**QWEN05, "num_attention_heads": 0}))
    bad(capsys, command, path, says="num_attention_heads (0) must be positive")


@pytest.mark.parametrize("value", [0, -5])
def test_non_positive_context(capsys, tmp_path: Path, value: int) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**QWEN05, "max_position_embeddings": value}))
    bad(capsys, "estimate", path, says="max_position_embeddings must be a positive integer")


def test_accum_check_script_with_a_200000_term_expression(capsys, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("x = " + "+".join(["a"] * 200_000) + "\n")
    bad(capsys, "accum-check", "--script", script, says="nested too deeply to check")


def test_accum_check_seed_beyond_64_bits(capsys) -> None:
    bad(capsys, "accum-check", "--seed", "1180591620717411303424", says="argument --seed")


@pytest.mark.parametrize("value", ["0", "-1"])
def test_plan_granularity(capsys, value: str) -> None:
    bad(capsys, "plan", "llama-3.2-1b", "--gpu", "24GiB", "--granularity", value, says="argument --granularity")


def test_a_yaml_alias_bomb(capsys, tmp_path: Path) -> None:
    lines = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"{chr(97 + i)}: &{chr(97 + i)} [" + ", ".join([f"*{chr(96 + i)}"] * 10) + "]" for i in range(1, 10)]
    lines += ["model_name_or_path: *j", "stage: sft"]
    cfg = tmp_path / "bomb.yaml"
    cfg.write_text("\n".join(lines) + "\n")
    bad(capsys, "estimate", "--config", cfg, says="expands to more than")


# -- hangs -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["estimate", "llama-3.1-8b", "--eval-batch", "100000"], "--eval-batch"),
        (["accum-check", "--micro-batches", "100000"], "--micro-batches"),
        (["plan", "llama-3.1-8b", "--gpu", "h100-sxm", "--global-batch", "1000000000"], "--global-batch"),
        (["accum", "llama-3.1-8b", "--gpu", "h100-sxm", "--global-batch", "1000000000"], "--global-batch"),
        (["plan", "llama-3.1-8b", "--gpu", "h100-sxm", "--global-batch", "1e9"], "--global-batch"),
    ],
    ids=["eval-batch", "micro-batches", "plan-global-batch", "accum-global-batch", "global-batch-1e9"],
)
def test_a_huge_number_is_refused_not_searched(capsys, argv: list[str], flag: str) -> None:
    bad(capsys, *argv, says=f"argument {flag}")


@pytest.mark.parametrize("option", ["--config", "--script"])
def test_dev_zero_is_not_read(capsys, option: str) -> None:
    argv = ["estimate", "--config", "/dev/zero"] if option == "--config" else ["accum-check", "--script", "/dev/zero"]
    bad(capsys, *argv, says="is not a regular file")


def test_a_fifo_config_does_not_block(capsys, tmp_path: Path) -> None:
    fifo = tmp_path / "c.yaml"
    os.mkfifo(fifo)  # opening it for reading would block until a writer came
    bad(capsys, "estimate", "--config", fifo, says="is not a regular file")


def test_a_huge_config_is_refused_before_parsing(capsys, tmp_path: Path) -> None:
    cfg = tmp_path / "big.yaml"
    cfg.write_text(LF + "".join(f"k{i}: {i}\n" for i in range(200_000)))  # 2.5 MB: minutes of parsing before
    bad(capsys, "estimate", "--config", cfg, says="more than the 1.0 MiB")


def test_many_unknown_keys_are_summarised_not_deduplicated_quadratically(capsys, tmp_path: Path) -> None:
    cfg = tmp_path / "many.yaml"
    cfg.write_text(LF + "".join(f"k{i}: {i}\n" for i in range(40_000)))  # under the size limit
    code, out, _ = run(capsys, "estimate", "--config", cfg)
    assert code == 0
    assert out.count("ignored: k") == 20
    assert "ignored: 39980 more keys vramledger does not know" in out


# -- accepted silently -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["estimate", "llama-3.2-1b", "--mode", "infer", "--prompt", "0"], "argument --prompt"),
        (["estimate", "llama-3.2-1b", "--gpu", ""], "argument --gpu: the value is empty"),
        (["estimate", "llama-3.2-1b", "--quant", ""], "argument --quant: the value is empty"),
        (["estimate", "llama-3.2-1b", "--optimizer", "sgd", "--sgd-momentum", "-1"], "argument --sgd-momentum"),
        (["estimate", "llama-3.2-1b", "--optimizer", "sgd", "--sgd-momentum", "nan"], "argument --sgd-momentum"),
        (["estimate", "llama-3.2-1b", "--optimizer", "sgd", "--sgd-momentum", "inf"], "argument --sgd-momentum"),
        (["convert", "llama-3.2-1b", "--to", "trl", "--lora-alpha", "nan"], "argument --lora-alpha"),
        (["estimate", "llama-3.2-1b", "--method", "freeze", "--freeze-layers", "0"], "argument --freeze-layers"),
        (["estimate", "llama-3.2-1b", "--eval-batch", "2", "--eval-steps", "0"], "argument --eval-steps"),
        (["fit", "llama-3.2-1b", "--gpu", "24GiB", "--max-len", "0"], "argument --max-len"),
        (["plan", "llama-3.2-1b", "--gpu", "24GiB", "--top", "0"], "argument --top"),
        (["accum", "llama-3.2-1b", "--gpu", "24GiB", "--global-batch", "0"], "argument --global-batch"),
        (["estimate", "llama-3.2-1b", "--headroom", "nan"], "argument --headroom"),
        (["convert", "llama-3.2-1b", "--to", "banana"], "--to: unknown format 'banana'"),
    ],
    ids=[
        "prompt-0",
        "gpu-empty",
        "quant-empty",
        "momentum-neg",
        "momentum-nan",
        "momentum-inf",
        "alpha-nan",
        "freeze-0",
        "eval-steps-0",
        "max-len-0",
        "top-0",
        "global-batch-0",
        "headroom-nan",
        "to-banana",
    ],
)
def test_nonsense_is_refused(capsys, argv: list[str], says: str) -> None:
    bad(capsys, *argv, says=says)


def test_nan_in_a_config_override_is_refused(capsys, tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(LF)
    bad(capsys, "convert", "--config", cfg, "--to", "trl", "lora_alpha=nan", says="lora alpha must be a finite")


def test_an_override_with_no_key(capsys, tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(LF)
    bad(capsys, "estimate", "--config", cfg, "...=1", says="not a config key")


def test_an_override_without_equals_is_named_as_such(capsys, tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(LF)
    bad(capsys, "estimate", "--config", cfg, "lora_rank", says="write KEY=VALUE (e.g. lora_rank=8)")


def test_a_binary_config_json_is_not_called_invalid_json(capsys, tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(b"\xff\xfe\x00\x01" * 16)
    bad(capsys, "estimate", path, says="is not UTF-8 text")


# -- exit codes: one table for every command (docs/cli.md) --------------------------------------------------------
def test_fit_exits_3_when_nothing_fits(capsys) -> None:
    code, out, _ = run(capsys, "fit", "llama-3.1-8b", "--gpu", "1GiB")
    assert code == 3
    assert "nothing fits" in out


def test_plan_exits_3_when_nothing_fits(capsys) -> None:
    code, _, _ = run(capsys, "plan", "llama-3.1-70b", "--gpu", "1GiB")
    assert code == 3


def test_an_unexpected_failure_is_one_line_and_exit_1(capsys, monkeypatch) -> None:
    import vramledger.analytic as analytic

    def boom(*_a: object, **_k: object) -> None:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(analytic, "estimate", boom)
    code, _, err = run(capsys, "estimate", "llama-3.2-1b")
    assert code == 1
    assert err.startswith("error: unexpected ZeroDivisionError") and err.count("\n") == 1


# -- found by tests/cli/test_fuzz.py ----------------------------------------------------------------------------
def test_control_characters_in_a_value_stay_on_one_line(capsys) -> None:
    bad(capsys, "estimate", "llama-3.2-1b", "--lora-targets", "0\x1e0\nq", says=r"lora targets: 0\x1e0\nq")


def test_a_tilde_user_that_does_not_exist(capsys) -> None:
    bad(capsys, "estimate", "~0", says="is not in the catalog")  # Path.expanduser raised RuntimeError


# -- lengths written the way contexts are named ------------------------------------------------------------------
def test_a_length_in_k_is_binary_thousands(capsys) -> None:
    """`--seq 32k` is Qwen2.5's "32K context", max_position_embeddings 32768 in its config (catalog file)."""
    assert QWEN05["max_position_embeddings"] == 32768
    _, by_k, _ = run(capsys, "estimate", "qwen2.5-0.5b", "--seq", "32k", "--json")
    _, by_number, _ = run(capsys, "estimate", "qwen2.5-0.5b", "--seq", "32768", "--json")
    assert json.loads(by_k) == json.loads(by_number)
    _, half, _ = run(capsys, "estimate", "qwen2.5-0.5b", "--seq", "1.5K", "--json")
    _, plain, _ = run(capsys, "estimate", "qwen2.5-0.5b", "--seq", "1536", "--json")
    assert json.loads(half) == json.loads(plain)


@pytest.mark.parametrize("value", ["1.3k", "4kk", "k", "-2k", "nank", "infk"])
def test_a_length_in_k_that_is_not_a_whole_count(capsys, value: str) -> None:
    bad(capsys, "estimate", "qwen2.5-0.5b", "--seq", value, says="--seq")
