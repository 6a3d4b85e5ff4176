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
    """By hand: under the preset (bf16-mixed) PEFT's 4-bit LoRA layer gives ``lora_A`` the input itself (no cast
    under autocast: ``lora.bnb.Linear4bit.forward``), so with adapters on q and v only the attention input is kept by
    them already; the old MatMul4Bit keeps the MLP input (H) and down's input (I) more, c = 2 bytes each per token,
    for at most every one of the 32 layers and at least all but one (SDPA: o_proj reads the kernel's saved output)."""
    m = resolve_model("llama-3.1-8b")
    per_layer = 2 * (m.hidden_size + m.intermediate_size) * 1024
    qv = ("--lora-targets", "q_proj,v_proj")
    more = _activations(capsys, *qv, "--legacy-bitsandbytes") - _activations(capsys, *qv)
    print(f"kept inputs {more:,} B; per layer by hand {per_layer:,} B")
    assert (m.num_layers - 1) * per_layer <= more <= m.num_layers * per_layer


def test_the_old_matmul_keeps_nothing_more_where_every_linear_is_adapted(capsys: pytest.CaptureFixture[str]) -> None:
    """The preset's adapters on every linear already keep each input MatMul4Bit would keep (the same tensor under
    autocast, dropout 0): the traced step is the same with and without ``keeps_input`` (trace/shims.py
    ``bnb_linear4bit``)."""
    assert _activations(capsys, "--legacy-bitsandbytes") == _activations(capsys)


def test_refused_without_a_4bit_base(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "llama-3.1-8b", "--method", "full", "--legacy-bitsandbytes"]) == 2
    err = capsys.readouterr().err
    assert "--legacy-bitsandbytes" in err and "--method qlora" in err and "Traceback" not in err
