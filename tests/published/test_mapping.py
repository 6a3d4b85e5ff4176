"""bench/published: the mapping of the 200 published figures parses, names real CSV rows, and every expressible row
runs through ``estimate``. Accuracy is recorded in docs/published.md, not asserted here (the figures are
evidence, not targets)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "published"


def _runner():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("published_run", BENCH / "run.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["published_run"] = mod
    spec.loader.exec_module(mod)
    return mod


run = _runner()


def test_every_csv_row_is_mapped_or_listed_once() -> None:
    # load_mapping checks that each row id exists, that its model and value match the CSV, and that every CSV
    # row is either mapped or listed as unexpressible (raising otherwise).
    csv_rows = run.read_csv()
    assert len(csv_rows) == 200
    mapping = run.load_mapping()
    mapped = {r.row for r in mapping.rows}
    listed = {n for n, _ in mapping.unexpressible}
    assert not mapped & listed
    assert mapped | listed == set(range(1, 201))
    for r in mapping.rows:
        assert r.judgement.strip(), r.row
        rec = csv_rows[r.row - 1]
        assert (r.metric == "oom") == (rec["metric"] == "OOM")


def test_a_drifted_row_id_is_caught(tmp_path: Path) -> None:
    text = (
        (BENCH / "mapping.yaml")
        .read_text()
        .replace("{row: 11, ", "{row: 12, ", 1)
        .replace("{row: 12, profile: litgpt23-qlora", "{row: 11, profile: litgpt23-qlora", 1)
    )
    bad = tmp_path / "mapping.yaml"
    bad.write_text(text)
    with pytest.raises(ValueError, match="but the CSV has"):
        run.load_mapping(bad)


def test_committed_csv_is_the_shared_one() -> None:
    candidates = [base / "shared" / "data" / "published_memory.csv" for base in (ROOT.parent, ROOT.parents[1])]
    shared = next((c for c in candidates if c.exists()), None)
    if shared is None:
        pytest.skip("no ../shared checkout here (users' clones have only the committed copy)")
    assert (BENCH / "published_memory.csv").read_bytes() == shared.read_bytes()


def test_estimate_runs_on_every_expressible_row() -> None:
    mapping = run.load_mapping()
    results = run.run(mapping, "estimate")
    assert len(results) == len(mapping.rows)
    for r in results:
        assert math.isfinite(r.predicted_gb) and r.predicted_gb > 0, r.row.row
        if r.error is not None:
            print(
                f"row {r.row.row}: measured {r.row.measured_gb} GB, estimate {r.predicted_gb:.2f} GB "
                f"({100 * r.error:+.1f}%)"
            )
    lines = run.table_lines(results, mapping, markdown=True) + run.unexpressible_lines(mapping, markdown=True)
    assert any(line.startswith("| all sources | allocated |") for line in lines)


# Published parameter counts of the four configs bundled in bench/published/models (Hugging Face model pages).
PUBLISHED = {
    "tinyllama-1.1b": 1_100_048_384,
    "gemma-2b": 2_506_172_416,
    "gemma-7b": 8_537_680_896,
    "codellama-34b": 33_743_970_304,
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_bundled_configs_give_the_published_parameter_count(name: str) -> None:
    from vramledger.analytic.params import count_params
    from vramledger.catalog import resolve_model

    assert count_params(resolve_model(str(BENCH / "models" / f"{name}.json"))) == PUBLISHED[name]


def test_distributed_settings_reach_the_estimate() -> None:
    # Rows 149 and 146 are the same TinyLlama pretraining step (litgpt extensions/thunder), on one GPU and under DDP
    # on 8. As published, DDP adds 32.04 - 29.84 = 2.20 GB: the buckets' second copy of the bf16 gradients (Fabric's
    # DDPStrategy leaves gradient_as_bucket_view=False). TinyLlama-1.1B has 1,100,048,384 parameters by hand: 22 layers
    # of q, o 2048² + k, v 2048·256 + MLP 3·2048·5632 + 2 norms of 2048, an untied 32000×2048 embedding and head,
    # and a final norm. If world_size did not reach TrainSpec, the two predictions would be equal.
    mapping = run.load_mapping()
    rows = {r.row.row: r for r in run.run(mapping, "estimate") if r.row.row in (146, 149)}
    params = 22 * (2 * 2048**2 + 2 * 2048 * 256 + 3 * 2048 * 5632 + 2 * 2048) + 2 * 32000 * 2048 + 2048
    assert params == 1_100_048_384
    added = (rows[146].predicted_gb - rows[149].predicted_gb) * 1e9
    assert added == pytest.approx(2 * params, rel=1e-6)


def test_a_percent_reading_is_what_the_source_converted_with_a_nominal_80_gb() -> None:
    """PEFT's guides print '64 GB (80%)' and '72-80 GB (90-98%)': GB = percent × a nominal 80 GB, so the reading
    is the percentage (W&B's NVML used / total), and the mapping compares with that share of the card's NVML total.
    Checked against the CSV's own quotation of each source, row by row."""
    import re

    import yaml

    csv_rows = run.read_csv()
    entries = [e for e in yaml.safe_load((BENCH / "mapping.yaml").read_text())["rows"] if "reading" in e]
    assert {e["row"] for e in entries} == {162, 164}
    for e in entries:
        quoted = re.search(r"(\d+)(?:-(\d+))? GB \((\d+)(?:-(\d+))?%\)", csv_rows[e["row"] - 1]["notes"])
        assert quoted, e["row"]
        gb = [float(g) for g in quoted.group(1, 2) if g]
        pct = [float(p) for p in quoted.group(3, 4) if p]
        assert math.isclose(gb[0], pct[0] / 100 * 80)  # the lower figure is the nominal conversion
        assert e["reading"]["percent"] == pct[0]  # the training level, not the save spike at the top
        # NVML's total of an H100 80GB HBM3, 81,559 MiB (nvidia-smi), not torch's total_memory
        assert e["reading"]["total_bytes"] == 81_559 * 2**20
    by_row = {r.row: r for r in run.load_mapping().rows}
    assert math.isclose(by_row[162].measured_gb or 0, 0.80 * 81_559 * 2**20 / 1e9)
