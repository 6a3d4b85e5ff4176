"""LitGPT's own decoder layer (analytic/litgpt.py): what it saves beyond transformers + PEFT, derived by hand from
litgpt 43c44323's model.py/lora.py for each case the module distinguishes."""

import dataclasses

import pytest

from vramledger.analytic import estimate
from vramledger.analytic.litgpt import litgpt_layer_extra_bytes_per_token
from vramledger.analytic.weights import weight_budget
from vramledger.catalog import resolve_model
from vramledger.ledger import Category, Phase
from vramledger.specs import LoraSpec, Method, ModelCode, Precision, QuantSpec, TrainSpec

L3_8B = resolve_model("llama-3-8b")  # 32 query heads over 8 K/V heads of 128, H = 4096
L2_7B = resolve_model("llama-2-7b")  # 32 heads, no GQA, H = 4096


def _lora(targets: tuple[str, ...], dropout: float = 0.05, code: ModelCode = ModelCode.LITGPT) -> TrainSpec:
    return TrainSpec(
        method=Method.LORA,
        precision=Precision.BF16,
        lora=LoraSpec(rank=16, alpha=16, targets=targets, dropout=dropout, adapter_fp32=False),
        micro_batch=1,
        seq_len=512,
        model_code=code,
    )


def _extra(m, t: TrainSpec) -> int:  # type: ignore[no-untyped-def]
    return litgpt_layer_extra_bytes_per_token(m, t, weight_budget(m, t))


@pytest.mark.parametrize(
    ("model", "targets", "dropout", "expected"),
    [
        # GQA, LoRA on q and v: K and V expanded to 32 heads (2·(32 − 8)·128·2), zero_pad's index_copy source
        # (q 4096 + v 1024)·2, one shared dropout instead of two: − 4096·(2 + 1)
        (L3_8B, ("q_proj", "v_proj"), 0.05, 2 * 24 * 128 * 2 + (4096 + 1024) * 2 - 4096 * 3),
        # the same without dropout: nothing to share
        (L3_8B, ("q_proj", "v_proj"), 0.0, 2 * 24 * 128 * 2 + (4096 + 1024) * 2),
        # no GQA: SDPA's V is a view of the fused qkv, which keeps q and k's parts (4096 + 4096)·2 alive
        (L2_7B, ("q_proj", "v_proj"), 0.05, (4096 + 4096) * 2 + (4096 + 4096) * 2 - 4096 * 3),
        # every linear: q, k and v all adapted, so zero_pad returns its input (no index_copy); two dropouts shared
        (L3_8B, ("all",), 0.05, 2 * 24 * 128 * 2 - 2 * 4096 * 3),
    ],
    ids=["gqa-qv", "gqa-qv-nodropout", "mha-qv", "gqa-all"],
)
def test_litgpt_layer_extra_by_hand(model, targets, dropout, expected) -> None:  # type: ignore[no-untyped-def]
    got = _extra(model, _lora(targets, dropout))
    print("per token per layer:", got, "expected", expected)
    assert got == expected


def test_lit_gpt_2023_rmsnorm_saves_its_bf16_input() -> None:
    # lit-gpt 8641822: the same attention and LoRA terms as above for Llama-2-7B (q, v, dropout), and two RMSNorms per
    # layer that keep their bf16 input where transformers keeps an fp32 copy: − 2·4096·(4 − 2)
    t = dataclasses.replace(_lora(("q_proj", "v_proj")), model_code=ModelCode.LIT_GPT_2023)
    assert _extra(L2_7B, t) == (4096 + 4096) * 2 + (4096 + 4096) * 2 - 4096 * 3 - 2 * 4096 * 2


def test_transformers_layers_add_nothing_and_full_fine_tuning_keeps_the_attention_terms() -> None:
    assert _extra(L3_8B, _lora(("q_proj", "v_proj"), code=ModelCode.TRANSFORMERS)) == 0
    full = TrainSpec(method=Method.FULL, precision=Precision.BF16, model_code=ModelCode.LITGPT)
    # + proj's input: ``y.transpose(1, 2).reshape(B, T, Dq)`` copies SDPA's (B, nh, T, hd) output (LitGPT's q is a
    # contiguous ``torch.cat``, and SDPA's output takes q's layout), and a trained proj keeps that copy: Dq·c.
    # Measured on litgpt 101e31d2's Block against transformers' LlamaDecoderLayer, both fully trained (H 256,
    # 8 heads of 32, bf16): +1536.0 B/token with 8 K/V heads ((256 + 256)·2 + 256·2), +1280.0 with 2
    # (2·6·32·2 + 256·2) (docs/published.md, "TinyLlama pretraining rows").
    assert _extra(L3_8B, full) == 2 * 24 * 128 * 2 + 4096 * 2
    assert _extra(L2_7B, full) == (4096 + 4096) * 2 + 4096 * 2


def test_litgpt_proj_keeps_the_output_copy_only_when_it_keeps_its_input() -> None:
    kv = 2 * 24 * 128 * 2  # Llama-3-8B: K and V expanded to 32 heads
    # LoRA on every linear: q, k and v all adapted (no index_copy). With dropout, proj's adapter reads a dropped
    # copy and the frozen proj keeps nothing: no output copy; the two shared dropouts save 2·4096·(2 + 1).
    assert _extra(L3_8B, _lora(("all",), 0.05)) == kv - 2 * 4096 * 3
    # without dropout LitGPT's LoRALinear applies ``lambda x: x``: lora_A keeps the copy itself (4096·2)
    assert _extra(L3_8B, _lora(("all",), 0.0)) == kv + 4096 * 2
    # QLoRA on q and v: proj is a bitsandbytes Linear4bit, whose MatMul4Bit keeps its input A (the copy)
    qlora = dataclasses.replace(_lora(("q_proj", "v_proj")), method=Method.QLORA, quant=QuantSpec(bits=4))
    assert _extra(L3_8B, qlora) == kv + (4096 + 1024) * 2 - 4096 * 3 + 4096 * 2


def test_the_estimate_saves_the_extra_in_every_trained_layer() -> None:
    hf = _lora(("q_proj", "v_proj"))
    lit = dataclasses.replace(hf, model_code=ModelCode.LITGPT)
    hf = dataclasses.replace(hf, model_code=ModelCode.TRANSFORMERS)

    def saved(t: TrainSpec) -> int:
        ledger = estimate(L3_8B, t)
        return sum(
            i.bytes
            for i in ledger.items
            if i.phase is Phase.FORWARD and i.category is Category.ACTIVATIONS and i.label.startswith("saved by")
        )

    per_token = 2 * 24 * 128 * 2 + (4096 + 1024) * 2 - 4096 * 3
    assert saved(lit) - saved(hf) == 32 * 512 * per_token  # 32 layers × 512 tokens
