"""``--legacy-bitsandbytes``: QLoRA on bitsandbytes before 0.43.2, whose ``MatMul4Bit.forward`` keeps its input A
(``ctx.tensors = (A, B)``; 0.43.2 keeps ``(None, B)``), from a flag; refused without a 4-bit base."""

import json

import pytest

from vramledger.catalog import resolve_model
from vramledger.cli import main

FLAGS = ("llama-3.1-8b", "--method", "qlora", "--seq", "1024", "--no-grad-ckpt", "--json")


def _activations(capsys: pytest.CaptureFixture[str], *extra: str) -> int:
    assert main(["estimate", *FLAGS, *extra]) == 0
    items = json.loads(capsys.readouterr().out)["items"]
    return max(it["bytes"] for it in items if it["category"] == "activations" and it["phase"] == "forward")


def test_the_old_matmul_keeps_each_quantised_linears_input(capsys: pytest.CaptureFixture[str]) -> None:
    """By hand: under the preset (bf16-mixed, fp32 adapters, so no adapter holds the very tensor) and SDPA (o_proj
    reads the kernel's saved output), each layer keeps the attention input (H), the MLP input (H) and down's input
    (I), c = 2 bytes each per token, for at most every one of the 32 layers and at least all but one."""
    m = resolve_model("llama-3.1-8b")
    per_layer = 2 * (2 * m.hidden_size + m.intermediate_size) * 1024
    more = _activations(capsys, "--legacy-bitsandbytes") - _activations(capsys)
    print(f"kept inputs {more:,} B; per layer by hand {per_layer:,} B")
    assert (m.num_layers - 1) * per_layer <= more <= m.num_layers * per_layer


def test_refused_without_a_4bit_base(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "llama-3.1-8b", "--method", "full", "--legacy-bitsandbytes"]) == 2
    err = capsys.readouterr().err
    assert "--legacy-bitsandbytes" in err and "--method qlora" in err and "Traceback" not in err
