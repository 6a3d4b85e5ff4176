"""Gemma 3's trained decoder layer for the two steps spill.py replays (``displaced_remade``): full fine-tuning,
bf16-true (``GemmaLayer``, a c-byte residual stream) and bf16-mixed (``GemmaAmpLayer``, fp32 weights under autocast:
an fp32 stream).

Legend: T = B·L tokens, H hidden, I MLP width, q and kv the widths of q's and k's projections (heads × head_dim),
hd head_dim, c the compute dtype's bytes (2), fp32 4 bytes.

transformers 5.24's models/gemma3/modeling_gemma3.py, not Llama's layer:

- ``Gemma3RMSNorm.forward`` (lines 128-133) is ``_norm(x.float()) * (1.0 + self.weight.float())`` then
  ``type_as(x)``: the fp32 copy of x is saved by ``x * rsqrt(...)``, and the normalised product 4·n is saved too
  (by the product with ``1 + weight``, which is trained), unlike ``LlamaRMSNorm``, whose product feeds a cast; the
  4·n product with the weight is a temporary until the cast back (c·n) is made (``_norm``);
- four such norms a layer (``Gemma3DecoderLayer.forward``, lines 373-404): ``input_layernorm`` (its output q's,
  k's and v's input), ``post_attention_layernorm`` on o_proj's output (its output a temporary until the residual
  sum), ``pre_feedforward_layernorm`` (gate's and up's input) and ``post_feedforward_layernorm`` on down_proj's
  output; ``q_norm`` and ``k_norm`` over head_dim after all three projections are made (``Gemma3Attention.forward``,
  lines 324-331), each projection's output dropped once its norm is done;
- ``Gemma3MLP.forward`` (line 115): ``gelu_pytorch_tanh`` in place of SiLU, the same four c·I·T blocks;
- ``Gemma3TextScaledWordEmbedding.forward`` (line 100): the embedding's output times ``embed_scale``, a second H·T
  block, the first freed;
- ``Gemma3TextModel.forward`` (lines 521-541): the sliding layers' mask, built once (``create_sliding_window_causal_
  mask``: an L² boolean mask, expanded over the batch, two alive at once while it is built) where the length reaches
  the window
  (the sliding layers of a packed batch get a mask; the full-attention layers none, ``is_causal``), and RoPE's cos
  and sin for each layer type (``Gemma3RotaryEmbedding.forward``, lines 188-200: fp32 ``cat``, ``cos``, ``sin`` and
  the products with the attention scaling, cast to the hidden states' dtype; one row of positions, L·hd each), both
  saved by every layer's ``q * cos`` and ``rotate_half(q) * sin`` to the first layer's backward;
- SDPA on a sliding layer gets the mask (integrations/sdpa_attention.py ``use_gqa_in_sdpa``: no grouped heads with a
  mask, so ``repeat_kv``; with one K/V head, gemma-3-1b's, ``expand`` and ``reshape`` are views and nothing is
  copied), which torch's ``scaled_dot_product_attention`` turns into an additive c·B·L² mask (``logical_not`` and
  ``where``, trace/shims.py ``cuda_sdpa_mask``) that the memory-efficient kernel saves; the full-attention layers
  run flash with grouped heads;
- Gemma 3 has no soft-capping (``final_logit_softcapping`` and ``attn_logit_softcapping`` are None), so the loss is
  the standard chain. Gemma 2's layer caps the attention logits, which SDPA refuses (``sdpa_attention_forward``
  raises on ``softcap``): it runs eager, whose length² blocks are not in the sequence.

What the trace of gemma-3-1b full, 1 × 1024, records (layer 2's forward, events of ``trace_events``; bf16-true
first, bf16-mixed second), and the sequence below reproduces request for request above the small pool: the norm's
4.5 MiB fp32 copy, ``pow``, the product, the 4.5 MiB temporary, the 2.25 MiB cast; q, k, v (2, 0.5, 0.5 MiB);
q_norm's 4 MiB blocks, k_norm's 1 MiB; RoPE's ``mul``, ``neg``, ``cat``, ``mul``, ``add``; the 1 MiB
``logical_not`` and the 2 MiB additive mask; SDPA's 2 MiB output; o_proj's output and the post-attention norm;
the residual sum; the MLP's four 13.5 MiB blocks; down_proj's output and the post-feed-forward norm; the residual
sum, then the layer's input freed by the caller (the c-byte stream, ``_Layer.held_by_caller``). Under autocast:
each projection's c·in·T cast of the fp32 norm output (q, k, v, gate, up) and the weights' c-byte copies; the
stream's norms' ``to(float32)`` are no-ops (x saved instead of a copy, the fp32 output returned); the c-byte
projection outputs' norms (q_norm, k_norm, post-attention, post-feed-forward) take the c-byte path; RoPE's products
fp32 (cos and sin in the stream's dtype), SDPA's autocast copies of q and k saved (on a sliding layer k's with every
query head: autocast casts ``repeat_kv``'s expanded view), and an fp32 residual sum.

Left out, as for Llama's layers: the weights, the norms' weights, row statistics and ``1 + weight`` (small pool),
SDPA's log-sum-exp (small pool at these shapes), backward's transients. Not written out: a sliding layer that
repeats K/V (more than one K/V head, fewer than the query heads: gemma-3-4b and larger), fp32 layers.
"""

from __future__ import annotations

from vramledger.analytic.reserve.amp_layer import Fp32Stream
from vramledger.analytic.reserve.forward_cache import _Layer, _Replay
from vramledger.specs import ModelSpec

_FP32 = 4


def sliding_pattern(m: ModelSpec) -> int:
    """Every how many layers one is full attention: configuration_gemma3.py's ``layer_types`` default, layer i
    full where ``(i + 1) % sliding_window_pattern == 0`` (6 for Gemma 3: gemma-3-1b's 26 layers, 22 sliding), read
    back from the count of sliding layers; 0 where every layer slides or none does."""
    full = m.num_layers - m.sliding_layers
    return m.num_layers // full if m.sliding_layers and full else 0


def window_masked(m: ModelSpec, seq_len: int) -> bool:
    """Whether a packed batch's sliding layers get a mask: the length reaches the window (masking_utils.py
    ``_ignore_causal_mask_sdpa`` drops it only where ``kv_length < local_attention_size``; activations.py
    ``sdpa_math`` reads the same condition)."""
    return bool(m.sliding_layers) and seq_len >= m.sliding_window


class GemmaLayer(_Layer):
    """One trained Gemma 3 decoder layer at B sequences of L tokens, bf16-true (see the module docstring); each
    projection's saved input is recorded in ``inputs`` for spill.py's backward."""

    def __init__(
        self, r: _Replay, m: ModelSpec, shapes: dict[str, tuple[int, int]], c: int, *, batch: int, seq_len: int
    ) -> None:
        super().__init__(r, m, set(), shapes, c, False, tokens=batch * seq_len, trained=True)
        self.B, self.L = batch, seq_len
        self.index = 0  # the next layer's index
        self.mask = 0  # the sliding layers' boolean mask's block (0: none)

    def embed(self) -> int:
        """The scaled embedding, the sliding layers' mask and RoPE's cos and sin for each layer type; returns the
        first layer's input."""
        r, n = self.r, self.m.hidden_size * self.T
        self.index = 0
        looked_up = r.alloc(self.residual_bytes * n)
        scaled = r.alloc(self.residual_bytes * n)
        r.free(looked_up)
        if window_masked(self.m, self.L):  # sliding_window_overlay's ``gt``/``le`` and the two ``bitwise_and``
            square = self.L * self.L  # one L × L mask, expanded over the batch (a view)
            first, step = r.alloc(square), r.alloc(square)
            r.free(first)
            last = r.alloc(square)
            self.mask = r.alloc(square)
            r.free(last)
            r.free(step)
        for _ in range(2 if sliding_pattern(self.m) else 1):
            self._rotary()
        return scaled

    def _rotary(self) -> None:
        """``Gemma3RotaryEmbedding.forward`` for one layer type: fp32 frequencies, ``cat``, ``cos`` and ``sin`` with
        their products by the scaling, cast to the stream's dtype (a no-op for an fp32 stream); cos and sin stay.
        One row of positions (``Gemma3TextModel.forward``: ``position_ids = arange(L).unsqueeze(0)``), so L·hd
        elements each, broadcast over the batch by RoPE's products."""
        r, hd = self.r, self.m.head_dim * self.L
        freqs, emb = r.alloc(_FP32 * hd // 2), r.alloc(_FP32 * hd)
        raw = r.alloc(_FP32 * hd)
        cos = r.alloc(_FP32 * hd)  # ``cos() * attention_scaling``
        r.free(raw)
        raw = r.alloc(_FP32 * hd)
        sin = r.alloc(_FP32 * hd)
        r.free(raw)
        cast = self.residual_bytes != _FP32
        if cast:  # ``cos.to(dtype=x.dtype)``, ``sin.to(...)``: the casts stay
            r.alloc(self.residual_bytes * hd)
            r.alloc(self.residual_bytes * hd)
        r.free(freqs)
        r.free(emb)
        if cast:
            r.free(cos)
            r.free(sin)

    def forward_done(self) -> None:
        """The model's forward returns: the sliding mask goes (its additive copies are the layers')."""
        if self.mask:
            self.r.free(self.mask)
            self.mask = 0

    def final_norm(self) -> None:
        """The model's final norm; its output is lm_head's input, saved by lm_head's matmul."""
        self._norm(self.m.hidden_size)

    def _sliding(self) -> bool:
        pattern = sliding_pattern(self.m)
        sliding = self.m.sliding_layers == self.m.num_layers or bool(pattern and (self.index + 1) % pattern)
        self.index += 1
        return sliding and window_masked(self.m, self.L)

    def forward(self, x: int, fused: bool) -> int:
        """Returns the layer's output; the caller frees ``x`` once the layer returns (``held_by_caller``)."""
        r, c, T, H, m = self.r, self.c, self.T, self.m.hidden_size, self.m
        masked = self._sliding()
        normed = self._norm(H)
        self.inputs[normed] = ("q_proj", "k_proj", "v_proj")
        q, k = self._linear("q_proj"), self._linear("k_proj")
        self._linear("v_proj")  # saved by SDPA
        self._attention_inputs(q, k)  # RoPE's outputs, saved by SDPA
        if masked:
            self._additive_mask(c)
        attn = r.alloc(c * m.q_dim * T)  # SDPA's output, saved by o_proj
        self.inputs[attn] = ("o_proj",)
        out_attn = self._linear("o_proj")
        h = self._residual(out_attn)
        normed = self._norm(H)
        self.inputs[normed] = ("gate_proj", "up_proj")
        down = self._mlp()
        out = self._residual(down)
        r.free(h)
        return out

    def _attention_inputs(self, q: int, k: int) -> list[int]:
        """q_norm and k_norm (each projection's output dropped once its norm is made), RoPE on both (saved by SDPA),
        the norms' outputs dropped; returns RoPE's outputs."""
        m, r = self.m, self.r
        qn = self._norm(m.q_dim)
        r.free(q)
        kn = self._norm(m.kv_dim)
        r.free(k)
        embedded = [self._rope(width) for width in (m.q_dim, m.kv_dim)]
        r.free(qn)
        r.free(kn)
        return embedded

    def _additive_mask(self, c: int) -> None:
        """torch's ``convert_boolean_attn_mask``: ``logical_not`` (B·L², freed) and ``where`` into a c-byte mask,
        saved by the kernel."""
        square = self.B * self.L * self.L
        inverted = self.r.alloc(square)
        self.r.alloc(c * square)
        self.r.free(inverted)

    def _mlp(self) -> int:
        """gate (saved by GELU), GELU (saved by the product), up (saved by the product), the product (down_proj's
        input); returns down_proj's output."""
        r, c, T = self.r, self.c, self.T
        width = self.shapes["gate_proj"][1]
        self._linear("gate_proj")
        r.alloc(c * width * T)
        self._linear("up_proj")
        product = r.alloc(c * width * T)
        self.inputs[product] = ("down_proj",)
        return self._linear("down_proj")

    def _residual(self, branch: int) -> int:
        """The branch's post norm (its output a temporary), the branch's output dropped, the residual sum
        (returned), the norm's output dropped."""
        r = self.r
        normed = self._norm(self.m.hidden_size)
        r.free(branch)
        total = r.alloc(self.residual_bytes * self.m.hidden_size * self.T)
        r.free(normed)
        return total

    def _norm(self, width: int) -> int:
        """``Gemma3RMSNorm`` on a c-byte input over ``width`` features: ``x.float()`` (saved), ``pow(2)``, the
        normalised product (saved), its product with ``1 + weight`` (a temporary), the cast back (returned)."""
        r, n = self.r, width * self.T
        r.alloc(_FP32 * n)
        r.free(r.alloc(_FP32 * n))
        r.alloc(_FP32 * n)
        weighted = r.alloc(_FP32 * n)
        out = r.alloc(self.c * n)
        r.free(weighted)
        return out


class GemmaAmpLayer(Fp32Stream, GemmaLayer):
    """One trained Gemma 3 decoder layer under autocast with fp32 weights (bf16-mixed): the fp32 stream, autocast's
    casts of each projection's fp32 input and of the weights (see the module docstring)."""

    def __init__(
        self, r: _Replay, m: ModelSpec, shapes: dict[str, tuple[int, int]], c: int, *, batch: int, seq_len: int
    ) -> None:
        super().__init__(r, m, shapes, c, batch=batch, seq_len=seq_len)
        self.weight_casts = True

    def final_norm(self) -> None:
        """The final norm on the fp32 stream, the sliding mask freed, lm_head's autocast copy of the norm's output
        (saved by lm_head's matmul); the fp32 output dropped (4·H·T: small beside the logits)."""
        out = self._stream_norm()
        self.forward_done()
        self.r.alloc(self.c * self.m.hidden_size * self.T)
        self.r.free(out)

    def forward(self, x: int, fused: bool) -> int:
        """Returns the layer's output, fp32; ``x`` stays (the input norm's ``x * rsqrt`` saves it)."""
        r, c, T, m = self.r, self.c, self.T, self.m
        masked = self._sliding()
        normed = self._stream_norm()
        q, k = self._cast_linear("q_proj"), self._cast_linear("k_proj")
        self._cast_linear("v_proj")  # saved by SDPA
        embedded = self._attention_inputs(q, k)
        # SDPA's autocast copies of q and k, saved; on a masked layer ``repeat_kv``'s expanded view of the fp32 k (one
        # K/V head: no copy) is what autocast casts, so k's copy has every query head
        r.alloc(c * m.q_dim * T)
        r.alloc(c * (m.q_dim if masked else m.kv_dim) * T)
        if masked:
            self._additive_mask(c)
        attn = r.alloc(c * m.q_dim * T)  # SDPA's output, saved by o_proj
        self.inputs[attn] = ("o_proj",)
        out_attn = self._linear("o_proj")
        for i in (*embedded, normed):  # the attention block returns: its fp32 tensors go
            r.free(i)
        self._residual(out_attn)  # saved by the next norm's ``x * rsqrt``
        normed = self._stream_norm()
        down = self._mlp()
        r.free(normed)
        return self._residual(down)

    def _rope(self, width: int, in_bytes: int = 0, out_bytes: int = 0) -> int:
        return super()._rope(width, self.c, _FP32)  # q in c bytes, cos and sin fp32

    def _mlp(self) -> int:
        r, c, T = self.r, self.c, self.T
        width = self.shapes["gate_proj"][1]
        self._cast_linear("gate_proj")
        r.alloc(c * width * T)
        self._cast_linear("up_proj")
        product = r.alloc(c * width * T)
        self.inputs[product] = ("down_proj",)
        return self._linear("down_proj")
