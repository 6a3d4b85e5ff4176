"""The meta-device builds stored in the catalog (``meta_build``) are what transformers builds today.

Catalog models without formulas carry their meta-built spec so that listing and estimating them stays instant;
this rebuilds each one from its config with the installed transformers and compares every stored field."""

from __future__ import annotations

import pytest

from vramledger.catalog import model_entries
from vramledger.catalog.hfconfig import model_spec_from_config
from vramledger.catalog.inventory import spec_to_json

pytest.importorskip("transformers")

META = sorted(k for k, e in model_entries().items() if e.meta_build is not None)


def test_the_new_families_are_stored_built() -> None:
    assert {"gpt-oss-20b", "deepseek-v2-lite", "llama-4-scout", "qwen2.5-vl-7b"} <= set(META)


@pytest.mark.parametrize("key", META, ids=META)
def test_stored_build_equals_a_fresh_one(key: str) -> None:
    entry = model_entries()[key]
    fresh = model_spec_from_config(entry.config, name=entry.hub_id, source="test")
    assert spec_to_json(fresh) == entry.meta_build
    assert entry.spec().inventory == fresh.inventory
