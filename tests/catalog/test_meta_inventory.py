"""Architectures without formulas, built by transformers on the meta device, against counts derived by hand.

Each tiny config below is of a model_type we have no formula for. The expected counts are written out from the
transformers 5.23 modeling files (cited per model), not from the inventory code, so a wrong grouping, a missed
3-D expert parameter or a double-counted tied matrix fails here.
"""

from __future__ import annotations

import pytest

from vramledger.analytic import estimate
from vramledger.analytic.params import active_params, count_params
from vramledger.catalog.hfconfig import model_spec_from_config
from vramledger.specs import LoraSpec, Method, TrainSpec

pytest.importorskip("transformers")
pytest.importorskip("peft")

V, H = 128, 64
EMB = V * H  # embed_tokens; every tiny model below has an untied lm_head of the same size
FINAL_NORM = H

# Shared by every tiny config: vocabulary, width, two layers (DeepSeek three), four heads.
_BASE = dict(vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
_TOKENS = dict(pad_token_id=0, eos_token_id=1)  # the families' default token ids lie outside V = 128

TINY = {
    "olmo2": dict(_BASE, model_type="olmo2", intermediate_size=96, **_TOKENS),
    "glm4": dict(_BASE, model_type="glm4", intermediate_size=96, head_dim=16, attention_bias=True, **_TOKENS),
    "deepseek_v3": dict(
        _BASE,
        model_type="deepseek_v3",
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
    ),
    "gpt_oss": dict(
        _BASE, model_type="gpt_oss", intermediate_size=32, head_dim=16, num_local_experts=4, num_experts_per_tok=2
    ),
    "llama4_text": dict(
        _BASE,
        model_type="llama4_text",
        intermediate_size=32,
        intermediate_size_mlp=96,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
    ),
}


def _olmo2() -> int:
    # modeling_olmo2.py: Olmo2Attention q/k/v/o without bias, q_norm RMSNorm(heads·head_dim = 64) and
    # k_norm RMSNorm(kv_heads·head_dim = 32) over the whole projection; Olmo2DecoderLayer has only
    # post_attention_layernorm and post_feedforward_layernorm; LlamaMLP-style gate/up/down.
    attn = H * 64 + H * 32 + H * 32 + 64 * H + 64 + 32
    layer = attn + 3 * H * 96 + 2 * H
    return EMB + 2 * layer + FINAL_NORM + EMB


def _glm4() -> int:
    # modeling_glm4.py: Glm4Attention q/k/v with bias=attention_bias, o_proj without bias; Glm4MLP fused
    # gate_up_proj (H → 2I) and down_proj; Glm4DecoderLayer has four norms (input, post_self_attn,
    # post_attention, post_mlp).
    attn = (H * 64 + 64) + 2 * (H * 32 + 32) + 64 * H
    layer = attn + H * 2 * 96 + 96 * H + 4 * H
    return EMB + 2 * layer + FINAL_NORM + EMB


def _deepseek_v3() -> tuple[int, int]:
    # modeling_deepseek_v3.py DeepseekV3Attention (MLA): q_a_proj H → q_lora_rank, q_a_layernorm(q_lora_rank),
    # q_b_proj → heads·(nope + rope), kv_a_proj_with_mqa H → kv_lora_rank + rope, kv_a_layernorm(kv_lora_rank),
    # kv_b_proj kv_lora_rank → heads·(nope + v), o_proj heads·v → H. The first first_k_dense_replace layers have a
    # dense MLP of intermediate_size; the others DeepseekV3MoE: router weight (E, H) (its e_score_correction_bias
    # is a buffer), experts gate_up_proj (E, 2·Im, H) and down_proj (E, H, Im), shared experts MLP of
    # Im·n_shared_experts.
    attn = H * 24 + 24 + 24 * 4 * 12 + H * (16 + 4) + 16 + 16 * 4 * (8 + 8) + 4 * 8 * H
    dense = attn + 2 * H + 3 * H * 96
    experts = 4 * (2 * 32 * H) + 4 * (H * 32)
    moe = attn + 2 * H + 4 * H + experts + 3 * H * 32
    total = EMB + dense + 2 * moe + FINAL_NORM + EMB
    active = total - 2 * experts * (4 - 2) // 4  # 2 of 4 routed experts per token
    return total, active


def _gpt_oss() -> tuple[int, int]:
    # modeling_gpt_oss.py: GptOssAttention q/k/v/o with bias=attention_bias (default True) and sinks
    # Parameter(heads); GptOssTopKRouter weight (E, H) and bias (E); GptOssExperts gate_up_proj (E, H, 2I) with
    # gate_up_proj_bias (E, 2I), down_proj (E, I, H) with down_proj_bias (E, H); two RMSNorms per layer.
    attn = (H * 64 + 64) + 2 * (H * 32 + 32) + (64 * H + H) + 4
    experts = 4 * (H * 64 + 64) + 4 * (32 * H + H)
    layer = attn + 4 * H + 4 + experts + 2 * H
    total = EMB + 2 * layer + FINAL_NORM + EMB
    idle_weights = 2 * (4 * H * 64 + 4 * 32 * H) * (4 - 2) // 4  # active_params leaves expert biases in
    return total, total - idle_weights


def _llama4_text() -> int:
    # modeling_llama4.py: Llama4TextAttention q/k/v/o without bias (its qk norm is an L2 norm without weights);
    # with interleave_moe_layer_step = 2 layer 1 is MoE: Llama4Router Linear(H, E), shared_expert MLP of
    # intermediate_size, Llama4TextExperts gate_up_proj (E, H, 2I) and down_proj (E, I, H); layer 0 a dense MLP
    # of intermediate_size_mlp.
    attn = H * 64 + 2 * H * 32 + 64 * H
    dense = attn + 2 * H + 3 * H * 96
    moe = attn + 2 * H + H * 4 + 3 * H * 32 + 4 * H * 64 + 4 * 32 * H
    return EMB + dense + moe + FINAL_NORM + EMB


def _spec(name: str):  # type: ignore[no-untyped-def]
    return model_spec_from_config(TINY[name], name=f"tiny-{name}", source=f"test:{name}")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("olmo2", _olmo2()),
        ("glm4", _glm4()),
        ("deepseek_v3", _deepseek_v3()[0]),
        ("gpt_oss", _gpt_oss()[0]),
        ("llama4_text", _llama4_text()),
    ],
    ids=["olmo2", "glm4", "deepseek_v3", "gpt_oss", "llama4_text"],
)
def test_count_equals_the_hand_derivation(name: str, expected: int) -> None:
    m = _spec(name)
    got = count_params(m)
    print(name, "expected", expected, "got", got, "match", got == expected)
    # GLM-4 and OLMo-2 have formulas (analytic/params.py); the rest are built on the meta device.
    assert (m.inventory is None) == (name in ("glm4", "olmo2"))
    assert got == expected


@pytest.mark.parametrize(("name", "hand"), [("glm4", _glm4()), ("olmo2", _olmo2())], ids=["glm4", "olmo2"])
def test_formula_families_equal_their_meta_device_build(name: str, hand: int) -> None:
    from vramledger.catalog.inventory import generic_model_spec

    built = generic_model_spec(TINY[name], name=f"tiny-{name}", source="test")
    assert count_params(_spec(name)) == count_params(built) == hand


def test_moe_active_params() -> None:
    assert active_params(_spec("deepseek_v3")) == _deepseek_v3()[1]
    assert active_params(_spec("gpt_oss")) == _gpt_oss()[1]


def test_config_defaults_come_from_transformers_config_class() -> None:
    # Olmo2Config's default rms_norm_eps etc. do not matter, but head_dim (H / heads) and the untied head do.
    from vramledger.catalog.inventory import generic_model_spec

    m = generic_model_spec(TINY["olmo2"], name="tiny-olmo2", source="test")
    assert (m.head_dim, m.num_kv_heads, m.tie_word_embeddings, m.qk_norm, m.norms_per_layer) == (16, 2, False, True, 2)
    mla = _spec("deepseek_v3")
    assert mla.head_dim == 8 + 4  # qk_nope_head_dim + qk_rope_head_dim
    assert mla.norms_per_layer == 2  # q_a/kv_a_layernorm act on the latents, not the hidden width


def _lora(rank: int) -> TrainSpec:
    return TrainSpec(method=Method.LORA, lora=LoraSpec(rank=rank), micro_batch=1, seq_len=64)


def test_lora_trainable_count_dense() -> None:
    # all-linear on OLMo-2: every nn.Linear of the layers, r·(in + out) each (peft tuners/lora/layer.py).
    per_layer = 8 * ((H + 64) + (H + 32) + (H + 32) + (64 + H) + 3 * (H + 96))
    ledger = estimate(_spec("olmo2"), _lora(8))
    assert ledger.trainable_params == 2 * per_layer


def test_lora_trainable_count_follows_peft_moe_conversion() -> None:
    # PEFT 0.21 with transformers 5 (utils/transformers_weight_conversion.py _convert_peft_config_moe): for a
    # model whose conversion pattern is mixtral's, "all-linear" becomes the attention nn.Linears plus
    # target_parameters gate.weight, gate_up_proj (rank 2r: gate and up were two v4 linears) and down_proj; the
    # dense and shared-expert gate/up/down_proj are then no longer targeted. ParamWrapper (tuners/lora/layer.py)
    # holds lora_A (r·E, in) and lora_B (out, r·E) for E experts.
    r = 16
    attn = r * ((H + 24) + (24 + 48) + (H + 20) + (16 + 64) + (32 + H))
    moe = r * (H + 4) + 2 * r * 4 * (H + 64) + r * 4 * (32 + H)
    ledger = estimate(_spec("deepseek_v3"), _lora(r))
    assert ledger.trainable_params == 3 * attn + 2 * moe


def test_estimate_labels_its_basis() -> None:
    ledger = estimate(_spec("gpt_oss"), _lora(8))
    basis = [w for w in ledger.warnings if w.startswith("gpt_oss: no formula here")]
    assert basis and "`vramledger trace` gives the exact figure" in basis[0]
    assert "GptOssForCausalLM" in basis[0] and "has no SDPA" in basis[0]
    assert not any("no formula here" in w for w in estimate(_spec("glm4"), _lora(8)).warnings)


@pytest.mark.parametrize("name", ["olmo2", "glm4"])
def test_dense_lora_count_without_torch_equals_peft_own(name: str) -> None:
    # The dense path counts adapters without building anything; PEFT's get_nb_trainable_parameters on the
    # meta-device model is the independent truth.
    from peft import LoraConfig, get_peft_model

    from vramledger.catalog.inventory import build_meta_model, hf_config_object

    model = build_meta_model(hf_config_object(TINY[name], "test"), where="test")
    peft_model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear", use_dora=True))
    trainable, _ = peft_model.get_nb_trainable_parameters()
    train = TrainSpec(method=Method.LORA, lora=LoraSpec(rank=8, dora=True), micro_batch=1, seq_len=64)
    assert estimate(_spec(name), train).trainable_params == trainable


def test_state_space_model_counts_and_peft_refusal_is_clean() -> None:
    # Mamba (modeling_mamba.py MambaMixer): in_proj H → 2I, conv1d (I, 1, k) with bias, x_proj I → R + 2S,
    # dt_proj R → I with bias, A_log (I, S), D (I), out_proj I → H; one RMSNorm per block. The conv weight is 3-D
    # but no expert. PEFT refuses out_proj and conv1d for Mamba, which surfaces as one clear error.
    from vramledger.errors import VramledgerError

    cfg = dict(
        model_type="mamba",
        vocab_size=V,
        hidden_size=H,
        state_size=4,
        num_hidden_layers=2,
        expand=2,
        conv_kernel=4,
        time_step_rank=8,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    m = model_spec_from_config(cfg, name="tiny-mamba", source="test")
    I, S, R, k = 2 * H, 4, 8, 4  # noqa: E741
    mixer = H * 2 * I + (I * k + I) + I * (R + 2 * S) + (R * I + I) + I * S + I + I * H
    tied = EMB  # MambaConfig ties the head by default
    assert count_params(m) == tied + 2 * (mixer + H) + FINAL_NORM
    with pytest.raises(VramledgerError, match=r"PEFT rejected the targets .*incompatible with Mamba"):
        estimate(m, _lora(4))
    assert estimate(m, TrainSpec(method=Method.FULL, micro_batch=1, seq_len=64)).trainable_params == count_params(m)
