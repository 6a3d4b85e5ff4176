"""Compose the components into the ledger of one steady-state training step.

The step modelled is the HF Trainer's (and LLaMA-Factory's, TRL's): ``model(**batch)`` with labels under
autocast for AMP, ``compute_loss`` returning only the loss, ``accelerator.backward(loss)``, ``optimizer.step()``,
``zero_grad(set_to_none=True)``. We model step ≥ 2: optimizer states exist from the first step on (they are
created inside it), so they are live through forward and backward of every later step — the true peak.

Each phase's peak is the largest of a few candidate moments (named in ``moments``):
- forward: inside the loss (logits, fp32 copy, log-softmax) with every layer's saved activations;
- backward: the log-softmax backward (12·V·T), lm_head's backward, the top layer's MLP backward (with its
  recompute under checkpointing), its eager attention's softmax backward (the MLP's saved tensors freed, the
  length² gradients live), or the end (every gradient allocated);
- optimizer: weights + gradients + states + the step's temporaries.
Gradients are absent in forward unless gradient accumulation keeps them across micro-steps.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import NamedTuple

from vramledger.analytic.activations import (
    _INPUT_OF,
    checkpoint_input_bytes_per_token,
    checkpoint_reused_bytes_per_token,
    computes_scores,
    dora_transient_bytes,
    explicit_mask,
    final_hidden_live_bytes_per_token,
    final_norm_bytes_per_token,
    first_layer_unsaved_bytes_per_token,
    head_input_bytes_per_token,
    layer_activations,
    merged_experts,
    residual_bytes,
    rope_bytes_per_token,
    runs_eager,
    softmax_backward_freed_bytes_per_token,
)
from vramledger.analytic.distributed import (
    LAYER_GRADIENT_NAME,
    PRE_FORWARD_NAME,
    FlattenMoment,
    add_buffers,
    engine_dtypes,
    fsdp2_pending_root_shard,
    holds_grads_into_forward,
    layer_gradient_lines,
    nccl_lines,
    rank_step_parts,
    root_flatten,
)
from vramledger.analytic.distributed.ddp_reserve import ddp_peak_reserved
from vramledger.analytic.distributed.stream_pools import RESERVE_LABEL, ReserveLine, pooled_phase_reserves
from vramledger.analytic.evaluation import eval_moments
from vramledger.analytic.litgpt import litgpt_layer_extra_bytes_per_token, litgpt_layer_extra_scores_per_seq
from vramledger.analytic.litgpt_loop import convert_output_moment
from vramledger.analytic.litgpt_qlora import dequant_transient_bytes, next_forward_moment
from vramledger.analytic.load import SOURCES as LOAD_SOURCES
from vramledger.analytic.load import load_transient_bytes
from vramledger.analytic.logits import litgpt_kept_logits_bytes, logits_bytes
from vramledger.analytic.loop import offloaded_layers, optimizer_in_backward
from vramledger.analytic.optimizer import optimizer_bytes
from vramledger.analytic.overhead import (
    CONTEXT_SOURCE,
    cublas_workspace_bytes,
    cuda_context_bytes,
)
from vramledger.analytic.paged import split_paged_states
from vramledger.analytic.params import layer_linears
from vramledger.analytic.parts import (
    SOURCES,
    TIED_SUM,
    Moment,
    StepParts,
    add_activations,
    add_persistent,
    embedding_gradient_before_accumulation,
    tied_gradient_sum,
)
from vramledger.analytic.reserve import phase_reserves, training_peaks
from vramledger.analytic.weights import WeightBudget, weight_budget
from vramledger.ledger import Basis, Category, LineItem, Phase
from vramledger.specs import DType, GPUSpec, Loss, Method, ModelSpec, TrainSpec


@lru_cache(maxsize=4096)
def step_parts(m: ModelSpec, train: TrainSpec, gpu: GPUSpec | None = None) -> StepParts:
    """The sizes every moment of the step is assembled from: the persistent lines (weights, gradients, optimizer
    states, autocast copies), the saved activations, the loss's tensors and each phase's transients."""
    if train.distributed:  # rank 0 of a data-parallel run: analytic/distributed/core.py
        return rank_step_parts(m, train, gpu, single=step_parts)
    wb = weight_budget(m, train)
    c = train.precision.compute.bytes
    saved = _saved_activations(m, train, wb)
    lg = logits_bytes(m, train, train.tokens)
    head_logits, head_saved = _head_input(m, train, wb)
    opt = optimizer_bytes(m, train, wb)
    states, step_temp = opt.states, opt.step_temporaries
    casts = _autocast_casts(m, train, wb)
    paged_states, states = split_paged_states(m, train, wb, states, opt.paged)  # analytic/paged.py
    # Each gradient in its parameter's dtype; one at a time under optimizer-in-backward (analytic/loop.py).
    grads, step_temp = optimizer_in_backward(train, wb, wb.trainable_bytes, step_temp)
    return StepParts(
        weights=wb,
        frozen_bytes=wb.frozen_bytes,
        trainable_bytes=wb.trainable_bytes,
        master_bytes=0,
        grad_bytes=grads,
        autocast_copy_bytes=casts.forward_end,
        recompute_cast_bytes=casts.recompute,
        state_bytes=states,
        paged_state_bytes=paged_states,
        step_temp_bytes=step_temp,
        saved_layers_bytes=saved.layers,
        layer_bytes=saved.layer,
        recompute_bytes=saved.recompute,
        scores_bytes=saved.scores,
        layer_scores_bytes=saved.layer_scores,
        extra_saved_bytes=saved.extra + head_saved,
        rope_saved_bytes=rope_bytes_per_token(m, train, wb) * train.tokens if saved.extra else 0,
        logits_forward=lg.forward_peak + head_logits,
        logits_saved=lg.saved + head_logits,
        logits_backward=lg.backward_peak + head_logits,
        logits_head=lg.head_grad_moment + head_logits,
        kept_logits_bytes=litgpt_kept_logits_bytes(m, train),
        final_hidden_bytes=final_hidden_live_bytes_per_token(m, train, wb) * train.tokens,
        head_cast_bytes=casts.head,
        layer_backward_temp=_layer_backward_temp(m, train, wb),
        softmax_backward_temp=_softmax_backward_temp(m, train, wb),
        softmax_backward_freed=softmax_backward_freed_bytes_per_token(m, train, wb) * train.tokens,
        dora_temp=dora_transient_bytes(train, wb),
        forward_layer_temp=dora_transient_bytes(train, wb) + _eager_scores_bytes(m, train, wb, c),
        dequant_temp=(  # analytic/litgpt_qlora.py: an fp16 copy and its cast under Lightning
            dequant_transient_bytes(
                wb.largest_frozen_matrix_numel, train.precision.compute, train.model_code, train.quant.compute_dtype
            )
            if train.quant is not None
            else 0
        ),
        workspace_bytes=cublas_workspace_bytes(gpu),
        optimizer_source=opt.source,
        logits_source=lg.source,
    )


class _Saved(NamedTuple):
    """What the trained layers save for backward, in bytes (the ``StepParts`` fields of the same names)."""

    layers: int
    layer: int
    recompute: int
    scores: int
    layer_scores: int
    extra: int


def _saved_activations(m: ModelSpec, train: TrainSpec, wb: WeightBudget) -> _Saved:
    """Every trained layer's saved activations, or under checkpointing their inputs (and eager's masks), with one
    layer's figures for the recompute; the final norm and RoPE tables once per model."""
    T, B, L = train.tokens, train.micro_batch, train.seq_len
    n_tl = wb.trainable_layers
    n_kept = offloaded_layers(train, n_tl)  # analytic/loop.py: activation offloading keeps two layers' worth
    la = layer_activations(m, train, wb)
    # analytic/litgpt.py; PEFT ParamWrapper's merged expert weights in a layer holding them (activations.py)
    layer = (la.per_token + litgpt_layer_extra_bytes_per_token(m, train, wb)) * T + la.merged_bytes
    merged = merged_experts(m, train, wb)
    kept_merged = merged.all_layers * n_kept // n_tl if n_tl else 0
    layer_scores = (la.scores_per_seq + litgpt_layer_extra_scores_per_seq(m, train)) * B
    extra = (final_norm_bytes_per_token(m, train, wb) + rope_bytes_per_token(m, train, wb)) * T if n_tl else 0
    if not train.grad_ckpt:
        unsaved = first_layer_unsaved_bytes_per_token(m, train, wb) * T if n_tl else 0
        return _Saved(
            layers=n_kept * (layer - la.merged_bytes) + kept_merged - unsaved,
            layer=layer,
            recompute=0,
            scores=n_tl * layer_scores,
            layer_scores=layer_scores,
            extra=extra,
        )
    masks = 0
    if runs_eager(m, train) and n_tl:
        # The checkpoint keeps its inputs, among them the additive causal mask(s) eager attention gets
        # (transformers masking_utils eager_mask, in the dtype of the input embeddings: s·B·L² each; a second one
        # for sliding-window layers).
        masks = residual_bytes(train, wb) * B * L * L * (2 if m.sliding_layers else 1)
    elif explicit_mask(m, train) and n_tl and not train.model_code.litgpt:
        # and SDPA's boolean 4-D mask of a padded batch (masking_utils sdpa_mask: B·L² bytes, one per mask kind),
        # the same tensor for every layer: held once, until the first layer's recompute in backward
        masks = B * L * L * (2 if m.sliding_layers else 1)
    return _Saved(
        layers=n_kept * checkpoint_input_bytes_per_token(m, train, wb) * T,
        layer=layer,
        recompute=layer - checkpoint_reused_bytes_per_token(m, train, wb) * T if n_tl else 0,
        scores=masks,
        layer_scores=layer_scores,
        extra=extra,
    )


def _head_input(m: ModelSpec, train: TrainSpec, wb: WeightBudget) -> tuple[int, int]:
    """lm_head's saved input as (bytes filed with the logits, bytes filed with the activations): under AMP
    lm_head saves its own bf16 cast (the trace files it with the logits); in pure precision it saves the final
    norm's output itself, an activation."""
    if train.loss is Loss.CHUNKED_NLL:  # TRL calls no lm_head: each chunk's matmul is checkpointed (logits.py)
        return (0, 0)
    head_input = head_input_bytes_per_token(m, train, wb) * train.tokens
    return (head_input, 0) if train.precision.mixed else (0, head_input)


class _Casts(NamedTuple):
    """Autocast's low-precision weight copies alive at the moments of the step (the ``StepParts`` fields)."""

    forward_end: int
    """``autocast_copy_bytes``: alive when forward ends, in the loss."""
    head: int
    """``head_cast_bytes``: lm_head's cast, part of ``forward_end``, freed by lm_head's backward."""
    recompute: int
    """``recompute_cast_bytes``: made again by one checkpointed layer's recompute in backward."""


# torch autocast_mode.cpp ``cached_cast``: a floating argument of a lower-precision op (linear, matmul) is cast to
# the autocast dtype; only leaves that require grad (trainable fp32 weights) are cached, until the outermost autocast
# exits (autocast_mode.py ``__exit__``: ``clear_autocast_cache``). Every other cast, a frozen fp32 weight's among
# them, is made at each use and lives as long as autograd keeps it: ``mm`` saves its weight for the input's gradient
# only when the input requires grad (derivatives.yaml ``mm``: ``mat2`` saved for ``self``'s gradient). Embedding
# lookups are on none of autocast's lists: an fp32 embedding is read as it is, never cast.
# Under checkpointing a decoder layer's forward keeps no saved tensor (torch/utils/checkpoint.py: non-reentrant
# ``_checkpoint_hook.pack_hook`` returns an empty ``_Holder``; reentrant ``CheckpointFunction.forward`` runs under
# ``torch.no_grad()``), so its casts die after their matmul; backward's recompute runs under the forward's autocast
# state (``recompute_fn`` / ``CheckpointFunction.backward``: ``torch.amp.autocast(**device_autocast_kwargs)``) and
# saves one layer's casts again until that layer's backward has used them. lm_head is outside the checkpoints.
def _autocast_casts(m: ModelSpec, train: TrainSpec, wb: WeightBudget) -> _Casts:
    """The bf16/fp16 weight copies autocast makes: the trainable fp32 matrices' cached copies, and with a frozen base
    loaded in fp32 (``base_dtype``) the casts autograd saves of the frozen matrices (traced: trace/build.py)."""
    if not train.precision.mixed:
        return _Casts(0, 0, 0)
    c = train.precision.compute.bytes
    fp32_trainable = wb.trainable_dtype.bytes == 4
    cached = wb.trainable_matrix_params * c if fp32_trainable else 0
    if cached and wb.head_trainable and train.loss is Loss.CHUNKED_NLL:
        cached -= wb.lm_head_weight_numel * c  # TRL casts w.float().t(), a view: never cached (logits.py)
    layer_cached = sum(a.params for a in wb.adapted) * c if fp32_trainable else 0
    frozen_fp32 = train.quant is None and train.frozen_dtype is DType.FP32
    # A frozen lm_head's cast is saved when its input needs a gradient: when anything trains below it; one per call
    # of lm_head (a trainable head's copy is cached, one for every call).
    # TRL's chunked_nll makes it per checkpointed chunk, counted with the logits (logits.py).
    head_frozen = (
        frozen_fp32
        and not wb.head_trainable
        and (wb.trainable_layers > 0 or wb.embedding_trainable)
        and train.loss is not Loss.CHUNKED_NLL
    )
    head = m.vocab_size * m.hidden_size * c if (head_frozen or (wb.head_trainable and fp32_trainable)) else 0
    if head_frozen:
        head *= _head_calls(train)
    frozen_head = head if head_frozen else 0
    # The frozen matrices inside the trained layers (method freeze trains whole layers: its frozen matrices lie
    # below them, where no input needs a gradient).
    decoder = 0
    if frozen_fp32 and train.method is not Method.FREEZE:
        decoder = max(wb.frozen_matrix_params - wb.lm_head_weight_numel, 0)
    if train.grad_ckpt:
        layer = -(-decoder // wb.trainable_layers) if wb.trainable_layers else 0
        return _Casts(cached + frozen_head, head, layer * c + layer_cached)
    saved = decoder - _first_layer_uncast(m, train, wb) if decoder else 0
    return _Casts(cached + saved * c + frozen_head, head, 0)


def _head_calls(train: TrainSpec) -> int:
    """Calls of lm_head in one forward. LitGPT's finetune/lora.py runs ``model(input_ids, lm_head_chunk_size=128)``
    and ``GPT.forward`` returns ``[self.lm_head(x_i) for x_i in x.split(lm_head_chunk_size, dim=1)]`` (lit-gpt
    8641822 and litgpt 43c44323 ``model.py``): one call per chunk of positions (finetune/full.py: one call)."""
    if train.loss is Loss.CHUNKED and train.model_code.litgpt and train.method is not Method.FULL:
        return -(-train.seq_len // max(1, train.loss_chunk_tokens))
    return 1


_GROUPS = ("attn_in", "attn_out", "mlp_in", "mlp_out")
"""The inputs of a decoder layer's linears, in the order the layer reads them (activations.py ``_INPUT_OF``)."""


def _first_layer_uncast(m: ModelSpec, train: TrainSpec, wb: WeightBudget) -> int:
    """Frozen weight elements of the first decoder layer whose casts autograd does not save because their input needs
    no gradient. With a frozen embedding the hidden states entering layer 0 carry none (without checkpointing; under
    it transformers calls ``enable_input_require_grads``) until an adapter's output joins them: q/k/v read such a
    tensor, o_proj too unless q/k/v are adapted, and so on down the layer."""
    if wb.embedding_trainable or wb.norms_trainable or train.grad_ckpt or not wb.trainable_layers:
        return 0
    linears = [lin for lin in layer_linears(m) if not lin.layers]
    if any(name not in _INPUT_OF for name in {lin.name for lin in linears} | {a.linear.name for a in wb.adapted}):
        return 0  # a layout whose data flow we do not know: every cast counted as saved
    # Another PEFT method (no LoRA linears listed): its trained weights are taken to reach the attention's output.
    adapted = {_INPUT_OF[a.linear.name] for a in wb.adapted} if wb.adapted else {"attn_in"}
    unsaved = 0
    for group in _GROUPS:
        unsaved += sum(
            lin.per_layer * lin.in_features * lin.out_features for lin in linears if _INPUT_OF[lin.name] == group
        )
        if group in adapted:  # the group's output, and so every later input, needs a gradient
            break
    return unsaved


def _eager_scores_bytes(m: ModelSpec, train: TrainSpec, wb: WeightBudget, per_element: int) -> int:
    """One trained layer's eager attention scores, ``per_element`` bytes each: nh·L² per sequence."""
    if not computes_scores(m, train) or not wb.trainable_layers:
        return 0
    return per_element * m.num_heads * train.seq_len * train.seq_len * train.micro_batch


def _hidden_state_grads(m: ModelSpec, train: TrainSpec, wb: WeightBudget) -> int:
    """Inside one layer's backward: the gradients of its input and output hidden states, 2·s·H·T."""
    return 2 * residual_bytes(train, wb) * m.hidden_size * train.tokens if wb.trainable_layers else 0


def _layer_backward_temp(m: ModelSpec, train: TrainSpec, wb: WeightBudget) -> int:
    """The MLP's backward in one layer: the hidden states' gradients and the MLP intermediates' (3·c·I·T)."""
    if not wb.trainable_layers:
        return 0
    c = train.precision.compute.bytes
    I = m.moe_intermediate_size * m.experts_per_token if m.is_moe else m.intermediate_size  # noqa: E741
    # the gradients of PEFT ParamWrapper's merged expert weights, made whole one at a time (activations.py)
    return _hidden_state_grads(m, train, wb) + 3 * c * I * train.tokens + merged_experts(m, train, wb).backward_extra


def _softmax_backward_temp(m: ModelSpec, train: TrainSpec, wb: WeightBudget) -> int:
    """Eager attention's softmax backward in one layer, after the MLP's (whose gradients are freed by then): the
    hidden states' gradients and (c+4)·nh·L² per sequence of length² gradients; 0 without eager attention."""
    scores = _eager_scores_bytes(m, train, wb, train.precision.compute.bytes + 4)
    return _hidden_state_grads(m, train, wb) + scores if scores else 0


def moments(m: ModelSpec, train: TrainSpec, gpu: GPUSpec | None = None) -> dict[Phase, Moment]:
    """The peak moment of each phase, as lines by category."""
    return _peaks(phase_moments(m, train, gpu))


def _peaks(every: dict[Phase, tuple[Moment, ...]]) -> dict[Phase, Moment]:
    """The largest of each phase's moments."""
    return {ph: max(mos, key=lambda mo: mo.total) for ph, mos in every.items()}


def phase_moments(m: ModelSpec, train: TrainSpec, gpu: GPUSpec | None = None) -> dict[Phase, tuple[Moment, ...]]:
    """Every moment modelled in each phase (the peak is the largest; ``moments``): FSDP's default stream peaks at
    the moment that holds the most outside its side streams' pools, which need not be the phase's peak
    (distributed/stream_pools.py ``pooled_phase_reserves``)."""
    p = step_parts(m, train, gpu)
    backward = (
        _loss_backward(train, p),
        _top_layer_backward(train, p),
        *_bottom_layer_backward(m, train, p),
        *_softmax_backward(train, p),
        *_layer_gradient(m, train, p),
        *_end_of_backward(m, train, p),
    )
    for mo in backward:  # the engine's buffers before the choice: some live only at the end of backward
        add_buffers(mo, Phase.BACKWARD, p.buffers)
    forward = _forward_moments(m, train, p)
    for mo in forward:
        add_buffers(mo, Phase.FORWARD, p.buffers)
    if holds_grads_into_forward(train):
        forward = (*forward, _before_forward(train, p))
    out = {
        Phase.LOAD: (_load_moment(m, train, p),),
        Phase.FORWARD: forward,
        Phase.BACKWARD: backward,
        Phase.OPTIMIZER: (_optimizer_moment(train, p),),
    }
    for phase in (Phase.LOAD, Phase.OPTIMIZER):
        add_buffers(out[phase][0], phase, p.buffers)
    out.update({ph: (mo,) for ph, mo in eval_moments(m, train, p).items()})
    return out


def _previous_grads(train: TrainSpec, p: StepParts) -> int:
    """Gradients alive before backward: those gradient accumulation keeps across micro-steps."""
    return p.grad_bytes if train.grad_accum > 1 else 0


def _load_moment(m: ModelSpec, train: TrainSpec, p: StepParts) -> Moment:
    """The weights on the GPU before the first step, with the transient of quantising one of them."""
    load = Moment(name="weights loaded, before the first step", phase=Phase.LOAD)
    if p.frozen_bytes:
        load.add(Category.WEIGHTS, "frozen base", p.frozen_bytes, SOURCES["weights"])
    if p.trainable_bytes:
        load.add(Category.WEIGHTS, "trainable", p.trainable_bytes, SOURCES["weights"])
    load.add(
        Category.TEMPORARIES,
        "quantising the largest weight on the GPU",  # analytic/load.py: per framework
        load_transient_bytes(m, train, p.weights),
        LOAD_SOURCES[train.load_path],
    )
    return load


def _forward_moments(m: ModelSpec, train: TrainSpec, p: StepParts) -> tuple[Moment, ...]:
    """Forward's moments, the largest its peak: the loss (with everything saved so far) and the inside of the last
    decoder layer (and, for LitGPT's QLoRA, lm_head beside the previous micro-step's graph:
    analytic/litgpt_qlora.py)."""
    grads_prev = _previous_grads(train, p)
    fwd = Moment(name="cross-entropy in the loss (logits, their fp32 copy and log-softmax live)", phase=Phase.FORWARD)
    add_persistent(fwd, p, train, grads=grads_prev, autocast=True, states=True)
    add_activations(fwd, p, train)
    fwd.add(Category.LOGITS_LOSS, "logits, fp32 copy, log-softmax", p.logits_forward, p.logits_source)
    fwd.add(
        Category.TEMPORARIES,
        "final hidden state (model output, alive during the loss)",
        p.final_hidden_bytes,
        "transformers CausalLM forward computes the loss while BaseModelOutputWithPast.last_hidden_state lives",
    )
    fwd_layer = Moment(name="inside the last decoder layer's forward", phase=Phase.FORWARD)
    add_persistent(fwd_layer, p, train, grads=grads_prev, autocast=False, states=True)
    _add_casts(fwd_layer, p.autocast_copy_bytes - p.head_cast_bytes, "bf16 copies made by autocast (lm_head's not yet)")
    add_activations(fwd_layer, p, train)
    fwd_layer.add(
        Category.TEMPORARIES,
        "transients of one layer",
        p.forward_layer_temp + p.dequant_temp,
        "eager pre-softmax scores c·nh·L² per sequence; DoRA weight norm (in² + 4·in·out fp32); "
        "QLoRA dequantised weight",
    )
    litgpt = (
        next_forward_moment(m, train, p, grads=grads_prev),
        convert_output_moment(m, train, p, grads=grads_prev),  # analytic/litgpt_loop.py
    )
    return (fwd, fwd_layer, *(mo for mo in litgpt if mo))


def _before_forward(train: TrainSpec, p: StepParts) -> Moment:
    """The next step's batch moved to the GPU while FSDP1 still holds the previous step's gradients
    (analytic/distributed/fsdp_root_flatten.py ``holds_grads_into_forward``): what the optimizer step leaves, and the
    engine's buffers that outlive it."""
    mo = Moment(name=PRE_FORWARD_NAME, phase=Phase.FORWARD)
    add_persistent(mo, p, train, grads=p.grad_bytes, autocast=False, states=True)
    add_buffers(mo, Phase.OPTIMIZER, p.buffers)
    return mo


def _add_casts(mo: Moment, n: int, label: str) -> None:
    mo.add(Category.WEIGHTS, label, n, SOURCES["autocast"])


def _add_backward_persistent(
    mo: Moment, p: StepParts, train: TrainSpec, *, grads: int, top_layer: bool = False
) -> None:
    """What lives through backward, with the autocast copies still saved: in the loss's backward every one saved in
    forward (under checkpointing only lm_head's, outside the checkpoints); in the top layer's backward lm_head's
    is gone, and under checkpointing the top layer's recompute has made that layer's again."""
    add_persistent(mo, p, train, grads=grads, autocast=False, states=True)
    if not top_layer and train.grad_ckpt:
        _add_casts(mo, p.head_cast_bytes, "lm_head's bf16 cast (outside checkpointing)")
    elif not top_layer:
        _add_casts(mo, p.autocast_copy_bytes, "bf16 copies made by autocast")
    elif train.grad_ckpt:
        _add_casts(mo, p.recompute_cast_bytes, "one layer's bf16 weight casts (recomputed)")
    else:
        _add_casts(mo, p.autocast_copy_bytes - p.head_cast_bytes, "bf16 copies made by autocast (lm_head's freed)")


def _loss_backward(train: TrainSpec, p: StepParts) -> Moment:
    """The log-softmax backward: every saved activation and the loss's fp32 gradients."""
    mo = Moment(name="log-softmax backward (_log_softmax_backward_data)", phase=Phase.BACKWARD)
    _add_backward_persistent(mo, p, train, grads=_previous_grads(train, p))
    add_activations(mo, p, train)
    mo.add(Category.LOGITS_LOSS, "log-softmax output and two fp32 gradients", p.logits_backward, p.logits_source)
    return mo


def _top_layer_backward(train: TrainSpec, p: StepParts) -> Moment:
    """The top decoder layer's MLP backward (after its recompute under checkpointing), lm_head's gradient made: the
    layer's whole saved set is alive with its MLP's gradients."""
    mo = _top_layer_moment(
        "backward of the top decoder layer" + (" (recomputed)" if train.grad_ckpt else ""), train, p, freed=0
    )
    if train.grad_ckpt:
        # Stands for DoRA's transients in the MLP's backward too (traced: the peak of a small LoRA/DoRA model is in
        # down_proj's DoRA backward; by the softmax's backward o_proj's is done and q/k/v's not begun).
        mo.add(
            Category.TEMPORARIES,
            "DoRA weight norm in the recomputed forward",
            p.dora_temp,
            "PEFT DoraLinearLayer.get_weight_norm, in² + 4·in·out fp32 (recomputed under checkpointing)",
        )
    mo.add(
        Category.TEMPORARIES,
        "gradients of hidden states and MLP intermediates",
        p.layer_backward_temp,
        "one layer's backward: grad in/out (2·s·H·T) + 3·c·I·T MLP gradients",
    )
    return mo


def _bottom_layer_backward(m: ModelSpec, train: TrainSpec, p: StepParts) -> tuple[Moment, ...]:
    """The backward of the lowest trained layer with experts, where PEFT's ParamWrapper adapts them (activations.py
    ``merged_experts``): the autograd engine runs the layers top-down, so the layers above have their gradients
    by then, beside the layer's saved set (recomputed under checkpointing) with its merged expert weights and their
    gradients made whole. Their adapters are large (Qwen3-30B-A3B, r 8: 498 M trainable parameters, 2.0 GB of
    fp32 gradients), so this moment, not the top layer's, is the backward's peak: the trace of a 2-layer
    Qwen3-30B-A3B under checkpointing peaks in layer 0's ``_grouped_mm`` backward with layer 1's gradients. Where no
    merged weights are made the moment is the top layer's plus the other layers' adapter gradients, a few MB,
    and is not added (not checked against the traces there)."""
    n = p.weights.trainable_layers
    merged = merged_experts(m, train, p.weights)
    if n < 2 or not merged.one_layer:
        return ()
    name = "backward of the bottom trained layer" + (" (recomputed)" if train.grad_ckpt else "")
    mo = Moment(name=name, phase=Phase.BACKWARD)
    # the lowest layer with experts (DeepSeek's first layers are dense): the expert layers above it are done
    k = merged.all_layers // merged.one_layer
    grads = max(_previous_grads(train, p), p.grad_bytes * (k - 1) // k)
    _add_backward_persistent(mo, p, train, grads=grads, top_layer=True)
    if train.grad_ckpt:
        mo.add(Category.ACTIVATIONS, "its checkpointed input", p.saved_layers_bytes // n, SOURCES["ckpt"])
        mo.add(Category.ACTIVATIONS, "the layer recomputed", p.recompute_bytes, SOURCES["acts"])
    else:
        mo.add(Category.ACTIVATIONS, "saved by the bottom layer", p.layer_bytes, SOURCES["acts"])
    mo.add(Category.ACTIVATIONS, "RoPE tables", p.rope_saved_bytes, SOURCES["acts"])
    mo.add(
        Category.TEMPORARIES,
        "gradients of hidden states, MLP intermediates and the merged expert weights",
        p.layer_backward_temp,
        "one layer's backward: grad in/out (2·s·H·T) + 3·c·I·T MLP gradients + PEFT ParamWrapper's merged weights' "
        "gradients, one at a time (analytic/activations.py merged_experts)",
    )
    return (mo,)


def _softmax_backward(train: TrainSpec, p: StepParts) -> tuple[Moment, ...]:
    """Eager attention's softmax backward in the top decoder layer, later in the same layer's backward: its MLP's
    saved tensors and gradients are freed (``StepParts.softmax_backward_freed``), its length² gradients live."""
    if not p.softmax_backward_temp:
        return ()
    name = "softmax backward in the top decoder layer's eager attention" + (" (recomputed)" if train.grad_ckpt else "")
    mo = _top_layer_moment(name, train, p, freed=p.softmax_backward_freed)
    mo.add(
        Category.TEMPORARIES,
        "gradients of hidden states and attention scores",
        p.softmax_backward_temp,
        "one layer's backward: grad in/out (2·s·H·T) + eager (c+4)·nh·L² per sequence, once the MLP's are freed "
        "(torch autograd engine.cpp evaluate_function: release_variables)",
    )
    return (mo,)


def _top_layer_moment(name: str, train: TrainSpec, p: StepParts, *, freed: int) -> Moment:
    """What lives in the top decoder layer's backward besides its gradients: every other layer's saved activations
    and the top layer's own (recomputed under checkpointing), less ``freed`` bytes of them its backward has
    released."""
    mo = Moment(name=name, phase=Phase.BACKWARD)
    head_grad = 0
    if p.weights.head_trainable and train.grad_accum <= 1:
        head_grad = p.weights.lm_head_weight_numel * p.weights.trainable_dtype.bytes
    _add_backward_persistent(mo, p, train, grads=_previous_grads(train, p) + head_grad, top_layer=True)
    # The final norm's and lm_head's backward ran before this layer's and released what they saved
    # (torch/csrc/autograd/engine.cpp Engine::evaluate_function: release_variables); the RoPE tables stay.
    rope = p.rope_saved_bytes
    saved = p.saved_layers_bytes - (0 if train.grad_ckpt else freed)  # the top layer's own is part of every layer's
    add_activations(mo, replace(p, saved_layers_bytes=saved, extra_saved_bytes=0), train)
    mo.add(Category.ACTIVATIONS, "RoPE tables (the final norm's saved tensors freed)", rope, SOURCES["acts"])
    if train.grad_ckpt and p.weights.trainable_layers:
        # The recompute reads the checkpointed input (counted above), so its saved set is recompute_bytes.
        label = "one layer recomputed" + (" (less what its backward has freed)" if freed else "")
        mo.add(Category.ACTIVATIONS, label, p.recompute_bytes - freed, SOURCES["acts"])
        mo.add(
            Category.ATTENTION_SCORES,
            "one layer's length² tensors (recomputed)",
            p.layer_scores_bytes,
            "analytic/activations.py",
        )
    mo.add(
        Category.TEMPORARIES,
        "4-bit weight dequantised for one matmul",
        p.dequant_temp,
        "bitsandbytes MatMul4Bit.backward: dequantize_4bit(B) to the compute dtype, one weight at a time",
    )
    return mo


def _layer_gradient(m: ModelSpec, train: TrainSpec, p: StepParts) -> tuple[Moment, ...]:
    """FSDP1: the top decoder layer's flat gradient concatenated, the next unit prefetched
    (analytic/distributed/fsdp1_layer_grad.py); the layer's own saved or recomputed activations are freed by then."""
    lines = layer_gradient_lines(m, train, p.weights)
    if not lines:
        return ()
    mo = Moment(name=LAYER_GRADIENT_NAME, phase=Phase.BACKWARD)
    add_persistent(mo, p, train, grads=_previous_grads(train, p), autocast=False, states=True)
    if train.grad_ckpt:
        add_activations(mo, p, train)
    else:
        mo.add(Category.ACTIVATIONS, "saved by every trained layer below", p.saved_layers_bytes - p.layer_bytes,
               SOURCES["acts"])  # fmt: skip
        mo.add(Category.ACTIVATIONS, "final norm, RoPE tables", p.extra_saved_bytes, SOURCES["acts"])
        mo.add(Category.ATTENTION_SCORES, "length² tensors of every layer below",
               p.scores_bytes - p.layer_scores_bytes, "analytic/activations.py")  # fmt: skip
    s = residual_bytes(train, p.weights)
    mo.add(
        Category.TEMPORARIES,
        "gradient of the layer's input hidden state",
        s * m.hidden_size * train.tokens,
        "autograd: the layer's input gradient, passed to the layer below",
    )
    for line in lines:
        mo.add(line.category, line.label, line.bytes, line.source)
    return (mo,)


def _end_of_backward(m: ModelSpec, train: TrainSpec, p: StepParts) -> tuple[Moment, ...]:
    """Every gradient allocated, with the embedding's gradient before AccumulateGrad adds it in; under FSDP1 with a
    trained root, the moments of its flattening instead (analytic/distributed/fsdp_root_flatten.py)."""
    flattening = root_flatten(m, train, p.weights)
    if flattening:
        return tuple(_flatten_moment(train, p, f) for f in flattening)
    mo = Moment(name="end of backward (every gradient allocated)", phase=Phase.BACKWARD)
    pending = fsdp2_pending_root_shard(m, train, p.weights)  # FSDP2: the root's shard comes after this moment
    add_persistent(mo, p, train, grads=p.grad_bytes - pending, autocast=False, states=True)
    mo.add(
        Category.TEMPORARIES,
        "embedding gradient before accumulation",
        embedding_gradient_before_accumulation(m, train, p),
        "embedding_dense_backward writes a V×H gradient that AccumulateGrad adds into the existing one "
        "(tied lm_head, or an earlier micro-step)",
    )
    mo.add(Category.TEMPORARIES, "sum of the tied weight's two gradients", tied_gradient_sum(m, train, p), TIED_SUM)
    return (mo,)


def _flatten_moment(train: TrainSpec, p: StepParts, f: FlattenMoment) -> Moment:
    """One instant of FSDP1's root flattening: every unit's gradient shard but the root's, and the root's pieces."""
    mo = Moment(name=f.name, phase=Phase.BACKWARD)
    add_persistent(mo, p, train, grads=p.grad_bytes - f.pending_shard, autocast=False, states=True)
    for line in f.lines:
        mo.add(line.category, line.label, line.bytes, line.source)
    return mo


def _optimizer_moment(train: TrainSpec, p: StepParts) -> Moment:
    """optimizer.step(): weights, gradients, states and the step's temporaries."""
    mo = Moment(
        name="optimizer.step()" + (" (foreach temporaries)" if p.step_temp_bytes else ""), phase=Phase.OPTIMIZER
    )
    add_persistent(mo, p, train, grads=p.grad_bytes, autocast=False, states=True)
    mo.add(Category.TEMPORARIES, "optimizer step temporaries", p.step_temp_bytes, p.optimizer_source)
    return mo


@dataclass(frozen=True)
class _ShapePeaks:
    """``reserve.ShapePeaks`` for one model and GPU; hashable, so the reserve can cache on it."""

    m: ModelSpec
    gpu: GPUSpec | None

    def __call__(self, train: TrainSpec) -> tuple[StepParts, int, int, int]:
        return _peaks_at(self.m, train, self.gpu)

    def parts(self, train: TrainSpec) -> StepParts:
        """The step's parts alone at another shape (no moments: a fraction of the cost, for the reserve's searches
        that need no peak, runs.py ``_regions``)."""
        return step_parts(self.m, train, self.gpu)

    def moments(self, train: TrainSpec) -> dict[Phase, Moment]:
        """The step's moments at another shape (read only), for what the FSDP default pool's floors read beyond the
        peaks (distributed/stream_pools.py ``_held_flatten_floor``)."""
        return _moments_at(self.m, train, self.gpu)


@lru_cache(maxsize=1024)
def _moments_at(m: ModelSpec, train: TrainSpec, gpu: GPUSpec | None) -> dict[Phase, Moment]:
    return moments(m, train, gpu)


@lru_cache(maxsize=4096)
def _peaks_at(m: ModelSpec, train: TrainSpec, gpu: GPUSpec | None) -> tuple[StepParts, int, int, int]:
    """The step at another shape, for the reserve of a run with dynamic padding (``reserve.held_reserved``)."""
    return (step_parts(m, train, gpu), *training_peaks({ph: mo.total for ph, mo in moments(m, train, gpu).items()}))


def ledger_items(m: ModelSpec, train: TrainSpec, gpu: GPUSpec | None) -> tuple[tuple[LineItem, ...], dict[Phase, str]]:
    """Line items for every phase, including the allocator reserve and the CUDA context."""
    items: list[LineItem] = []
    names: dict[Phase, str] = {}
    every = phase_moments(m, train, gpu)
    mos = _peaks(every)
    p = step_parts(m, train, gpu)
    if train.fsdp is not None:  # FSDP's side streams keep pools of their own (analytic/distributed/stream_pools.py)
        at_fsdp = _ShapePeaks(m, gpu) if engine_dtypes(train) == train else None
        reserves = pooled_phase_reserves(m, train, p, mos, at_fsdp, every)
    else:
        # The cache's block sizes follow the dtypes the step computes in (an engine's, under DeepSpeed).
        totals = {ph: mo.total for ph, mo in mos.items()}
        engine = engine_dtypes(train)
        # a run with dynamic padding: the reserve of the shorter shapes it meets (reserve.held_reserved), for the
        # step as it is (an engine's casts leave the single shape's form)
        at = _ShapePeaks(m, gpu) if engine is train else None
        # full fine-tuning, one GPU or DDP: step 1's optimizer peak replayed (analytic/distributed/ddp_reserve.py)
        reserved = phase_reserves(m, engine, p, totals, at, ddp_peak_reserved(m, engine, p, totals, at))
        reserves = {ph: [ReserveLine(n, RESERVE_LABEL, s, b)] for ph, (n, s, b) in reserved.items()}
    context = cuda_context_bytes(gpu)
    for phase, mo in mos.items():
        names[phase] = mo.name
        items.extend(mo.items)
        for r in reserves.get(phase, ()):
            items.append(
                LineItem(
                    category=Category.ALLOCATOR_RESERVE,
                    phase=phase,
                    bytes=r.bytes,
                    label=r.label,
                    source=r.source,
                    basis=r.basis,
                )
            )
        items.append(
            LineItem(
                category=Category.CUDA_CONTEXT,
                phase=phase,
                bytes=context,
                label="CUDA context",
                source=CONTEXT_SOURCE,
                basis=Basis.ASSUMPTION,
            )
        )
    items.extend(nccl_lines(train, gpu, mos))  # several GPUs: NCCL's communicators, outside the allocator
    return tuple(items), names
