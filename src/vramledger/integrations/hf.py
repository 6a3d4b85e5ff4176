"""``VramledgerCallback``: memory of an HF ``Trainer`` run (and of TRL's trainers, which are Trainers) as it runs.

    trainer = Trainer(model=model, args=args, train_dataset=ds)
    VramledgerCallback.attach(trainer, out="memory.jsonl")   # first in line, so its scalars reach W&B & co
    trainer.train()

What it does, by Trainer event (trainer.py ``_inner_training_loop``, transformers 5.23):
- ``on_train_begin``: opens the JSONL, hooks the model's ``forward`` (a pre-hook sees each micro-batch before it
  runs; a hook marks the end of the forward), starts the bounded history recording when ``record_history``;
- the forward pre-hook: the batch's shape; when it is the longest so far, the prediction for it, from
  ``TrainingArguments`` and the live model (``integrations.predict``) — a warning before that batch runs when it
  will not fit; then the forward phase begins;
- the forward hook: the backward phase begins (gradient clipping runs in it: ``_clip_grad_norm`` comes before
  ``on_pre_optimizer_step``);
- ``on_pre_optimizer_step`` / ``on_optimizer_step``: the optimizer phase;
- ``on_step_end``: the step's record and its checks; ``on_log`` adds ``vram/*`` scalars to the Trainer's logs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vramledger.errors import MissingDependencyError
from vramledger.integrations.stats import MemoryStats, default_stats
from vramledger.integrations.watcher import MemoryWatcher

try:
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover - transformers is what this module is for
    raise MissingDependencyError("transformers", "trace") from None


def batch_shape(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...] | None:
    """The (batch, length) of a causal-LM forward: ``input_ids``, else ``inputs_embeds``, else the first tensor."""
    for key in ("input_ids", "inputs_embeds"):
        t = kwargs.get(key)
        if t is not None and hasattr(t, "shape"):
            return tuple(t.shape[:2])
    for t in args:
        if hasattr(t, "shape") and len(t.shape) >= 2:
            return tuple(t.shape[:2])
    return None


class VramledgerCallback(TrainerCallback):
    """Measure, predict and explain GPU memory in a Trainer run (see the module docstring).

    ``out``: the JSONL file (a new name is picked if it exists). ``seq_len``: predict at train begin for this
    length (else at the first batch). ``tolerance``: measured over predicted by more than this warns.
    ``reserved_fraction``: reserved above this fraction of the GPU warns. ``record_history``: record allocation
    stacks (``max_entries`` bounded) and, on OOM, write a snapshot and a post-mortem beside the JSONL.
    ``stats``: the CUDA statistics (a stand-in in tests; CUDA's when a GPU is there, else nothing measured).
    """

    def __init__(
        self,
        out: str | Path | None = "vramledger_memory.jsonl",
        *,
        seq_len: int | None = None,
        tolerance: float = 0.10,
        reserved_fraction: float = 0.92,
        headroom: float = 0.08,
        record_history: bool = False,
        history_max_entries: int = 100_000,
        stats: MemoryStats | None = None,
    ) -> None:
        self._options: dict[str, Any] = {
            "tolerance": tolerance,
            "reserved_fraction": reserved_fraction,
            "headroom": headroom,
            "record_history": record_history,
            "history_max_entries": history_max_entries,
        }
        self.out = None if out is None else Path(out)
        self.seq_len = seq_len
        self._stats = stats
        self.watcher: MemoryWatcher | None = None
        self._hooks: list[Any] = []
        self._model: Any = None

    @classmethod
    def attach(cls, trainer: Any, **kwargs: Any) -> VramledgerCallback:
        """Add a callback first in ``trainer``'s list, so that the scalars it adds in ``on_log`` reach the
        reporting callbacks (W&B, TensorBoard, MLflow), which the Trainer puts before user callbacks."""
        cb = cls(**kwargs)
        trainer.callback_handler.callbacks.insert(0, cb)
        return cb

    # -- Trainer events --------------------------------------------------------------------------------------
    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs: Any
    ) -> None:
        from vramledger.integrations.postmortem import known_tensors
        from vramledger.integrations.predict import setup_from_trainer

        self.watcher = MemoryWatcher(self._stats or default_stats(), out=self.out, fmt="hf", **self._options)
        self._model = model

        def predictor(b: int, length: int) -> Any:
            return setup_from_trainer(model, args, micro_batch=b, seq_len=length)

        self.watcher.begin(
            predictor,
            context={"framework": "transformers", "max_steps": state.max_steps},
            known_tensors=lambda: known_tensors(model, optimizer),
        )
        if self.seq_len is not None:
            self.watcher.batch((args.per_device_train_batch_size, self.seq_len))
            self.watcher.step.batches.clear()
        if model is not None:
            self._hooks = [
                model.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
                model.register_forward_hook(self._post_forward),
            ]

    def _pre_forward(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.watcher is None or not module.training:
            return
        shape = batch_shape(args, kwargs)
        if shape is not None:
            self.watcher.batch(shape)
        self.watcher.enter("forward")

    def _post_forward(self, module: Any, args: tuple[Any, ...], output: Any) -> None:
        if self.watcher is not None and module.training and self.watcher.phase == "forward":
            self.watcher.enter("backward")

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.watcher is not None:
            self.watcher.enter("optimizer")

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.watcher is not None:
            self.watcher.enter(None)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.watcher is not None:
            self.watcher.end_step(int(state.global_step))

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if self.watcher is None or logs is None or "loss" not in logs and "train_loss" not in logs:
            return
        scalars = self.watcher.scalars()
        logs.update(scalars)
        if state.log_history:
            state.log_history[-1].update(scalars)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.watcher is not None:
            self.watcher.close()
