"""TRL's ``chunked_nll``: the estimate's peak reserved against the trace's allocator replay (issue 14 item 3: within
3%). The replay (``trace_step`` on fake tensors, its events through allocator/model.py) is the independent truth;
the estimate's term is analytic/reserve/trl.py ``trl_stranded_bytes``. A small Llama with Llama-3's vocabulary, so
each chunk's blocks (4·V·256 fp32) are larger than the backward thread's 32 MiB cuBLAS workspace, as in real
models. On main before that term these configs were 11-15% under."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from tests.trace.test_trl_chunked_nll_trace import CFG as TRACE_CFG  # noqa: E402
from vramledger.analytic import estimate  # noqa: E402
from vramledger.catalog.hfconfig import model_spec_from_config  # noqa: E402
from vramledger.specs import DType, Loss, Method, Precision, TrainSpec  # noqa: E402
from vramledger.trace import trace_step  # noqa: E402

CFG = {**TRACE_CFG, "vocab_size": 128256}  # test_trl_chunked_nll_trace.py's Llama, Llama-3's vocabulary
# (precision, base dtype, micro-batch, length); 2 × 512 has a shorter last chunk (2·511 − 3·256 = 254 tokens)
CASES = {
    "bf16-true 2x512": (Precision.BF16, None, 2, 512),
    "bf16-mixed fp32 base 2x512": (Precision.BF16_MIXED, DType.FP32, 2, 512),
    "bf16-true 1x300": (Precision.BF16, None, 1, 300),
    "bf16-mixed bf16 base 1x300": (Precision.BF16_MIXED, None, 1, 300),
    "bf16-mixed fp32 base 1x300": (Precision.BF16_MIXED, DType.FP32, 1, 300),
    "bf16-mixed bf16 base 2x512": pytest.param(
        Precision.BF16_MIXED,
        None,
        2,
        512,
        marks=pytest.mark.xfail(
            strict=True,
            reason="3.6% under: besides the chain's blocks the replay has 20 MiB free in forward _to_copy segments "
            "(layer transients in kLargeBuffer segments), not modelled for a chunked loss",
        ),
    ),
}


@pytest.mark.parametrize(("precision", "base", "batch", "seq"), CASES.values(), ids=CASES.keys())
def test_lora_reserved_within_3_percent_of_replay(
    precision: Precision, base: DType | None, batch: int, seq: int
) -> None:
    m = model_spec_from_config(CFG, name="tiny-llama3-vocab", source="test")
    t = TrainSpec(
        method=Method.LORA,
        precision=precision,
        micro_batch=batch,
        seq_len=seq,
        loss=Loss.CHUNKED_NLL,
        packing=True,
        base_dtype=base,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        replay = trace_step(m, t, config=CFG).settings["allocator"]["peak_reserved_bytes"]
    got = estimate(m, t).peak_reserved
    print(f"reserved: replay {replay / 2**20:.1f} MiB, estimate {got / 2**20:.1f} MiB ({got / replay - 1:+.2%})")
    assert abs(got / replay - 1) <= 0.03
