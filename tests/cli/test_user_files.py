"""Nothing the user owns is harmed: outputs never replace an input (through symlinks too), an existing output needs
--force, writes go through a temporary file renamed into place, and a written config names the user's model.

Each case reproduces a finding of the safety trial as it was reported; each failed before the fix.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from vramledger.cli import main

# A LLaMA-Factory config as users write them: comments, dataset settings, an instruct model that the catalog
# resolves to its base entry's shapes (Qwen/Qwen2.5-7B-Instruct -> qwen2.5-7b).
USER_CONFIG = """\
### model
model_name_or_path: Qwen/Qwen2.5-7B-Instruct  # the chat model, not the base

### method
stage: sft
do_train: true
finetuning_type: lora
lora_target: all
lora_rank: 8

### dataset
dataset: identity,alpaca_en_demo
template: qwen
cutoff_len: 2048

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1.0e-4
bf16: true
"""


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def user_config(tmp_path: Path) -> Path:
    path = tmp_path / "u.yaml"
    path.write_text(USER_CONFIG)
    return path


def one_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for n in needles:
        assert n in err, err


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--gpu", "24GiB", "--write-config", "{cfg}"],
        ["convert", "--to", "llamafactory", "--out", "{cfg}"],
        ["estimate", "--html", "{cfg}"],
    ],
    ids=["plan-write-config", "convert-out", "estimate-html"],
)
@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
def test_an_input_is_never_an_output(capsys, user_config: Path, argv: list[str], force: bool) -> None:
    argv = [a.replace("{cfg}", str(user_config)) for a in argv] + ["--config", str(user_config)]
    code, _, err = run(capsys, *argv, *(["--force"] if force else []))
    one_error(code, err, "never writes over its inputs")
    assert user_config.read_text() == USER_CONFIG


def test_an_input_reached_through_a_symlink_is_never_an_output(capsys, user_config: Path, tmp_path: Path) -> None:
    link = tmp_path / "link.yaml"
    link.symlink_to(user_config)
    # output through the link, input by its name; and the other way round
    for cfg, out in ((user_config, link), (link, user_config)):
        code, _, err = run(capsys, "plan", "--config", cfg, "--gpu", "24GiB", "--write-config", out, "--force")
        one_error(code, err, "never writes over its inputs")
    assert user_config.read_text() == USER_CONFIG and link.is_symlink()


def test_an_existing_output_needs_force(capsys, user_config: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.yaml"
    out.write_text("mine\n")
    code, _, err = run(capsys, "convert", "--config", user_config, "--to", "trl", "--out", out)
    one_error(code, err, "exists; pass --force")
    assert out.read_text() == "mine\n"
    code, _, err = run(capsys, "convert", "--config", user_config, "--to", "trl", "--out", out, "--force")
    assert code == 0, err
    assert yaml.safe_load(out.read_text())["model_name_or_path"] == "Qwen/Qwen2.5-7B-Instruct"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []  # the temporary file is gone


def test_png_refuses_existing_figures_and_folders_in_their_place(capsys, tmp_path: Path) -> None:
    figs = tmp_path / "figs"
    figs.mkdir()
    (figs / "bill.png").write_bytes(b"my picture")
    code, _, err = run(capsys, "estimate", "llama-3.2-1b", "--png", figs)
    one_error(code, err, "bill.png exists; pass --force")
    (figs / "bill.png").unlink()
    (figs / "bill.png").mkdir()  # a folder where a figure would go: a traceback before the fix
    code, _, err = run(capsys, "estimate", "llama-3.2-1b", "--png", figs, "--force")
    one_error(code, err, "is a folder")


def test_png_into_a_read_only_folder_is_one_error(capsys, tmp_path: Path) -> None:
    from vramledger.errors import VramledgerError
    from vramledger.userfiles import write_atomic

    if os.geteuid() == 0:  # root writes anywhere: simulate the refusal the kernel gives a user
        folder = tmp_path / "no-such-folder" / "deeper"
    else:
        folder = tmp_path / "ro"
        folder.mkdir()
        folder.chmod(0o500)
    with pytest.raises(VramledgerError, match=r"--png: cannot write .*bill.png"):
        write_atomic(folder / "bill.png", b"x", "--png")


@pytest.mark.parametrize("flag", ["--png", "--html"])
def test_an_empty_output_path_is_refused(capsys, flag: str) -> None:
    code, _, err = run(capsys, "estimate", "llama-3.2-1b", flag, "")
    one_error(code, err, f"argument {flag}: the path is empty")


def test_an_interrupted_write_leaves_the_old_file(monkeypatch, tmp_path: Path) -> None:
    from vramledger.errors import VramledgerError
    from vramledger.userfiles import write_atomic

    target = tmp_path / "report.html"
    target.write_text("old")

    def fail(*_a: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(VramledgerError, match="No space left on device"):
        write_atomic(target, "new " * 1000, "--html")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]


def test_write_config_keeps_the_model_the_user_named_and_their_file(capsys, user_config: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    code, stdout, err = run(capsys, "plan", "--config", user_config, "--gpu", "24GiB", "--write-config", out)
    assert code == 0, err
    text = out.read_text()
    written = yaml.safe_load(text)
    assert written["model_name_or_path"] == "Qwen/Qwen2.5-7B-Instruct"  # was Qwen/Qwen2.5-7B before the fix
    # the user's own file, patched: comments and dataset settings kept, each change listed on stdout
    assert "# the chat model, not the base" in text and "### dataset" in text
    assert written["dataset"] == "identity,alpaca_en_demo" and written["template"] == "qwen"
    assert written["learning_rate"] == 1.0e-4
    assert "with the plan's changes" in stdout
    changed = [k for k in written if yaml.safe_load(USER_CONFIG).get(k) != written[k]]
    for key in changed:
        assert f"  {key}: " in stdout
    # and it reads back as the plan vramledger printed: plan it again, nothing is left to change
    code, stdout2, _ = run(capsys, "estimate", "--config", out, "--gpu", "24GiB")
    assert code == 0


def test_write_config_of_a_catalog_short_name_names_the_hub_id(capsys, tmp_path: Path) -> None:
    # `llama-3-8b` is our catalog's name, not a hub id: LLaMA-Factory's from_pretrained cannot load it, so the written
    # config names the repository the catalog entry stands for (catalog/models: meta-llama/Meta-Llama-3-8B)
    out = tmp_path / "plan.yaml"
    argv = ["plan", "llama-3-8b", "--method", "lora", "--seq", "512", "--gpu", "24GiB", "--write-config", out]
    code, _, err = run(capsys, *argv)
    assert code == 0, err
    assert yaml.safe_load(out.read_text())["model_name_or_path"] == "meta-llama/Meta-Llama-3-8B"


def test_write_config_when_nothing_fits_exits_3(capsys, user_config: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    code, _, err = run(capsys, "plan", "--config", user_config, "--gpu", "1GiB", "--write-config", out)
    assert code == 3, err  # "does not fit" (it was 1, the code of an unexpected failure)
    assert "no plan fits" in err and not out.exists()


def test_write_format_must_be_a_writer(capsys, user_config: Path, tmp_path: Path) -> None:
    code, _, err = run(
        capsys,
        "plan",
        "--config",
        user_config,
        "--gpu",
        "24GiB",
        "--write-format",
        "banana",
        "--write-config",
        tmp_path / "o.yaml",
    )
    one_error(code, err, "--write-format: unknown format 'banana'")
    assert not (tmp_path / "o.yaml").exists()


def test_plan_speaks_the_users_framework(capsys, user_config: Path) -> None:
    code, out, _ = run(capsys, "plan", "--config", user_config, "--gpu", "24GiB")
    assert code == 0
    line = " ".join(out.split("plan 1 in your llamafactory config: ", 1)[1].split("\n\n")[0].split())
    # the keys LLaMA-Factory reads (adapters/llamafactory.py), not vramledger's flags
    assert "per_device_train_batch_size:" in line and "--batch" not in line
