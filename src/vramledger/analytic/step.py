"""Compose the components into the ledger of one steady-state training step.

The step modelled is the HF Trainer's (and LLaMA-Factory's, TRL's): ``model(**batch)`` with labels under
autocast for AMP, ``compute_loss`` returning only the loss, ``accelerator.backward(loss)``, ``optimizer.step()``,
``zero_grad(set_to_none=True)``. We model step ≥ 2: optimizer states exist from the first step on (they are
created inside it), so they are live through forward and backward of every later step — the true peak.

Each phase's peak is the largest of a few candidate moments (named in ``moments``):
- forward: inside the loss (logits, fp32 copy, log-softmax) with every layer's saved activations;
- backward: the log-softmax backward (12·V·T), lm_head's backward, the top layer's backward (with its recompute
  under checkpointing), or the end (every gradient allocated);
- optimizer: weights + gradients + states + the step's temporaries.
Gradients are absent in forward unless gradient accumulation keeps them across micro-steps.
"""

from __future__ import annotations

from functools import lru_cache

from vramledger.analytic.activations import (
    checkpoint_input_bytes_per_token,
    checkpoint_reused_bytes_per_token,
    dora_transient_bytes,
    final_hidden_live_bytes_per_token,
    final_norm_bytes_per_token,
    first_layer_unsaved_bytes_per_token,
    head_input_bytes_per_token,
    layer_activations,
    residual_bytes,
    rope_bytes_per_token,
    runs_eager,
)
from vramledger.analytic.distributed import add_buffers, rank_step_parts
from vramledger.analytic.evaluation import eval_moments
from vramledger.analytic.load import SOURCES as LOAD_SOURCES
from vramledger.analytic.load import load_transient_bytes
from vramledger.analytic.logits import logits_bytes
from vramledger.analytic.loop import offloaded_layers, optimizer_in_backward
from vramledger.analytic.optimizer import optimizer_bytes
from vramledger.analytic.overhead import (
    CONTEXT_SOURCE,
    cublas_workspace_bytes,
    cuda_context_bytes,
)
from vramledger.analytic.parts import SOURCES, Moment, StepParts, add_activations, add_persistent
from vramledger.analytic.reserve import phase_reserves
from vramledger.analytic.weights import weight_budget
from vramledger.ledger import Basis, Category, LineItem, Phase
from vramledger.specs import Attention, DType, GPUSpec, ModelSpec, TrainSpec


@lru_cache(maxsize=4096)
def step_parts(m: ModelSpec, train: TrainSpec, gpu: GPUSpec | None = None) -> StepParts:
    if train.distributed:  # rank 0 of a data-parallel run: analytic/distributed.py
        return rank_step_parts(m, train, gpu, single=step_parts)
    wb = weight_budget(m, train)
    T, B = train.tokens, train.micro_batch
    c = train.precision.compute.bytes
    n_tl = wb.trainable_layers
    n_kept = offloaded_layers(train, n_tl)  # analytic/loop.py: activation offloading keeps two layers' worth
    la = layer_activations(m, train, wb)
    layer_bytes = la.per_token * T
    layer_scores = la.scores_per_seq * B
    recompute = 0
    if train.grad_ckpt:
        saved_layers = n_kept * checkpoint_input_bytes_per_token(m, train, wb) * T
        recompute = layer_bytes - checkpoint_reused_bytes_per_token(m, train, wb) * T if n_tl else 0
        scores = 0
        eager = runs_eager(m, train)
        if eager and n_tl:
            # The checkpoint keeps its inputs, among them the additive causal mask(s) eager attention gets
            # (transformers masking_utils eager_mask, in the dtype of the input embeddings: s·B·L² each; a second one
            # for sliding-window layers).
            s_emb = residual_bytes(train, wb)
            scores = s_emb * B * train.seq_len * train.seq_len * (2 if m.sliding_layers else 1)
    else:
        saved_layers = n_kept * layer_bytes - (first_layer_unsaved_bytes_per_token(m, train, wb) * T if n_tl else 0)
        scores = n_tl * layer_scores
    extra = (final_norm_bytes_per_token(m, train, wb) + rope_bytes_per_token(m, train, wb)) * T if n_tl else 0
    lg = logits_bytes(m, train, T)
    # Under AMP lm_head saves its own bf16 cast (the trace files it with the logits); in pure precision it saves
    # the final norm's output itself, an activation.
    head_input = head_input_bytes_per_token(m, train, wb) * T
    if not train.precision.mixed:
        extra += head_input
        head_input = 0
    final_hidden = final_hidden_live_bytes_per_token(m, train, wb) * T

    # Under AMP, trainable fp32 matrices get a bf16 copy in the autocast cache (and saved by autograd).
    autocast_copies = wb.trainable_matrix_params * 2 if (train.precision.mixed and wb.trainable_dtype.bytes == 4) else 0
    if train.precision.mixed and train.quant is None and train.frozen_dtype is DType.FP32:
        # Frozen fp32 weights are cast to bf16 at every use (autocast caches only leaves that require grad) and
        # each cast is saved by autograd for the input's gradient: a bf16 copy of every frozen matrix.
        autocast_copies += wb.frozen_matrix_params * 2

    frozen, trainable = wb.frozen_bytes, wb.trainable_bytes
    grads = wb.trainable_bytes  # each gradient in its parameter's dtype
    opt = optimizer_bytes(m, train, wb)
    states, step_temp = opt.states, opt.step_temporaries
    paged_states, states = (states, 0) if opt.paged else (0, states)
    grads, step_temp = optimizer_in_backward(train, wb, grads, step_temp)  # analytic/loop.py
    master = 0

    # Backward of one layer: gradients of its input and output hidden states and of the MLP intermediates.
    H, I = m.hidden_size, (m.moe_intermediate_size * m.experts_per_token if m.is_moe else m.intermediate_size)
    s = residual_bytes(train, wb)
    layer_temp = (2 * s * H + 3 * c * I) * T if n_tl else 0
    if train.attn is Attention.EAGER and n_tl:
        layer_temp += (c + 4) * m.num_heads * train.seq_len * train.seq_len * B
    return StepParts(
        weights=wb,
        frozen_bytes=frozen,
        trainable_bytes=trainable,
        master_bytes=master,
        grad_bytes=grads,
        autocast_copy_bytes=autocast_copies,
        state_bytes=states,
        paged_state_bytes=paged_states,
        step_temp_bytes=step_temp,
        saved_layers_bytes=saved_layers,
        layer_bytes=layer_bytes,
        recompute_bytes=recompute,
        scores_bytes=scores,
        layer_scores_bytes=layer_scores,
        extra_saved_bytes=extra,
        logits_forward=lg.forward_peak + head_input,
        logits_saved=lg.saved + head_input,
        logits_backward=lg.backward_peak + head_input,
        logits_head=lg.head_grad_moment + head_input,
        final_hidden_bytes=final_hidden,
        head_cast_bytes=m.vocab_size * m.hidden_size * 2
        if (wb.head_trainable and train.precision.mixed and wb.trainable_dtype.bytes == 4) else 0,
        layer_backward_temp=layer_temp,
        dora_temp=dora_transient_bytes(train, wb),
        forward_layer_temp=dora_transient_bytes(train, wb)
        + (c * m.num_heads * train.seq_len * train.seq_len * B if train.attn is Attention.EAGER and n_tl else 0),
        dequant_temp=wb.largest_frozen_matrix_numel * c if train.quant is not None else 0,
        workspace_bytes=cublas_workspace_bytes(gpu),
        optimizer_source=opt.source,
        logits_source=lg.source,
    )


def moments(m: ModelSpec, train: TrainSpec, gpu: GPUSpec | None = None) -> dict[Phase, Moment]:
    """The peak moment of each phase, as lines by category."""
    p = step_parts(m, train, gpu)
    accum = train.grad_accum > 1
    grads_prev = p.grad_bytes if accum else 0
    out: dict[Phase, Moment] = {}

    load = Moment(name="weights loaded, before the first step", phase=Phase.LOAD)
    if p.frozen_bytes:
        load.add(Category.WEIGHTS, "frozen base", p.frozen_bytes, SOURCES["weights"])
    if p.trainable_bytes:
        load.add(Category.WEIGHTS, "trainable", p.trainable_bytes, SOURCES["weights"])
    load.add(Category.TEMPORARIES, "quantising the largest weight on the GPU",  # analytic/load.py: per framework
             load_transient_bytes(m, train, p.weights), LOAD_SOURCES[train.load_path])
    out[Phase.LOAD] = load

    # Forward: the loss with everything saved so far.
    fwd = Moment(name="cross-entropy in the loss (logits, their fp32 copy and log-softmax live)", phase=Phase.FORWARD)
    add_persistent(fwd, p, train, grads=grads_prev, autocast=True, states=True)
    add_activations(fwd, p, train)
    fwd.add(Category.LOGITS_LOSS, "logits, fp32 copy, log-softmax", p.logits_forward, p.logits_source)
    fwd.add(Category.TEMPORARIES, "final hidden state (model output, alive during the loss)", p.final_hidden_bytes,
            "transformers CausalLM forward computes the loss while BaseModelOutputWithPast.last_hidden_state lives")
    fwd_layer = Moment(name="inside the last decoder layer's forward", phase=Phase.FORWARD)
    add_persistent(fwd_layer, p, train, grads=grads_prev, autocast=True, states=True)
    add_activations(fwd_layer, p, train)
    fwd_layer.add(Category.TEMPORARIES, "transients of one layer", p.forward_layer_temp + p.dequant_temp,
                  "eager pre-softmax scores c·nh·L² per sequence; DoRA weight norm (in² + 4·in·out fp32); "
                  "QLoRA dequantised weight")
    out[Phase.FORWARD] = max((fwd, fwd_layer), key=lambda mo: mo.total)

    # Backward candidates.
    cands: list[Moment] = []
    b_loss = Moment(name="log-softmax backward (_log_softmax_backward_data)", phase=Phase.BACKWARD)
    # Non-reentrant checkpointing saves no casted weights: the autocast cache dies when forward's autocast exits.
    keep_casts = not train.grad_ckpt
    add_persistent(b_loss, p, train, grads=grads_prev, autocast=keep_casts, states=True)
    if not keep_casts:
        b_loss.add(Category.WEIGHTS, "lm_head's bf16 cast (outside checkpointing)", p.head_cast_bytes,
                   SOURCES["autocast"])
    add_activations(b_loss, p, train)
    b_loss.add(Category.LOGITS_LOSS, "log-softmax output and two fp32 gradients", p.logits_backward, p.logits_source)
    cands.append(b_loss)

    b_top = Moment(name="backward of the top decoder layer" + (" (recomputed)" if train.grad_ckpt else ""),
                   phase=Phase.BACKWARD)
    head_grad = 0
    if p.weights.head_trainable and not accum:
        head_grad = p.weights.lm_head_weight_numel * p.weights.trainable_dtype.bytes
    add_persistent(b_top, p, train, grads=grads_prev + head_grad, autocast=keep_casts, states=True)
    if not keep_casts:
        b_top.add(Category.WEIGHTS, "lm_head's bf16 cast (outside checkpointing)", p.head_cast_bytes,
                  SOURCES["autocast"])
    add_activations(b_top, p, train)
    if train.grad_ckpt and p.weights.trainable_layers:
        # The recompute reads the checkpointed input (counted above), so its saved set is recompute_bytes.
        b_top.add(Category.ACTIVATIONS, "one layer recomputed", p.recompute_bytes, SOURCES["acts"])
        b_top.add(Category.ATTENTION_SCORES, "one layer's length² tensors (recomputed)", p.layer_scores_bytes,
                  "analytic/activations.py")
    if train.grad_ckpt:
        b_top.add(Category.TEMPORARIES, "DoRA weight norm in the recomputed forward", p.dora_temp,
                  "PEFT DoraLinearLayer.get_weight_norm, in² + 4·in·out fp32 (recomputed under checkpointing)")
    b_top.add(Category.TEMPORARIES, "4-bit weight dequantised for one matmul", p.dequant_temp,
              "bitsandbytes MatMul4Bit.backward: dequantize_4bit(B) to the compute dtype, one weight at a time")
    b_top.add(Category.TEMPORARIES, "gradients of hidden states and MLP intermediates", p.layer_backward_temp,
              "one layer's backward: grad in/out (2·s·H·T) + 3·c·I·T MLP gradients (+ eager (c+4)·nh·L² per seq)")
    cands.append(b_top)

    b_end = Moment(name="end of backward (every gradient allocated)", phase=Phase.BACKWARD)
    add_persistent(b_end, p, train, grads=p.grad_bytes, autocast=False, states=True)
    if p.weights.embedding_trainable and (m.tie_word_embeddings or accum):
        b_end.add(Category.TEMPORARIES, "embedding gradient before accumulation",
                  p.weights.lm_head_weight_numel * p.weights.trainable_dtype.bytes,
                  "embedding_dense_backward writes a V×H gradient that AccumulateGrad adds into the existing one "
                  "(tied lm_head, or an earlier micro-step)")
    cands.append(b_end)
    out[Phase.BACKWARD] = max(cands, key=lambda mo: mo.total)

    opt = Moment(name="optimizer.step()" + (" (foreach temporaries)" if p.step_temp_bytes else ""),
                 phase=Phase.OPTIMIZER)
    add_persistent(opt, p, train, grads=p.grad_bytes, autocast=False, states=True)
    opt.add(Category.TEMPORARIES, "optimizer step temporaries", p.step_temp_bytes, p.optimizer_source)
    out[Phase.OPTIMIZER] = opt
    for phase, mo in out.items():
        add_buffers(mo, phase, p.buffers)
    out.update(eval_moments(m, train, p))
    return out


def ledger_items(m: ModelSpec, train: TrainSpec, gpu: GPUSpec | None) -> tuple[tuple[LineItem, ...], dict[Phase, str]]:
    """Line items for every phase, including the allocator reserve and the CUDA context."""
    items: list[LineItem] = []
    names: dict[Phase, str] = {}
    mos = moments(m, train, gpu)
    reserves = phase_reserves(m, train, step_parts(m, train, gpu), {ph: mo.total for ph, mo in mos.items()})
    for phase, mo in mos.items():
        names[phase] = mo.name
        items.extend(mo.items)
        if phase in reserves:
            n, source, basis = reserves[phase]
            items.append(LineItem(category=Category.ALLOCATOR_RESERVE, phase=phase, bytes=n,
                                  label="cached, not allocated", source=source, basis=basis))
        items.append(LineItem(category=Category.CUDA_CONTEXT, phase=phase, bytes=cuda_context_bytes(gpu),
                              label="CUDA context", source=CONTEXT_SOURCE, basis=Basis.ASSUMPTION))
    return tuple(items), names
