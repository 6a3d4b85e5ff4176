"""A trained decoder layer's forward in fp32 with SDPA's math kernel (full fine-tuning, ``--precision fp32``, grouped
query heads, no mask: analytic/activations.py ``sdpa_math``), for the two steps spill.py replays (``displaced_remade``).

Legend: T tokens, B sequences of L tokens, H hidden, I MLP width, q and kv the widths of q's and k's projections,
nh query heads, P = 4·nh·L²·B one fp32 length² block; every tensor is fp32 (4 bytes an element).

In transformers' ``LlamaDecoderLayer`` order (Mistral, Qwen2 and Qwen3 are alike), as the trace of Qwen2.5-0.5B full,
fp32, 2 × 1024 records it (layer 3's forward, bench/reserve/fp32_math.jsonl's shapes):

- ``LlamaRMSNorm.forward`` in fp32: ``to(torch.float32)`` and ``to(input_dtype)`` are no-ops, so the layer's input
  is what ``x * rsqrt(...)`` saves (the stream's block stays alive), ``pow(2)`` is a transient, the normalised product
  4·H·T is saved by the weight's ``mul``, and the weight product 4·H·T is saved by the projections it feeds (their
  weights are trained), as in amp_layer.py's fp32 stream;
- q, k and v's projections (``addmm`` with Qwen2's biases), Qwen3's ``q_norm`` and ``k_norm`` (the fp32 norm, which
  saves the projection), RoPE on q and k (``q * cos``, ``rotate_half``'s ``neg`` and ``cat``, ``* sin``, the sum),
  what RoPE took then dropped;
- ``_scaled_dot_product_attention_math`` (torch 2.13 aten/src/ATen/native/transformers/attention.cpp), called with
  ``is_causal`` and ``enable_gqa``: q scaled (a transient), the causal mask built (``ones`` and ``tril``, L² bytes,
  then ``where`` into an fp32 L² block), q made contiguous (a transient), K and V repeated to every query head and
  the scaled q saved (4·q·T each), ``bmm`` of q and Kᵀ (P, a transient), the mask added out of place (P),
  ``_safe_softmax`` (P, saved), ``bmm`` with V (4·q·T), whose contiguous copy (``clone``) o_proj saves; the RoPE
  outputs and v are freed once the attention block returns (the math kernel saved its own copies);
- the MLP: gate (saved by ``act_fn``), ``act_fn`` (saved by the product), up (saved by the product), the product
  (down_proj's input, saved), down_proj's output a transient until the residual sum.

The forward's two P requests are the blocks no other request of the layer fits: in the trace each layer makes two P
segments (the scores' and the masked scores'), the softmax takes the first once the scores are freed, and the MLP's
first 4·I·T blocks are cut from the second (CUDACachingAllocator.cpp ``get_free_block``, ``alloc_found_block``).
Left out, as for the other layers: the weights, the norms' weights and row statistics (small pool), backward's
transients (the two fp32 P blocks of each layer's attention backward among them).
"""

from __future__ import annotations

from vramledger.analytic.reserve.forward_cache import _Layer, _Replay
from vramledger.specs import ModelSpec

_FP32 = 4


class MathLayer(_Layer):
    """One trained fp32 decoder layer whose attention runs SDPA's math kernel, at B sequences of L tokens (see the
    module docstring); each projection's saved input is recorded in ``inputs`` for spill.py's backward."""

    def __init__(
        self, r: _Replay, m: ModelSpec, shapes: dict[str, tuple[int, int]], *, batch: int, seq_len: int
    ) -> None:
        super().__init__(r, m, set(), shapes, _FP32, False, tokens=batch * seq_len, trained=True)
        self.B, self.L = batch, seq_len

    @property
    def residual_bytes(self) -> int:
        return _FP32

    def final_norm(self) -> None:
        """The final norm on the fp32 stream; its output is lm_head's input, saved by lm_head's matmul."""
        self._stream_norm(self.m.hidden_size)

    def forward(self, x: int, fused: bool) -> int:
        """Returns the layer's output; ``x`` stays (the input norm's ``x * rsqrt`` saves it)."""
        r, T, H, m = self.r, self.T, self.m.hidden_size, self.m
        normed = self._stream_norm(H)
        self.inputs[normed] = ("q_proj", "k_proj", "v_proj")
        q, k = self._head("q_proj", m.q_dim), self._head("k_proj", m.kv_dim)
        v = self._linear("v_proj")
        embedded = [self._rope(width) for width in (m.q_dim, m.kv_dim)]
        r.free(q)
        r.free(k)
        attn = self._math_attention()
        self.inputs[attn] = ("o_proj",)
        out_attn = self._linear("o_proj")
        for i in (*embedded, v):
            r.free(i)
        r.alloc(_FP32 * H * T)  # residual + attention: saved by the next norm's ``x * rsqrt``
        r.free(out_attn)
        normed = self._stream_norm(H)
        self.inputs[normed] = ("gate_proj", "up_proj")
        width = self.shapes["gate_proj"][1]
        self._linear("gate_proj")  # saved by act_fn
        r.alloc(_FP32 * width * T)  # act_fn(gate), saved by the product
        self._linear("up_proj")  # saved by the product
        product = r.alloc(_FP32 * width * T)  # down_proj's input
        self.inputs[product] = ("down_proj",)
        down = self._linear("down_proj")
        out = r.alloc(_FP32 * H * T)  # residual + MLP
        r.free(down)
        return out

    def _math_attention(self) -> int:
        """``_scaled_dot_product_attention_math`` with a causal mask built and grouped K/V repeated (module
        docstring); returns o_proj's input, the output's contiguous copy."""
        r, L = self.r, self.L
        width = _FP32 * self.m.q_dim * self.T  # q, and K and V repeated to every query head
        P = _FP32 * self.m.num_heads * L * L * self.B
        scaled = r.alloc(width)
        ones = r.alloc(L * L)  # the causal mask: ``ones`` and ``tril`` in bool, ``where`` into fp32
        tril = r.alloc(L * L)
        r.free(ones)
        mask = r.alloc(_FP32 * L * L)
        r.free(tril)
        contiguous = r.alloc(width)
        for _ in range(3):  # K and V repeated, the scaled q: saved
            r.alloc(width)
        scores = r.alloc(P)
        masked = r.alloc(P)
        r.free(scores)
        r.alloc(P)  # _safe_softmax's probabilities: saved
        r.free(masked)
        out = r.alloc(width)
        for i in (contiguous, scaled, mask):
            r.free(i)
        attn = r.alloc(width)
        r.free(out)
        return attn

    def _stream_norm(self, width: int) -> int:
        """RMSNorm in fp32 over ``width`` features: ``pow(2)``, the normalised product (saved), the weight product
        (returned)."""
        r, n = self.r, width * self.T
        r.free(r.alloc(_FP32 * n))
        r.alloc(_FP32 * n)
        return r.alloc(_FP32 * n)

    def _head(self, name: str, width: int) -> int:
        """q's or k's projection and, with Qwen3's ``q_norm``/``k_norm``, its fp32 norm, whose ``x * rsqrt`` saves the
        projection's output (``to(torch.float32)`` is a no-op: no copy to save instead, as under autocast); returns
        what RoPE takes, dropped once it is done."""
        proj = self._linear(name)
        return self._stream_norm(width) if self.m.qk_norm else proj
