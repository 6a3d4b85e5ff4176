"""``--model-code``: LitGPT's own decoder layers from a flag, and a bad value."""

import json

import pytest

from vramledger.cli import main

FLAGS = ("estimate", "llama-3-8b", "--method", "lora", "--lora-targets", "q_proj,v_proj", "--lora-dropout", "0.05",
         "--precision", "bf16-true", "--batch", "1", "--seq", "512", "--no-grad-ckpt", "--json")  # fmt: skip


def _saved(capsys: pytest.CaptureFixture[str], *extra: str) -> int:
    assert main([*FLAGS, *extra]) == 0
    out = json.loads(capsys.readouterr().out)
    return sum(i["bytes"] for i in out["items"] if i["phase"] == "forward" and i["category"] == "activations")


def test_litgpt_layers_save_more_for_gqa(capsys: pytest.CaptureFixture[str]) -> None:
    # Llama-3-8B, LoRA on q and v: per token per layer 2·24·128·2 (K, V expanded) + (4096 + 1024)·2 (index_copy)
    # − 4096·3 (one shared dropout): 10240 bytes × 512 tokens × 32 layers (analytic/litgpt.py)
    assert _saved(capsys, "--model-code", "litgpt") - _saved(capsys) == 10240 * 512 * 32


def test_unknown_model_code_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*FLAGS, "--model-code", "megatron"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --model-code: unknown value 'megatron'")
