"""The caching allocator's reserve for the analytic path, from what the allocator's rules leave cached in a step.

PyTorch's caching allocator never returns a segment to the driver during training (only ``empty_cache`` or an
allocation that fails and retries does), and it serves a request only from a cached block at least as large
(``get_free_block``: best fit by size; blocks of different ``cudaMalloc`` segments never merge). So a step
reserves more than it allocates where blocks freed earlier are too small for a later request. The trace replay
(``trace/oom.py``, bench/reserve/) shows where that happens in a training step:

- the logits chain: forward frees the c·V·T logits block, then backward needs two fp32 4·V·T blocks at once
  (the gradients from ``nll_loss_backward`` and ``_log_softmax_backward_data``) while the log-softmax output is
  still live; the c·V·T hole cannot serve a 4·V·T request, so a new segment is made and the hole stays cached;
- one decoder layer's working set (its backward's gradients and, under checkpointing, its recomputed
  activations) is cached in segments the much larger logits requests cannot use;
- in the first step the optimizer states are created into whatever the cache holds: into the activation blocks
  where they fit, else into the logits chain's blocks, which step 2 then has to make again;
- per-parameter tensors (gradients, states, foreach temporaries) and activations reuse each other's blocks only
  where they fit;
- under checkpointing with autocast, step 1's forward keeps every layer's cached weight casts until the loss is
  computed, in segments the loss's requests cannot use (``ckpt_forward``).

The estimate uses a closed form of these mechanisms (``stranded_bytes``, ``peak_reserved``): it stays instant.
The replay shows more places (the backward thread's cuBLAS workspace in a logits block, activation blocks too
small for the optimizer, a tied embedding's gradient, the blocks step 2 makes again, ...) that switch off as the
shape grows: a packed run's estimate counts those on at its one shape, and falls where one switches off, as the
replay does; a run with dynamic padding, which keeps the segments of every shorter shape it meets, is estimated at
the largest single-shape reserve over those shapes, these included, and never falls as batch or length grow
(``held_reserved``; docs/reserve.md "Runs", "Packed runs: one shape").
``step_sequence`` spells the same step out as an allocation sequence built from the analytic
quantities (``parts.StepParts``) and ``replay_excess`` replays it through ``allocator/model.py`` (a port of
``CUDACachingAllocator.cpp``); tests and bench/reserve/ check the closed form against both that replay and the
replay of real traces (bench/reserve/replay_grid.jsonl). The cache left by step 1 persists, so from step 2 on
the reserved memory at every training phase is the step's peak reserved: each phase's reserve line is that
figure less the phase's allocated bytes. None of this is a GPU measurement: the allocator model itself awaits
validation on a GPU (allocator/gpucheck.py).

Legend: V vocabulary, H hidden, I intermediate, T tokens per micro-batch, c compute-dtype bytes, s residual-stream
bytes, b trainable-parameter bytes.

Modules: ``events`` (allocation sequences and their replay), ``replay`` (the step as a sequence; the small pool),
``trl`` (TRL's chunked loss), ``workspace`` (the backward thread's cuBLAS workspace), ``full`` (full fine-tuning's
logits blocks and optimizer states), ``spill`` (the blocks step 2 makes again where the states reach every fp32
logits block), ``freeze`` (the same blocks with the head and the embedding frozen),
``optimizers`` (SGD, fused AdamW, Adafactor), ``forward_cache``, ``load_residue`` and ``softcap`` (LoRA's forward
cache, the base's segment tails, Gemma 2's softcapped logits), ``eager_ckpt`` (LoRA with eager attention under
checkpointing: the length² and logits blocks replayed), ``ckpt_forward`` (step 1's checkpointed forward),
``shape`` (one shape's closed form), ``switches`` and ``runs`` (runs with dynamic padding); this module: the ledger's
reserve lines per phase.
"""

from __future__ import annotations

from vramledger.analytic.overhead import RESERVE_SOURCE as ASSUMED_SOURCE
from vramledger.analytic.overhead import allocator_reserve_bytes
from vramledger.analytic.parts import StepParts
from vramledger.analytic.reserve.events import Seq, replay_excess
from vramledger.analytic.reserve.full import logits_blocks
from vramledger.analytic.reserve.replay import reserve_excess, small_pool_excess, step_sequence
from vramledger.analytic.reserve.runs import held_reserved, peak_reserved
from vramledger.analytic.reserve.shape import stranded_bytes
from vramledger.analytic.reserve.switches import ShapePeaks, Switching
from vramledger.analytic.reserve.trl import trl_stranded_bytes
from vramledger.analytic.reserve.workspace import cublas_workspace_block
from vramledger.ledger import Basis, Phase
from vramledger.specs import ModelSpec, TrainSpec

__all__ = [
    "RESERVE_SOURCE",
    "Seq",
    "ShapePeaks",
    "Switching",
    "cublas_workspace_block",
    "held_reserved",
    "logits_blocks",
    "peak_reserved",
    "phase_reserves",
    "replay_excess",
    "reserve_excess",
    "small_pool_excess",
    "step_sequence",
    "stranded_bytes",
    "training_peaks",
    "trl_stranded_bytes",
]


RESERVE_SOURCE = (
    "caching-allocator rules (CUDACachingAllocator.cpp best fit, no merging across segments) applied to the step: "
    "blocks cached and unusable at the loss's peak (forward's c·V·T logits block; one layer's transients under "
    "checkpointing); full fine-tuning: states created in step 1 into the logits blocks, which step 2 makes again "
    "whole, and foreach temporaries' blocks too small for the activations; SGD and fused AdamW: the end of "
    "backward; Adafactor: its temporaries' own segments; LoRA: the small pool, the cache its layers' forward "
    "leaves (under checkpointing, in place of one layer's transients; with eager attention, the length² and logits "
    "blocks replayed through the allocator model) and the weights' segment tails; reserved "
    "stays at the step's peak from step 2 on; dynamic padding: the most any shape ≤ (B, L) reserves, the segments "
    "of shorter batches kept; packed: the one shape B × L (analytic/reserve/); not yet measured on a GPU"
)


_TRAIN_PHASES = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)


def training_peaks(allocated: dict[Phase, int]) -> tuple[int, int, int]:
    """Allocated bytes at the loss's peak (forward or backward), the step's peak and the optimizer's peak."""
    peak = max((allocated[ph] for ph in _TRAIN_PHASES if ph in allocated), default=0)
    loss_peak = max(allocated.get(Phase.FORWARD, 0), allocated.get(Phase.BACKWARD, 0))
    return loss_peak, peak, allocated.get(Phase.OPTIMIZER, peak)


def phase_reserves(
    m: ModelSpec,
    train: TrainSpec,
    p: StepParts,
    allocated: dict[Phase, int],
    at: ShapePeaks | None = None,
    engine: tuple[int, str] | None = None,
) -> dict[Phase, tuple[int, str, Basis]]:
    """The ALLOCATOR_RESERVE line of each phase in ``allocated`` (LOAD excluded): (bytes, source, basis).

    The step's peak reserved is the largest training phase's allocated bytes plus the modelled excess
    (``reserve_excess``). Every training phase reports that same reserved figure: the cache built by step 1 is
    still held in every later step (the trace replay shows reserved flat across phases in step 2). Evaluation
    and generation run after training steps, so they hold at least that cache; where they allocate more, the
    stated assumption of ``overhead.allocator_reserve_bytes`` covers their own fragmentation. ``engine``: the step's
    peak reserved and its source where a data-parallel engine's model gives it (analytic/distributed/ddp_reserve.py).
    """
    loss_peak, peak, opt_peak = training_peaks(allocated)
    if engine is not None:
        reserved, source = engine
    else:
        reserved, source = (peak_reserved(m, train, p, loss_peak, peak, opt_peak, at) if peak else 0), RESERVE_SOURCE
    out: dict[Phase, tuple[int, str, Basis]] = {}
    for ph, total in allocated.items():
        if ph is Phase.LOAD:
            continue
        if ph in _TRAIN_PHASES or reserved - total >= allocator_reserve_bytes(total):
            out[ph] = (max(reserved - total, 0), source, Basis.FORMULA)
        else:
            out[ph] = (allocator_reserve_bytes(total), ASSUMED_SOURCE, Basis.ASSUMPTION)
    return out
