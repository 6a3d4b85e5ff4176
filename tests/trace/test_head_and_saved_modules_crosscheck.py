"""LoRA on lm_head and ``modules_to_save``: the analytic ledger against the real PEFT step traced on fake tensors.

PEFT builds the head adapter and the ``ModulesToSaveWrapper`` copies itself here, so the trace is an independent
count of their weights, gradients, optimizer states and saved activations. Bar as in test_crosscheck.py: the
persistent categories within 0.5%, each phase's allocated peak within 2%.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from vramledger.analytic import estimate  # noqa: E402
from vramledger.catalog.hfconfig import model_spec_from_config  # noqa: E402
from vramledger.ledger import Category, Phase  # noqa: E402
from vramledger.specs import LoraSpec, Method, Precision, TrainSpec  # noqa: E402
from vramledger.trace import trace_step  # noqa: E402

CFG = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 4096,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
CASES = {
    "all+head, bf16-true, dropout": (
        Precision.BF16,
        LoraSpec(rank=8, targets=("all", "lm_head"), adapter_fp32=False, dropout=0.05),
    ),
    "q,v + saved embed/head, bf16-true": (
        Precision.BF16,
        LoraSpec(rank=8, targets=("q_proj", "v_proj"), modules_to_save=("embed_tokens", "lm_head")),
    ),
    "q,v + saved embed/head, bf16-mixed": (
        Precision.BF16_MIXED,
        LoraSpec(rank=8, targets=("q_proj", "v_proj"), modules_to_save=("embed_tokens", "lm_head")),
    ),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_analytic_matches_trace(case: str) -> None:
    precision, lora = CASES[case]
    m = model_spec_from_config(CFG, name="tiny", source="test")
    t = TrainSpec(method=Method.LORA, precision=precision, micro_batch=2, seq_len=128, lora=lora, packing=True)
    tr, es = trace_step(m, t, config=CFG), estimate(m, t)
    assert tr.trainable_params == es.trainable_params
    for ph in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER):
        for cat in (Category.WEIGHTS, Category.GRADIENTS, Category.OPTIMIZER_STATE):
            got, want = es.bytes_of(cat, ph), tr.bytes_of(cat, ph)
            print(f"{case} {ph.value} {cat.value}: trace {want:,} analytic {got:,}")
            assert abs(got - want) <= 0.005 * max(want, 1) + 4096
        got, want = es.allocated(ph), tr.allocated(ph)  # both include the cuBLAS workspaces
        print(f"{case} {ph.value} allocated: trace {want:,} analytic {got:,} ({got / want - 1:+.2%})")
        assert abs(got / want - 1) <= 0.02
