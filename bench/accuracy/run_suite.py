"""Run the accuracy suite on this machine's GPU and write one JSONL record per configuration.

run      measure every configuration of suite.yaml (each in its own worker process), with the estimate and
         trace figures when this version has them; appends to results/<gpu>-<date>.jsonl as it goes, so a
         run cut short keeps what it measured (--resume skips the ids already there)
predict  recompute the estimate / trace figures of existing records on any machine (no GPU): the
         measurements are kept, the predictions follow the current code
check    parse the suite and show what it covers (no GPU)

PYTHONPATH=src python bench/accuracy/run_suite.py run [--only ID,ID] [--budget-s 540] [--resume FILE]
PYTHONPATH=src python bench/accuracy/run_suite.py predict bench/accuracy/results/FILE.jsonl
PYTHONPATH=src python bench/accuracy/run_suite.py check
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from vramledger.errors import VramledgerError
from vramledger.specs import (
    Attention,
    LoraSpec,
    Method,
    ModelSpec,
    Optimizer,
    Precision,
    QuantSpec,
    TrainSpec,
)

HERE = Path(__file__).resolve().parent
SUITE = HERE / "suite.yaml"
RESULTS = HERE / "results"
BREAKDOWN = ("params", "trainable_params", "weights_bytes", "optimizer_state_bytes", "gradients_bytes")

_KEYS = {
    "id", "model", "method", "precision", "optimizer", "attn", "grad_ckpt", "batch", "seq", "accum",
    "lora_rank", "dora", "quant", "eval_batch", "eval_seq", "gen_tokens", "steps",
}  # fmt: skip


def load_suite(path: Path = SUITE) -> dict[str, Any]:
    """The suite with defaults applied to every config; unknown keys and duplicate ids are errors."""
    raw = yaml.safe_load(path.read_text())
    defaults = raw.get("defaults", {})
    models = raw["models"]
    seen: set[str] = set()
    configs = []
    for entry in raw["configs"]:
        cfg = {**defaults, **entry}
        unknown = sorted(set(cfg) - _KEYS)
        if unknown:
            raise VramledgerError(f"suite {path}: {cfg.get('id')}: unknown key(s) {', '.join(unknown)}")
        if cfg["id"] in seen:
            raise VramledgerError(f"suite {path}: duplicate id {cfg['id']}")
        if cfg["model"] not in models:
            raise VramledgerError(f"suite {path}: {cfg['id']}: model {cfg['model']} is not under models:")
        seen.add(cfg["id"])
        configs.append(cfg)
    return {"models": models, "configs": configs}


def train_spec(cfg: Mapping[str, Any]) -> TrainSpec:
    """The TrainSpec of one suite config."""
    method = Method(cfg["method"])
    lora = None
    if method in (Method.LORA, Method.QLORA):
        rank = int(cfg.get("lora_rank", 16))
        lora = LoraSpec(rank=rank, alpha=2.0 * rank, dora=bool(cfg.get("dora", False)))
    quant = None
    if method is Method.QLORA:
        q = cfg.get("quant", "nf4")
        quant = QuantSpec(bits=8 if q == "int8" else 4, quant_type="nf4" if q == "int8" else q)
    gen = int(cfg.get("gen_tokens", 0))
    return TrainSpec(
        method=method,
        precision=Precision(cfg["precision"]),
        optimizer=Optimizer(cfg["optimizer"]),
        attn=Attention(cfg["attn"]),
        grad_ckpt=bool(cfg["grad_ckpt"]),
        micro_batch=int(cfg["batch"]),
        seq_len=int(cfg["seq"]),
        grad_accum=int(cfg.get("accum", 1)),
        lora=lora,
        quant=quant,
        eval_batch=cfg.get("eval_batch"),
        eval_seq_len=cfg.get("eval_seq"),
        predict_with_generate=gen > 0,
        generation_max_new_tokens=gen,
    )


def resolve(models: Mapping[str, Any], key: str) -> ModelSpec:
    from vramledger.catalog import resolve_model

    entry = models[key]
    try:
        return resolve_model(entry["hub_id"])
    except VramledgerError:
        return resolve_model(key)


def predicted(model: ModelSpec, train: TrainSpec) -> dict[str, Any]:
    """Figures of each predictor available here; a predictor that fails is recorded with its error."""
    from vramledger.measure.results import ledger_figures, predictions

    out: dict[str, Any] = {"estimate": None, "trace": None, "prediction_notes": []}
    try:
        ledgers, notes = predictions(model, train)
    except Exception as exc:  # noqa: BLE001 - a predictor bug must not cost the GPU measurement
        out["prediction_notes"].append(f"{type(exc).__name__}: {exc}")
        return out
    out["prediction_notes"] = notes
    for name, ledger in ledgers.items():
        out[name] = ledger_figures(ledger)
    return out


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def cmd_run(args: argparse.Namespace) -> int:
    from vramledger.measure.harness import measure, require_gpu, run_worker
    from vramledger.measure.results import SCHEMA, measured_figures, read_jsonl, write_jsonl
    from vramledger.measure.serial import train_to_dict

    require_gpu("the accuracy suite")
    suite = load_suite(args.suite)
    only = set(args.only.split(",")) if args.only else None
    probe = run_worker({"probe_only": True}, timeout_s=300).raw.get("environment", {})
    today = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    out = args.resume or args.out or (RESULTS / f"{_slug(str(probe.get('gpu', 'gpu')))}-{today}.jsonl")
    done = {r["id"] for r in read_jsonl(out) if r.get("status") != "timeout"} if out.exists() else set()
    if args.streams:
        args.streams.mkdir(parents=True, exist_ok=True)
    worker_env = {"PYTORCH_CUDA_ALLOC_CONF": args.alloc_conf} if args.alloc_conf else None
    t_start = time.monotonic()
    for cfg in suite["configs"]:
        if (only and cfg["id"] not in only) or cfg["id"] in done:
            continue
        if args.budget_s and time.monotonic() - t_start > args.budget_s:
            print(f"budget of {args.budget_s:g} s spent; rerun with --resume {out}", flush=True)
            break
        try:
            model = resolve(suite["models"], cfg["model"])
        except VramledgerError as exc:
            print(f"{cfg['id']}: skipped, {exc}", flush=True)
            continue
        train = train_spec(cfg)
        t0 = time.monotonic()
        pickled = args.streams / f"{cfg['id']}.pickle" if args.streams else None
        m = measure(model, train, steps=int(cfg.get("steps", 3)), timeout_s=args.timeout, snapshot=pickled,
                    history_context=None, env=worker_env)  # fmt: skip
        raw = m.result.raw
        rec: dict[str, Any] = {
            "schema": SCHEMA,
            "id": cfg["id"],
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "status": m.result.status,
            "error": m.result.error or None,
            "config": {"model": model.name, "family": model.family, "steps": cfg.get("steps", 3),
                       "alloc_conf": args.alloc_conf or None, "train": train_to_dict(train)},
            "environment": raw.get("environment", probe),
            "measured": measured_figures(raw["phases"]) if m.result.ok else None,
            "counters": raw.get("counters"),
            "memory_stats": raw.get("memory_stats"),
            "phase_readings": {"load": raw.get("load"), "steps": raw.get("steps"),
                               "extra": raw.get("extra_phases")},
            "breakdown": {k: raw.get(k) for k in BREAKDOWN},
            "wall_s": round(time.monotonic() - t0, 1),
        }  # fmt: skip
        if args.predict:
            rec.update(predicted(model, train))
        else:
            rec.update({"estimate": None, "trace": None, "prediction_notes": ["predictions left to `predict`"]})
        if pickled is not None and pickled.exists():
            from streams import compact

            meta = {
                "id": cfg["id"],
                "alloc_conf": args.alloc_conf or None,
                "empty_cache_at": raw.get("empty_cache_at_entry"),
            }
            rec["stream"] = compact(pickled, pickled.with_suffix(".json.xz"), max_entries=1_000_000, meta=meta)
            pickled.unlink()
        write_jsonl(out, [rec])
        alloc = rec["measured"]["allocated"] / 2**30 if rec["measured"] else float("nan")
        print(f"{cfg['id']}: {rec['status']} allocated {alloc:.2f} GiB ({rec['wall_s']} s)"
              + (f" — {rec['error']}" if rec["error"] else ""), flush=True)  # fmt: skip
    print(f"results: {out}")
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    from vramledger.measure.results import read_jsonl, write_jsonl
    from vramledger.measure.serial import train_from_dict

    suite = load_suite(args.suite)
    records = read_jsonl(args.results)
    by_id = {c["id"]: c for c in suite["configs"]}
    for rec in records:
        cfg = by_id.get(rec["id"])
        if cfg is None:
            continue
        model = resolve(suite["models"], cfg["model"])
        rec.update(predicted(model, train_from_dict(rec["config"]["train"])))
    write_jsonl(args.out or args.results, records, append=False)
    print(f"updated predictions of {len(records)} records in {args.out or args.results}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    suite = load_suite(args.suite)
    configs = suite["configs"]
    fams = sorted({suite["models"][c["model"]]["family"] for c in configs})
    specs = [train_spec(c) for c in configs]
    n_models = len({c["model"] for c in configs})
    print(f"{len(configs)} configurations, {n_models} models, families {', '.join(fams)}")
    print(f"methods {sorted({s.method.value for s in specs})}, "
          f"attention {sorted({s.attn.value for s in specs})}, "
          f"checkpointing {sorted({s.grad_ckpt for s in specs})}")  # fmt: skip
    n_eval = sum(1 for s in specs if s.eval_batch)
    n_gen = sum(1 for s in specs if s.predict_with_generate)
    print(f"seq {min(s.seq_len for s in specs)}–{max(s.seq_len for s in specs)}, "
          f"batch {min(s.micro_batch for s in specs)}–{max(s.micro_batch for s in specs)}, "
          f"eval {n_eval}, generation {n_gen}")  # fmt: skip
    missing = []
    for key in sorted({c["model"] for c in configs}):
        try:
            resolve(suite["models"], key)
        except VramledgerError:
            missing.append(key)
    if missing:
        print(f"not in the catalog yet (skipped by run): {', '.join(missing)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--suite", type=Path, default=SUITE)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="measure on this GPU")
    r.add_argument("--only", help="comma-separated config ids")
    r.add_argument("--resume", type=Path, help="append to this results file, skipping ids already in it")
    r.add_argument("--budget-s", type=float, default=0, help="start no config after this many s")
    r.add_argument("--timeout", type=float, default=300, help="seconds per configuration (default 300)")
    r.add_argument(
        "--no-predict",
        dest="predict",
        action="store_false",
        help="measure only; fill the predictions later with `predict` on any machine",
    )
    r.add_argument("--streams", type=Path, help="record each trial's allocation stream into DIR/<id>.json.xz")
    r.add_argument("--alloc-conf", default="", help="PYTORCH_CUDA_ALLOC_CONF for the workers")
    r.add_argument("--out", type=Path, help="results file (default results/<gpu>-<date>.jsonl)")
    r.set_defaults(fn=cmd_run)
    p = sub.add_parser("predict", help="refill estimate/trace figures of a results file")
    p.add_argument("results", type=Path)
    p.add_argument("--out", type=Path, help="write here instead of in place")
    p.set_defaults(fn=cmd_predict)
    c = sub.add_parser("check", help="parse the suite and show its coverage")
    c.set_defaults(fn=cmd_check)
    args = ap.parse_args(argv)
    try:
        return int(args.fn(args))
    except VramledgerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
