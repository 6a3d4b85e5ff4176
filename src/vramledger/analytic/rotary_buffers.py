"""The rotary cos/sin tables that transformers 4.31-4.35 kept in every attention layer of Llama and Mistral.

Legend: L layers, M ``max_position_embeddings``, D head_dim, c bytes of the load dtype.

transformers 4.31.0 to 4.35.2 (the releases of the legacy tuple cache, ``analytic/kv_cache.py``) gave each
``LlamaAttention`` its own ``LlamaRotaryEmbedding`` (``self.rotary_emb = LlamaRotaryEmbedding(self.head_dim,
max_position_embeddings=...)``, ``models/llama/modeling_llama.py`` l. 260 at 4.31.0), whose ``__init__`` fills the
whole table at once: ``_set_cos_sin_cache(seq_len=max_position_embeddings, ...,
dtype=torch.get_default_dtype())`` registers ``cos_cached`` and ``sin_cached`` (``persistent=False``: no checkpoint
holds them, so no parameter count does either) of M × D elements each (4.32.0 l. 103-115; 4.35.2 l. 124-136;
``MistralRotaryEmbedding`` the same, 4.35.2 ``models/mistral/modeling_mistral.py`` l. 101-113). ``from_pretrained``
sets the default dtype to ``torch_dtype`` while it builds the model (4.32.0 ``modeling_utils.py`` l. 2837
``_set_default_torch_dtype``), so the tables are in the load dtype, and they reach the GPU with the weights
(accelerate 0.22 ``hooks.py`` ``AlignDevicesHook.init_hook``, l. 250-253, moves ``named_module_tensors``, buffers
included, to the execution device; ``dispatch_model`` always attaches it to a bitsandbytes model). ``forward``
slices them, and its ``.to(dtype=x.dtype)`` is a no-op in the same dtype: nothing more is allocated per step.

So such a model holds 2·L·M·D·c bytes beyond its parameters for as long as it is loaded: 84 MB for Llama-2-13B in
fp16 (40 layers, 4096 positions, head_dim 128). From 4.36 on the caches moved and later went away (one shared
rotary embedding computing cos/sin per call), which is what every other vramledger mode models.
"""

from __future__ import annotations

from vramledger.specs import ModelSpec

SOURCE = (
    "transformers 4.31-4.35 modeling_llama.py / modeling_mistral.py: one LlamaRotaryEmbedding per attention layer, "
    "cos_cached and sin_cached of max_position_embeddings × head_dim in the default dtype (= torch_dtype during "
    "from_pretrained), persistent=False buffers"
)

# The families whose 4.31-4.35 modeling file builds the per-layer tables (read at 4.31.0, 4.32.0 and 4.35.2);
# other architectures of those releases cached differently, and later ones did not exist yet.
FAMILIES = frozenset({"llama", "mistral"})


def legacy_rotary_bytes(m: ModelSpec, dtype_bytes: int) -> int:
    """Bytes of every layer's ``cos_cached`` + ``sin_cached`` under transformers 4.31-4.35 (0 for a family those
    releases did not build so, or a model without rotary positions).

    >>> from vramledger.catalog import resolve_model
    >>> legacy_rotary_bytes(resolve_model("llama-2-13b"), 2)  # 2 tables · 40 layers · 4096 · 128 · 2 bytes
    83886080
    """
    if m.family not in FAMILIES or m.learned_positions or not m.max_position_embeddings:
        return 0
    return 2 * m.num_layers * m.max_position_embeddings * m.head_dim * dtype_bytes
