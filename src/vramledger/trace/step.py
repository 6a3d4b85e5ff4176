"""Run two training steps of the real model code on fake CPU tensors and record every allocation and free.

The loop is the HF Trainer's (trainer.py ``training_step`` / ``compute_loss`` with accelerate's ``prepare_model``):
under mixed precision the forward runs in ``torch.autocast`` and accelerate converts the bf16/fp16 outputs to fp32
(accelerate/utils/operations.py ``convert_outputs_to_fp32``); the loss comes from transformers' ``ForCausalLMLoss``
via ``labels``; then ``backward``, ``optimizer.step()`` and ``model.zero_grad()`` (set_to_none=True). Two steps:
optimizer states exist only from the first step on, so the second step's backward is where full fine-tuning peaks
(tracing.md).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from vramledger.errors import MissingDependencyError, VramledgerError
from vramledger.ledger import Category, Phase
from vramledger.specs import Loss, Method, ModelSpec, TrainSpec
from vramledger.trace.classify import INPUTS
from vramledger.trace.recorder import Event, Recorder, StorageInfo

STEPS = 2


@dataclass(kw_only=True, slots=True)
class TraceResult:
    """What a traced step leaves behind: the events (categorised), the storages, and facts about the model."""

    events: list[Event]
    storages: dict[int, StorageInfo]
    params: int
    trainable_params: int
    warnings: list[str] = field(default_factory=list)
    sdpa_backends: list[str] = field(default_factory=list)
    quantised: list[tuple[int, int, int]] = field(default_factory=list)
    """(storage id, numel, out_features) of each linear weight a bitsandbytes base would quantise."""
    versions: str = ""


def _check_supported(train: TrainSpec) -> None:
    if train.loss is Loss.FUSED:
        raise VramledgerError(
            "trace: --loss fused needs Liger's kernels, which trace does not run; "
            "use --loss standard or chunked, or `vramledger estimate`"
        )
    if train.distributed:
        from vramledger.trace.distributed import check_traceable

        check_traceable(train)


def chunked_loss(hf: Any, input_ids: Any, labels: Any, chunk_len: int, attention_mask: Any = None) -> Any:
    """The chunked cross-entropy of torchtune's ``CEWithChunkedOutputLoss`` (and LitGPT's ``lm_head_chunk_size`` +
    ``chunked_cross_entropy``): the decoder's hidden states, the output layer applied per chunk of ``chunk_len``
    positions (every chunk's logits listed, as the model returns them), then per chunk ``logits.float()`` and
    ``cross_entropy(reduction="sum")``, summed and divided by the number of target tokens. Labels are shifted as
    transformers' ``ForCausalLMLoss`` shifts them (the last position has no target)."""
    import torch
    import torch.nn.functional as F

    base = hf.get_base_model() if hasattr(hf, "get_base_model") else hf
    hidden = base.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    head = base.lm_head
    chunks = [head(h) for h in hidden.split(chunk_len, dim=1)]
    del hidden
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    total = None
    for logits, y in zip(chunks, shifted.split(chunk_len, dim=1), strict=True):
        part = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
        total = part if total is None else total + part
    del chunks
    return total / max(1, labels.numel() - labels.shape[0])


def run_trace(
    model: ModelSpec,
    train: TrainSpec,
    *,
    config: dict[str, Any] | None = None,
    fake: bool = True,
    eval_shape: tuple[int, int] | None = None,
) -> TraceResult:
    """Trace ``STEPS`` training steps; returns the categorised events. ``fake=False`` runs the same loop on
    real (uninitialised) CPU tensors, for tests that compare the fake trace with a real run. ``eval_shape``
    (batch, length) adds one evaluation forward after the steps (phase ``EVAL``, step ``STEPS + 1``)."""
    try:
        import torch  # noqa: F401 - a missing one is said here, before any work
        import transformers  # noqa: F401
    except ImportError as exc:  # pragma: no cover
        raise MissingDependencyError(exc.name or "torch", "trace") from exc
    from vramledger.catalog.config_of import config_of
    from vramledger.trace.build import build_on_meta
    from vramledger.trace.recorder import module_hooks
    from vramledger.trace.shims import make_optimizer
    from vramledger.trace.vision_inputs import vision_trace

    _check_supported(train)
    # With images, the whole multimodal config (Gemma 3: tower and projector beside the decoder).
    cfg = dict(config) if config is not None else config_of(model, vision=bool(train.images))
    hf, warnings = build_on_meta(model, train, cfg)
    rec = Recorder()
    vocab = int(hf.get_output_embeddings().weight.shape[0])

    with contextlib.ExitStack() as stack:
        chosen = _enter_modes(stack, rec, fake=fake)
        stack.enter_context(vision_trace(hf, train))  # trace/vision_inputs.py: a no-op without images
        run = _load(stack, hf, model, train, rec)
        params = {id(p): p for p in hf.parameters()}
        n_params = sum(p.numel() for p in params.values())
        trainable = [p for p in params.values() if p.requires_grad]
        n_trainable = sum(p.numel() for p in trainable)
        quantised = _quantise(stack, hf, rec, train)
        stack.enter_context(module_hooks(rec, hf))
        hooks = _mark_gradients(rec, trainable)
        opt = make_optimizer(trainable, train.optimizer, sgd_momentum=train.sgd_momentum)
        backward_start = _train_steps(hf, run, rec, train, trainable, opt)
        if eval_shape is not None:
            _eval_forward(hf, rec, train, eval_shape)
        for h in hooks:
            h.remove()
        del opt, trainable, params, hf, run
    return TraceResult(
        events=_categorised(rec, vocab=vocab, seq_len=train.seq_len, backward_start=backward_start),
        storages=rec.storages,
        params=n_params,
        trainable_params=n_trainable,
        warnings=warnings,
        sdpa_backends=list(chosen),
        quantised=quantised,
        versions=_versions(),
    )


def _enter_modes(stack: contextlib.ExitStack, rec: Recorder, *, fake: bool) -> list[str]:
    """Enter the modes the step runs under; returns the list the SDPA shim fills with the backends it chose.
    Order matters: modes entered later see an op first. Autocast casts, then SDPA and dropout route."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramledger.trace.recorder import dispatch_mode
    from vramledger.trace.shims import (
        autocast_as_cuda,
        dropout_as_cuda,
        grouped_mm_as_cuda,
        no_packed_sequences,
        sdpa_as_cuda,
    )

    stack.enter_context(no_packed_sequences())
    if fake:
        stack.enter_context(FakeTensorMode())
        stack.enter_context(grouped_mm_as_cuda())  # beneath the recorder: it records the op's output
    stack.enter_context(dispatch_mode(rec))
    chosen: list[str] = stack.enter_context(sdpa_as_cuda())
    stack.enter_context(dropout_as_cuda())
    stack.enter_context(autocast_as_cuda())
    return chosen


def _load(stack: contextlib.ExitStack, hf: Any, model: ModelSpec, train: TrainSpec, rec: Recorder) -> Any:
    """Phase ``LOAD``: the weights put on the device, then for many GPUs the real FSDP/DDP wrapper on a fake
    process group (trace/distributed.py). Returns the module the steps call."""
    from vramledger.trace.build import materialise

    rec.phase = Phase.LOAD
    materialise(hf)
    if not train.distributed:
        return hf
    from vramledger.trace.distributed import data_parallel

    return stack.enter_context(data_parallel(hf, model, train, rec))


def _quantise(stack: contextlib.ExitStack, hf: Any, rec: Recorder, train: TrainSpec) -> list[tuple[int, int, int]]:
    """The linears a QLoRA base would quantise (their bytes are replaced later: trace/api.py); in 4 bits each runs
    as bitsandbytes' ``Linear4bit`` does, with PEFT's LoRA layer for it (trace/shims.py ``bnb_linear4bit``): the
    weight dequantised for each matmul, forward and backward, its input saved only under a bitsandbytes that keeps
    it (``TrainSpec.matmul4bit_keeps_input``)."""
    import torch

    from vramledger.trace.build import torch_dtype
    from vramledger.trace.shims import bnb_linear4bit

    quantised = _quantised_linears(hf, rec) if train.method is Method.QLORA else []
    quant = train.quant
    if quantised and quant is not None and quant.bits == 4:
        quantised_ids = {sid for sid, _, _ in quantised}
        modules = [m for m in hf.modules() if isinstance(m, torch.nn.Linear) and rec.sid_of(m.weight) in quantised_ids]
        bases = {id(m) for m in modules}
        lora_layers = [m for m in hf.modules() if id(getattr(m, "base_layer", None)) in bases and hasattr(m, "lora_A")]
        load = torch_dtype(train.frozen_dtype)
        stack.enter_context(
            bnb_linear4bit(
                modules,
                lora_layers=lora_layers,
                keeps_input=train.matmul4bit_keeps_input,
                state_dtype=load,
                compute_dtype=torch_dtype(quant.compute_dtype) if quant.compute_dtype is not None else load,
                blocksize=quant.blocksize,
                nested=quant.double_quant,
            )
        )
    return quantised


def _mark_gradients(rec: Recorder, trainable: list[Any]) -> list[Any]:
    """Hooks that mark each gradient as such once accumulated; returns their handles."""
    return [
        p.register_post_accumulate_grad_hook(lambda p: rec.mark(p.grad, Category.GRADIENTS.value)) for p in trainable
    ]


def _train_steps(hf: Any, run: Any, rec: Recorder, train: TrainSpec, trainable: list[Any], opt: Any) -> dict[int, int]:
    """The ``STEPS`` training steps: forward, backward, optimizer step, ``zero_grad(set_to_none=True)``. Returns
    the index of each step's first backward event."""
    backward_start: dict[int, int] = {}
    for step in range(1, STEPS + 1):
        rec.step, rec.phase = step, Phase.FORWARD
        loss = _forward_loss(hf, run, rec, train)
        rec.phase = Phase.BACKWARD
        backward_start[step] = len(rec.events)
        _backward(loss)
        del loss
        for p in trainable if train.fsdp is not None else ():  # FSDP sets sharded grads without AccumulateGrad
            if p.grad is not None:
                rec.mark(p.grad, Category.GRADIENTS.value)
        rec.phase = Phase.OPTIMIZER
        _optimizer_step(opt, rec)
        hf.zero_grad(set_to_none=True)
    return backward_start


def _categorised(rec: Recorder, *, vocab: int, seq_len: int, backward_start: dict[int, int]) -> list[Event]:
    """The recorded events, each with the category its storage was classified into (trace/classify.py)."""
    from vramledger.trace.classify import classify

    storages = rec.storages
    classify(storages, vocab=vocab, seq_len=seq_len, backward_start=backward_start)
    return [
        Event(e.kind, e.storage, e.bytes, e.phase, e.step, e.module, e.op, storages[e.storage].category, e.stream)
        for e in rec.events
    ]


def _forward_loss(hf: Any, run: Any, rec: Recorder, train: TrainSpec) -> Any:
    """One micro-batch's forward as the HF Trainer runs it (trainer.py ``training_step`` / ``compute_loss`` with
    accelerate's ``prepare_model``): the batch, the forward under autocast with ``labels`` (or the chunked loss),
    accelerate's fp32 conversion of the outputs; only the loss outlives it."""
    import torch

    from vramledger.trace.vision_inputs import image_inputs

    b, L = train.micro_batch, train.seq_len
    rec.push(INPUTS)
    input_ids = torch.zeros((b, L), dtype=torch.long)
    images = image_inputs(hf, train, input_ids)  # trace/vision_inputs.py: {} without images
    input_ids = images.pop("input_ids", input_ids)
    labels = input_ids.clone()  # DataCollatorForLanguageModeling: labels = input_ids.clone()
    mask = padding_mask(train, input_ids)
    if mask is not None:
        images["attention_mask"] = mask
        labels[-1, -1] = -100  # the collator's label for a pad token
    rec.pop()
    mixed = train.precision.mixed
    compute = torch.bfloat16 if train.precision.compute.value == "bf16" else torch.float16
    amp = torch.autocast("cpu", dtype=compute) if mixed else contextlib.nullcontext()
    with amp:
        if train.loss is Loss.CHUNKED:
            out = {"loss": chunked_loss(hf, input_ids, labels, max(1, train.loss_chunk_tokens // b), mask)}
        elif train.loss is Loss.CHUNKED_NLL:
            from vramledger.trace.trl_loss import trl_chunked_nll

            out = {"loss": trl_chunked_nll(hf, input_ids, labels, mask)}
        else:
            out = run(input_ids=input_ids, labels=labels, use_cache=False, **images)
    if mixed:  # accelerate convert_outputs_to_fp32, outside the autocast context
        out = {
            k: (v.float() if isinstance(v, torch.Tensor) and v.dtype in (torch.float16, torch.bfloat16) else v)
            for k, v in out.items()
        }
    loss = out["loss"]
    del out, input_ids, labels, images, mask
    return loss


def padding_mask(train: TrainSpec, input_ids: Any) -> Any:
    """The attention mask of the worst batch of a padded run under SDPA (``padded_sdpa``: more than one sequence,
    not packed), or None: every row full but the last, which ends in one pad token. A row shorter than the longest
    is what makes transformers build a mask (masking_utils.py ``_ignore_causal_mask_sdpa`` skips it only when no
    token is masked), and with it ``repeat_kv`` copies of K and V (integrations/sdpa_attention.py
    ``use_gqa_in_sdpa``: only without a mask) and the additive mask every layer's SDPA makes of it
    (analytic/activations.py); a batch of equal rows is the packed case. DataCollatorWithPadding pads on the right
    (``padding_side`` "right" for training) with attention_mask 0 and, in DataCollatorForSeq2Seq, label −100."""
    import torch

    from vramledger.analytic.activations import padded_sdpa

    if not padded_sdpa(train):
        return None
    mask = torch.ones_like(input_ids)
    mask[-1, -1] = 0
    return mask


def _backward(loss: Any) -> None:
    """What ``loss.backward()`` runs (torch/autograd/__init__.py ``backward``), called directly: as a torch
    function, ``Tensor.backward`` would be handled by the shims' modes, which are off while they handle a call,
    so the backward (and its checkpoint recomputes) would run without them."""
    import torch
    from torch.autograd.graph import _engine_run_backward

    _engine_run_backward(
        (loss,), (torch.ones_like(loss),), False, False, (), allow_unreachable=True, accumulate_grad=True
    )


def _optimizer_step(opt: Any, rec: Recorder) -> None:
    """``optimizer.step()``, its states marked as such (``step`` counters stay on the host unless fused)."""
    import torch

    opt.step()
    fused = bool(opt.defaults.get("fused"))
    for state in opt.state.values():
        for key, t in state.items():
            if isinstance(t, torch.Tensor):
                # torch/optim/adamw.py _init_group: 'step' is a host tensor unless fused or capturable.
                rec.mark(t, "host" if key == "step" and not fused else Category.OPTIMIZER_STATE.value)


def _versions() -> str:
    import torch
    import transformers

    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    with contextlib.suppress(ImportError):
        import peft

        versions += f", peft {peft.__version__}"
    return versions


def _eval_forward(hf: Any, rec: Recorder, train: TrainSpec, shape: tuple[int, int]) -> None:
    """One evaluation batch as the HF Trainer runs it (trainer.py ``prediction_step``): ``model.eval()``, the
    forward with labels under ``torch.no_grad()`` (and autocast with accelerate's fp32 outputs under AMP), the
    outputs dropped once the loss is read (``prediction_loss_only``). ``use_cache`` follows
    ``config.use_cache``, which LLaMA-Factory turns off exactly when it enables gradient checkpointing
    (analytic/evaluation.py)."""
    import torch

    rec.step, rec.phase = STEPS + 1, Phase.EVAL
    compute = torch.bfloat16 if train.precision.compute.value == "bf16" else torch.float16
    rec.push(INPUTS)
    input_ids = torch.zeros(shape, dtype=torch.long)
    labels = input_ids.clone()
    rec.pop()
    hf.eval()
    amp = torch.autocast("cpu", dtype=compute) if train.precision.mixed else contextlib.nullcontext()
    with torch.no_grad(), amp:
        out = hf(input_ids=input_ids, labels=labels, use_cache=not train.grad_ckpt)
    if train.precision.mixed:
        with torch.no_grad():
            out = {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in out.items()}
    del out, input_ids, labels
    hf.train()


def _quantised_linears(hf: Any, rec: Recorder) -> list[tuple[int, int, int]]:
    """(storage id, numel, out_features) of the linears bitsandbytes would quantise: every frozen
    ``nn.Linear`` weight except the output layer (transformers integrations/bitsandbytes.py
    ``get_keys_to_not_convert`` keeps
    lm_head)."""
    import torch

    out_emb = hf.get_output_embeddings()
    # With LoRA on lm_head PEFT wraps it; its frozen base_layer is still the output layer, which the bnb quantizer
    # (run before PEFT wraps anything) leaves unquantised.
    out_base = getattr(out_emb, "base_layer", out_emb)
    found = []
    for name, m in hf.named_modules():
        if (
            isinstance(m, torch.nn.Linear)
            and m is not out_emb
            and m is not out_base
            and "lora_" not in name
            and not m.weight.requires_grad
        ):
            sid = rec.sid_of(m.weight)
            if sid is not None:
                found.append((sid, m.weight.numel(), int(m.weight.shape[0])))
    return found
