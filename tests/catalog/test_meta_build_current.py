"""The meta-device builds stored in the catalog (``meta_build``) are what transformers builds today.

Catalog models without formulas carry their meta-built spec so that listing and estimating them stays instant;
this rebuilds each one from its config with the installed transformers and compares every stored field."""

from __future__ import annotations

from typing import Any

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
    fresh = spec_to_json(model_spec_from_config(entry.config, name=entry.hub_id, source="test"))
    # every built figure equal; the transformers version the stored build names is its provenance, not a figure
    assert _figures(fresh) == _figures(entry.meta_build)
    assert entry.spec().inventory.total_params == fresh["inventory"]["total_params"]


def _figures(build: dict[str, Any]) -> dict[str, Any]:
    inventory = {k: v for k, v in build["inventory"].items() if k != "transformers_version"}
    return build | {"inventory": inventory}
