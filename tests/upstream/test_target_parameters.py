"""The two axolotl examples that offer ``lora_target_parameters`` leave the block commented out (gpt-oss: "TODO: not
supported for now"; Qwen3-30B-A3B: "Target routed experts … use lora_target_parameters"), so the verbatim files
estimate without it (test_corpus.py ``EXPECT``: no target parameters). Here each is run with its block uncommented,
as a user following the comment would: the estimate must read the names the block lists and count the adapters
PEFT makes from them, on the model transformers builds from the catalog config (``get_nb_trainable_parameters``)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import yaml

from tests.analytic.test_target_parameters import _peft_count
from vramledger.analytic.target_parameters import CHECKPOINT_WRAPPER_SEGMENT
from vramledger.catalog import catalog_entry
from vramledger.cli import main

HERE = Path(__file__).parent / "axolotl"
FILES = {
    "examples/gpt-oss/gpt-oss-20b-sft-lora-singlegpu.yaml": "gpt-oss-20b",
    "examples/expert_parallel/qwen3_30ba3b_ep_lora_4gpu.yaml": "qwen3-30b-a3b",
}


def uncommented(text: str) -> str:
    """The file with its commented ``lora_target_parameters`` block (the key and the list items under it)
    uncommented: the comment marker the key line carries (``#`` or ``# ``) removed from it and its items."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip("# ").startswith("lora_target_parameters:"))
    marker = lines[start][: lines[start].index("lora_target_parameters")]
    lines[start] = lines[start][len(marker) :]
    i = start + 1
    while i < len(lines) and lines[i].startswith(marker) and lines[i][len(marker) :].lstrip().startswith("- "):
        lines[i] = lines[i][len(marker) :]
        i += 1
    assert i > start + 1, "no list items under the key"
    return "\n".join(lines) + "\n"


def _estimate(path: Path) -> dict[str, object]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["estimate", "--config", str(path), "--json"])
    assert code == 0, err.getvalue()
    return dict(json.loads(out.getvalue()))


@pytest.mark.parametrize("config", sorted(FILES))
def test_the_commented_block_uncommented(config: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    verbatim = (HERE / config).read_text()
    text = uncommented(verbatim)
    raw = yaml.safe_load(text)
    listed = tuple(raw["lora_target_parameters"])
    path = tmp_path / Path(config).name
    path.write_text(text)
    before = _estimate(HERE / config)
    after = _estimate(path)
    settings = after["settings"]
    assert isinstance(settings, dict)
    assert tuple(settings["lora"]["target_parameters"]) == listed

    entry = catalog_entry(FILES[config])
    assert entry is not None
    targets = "all-linear" if raw.get("lora_target_linear") else tuple(raw["lora_target_modules"])
    names = tuple(t.replace(CHECKPOINT_WRAPPER_SEGMENT, "") for t in listed)
    want = _peft_count(entry.config, targets, names, int(raw["lora_r"]))
    print(
        config,
        "trainable",
        before["trainable_params"],
        "→",
        after["trainable_params"],
        "(PEFT:",
        want,
        ") peak allocated",
        before["peak_allocated_bytes"],
        "→",
        after["peak_allocated_bytes"],
    )
    assert after["trainable_params"] == want
    assert after["trainable_params"] > before["trainable_params"]  # type: ignore[operator]
