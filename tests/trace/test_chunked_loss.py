"""``trace --loss chunked``: torchtune's CEWithChunkedOutputLoss run on fake tensors, against a hand derivation.

torchtune's recipe computes the output layer per chunk (the chunks' bf16 logits listed), upcasts each chunk to fp32
inside the loss, and ``del logits`` before ``loss.backward()``; cross_entropy's log_softmax saves its fp32 output.
So in backward the loss holds 4·V·T (every chunk's saved log-softmax) plus one chunk's two fp32 gradients
(8·V·chunk); in forward the listed bf16 logits (2·V·T) beside them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from vramledger.analytic import estimate  # noqa: E402
from vramledger.catalog.hfconfig import model_spec_from_config  # noqa: E402
from vramledger.ledger import Category, Phase  # noqa: E402
from vramledger.specs import Loss, Method, Precision, TrainSpec  # noqa: E402
from vramledger.trace import trace_step  # noqa: E402

CFG = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 8192,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}


def test_chunked_loss_trace() -> None:
    m = model_spec_from_config(CFG, name="tiny", source="test")
    B, L, chunk = 2, 512, 256
    t = TrainSpec(
        method=Method.LORA,
        precision=Precision.BF16,
        micro_batch=B,
        seq_len=L,
        loss=Loss.CHUNKED,
        loss_chunk_tokens=chunk,
        packing=True,
    )
    tr = trace_step(m, t, config=CFG)
    V, T = CFG["vocab_size"], B * L
    back = tr.bytes_of(Category.LOGITS_LOSS, Phase.BACKWARD)
    print(f"backward logits: trace {back:,}, hand 4·V·T + 8·V·chunk = {4 * V * T + 8 * V * chunk:,}")
    assert back == pytest.approx(4 * V * T + 8 * V * chunk, rel=0.01)
    # Forward: the estimate's chunked formula (analytic/logits.py) against the trace, within 1%.
    es = estimate(m, t)
    fwd_tr, fwd_es = tr.bytes_of(Category.LOGITS_LOSS, Phase.FORWARD), es.bytes_of(Category.LOGITS_LOSS, Phase.FORWARD)
    assert fwd_es == pytest.approx(fwd_tr, rel=0.01)


def test_fused_loss_is_still_refused() -> None:
    from vramledger.errors import VramledgerError

    m = model_spec_from_config(CFG, name="tiny", source="test")
    with pytest.raises(VramledgerError, match="--loss fused needs Liger"):
        trace_step(m, TrainSpec(method=Method.LORA, seq_len=64, loss=Loss.FUSED), config=CFG)
