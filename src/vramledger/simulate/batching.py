"""From sample lengths to the padded length of every batch, as the HF Trainer and LLaMA-Factory build them.

- Truncation: every sample is cut to the cutoff (LLaMA-Factory ``cutoff_len``; TRL ``max_length``).
- Order (``Order``): ``shuffle`` is the Trainer's default ``RandomSampler`` (a new permutation every epoch);
  ``group_by_length`` is transformers ``trainer_pt_utils.get_length_grouped_indices`` (used by
  ``LengthGroupedSampler``): a random permutation cut into mega-batches of ``mega_batch_mult × batch`` samples
  (``mega_batch_mult = min(n // (4·batch), 50)``, at least 1), each sorted by length descending, and the
  mega-batch holding the longest sample swapped to the front so that an OOM shows at once; ``sorted`` is every
  sample by length descending; ``given`` keeps the source's order (the ground-truth ``lengths.json``).
  Permutations come from ``random.Random(seed)``, not torch's generator: the same distribution of orders,
  not the same order as a given Trainer seed.
- Packing (``pack``): LLaMA-Factory's ``greedy_knapsack`` (``data/processor/processor_utils.py``): lengths
  sorted ascending, each knapsack filled with the largest remaining sample that still fits the cutoff; every
  packed row is then one sequence of the cutoff length (the collator pads it there).
- Padding: ``DataCollatorWithPadding`` / ``DataCollatorForSeq2Seq`` pad a batch to its longest sample, rounded
  up to ``pad_to_multiple_of`` (LLaMA-Factory's SFT workflow passes 8 when training).
- A last, partial batch of an epoch (``dataloader_drop_last=False``) is simulated as a full batch of its
  padded length: an upper bound, a little above the real step.
"""

from __future__ import annotations

import bisect
import enum
import random
from collections.abc import Sequence

from vramledger.errors import VramledgerError


class Order(str, enum.Enum):
    SHUFFLE = "shuffle"
    GROUP_BY_LENGTH = "group_by_length"
    SORTED = "sorted"
    GIVEN = "given"


def pad_to(length: int, multiple: int | None) -> int:
    """The collator's padded length: rounded up to ``pad_to_multiple_of``."""
    if not multiple or multiple <= 1:
        return length
    return -(-length // multiple) * multiple


def length_grouped_indices(lengths: Sequence[int], batch: int, rng: random.Random) -> list[int]:
    """transformers ``trainer_pt_utils.get_length_grouped_indices`` with ``random.Random`` for torch's
    ``randperm``."""
    mult = min(len(lengths) // (batch * 4), 50) or 1
    indices = list(range(len(lengths)))
    rng.shuffle(indices)
    size = mult * batch
    megabatches = [
        sorted(indices[i : i + size], key=lambda k: lengths[k], reverse=True) for i in range(0, len(indices), size)
    ]
    maxima = [lengths[m[0]] for m in megabatches]
    top = maxima.index(max(maxima))
    megabatches[0][0], megabatches[top][0] = megabatches[top][0], megabatches[0][0]
    return [i for m in megabatches for i in m]


def greedy_knapsack(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """LLaMA-Factory ``greedy_knapsack``: pack lengths (each ≤ capacity) into rows of at most ``capacity``."""
    remaining = sorted(lengths)
    rows: list[list[int]] = []
    while remaining:
        row: list[int] = []
        left = capacity
        while True:
            i = bisect.bisect_right(remaining, left) - 1  # search_for_fit: the largest that fits
            if i < 0:
                break
            left -= remaining[i]
            row.append(remaining.pop(i))
        rows.append(row)
    return rows


def epoch_order(lengths: Sequence[int], order: Order, batch: int, rng: random.Random) -> list[int]:
    """Sample indices in the order one epoch visits them."""
    n = len(lengths)
    if order is Order.GIVEN:
        return list(range(n))
    if order is Order.SORTED:
        return sorted(range(n), key=lambda k: -lengths[k])
    if order is Order.GROUP_BY_LENGTH:
        return length_grouped_indices(lengths, batch, rng)
    idx = list(range(n))
    rng.shuffle(idx)
    return idx


def padded_batches(
    lengths: Sequence[int],
    *,
    batch: int,
    micro_steps: int,
    cutoff: int,
    order: Order = Order.SHUFFLE,
    pad_multiple: int | None = None,
    packing: bool = False,
    seed: int = 0,
) -> list[int]:
    """The padded length of each of ``micro_steps`` batches, epoch after epoch as needed.

    >>> padded_batches([5, 9, 3, 7], batch=2, micro_steps=3, cutoff=8, order=Order.GIVEN, pad_multiple=4)
    [8, 8, 8]
    """
    if batch < 1 or micro_steps < 0 or cutoff < 1:
        raise VramledgerError("simulate: batch and cutoff must be positive")
    if not lengths:
        raise VramledgerError("--lengths: no samples")
    cut = [min(max(int(x), 1), cutoff) for x in lengths]
    if packing:
        cut = [cutoff] * len(greedy_knapsack(cut, cutoff))
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < micro_steps:
        idx = epoch_order(cut, order, batch, rng)
        for i in range(0, len(idx), batch):
            out.append(pad_to(max(cut[k] for k in idx[i : i + batch]), pad_multiple))
            if len(out) == micro_steps:
                break
    return out


def micro_steps_per_epoch(n_samples: int, batch: int, *, packing_rows: int | None = None) -> int:
    """Batches in one epoch (``dataloader_drop_last=False``: the last partial batch counts)."""
    rows = packing_rows if packing_rows is not None else n_samples
    return -(-rows // batch)
