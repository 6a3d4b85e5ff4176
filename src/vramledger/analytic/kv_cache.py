"""Which KV cache ``generate`` uses, and what each kind holds while a decode step runs.

Legend: S = P + N − 1 cached tokens at the end of ``generate``, per_tok = K and V bytes of one token in every
layer (``evaluation.kv_cache_bytes``).

- ``DynamicCache`` (transformers ≥ 4.36 by default; the only cache of 5.x unless ``cache_implementation`` says
  otherwise): ``cache_utils.py`` ``DynamicLayer.update`` ``torch.cat``s the new token onto one layer's K and V and
  drops the old tensors, so a decode step holds the cache plus one layer's old K/V being replaced.
- ``StaticCache`` (``cache_implementation="static"``; LitGPT's ``set_kv_cache`` is the same idea): S tokens per
  layer preallocated at the first update, written in place.
- The legacy tuple cache (transformers before 4.36, e.g. ``modeling_llama.py`` of 4.32): each layer returns
  ``present = (torch.cat([past_key, key]), torch.cat([past_value, value]))`` while ``generate``'s
  ``model_kwargs["past_key_values"]`` still holds the previous step's tuple until the forward returns: at the
  end of a decode step both the old cache (S − 1 tokens) and the new one (S tokens) are alive, about twice the
  cache. Those versions also computed the prefill's logits for every prompt token and upcast them to fp32
  (``logits = logits.float()`` in ``LlamaForCausalLM.forward``; ``logits_to_keep`` arrived in 4.45):
  (c + 4)·B·P·V at the prefill instead of (c + 4)·B·V.
"""

from __future__ import annotations

from vramledger.specs.cache import CacheKind

__all__ = ["CacheKind", "decode_step_extra", "prefill_logits_tokens"]

SRC_LEGACY = (
    "transformers < 4.36 modeling_llama.py: present = torch.cat(past, new) per layer while generate still holds "
    "the previous past_key_values tuple: the old cache (S−1 tokens) and the new one coexist at the step's end"
)
SRC_LEGACY_LOGITS = (
    "transformers < 4.45 LlamaForCausalLM.forward: lm_head on every prompt token, then logits.float() "
    "(no logits_to_keep): (c + 4)·B·P·V at the prefill"
)


def decode_step_extra(kind: CacheKind, *, at_end: int, per_layer_step: int, new_tokens: int, cached: int) -> int:
    """Bytes alive beside the cache at the end of the last decode step, by cache kind.

    ``at_end`` is the cache of ``cached`` = S tokens; the legacy tuple cache keeps the previous step's S − 1 tokens
    in every layer (``at_end``·(S − 1)/S); the dynamic one a single layer's old K/V (``per_layer_step``); the static
    one nothing. With one new token there is no decode step.
    """
    if kind is CacheKind.STATIC or new_tokens <= 1:
        return 0
    if kind is CacheKind.LEGACY:
        return at_end * (cached - 1) // cached
    return per_layer_step


def prefill_logits_tokens(kind: CacheKind, prompt: int) -> int:
    """Prompt positions whose logits the prefill computes: all of them before ``logits_to_keep`` (legacy), else 1."""
    return prompt if kind is CacheKind.LEGACY else 1
