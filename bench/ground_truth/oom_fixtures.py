"""Ground truth for ``explain``: three real out-of-memory failures, each with the allocator's full evidence.

Each case runs in its own child process (an OOM, the memory fraction and the recorded history must not
leak into the next case). The usable memory is capped with ``torch.cuda.set_per_process_memory_fraction``
(a cap on the caching allocator's reserved bytes; the CUDA context is outside it), the cap chosen from a
first, uncapped measurement of the same workload so that the OOM lands where intended:

- ``backward``: a LoRA step of Llama-3.2-1B (batch 8 x 2048): cap = midway between the forward's and the
  backward's peak reserved, so the forward fits and the backward (logit gradients, activation gradients)
  does not;
- ``eval``: training (batch 4 x 1024) fits under a cap 15% above its peak reserved; evaluation with
  ``compute_metrics`` and no ``eval_accumulation_steps`` keeps every batch's logits on the GPU, concatenated
  as ``transformers.trainer_pt_utils.EvalLoopContainer.add`` -> ``nested_concat`` does, until it fails;
- ``fragmentation``: a 4 GiB block is carved into alternating big holes (64-192 MiB, varying sizes) and
  small live pins (2 MiB); the holes are freed, so reserved is far above allocated, but no free block fits
  a 512 MiB request and no segment is wholly free for ``release_cached_blocks`` to return: the request
  fails with gigabytes "reserved by PyTorch but unallocated".

Evidence per case, taken at the moment of failure by an OOM observer
(``torch._C._cuda_attach_out_of_memory_observer``, as in PyTorch's "Understanding CUDA Memory Usage"):
``torch.cuda.memory._snapshot()`` with the history of ``torch.cuda.memory._record_memory_history(
"all", context="all", stacks="python", max_entries=...)``, ``torch.cuda.memory_stats()`` and
``torch.cuda.memory_summary()``; then the exception text ``str(exc)``. Files:

- ``oom_<case>.json``: message, phase, requested bytes, allocated/reserved/largest free block at failure,
  memory_stats, memory_summary, calibration, environment, config;
- ``oom_<case>.snapshot.pickle.gz``: the snapshot, trimmed (segments with their blocks; the last
  ``KEEP_TRACE`` trace entries; at most ``KEEP_FRAMES`` frames each), in ``torch.cuda.memory._dump_snapshot``'s
  format (gunzip it, then open it in https://pytorch.org/memory_viz);
- ``oom_<case>.snapshot.json.gz``: the same snapshot as JSON.

``--device cpu`` runs the same control flow with a byte counter and a fake capacity (no allocator, no
snapshot): it proves the script, not the numbers.
"""

from __future__ import annotations

import gzip
import json
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _common as C

CASES = ("backward", "eval", "fragmentation")
TOTAL_BUDGET_S = 130.0  # run_all.sh kills at 150 s
CASE_TIMEOUT_S = 60.0
MAX_ENTRIES = 20_000
KEEP_TRACE = 3_000
KEEP_FRAMES = 8

CONFIGS: dict[str, dict[str, Any]] = {
    "backward": {
        "model": "meta-llama/Llama-3.2-1B",
        "method": "lora",
        "lora_rank": 16,
        "attn": "sdpa",
        "batch": 8,
        "seq": 2048,
        "cap": "midway between forward and backward peak reserved",
    },
    "eval": {
        "model": "meta-llama/Llama-3.2-1B",
        "method": "lora",
        "lora_rank": 16,
        "attn": "sdpa",
        "train_batch": 4,
        "train_seq": 1024,
        "eval_batch": 8,
        "eval_seq": 1024,
        "max_eval_batches": 60,
        "cap": "1.15 x training peak reserved",
        "eval_mode": "logits of every batch concatenated on the GPU (nested_concat), Trainer with "
        "compute_metrics and eval_accumulation_steps=None",
    },
    "fragmentation": {
        "arena_bytes": 4 * C.GIB,
        "hole_mib": [64, 192],
        "pin_mib": 2,
        "request_mib": 512,
        "seed": 0,
        "cap": "reserved after carving + 256 MiB",
    },
}
SMOKE_CONFIGS: dict[str, dict[str, Any]] = {
    "backward": {**CONFIGS["backward"], "batch": 2, "seq": 64},
    "eval": {
        **CONFIGS["eval"],
        "train_batch": 2,
        "train_seq": 32,
        "eval_batch": 2,
        "eval_seq": 32,
        "max_eval_batches": 60,
    },
    "fragmentation": {
        **CONFIGS["fragmentation"],
        "arena_bytes": 4 * C.MIB,
        "hole_mib": [0.0625, 0.1875],
        "pin_mib": 0.002,
        "request_mib": 0.5,
    },
}


# -- the snapshot --------------------------------------------------------------------------------------------


def trim_snapshot(snap: dict[str, Any], keep_trace: int = KEEP_TRACE, keep_frames: int = KEEP_FRAMES) -> dict[str, Any]:
    """A smaller snapshot in the same format: every segment and block, the last trace entries, top frames.

    >>> s = {"segments": [{"blocks": [{"frames": list(range(20))}]}], "device_traces": [[{"frames": [1]}] * 9]}
    >>> t = trim_snapshot(s, keep_trace=2, keep_frames=3)
    >>> len(t["segments"][0]["blocks"][0]["frames"]), len(t["device_traces"][0])
    (3, 2)
    """

    def cut(entry: dict[str, Any]) -> dict[str, Any]:
        return {**entry, "frames": entry["frames"][:keep_frames]} if "frames" in entry else dict(entry)

    out = dict(snap)
    out["segments"] = [{**seg, "blocks": [cut(b) for b in seg.get("blocks", [])]} for seg in snap.get("segments", [])]
    out["device_traces"] = [[cut(e) for e in trace[-keep_trace:]] for trace in snap.get("device_traces", [])]
    return out


def snapshot_facts(snap: dict[str, Any]) -> dict[str, Any]:
    """Reserved, allocated and the largest free ("inactive") block, read from the snapshot's segments."""
    free = [
        b["size"] for seg in snap.get("segments", []) for b in seg.get("blocks", []) if b.get("state") == "inactive"
    ]
    return {
        "segments": len(snap.get("segments", [])),
        "reserved": sum(seg.get("total_size", 0) for seg in snap.get("segments", [])),
        "allocated": sum(seg.get("allocated_size", 0) for seg in snap.get("segments", [])),
        "free_blocks": len(free),
        "largest_free_block": max(free, default=0),
        "free_in_segments": sum(free),
    }


def save_snapshot(snap: dict[str, Any], out: Path, name: str) -> dict[str, Any]:
    trimmed = trim_snapshot(snap)
    pkl = out / f"oom_{name}.snapshot.pickle.gz"
    with gzip.open(pkl, "wb") as f:
        pickle.dump(trimmed, f)  # torch.cuda.memory._dump_snapshot writes pickle.dump(_snapshot())
    js = out / f"oom_{name}.snapshot.json.gz"
    with gzip.open(js, "wt") as f:
        json.dump(trimmed, f, default=str)
    return {
        "pickle": pkl.name,
        "json": js.name,
        "pickle_bytes": pkl.stat().st_size,
        "json_bytes": js.stat().st_size,
        "trace_entries_kept": sum(len(t) for t in trimmed["device_traces"]),
        "trace_entries_recorded": sum(len(t) for t in snap.get("device_traces", [])),
    }


class Evidence:
    """What the OOM observer saw at the moment of failure, and the phase the workload was in."""

    def __init__(self, device: Any, probe: C.Probe) -> None:
        self.device = device
        self.probe = probe
        self.phase = "setup"
        self.at_oom: dict[str, Any] | None = None
        self.snapshot: dict[str, Any] | None = None
        self.notes: dict[str, Any] = {}  # calibration, caps, attempts: written to the record whatever happens

    def reset(self) -> None:
        self.at_oom = None
        self.snapshot = None

    def attach(self) -> None:
        import torch

        if self.device.type == "cuda":
            attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
            if attach is not None:  # without it, run_case snapshots after the exception instead
                attach(self._cuda_observer)
        else:
            assert self.probe.counter is not None
            self.probe.counter.on_oom = self._cpu_observer

    def _cuda_observer(self, device: int, alloc: int, limit_or_total: int, device_free: int) -> None:
        # Called by DeviceCachingAllocator::malloc after its retries failed and its lock was released, with
        # the allowed maximum (the fraction's cap, else the device total) and cudaMemGetInfo's free bytes.
        import torch

        if self.at_oom is not None:
            return  # the first OOM is the evidence; a second one is recorded by its count in memory_stats
        self.at_oom = {
            "phase": self.phase,
            "requested": int(alloc),
            "observer_limit_or_total": int(limit_or_total),
            "observer_device_free": int(device_free),
            "allocated": int(torch.cuda.memory_allocated()),
            "reserved": int(torch.cuda.memory_reserved()),
            "memory_stats": dict(torch.cuda.memory_stats()),
            "memory_summary": torch.cuda.memory_summary(),
        }
        self.snapshot = torch.cuda.memory._snapshot()

    def _cpu_observer(self, requested: int) -> None:
        if self.at_oom is None:
            self.at_oom = {
                "phase": self.phase,
                "requested": requested,
                **self.probe.read(),
                "memory_stats": None,
                "memory_summary": None,
            }


def set_cap(device: Any, probe: C.Probe, limit: int) -> dict[str, Any]:
    """Cap the allocator at ``limit`` bytes (``set_per_process_memory_fraction``); CPU: the fake capacity."""
    import torch

    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        frac = min(1.0, limit / total)
        torch.cuda.set_per_process_memory_fraction(frac, device)
        return {"limit_bytes": int(limit), "fraction": frac, "total_bytes": int(total)}
    assert probe.counter is not None
    probe.counter.capacity = int(limit)
    return {"limit_bytes": int(limit), "fraction": None, "total_bytes": None}


def stop_history(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.memory._record_memory_history(enabled=None)


def start_history(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.memory._record_memory_history("all", context="all", stacks="python", max_entries=MAX_ENTRIES)


def release(device: Any) -> None:
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- the workloads -------------------------------------------------------------------------------------------


def _batch(b: int, L: int, vocab: int, device: Any) -> Any:
    import torch

    return torch.randint(3, vocab, (b, L), generator=torch.Generator().manual_seed(0)).to(device)


def _train_step(model: Any, opt: Any, ids: Any, ev: Evidence, probe: C.Probe) -> dict[str, dict[str, int]]:
    """One LoRA step; returns the probe's reading (peaks since the phase start) per phase."""
    import torch

    peaks = {}
    ev.phase = "forward"
    probe.begin()
    with torch.autocast(ids.device.type, dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    peaks["forward"] = probe.read()
    ev.phase = "backward"
    probe.begin()
    loss.backward()
    del loss
    peaks["backward"] = probe.read()
    ev.phase = "optimizer"
    probe.begin()
    opt.step()
    opt.zero_grad(set_to_none=True)
    peaks["optimizer"] = probe.read()
    return peaks


def _calibrate(model: Any, opt: Any, ids: Any, ev: Evidence, probe: C.Probe, device: Any) -> dict[str, dict[str, int]]:
    """Peak reserved per phase of an uncapped step, the second one: the first creates AdamW's state, which
    is then resident during every later forward."""
    _train_step(model, opt, ids, ev, probe)
    release(device)
    calib = _train_step(model, opt, ids, ev, probe)
    release(device)
    return calib


def case_backward(cfg: dict[str, Any], device: Any, smoke: bool, ev: Evidence, probe: C.Probe) -> None:
    """Cap between the forward's and the backward's peak allocated; move it until the OOM is in backward.

    The cap limits reserved bytes, but on a failed cudaMalloc the allocator frees its unused cached segments
    and retries (``release_cached_blocks``), so allocated bytes are what must fit. If the forward fails the
    cap goes up, if nothing fails it goes down (bisection, at most ``tries`` steps)."""
    import torch

    model = C.build_model(
        cfg["model"], device, method=cfg["method"], lora_rank=cfg["lora_rank"], attn=cfg["attn"], smoke=smoke
    )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = _batch(cfg["batch"], cfg["seq"], model.config.vocab_size, device)
    calib = _calibrate(model, opt, ids, ev, probe, device)
    ev.notes["calibration"] = calib
    f, b = calib["forward"]["max_allocated"], calib["backward"]["max_allocated"]
    lo, hi, t, tries = 0.0, 1.0, 0.5, 5
    attempts = ev.notes.setdefault("attempts", [])
    for i in range(tries):
        cap = set_cap(device, probe, int(f + t * (b - f)))
        attempt = {"t": t, **cap}
        attempts.append(attempt)
        ev.reset()
        start_history(device)
        C.log(
            f"attempt {i}: cap {cap['limit_bytes'] / C.GIB:.3f} GiB (forward {f / C.GIB:.3f}, backward {b / C.GIB:.3f})"
        )
        try:
            _train_step(model, opt, ids, ev, probe)
            attempt["outcome"] = "no_oom"
            hi = t
        except Exception as exc:  # noqa: BLE001 - an OOM in the wrong phase moves the cap
            attempt["outcome"] = f"{type(exc).__name__} in {ev.phase}"
            if not C.is_oom(exc) or ev.phase == "backward" or i == tries - 1:
                raise
            lo = t
        opt.zero_grad(set_to_none=True)
        stop_history(device)
        release(device)
        t = (lo + hi) / 2


def case_eval(cfg: dict[str, Any], device: Any, smoke: bool, ev: Evidence, probe: C.Probe) -> None:
    import torch

    model = C.build_model(
        cfg["model"], device, method=cfg["method"], lora_rank=cfg["lora_rank"], attn=cfg["attn"], smoke=smoke
    )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    vocab = model.config.vocab_size
    ids = _batch(cfg["train_batch"], cfg["train_seq"], vocab, device)
    calib = _calibrate(model, opt, ids, ev, probe, device)
    ev.notes["calibration"] = calib
    limit = int(1.15 * max(r["max_reserved"] for r in calib.values()))
    ev.notes["cap"] = set_cap(device, probe, limit)
    start_history(device)
    ev.notes["capped_train_step"] = _train_step(model, opt, ids, ev, probe)  # proves training fits
    C.log(f"training fits under the cap {limit / C.GIB:.2f} GiB")
    ev.phase = "eval"
    eval_ids = _batch(cfg["eval_batch"], cfg["eval_seq"], vocab, device)
    model.eval()
    acc = None
    done = 0
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        for done in range(1, cfg["max_eval_batches"] + 1):
            out = model(input_ids=eval_ids, labels=eval_ids)
            logits = out.logits
            del out
            # EvalLoopContainer.add -> nested_concat -> torch_pad_and_concatenate: a new tensor each batch.
            acc = logits if acc is None else torch.cat((acc, logits), dim=0)
            del logits
            ev.notes["eval_batches_done"] = done


def case_fragmentation(cfg: dict[str, Any], device: Any, smoke: bool, ev: Evidence, probe: C.Probe) -> None:
    import random

    import torch

    def mib(x: float) -> int:
        return int(x * C.MIB)

    start_history(device)
    ev.phase = "carve"
    # One segment: allocate the arena, free it (the block stays cached), then take pieces of it. Best-fit
    # splits the cached block (DeviceCachingAllocator::get_free_block + alloc_found_block), so every piece
    # lives in the same segment.
    arena = torch.empty(cfg["arena_bytes"], dtype=torch.uint8, device=device)
    del arena
    rng = random.Random(cfg["seed"])
    holes, pins, used = [], [], 0
    lo, hi = cfg["hole_mib"]
    while True:
        h = mib(rng.uniform(lo, hi))
        if used + h + mib(cfg["pin_mib"]) > cfg["arena_bytes"]:
            break
        holes.append(torch.empty(h, dtype=torch.uint8, device=device))
        pins.append(torch.empty(mib(cfg["pin_mib"]), dtype=torch.uint8, device=device))
        used += h + mib(cfg["pin_mib"])
    hole_sizes = [t.numel() for t in holes]
    del holes  # the holes are free but each sits between two live pins
    before = probe.read()
    limit = before["reserved"] + mib(256)
    if device.type == "cpu":
        limit = before["allocated"] + mib(cfg["request_mib"]) // 2  # the counter sees no reserve: fake it
    ev.notes.update(before_request=before, holes=len(hole_sizes), hole_bytes=hole_sizes)
    ev.notes["cap"] = set_cap(device, probe, limit)
    C.log(
        f"carved {len(hole_sizes)} holes; allocated {before['allocated'] / C.MIB:.0f} MiB, reserved "
        f"{before['reserved'] / C.MIB:.0f} MiB; cap {limit / C.MIB:.0f} MiB"
    )
    ev.phase = "big_request"
    big = torch.empty(mib(cfg["request_mib"]), dtype=torch.uint8, device=device)
    del big, pins


# -- one case per process ------------------------------------------------------------------------------------


def run_case(name: str, device_name: str, smoke: bool, out: Path) -> None:
    import torch

    device = torch.device(device_name)
    cfg = (SMOKE_CONFIGS if smoke else CONFIGS)[name]
    probe = C.Probe(device)
    ev = Evidence(device, probe)
    record: dict[str, Any] = {
        "case": name,
        "config": cfg,
        "environment": C.environment(device_name),
        "model_config": C.model_config(cfg["model"], smoke) if "model" in cfg else None,
    }
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with probe:
        ev.attach()
        try:
            fn = {"backward": case_backward, "eval": case_eval, "fragmentation": case_fragmentation}[name]
            fn(cfg, device, smoke, ev, probe)
            record["status"] = "no_oom"
        except Exception as exc:  # noqa: BLE001 - the OOM is the point; anything else is recorded too
            record["status"] = "oom" if C.is_oom(exc) else "error"
            record["exception_type"] = type(exc).__name__
            record["message"] = str(exc)
            record["phase"] = ev.phase
            C.log(f"{name}: {record['status']} in phase {ev.phase}: {str(exc)[:160]}")
        finally:
            if probe.counter is not None:
                probe.counter.capacity = None  # the rest of this process writes files, uncapped
    record["notes"] = ev.notes
    record["at_oom"] = ev.at_oom
    if ev.at_oom is not None:
        record["requested"] = ev.at_oom["requested"]
        record["allocated_at_oom"] = ev.at_oom["allocated"]
        record["reserved_at_oom"] = ev.at_oom["reserved"]
    if device.type == "cuda":
        snap = ev.snapshot
        if snap is None:
            snap = torch.cuda.memory._snapshot()  # no observer call: the state after the exception
            record["snapshot_taken"] = "after the exception"
        else:
            record["snapshot_taken"] = "in the OOM observer"
        stop_history(device)
        record["snapshot_facts"] = snapshot_facts(snap)
        record["snapshot_files"] = save_snapshot(snap, out, name)
        record["memory_stats_after"] = dict(torch.cuda.memory_stats())
    record["wall_s"] = round(time.perf_counter() - t0, 2)
    C.write_json(out / f"oom_{name}.json", record)
    C.log(f"wrote oom_{name}.json ({record['status']})")


def main() -> int:
    args = C.parse_args(__doc__, [("--case", {"choices": CASES, "help": "(internal) run one case here"})])
    if args.case:
        args.out.mkdir(parents=True, exist_ok=True)
        run_case(args.case, args.device, args.smoke, args.out)
        return 0
    deadline = C.Deadline(TOTAL_BUDGET_S)
    for name in CASES:
        left = deadline.left()
        if left < 15:
            C.log(f"skip {name}: {left:.0f} s left")
            continue
        C.log(f"case {name}")
        try:
            rc = subprocess.run(
                C.child_command(__file__, args, "--case", name), timeout=min(CASE_TIMEOUT_S, left)
            ).returncode
            C.log(f"case {name} exit code {rc}")
        except subprocess.TimeoutExpired:
            C.log(f"case {name} killed by its timeout")
    return 0


if __name__ == "__main__":
    sys.exit(main())
