"""``--model-code``: LitGPT's own decoder layers from a flag (adapters in the model dtype), and a bad value."""

import argparse
import json

import pytest

from vramledger.cli import main
from vramledger.cli.common import (
    add_gpu_options,
    add_model_options,
    add_output_options,
    add_train_options,
    resolve_inputs,
)
from vramledger.specs import ModelCode

FLAGS = ("llama-3-8b", "--method", "lora", "--lora-targets", "q_proj,v_proj", "--lora-dropout", "0.05",
         "--precision", "bf16-true", "--batch", "1", "--seq", "512", "--no-grad-ckpt")  # fmt: skip


def _train(*argv: str):  # type: ignore[no-untyped-def]
    p = argparse.ArgumentParser()
    for add in (add_model_options, add_train_options, add_gpu_options, add_output_options):
        add(p)
    return resolve_inputs(p.parse_args(list(argv))).train


def test_litgpt_flag_sets_the_code_and_keeps_adapters_in_the_model_dtype() -> None:
    lit = _train(*FLAGS, "--model-code", "litgpt")
    assert lit.model_code is ModelCode.LITGPT
    assert lit.lora is not None and not lit.lora.adapter_fp32  # LitGPT has no PEFT fp32 upcast
    hf = _train(*FLAGS)
    assert hf.model_code is ModelCode.TRANSFORMERS and hf.lora is not None and hf.lora.adapter_fp32


def test_litgpt_run_shows_its_code(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", *FLAGS, "--model-code", "lit-gpt-2023", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["model_code"] == "lit-gpt-2023"


def test_unknown_model_code_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", *FLAGS, "--model-code", "megatron"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --model-code: unknown value 'megatron'")
