"""ModelSpec and TrainSpec as plain JSON data and back: the callbacks record the setup they predicted for, so that
``explain`` can rebuild the prediction and price the fixes from the JSONL alone."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from vramledger.errors import VramledgerError
from vramledger.specs import (
    Attention,
    DType,
    EvalLogits,
    LoraSpec,
    Loss,
    Method,
    ModelSpec,
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
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def specs_to_dict(model: ModelSpec, train: TrainSpec) -> dict[str, Any]:
    return {"model": _plain(model), "train": _plain(train)}


def specs_from_dict(data: Mapping[str, Any], source: str) -> tuple[ModelSpec, TrainSpec]:
    """The specs ``specs_to_dict`` wrote; a record from another version that does not fit raises one clear line."""
    try:
        model = ModelSpec(**data["model"])
        raw = dict(data["train"])
        for key, cls in _ENUMS.items():
            if raw.get(key) is not None:
                raw[key] = cls(raw[key])
        if raw.get("lora") is not None:
            raw["lora"] = LoraSpec(**{**raw["lora"], "targets": tuple(raw["lora"]["targets"])})
        if raw.get("quant") is not None:
            raw["quant"] = QuantSpec(**raw["quant"])
        raw["warnings"] = tuple(raw.get("warnings", ()))
        return model, TrainSpec(**raw)
    except (KeyError, TypeError, ValueError) as exc:
        raise VramledgerError(f"{source}: the recorded setup cannot be read ({exc}); pass --config instead") from None
