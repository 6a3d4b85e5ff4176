"""Trace-replay reserved memory against the analytic estimate, over a grid of configs.

For each config: trace two training steps (``vramledger.trace``), replay the events through the caching-allocator
model on an unlimited device (``trace/oom.py``), and record peak allocated and peak reserved, the same figures at
each phase's peak, and the analytic estimate's allocated and reserved for the same specs.

Run:  python bench/reserve/run_grid.py              # traces what is missing from replay_grid.jsonl (minutes)
      python bench/reserve/run_grid.py --analytic   # recompute only the analytic columns (instant)
      python bench/reserve/run_grid.py --only ID    # one config, printed, not saved
      python bench/reserve/run_grid.py --table      # the markdown table of docs/readme/reserve.md
Output: bench/reserve/replay_grid.jsonl, one JSON object per config (bytes everywhere).
``analytic.peak_reserved_before`` is the flat assumption used before analytic/reserve.py (each phase's allocated
+ 5% + 64 MiB); ``sequence`` is the modelled step sequence (analytic/reserve.py step_sequence) replayed through
the allocator model: the analytic peak allocated plus that replay's reserved − allocated.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from vramledger.catalog import resolve_model  # noqa: E402
from vramledger.catalog.hfconfig import model_spec_from_config  # noqa: E402
from vramledger.ledger import Ledger, Phase  # noqa: E402
from vramledger.specs import Attention, Method, ModelSpec, TrainSpec  # noqa: E402

OUT = Path(__file__).with_name("replay_grid.jsonl")
# No GPU: the replay runs on an unlimited device (with a GPU, trace_step replays with its capacity and stops at the
# OOM point, which would cap the figures); both engines then take Hopper's cuBLAS workspace sizes.
GPU = None

# Custom configs (llama class): the cross-check's small config (tests/trace/test_crosscheck.py) and a mid one.
CUSTOM: dict[str, dict[str, Any]] = {
    "tiny": {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1376, "num_attention_heads": 8,
             "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 8000, "torch_dtype": "bfloat16",
             "tie_word_embeddings": False, "max_position_embeddings": 8192},
    "mid": {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16,
            "num_key_value_heads": 4, "num_hidden_layers": 8, "vocab_size": 32000, "torch_dtype": "bfloat16",
            "tie_word_embeddings": False, "max_position_embeddings": 8192},
}

# (model, method, batch, seq, grad_ckpt, attn)
GRID: list[tuple[str, str, int, int, bool, str]] = [
    ("llama-3.2-1b", "lora", 2, 2048, True, "sdpa"),
    ("llama-3.2-1b", "lora", 1, 4096, True, "sdpa"),
    ("llama-3.2-1b", "lora", 1, 1024, False, "sdpa"),
    ("llama-3.2-1b", "lora", 1, 512, False, "eager"),
    ("llama-3.2-1b", "full", 1, 2048, True, "sdpa"),
    ("llama-3.2-1b", "full", 2, 512, False, "sdpa"),
    ("llama-3.2-1b", "full", 8, 256, False, "sdpa"),
    ("qwen2.5-0.5b", "lora", 4, 1024, True, "sdpa"),
    ("qwen2.5-0.5b", "lora", 1, 2048, False, "sdpa"),
    ("qwen2.5-0.5b", "lora", 2, 512, True, "eager"),
    ("qwen2.5-0.5b", "lora", 8, 256, False, "sdpa"),
    ("qwen2.5-0.5b", "full", 8, 512, True, "sdpa"),
    ("qwen2.5-0.5b", "full", 1, 4096, False, "sdpa"),
    ("qwen2.5-0.5b", "full", 2, 256, False, "eager"),
    ("qwen3-0.6b", "lora", 2, 2048, True, "sdpa"),
    ("qwen3-0.6b", "lora", 4, 512, False, "sdpa"),
    ("qwen3-0.6b", "lora", 1, 1024, False, "eager"),
    ("qwen3-0.6b", "full", 1, 1024, False, "sdpa"),
    ("qwen3-0.6b", "full", 4, 4096, True, "sdpa"),
    ("qwen3-1.7b", "lora", 1, 4096, True, "sdpa"),
    ("qwen3-1.7b", "lora", 2, 512, False, "sdpa"),
    ("qwen3-1.7b", "full", 2, 1024, True, "sdpa"),
    ("qwen3-1.7b", "full", 1, 256, False, "sdpa"),
    ("tiny", "full", 1, 256, False, "sdpa"),
    ("tiny", "full", 8, 1024, True, "sdpa"),
    ("tiny", "full", 2, 4096, False, "sdpa"),
    ("tiny", "lora", 4, 512, False, "sdpa"),
    ("tiny", "lora", 2, 256, False, "eager"),
    ("tiny", "lora", 1, 2048, True, "sdpa"),
    ("mid", "full", 2, 1024, False, "sdpa"),
    ("mid", "full", 4, 2048, True, "sdpa"),
    ("mid", "full", 1, 2048, False, "eager"),
    ("mid", "lora", 8, 512, True, "sdpa"),
    ("mid", "lora", 1, 4096, False, "sdpa"),
    ("mid", "lora", 2, 1024, False, "eager"),
]


def config_id(row: tuple[str, str, int, int, bool, str]) -> str:
    name, method, b, L, ckpt, attn = row
    return f"{name}/{method}/b{b}/L{L}/{'ckpt' if ckpt else 'nockpt'}/{attn}"


def specs(row: tuple[str, str, int, int, bool, str]) -> tuple[ModelSpec, TrainSpec, dict[str, Any] | None]:
    name, method, b, L, ckpt, attn = row
    if name in CUSTOM:
        cfg = CUSTOM[name]
        model = model_spec_from_config(cfg, name=f"custom-{name}", source="bench/reserve/run_grid.py")
    else:
        cfg, model = None, resolve_model(name)
    train = TrainSpec(method=Method(method), micro_batch=b, seq_len=L, grad_ckpt=ckpt, attn=Attention(attn))
    return model, train, cfg


def _phases(ledger: Ledger) -> dict[str, dict[str, int]]:
    return {p.value: {"allocated": ledger.allocated(p), "reserved": ledger.reserved(p)} for p in ledger.phases
            if p is not Phase.LOAD}


def analytic_figures(model: ModelSpec, train: TrainSpec) -> dict[str, Any]:
    from vramledger.analytic import estimate
    from vramledger.analytic.overhead import allocator_reserve_bytes

    led = estimate(model, train, gpu=GPU)
    train_phases = {k: v for k, v in _phases(led).items() if k in ("forward", "backward", "optimizer")}
    return {
        "peak_allocated": max(v["allocated"] for v in train_phases.values()),
        "peak_reserved": max(v["reserved"] for v in train_phases.values()),
        # Before analytic/reserve.py: each phase's allocated + the flat assumption (5% + 64 MiB).
        "peak_reserved_before": max(v["allocated"] + allocator_reserve_bytes(v["allocated"])
                                    for v in train_phases.values()),
        "phases": train_phases,
    }


def sequence_figures(model: ModelSpec, train: TrainSpec, analytic_peak: int) -> dict[str, int]:
    from vramledger.analytic.reserve import reserve_excess
    from vramledger.analytic.step import step_parts

    excess = reserve_excess(model, train, step_parts(model, train, GPU))
    return {"excess": excess, "peak_reserved": analytic_peak + excess}


def table(done: dict[str, dict[str, Any]]) -> str:
    import statistics

    def gap(x: int, ref: int) -> float:
        return 100.0 * (x / ref - 1.0)

    rows = ["| config | trace alloc GiB | trace reserved GiB (+%) | before: gap | sequence replay: gap | after: gap |",
            "|---|---:|---:|---:|---:|---:|"]
    cols: dict[str, list[float]] = {"before": [], "sequence": [], "after": []}
    for cid, rec in done.items():
        t = rec["trace"]
        ref = t["replay_peak_reserved"]
        g = {"before": gap(rec["analytic"]["peak_reserved_before"], ref),
             "sequence": gap(rec["sequence"]["peak_reserved"], ref) if "sequence" in rec else float("nan"),
             "after": gap(rec["analytic"]["peak_reserved"], ref)}
        for k, v in g.items():
            cols[k].append(v)
        rows.append(f"| {cid} | {t['replay_peak_allocated'] / 2**30:.2f} | {ref / 2**30:.2f} "
                    f"(+{gap(ref, t['replay_peak_allocated']):.1f}%) | {g['before']:+.1f}% | {g['sequence']:+.1f}% | "
                    f"{g['after']:+.1f}% |")
    rows.append("| **median** | | | " + " | ".join(f"{statistics.median(cols[k]):+.1f}%" for k in cols) + " |")
    rows.append("| **worst below** | | | " + " | ".join(f"{min(cols[k]):+.1f}%" for k in cols) + " |")
    rows.append("| **worst above** | | | " + " | ".join(f"{max(cols[k]):+.1f}%" for k in cols) + " |")
    return "\n".join(rows)


def trace_figures(model: ModelSpec, train: TrainSpec, cfg: dict[str, Any] | None) -> dict[str, Any]:
    from vramledger.trace import trace_step

    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        led = trace_step(model, train, gpu=GPU, config=cfg)
    alloc = led.settings["allocator"]
    return {
        "seconds": round(time.perf_counter() - t0, 2),
        # The replay's maxima: max_memory_allocated (workspaces and block rounding included) and
        # max_memory_reserved over both traced steps.
        "replay_peak_allocated": alloc["peak_allocated_bytes"],
        "replay_peak_reserved": alloc["peak_reserved_bytes"],
        "replay_segments_at_peak": alloc["segments_at_peak"],
        # The trace ledger: allocated lines at each phase's peak moment, reserved = replayed reserved there.
        "peak_allocated": led.peak_allocated,
        "phases": _phases(led),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--analytic", action="store_true", help="recompute the analytic columns only")
    ap.add_argument("--only", help="trace one config id and print it")
    ap.add_argument("--table", action="store_true", help="print the comparison table (markdown)")
    args = ap.parse_args()
    rows = {config_id(r): r for r in GRID}
    done: dict[str, dict[str, Any]] = {}
    if OUT.exists():
        for line in OUT.read_text().splitlines():
            rec = json.loads(line)
            done[rec["id"]] = rec
    if args.table:
        print(table(done))
        return
    if args.only:
        model, train, cfg = specs(rows[args.only])
        print(json.dumps({"trace": trace_figures(model, train, cfg), "analytic": analytic_figures(model, train)},
                         indent=1))
        return
    for cid, row in rows.items():
        model, train, cfg = specs(row)
        if args.analytic:
            if cid in done:
                done[cid]["analytic"] = analytic_figures(model, train)
                done[cid]["sequence"] = sequence_figures(model, train, done[cid]["analytic"]["peak_allocated"])
            continue
        if cid in done:
            continue
        name, method, b, L, ckpt, attn = row
        rec = {"id": cid, "model": name, "config": cfg, "method": method, "micro_batch": b, "seq_len": L,
               "grad_ckpt": ckpt, "attn": attn, "gpu": GPU,
               "trace": trace_figures(model, train, cfg), "analytic": analytic_figures(model, train)}
        rec["sequence"] = sequence_figures(model, train, rec["analytic"]["peak_allocated"])
        done[cid] = rec
        with OUT.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        t = rec["trace"]
        print(f"{cid:45s} {t['seconds']:6.1f}s  alloc {t['replay_peak_allocated'] / 2**30:7.3f}  "
              f"reserved {t['replay_peak_reserved'] / 2**30:7.3f} GiB", flush=True)
    if args.analytic:
        OUT.write_text("".join(json.dumps(done[c]) + "\n" for c in rows if c in done))


if __name__ == "__main__":
    main()
