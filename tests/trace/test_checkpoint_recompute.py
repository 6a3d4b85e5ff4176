"""Under gradient checkpointing the recompute reads the checkpointed input itself: the analytic counts it once.

torch 2.13 ``torch/utils/checkpoint.py``, the non-reentrant path (transformers 5.23
``_activation_checkpointing_enable`` passes ``{"use_reentrant": False}`` by default): ``_CheckpointFrame.save_inputs``
keeps the layer's inputs, and the unpack hook recomputes with ``frame.recompute_fn(*frame.get_inputs())``, so the
recomputed layer runs on the very tensor the checkpoint holds. Its first norm saves that tensor unchanged when it
needs no cast of it (``LlamaRMSNorm``'s ``x.to(float32)`` of an fp32 residual stream is ``x``; ``nn.LayerNorm``
saves its input); otherwise it allocates an fp32 copy (4·H·T bytes). The trace shows which happens: in step 2's
backward, the top layer's recomputed input norm allocates that copy or not. The analytic's recomputed layer
(``StepParts.recompute_bytes``) must be its saved set (``layer_bytes``) less the input exactly when no copy is made.

Expected, by hand (H hidden, T tokens):
- Llama, full fine-tuning in bf16-mixed: the trained fp32 embedding makes the stream fp32 (as in fp32 precision),
  so no copy: the input (4·H·T) is not counted twice;
- Llama, bf16-true: a bf16 stream, the norm allocates its fp32 copy: nothing is shared;
- GPT-2, bf16-true: ``nn.LayerNorm`` saves its bf16 input itself: 2·H·T.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tests.trace._trace_tiny import TINY  # noqa: E402
from vramledger.analytic.step import step_parts  # noqa: E402
from vramledger.catalog.hfconfig import model_spec_from_config  # noqa: E402
from vramledger.ledger import Phase  # noqa: E402
from vramledger.specs import Method, Precision, TrainSpec  # noqa: E402
from vramledger.trace import trace_events  # noqa: E402

CASES = {
    # id: (family, precision, first norm of the top layer (of 2), bytes per element the recompute shares)
    "llama-bf16-mixed": ("llama", Precision.BF16_MIXED, "model.layers.1.input_layernorm", 4),
    "llama-bf16-true": ("llama", Precision.BF16, "model.layers.1.input_layernorm", 0),
    "gpt2-bf16-true": ("gpt2", Precision.BF16, "transformer.h.1.ln_1", 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_recompute_reads_the_checkpointed_input(case: str) -> None:
    family, precision, first_norm, shared = CASES[case]
    cfg = TINY[family]
    model = model_spec_from_config(cfg, name=f"tiny-{family}", source="test")
    spec = TrainSpec(method=Method.FULL, precision=precision, micro_batch=2, seq_len=48, packing=True, grad_ckpt=True)
    H, T = model.hidden_size, spec.tokens

    events = trace_events(model, spec, config=cfg)
    fp32_copies = [
        e for e in events
        if e.kind == "alloc" and e.step == 2 and e.phase is Phase.BACKWARD and e.module == first_norm
        and e.op == "_to_copy" and e.bytes == 4 * H * T
    ]  # fmt: skip
    p = step_parts(model, spec)
    counted_once = p.layer_bytes - p.recompute_bytes
    print(
        f"{case}: traced fp32 copies of the input {len(fp32_copies)}; analytic shares {counted_once:,} "
        f"(expected {shared * H * T:,})"
    )
    assert bool(fp32_copies) == (shared == 0)
    assert counted_once == shared * H * T
