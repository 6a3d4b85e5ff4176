"""LitGPT's QLoRA as its 2023-2024 commits ran it: what Lightning's ``BitsandbytesPrecision`` and the bitsandbytes
they pinned hold beyond a transformers + PEFT QLoRA step.

Legend: T = B·L tokens of one micro-step, V vocabulary (LitGPT's ``padded_vocab_size``), H hidden, c compute-dtype
bytes, n elements of one weight.

Applies to ``model_code`` litgpt (litgpt 43c44323..00af8b0d: ``lightning==2.3.0.dev20240328`` /
``2.4.0.dev20240728``, ``bitsandbytes==0.42.0`` in pyproject.toml) and lit-gpt-2023 (lit-gpt 8641822: Lightning
71aed751, bitsandbytes 0.41.1 as the resource tables state) with a 4-bit quantisation. Read at those pins:

1. **lm_head is quantised** (analytic/weights.py ``lm_head_quantised``): Lightning patches ``torch.nn.Linear`` with
   its ``_Linear4bit`` while LitGPT's ``fabric.init_module`` builds ``GPT``, and LitGPT passes no ``ignore_modules``.
2. **The quantisation state is fp16.** ``_Linear4bit.quantize`` casts every weight ``.to(device=device,
   dtype=torch.half)`` before ``quantize_4bit`` (Lightning 438f29f0 ``plugins/precision/bitsandbytes.py`` l. 334;
   71aed751 l. 221), which records ``A.dtype`` in the state (bitsandbytes 0.42.0 ``functional.py`` l. 967-969).
   ``MatMul4Bit`` runs ``F.dequantize_4bit(B, state).to(A.dtype)`` in forward and backward (0.42.0
   ``autograd/_functions.py`` l. 516, 546; 0.41.1 l. 516, 547): an fp16 copy (2n) and, under bf16 compute, its bf16
   cast (c·n) are alive together while ``.to`` runs. transformers + bitsandbytes ≥ 0.42 quantise the loaded bf16
   weight, so their state is bf16 and the cast is a no-op (one c·n copy).
3. **The previous micro-step's MatMul4Bit inputs outlive its backward.** bitsandbytes < 0.43.2 keeps A as a plain
   attribute, ``ctx.tensors = (A, B)`` (0.42.0 ``_functions.py`` l. 523), and autograd releases only what
   ``save_for_backward`` saved after a node's backward (torch ``PyNode::release_variables``): A lives as long as the
   graph. LitGPT's loop keeps the graph alive through its ``logits`` list (litgpt 43c44323 ``finetune/lora.py``
   l. 276 ``logits = model(input_ids, lm_head_chunk_size=128)``; each chunk's ``grad_fn`` is lm_head's MatMul4Bit
   node, whose edges reach every layer) until the next micro-step's forward returns and ``logits`` is rebound; the
   loss itself is rebound to a float at every log (l. 292, ``log_interval: 1``). So the next forward runs beside
   every quantised linear's previous input: per token c·(attention input + o_proj input + MLP input + down's input)
   per layer, the first layer's attention input excepted (no input of it needs grad), plus lm_head's input (c·H).
   bitsandbytes 0.43.2 stopped keeping A (9e753741, "fix QLoRA mem bug: delete useless buffered activation", #1270)
   and LitGPT moved to ``bitsandbytes>=0.45.2`` on 2024-12-28 (d2ed13c3): later LitGPT runs hold neither this nor
   the saved inputs of ``analytic/activations.py`` ``quantised_inputs_bytes``.

The moment this adds: lm_head's last chunk in the next micro-step's forward, with that micro-step's activations, its
logits (c·V·T), the previous micro-step's logits (4·V·T, the fp32 list of analytic/logits.py, still bound), the previous
inputs (3) and lm_head dequantised (2). A moment later Fabric's ``convert_output`` makes this micro-step's fp32 list
(4·V·T) with lm_head's dequantised weight gone (analytic/litgpt_loop.py). lm_head's backward (the same dequantised head,
without the previous micro-step's tensors) is smaller, and the loss's moments do not hold the dequantised head, so no
other moment changes. The steady state is modelled as everywhere in analytic/: the previous micro-step had the same
shape (under dynamic padding it may have been shorter; lit-gpt 8641822 runs its longest sample once, first, so there
this is an upper bound: bench/published/litgpt_trace.py finds those runs' peak at the first micro-step, which has no
previous micro-step beside it).

Checked on CPU: a function that keeps ``ctx.tensors = (A, B)`` keeps A alive after backward until the output list
is dropped, one that uses ``save_for_backward`` does not (tests/analytic/test_litgpt_qlora.py).
"""

from __future__ import annotations

from vramledger.analytic.activations import _INPUT_OF
from vramledger.analytic.params import layer_linears
from vramledger.analytic.parts import Moment, StepParts, add_activations, add_persistent
from vramledger.analytic.weights import lm_head_quantised
from vramledger.ledger import Category, Phase
from vramledger.specs import DType, ModelCode, ModelSpec, TrainSpec

SRC_DEQUANT = (
    "Lightning _Linear4bit.quantize .to(dtype=torch.half) → fp16 quant state; bitsandbytes 0.42.0 MatMul4Bit "
    "dequantize_4bit(B, state).to(A.dtype): fp16 copy + its compute-dtype cast"
)
SRC_RETAINED = (
    "bitsandbytes < 0.43.2 MatMul4Bit ctx.tensors = (A, B), never released by autograd; LitGPT finetune/lora.py "
    "keeps the graph through `logits` until the next forward returns"
)


def lightning_quant_state(model_code: ModelCode) -> bool:
    """Whether the 4-bit weights were quantised by Lightning's ``_Linear4bit`` (an fp16 quantisation state)."""
    return model_code.litgpt


def dequant_transient_bytes(numel: int, compute: DType, model_code: ModelCode, bnb_compute: DType | None = None) -> int:
    """Bytes alive while bitsandbytes dequantises one n-element 4-bit weight for a matmul: the state's dtype
    (fp16 under Lightning, else the dtype the weight was loaded in, ``compute``), plus its cast to the matmul's
    dtype when they differ (see the module docstring, 2): ``bnb_4bit_compute_dtype`` where it is set apart from
    the load dtype (``QuantSpec.compute_dtype``: ``Linear4bit.forward`` makes the input that dtype, and
    ``MatMul4Bit`` runs ``dequantize_4bit(B, state).to(A.dtype)``, bitsandbytes ``autograd/_functions.py``)."""
    state = DType.FP16 if lightning_quant_state(model_code) else compute
    matmul = bnb_compute or compute
    return numel * state.bytes + (numel * matmul.bytes if matmul is not state else 0)


def keeps_previous_graph(train: TrainSpec) -> bool:
    """Whether the previous micro-step's MatMul4Bit inputs are alive in the next forward (module docstring, 3)."""
    return train.quant is not None and train.quant.bits == 4 and train.model_code.litgpt


def retained_inputs_bytes(m: ModelSpec, train: TrainSpec, tokens: int, *, embedding_trainable: bool) -> int:
    """The previous micro-step's inputs that every quantised linear's MatMul4Bit still holds: c·T per distinct
    input width, over every layer (the first layer's attention input only when the embedding trains), plus
    lm_head's input (the final norm's output) when lm_head is quantised."""
    if not keeps_previous_graph(train):
        return 0
    c = train.precision.compute.bytes
    widths: dict[str, int] = {}
    for lin in layer_linears(m):
        group = _INPUT_OF.get(lin.name)
        if group is not None:
            widths[group] = lin.in_features
    per_layer = sum(widths.values())
    first = per_layer - (0 if embedding_trainable else widths.get("attn_in", 0))
    head = m.hidden_size if lm_head_quantised(train) else 0
    return c * tokens * ((m.num_layers - 1) * per_layer + first + head)


def head_dequant_bytes(m: ModelSpec, train: TrainSpec) -> int:
    """lm_head dequantised for one chunk's matmul (0 when lm_head is not quantised)."""
    if not lm_head_quantised(train):
        return 0
    return dequant_transient_bytes(m.vocab_size * m.hidden_size, train.precision.compute, train.model_code)


def end_of_next_forward(m: ModelSpec, train: TrainSpec, p: StepParts, *, name: str, grads: int) -> Moment:
    """A moment at the end of the next micro-step's forward: what lives through the step, every saved activation,
    and the previous micro-step's MatMul4Bit inputs where they are kept (0 elsewhere)."""
    mo = Moment(name=name, phase=Phase.FORWARD)
    add_persistent(mo, p, train, grads=grads, autocast=True, states=True)
    add_activations(mo, p, train)
    mo.add(
        Category.ACTIVATIONS,
        "previous micro-step's inputs kept by MatMul4Bit",
        retained_inputs_bytes(m, train, train.tokens, embedding_trainable=p.weights.embedding_trainable),
        SRC_RETAINED,
    )
    return mo


def next_forward_moment(m: ModelSpec, train: TrainSpec, p: StepParts, *, grads: int) -> Moment | None:
    """lm_head's last chunk in the next micro-step's forward, beside the previous micro-step's graph (module
    docstring); None when the run keeps no previous graph."""
    if not keeps_previous_graph(train):
        return None
    logits = train.precision.compute.bytes * m.vocab_size * train.tokens
    name = "lm_head's last chunk, the previous micro-step's graph alive (LitGPT QLoRA)"
    mo = end_of_next_forward(m, train, p, name=name, grads=grads)
    # The previous micro-step's logits (LitGPT's `logits`, fp32 after Fabric's convert_output) are in
    # add_persistent: StepParts.kept_logits_bytes.
    mo.add(Category.LOGITS_LOSS, "logits chunks of this micro-step", logits, "litgpt GPT.forward lm_head_chunk_size")
    mo.add(
        Category.TEMPORARIES,
        "lm_head dequantised (fp16 + compute-dtype cast)",
        head_dequant_bytes(m, train),
        SRC_DEQUANT,
    )
    return mo
