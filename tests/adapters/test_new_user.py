"""What a new user met in the adapters: torchtune's base/instruct builders, axolotl's 8-bit base described as int8."""

from __future__ import annotations

from pathlib import Path

import pytest

from vramledger.adapters import load_config
from vramledger.catalog import resolve_model
from vramledger.errors import VramledgerError

F = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize(
    ("builder", "hub_id", "catalog_key"),
    [
        # torchtune/models/qwen2_5/__init__.py exports qwen2_5_7b_instruct / _base and their lora_ twins
        ("torchtune.models.qwen2_5.lora_qwen2_5_7b_instruct", "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B"),
        ("torchtune.models.qwen2_5.qwen2_5_14b_base", "Qwen/Qwen2.5-14B", "Qwen/Qwen2.5-14B"),
        # torchtune/models/qwen3/_model_builders.py: qwen3_8b_instruct loads the hybrid Qwen/Qwen3-8B
        ("torchtune.models.qwen3.lora_qwen3_8b_instruct", "Qwen/Qwen3-8B", "Qwen/Qwen3-8B"),
    ],
)
def test_torchtune_base_and_instruct_builders(tmp_path: Path, builder: str, hub_id: str, catalog_key: str) -> None:
    text = (F / "torchtune_llama3_8B_lora_single_device.yaml").read_text()
    cfg = tmp_path / "tt.yaml"
    cfg.write_text(text.replace("torchtune.models.llama3.lora_llama3_8b", builder))
    rc = load_config(cfg)
    assert rc.model == hub_id  # the checkpoint the builder stands for, instruct kept
    spec = resolve_model(rc.model)
    assert spec.name == hub_id  # the name the user gave is kept
    assert (spec.config_name or spec.name) == catalog_key  # and the catalog knows its shapes


def test_an_unknown_torchtune_builder_is_named_not_called_no_model(tmp_path: Path) -> None:
    text = (F / "torchtune_llama3_8B_lora_single_device.yaml").read_text()
    cfg = tmp_path / "tt.yaml"
    cfg.write_text(text.replace("torchtune.models.llama3.lora_llama3_8b", "torchtune.models.foo.lora_foo_9b"))
    with pytest.raises(VramledgerError, match=r"the torchtune builder 'foo_9b' \(model._component_\) is not in"):
        load_config(cfg)


def test_axolotl_load_in_8bit_is_described_as_int8() -> None:
    rc = load_config(F / "axolotl_llama3_lora_8b.yml")
    assert rc.train.quant is not None and rc.train.quant.bits == 8
    assert "int8" in rc.provenance["quant"] and "nf4" not in rc.provenance["quant"]
