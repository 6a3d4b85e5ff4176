"""``VramledgerLightningCallback``: the memory callback for Lightning (``lightning`` or ``pytorch_lightning``).

Importable without Lightning; constructing the callback then raises one clear error. The hooks' logic lives in
``LightningWatch`` (no Lightning base class), which the callback inherits, so it is tested with stand-ins.

Lightning hook → phase (lightning/pytorch/callbacks/callback.py): ``on_train_batch_start`` (the batch's shape,
the prediction for the longest batch, forward begins), ``on_before_backward`` (backward begins),
``on_before_optimizer_step`` (optimizer begins), ``on_train_batch_end`` (the step's record; the ``vram/*``
scalars go through ``pl_module.log``, so every Lightning logger gets them). The precision comes from
``trainer.precision`` (Lightning's names are ours: ``bf16-mixed``, ``16-mixed``, ``bf16-true``, ``32-true``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vramledger.errors import VramledgerError
from vramledger.integrations.stats import MemoryStats, default_stats
from vramledger.integrations.watcher import MemoryWatcher
from vramledger.specs import Precision, TrainSpec

try:
    from lightning.pytorch.callbacks import Callback as _Callback
except ImportError:
    try:
        from pytorch_lightning.callbacks import Callback as _Callback
    except ImportError:
        _Callback = None

_PRECISION = {
    "32-true": Precision.FP32,
    "32": Precision.FP32,
    "bf16-mixed": Precision.BF16_MIXED,
    "16-mixed": Precision.FP16_MIXED,
    "bf16-true": Precision.BF16,
    "16-true": Precision.FP16,
}


def _shape(batch: Any) -> tuple[int, ...] | None:
    """(batch, length) of a dict batch (``input_ids``), a tuple batch's first tensor, or a tensor."""
    if isinstance(batch, dict):
        batch = batch.get("input_ids", next(iter(batch.values()), None))
    elif isinstance(batch, (list, tuple)) and batch:
        batch = batch[0]
    shape = getattr(batch, "shape", None)
    return tuple(int(x) for x in shape[:2]) if shape is not None and len(shape) >= 2 else None


class LightningWatch:
    """The Lightning hooks, free of Lightning (duck-typed ``trainer`` and ``pl_module``)."""

    def __init__(
        self,
        out: str | Path | None = "vramledger_memory.jsonl",
        *,
        train: TrainSpec | None = None,
        stats: MemoryStats | None = None,
        **options: Any,
    ) -> None:
        self.out = None if out is None else Path(out)
        self.train, self._stats, self._options = train, stats, options
        self.watcher: MemoryWatcher | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        import dataclasses

        from vramledger.integrations.postmortem import known_tensors
        from vramledger.integrations.predict import setup_from_model

        self.watcher = MemoryWatcher(self._stats or default_stats(), out=self.out, fmt="", **self._options)
        optimizer = (getattr(trainer, "optimizers", None) or [None])[0]
        base = self.train or TrainSpec()
        accum = getattr(trainer, "accumulate_grad_batches", None)
        if isinstance(accum, int) and accum >= 1:
            base = dataclasses.replace(base, grad_accum=accum)
        precision = _PRECISION.get(str(getattr(trainer, "precision", "")))

        def predictor(b: int, length: int) -> Any:
            return setup_from_model(pl_module, optimizer, base, micro_batch=b, seq_len=length, precision=precision)

        self.watcher.begin(
            predictor, context={"framework": "lightning"}, known_tensors=lambda: known_tensors(pl_module, optimizer)
        )

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.watcher is None:
            return
        shape = _shape(batch)
        if shape is not None:
            self.watcher.batch(shape)
        self.watcher.enter("forward")

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if self.watcher is not None:
            self.watcher.enter("backward")

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.watcher is not None:
            self.watcher.enter("optimizer")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.watcher is None:
            return
        for name, value in self.watcher.end_step(int(getattr(trainer, "global_step", batch_idx))).items():
            pl_module.log(name, value)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.watcher is not None:
            self.watcher.close()


if _Callback is not None:

    class VramledgerLightningCallback(LightningWatch, _Callback):
        """The memory callback for a Lightning ``Trainer(callbacks=[...])``."""

else:

    class VramledgerLightningCallback(LightningWatch):  # type: ignore[no-redef]
        """Needs Lightning: constructing it without raises one clear error."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise VramledgerError(
                "VramledgerLightningCallback needs Lightning, which is not installed: pip install lightning "
                "(or use vramledger.integrations.loop.watch_memory in a plain PyTorch loop)"
            )
