"""Parameter counts derived from the bundled configs against the counts their publishers give.

The truth here is the exact figure published for each checkpoint (the Hugging Face model page's safetensors
count, which sums every tensor stored in the checkpoint). The catalog JSON records the same figures; PUBLISHED
below writes the main ones out again, so a wrong number in a JSON file cannot pass by agreeing with itself.

Two kinds of checkpoint publish more than the language model's ``sum(p.numel() for p in model.parameters())``:
- Qwen3-0.6B and -1.7B store ``lm_head.weight`` as well as the ``embed_tokens.weight`` it is tied to;
- Gemma 3 4B/12B/27B include a SigLIP vision tower and a projector, derived by hand below from
  transformers' ``modeling_siglip.py`` and ``modeling_gemma3.py``.
"""

from __future__ import annotations

import pytest

from vramledger.analytic.params import active_params, count_params, layer_linears
from vramledger.catalog import model_entries, resolve_model

# Exact published counts (Hugging Face model page, safetensors), written here independently of the JSON files.
PUBLISHED = {
    "gpt2": 124_439_808,
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248,
    "llama-3.1-8b": 8_030_261_248,  # same shapes as Llama 3 8B
    "llama-3.1-70b": 70_553_706_496,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "mistral-7b-v0.1": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-72b": 72_706_203_648,
    "qwen3-0.6b": 751_632_384,  # lm_head stored twice, see below
    "qwen3-8b": 8_190_735_360,
    "qwen3-30b-a3b": 30_532_122_624,
    "gemma-2-2b": 2_614_341_888,
    "gemma-2-27b": 27_227_128_320,
    "gemma-3-1b": 999_885_952,
    "gemma-3-4b": 4_300_079_472,  # includes the vision tower, see below
    "phi-3-mini-4k": 3_821_079_552,
    "phi-4": 14_659_507_200,
}


def siglip_and_projector_params(vision: dict, text_hidden: int) -> int:
    """The parameters of Gemma 3's vision side, by hand from transformers 5.x.

    modeling_siglip.py: SiglipVisionEmbeddings = patch_embedding Conv2d(3, D, P, P) with bias +
    position_embedding Embedding((S/P)^2, D); SiglipEncoderLayer = layer_norm1/2 (LayerNorm: weight and bias),
    q/k/v/out_proj Linear(D, D) with bias, fc1 Linear(D, F) and fc2 Linear(F, D) with bias; post_layernorm; no
    head when vision_use_head is false. modeling_gemma3.py Gemma3MultiModalProjector:
    mm_input_projection_weight (D, H_text) and mm_soft_emb_norm RMSNorm(D).
    """
    D, F, L = vision["hidden_size"], vision["intermediate_size"], vision["num_hidden_layers"]
    P, S = vision["patch_size"], vision["image_size"]
    embeddings = 3 * D * P * P + D + (S // P) ** 2 * D
    layer = 2 * (2 * D) + 4 * (D * D + D) + (D * F + F) + (F * D + D)
    tower = embeddings + L * layer + 2 * D
    projector = D * text_hidden + D
    return tower + projector


def model_params_from_published(key: str) -> int:
    """What the language model's ``sum(p.numel() for p in model.parameters())`` must be, given the figure."""
    entry = model_entries()[key]
    assert entry.published_params is not None
    expected = entry.published_params
    spec = resolve_model(key)
    if entry.published_counts_tied_head_twice:
        assert spec.tie_word_embeddings
        expected -= spec.vocab_size * spec.hidden_size
    if entry.published_includes_vision_tower:
        expected -= siglip_and_projector_params(entry.config["vision_config"], spec.hidden_size)
    return expected


PUBLISHED_KEYS = sorted(k for k, e in model_entries().items() if e.published_params is not None)


@pytest.mark.parametrize("key", PUBLISHED_KEYS, ids=PUBLISHED_KEYS)
def test_count_matches_published(key: str) -> None:
    expected = model_params_from_published(key)
    got = count_params(resolve_model(key))
    print(f"{key}: expected {expected:,} got {got:,} {'OK' if got == expected else 'MISMATCH'}")
    assert got == expected


@pytest.mark.parametrize("key", sorted(PUBLISHED), ids=sorted(PUBLISHED))
def test_catalog_records_the_published_figure(key: str) -> None:
    assert model_entries()[key].published_params == PUBLISHED[key]
    assert count_params(resolve_model(key)) == model_params_from_published(key)


# The new families (gpt-oss, DeepSeek-V2, Llama-4 and Qwen2.5-VL built on the meta device; OLMo-2 and GLM-4 by
# formula): exact published counts written out here too, and the two published only rounded (gpt-oss: the model
# card's table; GLM-4: the model page). The four exact figures are the hub's safetensors parameter totals, as
# quoted in several public model inventories (checked 2026-11-24 with the search tool's string index).
PUBLISHED_META = {
    "deepseek-v2-lite": 15_706_484_224,
    "llama-4-scout": 108_641_793_536,  # vision encoder included: built as Llama4ForConditionalGeneration
    "olmo-2-7b": 7_298_617_344,
    "qwen2.5-vl-7b": 8_292_166_656,  # vision encoder included
    "qwen3-vl-4b": 4_437_815_808,  # vision encoder included
    "bloomz-7b1": 7_069_016_064,  # bloom-7b1's model card, "Parameters: 7,069,016,064" (BloomForCausalLM, tied)
}
# StarCoder's model card and paper (arXiv:2305.06161): 15.5B, multi-query attention (GPTBigCodeForCausalLM).
PUBLISHED_ROUNDED = {"gpt-oss-20b": "20.91B", "glm-4-9b": "9.4B", "octocoder": "15.5B"}


@pytest.mark.parametrize("key", sorted(PUBLISHED_META), ids=sorted(PUBLISHED_META))
def test_meta_built_catalog_models_match_the_published_count(key: str) -> None:
    spec = resolve_model(key)
    # Without a formula, counted from the transformers model built on the meta device (stored in the entry).
    assert (spec.inventory is not None) == (model_entries()[key].meta_build is not None)
    assert model_entries()[key].published_params == PUBLISHED_META[key]
    assert count_params(spec) == PUBLISHED_META[key]


@pytest.mark.parametrize("key", sorted(PUBLISHED_ROUNDED), ids=sorted(PUBLISHED_ROUNDED))
def test_rounded_published_counts(key: str) -> None:
    figure = PUBLISHED_ROUNDED[key]
    assert model_entries()[key].published_params_rounded == figure
    decimals = len(figure.rstrip("B").partition(".")[2])
    got = count_params(resolve_model(key))
    print(f"{key}: published {figure}, counted {got:,}")
    assert f"{got / 1e9:.{decimals}f}B" == figure


def test_gpt_oss_active_params_as_the_model_card_counts_them() -> None:
    # Model card Table 1: 3.61B active for gpt-oss-20b, counting the unembedding but not the embedding.
    m = resolve_model("gpt-oss-20b")
    assert round((active_params(m) - m.vocab_size * m.hidden_size) / 1e9, 2) == 3.61


def test_catalog_size_and_coverage() -> None:
    keys = set(model_entries())
    assert len(keys) >= 28
    rounded = {k for k, e in model_entries().items() if e.published_params_rounded}
    assert set(PUBLISHED_KEYS) | rounded == keys, "every catalog model carries a published count"
    assert len(PUBLISHED) >= 8


def test_qwen3_small_checkpoints_store_the_tied_head_twice() -> None:
    # Qwen3-0.6B: V = 151,936, H = 1,024; the model has 751,632,384 - 151,936 x 1,024 parameters.
    assert model_params_from_published("qwen3-0.6b") == 751_632_384 - 151_936 * 1_024 == 596_049_920
    # Qwen3-4B is tied too but its checkpoint stores the matrix once.
    assert not model_entries()["qwen3-4b"].published_counts_tied_head_twice
    assert resolve_model("qwen3-4b").tie_word_embeddings


def test_gemma3_vision_tower_by_hand() -> None:
    # SigLIP so400m at 896 px, patch 14: 678,528 embedding conv + 4,718,592 positions + 27 x 15,239,504 layers
    # + 2,304 post-norm = 416,866,032; projector 1,152 x 2,560 + 1,152 = 2,950,272 (Gemma 3 4B).
    vision = model_entries()["gemma-3-4b"].config["vision_config"]
    assert siglip_and_projector_params(vision, 2560) == 416_866_032 + 2_950_272
    assert count_params(resolve_model("gemma-3-4b")) == 4_300_079_472 - 419_816_304


def test_moe_active_params_match_the_names() -> None:
    # Mistral: "Mixtral 8x7B has 46.7B total parameters but only uses 12.9B parameters per token".
    mixtral = resolve_model("mixtral-8x7b")
    assert round(active_params(mixtral) / 1e9, 1) == 12.9
    # Qwen3-30B-A3B model card: 30.5B total, 3.3B activated.
    qwen = resolve_model("qwen3-30b-a3b")
    assert round(count_params(qwen) / 1e9, 1) == 30.5
    assert abs(active_params(qwen) / 1e9 - 3.3) < 0.1


def test_moe_layout_follows_transformers_5() -> None:
    # modeling_mixtral.py (transformers 5): MixtralTopKRouter.weight (E, H) and MixtralExperts.gate_up_proj
    # (E, 2I, H) / down_proj (E, H, I) are bare nn.Parameters, not nn.Linear modules (PEFT adapts them only as
    # target_parameters, through its MoE conversion: tests/analytic/test_peft_methods.py).
    by_name = {lin.name: lin for lin in layer_linears(resolve_model("mixtral-8x7b"))}
    assert by_name["gate"].numel == 8 * 4096 and not by_name["gate"].lora_targetable
    assert by_name["experts.gate_up_proj"].numel == 8 * 2 * 14336 * 4096
    assert by_name["experts.down_proj"].numel == 8 * 4096 * 14336
    assert not by_name["experts.gate_up_proj"].lora_targetable
    targetable = {n for n, lin in by_name.items() if lin.lora_targetable}
    assert targetable == {"q_proj", "k_proj", "v_proj", "o_proj"}
