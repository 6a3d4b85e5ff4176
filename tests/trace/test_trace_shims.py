"""The CUDA-path shims: dropout's bool mask, SDPA's backend choice, autocast's CUDA op lists."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from tests.trace._trace_tiny import TINY, spec
from vramledger.ledger import Category, Phase
from vramledger.specs import Attention, Method, Precision, TrainSpec
from vramledger.trace import trace_step
from vramledger.trace.recorder import round_block
from vramledger.trace.shims import autocast_as_cuda, cuda_sdpa_backend, dropout_as_cuda


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(func._overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _dropout_ops(shim: bool) -> list[str]:
    with FakeTensorMode():
        x = torch.empty(4, 8, dtype=torch.bfloat16, requires_grad=True)
        rec = _Ops()
        ctx = dropout_as_cuda() if shim else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        with ctx, rec:
            torch.nn.functional.dropout(x, 0.1, training=True)
    return rec.ops


def test_dropout_shim_uses_native_dropout_and_restores() -> None:
    # Dropout.cpp: CUDA takes native_dropout (bool mask); CPU takes empty_like + bernoulli_ (mask in x's
    # dtype).
    assert "native_dropout" in _dropout_ops(True) and "bernoulli_" not in _dropout_ops(True)
    assert "bernoulli_" in _dropout_ops(False)  # the shim is gone after its context


def _q(heads: int, dtype: torch.dtype, d: int = 64) -> torch.Tensor:
    return torch.empty(1, heads, 16, d, dtype=dtype, device="meta")


@pytest.mark.parametrize(
    ("dtype", "kv_heads", "mask", "want"),
    [
        (torch.bfloat16, 2, False, "flash"),  # flash takes grouped heads, no mask
        (torch.bfloat16, 8, True, "efficient"),  # a mask rules out flash; efficient takes it
        (torch.float32, 8, False, "efficient"),  # flash is fp16/bf16 only
        (torch.float32, 2, False, "math"),  # efficient needs equal heads: grouped fp32 falls back to math
    ],
)
def test_cuda_sdpa_backend_rules(dtype: torch.dtype, kv_heads: int, mask: bool, want: str) -> None:
    q, k = _q(8, dtype), _q(kv_heads, dtype)
    assert cuda_sdpa_backend(q, k, k, object() if mask else None, 0.0, kv_heads != 8) == want


def test_sdpa_has_no_length_squared_tensor_eager_has_fp32_scores() -> None:
    m, cfg = spec("llama"), TINY["llama"]
    b, L, h = 2, 48, m.num_heads
    sdpa = trace_step(m, TrainSpec(method=Method.LORA, micro_batch=b, seq_len=L, packing=True), config=cfg)
    assert sdpa.bytes_of(Category.ATTENTION_SCORES, Phase.FORWARD) == 0
    assert sdpa.settings["sdpa_backends"] == ["flash"]
    eager = trace_step(m, TrainSpec(method=Method.LORA, micro_batch=b, seq_len=L, attn=Attention.EAGER), config=cfg)
    # modeling_llama.py eager_attention_forward: softmax in fp32, cast back to bf16 and saved; per layer at
    # least
    # the saved bf16 probabilities (b·h·L²·2) are live at the end of forward.
    per_layer = b * h * L * L * 2
    assert eager.bytes_of(Category.ATTENTION_SCORES, Phase.FORWARD) >= m.num_layers * per_layer


def test_a_padded_batch_gives_sdpa_a_mask_every_layer_keeps() -> None:
    """A batch whose last row ends in a pad token: transformers builds a boolean (b, 1, L, L) mask (masking_utils
    ``_ignore_causal_mask_sdpa`` keeps it), the flash kernel cannot take it, and torch's SDPA hands the efficient
    kernel an additive bf16 copy per call (attention.cpp ``convert_boolean_attn_mask``), last dimension padded to
    16 (``preprocess_mask``), which that kernel saves: b·L·⌈L⌉₁₆·2 bytes in each layer."""
    m, cfg = spec("llama"), TINY["llama"]
    b, L = 2, 40
    padded = trace_step(m, TrainSpec(method=Method.LORA, micro_batch=b, seq_len=L), config=cfg)
    assert padded.settings["sdpa_backends"] == ["efficient"]
    per_layer = b * L * 48 * 2  # ⌈40⌉₁₆ = 48
    assert padded.bytes_of(Category.ATTENTION_SCORES, Phase.FORWARD) == m.num_layers * round_block(per_layer)


def test_fp32_grouped_sdpa_falls_back_to_math() -> None:
    m, cfg = spec("llama"), TINY["llama"]
    led = trace_step(m, TrainSpec(method=Method.LORA, precision=Precision.FP32, micro_batch=1, seq_len=40), config=cfg)
    assert led.settings["sdpa_backends"] == ["math"]
    assert led.bytes_of(Category.ATTENTION_SCORES, Phase.FORWARD) > 0


def test_autocast_follows_cuda_lists() -> None:
    # CUDA autocast (autocast_mode.cpp): layer_norm runs in fp32 and softmax without dtype returns fp32; on
    # CPU
    # autocast both stay in the input dtype.
    with FakeTensorMode():
        x = torch.empty(4, 8, dtype=torch.bfloat16)
        w = torch.empty(8, dtype=torch.bfloat16)
        with autocast_as_cuda(), torch.autocast("cpu", dtype=torch.bfloat16):
            ln = torch.nn.functional.layer_norm(x, (8,), w)
            sm = torch.softmax(x, -1)
            mm = torch.mm(x.float(), x.float().t())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ln_cpu = torch.nn.functional.layer_norm(x, (8,), w)
    assert (ln.dtype, sm.dtype, mm.dtype) == (torch.float32, torch.float32, torch.bfloat16)
    assert ln_cpu.dtype == torch.bfloat16
