"""TrainSpec to and from plain JSON, so a trial's setup can cross the process boundary to the worker."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from vramledger.errors import VramledgerError
from vramledger.specs import (
    LoraSpec,
    QuantSpec,
    TrainSpec,
)
from vramledger.specs.train import ENUM_FIELDS

_ENUMS = ENUM_FIELDS  # one table: specs/train.py


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
            for key_ in ("targets", "modules_to_save", "parameters"):
                if key_ in lora:
                    lora[key_] = tuple(lora[key_])
            kw[key] = LoraSpec(**lora)
        elif key == "quant" and value is not None:
            kw[key] = QuantSpec(**value)
        elif key == "warnings":
            kw[key] = tuple(value)
        else:
            kw[key] = value
    return TrainSpec(**kw)
