"""The Python entry point: ``vramledger.estimate(...)``, friendly to notebooks.

>>> import vramledger
>>> r = vramledger.estimate("qwen2.5-0.5b", method="lora", batch=2, seq=1024, gpu="rtx-4090")
>>> r.fits, r.ledger.peak_phase.value
(True, 'backward')

In Jupyter the result displays as the HTML bill (``_repr_html_``: the table and the verdict, no figures, no
matplotlib); ``print(r)`` gives the terminal table. Strings are accepted wherever the specs take an Enum
(``method="qlora"``, ``precision="bf16-true"``) and validated with the same one-line errors as the command line.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from vramledger.ledger import Ledger
from vramledger.specs import DEFAULT_HEADROOM, GPUSpec, LoraSpec, ModelSpec, TrainSpec, check_headroom

_ALIASES = {"batch": "micro_batch", "seq": "seq_len", "accum": "grad_accum"}
"""The command line's names for TrainSpec fields."""


@dataclass(frozen=True, slots=True)
class Estimate:
    """What ``vramledger.estimate`` returns: the ledger and the specs it was computed for."""

    ledger: Ledger
    model: ModelSpec
    train: TrainSpec
    gpu: GPUSpec | None
    headroom: float
    preset: str
    """The framework whose defaults filled what was not given (``none``: vramledger's bare defaults)."""

    @property
    def fits(self) -> bool | None:
        """Whether the step fits ``gpu`` with ``headroom`` kept free; None without a GPU."""
        return None if self.ledger.verdict is None else self.ledger.verdict.fits

    @property
    def device_total(self) -> int:
        """Bytes the process holds at the peak (what nvidia-smi shows)."""
        return self.ledger.device_total

    def to_dict(self) -> dict[str, Any]:
        """The ledger as ``vramledger estimate --json`` prints it."""
        from vramledger.report.json_out import ledger_to_dict

        return ledger_to_dict(self.ledger)

    def __str__(self) -> str:
        from vramledger.report.terminal import render_ledger

        return render_ledger(self.ledger)

    def _repr_html_(self) -> str:
        """Jupyter's rich display: the bill as an HTML table with the verdict and the advice."""
        from vramledger.report.html import notebook_html

        return notebook_html(self.ledger)


def estimate(
    model: str | ModelSpec,
    train: TrainSpec | None = None,
    *,
    gpu: str | GPUSpec | None = None,
    headroom: float = DEFAULT_HEADROOM,
    preset: str = "llamafactory",
    **setup: Any,
) -> Estimate:
    """Estimate the GPU memory of one training step, as ``vramledger estimate`` does.

    ``model``: a catalog name, hub id or ``config.json`` path, or a ModelSpec. ``train``: a TrainSpec, or none to
    build one from ``setup`` (TrainSpec's fields, or the command line's ``batch``, ``seq``, ``accum``,
    ``lora_rank``) over ``preset``'s defaults (``hf``, ``llamafactory``, ``trl``, ``axolotl``, or ``none``).
    ``gpu``: a catalog name, a size such as ``"24GiB"``, or a GPUSpec.
    """
    from vramledger.analytic import estimate as analytic_estimate
    from vramledger.catalog import resolve_gpu, resolve_model
    from vramledger.errors import VramledgerError

    spec = model if isinstance(model, ModelSpec) else resolve_model(model)
    if train is not None and setup:
        raise VramledgerError(f"estimate: pass either train= or setup keywords ({', '.join(setup)}), not both")
    if train is None:
        base = TrainSpec()
        if preset.strip().lower() != "none":
            from vramledger.adapters import preset_config

            base = preset_config(preset.strip().lower(), spec.name).train
        changes = {_ALIASES.get(k, k): v for k, v in setup.items()}
        rank = changes.pop("lora_rank", None)
        if rank is not None:
            changes["lora"] = dataclasses.replace(base.lora or LoraSpec(), rank=rank, alpha=2.0 * rank)
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(TrainSpec)})
        if unknown:
            raise VramledgerError(
                f"estimate: unknown setting {unknown[0]!r}; use TrainSpec's fields or batch, seq, accum, lora_rank"
            )
        if changes.get("method") not in (None, "qlora") and "quant" not in changes:
            changes["quant"] = None
        train = dataclasses.replace(base, **changes)
    gpu_spec = resolve_gpu(gpu) if isinstance(gpu, str) else gpu
    headroom = check_headroom(headroom)
    ledger = analytic_estimate(spec, train, gpu=gpu_spec, headroom=headroom)
    return Estimate(ledger=ledger, model=spec, train=train, gpu=gpu_spec, headroom=headroom, preset=preset)
