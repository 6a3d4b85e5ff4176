"""Hand a plan back as a ready-to-run training config, through the config writers of ``vramledger.adapters``."""

from __future__ import annotations

from pathlib import Path

from vramledger.adapters import writers
from vramledger.errors import VramledgerError
from vramledger.specs import TrainSpec

HEADER = [
    "written by `vramledger plan --write-config`: the fastest plan that fits, keys that decide memory only;",
    "add your dataset, template, learning rate and output_dir. With gradient_accumulation_steps > 1, step the",
    "LR schedule per optimizer step (the HF Trainer does).",
]


def plan_config_text(model: str, train: TrainSpec, *, fmt: str = "llamafactory") -> str:
    """The config text ``write_plan_config`` writes (the CLI writes it through ``userfiles.write_atomic``)."""
    mapping, notes = writers.write_config(model, train, fmt)
    return writers.dump(mapping, HEADER + [f"note: {n}" for n in notes])


def write_plan_config(model: str, train: TrainSpec, path: Path, *, fmt: str = "llamafactory") -> str:
    """Write ``train`` for ``model`` to ``path`` in ``fmt`` (the user's format when it has a writer, else
    LLaMA-Factory); returns which format was written."""
    fmt = fmt if fmt in writers.TARGETS else "llamafactory"
    mapping, notes = writers.write_config(model, train, fmt)
    text = writers.dump(mapping, HEADER + [f"note: {n}" for n in notes])
    try:
        path.write_text(text)
    except OSError as exc:
        raise VramledgerError(f"--write-config: cannot write {path} ({exc.strerror}); pick another path") from exc
    return fmt
