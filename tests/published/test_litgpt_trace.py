"""bench/published/litgpt_trace.jsonl, the committed trace of LitGPT's own training step per LitGPT row, read
without re-tracing: every record names the CSV's figure and the setup mapping.yaml gives the row, the commit it
replays is the one the source names, and every LitGPT row the estimate maps is traced or says why not."""

from __future__ import annotations

import math
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.published.test_mapping import run

MIRROR = Path("/work/.mirror/Lightning-AI+litgpt/repo")
"""A bare git mirror of Lightning-AI/litgpt (litgpt_trace.py's default); the commit checks skip without it."""

RECORDS = run.read_litgpt_trace()
CSV = run.read_csv()
MAPPING = run.load_mapping()
LITGPT_ROWS = [r for r in MAPPING.rows if r.setup.get("model_code") in ("litgpt", "lit-gpt-2023")]


def test_every_mapped_litgpt_row_is_traced_or_says_why_not() -> None:
    assert len(LITGPT_ROWS) >= 60  # the resource tables, config_hub and the thunder pretraining rows
    for r in LITGPT_ROWS:
        rec = RECORDS.get(r.row)
        assert rec is not None, f"row {r.row}: no record (run litgpt_trace.py --only {r.row})"
        s = r.setup
        # What a replay on fake tensors can run, stated from the setup alone: a bf16-true training step (QLoRA
        # included: bitsandbytes' kernels are stood in for) on one GPU, or under FSDP1 FULL_SHARD with the fine-tuning
        # scripts of the resource tables and config_hub (on a fake process group).
        source = CSV[r.row - 1]["source"]
        fsdp1 = (
            s.get("fsdp") == "full_shard"
            and s.get("fsdp_version") == 1
            and ("resource-tables" in source or "config_hub" in source)
        )
        replayable = (
            s.get("mode", "train") == "train"
            and (int(s.get("world_size", 1)) == 1 or fsdp1)
            and s.get("precision") == "bf16-true"
        )
        assert rec["traced"] is replayable, (r.row, rec.get("reason"))
        if not rec["traced"]:
            assert rec["reason"].strip(), r.row


@pytest.mark.parametrize("n", sorted(RECORDS))
def test_record_names_the_csv_figure_and_its_error(n: int) -> None:
    rec, csv_row = RECORDS[n], CSV[n - 1]
    assert "Lightning-AI/litgpt" in csv_row["source"], n
    if csv_row["metric"] == "OOM":
        assert rec["measured_gb"] is None and rec["setup"]["metric"] == "oom", n
    else:
        assert rec["measured_gb"] == float(csv_row["value_gb"]), n
    if rec["traced"] and rec["measured_gb"] is not None:
        assert rec["error"] == pytest.approx(rec["peak_bytes"] / 1e9 / float(csv_row["value_gb"]) - 1, abs=1e-5)


def test_record_setups_are_the_mappings() -> None:
    # A record traced before its row's mapping changed would compare an old setup with the figure.
    by_row = {r.row: r for r in MAPPING.rows}
    for n, rec in RECORDS.items():
        if n in by_row:
            setup = by_row[n].setup
            assert {k: setup.get(k) for k in rec["setup"]} == rec["setup"], n


def test_a_stale_record_is_not_compared() -> None:
    row = next(r for r in LITGPT_ROWS if RECORDS[r.row]["traced"] and r.metric == "allocated")
    rec: dict[str, Any] = {**RECORDS[row.row], "setup": {**RECORDS[row.row]["setup"], "batch": 99}}
    assert "stale" in run.litgpt_trace_result(row, rec)
    fresh = run.litgpt_trace_result(row, RECORDS[row.row])
    assert isinstance(fresh, run.Result) and math.isclose(fresh.error, RECORDS[row.row]["error"], abs_tol=1e-5)


def test_2023_rows_replay_the_commit_their_table_names() -> None:
    for n, rec in RECORDS.items():
        source = CSV[n - 1]["source"]
        if "resource-tables.md" in source:
            assert re.search(r"lit-gpt commit (\w+)", source).group(1) == rec["commit"], n  # type: ignore[union-attr]


def _show(commit: str, path: str) -> str:
    out = subprocess.run(
        ["git", "--git-dir", str(MIRROR), "show", f"{commit}:{path}"], capture_output=True, text=True, check=True
    )
    return out.stdout


@pytest.mark.skipif(not MIRROR.exists(), reason="no LitGPT mirror here")
def test_2024_rows_replay_a_commit_whose_table_holds_their_figure() -> None:
    # config_hub/finetune/README.md at the record's commit has the row's figure on a line of the same yaml kind;
    # extensions/thunder/README.md at its commit has the figure.
    checked = 0
    for n, rec in RECORDS.items():
        if not rec["traced"]:
            continue
        source, value = CSV[n - 1]["source"], CSV[n - 1]["value_gb"] or "OOM"
        if "config_hub/finetune/README.md" in source:
            yaml = source.split("::")[-1].strip()
            lines = _show(rec["commit"], "config_hub/finetune/README.md").splitlines()
            # The yaml's file (lora.yaml, qlora.yaml, full.yaml) and the figure on one line; the directory is not
            # compared: the README spells one of them "gemma2b/qlora.yaml" where the CSV has gemma2-2b/qlora.yaml.
            figure = re.compile(rf"\|\s*{re.escape(value)}\b")
            kind = yaml.split("/")[-1]
            assert any(
                line.split("|")[1].strip().endswith(f"/{kind}") and figure.search(line)
                for line in lines
                if line.startswith("| ")
            ), (n, yaml, value)
            checked += 1
        elif "extensions/thunder/README.md" in source:
            assert re.search(rf"\|\s*{re.escape(value)}\s*\|", _show(rec["commit"], "extensions/thunder/README.md")), n
            checked += 1
    assert checked >= 20


FSDP_RECORDS = [rec for rec in RECORDS.values() if rec.get("fsdp") and rec["longest_first"]]


def test_fsdp_rows_measured_figure_lies_between_the_first_micro_step_and_the_steady_state() -> None:
    """lit-gpt 8641822's multi-GPU LoRA rows replayed under FSDP1 (no_sync): the first micro-step (the longest
    sample, with no unsharded gradient before its backward) is a lower bound of the run's peak, and the steady
    state at that length (a previous micro-step of the same length and the kept gradients beside it) an upper one;
    every published figure lies between, and a later micro-step's peak grows with its length between them."""
    rows = [rec for rec in FSDP_RECORDS if rec["measured_gb"]]
    assert {rec["row"] for rec in rows} >= {36, 37, 38, 39, 40, 41, 42, 43, 44, 46}
    for rec in rows:
        first, steady, measured = rec["first_step_peak_bytes"], rec["steady_peak_bytes"], rec["measured_gb"] * 1e9
        later = [b for _, b in sorted((int(n), b) for n, b in rec["later_peak_bytes"].items())]
        print(rec["row"], "first", first, "measured", measured, "steady", steady, "later", later)
        assert first <= measured <= steady, rec["row"]
        assert later == sorted(later) and later[-1] <= steady, rec["row"]
        assert rec["peak_bytes"] == steady  # the figure compared: the upper bound
