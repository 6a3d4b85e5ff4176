"""`trace` runs architectures without formulas: the real transformers code of the tiny models of
tests/catalog/test_meta_inventory.py, whose counts there are derived by hand."""

from __future__ import annotations

import pytest

from tests.catalog.test_meta_inventory import TINY, _deepseek_v3, _gpt_oss
from vramledger.analytic import estimate
from vramledger.catalog.config_of import config_of as hf_config
from vramledger.catalog.hfconfig import model_spec_from_config
from vramledger.specs import LoraSpec, Method, TrainSpec
from vramledger.trace import trace_step


@pytest.mark.parametrize(
    ("name", "expected"),
    [("gpt_oss", _gpt_oss()[0]), ("deepseek_v3", _deepseek_v3()[0])],
    ids=["gpt_oss", "deepseek_v3"],
)
def test_trace_runs_and_agrees_with_the_hand_count(name: str, expected: int) -> None:
    m = model_spec_from_config(TINY[name], name=f"tiny-{name}", source=f"test:{name}")
    train = TrainSpec(method=Method.LORA, lora=LoraSpec(rank=4), micro_batch=1, seq_len=32)
    ledger = trace_step(m, train, config=hf_config(m))
    analytic = estimate(m, train)
    print(name, "trainable trace", ledger.trainable_params, "estimate", analytic.trainable_params)
    assert ledger.params - ledger.trainable_params == expected
    assert ledger.trainable_params == analytic.trainable_params


def test_mla_with_narrower_values_traces_in_bf16() -> None:
    # DeepSeek-V2-Lite's shape class: no q_lora_rank (a plain q_proj) and v_head_dim < qk_nope + qk_rope, under
    # bf16, where SDPA takes the flash/efficient route (trace/shims.py pads v for the CPU kernel).
    cfg = dict(
        TINY["deepseek_v3"],
        model_type="deepseek_v2",
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        torch_dtype="bfloat16",
    )
    m = model_spec_from_config(cfg, name="tiny-v2", source="test")
    train = TrainSpec(method=Method.LORA, lora=LoraSpec(rank=4), micro_batch=1, seq_len=32)
    ledger = trace_step(m, train, config=hf_config(m))
    assert ledger.trainable_params == estimate(m, train).trainable_params


def test_all_linear_on_llama4_router_is_refused_with_the_way_around() -> None:
    # transformers 5.23 Llama4Router subclasses nn.Linear but returns (scores, logits); PEFT 0.21's
    # lora.Linear.forward reads result.dtype and fails. Naming the projections traces.
    from vramledger.errors import VramledgerError

    m = model_spec_from_config(TINY["llama4_text"], name="tiny-l4", source="test")
    train = TrainSpec(method=Method.LORA, lora=LoraSpec(rank=4), micro_batch=1, seq_len=32)
    with pytest.raises(VramledgerError, match=r"PEFT would wrap Llama4Router, an nn.Linear whose forward"):
        trace_step(m, train, config=hf_config(m))
    named = TrainSpec(
        method=Method.LORA, lora=LoraSpec(rank=4, targets=("q_proj", "v_proj")), micro_batch=1, seq_len=32
    )
    assert trace_step(m, named, config=hf_config(m)).trainable_params == estimate(m, named).trainable_params


@pytest.mark.parametrize("name", ["glm4", "olmo2"])
def test_new_formula_families_trace_to_the_same_counts(name: str) -> None:
    # GLM-4 and OLMo-2 have formulas (no meta-device inventory); the trace builds the transformers class from the
    # same config.
    m = model_spec_from_config(TINY[name], name=f"tiny-{name}", source=f"test:{name}")
    assert m.inventory is None
    train = TrainSpec(method=Method.LORA, lora=LoraSpec(rank=4), micro_batch=1, seq_len=32)
    ledger = trace_step(m, train, config=dict(TINY[name]))
    analytic = estimate(m, train)
    assert (ledger.params, ledger.trainable_params) == (analytic.params, analytic.trainable_params)
