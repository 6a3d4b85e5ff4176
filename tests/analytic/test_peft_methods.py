"""Trainable counts of PEFT methods from formulas, against PEFT's own count on the meta device.

Truth: ``PeftModel.get_nb_trainable_parameters()`` of PEFT 0.21 applied to the transformers model built from
the same tiny config (on the CPU: BOFT's permutation buffers and PiSSA's SVD need real tensors). Twelve methods
(and variants) are compared."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from vramledger.analytic.peft_methods import factorization, peft_trainable
from vramledger.catalog.hfconfig import model_spec_from_config
from vramledger.errors import VramledgerError

TINY_LLAMA = dict(
    model_type="llama",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    pad_token_id=0,
)
CAUSAL = {"task_type": "CAUSAL_LM"}

METHODS: dict[str, dict[str, Any]] = {
    "lora-all-linear": {"peft_type": "LORA", "r": 8, "target_modules": "all-linear"},
    "dora": {"peft_type": "LORA", "r": 4, "target_modules": ["q_proj", "v_proj", "down_proj"], "use_dora": True},
    "rslora-pissa": {
        "peft_type": "LORA",
        "r": 4,
        "use_rslora": True,
        "init_lora_weights": "pissa",
        "target_modules": ["q_proj", "k_proj"],
    },
    "adalora": {
        "peft_type": "ADALORA",
        "init_r": 6,
        "target_r": 2,
        "total_step": 100,
        "target_modules": ["q_proj", "v_proj"],
    },
    "loha": {"peft_type": "LOHA", "r": 4, "target_modules": ["q_proj", "v_proj", "o_proj"]},
    "lokr": {"peft_type": "LOKR", "r": 2, "target_modules": ["q_proj", "gate_proj", "down_proj"]},
    "lokr-both": {"peft_type": "LOKR", "r": 1, "decompose_both": True, "target_modules": ["up_proj", "o_proj"]},
    "vera": {"peft_type": "VERA", "r": 16, "target_modules": ["q_proj", "o_proj"]},
    "oft": {"peft_type": "OFT", "oft_block_size": 16, "r": 0, "target_modules": ["q_proj", "v_proj"]},
    "boft": {
        "peft_type": "BOFT",
        "boft_block_size": 4,
        "boft_n_butterfly_factor": 2,
        "target_modules": ["q_proj", "down_proj"],
    },
    "ia3-default": {"peft_type": "IA3"},
    "prompt-tuning": {"peft_type": "PROMPT_TUNING", "num_virtual_tokens": 10},
    "p-tuning": {"peft_type": "P_TUNING", "num_virtual_tokens": 10, "encoder_hidden_size": 32},
    "prefix-tuning": {"peft_type": "PREFIX_TUNING", "num_virtual_tokens": 10},
    "prefix-projection": {
        "peft_type": "PREFIX_TUNING",
        "num_virtual_tokens": 6,
        "prefix_projection": True,
        "encoder_hidden_size": 24,
    },
    "ln-tuning": {"peft_type": "LN_TUNING"},
}


@functools.cache
def _tiny_model() -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    fields = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **fields))


def _peft_own_count(cfg: dict[str, Any]) -> int:
    import copy
    import warnings

    from peft import get_peft_config, get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(copy.deepcopy(_tiny_model()), get_peft_config({**CAUSAL, **cfg}))
    trainable, _ = peft_model.get_nb_trainable_parameters()
    return int(trainable)


@pytest.mark.parametrize("name", sorted(METHODS), ids=sorted(METHODS))
def test_formula_equals_peft_own_count(name: str) -> None:
    pytest.importorskip("peft")
    cfg = METHODS[name]
    m = model_spec_from_config(TINY_LLAMA, name="tiny", source="test")
    expected = _peft_own_count(cfg)
    got = peft_trainable(m, METHODS[name], boft_fbd_cuda=False).trainable_params  # no CUDA extension here
    print(name, "PEFT", expected, "formula", got, "match", got == expected)
    assert got == expected


def test_boft_butterfly_factor_with_the_cuda_extension() -> None:
    # boft_R (factor, in/b, b, b) + boft_s (out): q_proj 2·16·4·4 + 64, down_proj 2·24·4·4 + 64, in 2 layers.
    m = model_spec_from_config(TINY_LLAMA, name="tiny", source="test")
    hand = 2 * ((2 * 16 * 16 + 64) + (2 * 24 * 16 + 64))
    assert peft_trainable(m, METHODS["boft"]).trainable_params == hand


def test_factorization_matches_peft_docstring() -> None:
    # tuners/lokr/layer.py factorization examples.
    assert factorization(256) == (16, 16)
    assert factorization(128) == (8, 16)
    assert factorization(127) == (1, 127)
    assert factorization(128, 4) == (4, 32)


def test_unknown_method_names_the_modelled_ones() -> None:
    m = model_spec_from_config(TINY_LLAMA, name="tiny", source="test")
    with pytest.raises(VramledgerError, match=r"peft_type FOURIERFT has no formula here; modelled: LORA"):
        peft_trainable(m, {"peft_type": "FOURIERFT"})


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [
        ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
        ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    ],
    ids=["mixtral", "qwen3_moe"],
)
def test_all_linear_on_formula_moe_follows_peft_conversion(model_type: str, extra: dict[str, Any]) -> None:
    # PEFT 0.21 + transformers 5: all-linear on these MoE families also adapts the router and the fused experts
    # (target_parameters, gate_up at rank 2r); the formula must count what PEFT trains.
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from vramledger.analytic import estimate
    from vramledger.specs import LoraSpec, Method, TrainSpec

    cfg = {**TINY_LLAMA, "model_type": model_type, **extra}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items() if k != "model_type"})
        )
    peft_own, _ = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear")).get_nb_trainable_parameters()
    spec = model_spec_from_config(cfg, name="tiny", source="test")
    train = TrainSpec(method=Method.LORA, lora=LoraSpec(rank=8), micro_batch=1, seq_len=32)
    assert estimate(spec, train).trainable_params == peft_own
