"""The cheapest fixes for an OOM, priced by ``vramledger.plan`` and written in the user's framework keys.

``plan`` prices each remedy alone against the user's setup (memory saved, seconds per optimizer step added); the
fixes are the ones that fit, cheapest in time first, then the fastest combination when no single one fits.
The keys are what ``adapters.writers`` writes for the setup before and after the change (one home for the
key names): LLaMA-Factory, TRL or axolotl; for plain ``TrainingArguments`` (the HF callback) TRL's keys that
``TrainingArguments`` also has (``SFTConfig`` extends it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vramledger.errors import VramledgerError
from vramledger.explain.postmortem import EXPANDABLE_FIX, EXPANDABLE_PRICE, Diagnosis, Fix
from vramledger.specs import GPUSpec, ModelSpec, TrainSpec

MAX_FIXES = 3
_HF_NAMES = {"gradient_checkpointing": "activation_checkpointing"}
"""TRL's keys under their transformers 5 names: ``TrainingArguments.gradient_checkpointing`` is a deprecated alias of
``activation_checkpointing`` (training_args.py ``__post_init__``; ``adapters.hf.read_trainer`` reads both)."""


def changed_keys(
    model: str, before: TrainSpec, after: TrainSpec, fmt: str, allowed: Iterable[str] | None = None
) -> dict[str, object]:
    """Keys whose value differs between ``before`` and ``after`` written as ``fmt`` (``hf``: TRL's, filtered to
    ``allowed``); empty when the writer cannot express either setup."""
    from vramledger.adapters import writers

    target = "trl" if fmt == "hf" else fmt
    if target not in writers.TARGETS:
        return {}
    try:
        a, _ = writers.write_config(model, before, target)
        b, _ = writers.write_config(model, after, target)
    except VramledgerError:
        return {}
    out: dict[str, object] = {k: v for k, v in b.items() if a.get(k) != v}
    out.update({k: None for k in a if k not in b})
    if fmt == "hf":
        out = {_HF_NAMES.get(k, k): v for k, v in out.items()}
    if allowed is not None:
        keep = set(allowed)
        out = {k: v for k, v in out.items() if k in keep}
    return out


def training_arguments_fields() -> frozenset[str] | None:
    """The field names of transformers' ``TrainingArguments`` (None without transformers)."""
    try:
        import dataclasses

        from transformers import TrainingArguments
    except ImportError:
        return None
    return frozenset(f.name for f in dataclasses.fields(TrainingArguments))


def expandable_fix() -> Fix:
    """The fix for fragmentation, whatever the setup: segments that grow in place instead of new ones."""
    return Fix(
        title="allocator: expandable segments",
        change=EXPANDABLE_FIX,
        keys={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
        price=EXPANDABLE_PRICE,
    )


def priced_fixes(
    model: ModelSpec,
    train: TrainSpec,
    gpu: GPUSpec,
    headroom: float,
    *,
    diagnosis: Diagnosis,
    fmt: str,
    model_name: str | None = None,
    need_bytes: int = 0,
) -> tuple[Fix, ...]:
    """Up to ``MAX_FIXES`` fixes: ``expandable_segments`` first when fragmentation is the cause, then the
    cheapest remedies from ``plan`` that fit alone and save at least ``need_bytes`` (what the failure says was
    missing: the prediction may have said it fits), else ``plan``'s fastest fitting combination."""
    from vramledger.plan.planner import plan

    name = model_name or model.name
    allowed = training_arguments_fields() if fmt == "hf" else None
    out: list[Fix] = []
    if diagnosis is Diagnosis.FRAGMENTATION:
        out.append(expandable_fix())
    p = plan(model, train, gpu, headroom)
    alone = sorted(
        (
            r
            for r in p.remedies
            if r.fits and not r.change.changes_task and r.memory_saved > 0 and r.memory_saved >= need_bytes
        ),
        key=lambda r: (r.time_cost_s, -r.memory_saved),
    )
    seen: set[str] = set()
    for r in alone:
        if r.remedy in seen:
            continue
        seen.add(r.remedy)
        after = _spec_after(model, train, gpu, r.change)
        out.append(
            Fix(
                title=r.title,
                change=str(r.change),
                memory_saved_bytes=r.memory_saved,
                time_cost_s=r.time_cost_s,
                fits=True,
                price=r.price,
                keys=changed_keys(name, train, after, fmt, allowed) if after is not None else {},
            )
        )
        if len(out) >= MAX_FIXES:
            break
    if not alone and p.best is not None and p.best.changes:
        best = p.best
        out.append(
            Fix(
                title="plan 1 (no single remedy is enough)",
                change="; ".join(str(c) for c in best.changes),
                memory_saved_bytes=p.baseline.device_total - best.device_total,
                time_cost_s=best.time.step_s - p.baseline.time.step_s,
                fits=True,
                price="the remedies' prices together",
                keys=changed_keys(name, train, best.train, fmt, allowed),
            )
        )
    return tuple(out[:MAX_FIXES])


def _spec_after(model: ModelSpec, train: TrainSpec, gpu: GPUSpec, change: Any) -> TrainSpec | None:
    """The TrainSpec of the variant ``plan`` priced for ``change`` (the same generator, so the same spec)."""
    from vramledger.plan import remedies

    global_batch = train.micro_batch * train.grad_accum
    for v in remedies.variants(change.remedy, model, train, gpu, global_batch=global_batch):
        if str(v.change) == str(change):
            return v.train
    return None
