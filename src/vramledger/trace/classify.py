"""Give every traced storage one memory category, from what it is and how long it lives.

Rules, in order (the category of a storage is decided once, after the step, so that a tensor counts the same at
every moment):
1. set while tracing: gradients (``p.grad`` after accumulation), optimizer state (``optimizer.state``), ``host``
   (AdamW's non-fused ``step`` counters, which a CUDA run keeps on the CPU);
2. allocated while loading: weights (parameters and buffers);
3. a dtype cast of a parameter (autocast's weight cast cache): weights (shown on their own line);
4. a 4-D (batch, heads, length, length) tensor: attention scores (eager softmax, masks, math SDPA);
5. in the output layer or the loss (module ``lm_head``, or the causal-LM module itself after its decoder,
   outside any submodule), or with the vocabulary as last dimension: logits and loss;
6. allocated in forward (or in a checkpoint recompute) and still alive when forward ends: activations;
7. everything else: temporaries.
"""

from __future__ import annotations

from vramledger.analytic.sdpa_mask import mask_columns
from vramledger.ledger import Category, Phase
from vramledger.trace.recorder import StorageInfo

INPUTS = "<inputs>"
"""Module path given to the batch (input_ids, labels) the loop creates: temporaries."""


def _loss_region(module: str) -> bool:
    # ``LlamaForCausalLM.forward`` calls ``self.model`` then ``self.lm_head`` then ``self.loss_function``: ops in
    # the causal-LM module itself (path "" or "base_model.model" under PEFT) are the logits slice and the
    # loss.
    last = module.rsplit(".", 1)[-1]
    return module in ("", "base_model.model", "base_model") or last == "lm_head" or ".lm_head." in module


def classify(storages: dict[int, StorageInfo], *, vocab: int, seq_len: int, backward_start: dict[int, int]) -> None:
    """Fill ``category`` of every storage in place. ``backward_start``: event index where each step's backward
    begins."""
    for info in storages.values():
        if info.category:
            continue
        if info.module == INPUTS:
            info.category = Category.TEMPORARIES.value
            continue
        if info.phase is Phase.LOAD:
            info.category = Category.WEIGHTS.value
            continue
        if info.param_cast and info.phase in (Phase.FORWARD, Phase.BACKWARD):
            info.category = Category.WEIGHTS.value
            continue
        shape = info.shape
        # L × L, or L × ⌈L⌉₁₆: a padded batch's additive mask as SDPA pads it for the efficient kernel (shims.py).
        square = shape[-2:] in ((seq_len, seq_len), (seq_len, mask_columns(seq_len))) if len(shape) == 4 else False
        if square and info.phase is not Phase.OPTIMIZER:
            info.category = Category.ATTENTION_SCORES.value
            continue
        if info.phase in (Phase.FORWARD, Phase.BACKWARD) and (
            _loss_region(info.module) or (len(shape) >= 2 and shape[-1] == vocab)
        ):
            info.category = Category.LOGITS_LOSS.value
            continue
        if info.phase is Phase.FORWARD:
            alive_after = info.free_index < 0 or info.free_index >= backward_start.get(info.step, 0)
            info.category = (Category.ACTIVATIONS if alive_after and info.module else Category.TEMPORARIES).value
            continue
        if info.phase is Phase.BACKWARD and info.in_recompute:
            info.category = Category.ACTIVATIONS.value
            continue
        info.category = Category.TEMPORARIES.value
