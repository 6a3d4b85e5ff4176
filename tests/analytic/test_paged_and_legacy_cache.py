"""Paged optimizer states (CUDA managed memory), bitsandbytes' saved 4-bit inputs and the legacy KV cache, each
against a hand derivation from the upstream code named in the module it tests."""

from __future__ import annotations

from dataclasses import replace

from vramledger.analytic import estimate
from vramledger.analytic.activations import quantised_inputs_bytes
from vramledger.analytic.inference import InferSpec, infer_ledger
from vramledger.analytic.weights import weight_budget
from vramledger.catalog import resolve_gpu, resolve_model
from vramledger.ledger import Category, Phase
from vramledger.specs import (
    Attention,
    CacheKind,
    DType,
    LoraSpec,
    Method,
    ModelCode,
    Optimizer,
    Precision,
    QuantSpec,
    TrainSpec,
)


def test_paged_states_are_managed_memory_outside_allocated_and_reserved() -> None:
    # bitsandbytes get_state_buffer: PagedAdamW (32-bit) keeps exp_avg and exp_avg_sq as fp32 paged buffers,
    # 8 bytes per trainable parameter, from cudaMallocManaged: never seen by max_memory_allocated/reserved.
    m = resolve_model("llama-3.2-1b")
    t = TrainSpec(
        method=Method.FULL, precision=Precision.BF16, optimizer=Optimizer.PAGED_ADAMW_32BIT, micro_batch=1, seq_len=512
    )
    paged = estimate(m, t, gpu=resolve_gpu("a10g"))
    # An optimizer that allocates nothing through torch (SGD without momentum) gives the same allocated bytes.
    stateless = estimate(m, replace(t, optimizer=Optimizer.SGD), gpu=resolve_gpu("a10g"))
    P = weight_budget(m, t).trainable_params
    for ph in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER):
        assert paged.bytes_of(Category.MANAGED_MEMORY, ph) == 8 * P
        assert paged.bytes_of(Category.OPTIMIZER_STATE, ph) == 0
        assert paged.allocated(ph) == stateless.allocated(ph)
        assert paged.device(ph) == (paged.reserved(ph) + paged.bytes_of(Category.CUDA_CONTEXT, ph) + 8 * P)
    assert paged.bytes_of(Category.MANAGED_MEMORY, Phase.LOAD) == 0  # created at the first step
    assert any("managed memory" in w for w in paged.warnings)


def test_paged_8bit_states() -> None:
    # Optimizer2State with optim_bits=8: two uint8 states + one fp32 absmax per 256 elements (blockwise).
    # get_state_buffer pages only tensors of 1e5 elements or more: rank-16 q/v adapters of Llama-3.2-1B (lora_A
    # 16×2048, lora_B 2048×16 and 512×16) are all smaller, so every state is an ordinary device tensor.
    m = resolve_model("llama-3.2-1b")
    qv = ("q_proj", "v_proj")
    t = TrainSpec(method=Method.LORA, optimizer=Optimizer.PAGED_ADAMW_8BIT, lora=LoraSpec(rank=16, targets=qv))
    P = weight_budget(m, t).trainable_params
    led = estimate(m, t)
    assert led.bytes_of(Category.MANAGED_MEMORY, Phase.OPTIMIZER) == 0
    assert led.bytes_of(Category.OPTIMIZER_STATE, Phase.OPTIMIZER) == 2 * (P + 4 * -(-P // 256))
    # Rank 64: lora_A 64×2048 = 131,072 elements (paged), lora_B 2048×64 (paged) and 512×64 (not): the states
    # split in proportion to those parameters.
    t64 = replace(t, lora=LoraSpec(rank=64, targets=qv))
    P64 = weight_budget(m, t64).trainable_params
    states = 2 * (P64 + 4 * -(-P64 // 256))
    device_params = m.num_layers * 512 * 64
    led = estimate(m, t64)
    assert led.bytes_of(Category.OPTIMIZER_STATE, Phase.OPTIMIZER) == states * device_params // P64
    assert led.bytes_of(Category.MANAGED_MEMORY, Phase.OPTIMIZER) == states - states * device_params // P64


# Llama-2-7B QLoRA, bf16, LoRA q,v with dropout, eager attention: the setup of the two MatMul4Bit tests below
_QLORA_QV = TrainSpec(
    method=Method.QLORA,
    precision=Precision.BF16,
    attn=Attention.EAGER,
    lora=LoraSpec(rank=8, targets=("q_proj", "v_proj"), dropout=0.05, adapter_fp32=False),
)


def test_bitsandbytes_before_0_43_2_keeps_matmul4bit_inputs() -> None:
    # bitsandbytes 0.42.0 MatMul4Bit.forward: ctx.tensors = (A, B) whenever an input needs grad, which LitGPT's
    # QLoRA ran (model_code litgpt). Llama-2-7B, bf16, LoRA q,v with dropout (the adapters keep dropped copies,
    # not A itself), eager attention: the attention input (H), o_proj's input (Dq), the MLP input (H) and
    # down_proj's input (I) stay alive, 2 bytes each, per token and layer. With SDPA o_proj's input is the
    # kernel's own saved output, so Dq drops out.
    m = resolve_model("llama-2-7b")
    t = replace(_QLORA_QV, model_code=ModelCode.LITGPT)
    assert quantised_inputs_bytes(m, t, weight_budget(m, t)) == 2 * (4096 + 4096 + 4096 + 11008)
    sdpa = replace(t, attn=Attention.SDPA)
    assert quantised_inputs_bytes(m, sdpa, weight_budget(m, sdpa)) == 2 * (4096 + 4096 + 11008)
    # Without dropout and with bf16 adapters, q/v's lora_A keeps the very attention input: counted once.
    same = replace(t, lora=replace(t.lora, dropout=0.0))  # type: ignore[arg-type]
    assert quantised_inputs_bytes(m, same, weight_budget(m, same)) == 2 * (4096 + 4096 + 11008)


def test_bitsandbytes_today_keeps_no_matmul4bit_input() -> None:
    # bitsandbytes >= 0.43.2 (9e753741, #1270; 0.50.2 autograd/_functions.py: ctx.tensors = (None, B)): a frozen
    # 4-bit linear saves what a frozen nn.Linear saves, nothing. So the transformers + PEFT QLoRA step saves the
    # same activations as LoRA over a bf16 base, and 8-bit (MatMul8bitLt) likewise.
    m = resolve_model("llama-2-7b")
    t = _QLORA_QV
    lora_only = replace(t, method=Method.LORA, quant=None)
    saved = estimate(m, lora_only).bytes_of(Category.ACTIVATIONS, Phase.FORWARD)
    assert estimate(m, t).bytes_of(Category.ACTIVATIONS, Phase.FORWARD) == saved
    assert estimate(m, replace(t, quant=QuantSpec(bits=8))).bytes_of(Category.ACTIVATIONS, Phase.FORWARD) == saved


def test_legacy_cache_holds_the_previous_tuple_while_decoding() -> None:
    # Llama-2-13B, fp16, batch 16, 512 + 512 tokens. K and V per token per layer: 2 · 40 heads · 128 · 2 bytes.
    # Dynamic: S = 1023 cached tokens + one layer's old K/V (1022 tokens). Legacy (transformers < 4.36): the
    # previous step's whole tuple (1022 tokens in every layer) beside the new one.
    m = resolve_model("llama-2-13b")
    spec = InferSpec(batch=16, prompt=512, new_tokens=512, dtype=DType.FP16)
    per_tok_layer = 2 * 40 * 128 * 2 * 16
    cache = 40 * 1023 * per_tok_layer
    dyn = infer_ledger(m, spec)
    leg = infer_ledger(m, replace(spec, cache=CacheKind.LEGACY))
    g = Phase.GENERATE
    assert dyn.bytes_of(Category.KV_CACHE, g) == cache == leg.bytes_of(Category.KV_CACHE, g)
    assert leg.bytes_of(Category.TEMPORARIES, g) == 40 * 1022 * per_tok_layer
    assert dyn.bytes_of(Category.TEMPORARIES, g) == 1023 * per_tok_layer
    assert leg.settings["cache"] == "legacy" and dyn.settings["cache"] == "dynamic"
    labels = " ".join(i.label for i in leg.items)
    assert "legacy tuple cache" in labels and "DynamicCache" in " ".join(i.label for i in dyn.items)


def test_legacy_prefill_computes_every_prompt_logit() -> None:
    # Before logits_to_keep, the prefill's lm_head ran on all P prompt tokens and upcast to fp32: (c+4)·B·P·V.
    m = resolve_model("llama-2-7b")
    spec = InferSpec(batch=8, prompt=2048, new_tokens=1, dtype=DType.BF16, cache=CacheKind.LEGACY)
    led = infer_ledger(m, spec)
    assert led.bytes_of(Category.LOGITS_LOSS, Phase.GENERATE) == (2 + 4) * 8 * 2048 * 32000


def test_eval_generation_says_which_cache() -> None:
    m = resolve_model("llama-3.2-1b")
    t = TrainSpec(
        method=Method.LORA,
        micro_batch=1,
        seq_len=512,
        eval_batch=8,
        predict_with_generate=True,
        generation_max_new_tokens=2048,
    )
    dyn, leg = estimate(m, t), estimate(m, replace(t, generation_cache=CacheKind.LEGACY))
    g = Phase.GENERATE
    assert any("DynamicCache" in i.label for i in dyn.items if i.phase is g)
    # 8 × (512 + 2047) cached tokens: the legacy decode step holds the previous tuple too.
    cache = dyn.bytes_of(Category.KV_CACHE, g)
    assert leg.bytes_of(Category.TEMPORARIES, g) - dyn.bytes_of(Category.TEMPORARIES, g) > 0.9 * cache
