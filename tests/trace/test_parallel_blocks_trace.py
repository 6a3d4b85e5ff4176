"""transformers' parallel blocks (Phi, GPT-NeoX, Falcon's new decoder architecture) under the estimate's formulas
against the real step traced on fake tensors: the saved activations of the forward, and the peak.

The cases the formulas were checked on (docs/litgpt_families.md): full fine-tuning, which saves the linears' inputs
and, for the partial-rotary families, the copy of SDPA's output that the trained dense reads; and dropout-free bf16
adapters, which share their input with each other. Not held here (docs/litgpt_families.md): LoRA under autocast
with dropout on GPT-NeoX (+9% activations), Falcon-7B's multi-query call.
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from vramledger.analytic import estimate  # noqa: E402
from vramledger.catalog.hfconfig import model_spec_from_config  # noqa: E402
from vramledger.ledger import Category, Phase  # noqa: E402
from vramledger.specs import LoraSpec, Method, Precision, TrainSpec  # noqa: E402
from vramledger.trace import trace_step  # noqa: E402

_TINY = {"hidden_size": 512, "num_attention_heads": 8, "num_hidden_layers": 2, "vocab_size": 8000}
CASES = {
    "phi-full": (
        {"model_type": "phi", "intermediate_size": 2048, "partial_rotary_factor": 0.5, "hidden_act": "gelu_new",
         "resid_pdrop": 0.1, "torch_dtype": "bfloat16", **_TINY},
        {"method": Method.FULL, "precision": Precision.BF16},
    ),
    "gpt_neox-lora-nodropout": (
        {"model_type": "gpt_neox", "intermediate_size": 2048, "rotary_pct": 0.25, "hidden_act": "gelu",
         "torch_dtype": "bfloat16", **_TINY},
        {"method": Method.LORA, "precision": Precision.BF16,
         "lora": LoraSpec(rank=16, dropout=0.0, adapter_fp32=False)},
    ),
    "falcon-40b-shape-full": (
        {"model_type": "falcon", "num_kv_heads": 2, "new_decoder_architecture": True, "bias": False,
         "torch_dtype": "bfloat16", **_TINY},
        {"method": Method.FULL},
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_parallel_block_activations_match_the_trace(case: str) -> None:
    cfg, changes = CASES[case]
    model = model_spec_from_config(cfg, name=case, source="test")
    spec = dataclasses.replace(TrainSpec(micro_batch=2, seq_len=256, packing=True), **changes)
    traced, analytic = trace_step(model, spec, config=cfg), estimate(model, spec)
    a = analytic.bytes_of(Category.ACTIVATIONS, Phase.FORWARD)
    t = traced.bytes_of(Category.ACTIVATIONS, Phase.FORWARD)
    peak_a = max(analytic.allocated(p) - analytic.bytes_of(Category.WORKSPACE, p) for p in analytic.phases)
    peak_t = max(traced.allocated(p) - traced.bytes_of(Category.WORKSPACE, p) for p in traced.phases)
    print(case, "activations", a, "trace", t, "peak", peak_a, "trace", peak_t)
    assert abs(a - t) <= 0.005 * t
    assert abs(peak_a - peak_t) <= 0.01 * peak_t
