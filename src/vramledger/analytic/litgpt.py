"""What LitGPT's own decoder layer saves for backward beyond the transformers + PEFT layer of analytic/activations.py.

Legend, per token of one decoder layer: c bytes of the compute dtype; H hidden size; nh query heads, nkv key/value
heads, hd head size; Dq = nh·hd, Dk = Dv = nkv·hd the widths of the fused ``attn`` linear's q, k and v parts.

LitGPT (litgpt 43c44323, 2024-04-24, and unchanged in these lines to 00af8b0d, 2024-09-27: the code of the
config_hub benchmark table) computes q, k and v with one fused linear and LoRA with ``LoRAQKVLinear``:

- ``litgpt/model.py`` ``CausalSelfAttention.forward`` (43c44323 l. 215-247): ``qkv.view(...).permute(...)``,
  ``q, k, v = qkv.split(...)``; for grouped-query attention ``k.expand(...)``/``v.expand(...)`` to every query head,
  then ``reshape`` (a copy) before SDPA. So:
  - without GQA (nkv = nh) ``v.reshape`` stays a view of the fused output, and SDPA saves that view for backward:
    the whole fused tensor outlives the forward, (Dq + Dk)·c more than transformers' separate V;
  - with GQA, SDPA saves K and V expanded to every head: 2·(nh − nkv)·hd·c more than transformers 5, whose SDPA
    path passes ``enable_gqa`` and saves nkv heads.
- ``litgpt/lora.py`` ``LoRAQKVLinear.forward`` (43c44323 l. 396-431) and ``zero_pad`` (l. 279-340; ``index_copy_``
  from f84b6109, 2024-05-06): when LoRA adapts some but not all of q, k and v, the adapters' output is scattered
  into a zero tensor of the fused width with ``index_copy``, whose backward keeps its ``source``: Σ D of the adapted
  parts ·c more. The adapters share one ``lora_dropout(x)``, where PEFT drops out each adapted linear's input
  separately (analytic/activations.py ``_adapter_bytes``: the dropped copy c·H and CUDA ``native_dropout``'s bool
  mask H): (n − 1)·H·(c + 1) less for n adapted parts of q, k, v when ``lora_dropout > 0``.

- ``CausalSelfAttention.forward`` again (43c44323 l. 239-261; 101e31d2, the thunder pretraining table of
  2024-05-06, l. 239-261; 00af8b0d l. 266-321): q is a fresh contiguous (B, nh, T, hd) tensor (``torch.cat`` after
  RoPE), SDPA's output takes q's layout, and ``y.transpose(1, 2)`` then ``y.reshape(B, T, Dq)`` copies it, while
  transformers' query is a transposed view whose layout the output shares (its ``transpose(1, 2).contiguous()`` is
  a no-op). SDPA keeps its own output; ``proj`` reads the copy, and keeps it whenever it keeps its input: its
  weight trains (full fine-tuning, pretraining), it is a bitsandbytes 4-bit linear (``MatMul4Bit`` keeps its
  input A), or its adapter reads the copy undropped (LoRA on ``proj`` with ``lora_dropout`` 0: LitGPT's
  ``LoRALinear`` then uses ``lambda x: x``): Dq·c more.

Measured, not fitted: the saved-for-backward bytes of one LitGPT ``lora.Block`` (43c44323 and 00af8b0d) and of
transformers' ``LlamaDecoderLayer`` with PEFT LoRA on q and v, same shapes, bf16, walked from the autograd graph
(``_saved_*`` of every node, each storage once; bench/published/litgpt_layer_probe.py): their difference is the sum
above per token, for q,v and for every-linear LoRA, with and without GQA and dropout, up to a per-layer constant of
2-6 KB (``index_copy``'s int64 index; tests/analytic/test_litgpt_layer.py derives the cases by hand). On CPU
dropout keeps a c-byte mask where CUDA keeps a bool; the formula uses CUDA's. Not modelled: that per-layer constant;
in the first trained layer, whose input needs no grad, the shared dropout keeps no mask (H bytes per
token once).

The parallel blocks (Phi, GPT-NeoX/StableLM-Alpha, Falcon: ``parallel_residual``, ``shared_attention_norm``,
``GptNeoxMLP``, LayerNorm, ``rotary_percentage``; 8641822 and 43c44323 ``model.py`` ``Block.forward``) differ from
transformers' layers of the same families in three more ways, written here per token against activations.py's
figures (``_litgpt_attention`` for the attention):
- the attention by head layout as above, and for multi-query attention (Falcon-7B) as ``_litgpt_attention`` says:
  a view of the fused output under 43c44323, SDPA's math kernel under lit-gpt 2023 (a length² term per sequence,
  ``litgpt_layer_extra_scores_per_seq``);
- ``GptNeoxMLP`` calls ``F.gelu`` (one saved I-wide input) where transformers' Phi runs ``NewGELUActivation`` (four);
- LitGPT's ``Block`` has no dropout, where transformers' Phi keeps two bool masks (``resid_pdrop``).
Measured with the probe's ``--families`` (tests/analytic/test_litgpt_families.py holds the figures).

Lit-GPT 8641822 (2023-10-16, the resource tables; ``ModelCode.LIT_GPT_2023``) ran the same attention and LoRA code
(``lit_gpt/model.py`` l. 173-232, ``lit_gpt/lora.py``) but ``lit_gpt/rmsnorm.py``'s RMSNorm in the input dtype
(``x * torch.rsqrt(norm_x + self.eps)`` on x itself; the fp32 upcast came with 6178c7cc, 2023-10-24): each of a
layer's two norms saves its c-byte input where transformers saves an fp32 copy, 2·H·(4 − c) less. Measured the same
way (probe ``--commit 8641822``). Its attention output copy is not counted: 8641822 calls flash-attn's
``flash_attn_func`` (output (B, T, nh, hd), no copy) when the package is installed (``FlashAttention2Available``,
l. 239-250), SDPA otherwise, and the resource tables do not say which. Not modelled there: the final norm's
(H·(4 − c) once) and the first layer's input norm, which saves nothing in either when its input needs no grad
(H·(4 − c) per token once too many).
"""

from __future__ import annotations

from vramledger.analytic.activations import (
    attention_output_copied,
    attention_saved_bytes,
    input_of,
    new_gelu,
    runs_eager,
)
from vramledger.analytic.weights import WeightBudget
from vramledger.specs import Method, ModelSpec, TrainSpec
from vramledger.specs.framework import ModelCode

SOURCE = (
    "LitGPT model.py CausalSelfAttention (fused qkv: SDPA keeps a view of it, or K/V expanded to every head) and "
    "lora.py LoRAQKVLinear (zero_pad's index_copy keeps the adapters' output; one dropout for q, k and v)"
)
_QKV = ("q_proj", "k_proj", "v_proj")


def litgpt_layer_extra_bytes_per_token(m: ModelSpec, train: TrainSpec, wb: WeightBudget) -> int:
    """Bytes per token that one of LitGPT's decoder layers saves beyond the transformers + PEFT layer (0 unless
    ``train.model_code`` is LitGPT). Negative when LitGPT saves less (its shared LoRA dropout).

    >>> from vramledger.catalog import resolve_model
    >>> from vramledger.analytic.weights import weight_budget
    >>> from vramledger.specs import Method, Precision
    >>> m = resolve_model("llama-2-7b")
    >>> t = TrainSpec(method=Method.FULL, precision=Precision.BF16, model_code=ModelCode.LITGPT)
    >>> # fused qkv kept by V's view (Dq + Dk), and proj's copy of the attention output (Dq), bf16
    >>> litgpt_layer_extra_bytes_per_token(m, t, weight_budget(m, t)) == (4096 + 4096) * 2 + 4096 * 2
    True
    """
    if train.model_code is ModelCode.TRANSFORMERS or m.is_moe or m.attn_logit_softcapping:
        return 0  # softcapped attention (Gemma 2) runs LitGPT's own non-SDPA path: not measured
    c = train.precision.compute.bytes
    nh, nkv, hd = m.num_heads, m.num_kv_heads, m.head_dim
    width = {"q_proj": nh * hd, "k_proj": nkv * hd, "v_proj": nkv * hd}
    extra = 0
    if not runs_eager(m, train):
        extra += _litgpt_attention(m, train)[0] - attention_saved_bytes(m, train)
    if not m.gated_mlp and new_gelu(m):
        # GptNeoxMLP calls F.gelu(x, approximate=config.gelu_approximate): one op saving its input, where
        # transformers' NewGELUActivation (Phi's gelu_new) saves four I-wide tensors (analytic/activations.py).
        extra -= 3 * m.intermediate_size * c
    if m.resid_dropout > 0:  # LitGPT's Block has no dropout: transformers' Phi keeps two bool masks
        extra -= 2 * m.hidden_size
    if train.adapters and train.lora is not None:
        adapted = {a.linear.name for a in wb.adapted} & set(_QKV)
        if adapted and len(adapted) < len(_QKV):
            extra += sum(width[name] for name in adapted) * c
        if train.lora.dropout > 0 and len(adapted) > 1:
            extra -= (len(adapted) - 1) * m.hidden_size * (c + 1)
    if not runs_eager(m, train) and _proj_keeps_input(m, train, wb):
        # y.reshape's copy of SDPA's output, kept by proj: counted by transformers' formula already for its partial-
        # rotary families (activations.py attention_output_copied), not counted for lit-gpt 2023 (see above)
        if train.model_code is ModelCode.LITGPT and not attention_output_copied(m):
            extra += width["q_proj"] * c
        elif train.model_code is ModelCode.LIT_GPT_2023 and attention_output_copied(m):
            extra -= width["q_proj"] * c
    if train.model_code is ModelCode.LIT_GPT_2023 and not m.norm_bias and c < 4:
        extra -= 2 * m.hidden_size * (4 - c)  # two RMSNorms saving their c-byte input, not an fp32 copy
    return extra


def litgpt_layer_extra_scores_per_seq(m: ModelSpec, train: TrainSpec) -> int:
    """Length² bytes per sequence that one of LitGPT's layers saves beyond transformers' (see
    ``_litgpt_attention``): lit-gpt 2023's multi-query attention runs SDPA's math kernel, which keeps the
    probabilities."""
    if train.model_code is ModelCode.TRANSFORMERS or m.is_moe or m.attn_logit_softcapping or runs_eager(m, train):
        return 0
    return _litgpt_attention(m, train)[1]


def _litgpt_attention(m: ModelSpec, train: TrainSpec) -> tuple[int, int]:
    """What LitGPT's ``CausalSelfAttention`` keeps from its SDPA call: (bytes per token, bytes per sequence).

    ``qkv.view(B, T, groups, q_per_kv + 2, hs).permute(...)``, ``split``, then (lit-gpt 8641822 l. 204-213,
    c195451d the same; litgpt 43c44323 l. 222-233):

    - multi-head (groups = heads): no expand; q and k are fresh ``torch.cat`` outputs after RoPE, v a view of the
      fused output, which SDPA's saved v keeps alive whole: q, k, Dq + 2·Dkv, the output, an fp32 logsumexp;
    - grouped-query (1 < groups < heads): ``expand`` then ``reshape`` copies K and V to every query head: 4·Dq;
    - multi-query (groups = 1), litgpt 43c44323: the same expand, but merging a size-1 group dimension with a
      stride-0 one is a view, so ``reshape`` copies nothing: k (the cat after RoPE) is Dq wide and v stays a view
      of the fused output (probe: ``litgpt_layer_probe.py --families``);
    - multi-query, lit-gpt 2023 (``if self.config.n_query_groups != 1``: no expand): one key/value head against
      ``n_head`` query heads, which SDPA's fused kernels refuse on PyTorch 2.1 (sdp_utils.cpp
      ``check_batch_size_and_num_heads``), so ``_scaled_dot_product_attention_math`` runs: ``matmul`` saves the
      scaled q and K broadcast to every head (a copy for ``bmm``), ``_softmax`` its nh·L² output, the matmul with
      V the probabilities and V broadcast (a copy): 3·Dq per token and nh·L² per sequence, no logsumexp.
    """
    c = train.precision.compute.bytes
    Dq, Dkv, nh, nkv = m.q_dim, m.kv_dim, m.num_heads, m.num_kv_heads
    lse = 4 * nh
    if nkv == nh:
        return c * (Dq + Dkv + (Dq + 2 * Dkv) + Dq) + lse, 0
    if nkv > 1:
        return c * 4 * Dq + lse, 0
    if train.model_code is ModelCode.LIT_GPT_2023:
        return c * 3 * Dq, c * nh * train.seq_len**2
    return c * (Dq + Dq + (Dq + 2 * Dkv) + Dq) + lse, 0


def _proj_keeps_input(m: ModelSpec, train: TrainSpec, wb: WeightBudget) -> bool:
    """Whether LitGPT's attention ``proj`` keeps its input for backward (see the module docstring): its weight
    trains, bitsandbytes' ``MatMul4Bit`` runs it, or an undropped adapter reads it."""
    if train.method in (Method.FULL, Method.FREEZE) or (train.quant is not None and train.quant.bits == 4):
        return True
    lora = train.lora
    adapted = {input_of(m, a.linear.name) for a in wb.adapted}
    return lora is not None and lora.dropout == 0 and "attn_out" in adapted
