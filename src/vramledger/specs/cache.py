"""Which KV cache a ``generate`` call keeps (what each holds: ``analytic/kv_cache.py``)."""

from __future__ import annotations

import enum


class CacheKind(str, enum.Enum):
    """The KV cache a ``generate`` call keeps."""

    DYNAMIC = "dynamic"
    """``DynamicCache``: transformers ≥ 4.36 default (5.x)."""
    STATIC = "static"
    """``StaticCache``: ``cache_implementation="static"``, preallocated for S tokens."""
    LEGACY = "legacy"
    """The tuple of (K, V) per layer of transformers < 4.36: about twice the cache during a decode step."""

    @property
    def display(self) -> str:
        return _DISPLAY[self]


_DISPLAY = {
    CacheKind.DYNAMIC: "DynamicCache (transformers ≥ 4.36)",
    CacheKind.STATIC: "StaticCache (preallocated)",
    CacheKind.LEGACY: "legacy tuple cache (transformers < 4.36)",
}
