"""Turn the configs people already have (LLaMA-Factory, HF, TRL, axolotl, DeepSpeed, FSDP) into specs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vramledger.errors import VramledgerError
from vramledger.specs import TrainSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class ResolvedConfig:
    """A config file read into specs, with where each value came from."""

    model: str
    """The model name or path the config points to."""
    train: TrainSpec
    provenance: dict[str, str] = field(default_factory=dict)
    """TrainSpec field → ``file: key`` | ``default: framework (cite)`` ."""
    warnings: tuple[str, ...] = ()
    """Keys ignored or not modelled, each with the reason."""


def load_config(
    path: Path | None,
    *,
    fmt: str | None = None,
    overrides: Sequence[str] = (),
    deepspeed: Path | None = None,
    accelerate_config: Path | None = None,
) -> ResolvedConfig:
    raise VramledgerError("--config: reading config files is not implemented yet; pass the settings as flags")
