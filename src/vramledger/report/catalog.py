"""Listings of the bundled catalogs."""

from __future__ import annotations

import json

from vramledger.analytic.params import count_params
from vramledger.catalog import gpu_entries, model_entries
from vramledger.units import GiB


def print_models(*, as_json: bool) -> None:
    rows = []
    for key, entry in model_entries().items():
        spec = entry.spec()
        rows.append(
            {
                "key": key,
                "hub_id": entry.hub_id,
                "family": spec.family,
                "params": count_params(spec),
                "aliases": list(entry.aliases),
            }
        )
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'name':<24} {'hub id':<44} {'family':<12} {'params':>16}")
    for r in rows:
        print(f"{r['key']:<24} {r['hub_id']:<44} {r['family']:<12} {r['params']:>16,}")


def print_gpus(*, as_json: bool) -> None:
    gpus = list(gpu_entries().values())
    if as_json:
        print(json.dumps([{"key": g.key, "name": g.name, "memory_bytes": g.memory_bytes} for g in gpus], indent=2))
        return
    print(f"{'key':<16} {'name':<36} {'memory':>10} {'bf16 TFLOP/s':>13} {'GB/s':>7}")
    for g in gpus:
        mem = f"{g.memory_bytes / GiB:>6.1f} GiB"
        print(f"{g.key:<16} {g.name:<36} {mem} {g.bf16_tflops:>13.1f} {g.memory_bandwidth_gbs:>7.0f}")
