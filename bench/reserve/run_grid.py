"""Trace-replay reserved memory against the analytic estimate, over a grid of configs.

For each config: trace two training steps (``vramledger.trace``), replay the events through the caching-allocator
model on an unlimited device (``trace/oom.py``), and record peak allocated and peak reserved, the same figures at
each phase's peak, and the analytic estimate's allocated and reserved for the same specs.

Run:  python bench/reserve/run_grid.py              # traces what is missing from replay_grid.jsonl (minutes)
      python bench/reserve/run_grid.py --analytic   # recompute only the analytic columns (instant)
      python bench/reserve/run_grid.py --only ID    # one config, printed, not saved
      python bench/reserve/run_grid.py --table      # the markdown table of docs/reserve.md
      python bench/reserve/run_grid.py --states ID...  # where step 1's states land (replay_states.jsonl)
Output: bench/reserve/replay_grid.jsonl, one JSON object per config (bytes everywhere).
``analytic.peak_reserved_before`` is the flat assumption used before analytic/reserve/ (each phase's allocated
+ 5% + 64 MiB); ``analytic.peak_reserved_v1`` the first closed form (until the full-fine-tuning mechanisms);
``sequence`` is the modelled step sequence (analytic/reserve/replay.py step_sequence) replayed through
the allocator model: the analytic peak allocated plus that replay's reserved − allocated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from vramledger.catalog import resolve_model  # noqa: E402
from vramledger.catalog.hfconfig import model_spec_from_config  # noqa: E402
from vramledger.ledger import Ledger, Phase  # noqa: E402
from vramledger.specs import Attention, LoraSpec, Method, ModelSpec, Optimizer, Precision, TrainSpec  # noqa: E402

OUT = Path(__file__).with_name("replay_grid.jsonl")
# No GPU: the replay runs on an unlimited device (with a GPU, trace_step replays with its capacity and stops at the
# OOM point, which would cap the figures); both engines then take Hopper's cuBLAS workspace sizes.
GPU = None

# Custom configs (llama class): the cross-check's small config (tests/trace/test_crosscheck.py) and a mid one.
CUSTOM: dict[str, dict[str, Any]] = {
    "tiny": {
        "model_type": "llama",
        "hidden_size": 512,
        "intermediate_size": 1376,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": 8000,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "max_position_embeddings": 8192,
    },
    "mid": {
        "model_type": "llama",
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "num_hidden_layers": 8,
        "vocab_size": 32000,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "max_position_embeddings": 8192,
    },
}


@dataclass(frozen=True, slots=True)
class Row:
    """One traced configuration. ``method`` "dora" is LoRA with ``use_dora``; "freeze" trains the last two decoder
    layers (``TrainSpec.freeze_trainable_layers``' default)."""

    name: str
    method: str
    batch: int
    seq: int
    ckpt: bool
    attn: str
    precision: str = "bf16-mixed"
    optimizer: str = "adamw_torch"


def _r(
    name: str,
    method: str,
    b: int,
    L: int,
    ckpt: bool,
    attn: str = "sdpa",
    precision: str = "bf16-mixed",
    optimizer: str = "adamw_torch",
) -> Row:
    return Row(name, method, b, L, ckpt, attn, precision, optimizer)


# QLoRA has its own grid (qlora_grid.py): its trace runs each 4-bit linear as a stand-in of bitsandbytes' Linear4bit.
GRID: list[Row] = [
    # The first 35: checked since analytic/reserve/ was written.
    _r("llama-3.2-1b", "lora", 2, 2048, True),
    _r("llama-3.2-1b", "lora", 1, 4096, True),
    _r("llama-3.2-1b", "lora", 1, 1024, False),
    _r("llama-3.2-1b", "lora", 1, 512, False, "eager"),
    _r("llama-3.2-1b", "full", 1, 2048, True),
    _r("llama-3.2-1b", "full", 2, 512, False),
    _r("llama-3.2-1b", "full", 8, 256, False),
    _r("qwen2.5-0.5b", "lora", 4, 1024, True),
    _r("qwen2.5-0.5b", "lora", 1, 2048, False),
    _r("qwen2.5-0.5b", "lora", 2, 512, True, "eager"),
    _r("qwen2.5-0.5b", "lora", 8, 256, False),
    _r("qwen2.5-0.5b", "full", 8, 512, True),
    _r("qwen2.5-0.5b", "full", 1, 4096, False),
    _r("qwen2.5-0.5b", "full", 2, 256, False, "eager"),
    _r("qwen3-0.6b", "lora", 2, 2048, True),
    _r("qwen3-0.6b", "lora", 4, 512, False),
    _r("qwen3-0.6b", "lora", 1, 1024, False, "eager"),
    _r("qwen3-0.6b", "full", 1, 1024, False),
    _r("qwen3-0.6b", "full", 4, 4096, True),
    _r("qwen3-1.7b", "lora", 1, 4096, True),
    _r("qwen3-1.7b", "lora", 2, 512, False),
    _r("qwen3-1.7b", "full", 2, 1024, True),
    _r("qwen3-1.7b", "full", 1, 256, False),
    _r("tiny", "full", 1, 256, False),
    _r("tiny", "full", 8, 1024, True),
    _r("tiny", "full", 2, 4096, False),
    _r("tiny", "lora", 4, 512, False),
    _r("tiny", "lora", 2, 256, False, "eager"),
    _r("tiny", "lora", 1, 2048, True),
    _r("mid", "full", 2, 1024, False),
    _r("mid", "full", 4, 2048, True),
    _r("mid", "full", 1, 2048, False, "eager"),
    _r("mid", "lora", 8, 512, True),
    _r("mid", "lora", 1, 4096, False),
    _r("mid", "lora", 2, 1024, False, "eager"),
    # Full fine-tuning in pure bf16 (the case that showed the closed form far off), other precisions, optimizers.
    _r("llama-3.2-3b", "full", 4, 768, False, precision="bf16-true"),
    _r("llama-3.2-3b", "full", 1, 2048, True),
    _r("llama-3.2-3b", "full", 2, 2048, True, "eager", precision="bf16-true"),
    _r("llama-3.2-3b", "full", 4, 512, False, precision="bf16-true", optimizer="sgd"),
    _r("llama-3.2-3b", "full", 1, 1024, False),
    _r("llama-3.2-1b", "full", 4, 1024, False, precision="bf16-true"),
    _r("llama-3.2-1b", "full", 1, 512, False, precision="fp32"),
    _r("llama-3.2-1b", "full", 2, 1024, False, optimizer="adamw_torch_fused"),
    _r("llama-3.2-1b", "full", 2, 1024, True, optimizer="sgd"),
    _r("llama-3.2-1b", "full", 2, 2048, True, precision="bf16-true", optimizer="adafactor"),
    _r("qwen2.5-0.5b", "full", 16, 256, False, precision="bf16-true"),
    _r("qwen2.5-0.5b", "full", 4, 1024, True, precision="fp16-mixed"),
    _r("qwen2.5-1.5b", "full", 4, 1024, False),
    _r("qwen2.5-1.5b", "full", 8, 512, False, precision="bf16-true"),
    _r("qwen2.5-3b", "full", 2, 2048, True, precision="bf16-true"),
    _r("qwen3-0.6b", "full", 8, 1024, True, "eager", precision="bf16-true"),
    _r("qwen3-1.7b", "full", 4, 2048, False, precision="bf16-true"),
    _r("qwen3-4b", "full", 1, 4096, True, precision="bf16-true"),
    _r("qwen3-8b", "full", 1, 2048, True, precision="bf16-true"),
    _r("llama-3-8b", "full", 1, 1024, True, precision="bf16-true"),
    _r("llama-3-8b", "full", 1, 4096, False, precision="bf16-true"),
    _r("qwen2.5-7b", "full", 1, 1024, True, precision="bf16-true", optimizer="adamw_torch_fused"),
    _r("gemma-3-1b", "full", 4, 1024, False, precision="bf16-true"),
    _r("phi-3-mini-4k", "full", 1, 2048, True, precision="bf16-true"),
    _r("mid", "full", 4, 1024, False, precision="bf16-true"),
    _r("tiny", "full", 16, 512, False, precision="bf16-true"),
    # LoRA and DoRA: long sequences, eager, larger shapes.
    _r("llama-3.2-1b", "lora", 1, 16384, True),
    _r("llama-3.2-1b", "lora", 8, 256, False, "eager"),
    _r("llama-3.2-1b", "dora", 2, 2048, True),
    _r("llama-3.2-3b", "lora", 2, 4096, True),
    _r("llama-3.2-3b", "dora", 1, 1024, False),
    _r("llama-3-8b", "lora", 1, 16384, True),
    _r("llama-3-8b", "lora", 2, 2048, False),
    _r("llama-3-8b", "dora", 1, 2048, True),
    _r("llama-3-8b", "lora", 1, 4096, True, "eager"),
    _r("qwen3-8b", "lora", 2, 4096, True),
    _r("qwen2.5-7b", "lora", 1, 16384, True),
    _r("mistral-7b-v0.3", "lora", 4, 1024, False),
    _r("qwen2.5-1.5b", "lora", 1, 8192, False),
    _r("qwen2.5-1.5b", "dora", 2, 1024, True, "eager"),
    _r("qwen2.5-3b", "lora", 4, 2048, False),
    _r("qwen2.5-3b", "lora", 2, 1024, False, "eager", "fp16-mixed"),
    _r("qwen3-4b", "lora", 1, 16384, True),
    _r("qwen3-4b", "dora", 2, 512, False),
    _r("gemma-2-2b", "lora", 2, 1024, False, "eager"),
    _r("gemma-3-1b", "lora", 1, 8192, True),
    _r("phi-3-mini-4k", "lora", 4, 1024, False),
    _r("qwen2.5-0.5b", "lora", 1, 16384, True),
    _r("qwen2.5-0.5b", "dora", 4, 512, False),
    _r("qwen3-1.7b", "dora", 1, 4096, True),
    _r("qwen3-1.7b", "lora", 4, 1024, True, "eager"),
    _r("llama-3.2-1b", "lora", 4, 1024, False, precision="bf16-true"),
    # Freeze (LLaMA-Factory's default: the last two decoder layers train, the embedding and the head stay frozen).
    _r("mid", "freeze", 1, 1024, False),
    _r("mid", "freeze", 2, 1024, True),
    _r("qwen2.5-0.5b", "freeze", 4, 1024, False),
    _r("llama-3.2-1b", "freeze", 1, 1024, False),
    _r("llama-3.2-1b", "freeze", 2, 2048, True),
    # Full fine-tuning in fp32 (c = 4: the logits are an fp32 block themselves, no .float() copy).
    _r("qwen2.5-0.5b", "full", 8, 512, True, precision="fp32", optimizer="adamw_torch_fused"),
    _r("qwen2.5-0.5b", "full", 4, 512, True, precision="fp32"),
    _r("qwen2.5-0.5b", "full", 2, 1024, False, precision="fp32"),
    _r("qwen2.5-0.5b", "full", 4, 256, False, precision="fp32", optimizer="adamw_torch_fused"),
    _r("llama-3.2-1b", "full", 2, 1024, True, precision="fp32"),
    _r("llama-3.2-1b", "full", 4, 512, True, precision="fp32", optimizer="adamw_torch_fused"),
]


def config_id(row: Row) -> str:
    base = f"{row.name}/{row.method}/b{row.batch}/L{row.seq}/{'ckpt' if row.ckpt else 'nockpt'}/{row.attn}"
    extra = [x for x, default in ((row.precision, "bf16-mixed"), (row.optimizer, "adamw_torch")) if x != default]
    return "/".join([base, *extra])


def specs(row: Row) -> tuple[ModelSpec, TrainSpec, dict[str, Any] | None]:
    if row.name in CUSTOM:
        cfg = CUSTOM[row.name]
        model = model_spec_from_config(cfg, name=f"custom-{row.name}", source="bench/reserve/run_grid.py")
    else:
        cfg, model = None, resolve_model(row.name)
    method = Method.LORA if row.method == "dora" else Method(row.method)
    train = TrainSpec(
        method=method,
        micro_batch=row.batch,
        seq_len=row.seq,
        grad_ckpt=row.ckpt,
        attn=Attention(row.attn),
        precision=Precision(row.precision),
        optimizer=Optimizer(row.optimizer),
        lora=LoraSpec(dora=True) if row.method == "dora" else None,
    )
    return model, train, cfg


def _phases(ledger: Ledger) -> dict[str, dict[str, int]]:
    return {
        p.value: {"allocated": ledger.allocated(p), "reserved": ledger.reserved(p)}
        for p in ledger.phases
        if p is not Phase.LOAD
    }


def analytic_figures(model: ModelSpec, train: TrainSpec) -> dict[str, Any]:
    from vramledger.analytic import estimate
    from vramledger.analytic.overhead import allocator_reserve_bytes

    led = estimate(model, train, gpu=GPU)
    train_phases = {k: v for k, v in _phases(led).items() if k in ("forward", "backward", "optimizer")}
    return {
        "peak_allocated": max(v["allocated"] for v in train_phases.values()),
        "peak_reserved": max(v["reserved"] for v in train_phases.values()),
        # Before analytic/reserve/: each phase's allocated + the flat assumption (5% + 64 MiB).
        "peak_reserved_before": max(
            v["allocated"] + allocator_reserve_bytes(v["allocated"]) for v in train_phases.values()
        ),
        "phases": train_phases,
    }


def packed_figures(model: ModelSpec, train: TrainSpec) -> dict[str, int]:
    """The estimate of the same setup as a packed run (every step B × L: the single-shape replay is its reference)."""
    return {"peak_reserved": analytic_figures(model, dataclasses.replace(train, packing=True))["peak_reserved"]}


def sequence_figures(model: ModelSpec, train: TrainSpec, analytic_peak: int) -> dict[str, int]:
    from vramledger.analytic.reserve import reserve_excess
    from vramledger.analytic.step import step_parts

    excess = reserve_excess(model, train, step_parts(model, train, GPU))
    return {"excess": excess, "peak_reserved": analytic_peak + excess}


def table(done: dict[str, dict[str, Any]]) -> str:
    import statistics

    def gap(x: int, ref: int) -> float:
        return 100.0 * (x / ref - 1.0)

    names = {
        "flat": "flat 5% + 64 MiB",
        "v1": "closed form v1",
        "sequence": "sequence replay",
        "v2": "single-shape form",
        "now": "closed form now",
        "run": "now vs the run's envelope",
        "packed": "packed vs the single shape",
    }
    runs = _run_envelopes()
    rows = [
        "| config | replay alloc GiB | replay reserved GiB (+%) | " + " | ".join(names.values()) + " |",
        "|---|---:|---:|" + "---:|" * len(names),
    ]
    cols: dict[str, list[float]] = {k: [] for k in names}
    for cid, rec in done.items():
        t, a = rec["trace"], rec["analytic"]
        ref = t["replay_peak_reserved"]
        g = {
            "flat": gap(a["peak_reserved_before"], ref),
            "v1": gap(a.get("peak_reserved_v1", a["peak_reserved"]), ref),
            "sequence": gap(rec["sequence"]["peak_reserved"], ref) if "sequence" in rec else float("nan"),
            "v2": gap(a.get("peak_reserved_v2", a["peak_reserved"]), ref),
            "now": gap(a["peak_reserved"], ref),
            "run": gap(a["peak_reserved"], runs.get(cid, ref)),
            "packed": gap(rec["packed"]["peak_reserved"], ref) if "packed" in rec else float("nan"),
        }
        for k, v in g.items():
            cols[k].append(v)
        rows.append(
            f"| {cid} | {t['replay_peak_allocated'] / 2**30:.2f} | {ref / 2**30:.2f} "
            f"(+{gap(ref, t['replay_peak_allocated']):.1f}%) | " + " | ".join(f"{v:+.1f}%" for v in g.values()) + " |"
        )
    summary = {
        "median": lambda v: f"{statistics.median(v):+.1f}%",
        "worst below": lambda v: f"{min(v):+.1f}%",
        "worst above": lambda v: f"{max(v):+.1f}%",
        "within ±3%": lambda v: f"{sum(abs(x) <= 3 for x in v)}/{len(v)}",
        "below −3%": lambda v: f"{sum(x < -3 for x in v)}",
    }
    for name, f in summary.items():
        rows.append(f"| **{name}** | | | " + " | ".join(f(cols[k]) for k in cols) + " |")
    return "\n".join(rows)


def _run_envelopes() -> dict[str, int]:
    """The most any length ≤ L reserves on its own, where bench/reserve/run_runs.py measured it: what a run with
    dynamic padding keeps (the estimate's reference; single shape elsewhere). A padded run (micro-batch > 1, SDPA)
    takes run_padded_runs.py's ``envelope_run`` where measured: its batches with a padded row traced with their
    attention mask, as the estimate prices them, and its batches of equal rows (no mask) as runs.jsonl's."""
    out: dict[str, int] = {}
    for name, key in (("runs.jsonl", "envelope_fine"), ("runs_padded.jsonl", "envelope_run")):  # the second wins
        path = Path(__file__).with_name(name)
        if path.exists():
            out |= {r["id"]: r["reference"][key] for r in map(json.loads, path.read_text().splitlines())}
    return out


def trace_figures(model: ModelSpec, train: TrainSpec, cfg: dict[str, Any] | None) -> dict[str, Any]:
    from vramledger.trace import trace_step

    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # The single shape without a padding mask (every row full: the packed run's step), as every reference
        # here was traced before the trace fed a padded batch its mask (trace/step.py padding_mask).
        led = trace_step(model, dataclasses.replace(train, packing=True), gpu=GPU, config=cfg)
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


CAUSES = Path(__file__).with_name("replay_causes.jsonl")


def misses(done: dict[str, dict[str, Any]], rows: dict[str, Row]) -> list[str]:
    """Configs whose current analytic reserved is more than 3% from the replay's."""
    out = []
    for cid, rec in done.items():
        model, train, _ = specs(rows[cid])
        got = analytic_figures(model, train)["peak_reserved"]
        if abs(got / rec["trace"]["replay_peak_reserved"] - 1) > 0.03:
            out.append(cid)
    return out


def write_causes(ids: list[str], rows: dict[str, Row]) -> None:
    for cid, rec in _append_records(CAUSES, ids, rows, replay_causes):
        print(cid, rec["free_at_peak"][:1], flush=True)


def _append_records(
    path: Path, ids: list[str], rows: dict[str, Row], measure: Callable[..., dict[str, Any]]
) -> Iterator[tuple[str, dict[str, Any]]]:
    """Measure each config of ``ids`` not yet in ``path`` and append its record there; yields each new record."""
    known = set()
    if path.exists():
        known = {json.loads(line)["id"] for line in path.read_text().splitlines()}
    for cid in ids:
        if cid in known:
            continue
        model, train, cfg = specs(rows[cid])
        rec = {"id": cid, **measure(model, train, cfg)}
        with path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        yield cid, rec


def _device_events(model: ModelSpec, train: TrainSpec, cfg: dict[str, Any] | None) -> tuple[list[Any], Any]:
    """The traced events of two steps and their device allocations (workspaces inserted) for the replay."""
    from vramledger.trace.api import trace_events
    from vramledger.trace.oom import device_events

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        events = trace_events(model, train, config=cfg)
    return events, device_events(events, GPU)


def replay_device(
    model: ModelSpec, train: TrainSpec, cfg: dict[str, Any] | None, alloc: Any, live: dict[int, Any] | None = None
) -> Iterator[tuple[Any, int, Any, int]]:
    """Trace two steps (``_device_events``) and replay their device allocations through ``alloc``, yielding after
    each event: the event, its step (1 for the load's), the block it took (None for a free or an empty request) and
    the bytes it made the cache reserve (0: served from the cache). ``live``: the blocks alive now, by event id (the
    caller's dict, to read while replaying)."""
    from vramledger.allocator.replay import EventKind

    events, dev = _device_events(model, train, cfg)
    live = {} if live is None else live
    for ev, src in zip(dev.events, dev.origin, strict=True):
        step = events[src].step if src >= 0 else 1
        if ev.kind is EventKind.FREE:
            gone = live.pop(ev.id)
            if gone is not None:
                alloc.free(gone)
            yield ev, step, None, 0
            continue
        before = alloc.reserved
        blk = live[ev.id] = alloc.malloc(ev.size) if ev.size else None
        yield ev, step, blk, alloc.reserved - before


def replay_causes(model: ModelSpec, train: TrainSpec, cfg: dict[str, Any] | None) -> dict[str, Any]:
    """Where the replay's excess sits: at step 2's peak allocated, the free cached blocks grouped by what made
    their segment (step, phase, op, category), and the segments step 2 had to make (what step 1's cache could
    not serve). The "measured cause" of a miss in tests/analytic/test_reserve.py."""
    from collections import Counter

    from vramledger.allocator.model import CachingAllocatorModel

    alloc = CachingAllocatorModel()
    made_by: dict[int, str] = {}
    step2_made: Counter[str] = Counter()
    best: tuple[int, Counter[str], Counter[str]] = (0, Counter(), Counter())
    for ev, step, blk, new in replay_device(model, train, cfg, alloc):
        if blk is not None and new:
            what = (
                f"step {step} {ev.phase.value if ev.phase else ''} {ev.op} ({ev.category.value if ev.category else ''})"
            )
            made_by[blk.seg] = what
            if step == 2:
                step2_made[what] += new
        if step == 2 and alloc.allocated > best[0]:
            free: Counter[str] = Counter()
            count: Counter[str] = Counter()
            for _, addr in alloc._large.keys + alloc._small.keys:
                b = alloc._large.blocks.get(addr) or alloc._small.blocks[addr]
                free[made_by.get(b.seg, "?")] += b.size
                count[made_by.get(b.seg, "?")] += 1
            best = (alloc.allocated, free, count)
    _, free, count = best
    return {
        "free_at_peak": [{"made_by": k, "bytes": v, "blocks": count[k]} for k, v in free.most_common(4)],
        "made_in_step_2": [{"made_by": k, "bytes": v} for k, v in step2_made.most_common(3)],
    }


STATES = Path(__file__).with_name("replay_states.jsonl")


def write_states(ids: list[str], rows: dict[str, Row]) -> None:
    for cid, rec in _append_records(STATES, ids, rows, replay_states):
        print(cid, rec["fp32_blocks_with_states"], rec["made_in_step_2_fp32_blocks"], flush=True)


def replay_states(model: ModelSpec, train: TrainSpec, cfg: dict[str, Any] | None) -> dict[str, Any]:
    """Where step 1's optimizer states land and what step 2 makes again (full fine-tuning): the bytes of states in
    each segment the logits chain made in step 1 (the c·V·T logits block, the fp32 4·V·T ones) and elsewhere, and
    the segments step 2 makes, in units of one fp32 logits block (4·V·T). The measurement behind the
    full-fine-tuning misses of tests/analytic/test_reserve.py (docs/reserve.md "What the optimizer states do")."""
    from collections import Counter

    from vramledger.allocator.model import CachingAllocatorModel
    from vramledger.allocator.replay import EventKind

    events, dev = _device_events(model, train, cfg)
    alloc = CachingAllocatorModel()
    live: dict[int, Any] = {}
    made: dict[int, tuple[int, str, str, int]] = {}  # segment → (step, op, category, bytes)
    states: Counter[int] = Counter()
    grads: dict[int, Any] = {}  # the live gradients' blocks
    grads_at_first_state: Counter[int] | None = None  # their bytes by segment when step 1's first state is made
    end_of_step_1 = None
    peak = 0
    for ev, src in zip(dev.events, dev.origin, strict=True):
        step = events[src].step if src >= 0 else 1
        if step == 2 and end_of_step_1 is None:
            end_of_step_1 = alloc.reserved
        if ev.kind is EventKind.FREE:
            blk = live.pop(ev.id)
            grads.pop(ev.id, None)
            if blk is not None:
                alloc.free(blk)
            continue
        cat = ev.category.value if ev.category else ""
        if step == 1 and cat == "optimizer_state" and grads_at_first_state is None:
            grads_at_first_state = Counter()
            for g in grads.values():
                grads_at_first_state[g.seg] += g.size
        before = alloc.reserved
        blk = alloc.malloc(ev.size) if ev.size else None
        live[ev.id] = blk
        peak = max(peak, alloc.reserved)
        if blk is not None and cat == "gradients":
            grads[ev.id] = blk
        if blk is not None and alloc.reserved > before:
            made[blk.seg] = (step, ev.op, cat, alloc.reserved - before)
        if blk is not None and step == 1 and cat == "optimizer_state":
            states[blk.seg] += blk.size
    fp32 = 4 * model.vocab_size * train.tokens
    chain = [s for s, (step, _, cat, size) in made.items() if step == 1 and cat == "logits_loss" and size >= fp32 // 4]
    step2 = [(op, cat, size) for step, op, cat, size in made.values() if step == 2]
    return {
        "fp32_block": fp32,
        "reserved_end_of_step_1": end_of_step_1,
        "states": sum(states.values()),
        "states_in_logits_blocks": [
            {"made_by": made[s][1], "bytes": made[s][3], "states": states[s]} for s in sorted(chain)
        ],
        "states_elsewhere": sum(v for s, v in states.items() if s not in chain),
        # the gradients live in the logits chain's segments when step 1's first state is made (Adam._init_group)
        "gradients_in_logits_blocks": sum((grads_at_first_state or Counter())[s] for s in chain),
        "fp32_blocks_with_states": sum(1 for s in chain if made[s][3] >= fp32 and states[s]),
        "made_in_step_2": [{"made_by": f"{op} ({cat})", "bytes": size} for op, cat, size in step2 if size >= 2**26],
        "made_in_step_2_fp32_blocks": round(sum(size for _, _, size in step2) / fp32, 2),
        "peak_reserved": peak,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--analytic", action="store_true", help="recompute the analytic columns only")
    ap.add_argument("--only", help="trace one config id and print it")
    ap.add_argument("--table", action="store_true", help="print the comparison table (markdown)")
    ap.add_argument(
        "--causes",
        nargs="*",
        metavar="ID",
        help="retrace these configs (default: every one the estimate misses by more than 3%%) and "
        "record where the replay's excess sits, in replay_causes.jsonl",
    )
    ap.add_argument(
        "--states",
        nargs="+",
        metavar="ID",
        help="retrace these configs and record where step 1's optimizer states land and what step 2 makes again, "
        "in replay_states.jsonl",
    )
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
    if args.causes is not None:
        write_causes(args.causes or misses(done, rows), rows)
        return
    if args.states:
        write_states(args.states, rows)
        return
    if args.only:
        model, train, cfg = specs(rows[args.only])
        print(
            json.dumps(
                {"trace": trace_figures(model, train, cfg), "analytic": analytic_figures(model, train)}, indent=1
            )
        )
        return
    for cid, row in rows.items():
        model, train, cfg = specs(row)
        if args.analytic:
            if cid in done:
                a = done[cid]["analytic"]
                # Keep the first closed form's figure (analytic/reserve/ before the full-fine-tuning mechanisms).
                v1 = a.get("peak_reserved_v1", a["peak_reserved"])
                # and the single-shape closed form's (before the run rule, bench/reserve/run_runs.py).
                v2 = a.get("peak_reserved_v2", a["peak_reserved"])
                earlier = {"peak_reserved_v1": v1, "peak_reserved_v2": v2}
                done[cid]["analytic"] = analytic_figures(model, train) | earlier
                done[cid]["sequence"] = sequence_figures(model, train, done[cid]["analytic"]["peak_allocated"])
                done[cid]["packed"] = packed_figures(model, train)
            continue
        if cid in done:
            continue
        rec = {
            "id": cid,
            "model": row.name,
            "config": cfg,
            "method": row.method,
            "micro_batch": row.batch,
            "seq_len": row.seq,
            "grad_ckpt": row.ckpt,
            "attn": row.attn,
            "precision": row.precision,
            "optimizer": row.optimizer,
            "gpu": GPU,
            "trace": trace_figures(model, train, cfg),
            "analytic": analytic_figures(model, train),
        }
        rec["sequence"] = sequence_figures(model, train, rec["analytic"]["peak_allocated"])
        rec["packed"] = packed_figures(model, train)
        done[cid] = rec
        with OUT.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        t = rec["trace"]
        print(
            f"{cid:45s} {t['seconds']:6.1f}s  alloc {t['replay_peak_allocated'] / 2**30:7.3f}  "
            f"reserved {t['replay_peak_reserved'] / 2**30:7.3f} GiB",
            flush=True,
        )
    if args.analytic:
        OUT.write_text("".join(json.dumps(done[c]) + "\n" for c in rows if c in done))


if __name__ == "__main__":
    main()
