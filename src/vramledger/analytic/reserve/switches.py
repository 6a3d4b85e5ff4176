"""Which of the mechanisms that switch off as the shape grows a single shape's reserve counts (``Switching``), and
the step at another shape (``ShapePeaks``), for a run with dynamic padding (runs.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from vramledger.analytic.parts import StepParts
from vramledger.specs import TrainSpec


class Switching(NamedTuple):
    """Which of the mechanisms that switch off as the shape grows are counted."""

    workspace: bool = False
    activations: bool = False
    tied: bool = False
    temporaries: bool = False
    relaid: bool = False
    """The blocks step 2 makes again counted at this shape (``relaid_counted``; a run with dynamic padding);
    False: the bound min(S, 3·4·V·T) (``relaid_bytes``), which never falls as the shape grows."""
    softcap: bool = False
    fused_relaid: bool = False
    """Fused AdamW's fp32 logits block step 2 makes again, where 4·V·T is no larger than the V·H gradient
    (optimizers.py ``fused_relaid_switch``)."""
    state_rests: bool = False
    """What the MLP activation segments cache free at step 2's loss peak where step 1's states sit in every one of
    them (state_rests.py ``state_rests_cached``)."""
    loss_tails: bool = False
    """The trained weights' segment tails free at step 2's loss peak while k and v are small-pool blocks (full
    fine-tuning without checkpointing: load_residue.py ``loss_tails``)."""
    checkpointed_forward: bool = False
    """Under checkpointing, an optimizer without step temporaries: the checkpointed forward's segments free at the end
    of backward where no MLP per-parameter tensor fits their blocks (optimizers.py ``checkpointed_forward_switch``)."""
    tied_sum: bool = False
    """Adafactor with a trained tied embedding, under checkpointing: the segments step 1's optimizer makes for its
    temporaries where the tied gradients' sum and the layers' gradients leave too few rests of one temporary in the
    chain's blocks (optimizers.py ``tied_sum_switch``)."""


NONE = Switching()

ShapePeaks = Callable[[TrainSpec], tuple[StepParts, int, int, int]]
"""The step at another shape: its ``StepParts``, and allocated bytes at the loss's peak, the step's peak and the
optimizer's peak (analytic/step.py)."""
