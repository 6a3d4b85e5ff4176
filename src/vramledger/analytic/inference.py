"""Inference alone: weights, the KV cache of ``generate`` and the prefill's working set; how many sequences fit.

Legend as in ``analytic/evaluation.py``: B sequences, P prompt tokens, N new tokens, S = P + N − 1, V vocabulary.

The step modelled is ``model.generate(input_ids, max_new_tokens=N)`` in transformers 5.23 with the model loaded in
the compute dtype (``torch_dtype=bfloat16``) or bitsandbytes-quantised, ``num_beams=1``:
- no optimizer, no gradients, no saved activations (``generate`` runs under ``torch.no_grad``);
- the prefill runs the prompt through every layer (one layer's working set live at a time) and, with
  ``logits_to_keep=1`` (generation/utils.py l. 2953-2954), computes the logits of the last token only, copied to
  fp32 (l. 3247): (c + 4)·B·V, not B·P·V;
- the cache is what ``evaluation.kv_cache_bytes`` derives from cache_utils.py (``DynamicCache`` by default, static
  with ``cache_implementation="static"``); ``cache=CacheKind.LEGACY`` models the tuple cache of transformers
  < 4.36 instead (``analytic/kv_cache.py``: twice the cache during a decode step, full prefill logits), and with
  it those releases' per-layer rotary cos/sin tables of Llama and Mistral (``analytic/rotary_buffers.py``);
- one cuBLAS workspace (no autograd thread), the allocator reserve and the CUDA context as for training.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from vramledger.analytic.evaluation import SRC_CACHE, kv_cache_bytes, layer_working_set, mask_bytes
from vramledger.analytic.kv_cache import (
    SRC_LEGACY,
    SRC_LEGACY_LOGITS,
    CacheKind,
    decode_step_extra,
    prefill_logits_tokens,
)
from vramledger.analytic.overhead import (
    CONTEXT_SOURCE,
    RESERVE_SOURCE,
    allocator_reserve_bytes,
    cublas_workspace_bytes,
    cuda_context_bytes,
)
from vramledger.analytic.params import count_params
from vramledger.analytic.rotary_buffers import SOURCE as SRC_ROTARY
from vramledger.analytic.rotary_buffers import legacy_rotary_bytes
from vramledger.errors import VramledgerError
from vramledger.ledger import Basis, Category, Ledger, LineItem, Phase, ledger_verdict
from vramledger.specs import Attention, DType, GPUSpec, Method, ModelCode, ModelSpec, Precision, QuantSpec, TrainSpec
from vramledger.specs.gpu import DEFAULT_HEADROOM
from vramledger.units import fmt_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class InferSpec:
    """One ``generate`` call."""

    batch: int = 1
    """Sequences generated together (rows of the batch)."""
    prompt: int = 2048
    """Prompt tokens per sequence (the padded length of the longest prompt)."""
    new_tokens: int = 256
    """``max_new_tokens``."""
    dtype: DType = DType.BF16
    """Dtype the weights are loaded in and the forward computes in."""
    quant: QuantSpec | None = None
    """bitsandbytes quantisation of the linear layers (``BitsAndBytesConfig``)."""
    attn: Attention = Attention.SDPA
    cache: CacheKind = CacheKind.DYNAMIC
    """The KV cache modelled: ``DynamicCache`` (transformers ≥ 4.36, the default), ``static``
    (``cache_implementation="static"``: S tokens per layer preallocated) or ``legacy`` (the tuple cache of
    transformers < 4.36)."""
    model_code: ModelCode = ModelCode.TRANSFORMERS
    """Whose code generates: LitGPT's ``generate/base.py`` under Lightning's ``BitsandbytesPrecision`` quantises
    lm_head too, with an fp16 quantisation state (analytic/litgpt_qlora.py)."""

    def __post_init__(self) -> None:
        for name in ("batch", "prompt", "new_tokens"):
            if getattr(self, name) < 1:
                flag = {"batch": "--batch", "prompt": "--prompt", "new_tokens": "--new-tokens"}[name]
                raise VramledgerError(
                    f"inference: {name} must be a positive integer (got {getattr(self, name)}); e.g. {flag} 1"
                )
        if self.attn is Attention.FLASH2 and self.dtype is DType.FP32:
            raise VramledgerError("flash_attention_2 runs only in fp16/bf16; use --precision bf16 or --attn sdpa")

    @property
    def as_train(self) -> TrainSpec:
        """The TrainSpec whose compute dtype and attention match (for the shared per-layer formulas)."""
        prec = {DType.FP32: Precision.FP32, DType.BF16: Precision.BF16, DType.FP16: Precision.FP16}[self.dtype]
        return TrainSpec(
            method=Method.FULL, precision=prec, attn=self.attn, micro_batch=self.batch, seq_len=self.prompt
        )


def weight_bytes(m: ModelSpec, spec: InferSpec) -> int:
    """Parameters in the load dtype, or bitsandbytes storage for the linears (weights.py ``quantised_bytes``)."""
    if spec.quant is None:
        from vramledger.analytic.weights import checkpoint_storage_bytes

        return checkpoint_storage_bytes(m, spec.dtype.bytes)  # a GPTQ/AWQ/FP8/MXFP4 checkpoint: its storage
    from vramledger.analytic.weights import weight_budget

    return weight_budget(m, _quantised_train(spec)).frozen_bytes


def _quantised_train(spec: InferSpec) -> TrainSpec:
    """The QLoRA TrainSpec whose frozen base is the quantised model ``spec`` generates with."""
    from dataclasses import replace

    return replace(spec.as_train, method=Method.QLORA, quant=spec.quant, model_code=spec.model_code)


def dequant_bytes(m: ModelSpec, spec: InferSpec, *, head: bool) -> int:
    """A 4-bit weight dequantised for one matmul of more than one token (bitsandbytes ``matmul_4bit`` takes the
    ``gemv_4bit`` path only for a single token: ``A.numel() == A.shape[-1]``; otherwise ``MatMul4Bit`` runs
    ``dequantize_4bit(B, state).to(A.dtype)``): lm_head's when ``head`` (0 unless it is quantised), else the
    largest quantised weight of a decoder layer."""
    if spec.quant is None or spec.quant.bits != 4:
        return 0
    from vramledger.analytic.litgpt_qlora import dequant_transient_bytes
    from vramledger.analytic.weights import lm_head_quantised, weight_budget

    t = _quantised_train(spec)
    if head:
        n = m.vocab_size * m.hidden_size if lm_head_quantised(t) else 0
    else:
        n = weight_budget(m, t).largest_frozen_matrix_numel
    return dequant_transient_bytes(n, spec.dtype, spec.model_code, spec.quant.compute_dtype)


SRC_DEQUANT = "bitsandbytes matmul_4bit → MatMul4Bit: dequantize_4bit(B, state).to(A.dtype) (analytic/litgpt_qlora.py)"


def _item(cat: Category, n: int, label: str, source: str, basis: Basis = Basis.FORMULA) -> LineItem:
    return LineItem(category=cat, phase=Phase.GENERATE, bytes=n, label=label, source=source, basis=basis)


SRC_LOGITS = "generation/utils.py l. 2954 logits_to_keep=1, l. 3247 .to(float32)"
SRC_HEAD = (
    "LlamaForCausalLM.forward: lm_head runs on the final norm's output after self.model(...) returns, when the "
    "last layer's working set and the 4-D mask (locals of the decoder's forward) are freed"
)


def _generate_moments(m: ModelSpec, spec: InferSpec) -> list[tuple[str, list[LineItem]]]:
    """The candidate peaks of ``generate`` beside the weights, each named, as its GENERATE line items:

    - the prefill's top layer: the cache after the prefill, one layer's working set and the largest decoder weight
      dequantised (4-bit); it also carries the last-token logits line ((c + 4)·B·V, a few MB), which this moment
      has always counted although the first forward has made no logits yet;
    - the prefill's lm_head: the cache, the final norm's output (c·B·P·H) and the logits: of the last token, or of
      every prompt token before ``logits_to_keep`` (legacy), plus lm_head dequantised where it is 4-bit (LitGPT);
      the layer's working set is freed by then (``SRC_HEAD``);
    - the end of the last decode step: the whole cache, what the cache kind holds beside it
      (``kv_cache.decode_step_extra``), the last logits and, with a batch, a dequantised weight.
    """
    train = spec.as_train
    c = spec.dtype.bytes
    B, P, N = spec.batch, spec.prompt, spec.new_tokens
    legacy = spec.cache is CacheKind.LEGACY
    kv = kv_cache_bytes(m, batch=B, prompt=P, new_tokens=N, dtype_bytes=c, static=spec.cache is CacheKind.STATIC)
    tok, sq = layer_working_set(m, train, batch=B, length=P, resid=c)
    mask = mask_bytes(train, batch=B, length=P)
    logits = (c + 4) * B * m.vocab_size
    step_extra = decode_step_extra(
        spec.cache, at_end=kv.at_end, per_layer_step=kv.per_layer_step, new_tokens=N, cached=P + N - 1
    )
    dq_layer, dq_head = (dequant_bytes(m, spec, head=h) if B * P > 1 else 0 for h in (False, True))
    dq_decode = max(dequant_bytes(m, spec, head=h) for h in (False, True)) if B > 1 else 0
    cache_kind = spec.cache.display
    after_prefill = _item(Category.KV_CACHE, kv.after_prefill, f"KV cache after the prefill ({cache_kind})", SRC_CACHE)
    last_logits = _item(Category.LOGITS_LOSS, logits, "last-token logits and their fp32 copy", SRC_LOGITS)
    dq_label = "4-bit weight dequantised for the prompt's matmul"
    top_layer = [
        after_prefill,
        _item(Category.TEMPORARIES, tok, "one layer's working set", "analytic/evaluation.py layer_working_set"),
        _item(
            Category.ATTENTION_SCORES,
            sq + mask,
            "attention mask / length² tensors",
            "masking_utils create_causal_mask; eager_attention_forward",
        ),
        last_logits,
        *([_item(Category.TEMPORARIES, dq_layer, dq_label, SRC_DEQUANT)] if dq_layer else []),
    ]
    prompt_logits = _item(
        Category.LOGITS_LOSS,
        logits * prefill_logits_tokens(spec.cache, P),
        "logits of every prompt token and their fp32 copy",
        SRC_LEGACY_LOGITS,
    )
    head = [
        after_prefill,
        _item(Category.TEMPORARIES, c * B * P * m.hidden_size, "final norm's output (lm_head's input)", SRC_HEAD),
        prompt_logits if legacy else last_logits,
        *(
            [_item(Category.TEMPORARIES, dq_head, "lm_head dequantised for the prompt's matmul", SRC_DEQUANT)]
            if dq_head
            else []
        ),
    ]
    end = [
        _item(Category.KV_CACHE, kv.at_end, f"KV cache of {P}+{N}-1 tokens ({cache_kind})", SRC_CACHE),
        _item(
            Category.TEMPORARIES,
            step_extra,
            "the previous step's cache tuple, alive while the new one is built"
            if legacy
            else "one layer's K/V being re-concatenated",
            SRC_LEGACY if legacy else "cache_utils.py DynamicLayer.update torch.cat",
        ),
        *(
            [_item(Category.TEMPORARIES, dq_decode, "4-bit weight dequantised for the batch's matmul", SRC_DEQUANT)]
            if dq_decode
            else []
        ),
        last_logits,
    ]
    return [
        (f"prefill of {B}×{P} prompt tokens (top layer)", top_layer),
        (f"prefill of {B}×{P} prompt tokens (lm_head)", head),
        (f"last of {N} decode steps", end),
    ]


def infer_ledger(
    m: ModelSpec, spec: InferSpec, *, gpu: GPUSpec | None = None, headroom: float = DEFAULT_HEADROOM
) -> Ledger:
    """The ledger of one ``generate`` call: Phase.LOAD (weights) and Phase.GENERATE (its peak moment)."""
    c = spec.dtype.bytes
    w = weight_bytes(m, spec)
    rotary = legacy_rotary_bytes(m, c) if spec.cache is CacheKind.LEGACY else 0
    ws = cublas_workspace_bytes(gpu) // 2  # one handle: no autograd thread
    w_src = "Σ parameters × dtype bytes (analytic/params.py); bitsandbytes storage (analytic/weights.py)"
    rot_label = "rotary cos/sin tables of every layer (transformers < 4.36)"
    rot_load = [LineItem(category=Category.WEIGHTS, phase=Phase.LOAD, bytes=rotary, label=rot_label, source=SRC_ROTARY)]
    items: list[LineItem] = [
        LineItem(category=Category.WEIGHTS, phase=Phase.LOAD, bytes=w, label="weights", source=w_src),
        *(rot_load if rotary else []),
        LineItem(
            category=Category.CUDA_CONTEXT,
            phase=Phase.LOAD,
            bytes=cuda_context_bytes(gpu),
            label="CUDA context",
            source=CONTEXT_SOURCE,
            basis=Basis.ASSUMPTION,
        ),
        _item(Category.WEIGHTS, w, "weights", w_src),
        *([_item(Category.WEIGHTS, rotary, rot_label, SRC_ROTARY)] if rotary else []),
        _item(Category.WORKSPACE, ws, "cuBLAS workspace", "torch CublasHandlePool.cpp getChosenWorkspaceSize"),
    ]
    moment, peak_items = max(_generate_moments(m, spec), key=lambda mo: sum(i.bytes for i in mo[1]))
    items += peak_items
    allocated = sum(i.bytes for i in items if i.phase is Phase.GENERATE)
    items += [
        _item(
            Category.ALLOCATOR_RESERVE,
            allocator_reserve_bytes(allocated),
            "cached, not allocated",
            RESERVE_SOURCE,
            Basis.ASSUMPTION,
        ),
        _item(Category.CUDA_CONTEXT, cuda_context_bytes(gpu), "CUDA context", CONTEXT_SOURCE, Basis.ASSUMPTION),
    ]
    ledger = Ledger(
        model=m.name,
        params=count_params(m),
        trainable_params=0,
        items=tuple(items),
        engine="analytic",
        moments=MappingProxyType({Phase.LOAD: "weights loaded", Phase.GENERATE: moment}),
        settings=MappingProxyType(
            {
                "mode": "infer",
                "batch": spec.batch,
                "prompt": spec.prompt,
                "new_tokens": spec.new_tokens,
                "dtype": spec.dtype.value,
                "cache": spec.cache.value,
                "attn": spec.attn.value,
                "quant": None if spec.quant is None else spec.quant.quant_type if spec.quant.bits == 4 else "int8",
            }
            | (
                {"bnb_compute_dtype": spec.quant.compute_dtype.value}
                if spec.quant is not None and spec.quant.compute_dtype is not None
                else {}
            )
        ),
    )
    from dataclasses import replace

    verdict = None if gpu is None else ledger_verdict(ledger, gpu.name, gpu.memory_bytes, headroom)
    cache = ledger.bytes_of(Category.KV_CACHE, Phase.GENERATE)
    advice = (
        f"The KV cache ({fmt_bytes(cache)}) "
        + ("outweighs the weights" if cache > w else "is smaller than the weights")
        + f" ({fmt_bytes(w)}); fewer sequences or tokens shrink it linearly."
    )
    return replace(ledger, verdict=verdict, advice=advice)


@dataclass(frozen=True, kw_only=True, slots=True)
class Concurrency:
    """How many sequences of one length fit next to the weights on a GPU."""

    max_batch: int
    """Largest batch whose device total fits the usable memory (0: not even one sequence)."""
    usable_bytes: int
    weights_bytes: int
    cache_per_sequence: int
    """KV cache of one sequence at its peak."""
    device_at_max: int
    """Device total at ``max_batch`` (at batch 1 when none fits)."""
    gpu: str


def max_concurrency(m: ModelSpec, spec: InferSpec, gpu: GPUSpec, *, headroom: float = DEFAULT_HEADROOM) -> Concurrency:
    """Binary search on the batch: the device total grows with B (cache, working set, logits), so it is monotone."""

    def device(b: int) -> int:
        from dataclasses import replace

        return infer_ledger(m, replace(spec, batch=b), gpu=gpu, headroom=headroom).device_total

    usable = int(gpu.memory_bytes * (1.0 - headroom))
    one = infer_ledger(m, spec if spec.batch == 1 else _with_batch(spec, 1), gpu=gpu, headroom=headroom)
    if one.device_total > usable:
        best, at = 0, one.device_total
    else:
        lo, hi = 1, 2
        while device(hi) <= usable:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if device(mid) <= usable:
                lo = mid
            else:
                hi = mid
        best, at = lo, device(lo)
    return Concurrency(
        max_batch=best,
        usable_bytes=usable,
        weights_bytes=weight_bytes(m, spec),
        cache_per_sequence=kv_cache_bytes(
            m,
            batch=1,
            prompt=spec.prompt,
            new_tokens=spec.new_tokens,
            dtype_bytes=spec.dtype.bytes,
            static=spec.cache is CacheKind.STATIC,
        ).peak,
        device_at_max=at,
        gpu=gpu.name,
    )


def _with_batch(spec: InferSpec, b: int) -> InferSpec:
    from dataclasses import replace

    return replace(spec, batch=b)
