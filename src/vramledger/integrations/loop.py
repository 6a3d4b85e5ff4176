"""``watch_memory``: the callbacks' measurements for a hand-written PyTorch loop.

    with watch_memory(model, optimizer, out="memory.jsonl") as w:
        for step, batch in enumerate(loader):
            w.batch(batch["input_ids"].shape)           # before the forward: predicts for the longest batch
            with w.phase("forward"):
                loss = model(**batch).loss
            with w.phase("backward"):
                loss.backward()
            with w.phase("optimizer"):
                optimizer.step(); optimizer.zero_grad()
            w.end_step(step)

The setup comes from the live model (PEFT adapters, quantised base, dtypes, attention, checkpointing) and the
optimizer's class; ``train`` gives what neither says (precision, accumulation), as a TrainSpec.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vramledger.integrations.stats import MemoryStats, default_stats
from vramledger.integrations.watcher import MemoryWatcher
from vramledger.specs import TrainSpec


class LoopWatch:
    """The handle ``watch_memory`` yields."""

    def __init__(self, watcher: MemoryWatcher) -> None:
        self.watcher = watcher

    def batch(self, shape: Any) -> None:
        self.watcher.batch(tuple(shape))

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure one phase (forward, backward, optimizer) of the current step."""
        self.watcher.enter(name)
        try:
            yield
        finally:
            self.watcher.enter(None)

    def end_step(self, step: int) -> dict[str, float]:
        """Write the step's record; returns the ``vram/*`` scalars for your logger."""
        return self.watcher.end_step(step)


@contextmanager
def watch_memory(
    model: Any,
    optimizer: Any = None,
    *,
    out: str | Path | None = "vramledger_memory.jsonl",
    train: TrainSpec | None = None,
    stats: MemoryStats | None = None,
    **options: Any,
) -> Iterator[LoopWatch]:
    """Watch a plain loop's memory (see the module docstring); ``options`` as for ``MemoryWatcher``."""
    from vramledger.integrations.postmortem import known_tensors
    from vramledger.integrations.predict import setup_from_model

    watcher = MemoryWatcher(stats or default_stats(), out=None if out is None else Path(out), fmt="", **options)
    base = train or TrainSpec()

    def predictor(b: int, length: int) -> Any:
        return setup_from_model(model, optimizer, base, micro_batch=b, seq_len=length)

    watcher.begin(predictor, context={"framework": "torch"}, known_tensors=lambda: known_tensors(model, optimizer))
    try:
        yield LoopWatch(watcher)
    finally:
        watcher.close()
