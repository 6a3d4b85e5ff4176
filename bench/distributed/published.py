"""The multi-GPU rows of the published measurements against the estimate: a view of the general benchmark.

The rows, their settings and the judgement of what was assumed live in one place, bench/published/mapping.yaml
(read by bench/published/run.py, which predicts every published row on its own metric). This script keeps the
rows of that mapping that run on several GPUs (``world_size`` above 1: DDP, FSDP, DeepSpeed ZeRO, offload) and prints
them as the table of docs/distributed.md. Multi-GPU rows whose architecture has no bundled config are listed in the
mapping's ``unexpressible`` section with the feature they miss.

Run:  python bench/distributed/published.py            # the markdown table of docs/distributed.md
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))


def _general() -> ModuleType:
    """bench/published/run.py, loaded by path (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("published_run", ROOT / "bench" / "published" / "run.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["published_run"] = mod
    spec.loader.exec_module(mod)
    return mod


def _engine(setup: dict[str, Any]) -> str:
    if setup.get("zero_stage"):
        engine = f"ZeRO-{setup['zero_stage']}"
    elif setup.get("fsdp"):
        engine = f"FSDP{setup.get('fsdp_version', 2)} {setup['fsdp']}"
    else:
        engine = "DDP"
    return engine + (" + offload" if setup.get("offload_params") or setup.get("offload_optimizer") else "")


def table() -> str:
    run = _general()
    mapping = run.load_mapping()
    multi = [r for r in mapping.rows if int(r.setup.get("world_size", 1)) > 1]
    results = run.run(run.Mapping_(rows=tuple(multi), unexpressible=()), "estimate")
    lines = [
        "| row | source | model | engine | GPUs | metric | published | ours | error |",
        "|---:|---|---|---|---:|---|---:|---:|---:|",
    ]
    for r in results:
        s = r.row.setup
        published = "OOM" if r.row.measured_gb is None else f"{r.row.measured_gb:.2f} GB"
        if r.error is None:  # the general benchmark's rule: an OOM agrees when the device total exceeds the GPU
            error = "OOM predicted" if r.oom_agrees else "predicted to fit"
        else:
            error = f"{100 * r.error:+.0f}%"
        lines.append(
            f"| {r.row.row} | {r.row.source} | {str(s['model']).removeprefix('models/')} | {_engine(s)} | "
            f"{s['world_size']} | {r.row.metric} | {published} | {r.predicted_gb:.2f} GB | {error} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
