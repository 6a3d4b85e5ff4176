"""The ledger as JSON: the stable machine-readable form (`--json`)."""

from __future__ import annotations

import json
from typing import Any

from vramledger.ledger import Ledger


def ledger_to_dict(ledger: Ledger) -> dict[str, Any]:
    v = ledger.verdict
    return {
        "model": ledger.model,
        "engine": ledger.engine,
        "params": ledger.params,
        "trainable_params": ledger.trainable_params,
        "peak_allocated_bytes": ledger.peak_allocated,
        "peak_reserved_bytes": ledger.peak_reserved,
        "device_total_bytes": ledger.device_total,
        "peak_phase": ledger.peak_phase.value,
        "fits": None if v is None else v.fits,
        "verdict": None
        if v is None
        else {
            "gpu": v.gpu,
            "capacity_bytes": v.capacity_bytes,
            "headroom_fraction": v.headroom_fraction,
            "usable_bytes": v.usable_bytes,
            "margin_bytes": v.margin_bytes,
            "without_cache_bytes": v.without_cache_bytes,
        },
        "phases": {
            p.value: {
                "allocated_bytes": ledger.allocated(p),
                "reserved_bytes": ledger.reserved(p),
                "device_bytes": ledger.device(p),
                "moment": ledger.moments.get(p, ""),
            }
            for p in ledger.phases
        },
        "items": [
            {
                "category": i.category.value,
                "phase": i.phase.value,
                "bytes": i.bytes,
                "label": i.label,
                "source": i.source,
                "basis": i.basis.value,
            }
            for i in ledger.items
        ],
        "advice": ledger.advice,
        "warnings": list(ledger.warnings),
        "settings": dict(ledger.settings),
    }


def dumps(ledger: Ledger) -> str:
    return json.dumps(ledger_to_dict(ledger), indent=2, default=str)
