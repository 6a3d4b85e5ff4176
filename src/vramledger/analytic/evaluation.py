"""Evaluation and generation: why training fits and evaluation OOMs.

Legend: B eval batch, L eval length, T = B·L, V vocabulary, H hidden, I MLP width, Dq = heads·head_dim,
Dkv = kv_heads·head_dim, nh heads, c compute-dtype bytes, s residual-stream bytes, W sliding window,
P prompt tokens, N new tokens, S = P + N − 1 tokens cached at the end of ``generate``, k eval batches kept on
the GPU.

What the HF Trainer does (transformers 5.23 ``trainer.py``):
- ``evaluation_loop`` (l. 2896-3045) runs ``model.eval()`` and, per batch, ``prediction_step`` (l. 3185-3290),
  whose forward runs under ``torch.no_grad()`` (l. 3239): nothing is saved for backward, so only one layer's
  working set is live at a time, with the logits and the loss' fp32 upcast at the end. Model, adapters and
  optimizer states stay on the GPU; gradients are None after ``zero_grad(set_to_none=True)``.
- ``evaluate`` passes ``prediction_loss_only=True`` when there is no ``compute_metrics`` (l. 2867-2868), and then
  ``prediction_step`` returns no logits (l. 3285). Otherwise the logits (padded with
  ``pad_across_processes``, reduced by ``preprocess_logits_for_metrics`` if given, gathered) go into
  ``EvalLoopContainer.add`` (l. 3010-3015; ``trainer_pt_utils.py`` l. 371-378), which ``torch.cat``s them onto the
  earlier batches' (``nested_concat`` → ``torch_pad_and_concatenate``, l. 80-95): on the GPU, growing by one batch
  per step. Only with ``eval_accumulation_steps`` are they moved to the CPU, every that many steps
  (l. 3038-3045, ``to_cpu_and_numpy``); without it they stay until the loop ends (``get_arrays``, l. 3050-3053).
  Labels are kept the same way (int64). The concatenation holds the old, the new batch and the result at once.
- accelerate ``Accelerator.prepare_model`` (accelerator.py l. 1824-1835) wraps the forward in autocast and
  ``convert_outputs_to_fp32`` under AMP (``*-mixed``): the logits the Trainer keeps are fp32 (4·B·L·V).
- ``LlamaModel.forward`` (modeling_llama.py l. 372) builds ``DynamicCache(config)`` whenever ``use_cache``, which
  defaults to ``config.use_cache`` (``utils/generic.py`` ``merge_with_config_defaults``, turned off only for
  gradient checkpointing *in training mode*). So an eval forward fills a KV cache of the whole eval batch, unless
  the training script set ``config.use_cache = False`` — which LLaMA-Factory (``model_utils/checkpointing.py``
  ``prepare_model_for_training``) and most scripts do exactly when they enable gradient checkpointing. We count
  that cache when gradient checkpointing is off.

Generation (transformers 5.23 ``generation/utils.py`` and ``cache_utils.py``):
- ``generate`` sets ``logits_to_keep=1`` (l. 2953-2954): the prefill computes logits for the last token only, then
  copies them to fp32 (l. 3247).
- ``max_cache_length = max_length − 1`` (l. 2961): the last new token is never fed back, so S = P + N − 1.
- ``DynamicLayer.update`` (l. 119-138) ``torch.cat``s each step: K and V of S tokens per full-attention layer.
- ``DynamicSlidingWindowLayer.update`` (l. 222-247) keeps ``full[:, :, -W+1:]``, a *view* of the concatenation:
  right after the prefill the storage of all P tokens stays alive; after each decode step it is a fresh
  concatenation of W − 1 + 1 tokens. Storage: P after the prefill, min(S, W) after the first decode step.
  ``get_layer_types_and_kwargs`` (l. 1910-1957) makes a layer sliding when ``layer_types`` says so (Gemma 2/3,
  Qwen with ``use_sliding_window``) or when the config has a ``sliding_window`` (Mistral v0.1, Phi-3).
- ``StaticCache`` (``StaticLayer.lazy_initialization``, l. 423-450) preallocates ``max_cache_len`` = S tokens per
  layer at the first update; ``StaticSlidingWindowLayer`` min(W, S) (l. 525-527). Batch × ``num_beams`` rows.
- GQA/MQA: the cache holds kv_heads heads (``repeat_kv`` copies are transient, inside attention).
- MLA (DeepSeek-V2/V3 compressed latents) is not modelled: the catalog has no MLA model.

TRL's ``chunked_nll`` (``Loss.CHUNKED_NLL``; trl f2cd577 ``trl/trainer/sft_trainer.py``): ``prediction_step``
passes the labels, so the patched forward (``_patch_chunked_ce_lm_head._chunked_ce_forward``, l. 270-374) runs
its chunked path in eval too: the decoder with ``use_cache=False`` (l. 293, 309; ``SFTTrainer.compute_loss`` also
sets ``inputs["use_cache"] = False``, l. 1710): no KV cache; then ``_chunked_cross_entropy_loss`` (l. 117-234),
whose ``torch.utils.checkpoint`` under ``no_grad`` just runs ``_chunk``: one chunk's logits, fp32 log-softmax and
entropy at a time, as in the training forward (analytic/logits.py ``_trl_chunked_nll`` ``forward_peak``). It
returns ``logits=None`` (l. 364): with ``compute_metrics`` the Trainer keeps, per eval batch, the labels and the
output's other tensors (``prediction_step`` l. 3268: ``ModelOutput.items()`` skips None), three 0-d metrics
(``num_correct_tokens`` fp32, ``entropy_sum`` fp32, ``num_valid_tokens`` int64) that ``nested_concat`` turns into
1-D tensors (``atleast_1d``); ``preprocess_logits_for_metrics`` receives those, not logits.
Traced on CPU tensors: tests/analytic/test_trl_eval.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vramledger.analytic.activations import merged_experts, repeat_kv_copies, residual_bytes
from vramledger.analytic.kv_cache import SRC_LEGACY, decode_step_extra
from vramledger.analytic.logits import logits_bytes
from vramledger.analytic.parts import Moment, StepParts, add_persistent
from vramledger.errors import VramledgerError
from vramledger.ledger import Category, Ledger, Phase
from vramledger.specs import Attention, CacheKind, EvalLogits, Loss, ModelSpec, TrainSpec
from vramledger.units import fmt_bytes

TRAINER = "transformers 5.23 trainer.py"
SRC_KEPT = (
    f"{TRAINER} evaluation_loop l. 3010-3045: EvalLoopContainer.add torch.cat's each batch's (gathered, padded) "
    "logits and labels on the GPU; moved to CPU only every eval_accumulation_steps"
)
SRC_CONCAT = "trainer_pt_utils.py torch_pad_and_concatenate l. 80-95: torch.cat((kept, new)) holds kept, new and result"
SRC_TRL_EVAL = "trl f2cd577 sft_trainer.py _chunked_ce_forward l. 293-309 (use_cache=False), l. 364 (logits=None)"
TRL_EVAL_METRICS = 4 + 4 + 8
"""Bytes per eval batch of the kept 0-d metrics of TRL's chunked output: num_correct_tokens, entropy_sum (fp32),
num_valid_tokens (int64) (module docstring)."""
SRC_CACHE = (
    "cache_utils.py DynamicLayer.update (cat, S tokens), DynamicSlidingWindowLayer.update (view of the cat: P after "
    "prefill, min(S, W) after), StaticLayer (max_cache_len = P+N-1 preallocated): 2·B·kv_heads·head_dim·tokens·bytes"
)


# -- the KV cache ----------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class CacheBytes:
    """Bytes held by transformers' KV cache of one ``generate`` call (tensor storage, not views)."""

    after_prefill: int
    """Right after the prompt's forward (every layer, sliding ones included, holds P tokens' storage)."""
    at_end: int
    """After the last decode step (S = P + N − 1 tokens; sliding layers min(S, W))."""
    per_layer_step: int
    """One layer's K and V at the end: the extra a ``torch.cat`` holds while it replaces them."""

    @property
    def peak(self) -> int:
        return max(self.after_prefill, self.at_end)


def kv_bytes_per_token(m: ModelSpec, *, key_bytes: int, value_bytes: int) -> int:
    """K and V of one token in one layer: kv_heads·head_dim·(key + value bytes). MLA (modeling_deepseek_v2/v3.py
    ``past_key_values.update(k_nope, k_pe)``) caches the single-head latent and the shared rotary key instead."""
    if m.kv_lora_rank:
        return m.kv_lora_rank * key_bytes + m.qk_rope_head_dim * value_bytes
    return m.num_kv_heads * m.head_dim * (key_bytes + value_bytes)


def kv_cache_bytes(
    m: ModelSpec,
    *,
    batch: int,
    prompt: int,
    new_tokens: int,
    dtype_bytes: int,
    key_bytes: int | None = None,
    static: bool = False,
) -> CacheBytes:
    """The cache of ``generate(prompt, max_new_tokens=new_tokens)`` for ``batch`` rows, as transformers keeps it.

    >>> from vramledger.catalog import resolve_model
    >>> kv_cache_bytes(resolve_model("llama-3-8b"), batch=8, prompt=4096, new_tokens=1, dtype_bytes=2).at_end
    4294967296
    """
    if batch < 1 or prompt < 1 or new_tokens < 1:
        raise VramledgerError("generation: batch, prompt and new tokens must be positive (e.g. --new-tokens 8)")
    per_tok = kv_bytes_per_token(m, key_bytes=key_bytes or dtype_bytes, value_bytes=dtype_bytes) * batch
    S = prompt + new_tokens - 1
    sliding = m.sliding_layers if m.sliding_window else 0
    full = m.num_layers - sliding
    W = m.sliding_window
    if static:
        held = full * S + sliding * min(W, S)
        return CacheBytes(after_prefill=held * per_tok, at_end=held * per_tok, per_layer_step=0)
    end_sliding = prompt if new_tokens == 1 else min(S, W)
    return CacheBytes(
        after_prefill=m.num_layers * prompt * per_tok,
        at_end=(full * S + sliding * end_sliding) * per_tok,
        per_layer_step=(S if full else end_sliding) * per_tok,
    )


# -- one layer's forward without autograd ----------------------------------------------------------------------
def _eager(m: ModelSpec, train: TrainSpec) -> bool:
    # transformers' sdpa cannot softcap attention logits: Gemma 2 runs eager (see analytic/__init__ _warnings).
    from vramledger.analytic.activations import runs_eager

    return runs_eager(m, train)


def layer_working_set(m: ModelSpec, train: TrainSpec, *, batch: int, length: int, resid: int) -> tuple[int, int]:
    """(token-proportional bytes, length² bytes) live inside one decoder layer's forward under ``no_grad``.

    MLP (``LlamaMLP.forward``: ``down(act(gate(x)) * up(x))``): the residual input, the normed input, and act, up
    and their product at once: (s + c)·H + 3·c·I per token. Attention: the residual, the normed input, q/k/v and
    their RoPE outputs and the attention output: (s + c)·H + c·(3·Dq + 3·Dkv); eager adds ``repeat_kv`` copies
    (2·c·Dq) and, per sequence, the scores (c), their fp32 softmax (4) and its cast (c) at once: (2c + 4)·nh·L²
    (``eager_attention_forward``: ``softmax(attn_weights, dtype=float32).to(query.dtype)`` while the name still
    binds the scores). Padded SDPA (B > 1) turns the boolean mask into an additive one per call (c·L²).
    """
    c = train.precision.compute.bytes
    H, Dq, Dkv = m.hidden_size, m.q_dim, m.kv_dim
    I = m.moe_intermediate_size * m.experts_per_token if m.is_moe else m.intermediate_size
    mlp = (resid + c) * H + 3 * c * I
    attn = (resid + c) * H + c * (3 * Dq + 3 * Dkv)
    sq = 0
    if _eager(m, train):
        attn += 2 * c * Dq if m.num_kv_heads != m.num_heads else 0
        sq = (2 * c + 4) * m.num_heads * length * length * batch
    elif train.attn is Attention.SDPA and batch > 1:
        attn += 2 * c * Dq if repeat_kv_copies(m) else 0  # repeat_kv: no GQA kernel with a mask
        sq = c * length * (-(-length // 16) * 16) * batch
    tokens = batch * length
    if attn * tokens + sq > mlp * tokens:
        return attn * tokens, sq
    return mlp * tokens, 0


def mask_bytes(train: TrainSpec, *, batch: int, length: int) -> int:
    """The 4-D mask ``create_causal_mask`` builds once per forward for a padded batch (masking_utils): boolean for
    SDPA (1 byte), additive in the compute dtype for eager; none for flash-attention (it takes the 2-D mask)."""
    if train.attn is Attention.FLASH2 or batch == 1:
        return 0
    per = 1 if train.attn is Attention.SDPA else train.precision.compute.bytes
    return per * batch * length * length


# -- what the eval loop keeps ----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class EvalShape:
    """The eval loop's shapes, resolved from the TrainSpec."""

    batch: int
    length: int
    steps_kept: int
    """Eval batches whose logits/labels are on the GPU at the worst moment (k)."""
    kept_per_step: int
    """Bytes added to the kept containers per eval batch (logits or token ids, and labels)."""
    logits_kept_dtype: int
    """Bytes per element of the kept logits (4 under AMP: accelerate's convert_outputs_to_fp32)."""
    use_cache: bool
    warnings: tuple[str, ...] = ()


def eval_shape(m: ModelSpec, train: TrainSpec) -> EvalShape:
    B = train.eval_batch or train.micro_batch
    L = train.eval_seq_len or train.seq_len
    warnings: list[str] = []
    dt = 4 if train.precision.mixed else train.precision.compute.bytes
    labels = 8 * B * L  # int64 labels, kept with the predictions (evaluation_loop l. 3016-3019)
    if train.eval_logits is EvalLogits.FULL:
        per = dt * B * L * m.vocab_size + labels
    elif train.eval_logits is EvalLogits.ARGMAX:
        per = 8 * B * L + labels  # torch.argmax returns int64
    else:
        per = 0
    if per and train.loss is Loss.CHUNKED_NLL:
        # TRL's chunked forward returns logits=None: only the labels and three scalar metrics are kept.
        per = TRL_EVAL_METRICS + labels
        warnings.append(
            "eval: TRL's chunked_nll returns no logits in eval (logits=None): compute_metrics and "
            "preprocess_logits_for_metrics get only its scalar metrics; the labels are kept (" + SRC_TRL_EVAL + ")"
        )
    if train.predict_with_generate:
        # Seq2SeqTrainer.prediction_step returns the generated ids (padded to max_length) instead of logits.
        per = 8 * B * (L + max(train.generation_max_new_tokens, 1)) + labels
    k = 1
    if per:
        if train.eval_accumulation_steps is not None:
            k = train.eval_accumulation_steps
            if train.eval_steps_total:
                k = min(k, train.eval_steps_total)
        elif train.eval_steps_total:
            k = train.eval_steps_total
        else:
            warnings.append(
                "eval: without eval_accumulation_steps the Trainer keeps every eval batch's predictions on the GPU "
                f"until the end (+{fmt_bytes(per)} per batch); the number of eval batches is unknown, so one is "
                "counted: give it (eval_steps_total) or set eval_accumulation_steps"
            )
    return EvalShape(
        batch=B,
        length=L,
        steps_kept=k,
        kept_per_step=per,
        logits_kept_dtype=dt,
        use_cache=not train.grad_ckpt and train.loss is not Loss.CHUNKED_NLL,  # TRL: use_cache=False
        warnings=tuple(warnings),
    )


def eval_warnings(m: ModelSpec, train: TrainSpec) -> list[str]:
    """Notes for the ledger when an eval phase is modelled."""
    if train.eval_batch is None and not train.predict_with_generate:
        return []
    out = list(eval_shape(m, train).warnings)
    if train.predict_with_generate and train.generation_max_new_tokens < 1:
        out.append(
            "eval: predict_with_generate without max_new_tokens: generation counted for its prefill only; "
            "give --max-new-tokens N"
        )
    if eval_shape(m, train).use_cache:
        out.append(
            "eval: counted the KV cache the eval forward builds (config.use_cache, on unless the script turned it "
            "off; LLaMA-Factory turns it off with gradient checkpointing)"
        )
    return out


# -- the eval and generate moments -----------------------------------------------------------------------------
def eval_moments(m: ModelSpec, train: TrainSpec, p: StepParts) -> dict[Phase, Moment]:
    """The peak moments of Phase.EVAL (and Phase.GENERATE with ``predict_with_generate``) of the run whose training
    step is ``p``; empty when no evaluation is configured."""
    if not _evaluates(train):
        return {}
    sh = eval_shape(m, train)
    s = residual_bytes(train, p.weights)  # RoPE'd keys take the residual dtype (cos/sin are cast to it)
    out: dict[Phase, Moment] = {Phase.EVAL: _eval_moment(m, train, p, sh, s)}
    if train.predict_with_generate:
        out[Phase.GENERATE] = _generate_moment(m, train, p, sh, s)
    return out


def _evaluates(train: TrainSpec) -> bool:
    """Whether the run evaluates: an eval batch size, or generation during evaluation."""
    return train.eval_batch is not None or train.predict_with_generate


def _eval_base(p: StepParts, train: TrainSpec, sh: EvalShape, name: str, phase: Phase = Phase.EVAL) -> Moment:
    """What every eval or generate moment holds: the training run's persistent lines and the kept predictions."""
    kept_prev = (sh.steps_kept - 1) * sh.kept_per_step
    mo = Moment(name=name, phase=phase)
    # Weights and optimizer states stay; gradients are None (zero_grad(set_to_none=True)); autocast's cast
    # cache fills during the forward as in training (cached_cast keys on requires_grad, not on grad mode).
    add_persistent(mo, p, train, grads=0, autocast=True, states=True)
    if kept_prev:
        mo.add(
            Category.LOGITS_LOSS, f"predictions kept from {sh.steps_kept - 1} earlier eval batches", kept_prev, SRC_KEPT
        )
    return mo


MERGED = (
    "PEFT ParamWrapper (tuners/lora/layer.py _LoraFactorsProxy): every forward, no_grad too, merges each adapted "
    "expert stack (baddbmm(W, lhs, rhs)), cached for the layer's forward (analytic/activations.py merged_experts)"
)


def _eval_moment(m: ModelSpec, train: TrainSpec, p: StepParts, sh: EvalShape, s: int) -> Moment:
    """The eval forward's peak: at the loss, in the top decoder layer, or in the concatenation of kept predictions."""
    B, L = sh.batch, sh.length
    c = train.precision.compute.bytes
    # Eval forward (the loss needs labels: the standard loss, or Liger's fused one when no logits are kept; TRL's
    # chunked_nll whatever is kept: its forward takes the chunked path whenever labels are given).
    cache = 0
    if sh.use_cache:
        cache = kv_cache_bytes(m, batch=B, prompt=L, new_tokens=1, dtype_bytes=c, key_bytes=s).after_prefill
    mask = mask_bytes(train, batch=B, length=L)
    keeps = train.eval_logits is not EvalLogits.NONE or train.predict_with_generate
    loss = Loss.STANDARD if (train.loss is Loss.FUSED and keeps) else train.loss
    lg = logits_bytes(m, replace(train, micro_batch=B, seq_len=L, loss=loss), B * L)
    cands: list[Moment] = []

    def forward_common(mo: Moment) -> None:
        mo.add(
            Category.KV_CACHE,
            f"cache of the eval forward ({B}×{L} tokens, every layer)",
            cache,
            "modeling_llama.py l. 372 DynamicCache(config) when config.use_cache; " + SRC_CACHE,
        )
        mo.add(
            Category.ATTENTION_SCORES,
            "4-D attention mask of the padded eval batch",
            mask,
            "masking_utils create_causal_mask: B·L² (bool for sdpa, compute dtype for eager)",
        )

    a = _eval_base(p, train, sh, f"eval loss (batch {B} × {L} tokens, no autograd)")
    forward_common(a)
    a.add(Category.ACTIVATIONS, "last hidden state", s * m.hidden_size * B * L, "LlamaForCausalLM.forward")
    a.add(
        Category.LOGITS_LOSS,
        "eval loss: one chunk's logits at a time (TRL chunked_nll)"
        if train.loss is Loss.CHUNKED_NLL
        else "eval logits, fp32 copy, log-softmax",
        lg.forward_peak,
        f"{TRAINER} prediction_step l. 3239-3268 (no_grad) + analytic/logits.py ({lg.source})",
    )
    cands.append(a)

    tok, sq = layer_working_set(m, train, batch=B, length=L, resid=s)
    b = _eval_base(p, train, sh, "top decoder layer of the eval forward (no autograd)")
    forward_common(b)
    b.add(
        Category.TEMPORARIES,
        "one layer's working set",
        tok,
        "no_grad forward of one layer: (s+c)·H + max(3·c·I MLP, c·(3·Dq+3·Dkv) attention) per token",
    )
    b.add(
        Category.ATTENTION_SCORES,
        "scores, fp32 softmax and its cast (one layer)" if _eager(m, train) else "additive mask of one sdpa call",
        sq,
        "eager_attention_forward: (2c+4)·nh·L² per sequence; sdpa: torch convert_boolean_attn_mask c·L²",
    )
    merged = merged_experts(m, train, p.weights).one_layer
    b.add(Category.TEMPORARIES, "merged expert weights (one layer)", merged, MERGED)
    cands.append(b)

    if sh.kept_per_step and sh.steps_kept > 1:
        cc = _eval_base(p, train, sh, f"torch.cat of the kept predictions (eval batch {sh.steps_kept})")
        cc.add(
            Category.LOGITS_LOSS,
            "this batch's predictions and the concatenation",
            sh.kept_per_step * (1 + sh.steps_kept),
            SRC_CONCAT,
        )
        cands.append(cc)
    return max(cands, key=lambda mo: mo.total)


def _generate_moment(m: ModelSpec, train: TrainSpec, p: StepParts, sh: EvalShape, s: int) -> Moment:
    """``predict_with_generate``'s peak: the prefill's top layer, or the last decode step."""
    B, L = sh.batch, sh.length
    c = train.precision.compute.bytes
    tok, sq = layer_working_set(m, train, batch=B, length=L, resid=s)
    N = max(train.generation_max_new_tokens, 1)  # unknown: the prefill only (eval_warnings says so)
    kv = kv_cache_bytes(m, batch=B, prompt=L, new_tokens=N, dtype_bytes=c, key_bytes=s)
    pre = _eval_base(p, train, sh, f"generate: prefill of {B}×{L} prompt tokens (top layer)", Phase.GENERATE)
    kind = train.generation_cache  # analytic/kv_cache.py: what each cache kind holds during a decode step
    pre.add(Category.KV_CACHE, f"KV cache after the prefill ({kind.display})", kv.after_prefill, SRC_CACHE)
    pre.add(
        Category.ATTENTION_SCORES,
        "4-D mask of the left-padded prompts",
        mask_bytes(train, batch=B, length=L),
        "masking_utils create_causal_mask",
    )
    pre.add(Category.TEMPORARIES, "one layer's working set", tok, "as the eval forward, at the prompt length")
    pre.add(Category.ATTENTION_SCORES, "one layer's length² tensors", sq, "as the eval forward")
    merged = merged_experts(m, train, p.weights).one_layer
    pre.add(Category.TEMPORARIES, "merged expert weights (one layer)", merged, MERGED)
    end = _eval_base(p, train, sh, f"generate: last of {N} decode steps", Phase.GENERATE)
    end.add(Category.KV_CACHE, f"KV cache of {L}+{N}-1 tokens ({kind.display})", kv.at_end, SRC_CACHE)
    end.add(
        Category.TEMPORARIES,
        "the previous step's cache tuple" if kind is CacheKind.LEGACY else "one layer's K/V being re-concatenated",
        decode_step_extra(kind, at_end=kv.at_end, per_layer_step=kv.per_layer_step, new_tokens=N, cached=L + N - 1),
        SRC_LEGACY
        if kind is CacheKind.LEGACY
        else "DynamicLayer.update: torch.cat([keys, new]) holds the old and the new tensor",
    )
    end.add(Category.TEMPORARIES, "merged expert weights (one layer)", merged, MERGED)
    end.add(
        Category.LOGITS_LOSS,
        "last-token logits (compute dtype and fp32 copy)",
        (c + 4) * B * m.vocab_size,
        "generation/utils.py l. 2954 logits_to_keep=1, l. 3247 .to(float32)",
    )
    return max((pre, end), key=lambda mo: mo.total)


# -- the verdict's sentence when evaluation is the peak --------------------------------------------------------
def _eval_peak(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    return max((mo.total for mo in eval_moments(m, train, p).values()), default=0)


def eval_advice(ledger: Ledger, m: ModelSpec, train: TrainSpec, p: StepParts) -> str | None:
    """One sentence when evaluation (or generation) is the peak of the run: what it costs against training and the
    one change that brings it back under training's peak; None when training is the peak.

    ``p``: the training step's parts; the variants tried change only evaluation settings, which ``StepParts``
    does not depend on."""
    if not _evaluates(train):  # no evaluation moment: no peak to find
        return None
    peak = ledger.peak_phase
    if peak not in (Phase.EVAL, Phase.GENERATE):
        return None
    training = max((ledger.device(ph) for ph in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)), default=0)
    train_alloc = max((ledger.allocated(ph) for ph in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)), default=0)
    by_cat = {
        i.category: ledger.bytes_of(i.category, peak)
        for i in ledger.items
        if i.phase is peak and i.category.allocated and i.category not in (Category.WEIGHTS, Category.OPTIMIZER_STATE)
    }
    biggest = max(by_cat, key=lambda k: by_cat[k])
    what = "evaluation" if peak is Phase.EVAL else "generation during evaluation (predict_with_generate)"
    head = (
        f"Evaluation is the peak: {what} needs {fmt_bytes(ledger.device(peak))} against training's "
        f"{fmt_bytes(training)}; its biggest line is {biggest.display} ({fmt_bytes(by_cat[biggest])})"
    )

    sh = eval_shape(m, train)
    tries: list[tuple[str, TrainSpec]] = []
    if sh.kept_per_step and sh.steps_kept > 1:
        tries.append(
            (
                "eval_accumulation_steps 1 (kept predictions go to the CPU after every eval batch)",
                replace(train, eval_accumulation_steps=1),
            )
        )
    if train.eval_logits is EvalLogits.FULL and not train.predict_with_generate:
        tries.append(
            (
                "preprocess_logits_for_metrics returning argmax ids (LLaMA-Factory compute_accuracy does)",
                replace(train, eval_logits=EvalLogits.ARGMAX),
            )
        )
    for b in range(sh.batch - 1, 0, -1):
        t = replace(train, eval_batch=b)
        if _eval_peak(m, t, p) <= train_alloc:
            tries.append((f"per_device_eval_batch_size {b} (--eval-batch {b})", t))
            break
    if train.predict_with_generate and train.generation_max_new_tokens > 1:
        n = train.generation_max_new_tokens // 2
        tries.append((f"fewer generated tokens (max_new_tokens {n})", replace(train, generation_max_new_tokens=n)))
    for text, t in tries:
        after = _eval_peak(m, t, p)
        if after <= train_alloc:
            return f"{head}; {text} brings it to {fmt_bytes(after)} allocated, under training's peak."
    # Nothing alone is enough: combine the smallest settings.
    t = replace(train, eval_batch=1, eval_accumulation_steps=1 if sh.kept_per_step else train.eval_accumulation_steps)
    return (
        f"{head}; even per_device_eval_batch_size 1 with eval_accumulation_steps 1 needs "
        f"{fmt_bytes(_eval_peak(m, t, p))} allocated: shorten the eval length (--eval-seq) or the generation."
    )
