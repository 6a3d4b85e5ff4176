"""The public entry points of the trace engine."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any

from vramledger.advice import advice_sentence
from vramledger.allocator.conf import DEFAULT_CONF, AllocatorConf
from vramledger.analytic.distributed import nccl_bill, nccl_lines
from vramledger.analytic.vision import lm_view
from vramledger.ledger import Category, Ledger, Phase, ledger_verdict
from vramledger.specs import GPUSpec, ModelSpec, QuantSpec, TrainSpec
from vramledger.specs.gpu import DEFAULT_HEADROOM
from vramledger.trace.distributed import wrapper_settings
from vramledger.trace.ledger_build import downsample, line_items, replay, top_modules
from vramledger.trace.oom import device_events, device_lines, replay_outcome
from vramledger.trace.opnames import op_label
from vramledger.trace.recorder import Event, round_block
from vramledger.trace.step import TraceResult, run_trace
from vramledger.trace.vision_inputs import check_traceable


def quantised_weight_bytes(numel: int, out_features: int, quant: QuantSpec) -> int:
    """Device bytes of one bitsandbytes-quantised weight: the tensors of the analytic formula
    (:func:`vramledger.analytic.weights.quantised_tensors`), each rounded to the allocator's 512 B."""
    from vramledger.analytic.weights import quantised_tensors

    return sum(round_block(n) for n in quantised_tensors(numel, out_features, quant))


def _apply_quantisation(result: TraceResult, quant: QuantSpec) -> list[Event]:
    """Replace the traced bytes of the quantised linears by the bitsandbytes figure (they cannot be
    traced)."""
    new_bytes = {sid: quantised_weight_bytes(n, rows, quant) for sid, n, rows in result.quantised}
    if not new_bytes:
        return result.events
    return [dataclasses.replace(e, bytes=new_bytes[e.storage]) if e.storage in new_bytes else e for e in result.events]


def _trace(
    model: ModelSpec, train: TrainSpec, config: dict[str, Any] | None, eval_shape: tuple[int, int] | None = None
) -> tuple[TraceResult, list[Event]]:
    import warnings

    with warnings.catch_warnings():
        # transformers 5 warns that `is_gradient_checkpointing` (read by PEFT while preparing the model) is
        # renamed: nothing a user of the trace can act on
        warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*", category=FutureWarning)
        # transformers 5's MoE conversion of a LoRA config (_convert_peft_config_moe) gives gate_up_proj rank 2r in
        # rank_pattern/alpha_pattern, which PEFT 0.21 applies to the target_parameters but reports as matching no
        # module: the ranks are as counted (activations.py merged_experts, the trainable count equal)
        warnings.filterwarnings("ignore", message=r"The following (rank|alpha)_pattern keys did not match any targeted")
        # The language model sees the images' tokens too (analytic/vision.py lm_view).
        check_traceable(model, train)
        result = run_trace(model, lm_view(model, train), config=config, eval_shape=eval_shape)
    events = result.events
    if train.quant is not None:
        events = _apply_quantisation(result, train.quant)
    return result, events


def trace_events(model: ModelSpec, train: TrainSpec, *, config: dict[str, Any] | None = None) -> list[Event]:
    """Every allocation and free of two traced training steps, in order: ``Event(kind, storage, bytes, phase,
    step, module, op, category)`` with bytes rounded to 512 B. ``category`` ``host`` marks tensors a CUDA run
    keeps on the CPU (skip them when replaying device memory)."""
    return _trace(model, train, config)[1]


def trace_result(
    model: ModelSpec,
    train: TrainSpec,
    *,
    config: dict[str, Any] | None = None,
    eval_shape: tuple[int, int] | None = None,
) -> tuple[TraceResult, list[Event]]:
    """The trace with its storages (shape and dtype of each) beside the events of :func:`trace_events`;
    ``eval_shape`` (batch, length) adds one evaluation forward after the two steps (phase ``eval``)."""
    return _trace(model, train, config, eval_shape)


def trace_step(
    model: ModelSpec,
    train: TrainSpec,
    *,
    gpu: GPUSpec | None = None,
    headroom: float = DEFAULT_HEADROOM,
    config: dict[str, Any] | None = None,
    alloc_conf: AllocatorConf = DEFAULT_CONF,
) -> Ledger:
    """Trace two training steps of the real transformers/PEFT code on fake CPU tensors and itemise the memory.

    ``config``: the config.json mapping to build from (by default the catalog entry or the file in
    ``model.source``). The events are replayed through the caching-allocator model under ``alloc_conf``
    (trace/oom.py): the ledger gets the allocator reserve, the BLAS workspaces and the CUDA context, and
    ``settings["allocator"]`` the replay on ``gpu`` (where it would run out of memory) or on an unlimited
    device; with a non-default ``alloc_conf``, ``settings["allocator_default"]`` is the same replay under
    torch's defaults. Example::

        from vramledger.catalog import resolve_model
        from vramledger.specs import TrainSpec, Method
        ledger = trace_step(resolve_model("llama-3-8b"), TrainSpec(method=Method.LORA, micro_batch=4,
        seq_len=4096))
        ledger.peak_allocated
    """
    return _trace_ledger(model, train, gpu=gpu, headroom=headroom, config=config, alloc_conf=alloc_conf)[0]


def trace_step_snapshot(
    model: ModelSpec,
    train: TrainSpec,
    *,
    gpu: GPUSpec | None = None,
    headroom: float = DEFAULT_HEADROOM,
    config: dict[str, Any] | None = None,
    alloc_conf: AllocatorConf = DEFAULT_CONF,
) -> tuple[Ledger, dict[str, Any]]:
    """:func:`trace_step` and, from the same trace, its memory snapshot in ``torch.cuda.memory._snapshot``'s
    format (trace/snapshot.py): pickle it to get what ``torch.cuda.memory._dump_snapshot`` writes."""
    ledger, snap = _trace_ledger(
        model, train, gpu=gpu, headroom=headroom, config=config, alloc_conf=alloc_conf, snapshot=True
    )
    assert snap is not None
    return ledger, snap


def _trace_ledger(
    model: ModelSpec,
    train: TrainSpec,
    *,
    gpu: GPUSpec | None,
    headroom: float,
    config: dict[str, Any] | None,
    alloc_conf: AllocatorConf,
    snapshot: bool = False,
) -> tuple[Ledger, dict[str, Any] | None]:
    result, events = _trace(model, train, config)
    casts = frozenset(sid for sid, info in result.storages.items() if info.param_cast)
    peaks, samples = replay(events, casts)
    source = f"traced on fake tensors ({result.versions}); vramledger.trace"
    items = line_items(peaks, source)
    dev = device_events(events, gpu)
    allocated = {p: sum(i.bytes for i in items if i.phase is p) for p in peaks}
    items += device_lines(peaks, allocated, dev, gpu, alloc_conf)
    items += nccl_lines(train, gpu, peaks)  # several GPUs: NCCL's communicators, outside the allocator
    nccl = nccl_bill(train, gpu).total  # NCCL's communicators take device memory torch cannot obtain
    allocator = {"allocator": replay_outcome(dev, events, conf=alloc_conf, gpu=gpu, outside_bytes=nccl).to_dict()}
    if alloc_conf != DEFAULT_CONF:
        allocator["allocator_default"] = replay_outcome(
            dev, events, conf=DEFAULT_CONF, gpu=gpu, outside_bytes=nccl
        ).to_dict()
    warnings = tuple(result.warnings) + tuple(train.warnings)
    if alloc_conf.ignored_keys:
        warnings += (f"alloc conf: {', '.join(alloc_conf.ignored_keys)} do not change device memory; ignored",)
    moments: dict[Phase, str] = {
        p: f"{op_label(pk.op, events[pk.index].category, p.value, pk.module)} in {pk.module or '(top level)'} "
        f"(step {pk.step})"
        for p, pk in peaks.items()
        if p is not Phase.LOAD
    }
    ledger = Ledger(
        model=model.name,
        params=result.params,
        trainable_params=result.trainable_params,
        items=tuple(items),
        engine="trace",
        moments=MappingProxyType(moments),
        warnings=warnings,
        settings=MappingProxyType(_settings(train, result, events) | {"alloc_conf": alloc_conf.text} | allocator),
        timeline=downsample(samples),
    )
    advice = advice_sentence(ledger, train)  # the estimate's wording and remedy (vramledger.advice)
    verdict = None
    if gpu is not None:
        verdict = ledger_verdict(ledger, gpu.name, gpu.memory_bytes, headroom)
    snap = None
    if snapshot:
        from vramledger.analytic.overhead import obtainable_bytes
        from vramledger.trace.snapshot import build_snapshot

        steps = tuple(events[i].step if i >= 0 else 1 for i in dev.origin)
        snap = build_snapshot(
            dev,
            steps,
            conf=alloc_conf,
            capacity_bytes=obtainable_bytes(gpu),
            device_total_bytes=None if gpu is None else gpu.memory_bytes,
        )
    return dataclasses.replace(ledger, verdict=verdict, advice=advice), snap


def _settings(train: TrainSpec, result: TraceResult, events: list[Event]) -> dict[str, object]:
    return {
        "method": train.method.value,
        "precision": train.precision.value,
        "optimizer": train.optimizer.value,
        "micro_batch": train.micro_batch,
        "seq_len": train.seq_len,
        "grad_ckpt": train.grad_ckpt,
        "attn": train.attn.value,
        "steps_traced": 2,
        "sdpa_backends": sorted(set(result.sdpa_backends)),
        "versions": result.versions,
        "top_modules": top_modules(events),
        "events": len(events),
        "categories": sorted({c.value for c in Category if any(e.category == c.value for e in events)}),
    } | ({"distributed": wrapper_settings(train)} if train.distributed else {})
