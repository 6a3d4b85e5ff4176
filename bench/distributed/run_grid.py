"""Per-rank trace of the real FSDP2 / FSDP1 / DDP wrappers against the analytic estimate, over a grid of configs.

For each config: trace two training steps on the fake process group (``vramledger.trace``, trace/distributed.py),
and record rank 0's allocated bytes at each phase's peak and overall, with the analytic estimate for the same
specs; and the reserved bytes: the ledger's per phase (the replay read at each phase's peak moment, as the trace
reports it), and the replay's own peak reserved with each stream's pool (trace/oom.py replays one caching-allocator
pool per CUDA stream: the default stream, FSDP's all-gather and reduce-scatter streams). tests/analytic/
test_distributed_grid.py and test_stream_pools.py check the estimate against the committed traces.

Run:  nice python bench/distributed/run_grid.py              # traces what is missing from grid.jsonl, or was
                                                             # traced without the replay's pools (minutes)
      python bench/distributed/run_grid.py --analytic        # recompute only the analytic columns (instant)
      python bench/distributed/run_grid.py --only ID         # one config, printed, not saved
      nice python bench/distributed/run_grid.py --retrace /fsdp2   # trace again (and save) every config whose id
                                                             # contains the text, after a change to the tracer
      python bench/distributed/run_grid.py --table           # the markdown table of docs/distributed.md
      python bench/distributed/run_grid.py --reserved        # its reserved table (rank 0, side pools apart)
      python bench/distributed/run_grid.py --causes ID       # where one config's default-stream excess sits
      python bench/distributed/run_grid.py --free ID         # its default pool's free bytes by kind of segment
Output: bench/distributed/grid.jsonl, one JSON object per config (bytes everywhere).
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
from vramledger.specs import LoraSpec, Method, ModelSpec, Precision, Sharding, TrainSpec  # noqa: E402

OUT = Path(__file__).with_name("grid.jsonl")
PHASES = (Phase.LOAD, Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)

MID = {
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
}

# engine: fsdp2 / fsdp2-sgo / fsdp1 / ddp / fsdp2-hsdp / fsdp1-hsdp / fsdp1-noshard (FSDP1 SHARD_GRAD_OP is not
# traced: trace/distributed.py)
ENGINES: dict[str, dict[str, Any]] = {
    "fsdp2": {"fsdp": Sharding.FULL_SHARD, "fsdp_version": 2},
    "fsdp2-sgo": {"fsdp": Sharding.SHARD_GRAD_OP, "fsdp_version": 2},
    "fsdp1": {"fsdp": Sharding.FULL_SHARD, "fsdp_version": 1},
    "ddp": {},
    "fsdp2-hsdp": {"fsdp": Sharding.HYBRID_SHARD, "fsdp_version": 2, "gpus_per_node": 4},
    "fsdp1-hsdp": {"fsdp": Sharding.HYBRID_SHARD, "fsdp_version": 1, "gpus_per_node": 4},
    "fsdp1-noshard": {"fsdp": Sharding.NO_SHARD, "fsdp_version": 1},
}
# (model, engine, world, method, precision, batch, seq, grad_ckpt). One unpadded sequence per micro-batch, so that
# the single-GPU lines the engines start from are exact (a padded batch adds the analytic mask terms); FSDP1 cannot
# flatten fp32 adapters with a bf16 base (a real run fails too), so its LoRA rows are pure bf16.
GRID: list[tuple[str, str, int, str, str, int, int, bool]] = [
    ("mid", engine, world, method, precision, 1, 1024, False)
    for engine in ("fsdp2", "fsdp2-sgo", "fsdp1", "ddp")
    for world in (2, 8)
    for method, precision in (
        ("full", "bf16-true"),
        ("full", "bf16-mixed"),
        ("freeze", "bf16-mixed"),
        ("lora", "bf16-true" if engine.startswith("fsdp1") else "bf16-mixed"),
    )
] + [("llama-3.2-1b", engine, 8, "full", "bf16-mixed", 1, 1024, True) for engine in ("fsdp2", "fsdp1", "ddp")]
# HSDP: FSDP2 sharding over 4 GPUs per node, replicated over 2 nodes (the gradients all-reduced on a stream of
# their own).
GRID += [("mid", "fsdp2-hsdp", 8, method, "bf16-mixed", 1, 1024, False) for method in ("full", "lora")]
# Checkpointing on the mid model too (the reserve's layer-transient term changes with it).
GRID += [
    ("mid", engine, 8, method, "bf16-true" if engine == "fsdp1" and method == "lora" else "bf16-mixed", 1, 1024, True)
    for engine in ("fsdp2", "fsdp1", "ddp")
    for method in ("full", "lora")
]
# FSDP1 HYBRID_SHARD (sharded over 4 GPUs per node, the shard's cast back on the all-reduce stream) and NO_SHARD
# (mixed precision: each unit cast to bf16 on the pre-unshard stream, its gradient back to fp32 on the post-backward
# stream; pure bf16: no side stream), appended so that the rows above keep their order.
GRID += [
    ("mid", "fsdp1-hsdp", 8, method, precision, 1, 1024, False)
    for method, precision in (("full", "bf16-mixed"), ("freeze", "bf16-mixed"), ("lora", "bf16-true"))
]
GRID += [
    ("mid", "fsdp1-noshard", 2, method, precision, 1, 1024, False)
    for method, precision in (("full", "bf16-true"), ("full", "bf16-mixed"), ("freeze", "bf16-mixed"))
]

# An 8B shape under FSDP1, where the peak is the root unit's gradients flattened at the end of backward
# (analytic/distributed/fsdp_root_flatten.py), not the loss.
GRID += [("llama-3.1-8b", "fsdp1", 8, "full", "bf16-mixed", 1, 1024, True)]

# DDP full fine-tuning in bf16-mixed at more shapes: fp32 per-parameter tensors whose 2 MiB-rounded blocks keep
# unsplit rests, with the MLP's c·I·T blocks under 10 MiB (1 × 512, 1 × 1536, Qwen2.5-0.5B 1 × 512, its head tied)
# and above (2 × 1024, 1 × 2048) (analytic/distributed/ddp_reserve.py).
GRID += [("mid", "ddp", 2, "full", "bf16-mixed", b, L, False) for b, L in ((1, 512), (1, 1536), (2, 1024), (1, 2048))]
GRID += [("qwen2.5-0.5b", "ddp", 2, "full", "bf16-mixed", 1, 512, False)]
# The same under checkpointing (the rests without the saved activations' segments).
GRID += [("mid", "ddp", 2, "full", "bf16-mixed", 1, L, True) for L in (512, 1536, 2048)]
GRID += [("qwen2.5-0.5b", "ddp", 2, "full", "bf16-mixed", 1, 512, True)]
# An 8B shape at short lengths, where autocast's bf16 weight copies freed in backward are the cache the fp32 states
# meet (a run with dynamic padding's one-token replay, analytic/distributed/ddp_reserve.py).
GRID += [("llama-3.1-8b", "ddp", 8, "full", "bf16-mixed", 1, L, ckpt) for L, ckpt in ((128, False), (256, True))]


def _id(row: tuple[str, str, int, str, str, int, int, bool]) -> str:
    model, engine, world, method, precision, b, L, ckpt = row
    return f"{model}/{engine}/w{world}/{method}/{precision}/b{b}/L{L}/{'ckpt' if ckpt else 'nockpt'}"


def _specs(row: tuple[str, str, int, str, str, int, int, bool]) -> tuple[ModelSpec, TrainSpec, dict[str, Any] | None]:
    model, engine, world, method, precision, b, L, ckpt = row
    if model == "mid":
        spec, config = model_spec_from_config(MID, name="mid", source="bench"), MID
    else:
        spec, config = resolve_model(model), None
    # pure bf16 LoRA keeps its adapters in bf16 (torchtune, LitGPT), which FSDP1 needs to flatten a unit
    lora = LoraSpec(adapter_fp32=False) if method == "lora" and precision == "bf16-true" else None
    train = TrainSpec(
        method=Method(method),
        precision=Precision(precision),
        micro_batch=b,
        seq_len=L,
        grad_ckpt=ckpt,
        world_size=world,
        lora=lora,
        **ENGINES[engine],
    )
    return spec, train, config


def _phases(ledger: Ledger) -> dict[str, Any]:
    """Allocated bytes at each phase's peak, and by category."""
    return {
        p.value: {
            "allocated": ledger.allocated(p),
            "by_category": {c.value: ledger.bytes_of(c, p) for c in ledger.categories() if c.allocated},
        }
        for p in PHASES
        if p in ledger.phases
    }


def _reserved(ledger: Ledger) -> dict[str, Any]:
    """Reserved bytes at each phase's peak (allocated + the allocator-reserve line) and their maximum."""
    return {
        "peak_reserved": ledger.peak_reserved,
        "reserved_by_phase": {p.value: ledger.reserved(p) for p in PHASES[1:] if p in ledger.phases},
    }


def analytic(row: tuple[str, str, int, str, str, int, int, bool]) -> dict[str, Any]:
    from vramledger.analytic import estimate

    m, t, _ = _specs(row)
    ledger = estimate(m, t)
    return {"peak_allocated": ledger.peak_allocated, "phases": _phases(ledger)} | _reserved(ledger)


def pools(dev: Any) -> dict[str, Any]:
    """The replay of trace/oom.py ``stream_pools`` (one ``CachingAllocatorModel`` per stream, default settings,
    unlimited device) followed to its end: the peak of the summed reserved bytes (reserved never falls without
    ``empty_cache``), and each pool's reserved, peak reserved and peak allocated."""
    from vramledger.trace.oom import stream_pools

    peak_total = 0
    models: dict[str, Any] = {}
    for models in stream_pools(dev):
        peak_total = max(peak_total, sum(m.reserved for m in models.values()))
    return {
        "peak_reserved": peak_total,
        "pools": {
            s or "default": {
                "reserved": m.reserved,
                "peak_reserved": m.peak_reserved,
                "peak_allocated": m.peak_allocated,
            }
            for s, m in sorted(models.items(), key=lambda kv: kv[0] or "default")
        },
    }


def traced(row: tuple[str, str, int, str, str, int, int, bool]) -> dict[str, Any]:
    from unittest import mock

    import vramledger.trace.api as api
    from vramledger.trace import trace_step

    m, t, config = _specs(row)
    start = time.time()
    seen: list[Any] = []

    def keep(*args: Any, **kwargs: Any) -> Any:  # the replay's input, as trace_step builds it
        seen.append(api_device_events(*args, **kwargs))
        return seen[-1]

    api_device_events = api.device_events
    with warnings.catch_warnings(), mock.patch.object(api, "device_events", keep):
        warnings.simplefilter("ignore")
        ledger = trace_step(m, t, config=config)
    return {
        "seconds": round(time.time() - start, 1),
        "peak_allocated": ledger.peak_allocated,
        "phases": _phases(ledger),
        "versions": ledger.settings.get("versions", ""),
        **_reserved(ledger),
        "replay": pools(seen[-1]),
    }


def single_view(row: tuple[str, str, int, str, str, int, int, bool]) -> dict[str, Any]:
    """The same step on one GPU in the dtype the engine computes in (analytic/distributed/core.py ``single_gpu_spec``
    and ``_engine_casts``), traced and estimated: the single-GPU error the per-rank figures inherit."""
    from vramledger.analytic import estimate
    from vramledger.analytic.distributed import compute_view
    from vramledger.trace import trace_step

    m, t, config = _specs(row)
    view = compute_view(t)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced_ledger = trace_step(m, view, config=config)
    ours = estimate(m, view)
    return {
        "trace_peak_allocated": traced_ledger.peak_allocated,
        "analytic_peak_allocated": ours.peak_allocated,
        "trace_peak_reserved": traced_ledger.peak_reserved,
        "analytic_peak_reserved": ours.peak_reserved,
    }


def _load() -> dict[str, dict[str, Any]]:
    if not OUT.exists():
        return {}
    return {d["id"]: d for d in (json.loads(line) for line in OUT.read_text().splitlines() if line.strip())}


def _save(rows: dict[str, dict[str, Any]]) -> None:
    order = [_id(r) for r in GRID]
    OUT.write_text("".join(json.dumps(rows[i]) + "\n" for i in order if i in rows))


def table(rows: dict[str, dict[str, Any]]) -> str:
    lines = ["| config | trace (rank 0) | estimate | error |", "|---|---:|---:|---:|"]
    for r in GRID:
        d = rows.get(_id(r))
        if d is None:
            continue
        t, a = d["trace"]["peak_allocated"], d["analytic"]["peak_allocated"]
        lines.append(f"| {d['id']} | {t / 2**30:.2f} GiB | {a / 2**30:.2f} GiB | {100 * (a - t) / t:+.1f}% |")
    return "\n".join(lines)


def reserved_table(rows: dict[str, dict[str, Any]]) -> str:
    """Rank 0's peak reserved, the estimate against the trace's replay, and the side-stream pools apart (FSDP's
    all-gather + reduce-scatter pools: the replay's against analytic/distributed/stream_pools.py ``side_pools``).
    The trace runs one shape, so the estimate is the packed run's (every step B × L); a run with dynamic padding keeps
    the cache of its shorter shapes too (docs/reserve.md "Runs"), and its estimate is the last column."""
    from dataclasses import replace

    from vramledger.analytic import estimate
    from vramledger.analytic.distributed.stream_pools import side_pools
    from vramledger.analytic.step import step_parts

    lines = [
        "| config | trace reserved | estimate (one shape) | error | side pools: trace | estimate | padded run |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in GRID:
        d = rows.get(_id(r))
        if d is None:
            continue
        m, t, _ = _specs(r)
        want, got = d["trace"]["peak_reserved"], estimate(m, replace(t, packing=True)).peak_reserved
        padded = estimate(m, t).peak_reserved
        pools = d["trace"]["replay"]["pools"]
        side_want = sum(p["reserved"] for s, p in pools.items() if s != "default")
        side_got = side_pools(m, t, step_parts(m, t).weights).total
        lines.append(
            f"| {d['id']} | {want / 2**20:,.0f} MiB | {got / 2**20:,.0f} MiB | {100 * (got - want) / want:+.1f}% "
            f"| {side_want / 2**20:,.0f} MiB | {side_got / 2**20:,.0f} MiB | {100 * (padded - want) / want:+.1f}% |"
        )
    return "\n".join(lines)


def _replay_input(row: tuple[str, str, int, str, str, int, int, bool]) -> tuple[list[Any], Any]:
    """One config traced: its events and the device events trace/oom.py replays (with each one's stream)."""
    from vramledger.trace import trace_events
    from vramledger.trace.oom import device_events

    m, t, config = _specs(row)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        events = trace_events(m, t, config=config)
    return events, device_events(events, None)


def default_pool_causes(row: tuple[str, str, int, str, str, int, int, bool]) -> list[str]:
    """The default stream's pool at step 2's peak allocated, in the replay of the trace: the segments step 2 had to
    make (what step 1's cache could not serve) and what lives then in the segments step 1's logits chain made."""
    from collections import Counter

    from vramledger.allocator.model import CachingAllocatorModel
    from vramledger.allocator.replay import EventKind

    events, dev = _replay_input(row)
    pool = CachingAllocatorModel()
    live: dict[int, Any] = {}
    what: dict[int, str] = {}
    logits_segments: set[int] = set()
    made: Counter[str] = Counter()
    peak: tuple[int, Counter[str]] = (0, Counter())
    for ev, src in zip(dev.events, dev.origin, strict=True):
        if dev.streams.get(ev.id, ""):
            continue  # a side stream's pool
        step = events[src].step if src >= 0 else 1
        if ev.kind is EventKind.ALLOC:
            before = pool.reserved
            live[ev.id] = blk = pool.malloc(ev.size) if ev.size else None
            cat = ev.category.value if ev.category else ""
            what[ev.id] = f"step {step} {ev.phase.value if ev.phase else ''} {ev.op} ({cat}) {ev.size / 2**20:.1f} MiB"
            if blk is not None and pool.reserved > before:
                # FSDP's own buffers made inside the root's forward (its unsharded parameters' all-gather outputs,
                # FSDP1's lazy-init flat buffers) are filed under logits too: only the loss's ops make the chain
                if step == 1 and cat == "logits_loss" and ev.op not in ("empty", "empty_like", "resize_"):
                    logits_segments.add(blk.seg)
                if step == 2:
                    made[what[ev.id]] += pool.reserved - before
        else:
            blk = live.pop(ev.id)
            if blk is not None:
                pool.free(blk)
        if step == 2 and pool.allocated > peak[0]:
            tenants = Counter(what[i] for i, b in live.items() if b is not None and b.seg in logits_segments)
            peak = (pool.allocated, tenants)
    out = [
        f"default pool: reserved {pool.reserved / 2**20:,.0f} MiB, step 2's peak allocated {peak[0] / 2**20:,.1f} MiB"
    ]
    out += [f"  made in step 2: {n / 2**20:,.0f} MiB for {k}" for k, n in made.most_common() if n > 2 * 2**20]
    out += [f"  in step 1's logits segments at that peak: {n} x {k}" for k, n in peak[1].most_common()]
    return out


def _segment_kind(maker: tuple[int, str, str], size: int, holds_workspace: bool) -> str:
    """What made a default-pool segment, in the terms of analytic/distributed/fsdp_workspace.py's floor."""
    step, op, cat = maker
    if cat == "logits_loss" and op in ("empty", "empty_like", "resize_"):
        # made inside the root's forward, but FSDP's: the root's unsharded parameters (FSDP2), FSDP1's lazy-init
        # flat buffers (_flat_param.py init_flat_param_attributes), where forward's cuBLAS workspace may sit
        return "FSDP's unsharded-buffer segments"
    if holds_workspace:
        return "workspace block's segment"
    if size <= 2 * 2**20:
        return "small pool"
    if step == 1 and cat == "logits_loss" and op == "mm":
        return "c·V·T hole"
    if cat == "logits_loss" and op not in ("empty", "resize_"):
        return "other logits segments"
    if size == 20 * 2**20:
        return "20 MiB segments"
    return "other"


def default_pool_free(row: tuple[str, str, int, str, str, int, int, bool]) -> str:
    """The default stream's pool at step 2's peak allocated, in the replay of the trace: its reserved bytes, the
    bytes its blocks hold (the requests, and the requests as the allocator rounds and splits them), what the side
    pools hold then, and the free bytes by kind of segment (the segment holding step 1's backward cuBLAS workspace
    among the logits blocks; forward's c·V·T logits block; the other logits blocks; the 20 MiB segments of requests
    under 10 MiB; the small pool's 2 MiB segments; the rest)."""
    from vramledger.allocator.model import CachingAllocatorModel
    from vramledger.allocator.replay import EventKind

    events, dev = _replay_input(row)
    pool = CachingAllocatorModel()
    live: dict[int, Any] = {}
    asked: dict[int, tuple[int, str, int]] = {}  # size, category, step
    side: dict[int, int] = {}
    made: dict[int, tuple[tuple[int, str, str], int]] = {}  # segment -> (maker, reserved bytes)
    peak: tuple[int, int, int, int, dict[str, int]] = (0, 0, 0, 0, {})
    for ev, src in zip(dev.events, dev.origin, strict=True):
        step = events[src].step if src >= 0 else 1
        if dev.streams.get(ev.id, ""):
            if ev.kind is EventKind.ALLOC:
                side[ev.id] = ev.size
            else:
                side.pop(ev.id, None)
            continue
        cat = ev.category.value if ev.category else ""
        if ev.kind is EventKind.ALLOC:
            before = pool.reserved
            live[ev.id] = blk = pool.malloc(ev.size) if ev.size else None
            asked[ev.id] = (ev.size, cat, step)
            if blk is not None and pool.reserved > before:
                made[blk.seg] = ((step, ev.op, cat), pool.reserved - before)
        else:
            blk = live.pop(ev.id)
            if blk is not None:
                pool.free(blk)
        if step == 2 and pool.allocated > peak[0]:
            used: dict[int, int] = {}
            workspace: set[int] = set()
            for i, b in live.items():
                if b is None:
                    continue
                used[b.seg] = used.get(b.seg, 0) + b.size
                if asked[i][1] == "workspace" and asked[i][2] == 1 and made[b.seg][0][2] == "logits_loss":
                    workspace.add(b.seg)
            free: dict[str, int] = {}
            for seg, (maker, size) in made.items():
                kind = _segment_kind(maker, size, seg in workspace)
                free[kind] = free.get(kind, 0) + size - used.get(seg, 0)
            requested = sum(asked[i][0] for i, b in live.items() if b is not None)
            peak = (pool.allocated, pool.reserved, requested, sum(side.values()), free)
    allocated, reserved, requested, side_live, free = peak
    mib = 2**20
    out = [
        f"default pool at step 2's peak allocated: reserved {reserved / mib:,.1f} MiB, allocated {allocated / mib:,.1f}"
        f" (requested {requested / mib:,.1f}); side pools' live bytes then {side_live / mib:,.1f} MiB",
    ]
    out += [f"  free in {k}: {n / mib:,.1f} MiB" for k, n in sorted(free.items(), key=lambda kv: -kv[1]) if n]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--analytic", action="store_true")
    ap.add_argument("--only")
    ap.add_argument("--retrace", metavar="TEXT", help="trace again every config whose id contains TEXT")
    ap.add_argument("--table", action="store_true")
    ap.add_argument("--reserved", action="store_true", help="the reserved table of docs/distributed.md")
    ap.add_argument("--causes", metavar="ID", help="trace one config and print where its default pool's excess sits")
    ap.add_argument("--free", metavar="ID", help="trace one config and print its default pool's free bytes by kind")
    ap.add_argument("--views", action="store_true", help="add each row's single-GPU compute view, traced and estimated")
    args = ap.parse_args()
    rows = _load()
    if args.views:
        cache: dict[str, dict[str, Any]] = {}
        for row in GRID:
            d = rows.get(_id(row))
            if d is None:
                continue
            from vramledger.analytic.distributed import compute_view

            key = row[0] + repr(compute_view(_specs(row)[1]))  # the model and the view
            if key not in cache:
                cache[key] = single_view(row)
            d["single_view"] = cache[key]
        _save(rows)
        return
    if args.table:
        print(table(rows))
        return
    if args.reserved:
        print(reserved_table(rows))
        return
    if args.free:
        print(default_pool_free(next(r for r in GRID if _id(r) == args.free)))
        return
    if args.causes:
        print("\n".join(default_pool_causes(next(r for r in GRID if _id(r) == args.causes))))
        return
    for row in GRID:
        rid = _id(row)
        if args.only and rid != args.only:
            continue
        if args.analytic:
            if rid in rows:
                rows[rid]["analytic"] = analytic(row)
            continue
        if args.retrace is not None and args.retrace not in rid:
            continue
        if rid in rows and not (args.only or args.retrace) and "replay" in rows[rid]["trace"]:
            continue  # traced already, with the replay's pools
        d = {"id": rid, "trace": traced(row), "analytic": analytic(row)}
        if "single_view" in rows.get(rid, {}):
            d["single_view"] = rows[rid]["single_view"]
        t, a = d["trace"]["peak_allocated"], d["analytic"]["peak_allocated"]
        print(
            f"{rid}: trace {t / 2**30:.3f} GiB, estimate {a / 2**30:.3f} GiB ({100 * (a - t) / t:+.1f}%), "
            f"{d['trace']['seconds']} s",
            flush=True,
        )
        if args.only:
            print(json.dumps(d, indent=1))
            return
        rows[rid] = d
        _save(rows)
    if args.analytic:
        _save(rows)


if __name__ == "__main__":
    main()
