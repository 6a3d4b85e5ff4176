"""``vramledger convert``: writing a spec as a framework's config and reading it back gives the same spec."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from vramledger.adapters import load_config
from vramledger.adapters.writers import dump, write_config
from vramledger.cli import main
from vramledger.errors import VramledgerError
from vramledger.specs import Attention, LoraSpec, Loss, Method, Optimizer, Precision, QuantSpec, TrainSpec

F = Path(__file__).parent / "fixtures"

SPECS = {
    "lora": TrainSpec(
        method=Method.LORA,
        lora=LoraSpec(rank=32, alpha=64.0, targets=("q_proj", "v_proj"), dropout=0.05),
        micro_batch=4,
        seq_len=4096,
        grad_accum=2,
        grad_ckpt=True,
        attn=Attention.FLASH2,
        optimizer=Optimizer.PAGED_ADAMW_8BIT,
    ),
    "qlora": TrainSpec(
        method=Method.QLORA,
        quant=QuantSpec(bits=4),
        lora=LoraSpec(rank=8, alpha=16.0),
        packing=True,
        loss=Loss.FUSED,
        eval_batch=2,
        eval_accumulation_steps=4,
    ),
    "full-zero3": TrainSpec(
        method=Method.FULL,
        precision=Precision.BF16,
        grad_ckpt=True,
        zero_stage=3,
        offload_optimizer=True,
        world_size=4,
        micro_batch=2,
        grad_accum=4,
    ),
    "full-fp32": TrainSpec(method=Method.FULL, precision=Precision.FP32, attn=Attention.EAGER),
    # PEFT target_parameters: axolotl and TRL lora_target_parameters, with and without target modules
    "lora-parameters": TrainSpec(
        method=Method.LORA,
        lora=LoraSpec(rank=8, targets=("q_proj",), parameters=("mlp.experts.down_proj",)),
    ),
    "lora-parameters-alone": TrainSpec(
        method=Method.LORA,
        lora=LoraSpec(rank=8, targets=(), parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj")),
    ),
}
# what each target can express (see writers.py for why the others are refused)
CASES = [
    ("llamafactory", "lora"),
    ("llamafactory", "qlora"),
    ("llamafactory", "full-zero3"),
    ("llamafactory", "full-fp32"),
    ("trl", "lora"),
    ("trl", "qlora"),
    ("trl", "full-zero3"),
    ("trl", "full-fp32"),
    ("axolotl", "lora"),
    ("axolotl", "qlora"),
    ("axolotl", "full-zero3"),
    ("axolotl", "full-fp32"),
    ("trl", "lora-parameters"),
    ("trl", "lora-parameters-alone"),
    ("axolotl", "lora-parameters"),
    ("axolotl", "lora-parameters-alone"),
]


@pytest.mark.parametrize(("fmt", "name"), CASES, ids=[f"{f}-{n}" for f, n in CASES])
def test_round_trip(tmp_path: Path, fmt: str, name: str) -> None:
    spec = SPECS[name]
    config, _ = write_config("llama-3-8b", spec, fmt)
    path = tmp_path / f"{fmt}.yaml"
    path.write_text(dump(config, ["test"]))
    rc = load_config(path)
    assert rc.format == fmt and rc.model == "llama-3-8b"
    got = rc.train
    for f in dataclasses.fields(TrainSpec):
        if f.name in ("warnings", "loss_chunk_tokens"):
            continue
        assert getattr(got, f.name) == getattr(spec, f.name), f"{fmt} {name}: {f.name}"


def test_refuses_what_a_format_cannot_say() -> None:
    with pytest.raises(VramledgerError, match="chunked loss cannot be written as a llamafactory config"):
        write_config("llama-3-8b", TrainSpec(loss=Loss.CHUNKED), "llamafactory")
    with pytest.raises(VramledgerError, match="method freeze cannot be written as a axolotl config|method freeze"):
        write_config("llama-3-8b", TrainSpec(method=Method.FREEZE), "axolotl")
    with pytest.raises(VramledgerError, match="LoRA target parameters .* cannot be written as a llamafactory"):
        write_config("llama-3-8b", SPECS["lora-parameters"], "llamafactory")


def test_cli_convert_from_another_format(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ax.yaml"
    rc = main(
        [
            "convert",
            "--config",
            str(F / "lf_llama3_qlora_otfq.yaml"),
            "cutoff_len=4096",
            "--to",
            "axolotl",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    back = load_config(out)
    src = load_config(F / "lf_llama3_qlora_otfq.yaml", overrides=["cutoff_len=4096"])
    assert back.model == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert back.train == src.train


def test_cli_convert_from_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "convert",
                "llama-3-8b",
                "--method",
                "qlora",
                "--batch",
                "4",
                "--seq",
                "4096",
                "--grad-ckpt",
                "--to",
                "trl",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "load_in_4bit: true" in text and "max_length: 4096" in text and "model_name_or_path: llama-3-8b" in text
