"""LitGPT's training loop under Lightning Fabric: the moment its fp32 logits are made while the previous
micro-step's are still bound.

Legend: T = B·L tokens of one micro-step, V vocabulary, c compute-dtype bytes.

``_FabricModule.forward`` returns ``precision.convert_output(output)``, an fp32 copy of every floating output
(Lightning 71aed751 and 2.3.0.dev ``plugins/precision/half.py`` ``convert_output``: ``apply_to_collection(data,
function=_convert_fp_tensor, dtype=Tensor, dst_type=torch.get_default_dtype())``; the same in ``amp.py`` and
``bitsandbytes.py``). While it runs, the model's own compute-dtype logits (c·V·T, bound to ``output`` until
``convert_output`` returns) and the new fp32 copy (4·V·T) are alive together; LitGPT's loop still binds the
previous micro-step's fp32 ``logits`` (litgpt 43c44323 ``finetune/lora.py`` l. 276, lit-gpt 8641822 l. 216,
``finetune/full.py`` l. 229: rebound when ``model(...)`` returns), which ``add_persistent`` counts
(``StepParts.kept_logits_bytes``). Every activation of the micro-step is saved by then (forward is over), so this
moment holds the activations and (4 + c + 4)·V·T of logits: more than the loss (analytic/logits.py), which holds
the new list and the log-softmax outputs (8·V·T) after the previous list is freed. Under bitsandbytes < 0.43.2 the
previous graph's MatMul4Bit inputs are alive here too (analytic/litgpt_qlora.py: the previous graph is reachable
from the previous list until it is rebound).

The steady state is modelled: the first micro-step of a run has no previous list; the peak comes at the second. Where
the longest batch runs once, first (lit-gpt 8641822's ``get_batch(..., longest_seq_ix if iter_num == 0 else None)``),
the steady state at that length is an upper bound (docs/published.md, "LitGPT FSDP LoRA rows 36-46").
"""

from __future__ import annotations

from vramledger.analytic.litgpt_qlora import end_of_next_forward
from vramledger.analytic.parts import Moment, StepParts
from vramledger.ledger import Category
from vramledger.specs import ModelSpec, TrainSpec

SRC_CONVERT = (
    "Lightning Fabric _FabricModule.forward: precision.convert_output(output) casts the logits to fp32 while the "
    "model's compute-dtype logits are still bound"
)


def convert_output_moment(m: ModelSpec, train: TrainSpec, p: StepParts, *, grads: int) -> Moment | None:
    """Fabric's ``convert_output`` at the end of the next micro-step's forward (module docstring); None when the run
    is not LitGPT's chunked loop (no fp32 list kept)."""
    if not p.kept_logits_bytes:
        return None
    c = train.precision.compute.bytes
    T, V = train.tokens, m.vocab_size
    name = "Fabric's convert_output: this micro-step's logits cast to fp32 (LitGPT)"
    mo = end_of_next_forward(m, train, p, name=name, grads=grads)
    mo.add(Category.LOGITS_LOSS, "this micro-step's logits (compute dtype)", c * V * T if c != 4 else 0, SRC_CONVERT)
    mo.add(Category.LOGITS_LOSS, "their fp32 copy", 4 * V * T, SRC_CONVERT)
    return mo
