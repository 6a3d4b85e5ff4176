"""LoRA on lm_head and PEFT ``modules_to_save``, counted against PEFT itself on tiny models built here.

The independent truth is PEFT 0.21: ``get_peft_model`` on a randomly initialised tiny Llama (or a tied-embedding
one), then ``sum(p.numel() for p in model.parameters() if p.requires_grad)``: the adapters plus the trained copies
``ModulesToSaveWrapper`` makes (utils/other.py). The memory consequences are checked by hand derivation.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from vramledger.analytic import estimate
from vramledger.analytic.weights import weight_budget
from vramledger.catalog.hfconfig import model_spec_from_config
from vramledger.errors import VramledgerError
from vramledger.ledger import Category, Phase
from vramledger.specs import LoraSpec, Method, Precision, TrainSpec

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 300,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
CASES = {
    "qv+head": (
        dict(TINY),
        dict(target_modules=["q_proj", "v_proj", "lm_head"]),
        LoraSpec(rank=4, targets=("q_proj", "v_proj", "lm_head")),
    ),
    "all-linear+saved": (
        dict(TINY),
        dict(target_modules="all-linear", modules_to_save=["embed_tokens", "lm_head"]),
        LoraSpec(rank=4, modules_to_save=("embed_tokens", "lm_head")),
    ),
    "qv+saved head, tied": (
        {**TINY, "tie_word_embeddings": True},
        dict(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]),
        LoraSpec(rank=4, targets=("q_proj", "v_proj"), modules_to_save=("lm_head",)),
    ),
}


def _peft_trainable(cfg: dict, lora_kwargs: dict) -> int:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"}))
    model = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, **lora_kwargs))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_trainable_count_matches_peft(case: str) -> None:
    cfg, lora_kwargs, lora = CASES[case]
    expected = _peft_trainable(cfg, lora_kwargs)
    m = model_spec_from_config(cfg, name="tiny", source="test")
    got = weight_budget(m, TrainSpec(method=Method.LORA, lora=lora)).trainable_params
    print(f"{case}: PEFT {expected:,}, vramledger {got:,}, match {expected == got}")
    assert got == expected


def test_saved_modules_bring_weights_grads_and_adam_states() -> None:
    # Hand derivation: bf16-true, adapters in bf16 (LitGPT-style), AdamW. Saving lm_head adds V·H trainable
    # parameters: a bf16 copy (2·V·H), its gradient (2·V·H) and two bf16 Adam states (4·V·H) over the plain run.
    m = model_spec_from_config(TINY, name="tiny", source="test")
    base = TrainSpec(
        method=Method.LORA,
        precision=Precision.BF16,
        micro_batch=1,
        seq_len=32,
        lora=LoraSpec(rank=4, targets=("q_proj", "v_proj"), adapter_fp32=False),
    )
    saved = replace(base, lora=replace(base.lora, modules_to_save=("lm_head",)))  # type: ignore[arg-type]
    a, b = estimate(m, base), estimate(m, saved)
    VH = TINY["vocab_size"] * TINY["hidden_size"]
    ph = Phase.OPTIMIZER
    assert b.bytes_of(Category.WEIGHTS, ph) - a.bytes_of(Category.WEIGHTS, ph) == 2 * VH
    assert b.bytes_of(Category.GRADIENTS, ph) - a.bytes_of(Category.GRADIENTS, ph) == 2 * VH
    assert b.bytes_of(Category.OPTIMIZER_STATE, ph) - a.bytes_of(Category.OPTIMIZER_STATE, ph) == 4 * VH


def test_unknown_saved_module_is_a_clear_error() -> None:
    m = model_spec_from_config(TINY, name="tiny", source="test")
    t = TrainSpec(method=Method.LORA, lora=LoraSpec(rank=4, modules_to_save=("score",)))
    with pytest.raises(VramledgerError, match="modules_to_save: score not modelled"):
        weight_budget(m, t)
