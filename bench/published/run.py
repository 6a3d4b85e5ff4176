"""Compare vramledger with 200 published GPU memory figures (published_memory.csv), each on its own metric.

mapping.yaml maps every row vramledger can express to a setup (with a one-line judgement of what was assumed)
and lists the rest with the feature they miss. This runner predicts each expressible row and compares it with
the row's own metric: ``allocated`` with ``torch.cuda.max_memory_allocated``, ``reserved`` with
``max_memory_reserved``, ``device`` with an NVML / nvidia-smi total, ``allocated_plus_context`` with optimum's
"torch peak allocated + (NVML − torch reserved)". ``oom`` rows say the run did not fit: the prediction agrees
when its device total exceeds the GPU's capacity.

  PYTHONPATH=src python bench/published/run.py                 # estimate every row (a few seconds)
  PYTHONPATH=src python bench/published/run.py --markdown      # the tables as Markdown (docs/published.md)
  PYTHONPATH=src python bench/published/run.py --rows          # one line per row: measured, predicted, error
  PYTHONPATH=src python bench/published/run.py --trace --markdown  # also the trace table (2 min; LitGPT's rows
                                                                   # are read from litgpt_trace.jsonl)
  nice -n 10 env PYTHONPATH=src python bench/published/litgpt_trace.py --redo   # re-trace LitGPT's rows (~30 min)

Errors are signed: (predicted − measured) / measured; an under-estimate is negative.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import re
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
CSV_PATH = HERE / "published_memory.csv"
MAPPING = HERE / "mapping.yaml"
LITGPT_TRACE = HERE / "litgpt_trace.jsonl"
"""LitGPT's own training step traced at each LitGPT row's commit (written by litgpt_trace.py, read by ``--trace``)."""
UNDER = -0.03
"""An under-estimate beyond −3% is the failure that matters: it fits on paper and OOMs on the GPU."""

METRICS = ("allocated", "reserved", "device", "allocated_plus_context", "oom")
SETUP_KEYS = {
    "model", "mode", "method", "lora_rank", "lora_alpha", "lora_targets", "lora_dropout", "adapter_fp32",
    "modules_to_save", "precision", "optimizer", "batch", "seq", "accum", "grad_ckpt", "attn", "loss",
    "loss_chunk", "packing", "world_size", "zero_stage", "fsdp", "fsdp_version", "offload_optimizer",
    "offload_params", "model_code", "legacy_bitsandbytes", "quant", "untie_embeddings", "prompt", "new_tokens",
    "cache", "base_dtype", "metric", "gpu", "bnb_compute",
}  # fmt: skip
ROW_KEYS = SETUP_KEYS | {"row", "profile", "csv_model", "csv_value", "judgement", "reading"}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    """One expressible CSV row: its setup (profile merged) and what the CSV says."""

    row: int
    """1-based data row of published_memory.csv (the header is row 0)."""
    setup: Mapping[str, Any]
    judgement: str
    source: str
    metric: str
    measured_gb: float | None
    """Decimal GB (None for ``oom`` rows)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Mapping_:
    rows: tuple[Row, ...]
    unexpressible: tuple[tuple[int, str], ...]
    """(row, missing feature)."""


def read_csv(path: Path = CSV_PATH) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def short_source(source: str) -> str:
    """``github:Lightning-AI/litgpt tutorials/x.md (…) :: …`` → ``litgpt tutorials/x.md``."""
    m = re.match(r"github:[^/]+/(\S+) (\S+)", source)
    return f"{m.group(1)} {m.group(2)}" if m else source.split("(")[0].strip()


def load_mapping(path: Path = MAPPING, csv_rows: list[dict[str, str]] | None = None) -> Mapping_:
    """The mapping with profiles merged, checked against the CSV (row ids, model names and values must match)."""
    csv_rows = read_csv() if csv_rows is None else csv_rows
    raw = yaml.safe_load(path.read_text())
    profiles: dict[str, dict[str, Any]] = raw.get("profiles", {})
    rows: list[Row] = []
    seen: set[int] = set()
    for entry in raw["rows"]:
        unknown = sorted(set(entry) - ROW_KEYS)
        if unknown:
            raise ValueError(f"mapping row {entry.get('row')}: unknown keys {unknown}")
        n = int(entry["row"])
        if n in seen:
            raise ValueError(f"mapping: row {n} appears twice")
        seen.add(n)
        if not 1 <= n <= len(csv_rows):
            raise ValueError(f"mapping row {n}: the CSV has rows 1-{len(csv_rows)}")
        rec = csv_rows[n - 1]
        if entry.get("csv_model") != rec["model"] or str(entry.get("csv_value", "")) != rec["value_gb"]:
            raise ValueError(
                f"mapping row {n}: says {entry.get('csv_model')!r} {entry.get('csv_value')!r} but the CSV has "
                f"{rec['model']!r} {rec['value_gb']!r}"
            )
        profile = entry.get("profile")
        if profile is not None and profile not in profiles:
            raise ValueError(f"mapping row {n}: unknown profile {profile!r}")
        setup = {
            **(profiles.get(profile, {}) if profile else {}),
            **{k: v for k, v in entry.items() if k in SETUP_KEYS},
        }
        unknown = sorted(set(setup) - SETUP_KEYS)
        if unknown:
            raise ValueError(f"mapping row {n}: unknown setup keys {unknown}")
        metric = setup.get("metric")
        if metric not in METRICS:
            raise ValueError(f"mapping row {n}: metric must be one of {METRICS} (got {metric!r})")
        if (metric == "oom") != (rec["metric"] == "OOM"):
            raise ValueError(f"mapping row {n}: metric {metric} but the CSV says {rec['metric']!r}")
        if not entry.get("judgement"):
            raise ValueError(f"mapping row {n}: a judgement (what was assumed and why) is required")
        rows.append(
            Row(
                row=n,
                setup=setup,
                judgement=entry["judgement"],
                source=short_source(rec["source"]),
                metric=metric,
                measured_gb=None if metric == "oom" else _measured_gb(n, rec, entry.get("reading")),
            )
        )
    unexpressible: list[tuple[int, str]] = []
    for group in raw.get("unexpressible", []):
        for n in group["rows"]:
            if n in seen:
                raise ValueError(f"mapping: row {n} is both mapped and unexpressible")
            seen.add(n)
            unexpressible.append((int(n), group["missing"]))
    missing = sorted(set(range(1, len(csv_rows) + 1)) - seen)
    if missing:
        raise ValueError(f"mapping: CSV rows {missing} are neither mapped nor listed as unexpressible")
    return Mapping_(rows=tuple(rows), unexpressible=tuple(unexpressible))


def read_litgpt_trace(path: Path = LITGPT_TRACE) -> dict[int, dict[str, Any]]:
    """litgpt_trace.py's records by row ({} when the file is absent)."""
    if not path.exists():
        return {}
    return {int(obj["row"]): obj for obj in map(json.loads, path.read_text().splitlines()) if obj}


def _measured_gb(n: int, rec: Mapping[str, str], reading: Mapping[str, Any] | None) -> float:
    """The row's figure in decimal GB: the CSV's value, or, where the source read a percentage off a monitor and
    converted it with the card's nominal size, that percentage of the card's real total (``reading``)."""
    if reading is None:
        return float(rec["value_gb"])
    if set(reading) != {"percent", "total_bytes"}:
        raise ValueError(f"mapping row {n}: reading takes percent and total_bytes (got {sorted(reading)})")
    return float(reading["percent"]) / 100 * int(reading["total_bytes"]) / 1e9


# -- setups -------------------------------------------------------------------------------------------------------
def _model(setup: Mapping[str, Any]) -> Any:
    from vramledger.catalog import resolve_model

    name = str(setup["model"])
    m = resolve_model(str(HERE / name) if name.startswith("models/") else name)
    if setup.get("untie_embeddings"):
        m = dataclasses.replace(m, tie_word_embeddings=False)
    return m


def _quant(text: str | None, compute: str | None = None) -> Any:
    from vramledger.specs import DType, QuantSpec

    if not text:
        return None
    if text == "int8":
        return QuantSpec(bits=8)
    kind, _, dq = text.partition("-")
    return QuantSpec(
        bits=4, quant_type=kind, double_quant=dq == "dq", compute_dtype=DType(compute) if compute else None
    )


def train_spec(setup: Mapping[str, Any]) -> Any:
    """The TrainSpec of a training row (vramledger's own names; see mapping.yaml's header)."""
    from vramledger.specs import (
        Attention,
        DType,
        LoraSpec,
        Loss,
        Method,
        ModelCode,
        Optimizer,
        Precision,
        Sharding,
        TrainSpec,
    )

    method = Method(setup.get("method", "lora"))
    lora = None
    if method in (Method.LORA, Method.QLORA):
        rank = int(setup.get("lora_rank", 8))
        lora = LoraSpec(
            rank=rank,
            alpha=float(setup.get("lora_alpha", 2 * rank)),
            targets=tuple(setup.get("lora_targets", ["all"])),
            dropout=float(setup.get("lora_dropout", 0.0)),
            adapter_fp32=bool(setup.get("adapter_fp32", True)),
            modules_to_save=tuple(setup.get("modules_to_save", ())),
        )
    base = setup.get("base_dtype")
    fsdp = setup.get("fsdp")
    return TrainSpec(
        method=method,
        precision=Precision(setup.get("precision", "bf16-mixed")),
        optimizer=Optimizer(setup.get("optimizer", "adamw_torch")),
        micro_batch=int(setup.get("batch", 1)),
        seq_len=int(setup.get("seq", 2048)),
        grad_accum=int(setup.get("accum", 1)),
        grad_ckpt=bool(setup.get("grad_ckpt", False)),
        attn=Attention(setup.get("attn", "sdpa")),
        loss=Loss(setup.get("loss", "standard")),
        loss_chunk_tokens=int(setup.get("loss_chunk", 1024)),
        packing=bool(setup.get("packing", False)),
        world_size=int(setup.get("world_size", 1)),
        zero_stage=int(setup.get("zero_stage", 0)),
        fsdp=Sharding(fsdp) if fsdp else None,
        fsdp_version=int(setup.get("fsdp_version", 2)),
        offload_optimizer=bool(setup.get("offload_optimizer", False)),
        offload_params=bool(setup.get("offload_params", False)),
        lora=lora,
        quant=_quant(setup.get("quant"), setup.get("bnb_compute")) if method is Method.QLORA else None,
        base_dtype=DType(base) if base else None,
        model_code=ModelCode(setup.get("model_code", "transformers")),
        legacy_bitsandbytes=bool(setup.get("legacy_bitsandbytes", False)),
    )


def infer_spec(setup: Mapping[str, Any]) -> Any:
    from vramledger.analytic.inference import InferSpec
    from vramledger.specs import Attention, CacheKind, DType, ModelCode

    return InferSpec(
        batch=int(setup.get("batch", 1)),
        prompt=int(setup.get("prompt", 16)),
        new_tokens=int(setup.get("new_tokens", 50)),
        dtype=DType(setup.get("precision", "bf16")),
        quant=_quant(setup.get("quant"), setup.get("bnb_compute")),
        attn=Attention(setup.get("attn", "sdpa")),
        cache=CacheKind(setup.get("cache", "dynamic")),
        model_code=ModelCode(setup.get("model_code", "transformers")),
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Prediction:
    allocated: int
    reserved: int
    device: int
    context: int


def predict(row: Row, engine: str = "estimate") -> Prediction | None:
    """Bytes for one row; None when the engine cannot run it (trace of an inference row)."""
    from vramledger.catalog import resolve_gpu
    from vramledger.ledger import Category, Phase

    s = row.setup
    gpu = resolve_gpu(s["gpu"]) if s.get("gpu") else None
    m = _model(s)
    if s.get("mode", "train") == "infer":
        if engine != "estimate":
            return None
        from vramledger.analytic.inference import infer_ledger

        ledger = infer_ledger(m, infer_spec(s), gpu=gpu)
    elif engine == "estimate":
        from vramledger.analytic import estimate

        ledger = estimate(m, train_spec(s), gpu=gpu)
    else:
        from vramledger.errors import VramledgerError
        from vramledger.specs import Optimizer
        from vramledger.trace.api import trace_step

        train = train_spec(s)
        if train.model_code.litgpt:  # `vramledger trace` runs transformers' layers, not LitGPT's
            raise VramledgerError("trace: LitGPT's own code is traced by litgpt_trace.py (read by run())")
        paged = train.optimizer.value.startswith("paged")
        if paged:
            # bitsandbytes does not run on fake tensors, and paged states are outside the allocator anyway:
            # trace with an optimizer that allocates nothing through torch, then add the managed bytes back.
            train = dataclasses.replace(train, optimizer=Optimizer.SGD, sgd_momentum=0.0)
        from vramledger.catalog.config_of import config_of as hf_config

        config = hf_config(m)
        if s.get("untie_embeddings"):
            config = {**config, "tie_word_embeddings": False}
        ledger = trace_step(m, train, gpu=gpu, config=config)
        if paged:
            from vramledger.analytic import estimate

            managed = estimate(m, train_spec(s), gpu=gpu).bytes_of(Category.MANAGED_MEMORY, Phase.OPTIMIZER)
            return Prediction(
                allocated=ledger.peak_allocated,
                reserved=ledger.peak_reserved,
                device=ledger.device_total + managed,
                context=ledger.bytes_of(Category.CUDA_CONTEXT, ledger.peak_phase),
            )
    peak = ledger.peak_phase
    return Prediction(
        allocated=ledger.peak_allocated,
        reserved=ledger.peak_reserved,
        device=ledger.device_total,
        context=ledger.bytes_of(Category.CUDA_CONTEXT, peak if peak in ledger.phases else Phase.LOAD),
    )


def predicted_gb(row: Row, p: Prediction) -> float:
    n = {
        "allocated": p.allocated,
        "reserved": p.reserved,
        "device": p.device,
        "allocated_plus_context": p.allocated + p.context,
        "oom": p.device,
    }[row.metric]
    return n / 1e9


def oom_agrees(row: Row, p: Prediction) -> bool:
    """An OOM row agrees when the predicted device total exceeds the GPU's whole capacity."""
    from vramledger.catalog import resolve_gpu

    return p.device > resolve_gpu(row.setup["gpu"]).memory_bytes


# -- results and tables -------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Result:
    row: Row
    engine: str
    predicted_gb: float
    error: float | None
    """Signed relative error; None for OOM rows."""
    oom_agrees: bool | None


def _is_litgpt(setup: Mapping[str, Any]) -> bool:
    from vramledger.specs import ModelCode

    return ModelCode(setup.get("model_code", "transformers")).litgpt


def litgpt_trace_result(row: Row, rec: Mapping[str, Any] | None) -> Result | str:
    """The trace of a LitGPT row: LitGPT's own step at the row's commit, read from litgpt_trace.jsonl (never traced
    here), or why there is none. The replay counts allocated bytes only, so an ``oom`` row agrees when its allocated
    peak alone, a lower bound of the device total, exceeds the GPU's capacity."""
    from vramledger.catalog import resolve_gpu

    if rec is None:
        return f"trace: not in {LITGPT_TRACE.name} (run litgpt_trace.py)"
    if not rec["traced"]:
        return f"trace: {rec['reason']}"
    stale = sorted(k for k, v in rec["setup"].items() if row.setup.get(k) != v)
    if stale:
        return f"trace: {LITGPT_TRACE.name} is stale (setup changed: run litgpt_trace.py --redo --only ROW)"
    gb = rec["peak_bytes"] / 1e9
    if row.metric == "oom":
        agrees = rec["peak_bytes"] > resolve_gpu(row.setup["gpu"]).memory_bytes
        return Result(row=row, engine="trace", predicted_gb=gb, error=None, oom_agrees=agrees)
    if row.metric != "allocated":
        return f"trace: LitGPT's step is counted in allocated bytes, not {row.metric}"
    assert row.measured_gb
    return Result(row=row, engine="trace", predicted_gb=gb, error=gb / row.measured_gb - 1, oom_agrees=None)


def litgpt_extra_results(mapping: Mapping_, records: Mapping[int, Mapping[str, Any]] | None = None) -> list[Result]:
    """The traced LitGPT rows that mapping.yaml lists as not expressible by the estimate (LitGPT's model families
    and adapters it lacks), compared with the CSV's figure."""
    records = read_litgpt_trace() if records is None else records
    csv_rows = read_csv()
    mapped = {r.row for r in mapping.rows}
    out = []
    for n, rec in sorted(records.items()):
        if n in mapped or not rec["traced"]:
            continue
        value = csv_rows[n - 1]["value_gb"]
        row = Row(
            row=n,
            setup=rec["setup"],
            judgement="not expressible by the estimate; traced with LitGPT's own code (litgpt_trace.py)",
            source=short_source(csv_rows[n - 1]["source"]),
            metric=rec["setup"]["metric"],
            measured_gb=float(value) if value else None,
        )
        result = litgpt_trace_result(row, rec)
        assert isinstance(result, Result), (n, result)
        out.append(result)
    return out


def run(mapping: Mapping_, engine: str = "estimate", skipped: dict[int, str] | None = None) -> list[Result]:
    """Predict every row; rows the engine cannot run go into ``skipped`` (row → reason). ``trace`` reads LitGPT's
    rows from litgpt_trace.jsonl and traces the others with ``vramledger trace`` (transformers + PEFT)."""
    from vramledger.errors import VramledgerError

    out = []
    seen: dict[str, Prediction | None] = {}
    litgpt = read_litgpt_trace() if engine == "trace" else {}
    for row in mapping.rows:
        if engine == "trace" and _is_litgpt(row.setup):
            result = litgpt_trace_result(row, litgpt.get(row.row))
            if isinstance(result, Result):
                out.append(result)
            elif skipped is not None:
                skipped[row.row] = result
            continue
        key = repr(sorted(row.setup.items()))  # rows with the same setup (e.g. 109 and 111) are predicted once
        try:
            p = seen[key] if key in seen else predict(row, engine)
            seen[key] = p
        except VramledgerError as exc:
            if skipped is None:
                raise
            skipped[row.row] = str(exc).split(";")[0]
            continue
        if p is None:
            if skipped is not None:
                skipped[row.row] = f"{engine}: inference row (the step replayed here is training)"
            continue
        gb = predicted_gb(row, p)
        if engine != "estimate":  # slow engines report as they go
            print(f"{engine} row {row.row}: {predicted_gb(row, p):.2f} GB", file=sys.stderr, flush=True)
        if row.metric == "oom":
            out.append(Result(row=row, engine=engine, predicted_gb=gb, error=None, oom_agrees=oom_agrees(row, p)))
        else:
            assert row.measured_gb
            out.append(Result(row=row, engine=engine, predicted_gb=gb, error=gb / row.measured_gb - 1, oom_agrees=None))
    return out


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Summary:
    source: str
    metric: str
    n: int
    median: float
    median_abs: float
    mean_abs: float
    worst: float
    worst_row: int
    under: int


def summarise(results: Iterable[Result]) -> list[Summary]:
    groups: dict[tuple[str, str], list[Result]] = defaultdict(list)
    for r in results:
        if r.error is not None:
            groups[(r.row.source, r.row.metric)].append(r)
            groups[("all sources", r.row.metric)].append(r)
    out = []
    for (source, metric), rs in sorted(groups.items(), key=lambda kv: (kv[0][0] == "all sources", kv[0])):
        errs = [r.error for r in rs if r.error is not None]
        worst = max(rs, key=lambda r: abs(r.error or 0.0))
        out.append(
            Summary(
                source=source,
                metric=metric,
                n=len(rs),
                median=statistics.median(errs),
                median_abs=statistics.median(abs(e) for e in errs),
                mean_abs=statistics.fmean(abs(e) for e in errs),
                worst=worst.error or 0.0,
                worst_row=worst.row.row,
                under=sum(e < UNDER for e in errs),
            )
        )
    return out


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


OOM_BASIS = {
    "estimate": "device total",
    "trace": "peak (LitGPT's step: its allocated peak alone, a lower bound of the device total)",
}
"""What an ``oom`` row's prediction is compared with the GPU's capacity on, per engine."""


def table_lines(results: list[Result], mapping: Mapping_, *, markdown: bool, title: str | None = None) -> list[str]:
    engine = results[0].engine if results else "estimate"
    head = ["source", "metric", "rows", "median", "median abs", "mean abs", "worst (row)", f"under {100 * UNDER:.0f}%"]
    body = [
        [
            s.source,
            s.metric,
            str(s.n),
            _pct(s.median),
            f"{100 * s.median_abs:.1f}%",
            f"{100 * s.mean_abs:.1f}%",
            f"{_pct(s.worst)} ({s.worst_row})",
            str(s.under),
        ]
        for s in summarise(results)
    ]
    ooms = [r for r in results if r.oom_agrees is not None]
    lines = [f"{title or engine}: {sum(r.error is not None for r in results)} rows with a value, {len(ooms)} OOM rows"]
    lines += [""] * markdown + _grid(head, body, markdown=markdown)
    if ooms:
        lines.append("")
        lines.append(
            f"OOM rows where the {engine} {OOM_BASIS[engine]} exceeds the GPU's capacity: "
            f"{sum(bool(r.oom_agrees) for r in ooms)} of {len(ooms)}"
            + "".join(f"; row {r.row.row} predicted {r.predicted_gb:.1f} GB" for r in ooms if not r.oom_agrees)
        )
    return lines


def unexpressible_lines(mapping: Mapping_, *, markdown: bool) -> list[str]:
    counts = Counter(missing for _, missing in mapping.unexpressible)
    rows: dict[str, list[int]] = defaultdict(list)
    for n, missing in mapping.unexpressible:
        rows[missing].append(n)
    body = [[str(c), missing, _ranges(rows[missing])] for missing, c in counts.most_common()]
    return [f"not expressible: {len(mapping.unexpressible)} rows", *[""] * markdown] + _grid(
        ["rows", "missing feature", "row ids"], body, markdown=markdown
    )


def skipped_lines(engine: str, skipped: Mapping[int, str], *, markdown: bool) -> list[str]:
    """The rows an engine did not run, counted by reason."""
    by_reason: dict[str, list[int]] = defaultdict(list)
    for n, why in skipped.items():
        by_reason[why.removeprefix(f"{engine}: ")].append(n)
    body = [[str(len(ns)), why, _ranges(ns)] for why, ns in sorted(by_reason.items(), key=lambda kv: -len(kv[1]))]
    head = [f"{engine}: {len(skipped)} rows not run", *[""] * markdown]
    return head + _grid(["rows", "why not", "row ids"], body, markdown=markdown)


def longest_first_lines(records: Mapping[int, Mapping[str, Any]], *, markdown: bool) -> list[str]:
    """LitGPT's rows whose script runs its longest sample first (litgpt_trace.py ``Script.longest_first``): the first
    micro-step's peak (the trace table's figure: the only micro-step at that length, nothing of a previous one alive)
    beside the steady state at that length, which such a run never reaches (an upper bound)."""
    rows = [r for _, r in sorted(records.items()) if r["traced"] and r["longest_first"] and r["measured_gb"]]
    rows = [r for r in rows if not r.get("fsdp")]  # fsdp_bounds_lines
    if not rows:
        return []
    body = []
    first_errs, steady_errs = [], []
    for rec in rows:
        m, first, steady = rec["measured_gb"], rec["first_step_peak_bytes"] / 1e9, rec["steady_peak_bytes"] / 1e9
        first_errs.append(first / m - 1)
        steady_errs.append(steady / m - 1)
        s = rec["setup"]
        method = s["method"] + (f" {s['quant']}" if s.get("quant") else "")
        body.append(
            [str(rec["row"]), str(s["model"]), method, f"{m:.2f}", f"{first:.2f}", _pct(first_errs[-1]),
             f"{steady:.2f}", _pct(steady_errs[-1])]
        )  # fmt: skip
    head = ["row", "model", "method", "measured GB", "first micro-step GB", "error", "steady state GB", "error"]
    title = (
        f"trace, LitGPT scripts that run their longest sample first: {len(rows)} rows; median |error| first "
        f"micro-step {100 * statistics.median(abs(e) for e in first_errs):.1f}%, steady state "
        f"{100 * statistics.median(abs(e) for e in steady_errs):.1f}%"
    )
    return [title, *[""] * markdown] + _grid(head, body, markdown=markdown)


def later_length(rec: Mapping[str, Any]) -> float | None:
    """The padded length of a later micro-step (after one of its own length) at which the FSDP trace reaches the
    measured figure, linear between the traced lengths; None outside them (litgpt_trace.py ``replay_fsdp``)."""
    points = sorted((int(n), b) for n, b in rec["later_peak_bytes"].items())
    points.append((int(rec["setup"]["seq"]), rec["steady_peak_bytes"]))
    want = rec["measured_gb"] * 1e9
    for (n0, b0), (n1, b1) in zip(points, points[1:], strict=False):
        if b0 <= want <= b1 and b1 > b0:
            return n0 + (want - b0) / (b1 - b0) * (n1 - n0)
    return None


def fsdp_bounds_lines(records: Mapping[int, Mapping[str, Any]], *, markdown: bool) -> list[str]:
    """LitGPT's FSDP1 rows (litgpt_trace.py ``replay_fsdp``): the first micro-step (the longest sample, no gradient
    before its backward) and the steady state at that length bound the run's peak, which is the longest later
    batch's; the later batch length at which the trace reaches the measured figure."""
    rows = [r for _, r in sorted(records.items()) if r["traced"] and r.get("fsdp") and r["longest_first"]]
    rows = [r for r in rows if r["measured_gb"]]
    if not rows:
        return []
    body = []
    for rec in rows:
        m, first, steady = rec["measured_gb"], rec["first_step_peak_bytes"] / 1e9, rec["steady_peak_bytes"] / 1e9
        n = later_length(rec)
        s = rec["setup"]
        body.append(
            [str(rec["row"]), str(s["model"]), str(s["batch"]), str(s["seq"]), f"{m:.2f}", f"{first:.2f}",
             _pct(first / m - 1), f"{steady:.2f}", _pct(steady / m - 1), "-" if n is None else f"{n:.0f}"]
        )  # fmt: skip
    head = ["row", "model", "micro-batch", "longest", "measured GB", "first micro-step GB", "error",
            "steady state GB", "error", "later batch length at the measured figure"]  # fmt: skip
    inside = sum(r["first_step_peak_bytes"] <= r["measured_gb"] * 1e9 <= r["steady_peak_bytes"] for r in rows)
    title = (
        f"trace, LitGPT FSDP1 rows (no_sync): {len(rows)} rows; the measured figure lies between the first micro-step "
        f"and the steady state in {inside}"
    )
    return [title, *[""] * markdown] + _grid(head, body, markdown=markdown)


def row_lines(results: list[Result], *, markdown: bool) -> list[str]:
    head = ["row", "source", "model", "metric", "measured GB", "predicted GB", "error"]
    body = []
    for r in results:
        measured = "OOM" if r.row.measured_gb is None else f"{r.row.measured_gb:.2f}"
        err = ("agrees" if r.oom_agrees else "DISAGREES") if r.error is None else _pct(r.error)
        body.append(
            [
                str(r.row.row),
                r.row.source,
                str(r.row.setup["model"]).removeprefix("models/"),
                r.row.metric,
                measured,
                f"{r.predicted_gb:.2f}",
                err,
            ]
        )
    return _grid(head, body, markdown=markdown)


def _ranges(ns: list[int]) -> str:
    ns = sorted(ns)
    out: list[str] = []
    start = prev = ns[0]
    for n in ns[1:] + [-1]:
        if n != prev + 1:
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = n
        prev = n
    return ", ".join(out)


def _grid(head: list[str], body: list[list[str]], *, markdown: bool) -> list[str]:
    if markdown:
        return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in body]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=False)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*head).rstrip(), "  ".join("-" * w for w in widths)] + [fmt.format(*r).rstrip() for r in body]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--trace",
        action="store_true",
        help="also the trace: LitGPT's rows from litgpt_trace.jsonl, the others traced (transformers + PEFT)",
    )
    ap.add_argument("--markdown", action="store_true", help="Markdown tables (for docs/published.md)")
    ap.add_argument("--rows", action="store_true", help="one line per row")
    args = ap.parse_args(argv)
    mapping = load_mapping()
    engines = ["estimate"] + (["trace"] if args.trace else [])
    out: list[str] = []
    for engine in engines:
        skipped: dict[int, str] = {}
        results = run(mapping, engine, skipped)
        out += table_lines(results, mapping, markdown=args.markdown) + [""]
        if skipped:
            out += skipped_lines(engine, skipped, markdown=args.markdown) + [""]
        if args.rows:
            out += row_lines(results, markdown=args.markdown) + [""]
        if engine == "trace" and (extra := litgpt_extra_results(mapping)):
            title = "trace, LitGPT rows the estimate cannot express"
            out += table_lines(extra, mapping, markdown=args.markdown, title=title) + [""]
            if args.rows:
                out += row_lines(extra, markdown=args.markdown) + [""]
        if engine == "trace" and (first := longest_first_lines(read_litgpt_trace(), markdown=args.markdown)):
            out += first + [""]
        if engine == "trace" and (bounds := fsdp_bounds_lines(read_litgpt_trace(), markdown=args.markdown)):
            out += bounds + [""]
    out += unexpressible_lines(mapping, markdown=args.markdown)
    sys.stdout.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
