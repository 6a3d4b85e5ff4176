"""Replay real allocation streams through the allocator port and compare, event by event, with the real cache.

The accuracy suite records each trial's allocator events on the GPU (``streams.py``). Replaying exactly that
stream through :class:`vramledger.allocator.model.CachingAllocatorModel` checks the port on its own, apart from
the tracer: the real reserved memory after every event is known from the stream's ``segment_alloc`` /
``segment_free`` (and ``segment_map`` / ``segment_unmap`` with expandable segments) entries, so the two
trajectories can be compared everywhere, not only at the peak.

  PYTHONPATH=src python bench/accuracy/replay_streams.py STREAMS.tar|DIR|FILE.json.xz ... [--json OUT]

Per stream: the real and replayed peak reserved (after the build's ``empty_cache``, i.e. over the training
steps, and over the whole stream), the number of device allocations (cudaMalloc or page maps) on each side,
and the first event where the two reserved trajectories part, with its action and size (the rule to look at).
"""

from __future__ import annotations

import argparse
import io
import json
import lzma
import sys
import tarfile
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vramledger.allocator.conf import parse_alloc_conf
from vramledger.allocator.model import CachingAllocatorModel

_REAL_DELTA = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


@dataclass(frozen=True, kw_only=True, slots=True)
class StreamComparison:
    id: str
    alloc_conf: str | None
    events: int
    real_peak_reserved: int
    model_peak_reserved: int
    real_peak_reserved_steps: int
    model_peak_reserved_steps: int
    real_device_allocs: int
    model_device_allocs: int
    first_divergence: int | None
    """Index of the first event after which the reserved bytes differ (None: identical throughout)."""
    divergence_event: str | None
    other_streams: int
    """Allocations on a CUDA stream other than the first one seen (the port models one stream)."""
    overflowed: bool

    @property
    def steps_error(self) -> float:
        return (self.model_peak_reserved_steps - self.real_peak_reserved_steps) / max(1, self.real_peak_reserved_steps)


def compare(stream: Mapping[str, Any]) -> StreamComparison:
    """Replay one reduced stream (``streams.load``) and compare reserved memory after every event."""
    actions = stream["actions"]
    model = CachingAllocatorModel(parse_alloc_conf(stream.get("alloc_conf") or ""))
    marker = stream.get("empty_cache_at")
    live: dict[int, Any] = {}
    real = real_peak = real_steps = model_peak_steps = real_allocs = 0
    first: int | None = None
    first_event: str | None = None
    main_stream: int | None = None
    other = 0
    for i, (a, addr, size, cuda_stream) in enumerate(stream["events"]):
        if marker is not None and i == marker:
            model.empty_cache()
        action = actions[a]
        if action == "alloc":
            main_stream = cuda_stream if main_stream is None else main_stream
            other += cuda_stream != main_stream
            live[addr] = model.malloc(size)
        elif action == "free_completed":
            blk = live.pop(addr, None)
            if blk is not None:
                model.free(blk)
        elif action in _REAL_DELTA:
            real += _REAL_DELTA[action] * size
            real_allocs += _REAL_DELTA[action] > 0
        real_peak = max(real_peak, real)
        if marker is None or i >= marker:
            real_steps = max(real_steps, real)
            model_peak_steps = max(model_peak_steps, model.reserved)
        # Segment entries are recorded inside malloc, before its alloc entry: compare where both sides settle.
        settled = action in ("alloc", "free_completed")
        if first is None and settled and model.reserved != real:
            first, first_event = i, f"{action} {size} B (real {real} B, model {model.reserved} B)"
    return StreamComparison(
        id=str(stream.get("id")),
        alloc_conf=stream.get("alloc_conf"),
        events=len(stream["events"]),
        real_peak_reserved=real_peak,
        model_peak_reserved=model.peak_reserved,
        real_peak_reserved_steps=real_steps,
        model_peak_reserved_steps=model_peak_steps,
        real_device_allocs=real_allocs,
        model_device_allocs=model.num_device_alloc,
        first_divergence=first,
        divergence_event=first_event,
        other_streams=other,
        overflowed=bool(stream.get("overflowed")),
    )


def _streams(path: Path) -> Iterator[dict[str, Any]]:
    if path.is_dir():
        for f in sorted(path.glob("*.json.xz")):
            yield from _streams(f)
    elif path.suffix == ".tar":
        with tarfile.open(path) as tar:
            for member in sorted(tar.getmembers(), key=lambda m: m.name):
                if member.isfile() and member.name.endswith(".json.xz"):
                    raw = tar.extractfile(member)
                    assert raw is not None
                    with lzma.open(io.BytesIO(raw.read()), "rt") as f:
                        yield json.load(f)
    else:
        with lzma.open(path, "rt") as f:
            yield json.load(f)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("paths", type=Path, nargs="+")
    ap.add_argument("--json", type=Path, help="also write the comparisons as JSON lines here")
    args = ap.parse_args(argv)
    rows = [compare(s) for p in args.paths for s in _streams(p)]
    gib = 2**30
    print(f"{'stream':<40} {'real GiB':>9} {'model GiB':>9} {'error':>7} {'cudaMalloc r/m':>15}  first divergence")
    for r in rows:
        div = "none" if r.first_divergence is None else f"#{r.first_divergence}: {r.divergence_event}"
        name = r.id + (f" [{r.alloc_conf}]" if r.alloc_conf else "")
        print(f"{name:<40} {r.real_peak_reserved_steps / gib:>9.3f} {r.model_peak_reserved_steps / gib:>9.3f} "
              f"{r.steps_error * 100:>+6.2f}% {r.real_device_allocs:>7}/{r.model_device_allocs:<7}  {div}"
              + ("  (history overflowed: not comparable)" if r.overflowed else ""))  # fmt: skip
    if args.json:
        with open(args.json, "x") as f:
            for r in rows:
                f.write(json.dumps(asdict(r)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
