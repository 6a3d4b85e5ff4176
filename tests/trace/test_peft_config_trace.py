"""``trace --peft-config``: the real PEFT adapter code of a dozen methods runs on fake tensors.

Truth: PEFT 0.21's own ``get_nb_trainable_parameters()`` of the same method on the same tiny Llama, built on the
CPU with real tensors (independent of our meta-device build and of the formulas). The trace's trainable count
and the estimate's must both equal it. For IA3 and prefix tuning, whose saved tensors ``estimate`` models, the
estimate's activations must be within 1% of the traced ones (the trace is the truth there)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

# The tiny Llama and PEFT's own count on it (a real CPU model) that the formulas are checked against.
from tests.analytic.test_peft_methods import TINY_LLAMA, _peft_own_count
from vramledger.adapters.peft_config import check_peft_config, peft_changes
from vramledger.analytic import estimate
from vramledger.catalog.hfconfig import model_spec_from_config
from vramledger.ledger import Category, Ledger
from vramledger.specs import TrainSpec
from vramledger.trace import trace_step

SMALL = dict(TINY_LLAMA, vocab_size=1000, hidden_size=256, intermediate_size=704, head_dim=64)

METHODS: dict[str, dict[str, Any]] = {
    "dora": {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj"], "use_dora": True},
    "adalora": {"peft_type": "ADALORA", "init_r": 6, "target_r": 2, "total_step": 100,
                "target_modules": ["q_proj", "v_proj"]},
    "loha": {"peft_type": "LOHA", "r": 4, "target_modules": ["q_proj", "v_proj", "o_proj"]},
    "lokr": {"peft_type": "LOKR", "r": 2, "target_modules": ["q_proj", "gate_proj", "down_proj"]},
    "vera": {"peft_type": "VERA", "r": 16, "target_modules": ["q_proj", "o_proj"]},
    "oft": {"peft_type": "OFT", "oft_block_size": 16, "r": 0, "target_modules": ["q_proj", "v_proj"]},
    # butterfly factor 1: PEFT uses 1 anyway without its CUDA extension (as on this CPU), so the truth agrees
    "boft": {"peft_type": "BOFT", "boft_block_size": 4, "boft_n_butterfly_factor": 1, "target_modules": ["q_proj"]},
    "ia3": {"peft_type": "IA3"},
    "prefix-tuning": {"peft_type": "PREFIX_TUNING", "num_virtual_tokens": 6},
    "prompt-tuning": {"peft_type": "PROMPT_TUNING", "num_virtual_tokens": 6},
    "p-tuning": {"peft_type": "P_TUNING", "num_virtual_tokens": 6, "encoder_hidden_size": 32},
    "ln-tuning": {"peft_type": "LN_TUNING"},
}  # fmt: skip


def spec_for(config: dict[str, Any], cfg: dict[str, Any], seq: int) -> tuple[Any, TrainSpec]:
    """The model and the setup ``--peft-config`` makes (adapters/peft_config.py), with a short sequence."""
    checked = check_peft_config(cfg, "test")
    base = TrainSpec(micro_batch=1, seq_len=seq)
    train = dataclasses.replace(base, **peft_changes(checked, base.method, base.lora))
    return model_spec_from_config(config, name="tiny", source="test"), train


@pytest.mark.parametrize("name", list(METHODS), ids=list(METHODS))
def test_trace_runs_the_method_and_counts_as_peft(name: str) -> None:
    m, train = spec_for(TINY_LLAMA, METHODS[name], seq=16)
    truth = _peft_own_count(METHODS[name])
    traced = trace_step(m, train)
    estimated = estimate(m, train)
    print(name, "PEFT", truth, "trace", traced.trainable_params, "estimate", estimated.trainable_params)
    assert traced.trainable_params == truth
    assert estimated.trainable_params == truth
    assert traced.peak_allocated > 0 and traced.bytes_of(Category.ACTIVATIONS, traced.peak_phase) > 0


def _activations(ledger: Ledger) -> int:
    return ledger.bytes_of(Category.ACTIVATIONS, ledger.peak_phase)


@pytest.mark.parametrize("name", ["ia3", "prefix-tuning"])
def test_estimated_activations_match_the_trace(name: str) -> None:
    m, train = spec_for(SMALL, METHODS[name], seq=96)
    traced, estimated = _activations(trace_step(m, train)), _activations(estimate(m, train))
    print(name, "trace", traced, "estimate", estimated, "ratio", estimated / traced)
    assert estimated == pytest.approx(traced, rel=0.01)


NAMED_TARGETS = {  # PEFT has per-model default targets for some methods only (utils/constants.py): name them
    "ia3": {
        "peft_type": "IA3",
        "target_modules": ["k_proj", "v_proj", "down_proj"],
        "feedforward_modules": ["down_proj"],
    },
    "loha": METHODS["loha"],
    "prefix-tuning": METHODS["prefix-tuning"],
    "adalora": METHODS["adalora"],
}


@pytest.mark.parametrize("name", list(NAMED_TARGETS))
def test_model_without_formulas_counts_with_peft_on_the_meta_device(name: str) -> None:
    # A model spec built on the meta device (catalog/inventory.py), as for a family without formulas: the estimate
    # takes PEFT's own count there, which must equal PEFT's count on a real CPU model, and the trace's.
    import copy
    import warnings

    import torch
    from peft import get_peft_config, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.catalog.test_meta_inventory import TINY
    from vramledger.catalog.inventory import generic_model_spec

    config = TINY["glm4"]
    _, train = spec_for(config, NAMED_TARGETS[name], seq=16)
    m = generic_model_spec(config, name="tiny-glm4", source="test")  # built on the meta device, no formula
    assert m.inventory is not None
    torch.manual_seed(0)
    fields = {k: v for k, v in config.items() if k != "model_type"}
    real = AutoModelForCausalLM.from_config(AutoConfig.for_model("glm4", **fields))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(
            copy.deepcopy(real), get_peft_config({"task_type": "CAUSAL_LM", **NAMED_TARGETS[name]})
        )
    truth = int(peft_model.get_nb_trainable_parameters()[0])
    estimated = estimate(m, train)
    assert estimated.trainable_params == truth
    assert trace_step(m, train).trainable_params == truth
    assert any("PEFT's own count, on the meta device" in w for w in estimated.warnings)
