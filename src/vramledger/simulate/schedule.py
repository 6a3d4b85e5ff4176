"""What a run does, in order: which batches, at which padded lengths, when it evaluates and empties the cache.

The HF Trainer's loop (transformers 5.23 ``trainer.py`` ``_inner_training_loop``): per optimizer step,
``gradient_accumulation_steps`` micro-batches (forward + backward each), then ``optimizer.step()`` and
``zero_grad``; every ``eval_steps`` optimizer steps ``evaluate`` runs the whole eval set (a
``SequentialSampler``: the same batches, in the same order, every time); with ``torch_empty_cache_steps`` N it
calls ``torch.cuda.empty_cache()`` in ``training_step`` when ``global_step % N == 0`` (modelled before that
step's forward).
"""

from __future__ import annotations

from dataclasses import dataclass

from vramledger.errors import VramledgerError
from vramledger.simulate.batching import Order, greedy_knapsack, pad_to, padded_batches
from vramledger.simulate.engine import Unit

MAX_SHAPES = 32
"""At most this many distinct padded lengths are replayed: beyond it lengths are rounded up to buckets."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSpec:
    """The run around the step: its data, its order and its schedule."""

    cutoff: int
    """Samples are truncated to this many tokens (LLaMA-Factory ``cutoff_len``)."""
    steps: int | None = None
    """Optimizer steps; ``None``: ``epochs`` over the samples."""
    epochs: float = 1.0
    accum: int = 1
    """Micro-batches per optimizer step (``gradient_accumulation_steps``)."""
    order: Order = Order.SHUFFLE
    pad_multiple: int | None = None
    """``pad_to_multiple_of`` of the collator (``None``: pad to the longest sample only)."""
    packing: bool = False
    eval_every: int | None = None
    """``eval_steps``: evaluate after every this many optimizer steps (``None``: never)."""
    eval_batches: int = 0
    """Batches per evaluation (from the eval lengths when given, else drawn from the training lengths)."""
    empty_cache_steps: int | None = None
    """``torch_empty_cache_steps``."""
    empty_cache_after_eval: bool = False
    bucket: int | None = None
    """Round padded lengths up to a multiple of this for the replay (``None``: only when more than
    ``MAX_SHAPES`` distinct lengths; 1: never)."""

    def __post_init__(self) -> None:
        for name in ("cutoff", "accum", "eval_every", "empty_cache_steps", "bucket", "pad_multiple", "steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise VramledgerError(f"simulate: {name.replace('_', '-')} must be at least 1 (got {value})")
        if self.epochs <= 0:
            raise VramledgerError(f"--epochs must be positive (got {self.epochs})")
        if self.eval_batches < 0:
            raise VramledgerError("--eval-batches must be 0 or more")


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """The units of one run and the lengths they replay."""

    units: list[Unit]
    bucket: int
    """Bucket width the padded lengths were rounded up to (1: exact)."""
    train_lengths: list[int]
    """Padded length of every micro-batch, before bucketing."""


def bucket_width(lengths: list[int], spec: RunSpec) -> int:
    """The smallest of pad multiple × 1, 2, 4, … that leaves at most ``MAX_SHAPES`` distinct lengths."""
    if spec.bucket is not None:
        return spec.bucket
    width = spec.pad_multiple or 1
    while len({pad_to(n, width) for n in lengths}) > MAX_SHAPES:
        width *= 2
    return width


def plan_run(
    train: list[int], eval_lengths: list[int], spec: RunSpec, *, batch: int, eval_batch: int | None, seed: int
) -> Plan:
    """The units of a run over samples of ``train`` lengths (``eval_lengths`` for evaluation)."""
    cut = [min(x, spec.cutoff) for x in train]
    rows = len(greedy_knapsack(cut, spec.cutoff)) if spec.packing else len(train)
    per_epoch = -(-rows // batch)
    n_micro = spec.steps * spec.accum if spec.steps is not None else max(spec.accum, round(spec.epochs * per_epoch))
    padded = padded_batches(
        train,
        batch=batch,
        micro_steps=n_micro,
        cutoff=spec.cutoff,
        order=spec.order,
        pad_multiple=spec.pad_multiple,
        packing=spec.packing,
        seed=seed,
    )
    ev_padded: list[int] = []
    if spec.eval_every and spec.eval_batches and eval_batch:
        pool = eval_lengths or train
        ev = [min(x, spec.cutoff) for x in pool[: spec.eval_batches * eval_batch]]
        ev_padded = [pad_to(max(ev[i : i + eval_batch]), spec.pad_multiple) for i in range(0, len(ev), eval_batch)]
    width = bucket_width(padded + ev_padded, spec)
    top = max(padded + ev_padded)  # a bucket never rounds past the longest batch
    padded_b = [min(pad_to(n, width), top) for n in padded]
    ev_b = tuple(min(pad_to(n, width), top) for n in ev_padded)
    units = [Unit(kind="load", step=0)]
    n_steps = len(padded_b) // spec.accum
    for k in range(1, n_steps + 1):
        lens = tuple(padded_b[(k - 1) * spec.accum : k * spec.accum])
        empty = spec.empty_cache_steps is not None and k % spec.empty_cache_steps == 0
        units.append(Unit(kind="train", step=k, lengths=lens, empty_cache_before=empty))
        if ev_b and spec.eval_every and k % spec.eval_every == 0:
            units.append(Unit(kind="eval", step=k, lengths=ev_b, empty_cache_after=spec.empty_cache_after_eval))
    return Plan(units=units, bucket=width, train_lengths=padded)
