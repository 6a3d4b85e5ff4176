"""LitGPT's parallel blocks (Phi, StableLM-Alpha's GPT-NeoX, Falcon) in the estimate: the configs bundled for the
published rows, their parameters, and what one of LitGPT's blocks saves for backward, derived by hand from LitGPT's
``model.py``/``lora.py`` and checked against the bytes bench/published/litgpt_layer_probe.py measured on LitGPT's own
block (``--families``, CPU, bf16, B·T = 128)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramledger.analytic.activations import layer_activations
from vramledger.analytic.litgpt import litgpt_layer_extra_bytes_per_token, litgpt_layer_extra_scores_per_seq
from vramledger.analytic.params import count_params
from vramledger.analytic.weights import weight_budget
from vramledger.catalog import resolve_model
from vramledger.catalog.hfconfig import model_spec_from_config
from vramledger.specs import LoraSpec, Method, ModelCode, ModelSpec, Precision, TrainSpec

MODELS = Path(__file__).resolve().parents[2] / "bench" / "published" / "models"


def _model(name: str) -> ModelSpec:
    return resolve_model(str(MODELS / f"{name}.json"))


# -- the configs and their parameters ------------------------------------------------------------------------------
def test_phi_1_5_parameters_by_hand() -> None:
    # PhiForCausalLM: V = 51,200, H = 2,048, I = 8,192, 24 layers. Per layer q/k/v/dense 4·(H² + H), fc1 H·I + I,
    # fc2 I·H + H, one LayerNorm 2H; embedding V·H; final LayerNorm 2H; lm_head V·H + V (its bias).
    H, I, V = 2048, 8192, 51200
    layer = 4 * (H * H + H) + (H * I + I) + (I * H + H) + 2 * H
    expected = V * H + 24 * layer + 2 * H + V * H + V
    assert expected == 1_418_270_720  # the model page's 1.42B
    assert count_params(_model("phi-1_5")) == expected


def test_falcon_published_figures_count_the_tied_head_twice() -> None:
    # Falcon-7B: fused query_key_value H → (71 + 2)·64, dense, 4H MLP, no biases, one LayerNorm; the head is tied.
    H, V = 4544, 65024
    layer = H * 73 * 64 + H * H + 2 * H * 4 * H + 2 * H
    tied = V * H + 32 * layer + 2 * H
    assert count_params(_model("falcon-7b")) == tied == 6_921_720_704
    # The model pages' 7.22B and 41.8B count lm_head.weight stored beside the embedding: V·H more.
    assert f"{(tied + V * H) / 1e9:.2f}B" == "7.22B"
    assert f"{(count_params(_model('falcon-40b')) + V * 8192) / 1e9:.1f}B" == "41.8B"


@pytest.mark.parametrize(
    "name", ["phi-1_5", "phi-2", "stablelm-base-alpha-3b", "stablelm-base-alpha-7b", "falcon-7b", "falcon-40b"]
)
def test_bundled_config_counts_what_transformers_builds(name: str) -> None:
    pytest.importorskip("transformers")
    from vramledger.catalog.inventory import build_meta_model, hf_config_object

    cfg = {k: v for k, v in json.loads((MODELS / f"{name}.json").read_text()).items() if k != "_source"}
    hf = build_meta_model(hf_config_object(cfg, name), where=name)
    built = sum(p.numel() for p in {id(p): p for p in hf.parameters()}.values())
    print(name, "formula", count_params(_model(name)), "meta build", built)
    assert count_params(_model(name)) == built


def test_block_wiring_read_from_the_configs() -> None:
    phi, neox = _model("phi-1_5"), _model("stablelm-base-alpha-3b")
    f7, f40 = _model("falcon-7b"), _model("falcon-40b")
    # Phi: one shared LayerNorm, partial_rotary_factor 0.5 of 64; GPT-NeoX: two norms, rotary_pct 0.25 of 128
    assert (phi.norms_per_layer, phi.shared_block_input, phi.rope_dim, phi.head_bias) == (1, True, 32, True)
    assert (neox.norms_per_layer, neox.parallel_residual, neox.shared_block_input) == (2, True, False)
    assert neox.rope_dim == 32
    # Falcon-7B: multi-query (one key/value head), parallel_attn with one norm; Falcon-40B: 8 kv heads, two norms
    assert (f7.num_kv_heads, f7.norms_per_layer, f7.shared_block_input, f7.intermediate_size) == (1, 1, True, 18176)
    assert (f40.num_kv_heads, f40.norms_per_layer, f40.parallel_residual) == (8, 2, True)


# -- what one of LitGPT's blocks saves -----------------------------------------------------------------------------
def _lora(code: ModelCode, *, seq: int = 1024) -> TrainSpec:
    return TrainSpec(
        method=Method.LORA, precision=Precision.BF16, micro_batch=1, seq_len=seq, packing=True, model_code=code,
        lora=LoraSpec(rank=8, alpha=16, targets=("q_proj", "v_proj"), dropout=0.05, adapter_fp32=False),
    )  # fmt: skip


def _litgpt_per_token(m: ModelSpec, t: TrainSpec) -> int:
    wb = weight_budget(m, t)
    return layer_activations(m, t, wb).per_token + litgpt_layer_extra_bytes_per_token(m, t, wb)


def test_phi_1_5_lora_block_by_hand() -> None:
    # lit-gpt 8641822 Block with LoRA on q and v (dropout 0.05), bf16, per token (H = Dq = 2048, I = 8192):
    H, I, c = 2048, 8192, 2
    norm = c * H + 8  # norm_1 (shared_attention_norm): its input and the fp32 mean and rstd of each row
    dropout = c * H + H  # the one lora_dropout(x) of LoRAQKVLinear: the dropped copy and CUDA's bool mask
    lora_a = c * 2 * 8  # lora_A's output (2 parts of rank 8), kept by lora_B
    zero_pad = c * (H + H)  # index_copy's source: the q and v adapters' output
    sdpa = c * H + c * H + c * 3 * H + c * H + 4 * 32  # q, k (fresh cats), v a view of the whole fused qkv, out, lse
    gelu = c * I  # F.gelu saves its input (the frozen fc's output); frozen proj keeps nothing
    expected = norm + dropout + lora_a + zero_pad + sdpa + gelu
    assert _litgpt_per_token(_model("phi-1_5"), _lora(ModelCode.LIT_GPT_2023)) == expected == 59_560


def test_stablelm_two_norms_save_the_layer_input_once() -> None:
    # GPT-NeoX's parallel block: norm_1(x) and norm_2(x) read the same x, saved once, each with its row stats;
    # against Phi's shared norm the same shapes save 8 bytes more (the second norm's mean and rstd).
    neox = model_spec_from_config(
        {"model_type": "gpt_neox", "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
         "num_hidden_layers": 1, "vocab_size": 64}, name="neox", source="test",
    )  # fmt: skip
    phi = _model("phi-1_5")
    t = _lora(ModelCode.LIT_GPT_2023)
    assert _litgpt_per_token(neox, t) - _litgpt_per_token(phi, t) == 8


def test_falcon_7b_lit_gpt_2023_runs_sdpa_math() -> None:
    # lit-gpt 8641822/c195451d do not expand Falcon-7B's single key/value head, so PyTorch 2.1's SDPA refuses its
    # fused kernels (query and key heads differ) and runs the math kernel: the scaled q, K and V broadcast to the 71
    # heads (copies for bmm), and the 71·L² probabilities, in bf16.
    m, L = _model("falcon-7b"), 1079
    t = _lora(ModelCode.LIT_GPT_2023, seq=L)
    assert litgpt_layer_extra_scores_per_seq(m, t) == 2 * 71 * L * L
    # the same block under litgpt 43c44323 expands K (and V, whose reshape stays a view): no length² term
    assert litgpt_layer_extra_scores_per_seq(m, _lora(ModelCode.LITGPT, seq=L)) == 0
    # Per token, both against the flash path's q, k, v, output and lse: math keeps 3·Dq, no lse, no fused qkv
    wb = weight_budget(m, t)
    attention = 2 * 3 * 4544 + 0
    H, I, c = 4544, 18176, 2
    rest = (c * H + 8) + (c * H + H) + c * 16 + c * (4544 + 64) + c * I
    assert _litgpt_per_token(m, t) == attention + rest
    assert layer_activations(m, t, wb).scores_per_seq == 0  # the transformers formula has none


# The probe's measurements (bench/published/litgpt_layer_probe.py --families, litgpt 43c44323 and lit-gpt 8641822,
# torch 2.13 CPU): bytes per token one block saved, hidden 256, 8 heads of 32, MLP 1024, B·T = 128. The probe's
# analytic figure counts CPU's dropout masks in bf16 (CUDA keeps bool) and, for lit-gpt 2023's multi-query
# attention, the math kernel in fp32 (PyTorch 2.13 upcasts bf16 on CPU); CPU's LayerNorm row stats are bf16 (4 bytes,
# CUDA fp32: 8), and the index_copy of q,v keeps its int64 index (288 or 576 elements per layer, 18-36 B per token).
PROBE = [
    # (commit, family, setup, measured B/token)
    ("43c44323", "phi-1_5", "lora-qv", 7764.1),
    ("43c44323", "phi-1_5", "lora-all", 12884.2),
    ("43c44323", "phi-1_5", "lora-all-nodrop", 8788.2),
    ("43c44323", "phi-1_5", "full", 8740.0),
    ("43c44323", "stablelm-alpha", "lora-qv", 7768.1),
    ("43c44323", "stablelm-alpha", "full", 9256.0),
    ("43c44323", "falcon-7b", "lora-qv", 6406.1),
    ("43c44323", "falcon-7b", "full", 7844.0),
    ("43c44323", "falcon-40b", "lora-all", 11864.2),
    ("43c44323", "falcon-40b", "full", 8232.0),
    ("8641822", "phi-1_5", "lora-qv", 7764.1),
    ("8641822", "stablelm-alpha", "lora-all", 12888.2),
    ("8641822", "falcon-7b", "lora-qv", 9318.1),
    ("8641822", "falcon-7b", "lora-all", 14900.2),
]


@pytest.mark.parametrize(("commit", "family", "setup", "measured"), PROBE, ids=[f"{p[0]}-{p[1]}-{p[2]}" for p in PROBE])
def test_litgpt_block_against_the_probe(commit: str, family: str, setup: str, measured: float) -> None:
    import sys

    sys.path.insert(0, str(MODELS.parent))
    from litgpt_layer_probe import analytic_family  # bench/published: the probe's own CPU-adjusted figure

    code = "litgpt" if commit == "43c44323" else "lit-gpt-2023"
    lora = setup != "full"
    per_token, per_seq = analytic_family(
        code, family, lora=lora, all_targets=setup.startswith("lora-all"), dropout=0.0 if "nodrop" in setup else 0.05
    )
    got = per_token + per_seq * 2 / 128
    stats = 2 if family in ("phi-1_5", "falcon-7b") else 3  # LayerNorms of the block beside the final one
    print(commit, family, setup, "estimate (CPU terms)", got, "measured", measured)
    # within the int64 index of index_copy (at most 36 B per token) and CPU's smaller row stats
    assert abs(got - measured) <= 36 + 4 * stats
