"""A frozen base loaded in fp32 under bf16 autocast (TRL's default ``dtype: float32``): the casts autograd keeps.

torch's autocast casts a frozen fp32 weight at every matmul (autocast_mode.cpp ``cached_cast`` caches only leaves
that require grad), and the cast lives as long as autograd saves it: ``mm`` saves its weight for the input's gradient
only when the input requires grad. Under checkpointing a decoder layer saves nothing in forward, so only lm_head's
cast (outside the checkpoints) stays, and one layer's casts come back in its recompute. Checked here against the
real transformers/PEFT step traced on fake tensors under ``torch.autocast`` (trace/build.py builds the base in
``base_dtype``), and against byte counts derived by hand from Llama-3.2-1B's shapes.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from vramledger.analytic import estimate
from vramledger.analytic.parts import SOURCES
from vramledger.analytic.step import step_parts
from vramledger.catalog import resolve_model
from vramledger.catalog.config_of import config_of
from vramledger.catalog.hfconfig import model_spec_from_config
from vramledger.ledger import Category, Ledger, Phase
from vramledger.specs import DType, LoraSpec, Method, ModelSpec, TrainSpec

# Llama-3.2-1B (config.json): H 2048, 32 heads of 64 (Dq 2048), 8 KV heads (Dkv 512), I 8192, vocab 128256, tied.
H, Dq, Dkv, I, V, dh = 2048, 2048, 512, 8192, 128256, 64
LAYER_LINEARS = H * Dq + 2 * H * Dkv + Dq * H + 3 * H * I
"""q, k, v, o, gate, up, down weights of one decoder layer: 60,817,408 elements."""
R = 16
QV_ADAPTERS = R * (H + Dq) + R * (H + Dkv)
"""LoRA A and B of q_proj and v_proj (rank 16) in one layer."""
ALL_ADAPTERS = R * ((H + Dq) + 2 * (H + Dkv) + (Dq + H) + 3 * (H + I))
"""LoRA A and B of all seven linears (rank 16) in one layer."""
CAST = 2  # bf16 bytes per weight element
QV = LoraSpec(rank=R, targets=("q_proj", "v_proj"))
FP32_LORA = TrainSpec(method=Method.LORA, lora=QV, micro_batch=1, seq_len=128, packing=True, base_dtype=DType.FP32)
"""LoRA r16 on q and v, bf16 autocast over a base loaded in fp32, one packed sequence of 128 tokens."""


def _two_layers(vocab: int) -> tuple[ModelSpec, dict[str, object]]:
    """Llama-3.2-1B's shapes with two decoder layers (so the trace takes seconds)."""
    cfg = {**config_of(resolve_model("llama-3.2-1b")), "num_hidden_layers": 2, "vocab_size": vocab}
    cfg.update(bos_token_id=None, eos_token_id=None)  # the real ids are outside a reduced vocabulary
    return model_spec_from_config(cfg, name=f"llama-3.2-1b-2layers-v{vocab}", source="test"), cfg


def _casts(ledger: Ledger, phase: Phase) -> int:
    """Bytes of autocast's weight copies at the phase's peak: the trace's line, or the estimate's lines."""
    return sum(
        i.bytes
        for i in ledger.items
        if i.phase is phase
        and i.category is Category.WEIGHTS
        and (i.source == SOURCES["autocast"] or i.label.startswith("autocast copies"))
    )


# (id, vocab, grad_ckpt, the casts alive at backward's peak moment derived by hand)
CASES = [
    # No checkpointing, the log-softmax backward: lm_head's cast (the tied embedding matrix, cast for lm_head's
    # matmul, saved because the final hidden state needs a gradient); layer 0 reads the frozen embedding's output,
    # which needs no gradient, so q/k/v's casts are not saved (q and v's adapter outputs make o_proj's input need
    # one); every cast of layer 1; the adapters' cached copies in both layers.
    (
        "no-ckpt",
        V,
        False,
        V * H * CAST + (Dq * H + 3 * H * I) * CAST + LAYER_LINEARS * CAST + 2 * QV_ADAPTERS * CAST,
    ),
    # Checkpointing, the log-softmax backward: lm_head's cast only (the autocast cache of the adapters died when
    # forward's autocast exited; no layer saved a cast).
    ("ckpt-loss", V, True, V * H * CAST),
    # Checkpointing with a small vocabulary, so the top layer's recomputed backward is the peak: one layer's casts
    # and its adapters' copies, made again by the recompute's autocast; lm_head's is freed by then.
    ("ckpt-top-layer", 8000, True, LAYER_LINEARS * CAST + QV_ADAPTERS * CAST),
]


@pytest.mark.parametrize(("vocab", "ckpt", "hand"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_estimate_and_trace_agree_on_an_fp32_base(vocab: int, ckpt: bool, hand: int) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from vramledger.trace import trace_step

    model, cfg = _two_layers(vocab)
    spec = replace(FP32_LORA, grad_ckpt=ckpt)
    traced, analytic = trace_step(model, spec, config=cfg), estimate(model, spec)
    t_casts, a_casts = _casts(traced, Phase.BACKWARD), _casts(analytic, Phase.BACKWARD)
    print(f"casts: hand {hand:,} trace {t_casts:,} estimate {a_casts:,}")
    print(f"peak allocated: trace {traced.peak_allocated:,} estimate {analytic.peak_allocated:,}")
    print(f"moments: trace {traced.moments[Phase.BACKWARD]!r} estimate {analytic.moments[Phase.BACKWARD]!r}")
    # The trace rounds each storage to 512 B and its backward peak may fall an op away from the estimate's moment:
    # 1 MiB of slack, under 1% of the smallest cast figure here.
    assert abs(t_casts - hand) <= 2**20
    assert abs(a_casts - hand) <= 2**20
    # The whole step within 1% (counting every frozen matrix's cast, as before, was 5-30% over here).
    assert abs(analytic.peak_allocated - traced.peak_allocated) <= 0.01 * traced.peak_allocated


@pytest.mark.parametrize("arch", ["phi3", "gpt2", "gemma2"])
def test_other_layouts_without_checkpointing(arch: str) -> None:
    # Fused qkv_proj / gate_up_proj (Phi-3), GPT-2's Conv1D layers and learned positions, Gemma 2's scaled embedding
    # and soft-capped eager attention: the saved casts (and the uncast ones of layer 0) follow each layout. The small
    # configs of the trace cross-check, LoRA r16 on every linear, without checkpointing.
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from tests.trace.test_crosscheck import CONFIGS
    from vramledger.specs import Attention
    from vramledger.trace import trace_step

    cfg = CONFIGS[arch]
    model = model_spec_from_config(cfg, name=f"tiny-{arch}", source="test")
    attn = Attention.EAGER if model.attn_logit_softcapping else Attention.SDPA
    spec = replace(FP32_LORA, lora=LoraSpec(rank=R), attn=attn)
    traced, analytic = trace_step(model, spec, config=cfg), estimate(model, spec)
    t_casts, a_casts = _casts(traced, Phase.FORWARD), _casts(analytic, Phase.FORWARD)
    print(f"casts at the loss: trace {t_casts:,} estimate {a_casts:,}")
    print(f"peak allocated: trace {traced.peak_allocated:,} estimate {analytic.peak_allocated:,}")
    assert abs(t_casts - a_casts) <= 64 * 1024
    assert abs(analytic.peak_allocated - traced.peak_allocated) <= 0.01 * traced.peak_allocated


def test_litgpt_chunked_head_saves_a_cast_per_chunk() -> None:
    # LitGPT's LoRA loop (lit-gpt 8641822, published row 70: bf16-mixed over an fp32 base) calls
    # model(input_ids, lm_head_chunk_size=128), and GPT.forward runs lm_head on each 128-position chunk: every call
    # casts the frozen fp32 head anew and autograd saves each cast (the chunk's input needs a gradient). The trace's
    # chunked loss (trace/step.py chunked_loss) calls lm_head the same way, on transformers' layers.
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from vramledger.specs import Loss, ModelCode
    from vramledger.trace import trace_step

    model, cfg = _two_layers(V)
    L, chunk = 384, 128
    spec = replace(FP32_LORA, seq_len=L, loss=Loss.CHUNKED, loss_chunk_tokens=chunk)
    litgpt = estimate(model, replace(spec, model_code=ModelCode.LIT_GPT_2023))
    traced = trace_step(model, spec, config=cfg)
    # 3 lm_head casts, then the decoder's as in the no-ckpt case above (q/k/v of layer 0 unsaved) and the adapters'.
    hand = (L // chunk) * V * H * CAST + (Dq * H + 3 * H * I) * CAST + LAYER_LINEARS * CAST + 2 * QV_ADAPTERS * CAST
    t_casts, a_casts = _casts(traced, Phase.FORWARD), _casts(litgpt, Phase.FORWARD)
    print(f"casts at the loss: hand {hand:,} trace {t_casts:,} estimate (lit-gpt-2023) {a_casts:,}")
    assert a_casts == hand
    assert abs(t_casts - hand) <= 2**20


def test_fp32_minus_bf16_base_under_checkpointing_by_hand() -> None:
    # Llama-3.2-1B, LoRA r16 on all linears, bf16 autocast, checkpointing, 1 × 1024 tokens: the base loaded in
    # fp32 against bf16. The backward peak is the log-softmax backward in both.
    m = resolve_model("llama-3.2-1b")
    L, T = 16, 1024
    bf16 = TrainSpec(method=Method.LORA, seq_len=T, grad_ckpt=True)
    fp32 = TrainSpec(method=Method.LORA, seq_len=T, grad_ckpt=True, base_dtype=DType.FP32)
    a, b = estimate(m, bf16), estimate(m, fp32)
    # Parameters: embedding V·H + 16 × (linears + two norms 2H) + final norm H = 1,235,814,400 (Meta's 1.23B).
    n = V * H + L * (LAYER_LINEARS + 2 * H) + H
    assert n == 1_235_814_400
    expected = (
        n * (4 - 2)  # every frozen weight in fp32 instead of bf16
        + V * H * CAST  # lm_head's bf16 cast, saved by autograd (lm_head is outside the checkpoints)
        # The fp32 embedding is looked up, never cast, so the residual stream is fp32: each checkpointed layer input
        # (L·T·H) takes 4 bytes instead of 2,
        + L * T * H * (4 - 2)
        # and so do RoPE's cos and sin (T × dh each), which LlamaRotaryEmbedding returns in the hidden states' dtype.
        + 2 * T * dh * (4 - 2)
    )
    got = b.allocated(Phase.BACKWARD) - a.allocated(Phase.BACKWARD)
    print(f"expected {expected:,} got {got:,} (moment: {b.moments[Phase.BACKWARD]})")
    assert "log-softmax" in b.moments[Phase.BACKWARD] and "log-softmax" in a.moments[Phase.BACKWARD]
    assert got == expected
    # The top layer's recompute (in backward) casts one layer's seven frozen matrices again, beside its adapters'
    # cached copies: 60,817,408 + 44,032 × 16 elements in bf16. Not every layer's: that was the over-count.
    assert step_parts(m, fp32).recompute_cast_bytes == (LAYER_LINEARS + ALL_ADAPTERS) * CAST


# PEFT's 70B guides (docs/source/accelerate/fsdp.md and deepspeed.md, examples/sft at peft aa2ca83ca): the script
# loads Llama-2-70B with no torch_dtype, so in fp32, and trains LoRA r8 on all linears with --bf16 on 8 GPUs.
PEFT_70B = TrainSpec(
    method=Method.LORA,
    lora=LoraSpec(rank=8, alpha=16, dropout=0.1),
    micro_batch=8,
    seq_len=2048,
    grad_accum=4,
    grad_ckpt=True,
    packing=True,
    world_size=8,
)


def test_fsdp_keeps_an_fp32_shard_and_casts_nothing() -> None:
    # FSDP1 FULL_SHARD under accelerate's MixedPrecision(bf16): the flat parameters keep the dtype they were loaded
    # in, so rank 0 holds 1/8 of the fp32 base; the units are all-gathered as bf16 copies, so autocast finds bf16
    # weights and casts none, and everything but the shard is what a bf16 base gives.
    from vramledger.specs import Sharding

    m = resolve_model("llama-2-70b")
    # Llama-2-70B: embedding and lm_head 32000 × 8192 each (untied); per layer q, o 8192², k, v 8192 × 1024, the MLP
    # 3 × 8192 × 28672 and two norms; 80 layers and the final norm: 68,976,648,192 (the count on its model card).
    per_layer = 2 * 8192**2 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192
    n = 2 * 32000 * 8192 + 80 * per_layer + 8192
    assert n == 68_976_648_192
    fsdp = replace(PEFT_70B, fsdp=Sharding.FULL_SHARD, fsdp_version=1)
    a, b = estimate(m, fsdp), estimate(m, replace(fsdp, base_dtype=DType.FP32))
    for phase in (Phase.LOAD, Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER):
        got = b.allocated(phase) - a.allocated(phase)
        print(phase.value, f"expected {n * (4 - 2) // 8:,} got {got:,}")
        assert got == n * (4 - 2) // 8
    assert not [i.label for i in b.items if i.category is Category.WEIGHTS and "cast" in i.label]


def test_zero3_init_makes_an_fp32_base_bf16() -> None:
    # DeepSpeed ZeRO-3 under the HF Trainer: zero.Init creates every parameter in the config's dtype, bf16 here
    # (runtime/zero/partition_parameters.py Init._set_dtype), whatever from_pretrained was asked for.
    m = resolve_model("llama-2-70b")
    zero3 = replace(PEFT_70B, zero_stage=3)
    a, b = estimate(m, zero3), estimate(m, replace(zero3, base_dtype=DType.FP32))
    assert [(i.label, i.phase, i.bytes) for i in b.items] == [(i.label, i.phase, i.bytes) for i in a.items]


def test_fsdp1_trace_agrees_on_an_fp32_base() -> None:
    # The real FullyShardedDataParallel on a fake process group (trace/distributed.py), rank 0 of 2, with the HF
    # Trainer's wrap policy (PEFT's fsdp_auto_wrap_policy: every lora_A/lora_B in a unit of its own) and
    # MixedPrecision(bf16), over a small Llama loaded in fp32 with fp32 adapters.
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from vramledger.specs import Sharding
    from vramledger.trace import trace_step

    h, inter, kv, vocab, layers, r = 512, 1376, 128, 8000, 2, 16
    cfg = {
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
    }
    model = model_spec_from_config(cfg, name="small-llama", source="test")
    spec = replace(
        FP32_LORA,
        lora=LoraSpec(rank=r),
        grad_ckpt=True,
        world_size=2,
        fsdp=Sharding.FULL_SHARD,
        fsdp_version=1,
    )
    traced, analytic = trace_step(model, spec, config=cfg), estimate(model, spec)
    # Base: embedding and lm_head V·H, per layer q, o H², k, v H·Dkv, MLP 3·H·I, two norms; final norm.
    base = 2 * vocab * h + layers * (2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h) + h
    # Adapters: rank r on q, k, v, o, gate, up, down of every layer, A and B.
    adapters = layers * r * ((h + h) + 2 * (h + kv) + (h + h) + 3 * (h + inter))
    shard = (base + adapters) * 4 // 2  # fp32, half on rank 0
    grads = adapters * 4 // 2  # the adapters' sharded fp32 gradients only: no frozen element in their units
    t_load, a_load = traced.bytes_of(Category.WEIGHTS, Phase.LOAD), analytic.bytes_of(Category.WEIGHTS, Phase.LOAD)
    t_grad = traced.bytes_of(Category.GRADIENTS, Phase.OPTIMIZER)
    a_grad = analytic.bytes_of(Category.GRADIENTS, Phase.OPTIMIZER)
    print(f"weights at load: hand {shard:,} trace {t_load:,} estimate {a_load:,}")
    print(f"gradients in the step: hand {grads:,} trace {t_grad:,} estimate {a_grad:,}")
    print(f"peak allocated: trace {traced.peak_allocated:,} estimate {analytic.peak_allocated:,}")
    assert a_load == shard and abs(t_load - shard) <= 64 * 1024  # the trace rounds and pads each flat shard
    assert a_grad == grads and abs(t_grad - grads) <= 64 * 1024
    # No weight is cast (the all-gathered copies are bf16 already): the only bf16 copies the trace files as casts are
    # MixedPrecision's buffer_dtype copies of the RoPE inv_freq buffers (2 × 32 elements, one 512 B block each).
    assert _casts(traced, Phase.BACKWARD) <= 2 * 512
    assert abs(analytic.peak_allocated - traced.peak_allocated) <= 0.01 * traced.peak_allocated
