"""Each step's allocation stream at any padded length, from one trace at a reference length.

Tracing every padded length a run meets would take a trace (seconds to tens of seconds) per length. Instead
the run is traced once, at a reference length ``L0`` chosen to collide with no model dimension, and every
allocation's size is re-derived at the length ``L`` a step sees.

Legend: b micro-batch, be eval batch, L0 reference length, L the step's padded length.

What is assumed (and checked in ``tests/simulate/test_templates.py`` against real traces at held-out lengths,
byte for byte):
- The sequence of ops, allocations and frees of a step does not depend on ``L``: the same model code runs
  (no length-dependent branch: no chunked loss, no sliding window shorter than ``L``, no packed-sequence path).
- Every traced storage holds one tensor of its recorded shape (``StorageInfo.shape``, ``dtype``); its bytes
  are ``round512(itemsize × Π dims)`` (checked at ``L0`` for every storage: one that does not match keeps its
  traced size and is counted in ``unscaled``).
- A dimension depends on the length exactly when it equals ``L0``, ``L0 ± 1`` (ForCausalLMLoss pads the
  labels by one: transformers ``loss/loss_utils.py`` ``ForCausalLMLoss``) or ``b·L0`` (the flattened tokens of
  the loss); it then becomes ``L``, ``L ± 1`` or ``b·L``. An attention score or mask tensor (…, L0, L0)
  becomes (…, L, L). ``L0`` is a prime none of these forms of which equals a model dimension.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vramledger.allocator.replay import AllocEvent, EventKind
from vramledger.analytic.sdpa_mask import MASK_ALIGNMENT, mask_columns
from vramledger.ledger import Category, Phase
from vramledger.specs import ModelSpec, TrainSpec

BLOCK = 512  # c10/cuda/CUDACachingAllocator.cpp kMinBlockSize: every request is rounded to 512 B
_ACC_ID_OFFSET = 1 << 44  # ids of an accumulation micro-step's own gradients (trace ids stay far below)
_REFERENCE_CANDIDATES = (61, 67, 71, 73, 79, 83, 89, 97, 101, 103, 107, 109, 113, 127, 131, 137, 139, 149)

_DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "float64": 8,
    "double": 8,
    "int64": 8,
    "long": 8,
    "int32": 4,
    "int": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


@dataclass(frozen=True, slots=True)
class SizeRule:
    """``bytes(L) = round512(factor × Π ⌈a·L + c⌉_q)`` over the length-dependent dimensions ``terms`` (a, c, q):
    q = 1 but for a padded batch's SDPA mask, whose last dimension the memory-efficient kernel pads to 16
    (trace/shims.py ``cuda_sdpa_mask``)."""

    factor: int
    terms: tuple[tuple[int, int, int], ...]

    def at(self, length: int) -> int:
        n = self.factor
        for a, c, q in self.terms:
            n *= -(-(a * length + c) // q) * q
        return -(-n // BLOCK) * BLOCK if n > 0 else 0


@dataclass(frozen=True, slots=True)
class Segment:
    """A stretch of one step (its forward and backward, its optimizer step, one eval batch) as allocator
    events: ``kinds[i]`` is True for an alloc; ``ids[i]`` names the storage; ``rules[i]`` sizes an alloc."""

    name: str
    kinds: tuple[bool, ...]
    ids: tuple[int, ...]
    rules: tuple[SizeRule | None, ...]
    events: tuple[AllocEvent, ...]
    """The traced events (op, module, phase of each), to say where an allocation failed."""

    def sizes(self, length: int) -> tuple[int, ...]:
        return tuple(r.at(length) if r is not None else 0 for r in self.rules)


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTemplates:
    """The segments of a run, traced once at ``reference_len``.

    ``load``: the model on the device; ``first_fb``/``first_opt``: the first step's forward+backward (with the
    cuBLAS workspaces, allocated by its first matmuls) and optimizer step (which creates the optimizer state);
    ``fb``/``opt``: every later step's; ``fb_acc``: a micro-step after the first of an accumulation window
    (its parameter gradients are summed into the existing ones and freed at once: torch
    ``AccumulateGrad::accumulateGrad``); ``eval``: one evaluation batch (``None`` when not traced).
    """

    load: Segment
    first_fb: Segment
    first_opt: Segment
    fb: Segment
    fb_acc: Segment
    opt: Segment
    eval: Segment | None
    reference_len: int
    micro_batch: int
    eval_batch: int | None
    unscaled: int
    """Storages whose bytes did not follow their shape at the reference length (kept at their traced size)."""
    versions: str


# A padded batch's SDPA mask is padded to MASK_ALIGNMENT columns for the memory-efficient kernel; at a length
# already a multiple the trace makes no padded copy, which the template, traced at a prime, still makes: one
# transient mask more at such lengths (freed at once).


def reference_length(model_dims: Sequence[int], batches: Sequence[int]) -> int:
    """The smallest candidate prime ``L0`` such that none of ``L0 − 1, L0, L0 + 1, b·L0`` and ``⌈L0⌉₁₆`` is a
    model dimension (or half or twice one)."""
    dims = {d for x in model_dims if x > 0 for d in (x, 2 * x, x // 2)}
    for cand in _REFERENCE_CANDIDATES:
        forms = {cand - 1, cand, cand + 1, mask_columns(cand)} | {b * cand for b in batches if b > 1}
        if not forms & dims:
            return cand
    return _REFERENCE_CANDIDATES[-1]


def _model_ints(model: ModelSpec) -> list[int]:
    """The model's dimensions as the ModelSpec derives them, beside the config's (a head size the config leaves to
    hidden_size / num_attention_heads: Qwen2.5's 64, where ⌈61⌉₁₆ = 64 made every q, k and v of the reference
    length 61 look like the padded mask's columns, rebuilt at ⌈L⌉₁₆: Qwen2.5-0.5B LoRA 8 × 256 +12%)."""
    ints = [getattr(model, f.name) for f in dataclasses.fields(model)]
    return [x for x in ints if isinstance(x, int) and not isinstance(x, bool)] + [model.q_dim, model.kv_dim]


def _config_ints(config: dict[str, Any]) -> list[int]:
    out: list[int] = []
    for v in config.values():
        if isinstance(v, bool):
            continue
        if isinstance(v, int):
            out.append(v)
        elif isinstance(v, dict):
            out.extend(_config_ints(v))
    return out


def size_rule(shape: Sequence[int], dtype: str, nbytes: int, *, ref: int, batch: int) -> SizeRule | None:
    """The rule re-deriving a storage's bytes at another length (``None``: its bytes do not follow its
    shape)."""
    itemsize = _DTYPE_BYTES.get(dtype)
    if itemsize is None:
        return None
    factor, terms = itemsize, []
    for d in shape:
        if d == ref:
            terms.append((1, 0, 1))
        elif d == ref + 1:
            terms.append((1, 1, 1))
        elif d == ref - 1:
            terms.append((1, -1, 1))
        elif batch > 1 and d == batch * ref:
            terms.append((batch, 0, 1))
        elif d == mask_columns(ref):
            terms.append((1, 0, MASK_ALIGNMENT))
        else:
            factor *= d
    rule = SizeRule(factor, tuple(terms))
    return rule if rule.at(ref) == nbytes else None


def _segment(name: str, events: Sequence[AllocEvent], rules: dict[int, SizeRule]) -> Segment:
    alloc = EventKind.ALLOC
    return Segment(
        name=name,
        kinds=tuple(e.kind is alloc for e in events),
        ids=tuple(e.id for e in events),
        rules=tuple(rules[e.id] if e.kind is alloc else None for e in events),
        events=tuple(events),
    )


def _acc_variant(fb: Segment, gradient_ids: frozenset[int]) -> Segment:
    """``fb`` with each parameter gradient freed right after it is allocated (summed into the kept one), under
    ids of its own (the kept gradients are still live)."""
    kinds: list[bool] = []
    ids: list[int] = []
    rules: list[SizeRule | None] = []
    events: list[AllocEvent] = []
    for k, i, r, e in zip(fb.kinds, fb.ids, fb.rules, fb.events, strict=True):
        grad = i in gradient_ids
        kinds.append(k)
        ids.append(i + _ACC_ID_OFFSET if grad else i)
        rules.append(r)
        events.append(e)
        if k and grad:
            kinds.append(False)
            ids.append(i + _ACC_ID_OFFSET)
            rules.append(None)
            events.append(AllocEvent.free(i, op="AccumulateGrad", module=e.module, phase=e.phase))
    return Segment(name="fb_acc", kinds=tuple(kinds), ids=tuple(ids), rules=tuple(rules), events=tuple(events))


def build_templates(
    model: ModelSpec,
    train: TrainSpec,
    *,
    eval_batch: int | None = None,
    config: dict[str, Any] | None = None,
    reference: int | None = None,
) -> StepTemplates:
    """Trace the run once at a reference length and cut it into segments (see the module docstring)."""
    from vramledger.catalog.config_of import config_of as hf_config
    from vramledger.trace.api import trace_result
    from vramledger.trace.oom import device_events

    cfg = dict(config) if config is not None else hf_config(model)
    b = train.micro_batch
    dims = _config_ints(cfg) + _model_ints(model) + ([train.lora.rank] if train.lora is not None else [])
    ref = reference or reference_length(dims, [b] + ([eval_batch] if eval_batch else []))
    traced = dataclasses.replace(train, seq_len=ref)
    result, events = trace_result(model, traced, config=cfg, eval_shape=(eval_batch, ref) if eval_batch else None)
    dev = device_events(events, None)

    rules: dict[int, SizeRule] = {}
    unscaled = 0
    for ev, src in zip(dev.events, dev.origin, strict=True):
        if ev.kind is not EventKind.ALLOC:
            continue
        info = result.storages.get(ev.id) if src >= 0 else None
        rule = None
        if info is not None:
            batch = eval_batch if info.phase is Phase.EVAL and eval_batch else b
            rule = size_rule(info.shape, info.dtype, ev.size, ref=ref, batch=batch)
        if rule is None:
            unscaled += src >= 0
            rule = SizeRule(ev.size, ())
        rules[ev.id] = rule

    def part(step: int, phases: tuple[Phase, ...]) -> list[Any]:
        """The events of ``step`` in ``phases`` whose storage was allocated in that same step (the trace's
        teardown frees weights and optimizer state at its end: not part of a step)."""
        own = {
            ev.id
            for ev, src in zip(dev.events, dev.origin, strict=True)
            if ev.kind is EventKind.ALLOC and (src < 0 or events[src].step == step)
        }
        out = []
        for ev, src in zip(dev.events, dev.origin, strict=True):
            e_step = events[src].step if src >= 0 else 1  # cuBLAS workspaces: first forward/backward
            phase = ev.phase
            if e_step == step and phase in phases and ev.id in own:
                out.append(ev)
        return out

    fb_phases = (Phase.FORWARD, Phase.BACKWARD)
    load = [
        ev
        for ev, src in zip(dev.events, dev.origin, strict=True)
        if src >= 0 and events[src].phase is Phase.LOAD and ev.kind is EventKind.ALLOC
    ]
    fb = _segment("fb", part(2, fb_phases), rules)
    gradients = frozenset(
        i
        for i, k in zip(fb.ids, fb.kinds, strict=True)
        if k and (s := result.storages.get(i)) is not None and s.category == Category.GRADIENTS.value
    )
    eval_seg = _segment("eval", part(3, (Phase.EVAL,)), rules) if eval_batch else None
    return StepTemplates(
        load=_segment("load", load, rules),
        first_fb=_segment("first_fb", part(1, fb_phases), rules),
        first_opt=_segment("first_opt", part(1, (Phase.OPTIMIZER,)), rules),
        fb=fb,
        fb_acc=_acc_variant(fb, gradients),
        opt=_segment("opt", part(2, (Phase.OPTIMIZER,)), rules),
        eval=eval_seg,
        reference_len=ref,
        micro_batch=b,
        eval_batch=eval_batch,
        unscaled=unscaled,
        versions=result.versions,
    )
