"""A trained decoder layer's forward under autocast with fp32 weights (full fine-tuning, bf16-mixed), for the two
steps spill.py replays (``displaced_remade``).

Legend: T tokens, H hidden, I MLP width, q and kv the widths of q's and k's projections, c the compute dtype's bytes
(2), fp32 4 bytes.

With fp32 weights the residual stream is fp32: the embedding's output (autocast leaves ``embedding`` alone) and
every residual sum. So the layer is not forward_cache.py's ``_Layer`` with c-byte tensors (bf16-true full
fine-tuning, LoRA), but, in transformers' ``LlamaDecoderLayer`` order (Mistral, Qwen2 and Qwen3 are alike):

- ``LlamaRMSNorm.forward`` on the fp32 stream: ``to(torch.float32)`` and ``to(input_dtype)`` are no-ops, so its
  input x is what ``x * rsqrt(...)`` saves (the stream's block stays alive), ``pow(2)`` is a transient, the
  normalised product 4·H·T is saved by the weight's ``mul``, and the weight product is fp32 (type promotion with the
  fp32 weight), 4·H·T, a temporary that lives until the block is done with it;
- every projection whose input is fp32 gets autocast's own c-byte copy of it (autocast_mode.cpp ``cached_cast``
  caches only leaf tensors, the weights): q, k, v, gate and up each save a c·H·T cast, beside the cached c-byte
  weight copy and their c-byte output; o_proj's input (SDPA's output) and down_proj's (the MLP's product) are c-byte
  already;
- ``LlamaRotaryEmbedding.forward`` returns cos and sin in the hidden states' dtype, fp32, so ``q * cos`` and the sum
  are fp32 (4·q·T), ``rotate_half``'s ``neg`` and ``cat`` in q's dtype; SDPA (autocast's lower-precision list) casts
  q and k back to c bytes and saves those, and the fp32 ones are freed once the attention block returns;
- Qwen3's ``q_norm``/``k_norm`` take the c-byte projection output: the norm's c-byte path, with an fp32 weight
  product, which RoPE then takes in fp32.

What the trace shows (Qwen2.5-1.5B full, bf16-mixed, 4 × 1024, layer 10's forward: bench/reserve/run_two_steps.py's
trace replayed): 24 MiB fp32 blocks for the stream, the norms' products and RoPE's, 12 MiB casts for q, k, v, gate
and up, 70 MiB MLP blocks; the c-byte layer put the stream in 12 MiB blocks, and two steps replayed with it reserved
1.7 GiB less in step 1 than the trace.
"""

from __future__ import annotations

from vramledger.analytic.reserve.forward_cache import _Layer, _Replay
from vramledger.specs import ModelSpec

_FP32 = 4


class Fp32Stream(_Layer):
    """What a trained layer under autocast with fp32 weights does on its fp32 residual stream, whatever the layer:
    its norms and autocast's cast of each projection's input (AmpLayer here; gemma_layer.py's GemmaAmpLayer)."""

    @property
    def residual_bytes(self) -> int:
        return _FP32

    def _stream_norm(self) -> int:
        """RMSNorm on the fp32 stream (Gemma3RMSNorm's ``x.float()`` and ``type_as`` are no-ops there): ``pow(2)``,
        the normalised product (saved), the fp32 weight product (returned)."""
        r, n = self.r, self.m.hidden_size * self.T
        r.free(r.alloc(_FP32 * n))
        r.alloc(_FP32 * n)
        return r.alloc(_FP32 * n)

    def _cast_linear(self, name: str) -> int:
        """A projection of an fp32 input: autocast's c-byte copy of it (saved by the matmul), the weight's copy and
        the output (returned)."""
        cast = self.r.alloc(self.c * self.shapes[name][0] * self.T)
        self.inputs[cast] = (name,)
        return self._linear(name)


class AmpLayer(Fp32Stream):
    """One trained decoder layer under autocast with fp32 weights, at T tokens (see the module docstring); each
    projection's saved input is recorded in ``inputs`` for spill.py's backward."""

    def __init__(self, r: _Replay, m: ModelSpec, shapes: dict[str, tuple[int, int]], c: int, *, tokens: int) -> None:
        super().__init__(r, m, set(), shapes, c, False, tokens=tokens, trained=True, weight_casts=True)

    def final_norm(self) -> None:
        """The final norm on the fp32 stream and lm_head's autocast copy of its output (saved by lm_head's matmul);
        the fp32 output is dropped once the loss has its logits (freed here: its 4·H·T is small beside them)."""
        out = self._stream_norm()
        self.r.alloc(self.c * self.m.hidden_size * self.T)
        self.r.free(out)

    def forward(self, x: int, fused: bool) -> int:
        """Returns the layer's output, fp32; ``x`` stays (the input norm's ``x * rsqrt`` saves it)."""
        r, c, T, H, m = self.r, self.c, self.T, self.m.hidden_size, self.m
        normed = self._stream_norm()
        q, k = self._head("q_proj", m.q_dim), self._head("k_proj", m.kv_dim)
        self._cast_linear("v_proj")  # saved by SDPA
        in_bytes = _FP32 if m.qk_norm else c
        embedded = [self._rope(w, in_bytes, _FP32) for w in (m.q_dim, m.kv_dim)]
        r.free(q)
        r.free(k)
        r.alloc(c * m.q_dim * T)  # SDPA's autocast copies of q and k, saved
        r.alloc(c * m.kv_dim * T)
        attn = r.alloc(c * m.q_dim * T)  # SDPA's output, saved by o_proj
        self.inputs[attn] = ("o_proj",)
        out_attn = self._linear("o_proj")
        for i in (*embedded, normed):  # the attention block returns: its fp32 temporaries go
            r.free(i)
        r.alloc(_FP32 * H * T)  # residual + attention: saved by the next norm's ``x * rsqrt``
        r.free(out_attn)
        normed = self._stream_norm()
        width = self.shapes["gate_proj"][1]
        self._cast_linear("gate_proj")  # saved by act_fn
        r.alloc(c * width * T)  # act_fn(gate), saved by the product
        self._cast_linear("up_proj")  # saved by the product
        product = r.alloc(c * width * T)  # down_proj's input
        self.inputs[product] = ("down_proj",)
        down = self._linear("down_proj")
        r.free(normed)
        out = r.alloc(_FP32 * H * T)  # residual + MLP
        r.free(down)
        return out

    def _head(self, name: str, width: int) -> int:
        """q's or k's projection and, with Qwen3's ``q_norm``/``k_norm``, its norm (the c-byte path, the weight
        product fp32), the projection's output then dropped."""
        proj = self._cast_linear(name)
        if not self.m.qk_norm:
            return proj
        normed = self.norm(width, out_bytes=_FP32)
        self.r.free(proj)
        return normed
