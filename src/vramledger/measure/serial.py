"""TrainSpec to and from plain JSON, so a trial's setup can cross the process boundary to the worker."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from vramledger.errors import VramledgerError
from vramledger.specs import (
    Attention,
    DType,
    EvalLogits,
    LoraSpec,
    Loss,
    Method,
    Optimizer,
    Precision,
    QuantSpec,
    TrainSpec,
)

_ENUMS: dict[str, type[enum.Enum]] = {
    "method": Method,
    "precision": Precision,
    "optimizer": Optimizer,
    "attn": Attention,
    "loss": Loss,
    "eval_logits": EvalLogits,
    "base_dtype": DType,
}


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def train_to_dict(train: TrainSpec) -> dict[str, Any]:
    """A JSON-ready mapping of every TrainSpec field (enums as their values, nested specs as mappings)."""
    out = _plain(train)
    out.pop("warnings", None)
    return out


def train_from_dict(raw: dict[str, Any]) -> TrainSpec:
    """The inverse of :func:`train_to_dict`; unknown keys are an error (they would be silently ignored)."""
    known = {f.name for f in dataclasses.fields(TrainSpec)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise VramledgerError(f"train spec: unknown field(s) {', '.join(unknown)}; check the spelling")
    kw: dict[str, Any] = {}
    for key, value in raw.items():
        if key in _ENUMS and value is not None:
            kw[key] = _ENUMS[key](value)
        elif key == "lora" and value is not None:
            lora = dict(value)
            if "targets" in lora:
                lora["targets"] = tuple(lora["targets"])
            kw[key] = LoraSpec(**lora)
        elif key == "quant" and value is not None:
            kw[key] = QuantSpec(**value)
        elif key == "warnings":
            kw[key] = tuple(value)
        else:
            kw[key] = value
    return TrainSpec(**kw)
