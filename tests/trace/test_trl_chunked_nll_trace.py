"""``trace --loss chunked_nll``: TRL's checkpointed chunks (trace/trl_loss.py) run on fake tensors against the
estimate (analytic/logits.py ``_trl_chunked_nll``). Bar as in test_crosscheck.py: each phase's allocated peak
within 2%. The model's own terms are checked on TRL's verbatim code in tests/analytic/test_trl_chunked_nll.py."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from tests.trace.test_lora_head_saved_modules_chunked_loss import CFG  # noqa: E402  (the same small Llama)
from vramledger.analytic import estimate  # noqa: E402
from vramledger.catalog.hfconfig import model_spec_from_config  # noqa: E402
from vramledger.ledger import Phase  # noqa: E402
from vramledger.specs import DType, Loss, Method, Precision, TrainSpec  # noqa: E402
from vramledger.trace import trace_step  # noqa: E402

CASES = {
    "lora bf16-true": (Method.LORA, Precision.BF16, None),
    "lora bf16-mixed, bf16 base": (Method.LORA, Precision.BF16_MIXED, None),
    "lora bf16-mixed, fp32 base (TRL's default dtype)": (Method.LORA, Precision.BF16_MIXED, DType.FP32),
    "full bf16-mixed (the head trained, fp32)": (Method.FULL, Precision.BF16_MIXED, None),
    "full bf16-true": (Method.FULL, Precision.BF16, None),
}


@pytest.mark.parametrize(("method", "precision", "base"), CASES.values(), ids=CASES.keys())
def test_trace_and_estimate_agree(method: Method, precision: Precision, base: DType | None) -> None:
    m = model_spec_from_config(CFG, name="tiny", source="test")
    t = TrainSpec(
        method=method,
        precision=precision,
        micro_batch=2,
        seq_len=512,
        loss=Loss.CHUNKED_NLL,
        packing=True,
        base_dtype=base,
    )
    tr, es = trace_step(m, t, config=CFG), estimate(m, t)
    for ph in (Phase.FORWARD, Phase.BACKWARD):
        got, want = es.allocated(ph), tr.allocated(ph)
        print(f"{ph.value} allocated: trace {want:,} analytic {got:,} ({got / want - 1:+.2%})")
        assert abs(got / want - 1) <= 0.02
