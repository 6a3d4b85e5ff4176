"""The config real code builds Gemma 3 from: the catalog keeps Gemma 3's multimodal config.json (``gemma3`` with a
``text_config``), whose decoder vramledger sizes; trace and measure must build that decoder. Before, the whole
multimodal dict went to ``AutoConfig.for_model("gemma3_text", ...)`` and ``vramledger trace gemma-3-4b`` failed
with "'dict' object has no attribute 'to_dict'"."""

from __future__ import annotations

import pytest

from tests.catalog.test_params import siglip_and_projector_params
from vramledger.catalog import catalog_entry, resolve_model
from vramledger.catalog.config_of import config_of


@pytest.mark.parametrize("key", ["gemma-3-4b", "gemma-3-12b"])
def test_gemma3_builds_its_decoder_with_the_published_count(key: str) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = config_of(resolve_model(key))
    assert "text_config" not in cfg and cfg["model_type"] == "gemma3_text"
    model_type = cfg.pop("model_type")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **cfg))
    entry = catalog_entry(key)
    assert entry is not None and entry.published_params is not None
    # the hub's published total less the SigLIP tower and projector derived by hand in tests/catalog/test_params.py
    vision = entry.config["vision_config"]
    text_hidden = entry.config["text_config"]["hidden_size"]
    expected = entry.published_params - siglip_and_projector_params(vision, text_hidden)
    assert sum(p.numel() for p in model.parameters()) == expected
