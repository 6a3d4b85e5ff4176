"""LitGPT's QLoRA under Lightning's BitsandbytesPrecision (analytic/litgpt_qlora.py): the autograd rule it rests
on, checked on torch itself, and each byte count derived by hand from the upstream code."""

import weakref
from dataclasses import replace
from typing import Any

import pytest
import torch

from vramledger.analytic import estimate
from vramledger.analytic.inference import InferSpec, infer_ledger
from vramledger.analytic.litgpt_qlora import dequant_transient_bytes, next_forward_moment, retained_inputs_bytes
from vramledger.analytic.step import moments, step_parts
from vramledger.analytic.weights import quantised_bytes, weight_budget
from vramledger.catalog.hfconfig import model_spec_from_config
from vramledger.ledger import Phase
from vramledger.specs import (
    DType,
    LoraSpec,
    Loss,
    Method,
    ModelCode,
    Optimizer,
    Precision,
    QuantSpec,
    TrainSpec,
)

# A small Llama: H=256, I=688, 8 heads of 32 (Dq = H), 2 KV heads, vocab 1000, 3 layers, untied.
LLAMA = model_spec_from_config(
    {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "num_hidden_layers": 3,
        "vocab_size": 1000,
        "tie_word_embeddings": False,
    },
    name="small-llama",
    source="test",
)
H, I, V, L = 256, 688, 1000, 3


def _qlora(code: ModelCode, **kw: Any) -> TrainSpec:
    base = dict(
        method=Method.QLORA,
        precision=Precision.BF16,
        optimizer=Optimizer.PAGED_ADAMW_32BIT,
        micro_batch=2,
        seq_len=512,
        grad_accum=4,
        loss=Loss.CHUNKED,
        loss_chunk_tokens=128,
        packing=True,
        lora=LoraSpec(rank=8, alpha=16, targets=("q_proj", "v_proj"), dropout=0.05, adapter_fp32=False),
        quant=QuantSpec(bits=4, quant_type="nf4", double_quant=False),
        model_code=code,
    )
    base.update(kw)
    return TrainSpec(**base)  # type: ignore[arg-type]


# -- the autograd rule: bitsandbytes 0.42.0 MatMul4Bit keeps A in ctx.tensors, which autograd never releases ----
class _KeepsInCtx(torch.autograd.Function):
    """bitsandbytes 0.42.0 autograd/_functions.py MatMul4Bit, its storage of A and B verbatim."""

    @staticmethod
    def forward(ctx: Any, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.linear(A, B)
        if any(ctx.needs_input_grad[:2]):
            ctx.tensors = (A, B)
        else:
            ctx.tensors = (None, None)
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        _, B = ctx.tensors
        return grad_output @ B, None


class _SavesForBackward(torch.autograd.Function):
    """The same matmul saving A and B with save_for_backward (freed after the node's backward)."""

    @staticmethod
    def forward(ctx: Any, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(A, B)
        return torch.nn.functional.linear(A, B)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        _, B = ctx.saved_tensors
        return grad_output @ B, None


def _alive_after_backward(fn: Any) -> tuple[bool, bool]:
    """LitGPT's loop on one linear: (A alive after backward while `logits` is held, A alive once it is rebound)."""
    x = torch.randn(4, 8, requires_grad=True)
    W = torch.randn(8, 8)
    hidden = x * 2  # the linear's input, an activation
    ref = weakref.ref(hidden)
    logits = [fn.apply(hidden, W)]  # litgpt: logits = model(input_ids, lm_head_chunk_size=128)
    del hidden
    loss = logits[0].sum()
    loss.backward()
    loss = loss.item()  # litgpt: loss = running_loss.compute().item() at every log
    held = ref() is not None
    logits = []  # the next micro-step's `logits = model(...)` returns
    return held, ref() is not None


@pytest.mark.parametrize(
    ("fn", "expected"),
    [(_KeepsInCtx, (True, False)), (_SavesForBackward, (False, False))],
    ids=["ctx.tensors (bitsandbytes < 0.43.2)", "save_for_backward"],
)
def test_input_outlives_backward_only_through_ctx_attributes(fn: Any, expected: tuple[bool, bool]) -> None:
    got = _alive_after_backward(fn)
    print("expected", expected, "got", got)
    assert got == expected


# -- byte counts derived by hand ---------------------------------------------------------------------------------
def test_lm_head_quantised_only_under_lightning() -> None:
    # LitGPT: lm_head is a 4-bit _Linear4bit too: V·H bf16 (2 B) become V·H/2 packed + one fp32 absmax per 64.
    head_nf4 = V * H // 2 + 4 * (V * H // 64)
    assert quantised_bytes(V * H, V, QuantSpec(bits=4, quant_type="nf4", double_quant=False)) == head_nf4
    lit = weight_budget(LLAMA, _qlora(ModelCode.LITGPT)).frozen_bytes
    hf = weight_budget(LLAMA, _qlora(ModelCode.TRANSFORMERS)).frozen_bytes
    print("expected", 2 * V * H - head_nf4, "got", hf - lit)
    assert hf - lit == 2 * V * H - head_nf4


@pytest.mark.parametrize(
    ("code", "compute", "expected_per_element"),
    [
        (ModelCode.LITGPT, DType.BF16, 2 + 2),  # fp16 dequantised copy + its bf16 cast
        (ModelCode.LIT_GPT_2023, DType.FP16, 2),  # .to(fp16) of an fp16 tensor is the tensor itself
        (ModelCode.TRANSFORMERS, DType.BF16, 2),  # state in the weight's dtype: one copy
        (ModelCode.TRANSFORMERS, DType.FP32, 4),
    ],
)
def test_dequantised_weight(code: ModelCode, compute: DType, expected_per_element: int) -> None:
    assert dequant_transient_bytes(1000, compute, code) == 1000 * expected_per_element


def test_previous_inputs_by_hand() -> None:
    # Per token, c = 2: each layer's quantised linears read the attention input (H), o_proj's input (Dq = H), the MLP
    # input (H) and down's input (I); layer 0's attention input needs no grad (frozen embedding and norm); lm_head
    # reads the final norm's output (H). T = 2·512.
    T = 1024
    expected = 2 * T * ((L - 1) * (H + H + H + I) + (H + H + I) + H)
    got = retained_inputs_bytes(LLAMA, _qlora(ModelCode.LITGPT), T, embedding_trainable=False)
    print("expected", expected, "got", got)
    assert got == expected
    assert retained_inputs_bytes(LLAMA, _qlora(ModelCode.TRANSFORMERS), T, embedding_trainable=False) == 0


def test_next_forward_moment_lines_by_hand() -> None:
    t = _qlora(ModelCode.LITGPT)
    p = step_parts(LLAMA, t)
    fwd = next_forward_moment(LLAMA, t, p, grads=p.grad_bytes)  # accumulation (4): the gradients are kept
    assert fwd is not None
    T = t.tokens

    def line(label: str) -> int:
        return sum(i.bytes for i in fwd.items if i.label.startswith(label))

    print(fwd.name, [(i.label, i.bytes) for i in fwd.items])
    assert line("previous micro-step's inputs") == retained_inputs_bytes(LLAMA, t, T, embedding_trainable=False)
    assert line("logits chunks of this micro-step") == 2 * V * T
    # the previous micro-step's logits: the fp32 list of Fabric's convert_output (tests/analytic/test_litgpt_loop.py)
    assert line("LitGPT's fp32 logits") == 4 * V * T
    assert line("lm_head dequantised") == (2 + 2) * V * H
    # A moment later convert_output holds this micro-step's bf16 logits and their fp32 copy instead of the head.
    forward = moments(LLAMA, t)[Phase.FORWARD]
    assert "convert_output" in forward.name
    assert forward.total - fwd.total == (2 + 4) * V * T - 2 * V * T - (2 + 2) * V * H


def test_transformers_qlora_is_unchanged() -> None:
    # The HF Trainer drops the graph with the loss after each step: no previous-graph moment, lm_head bf16.
    t = _qlora(ModelCode.TRANSFORMERS)
    led = estimate(LLAMA, t)
    assert all("previous micro-step" not in i.label for i in led.items)
    assert "previous micro-step" not in moments(LLAMA, t)[Phase.FORWARD].name


def test_litgpt_generate_prefill_dequantises_lm_head() -> None:
    # LitGPT's generate/base.py: the prompt's lm_head matmul (6 tokens: not the gemv path) dequantises the 4-bit
    # V·H head into fp16 and casts it to bf16: 4·V·H; transformers keeps lm_head bf16 and dequantises the largest
    # decoder linear (gate/up/down, H·I) once, in bf16.
    q = QuantSpec(bits=4, quant_type="nf4", double_quant=False)
    lit = InferSpec(batch=1, prompt=6, new_tokens=50, quant=q, model_code=ModelCode.LIT_GPT_2023)
    hf = replace(lit, model_code=ModelCode.TRANSFORMERS)

    def dequant(spec: InferSpec) -> int:
        led = infer_ledger(LLAMA, spec)
        return sum(i.bytes for i in led.items if i.phase is Phase.GENERATE and "dequantised" in i.label)

    assert dequant(lit) == 4 * V * H
    assert dequant(hf) == 2 * H * I


# -- paged optimizers: bitsandbytes keeps the states of tensors under 1e5 elements on the device -----------------
def test_paged_states_of_small_adapter_tensors_stay_on_the_device() -> None:
    from vramledger.analytic.step import step_parts

    # Rank 8 on q (256→256) and v (256→64): lora_A 8×256 = 2048, lora_B 256×8 / 64×8: every tensor is far below
    # 1e5 elements, so PagedAdamW's two fp32 states (8 B per parameter) are all ordinary device tensors.
    t = _qlora(ModelCode.TRANSFORMERS)
    P = L * (8 * (H + H) + 8 * (H + 64))
    p = step_parts(LLAMA, t)
    print("expected", 8 * P, "got", p.state_bytes, p.paged_state_bytes)
    assert (p.state_bytes, p.paged_state_bytes) == (8 * P, 0)

    # A 4096-wide model at rank 32: lora_A 32×4096 = 131,072 and lora_B 4096×32 are paged; v's lora_B (1024×32 =
    # 32,768, GQA with 8 K/V heads of 128) is not.
    big = model_spec_from_config(
        {
            "model_type": "llama",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "num_hidden_layers": 2,
            "vocab_size": 1000,
            "tie_word_embeddings": False,
        },
        name="wide-llama",
        source="test",
    )
    lora = LoraSpec(rank=32, alpha=16, targets=("q_proj", "v_proj"), dropout=0.05, adapter_fp32=False)
    p = step_parts(big, replace(t, lora=lora))
    device = 2 * 32 * 1024
    paged = 2 * (32 * 4096 + 4096 * 32 + 32 * 4096)
    print("expected", 8 * device, 8 * paged, "got", p.state_bytes, p.paged_state_bytes)
    assert (p.state_bytes, p.paged_state_bytes) == (8 * device, 8 * paged)
