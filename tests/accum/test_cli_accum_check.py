"""`vramledger accum-check`: exit codes and output, through the real CLI entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramledger.cli import main

FIXTURES = Path(__file__).parent / "fixtures"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["accum-check", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_script_with_a_mistake_exits_3_and_names_the_line(capsys) -> None:
    path = FIXTURES / "bad_scheduler_per_micro_batch.py"
    code, out, _ = run(capsys, "--script", str(path))
    print(out)
    assert code == 3  # findings: "the answer is no" (docs/cli.md exit codes), not 1 (unexpected)
    assert f"{path}:18: ACC001 scheduler-per-micro-batch:" in out
    assert "fix: move it under `if (step + 1) % accum_steps == 0:` (line 14)" in out
    assert out.rstrip().endswith("1 finding.")


def test_clean_script_exits_0(capsys) -> None:
    code, out, _ = run(capsys, "--script", str(FIXTURES / "good_accelerate.py"))
    assert code == 0
    assert "line 16: accelerate" in out
    assert out.rstrip().endswith("no findings.")


def test_script_json(capsys) -> None:
    code, out, _ = run(capsys, "--script", str(FIXTURES / "bad_zero_grad_per_micro_batch.py"), "--json")
    assert code == 3
    data = json.loads(out)
    assert [(f["line"], f["rule"], f["name"]) for f in data["findings"]] == [
        (10, "ACC003", "zero-grad-per-micro-batch")
    ]


def test_unparsable_script_exits_2_with_one_line(capsys, tmp_path: Path) -> None:
    bad = tmp_path / "train.py"
    bad.write_text("for x in y\n")
    code, out, err = run(capsys, "--script", str(bad))
    assert code == 2
    assert out == ""
    assert err.startswith("error: --script ") and err.count("\n") == 1


def test_experiment_table(capsys) -> None:
    pytest.importorskip("transformers")
    code, out, _ = run(capsys, "--micro-batches", "3", "--seed", "1", "--dtype", "fp64")
    print(out)
    assert code == 0
    assert "(a) differs from g_ref" in out
    assert "(b) matches g_ref" in out
    assert "batch-dependent layers: none in LlamaForCausalLM" in out


def test_experiment_json(capsys) -> None:
    pytest.importorskip("transformers")
    code, out, _ = run(capsys, "--json", "--micro-batches", "2")
    assert code == 0
    data = json.loads(out)
    assert len(data["target_tokens"]) == 2
    assert data["total_target_tokens"] == sum(data["target_tokens"])
    assert {c["key"]: c["within_rounding"] for c in data["comparisons"]} == {
        "mean_of_means": False,
        "global_token_mean": True,
    }


def test_bad_micro_batches(capsys) -> None:
    code, _, err = run(capsys, "--micro-batches", "0")
    assert code == 2
    assert "argument --micro-batches: 0 is out of range" in err
