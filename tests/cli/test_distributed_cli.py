"""The distributed flags as a user meets them: from flags alone, combined with a config, and bad input."""

import json
from pathlib import Path

import pytest

from vramledger.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("flags", "engine"),
    [
        (("--world-size", "8", "--zero", "3"), "zero-3"),
        (("--world-size", "8", "--fsdp", "full_shard"), "fsdp2 full_shard"),
        (
            ("--nproc-per-node", "4", "--nnodes", "2", "--fsdp", "shard_grad_op", "--fsdp-version", "1"),
            "fsdp1 shard_grad_op",
        ),
        (("--world-size", "8"), "ddp"),
    ],
    ids=["zero3", "fsdp", "torchrun-style", "ddp"],
)
def test_flags_alone(capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], engine: str) -> None:
    code, out, _ = run(capsys, "estimate", "llama-3.1-8b", "--method", "full", "--json", *flags)
    assert code == 0
    d = json.loads(out)["settings"]["distributed"]
    assert d["engine"] == engine and d["world_size"] == 8


def test_flags_win_over_the_deepspeed_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    code, out, _ = run(
        capsys, "estimate", "llama-3.1-8b", "--deepspeed", str(ds), "--zero", "3", "--world-size", "4", "--json"
    )
    assert code == 0
    assert json.loads(out)["settings"]["distributed"]["engine"] == "zero-3"
    assert json.loads(ds.read_text()) == {"zero_optimization": {"stage": 2}}  # the user's file is untouched


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--zero", "3", "--fsdp", "full_shard"), "--zero and --fsdp exclude each other"),
        (("--zero", "4"), "ZeRO stage must be 0, 1, 2 or 3"),
        (("--fsdp", "everything"), "--fsdp: unknown value 'everything'"),
        (("--world-size", "8", "--nproc-per-node", "4"), "--world-size 8 but --nproc-per-node × --nnodes = 4"),
        (("--offload", "gpu"), "--offload: unknown value 'gpu'"),
        (("--world-size", "0"), "--world-size must be a positive integer"),
    ],
    ids=["both", "stage", "strategy", "disagree", "offload", "zero-ranks"],
)
def test_bad_flags_are_one_line(capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], message: str) -> None:
    code, _, err = run(capsys, "estimate", "llama-3.1-8b", *flags)
    assert code == 2
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
