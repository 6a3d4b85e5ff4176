"""torchtune's loop features read from a real recipe config, and their memory effects by hand derivation:
optimizer-in-backward (torchtune register_optim_in_bwd_hooks), activation offloading (OffloadActivations),
torch.compile (accepted, stated), LoRA on the output projection, and the QLoRA load path (torchao to_nf4 on the
GPU against bitsandbytes' per-weight quantisation)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from vramledger.adapters import load_config
from vramledger.analytic import estimate, step_parts
from vramledger.catalog import resolve_model
from vramledger.errors import VramledgerError
from vramledger.ledger import Category, Phase
from vramledger.specs import LoadPath, LoraSpec, Method, Precision, TrainSpec

F = Path(__file__).resolve().parents[1] / "adapters" / "fixtures"
ON = ["model.apply_lora_to_output=True", "compile=True", "enable_activation_offloading=True", "optimizer_in_bwd=True",
      "gradient_accumulation_steps=1", "tokenizer.max_seq_len=1024"]  # fmt: skip


def test_torchtune_recipe_switches_are_read() -> None:
    rc = load_config(F / "torchtune_llama3_8B_qlora_single_device.yaml", overrides=ON)
    t = rc.train
    assert t.lora is not None and "lm_head" in t.lora.targets
    assert (t.compile, t.offload_activations, t.optimizer_in_backward) == (True, True, True)
    assert t.load_path is LoadPath.TORCHTUNE
    assert not any("ignored: compile" in w or "ignored: optimizer_in_bwd" in w for w in rc.warnings)
    led = estimate(resolve_model("llama-3-8b"), t)
    assert any("torch.compile: estimated as eager" in w for w in led.warnings)


def test_optimizer_in_backward_keeps_one_gradient() -> None:
    # LoRA r8 on q,v and lm_head, bf16: the largest trainable tensor is lm_head's lora_B, V×r = 128256·8.
    m = resolve_model("llama-3-8b")
    t = TrainSpec(
        method=Method.LORA,
        precision=Precision.BF16,
        micro_batch=1,
        seq_len=512,
        lora=LoraSpec(rank=8, targets=("q_proj", "v_proj", "lm_head"), adapter_fp32=False),
    )
    led = estimate(m, replace(t, optimizer_in_backward=True))
    assert led.bytes_of(Category.GRADIENTS, Phase.OPTIMIZER) == 2 * 128256 * 8
    assert estimate(m, t).bytes_of(Category.GRADIENTS, Phase.OPTIMIZER) > 2 * 128256 * 8
    with pytest.raises(VramledgerError, match="cannot accumulate gradients"):
        replace(t, optimizer_in_backward=True, grad_accum=4)


def test_offloading_keeps_two_layers_of_saved_tensors() -> None:
    m = resolve_model("llama-3.2-1b")  # 16 layers
    t = TrainSpec(method=Method.FULL, precision=Precision.BF16, micro_batch=2, seq_len=1024, packing=True)
    off = replace(t, offload_activations=True)
    layer = step_parts(m, t).layer_bytes
    gap = step_parts(m, t).saved_layers_bytes - step_parts(m, off).saved_layers_bytes
    assert gap == (16 - 2) * layer


def test_load_paths_quantising_on_the_gpu() -> None:
    # Largest quantised weight of Llama-3-8B: the MLP's 14336 × 4096 = 58,720,256 elements, c = 2.
    m = resolve_model("llama-3-8b")
    t = TrainSpec(method=Method.QLORA, precision=Precision.BF16, micro_batch=1, seq_len=512)
    n = 14336 * 4096
    hf = estimate(m, t).bytes_of(Category.TEMPORARIES, Phase.LOAD)
    tt = estimate(m, replace(t, load_path=LoadPath.TORCHTUNE)).bytes_of(Category.TEMPORARIES, Phase.LOAD)
    assert hf == 2 * n  # bitsandbytes Params4bit._quantize: the bf16 weight on the GPU
    assert tt == 5 * n + (17 * 2 + 8) * 2**20  # torchao: weight + scaled blocks + uint8 codes + one chunk
    assert estimate(m, replace(t, method=Method.LORA, quant=None)).bytes_of(Category.TEMPORARIES, Phase.LOAD) == 0
