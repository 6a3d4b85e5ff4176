"""Gemma 2's final-logit softcapping: an fp32 logits block step 2 makes again, at the shapes where the 2 MiB rounding
puts tanh's output into a freed fp32 block (analytic/reserve/, a mechanism that switches on and off with the shape).

transformers ``Gemma2ForCausalLM.forward``: ``logits = logits / cap; logits = torch.tanh(logits); logits = logits *
cap`` on the c·V·T logits before ``ForCausalLMLoss`` casts them to fp32 (4·V·T = 2X with c = 2 bytes, X = c·V·T);
tanh's output (X) is saved for its backward. Step 1 makes the chain's segments: the logits' and the division's (X
each, rounded up to 2 MiB by ``get_allocation_size``) and the fp32 ones (the copy, the log-softmax and the
backward's second gradient, 2X rounded). In step 2 (whose forward has cut an activation from the logits' old
segment, the smallest free block that size: 35 MiB in the trace) the logits take the division's and the division the
first fp32 segment (best fit: the smallest cached block at least as large, ``get_free_block``), which is split
(``should_split``); when the logits are freed, tanh's request finds two blocks: the division's old segment (X
rounded up, where the logits were) and the fp32 segment's rest (2X rounded up, less X). Where X is not a multiple of
2 MiB and its remainder is at most 1 MiB, the rest is the smaller and best fit takes it (an equal size goes to the
older segment): tanh's output, saved until backward, then sits in an fp32 segment, and backward's second fp32
gradient (``_log_softmax_backward_data``) finds every fp32 block taken and makes one more. The trace replay shows
it: Gemma-2-2B LoRA 2 × 992 reserves 26.0 GiB (the new segment made in step 2's backward), 2 × 1024 only 24.5 GiB (X
= 1000 MiB, a tie). Half the lengths or so are such shapes, so a run with dynamic padding meets one within a few
tokens of its longest batch (bench/reserve/runs.jsonl: the run's envelope, 2 × 992).
"""

from __future__ import annotations

from collections.abc import Callable

from vramledger.allocator.conf import K_SMALL_SIZE, allocation_size, round_size
from vramledger.specs import Loss, ModelSpec, TrainSpec

# How far below L to look for a shape where the mechanism is on, per micro-batch: X moves by c·V·b bytes per token,
# so one is found within a few tokens unless c·V·b is a multiple of 2 MiB (then never).
_SCAN = 4096


def softcap_remade(m: ModelSpec, train: TrainSpec) -> Callable[[int, int], bool] | None:
    """Whether at (b, ℓ) step 2 makes an fp32 logits block again because tanh's output took a freed fp32 block's
    rest; None where the setup has no such chain (no softcapping, a fused or chunked loss, fp32 compute)."""
    c, V = train.precision.compute.bytes, m.vocab_size
    if not m.final_logit_softcapping or train.loss is not Loss.STANDARD or c != 2:
        return None

    def on(b: int, ell: int) -> bool:
        x = round_size(c * V * b * ell)
        rest = allocation_size(round_size(4 * V * b * ell)) - x
        return x <= rest < allocation_size(x) and rest > K_SMALL_SIZE

    return on


def softcap_block(m: ModelSpec, train: TrainSpec) -> int:
    """The fp32 segment step 2 makes again (4·V·T rounded as ``get_allocation_size`` does)."""
    return allocation_size(round_size(4 * m.vocab_size * train.tokens))


def latest_on(B: int, L: int, on: Callable[[int, int], bool]) -> list[tuple[int, int]]:
    """For each micro-batch b ≤ B, the longest length ℓ ≤ L with ``on(b, ℓ)``, for a set of shapes that is not
    closed downwards (micro-batches where none is found within ``_SCAN`` tokens of L are left out)."""
    out = []
    for b in range(1, B + 1):
        ell = next((ell for ell in range(L, max(L - _SCAN, 0), -1) if on(b, ell)), 0)
        if ell:
            out.append((b, ell))
    return out
