"""One cached door to the analytic estimate: every search in ``plan`` asks it, never ``estimate`` directly.

Specs are frozen (hashable), so a (model, train, gpu, headroom) key identifies a ledger; the searches ask for the
same configurations many times (the frontier's neighbours, the planner's remedy combinations).
"""

from __future__ import annotations

from functools import lru_cache

from vramledger.ledger import Ledger
from vramledger.specs import GPUSpec, ModelSpec, TrainSpec


@lru_cache(maxsize=65536)
def ledger(model: ModelSpec, train: TrainSpec, gpu: GPUSpec, headroom: float) -> Ledger:
    """The analytic ledger with its verdict (cached)."""
    from vramledger.analytic import estimate

    return estimate(model, train, gpu=gpu, headroom=headroom)


def device_total(model: ModelSpec, train: TrainSpec, gpu: GPUSpec, headroom: float) -> int:
    """What ``nvidia-smi`` would show at the step's peak: the number the verdict compares."""
    return ledger(model, train, gpu, headroom).device_total


def usable_bytes(gpu: GPUSpec, headroom: float) -> int:
    """The GPU's memory less the headroom, exactly as ``ledger.make_verdict`` computes it."""
    return int(gpu.memory_bytes * (1.0 - headroom))


def fits(model: ModelSpec, train: TrainSpec, gpu: GPUSpec, headroom: float) -> bool:
    """The estimate's own verdict: device total ≤ GPU memory × (1 − headroom)."""
    verdict = ledger(model, train, gpu, headroom).verdict
    assert verdict is not None
    return verdict.fits
