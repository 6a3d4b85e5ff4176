"""LoRA on lm_head, ``modules_to_save`` and the chunked loss: the analytic ledger and hand derivations against the
real PEFT step traced on fake tensors.

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
from vramledger.specs import LoraSpec, Loss, Method, Precision, TrainSpec  # noqa: E402
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


def test_chunked_loss_trace() -> None:
    """``trace --loss chunked``: torchtune's CEWithChunkedOutputLoss run on fake tensors, against a hand derivation.

    torchtune's recipe computes the output layer per chunk (the chunks' bf16 logits listed), upcasts each chunk to fp32
    inside the loss, and ``del logits`` before ``loss.backward()``; cross_entropy's log_softmax saves its fp32 output.
    So in backward the loss holds 4·V·T (every chunk's saved log-softmax) plus one chunk's two fp32 gradients
    (8·V·chunk); in forward the listed bf16 logits (2·V·T) beside them."""
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


QLORA = {
    "qlora q,v dropout, bf16-true": TrainSpec(
        method=Method.QLORA, precision=Precision.BF16, micro_batch=2, seq_len=256, packing=True,
        lora=LoraSpec(rank=8, targets=("q_proj", "v_proj"), dropout=0.05, adapter_fp32=False),
    ),
    "qlora all-linear, bf16-mixed": TrainSpec(
        method=Method.QLORA, precision=Precision.BF16_MIXED, micro_batch=2, seq_len=256, packing=True,
        lora=LoraSpec(rank=8),
    ),
    "qlora all-linear + lm_head, bf16-true": TrainSpec(
        method=Method.QLORA, precision=Precision.BF16, micro_batch=2, seq_len=256, packing=True,
        lora=LoraSpec(rank=8, targets=("all", "lm_head"), adapter_fp32=False, dropout=0.05),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(QLORA), ids=list(QLORA))
def test_qlora_saved_inputs_match_the_trace(case: str) -> None:
    """bitsandbytes' MatMul4Bit keeps each quantised linear's input: the trace runs the same autograd rule on the
    bf16 base (trace/shims.py matmul4bit_saves_input), the estimate counts it (activations.py)."""
    m = model_spec_from_config(CFG, name="tiny", source="test")
    t = QLORA[case]
    tr, es = trace_step(m, t, config=CFG), estimate(m, t)
    for ph in (Phase.FORWARD, Phase.BACKWARD):
        # the head adapter's saved input is filed with the logits by the trace's classifier: compare the sum
        got, want = (
            sum(led.bytes_of(cat, ph) for cat in (Category.ACTIVATIONS, Category.LOGITS_LOSS)) for led in (es, tr)
        )
        print(f"{case} {ph.value} activations: trace {want:,} analytic {got:,}")
        assert abs(got / want - 1) <= 0.005
        assert abs(es.allocated(ph) / tr.allocated(ph) - 1) <= 0.01
        # the output layer stays bf16 under its adapter (quantised before PEFT wraps it)
        assert abs(es.bytes_of(Category.WEIGHTS, ph) / tr.bytes_of(Category.WEIGHTS, ph) - 1) <= 0.005
