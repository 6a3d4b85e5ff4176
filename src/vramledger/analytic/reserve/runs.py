"""A run's peak reserved (``peak_reserved``): a packed run meets one shape; a run with dynamic padding meets every
shape up to (B, L) and the allocator keeps each one's segments, so it gets the largest single-shape reserve over
them, the mechanisms that switch off as the shape grows included (``held_reserved``; docs/reserve.md "Runs")."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from functools import lru_cache, partial
from typing import NamedTuple

from vramledger.allocator.conf import K_SMALL_SIZE
from vramledger.analytic.activations import sdpa_math
from vramledger.analytic.parts import StepParts
from vramledger.analytic.reserve.ckpt_forward import forward_block_width
from vramledger.analytic.reserve.forward_cache import mask_bytes
from vramledger.analytic.reserve.freeze import frozen_head, frozen_head_regions
from vramledger.analytic.reserve.full import decoder_mlp_width, relaid_regions
from vramledger.analytic.reserve.held_activations import eligibility_edges, mlp_tensors_unfit, scores_edges
from vramledger.analytic.reserve.load_residue import loss_tails_switch
from vramledger.analytic.reserve.optimizers import (
    checkpointed_forward_switch,
    fused_relaid_switch,
    temporaries_switch,
    tied_sum_switch,
)
from vramledger.analytic.reserve.shape import chain_gradients_at, single_shape, states_beside_chain, workspace_in_chain
from vramledger.analytic.reserve.softcap import latest_on, softcap_remade
from vramledger.analytic.reserve.spill import displaced_remade, replayed_setup
from vramledger.analytic.reserve.state_rests import band_edges, rests_band
from vramledger.analytic.reserve.switches import NONE, ShapePeaks, Switching
from vramledger.analytic.reserve.workspace import (
    cublas_workspace_block,
    dequantised_block,
    rival_holds_workspace,
    workspace_band,
    workspace_band_on,
    workspace_rivals_per_token,
)
from vramledger.specs import Attention, Loss, ModelSpec, TrainSpec

# Three mechanisms the replay shows switch OFF as the shape grows: a longer batch brings a block large enough
# for what was stranded (the backward thread's cuBLAS workspace in an fp32 logits block, adapters; activation
# blocks too small for the optimizer, full without checkpointing; a tied embedding's gradient block, full). A
# single shape's reserve therefore falls from one length to the next. A run with dynamic padding meets shorter
# batches too, and the allocator never gives their segments back: replayed through one allocator, a run whose
# first steps are at a shorter length reserves at least what that length reserves on its own, and every longer
# step adds its own segments on top (bench/reserve/runs.jsonl, docs/reserve.md "Runs"; Llama-3.2-3B full,
# bf16-true, 4 × 768: 39.9 GiB when two steps at 648 tokens come first, 34.7 GiB for 768 alone). So the estimate
# of such a run is the largest single-shape reserve, these mechanisms included, over the shapes ≤ (B, L): the
# shorter batches of B sequences and the last, partial batch of an epoch (fewer sequences). Each mechanism is on
# over a set of shapes closed downwards, and what it adds grows inside that set, so the largest is at a shape on
# the set's upper edge (``largest_on``); the set grows with (B, L), so the estimate never falls.


def peak_reserved(
    m: ModelSpec,
    train: TrainSpec,
    p: StepParts,
    loss_peak: int,
    step_peak: int,
    opt_peak: int | None = None,
    at: ShapePeaks | None = None,
) -> int:
    """Peak reserved of a run at (B, L), in closed form, from the caching allocator's rules; for a run with dynamic
    padding it never falls as batch or length grow (the planner's searches rely on that).

    ``loss_peak``: allocated bytes at the forward or backward peak (inside the loss); ``step_peak``: the largest
    phase's allocated bytes; ``opt_peak``: allocated at ``optimizer.step()`` (default ``step_peak``); ``at``: the
    same peaks of the step at another shape (``StepParts`` and allocated bytes), for a run with dynamic padding.
    A packed run (``train.packing``) meets one shape, every step B × L, and gets that shape's reserve with every
    mechanism that is on there (``on_at``): the figure falls where one switches off as the shape grows, as the
    replay's does (bench/reserve/replay_grid.jsonl against the packed estimate, ``run_grid.py --table``); a run with
    dynamic padding meets every shape up to (B, L) and keeps the segments each made, so it gets the largest
    single-shape reserve, those mechanisms included, over the shapes it meets (``held_reserved``), which never
    falls. A call without ``at`` gets the single shape's reserve without the mechanisms (``NONE``).
    """
    opt_peak = step_peak if opt_peak is None else opt_peak
    if at is None:
        return single_shape(m, train, p, loss_peak, step_peak, opt_peak, NONE)
    parts_at = parts_of(at)
    if train.packing:
        own = single_shape(m, train, p, loss_peak, step_peak, opt_peak, on_at(m, train, p), parts_at)
        if displaced_remade(m, train, p) is None:
            return own
        # the two steps replayed (spill.py) are not held over shorter shapes, so a run with dynamic padding keeps the
        # closed forms; it meets B × L too, so the packed run's figure is at most its (the replay's count at B × L is
        # more than they hold on 2% of random shapes, by up to 5%: there the padded run's figure stands for both)
        padded = replace(train, packing=False)
        pp, lp, sp, op = at(padded)
        return min(own, peak_reserved(m, padded, pp, lp, sp, op, at))
    single = single_shape(m, train, p, loss_peak, step_peak, opt_peak, Switching(relaid=True), parts_at)
    if not replayed_setup(m, train, p):
        return max(single, held_reserved(m, train, at, p))
    # the closed forms bound the replayed figure, which adds the padded batch's mask and repeated K/V (``closed_at``);
    # the held reserve is asked for only where the single shape's figure leaves the minimum open
    envelope, mask = replayed_envelope(m, train, at), mask_bytes(m, train, p)
    if envelope <= single + mask:
        return max(step_peak, envelope)
    return max(step_peak, min(max(single, held_reserved(m, train, at, p)) + mask, envelope))


# A run with dynamic padding where the two steps are replayed at each shape (spill.py ``displaced_remade``): the
# replay's figure falls and rises with the length (Qwen3-1.7B full, bf16-true, 4 × ℓ: 49.97 GiB at 1920 tokens, 46.69
# at 1952, 48.43 at 2048; the traced templates' replay likewise, bench/reserve/runs.jsonl), so no single shape's
# figure is the run's, and the closed forms, held over the shorter shapes, put the run 4-9% over what any length
# ≤ L reserves on its own (docs/reserve.md, "A padded run of the two steps replayed"). The run's figure is then the
# largest replayed figure over the shapes it meets, searched on a lattice of lengths fixed for every run (64 points
# an octave, multiples of 8): the set searched grows with (B, L), so the figure never falls; a length between two
# points stands for the next point up (at most 1.1% longer, and never more than the closed forms at (B, L)).
_LATTICE = 64


def _lattice_length(k: int) -> int:
    """The lattice's k-th length: 2^(k/64) rounded up to a multiple of 8 (every power of two ≥ 8 among them)."""
    return 8 * math.ceil(2 ** (k / _LATTICE) / 8)


def _lattice_at_or_above(length: int) -> int:
    """The index of the smallest lattice length ≥ ``length``."""
    k = max(0, int(_LATTICE * math.log2(max(length, 1))) - 2)
    while _lattice_length(k) < length:
        k += 1
    return k


def replayed_envelope(m: ModelSpec, train: TrainSpec, at: ShapePeaks) -> int:
    """The largest replayed figure of a run with dynamic padding over the shapes (b, ℓ) it meets: b ≤ B sequences
    (the last batch of an epoch has fewer), ℓ on the lattice up to the first point ≥ L. At each shape, the packed
    run's own figure (the two steps replayed, ``single_shape`` with the mechanisms on there) plus what the padded
    batch's mask and repeated K/V add (forward_cache.py ``mask_bytes``: live at the loss peak, in segments of their
    own), at most the closed forms' figure at that shape; the closed forms' figure where the steps are not replayed.

    Searched from (B, L⁺) down: the closed forms' figure never falls as the shape grows and bounds each shape's, so
    once it is no more than the largest found, no shorter shape can beat it (a few replays a run, each cached)."""
    top = _lattice_at_or_above(train.seq_len)
    return _envelope(m, train.at_shape(train.micro_batch, _lattice_length(top)), at)


@lru_cache(maxsize=1024)
def _envelope(m: ModelSpec, train: TrainSpec, at: ShapePeaks) -> int:
    packed = replace(train, packing=True)
    if displaced_remade(m, packed, at(packed)[0]) is None:  # the replayed shapes are closed upwards in b·ℓ
        return closed_at(m, train, at=at)
    return lattice_envelope(
        train, partial(closed_below, m, at=at), partial(closed_at, m, at=at), partial(replay_figure, m, at=at)
    )


def lattice_envelope(
    train: TrainSpec,
    below: Callable[[TrainSpec], int],
    bound: Callable[[TrainSpec], int],
    replayed: Callable[[TrainSpec], int | None],
) -> int:
    """The largest figure over the shapes t = (b, ℓ), b ≤ B and ℓ on the lattice up to the first point ≥ L
    (``train``'s (B, L)): ``replayed(t)`` at most ``bound(t)``, or ``bound(t)`` where ``replayed`` is None. Searched
    down from (B, L⁺): ``bound`` never falls as the shape grows and is at least the figure at its shape, so the search
    stops along ℓ, and then along b, where it is no more than the largest found.

    ``below(t)`` is at most ``bound(t)`` and costs a fraction of it (the closed forms without the reserve held over
    shorter shapes, which is rarely the larger): where it is above the largest found the search goes on without
    ``bound(t)``, and where the replayed figure is no more than it, that figure is the shape's; ``bound(t)`` is
    asked for only where either is in doubt. The shapes visited and the figure are those of the search on ``bound``
    alone."""
    top = _lattice_at_or_above(train.seq_len)
    best = 0
    for b in range(train.micro_batch, 0, -1):
        last = 0
        for k in range(top, -1, -1):
            ell = _lattice_length(k)
            if ell == last:
                continue
            t = train.at_shape(b, ell)
            low = below(t)
            most = None
            if low <= best:
                most = bound(t)
                if most <= best:
                    break
            last = ell
            figure = replayed(t)
            if figure is not None and figure <= low:  # the bound is at least ``low``: the figure is the shape's
                best = max(best, figure)
                continue
            most = bound(t) if most is None else most
            best = max(best, most if figure is None else min(most, figure))
        if not last:  # even b sequences of the longest length stay below: so do fewer
            break
    return best


@lru_cache(maxsize=8192)
def closed_below(m: ModelSpec, train: TrainSpec, *, at: ShapePeaks) -> int:
    """``closed_at`` without the reserve held over shorter shapes (``held_reserved``): the single shape's closed
    forms plus the mask, at most ``closed_at`` and a fraction of its cost (``held_reserved`` searches the switching
    mechanisms' edges), for ``lattice_envelope``'s search."""
    p, loss_peak, step_peak, opt_peak = at(train)
    single = single_shape(m, train, p, loss_peak, step_peak, opt_peak, Switching(relaid=True), parts_of(at))
    return single + _mask_at(m, train, at)


@lru_cache(maxsize=8192)
def closed_at(m: ModelSpec, train: TrainSpec, *, at: ShapePeaks) -> int:
    """The closed forms' figure of a run with dynamic padding at ``train``'s shape (``peak_reserved`` without the
    replayed envelope), plus what the padded batch's mask and repeated K/V add (forward_cache.py ``mask_bytes``),
    the bound of the replayed figure there (``replay_figure``), which adds them too.

    The closed forms count those bytes where they are allocated, at the loss peak; the step's peak reserved is its
    optimizer's, where they are freed, so the closed figure was the packed batch's (the 8-layer toy, full 2 × 1024:
    3911 MiB both ways). The replay of the padded run (bench/reserve/runs_padded.jsonl) keeps their segments to the
    optimizer's peak: 4082 MiB at 2 × 1016 against 3990 packed. Bounded by the closed forms without them, the
    replayed figure (4071 MiB) was cut to 3911, −4.2%; bounded with them, −2.2% (and three 2-layer toy runs,
    −3.6…−4.4% → −1.2…−2.9%; docs/reserve.md)."""
    held = held_reserved(m, train, at, at(train)[0]) + _mask_at(m, train, at)
    return max(closed_below(m, train, at=at), held)


def replay_figure(m: ModelSpec, train: TrainSpec, *, at: ShapePeaks) -> int | None:
    """The replayed figure at ``train``'s shape (``replayed_envelope``) before the closed forms' bound: the packed
    run's own figure plus the padded batch's mask; None where the two steps are not replayed there (the closed forms'
    figure is the shape's)."""
    packed = replace(train, packing=True)
    pp, loss_peak, step_peak, opt_peak = at(packed)
    if displaced_remade(m, packed, pp) is None:
        return None
    own = single_shape(m, packed, pp, loss_peak, step_peak, opt_peak, on_at(m, packed, pp), parts_of(at))
    return own + _mask_at(m, train, at)


@lru_cache(maxsize=8192)
def _mask_at(m: ModelSpec, train: TrainSpec, at: ShapePeaks) -> int:
    """forward_cache.py ``mask_bytes`` at ``train``'s shape (the envelope's searches ask again at the same shapes)."""
    return mask_bytes(m, train, at(train)[0])


def parts_of(at: ShapePeaks) -> Callable[[TrainSpec], StepParts]:
    """The step's parts alone at another shape, where the ``ShapePeaks`` offers them (analytic/step.py
    ``_ShapePeaks.parts``: the moments at each shape cost more than the parts, and the searches visit hundreds)."""
    parts: Callable[[TrainSpec], StepParts] | None = getattr(at, "parts", None)
    return parts if parts is not None else (lambda t: at(t)[0])


def on_at(m: ModelSpec, train: TrainSpec, p: StepParts) -> Switching:
    """The mechanisms a shape's own reserve counts: the blocks step 2 makes again, and every switching mechanism
    that is on at the shape ``train`` (B, L)."""
    B, L = train.micro_batch, train.seq_len
    return Switching(relaid=True, **{name: True for name, holds in _switches(m, train, p).items() if holds(B, L)})


def _switches(m: ModelSpec, train: TrainSpec, p: StepParts) -> dict[str, Callable[[int, int], bool]]:
    """Every switching mechanism that applies, by ``Switching`` field, with where it is on: the closed ones, eager's
    workspace band, the states' rests (a band) and Gemma-2's softcap block (on and off every few tokens)."""
    out = _closed_switches(m, train, p)
    if (band := workspace_band_on(m, train, p)) is not None:  # eager's band of lengths, beside the closed set
        closed = out.get("workspace")
        out["workspace"] = band if closed is None else (lambda b, ell: closed(b, ell) or band(b, ell))
    if (rests := rests_band(m, train, p)) is not None:
        out["state_rests"] = rests
    if (softcap := softcap_remade(m, train) if train.adapters else None) is not None:
        out["softcap"] = softcap
    return out


def held_reserved(m: ModelSpec, train: TrainSpec, at: ShapePeaks, p: StepParts | None = None) -> int:
    """The largest single-shape reserve, the switching mechanisms included, over the shapes ≤ (B, L) where they
    are on (0 where none is on anywhere); each set's upper edge is enough (see above). Beyond the largest
    micro-batch and length where a mechanism is on nothing changes, so the figure is computed (and cached) for
    (B, L) capped there: the planner asks for many shapes past the edge. ``p``: the step at (B, L), when the
    caller has it (default ``at(train)``)."""
    regions = _regions(m, train, at(train)[0] if p is None else p, at)
    if not regions:
        return 0
    B = max((pts[-1][0] for _, pts in regions if pts), default=1)
    L = max((ell for _, pts in regions for _, ell in pts), default=1)
    return _held_capped(m, train.at_shape(min(B, train.micro_batch), min(L, train.seq_len)), at)


@lru_cache(maxsize=4096)
def _held_capped(m: ModelSpec, train: TrainSpec, at: ShapePeaks) -> int:
    best = 0
    p = at(train)[0]
    also = _switches(m, train, p)
    shapeless = train.at_shape(1, 1)
    # the regions share many edges: each shape's mechanisms are found once, each (shape, mechanisms) reserve read once
    mechanisms: dict[tuple[int, int], dict[str, bool]] = {}
    seen: set[tuple[int, int, Switching]] = set()
    for which, points in _regions(m, train, p, at):
        # (b, ℓ_b) with ℓ_(b+1) = ℓ_b lies under (b + 1, ℓ_b): the reserve grows with b, so it is left out
        edge = [pt for pt, nxt in zip(points, [*points[1:], (0, 0)], strict=False) if nxt[1] < pt[1]]
        for b, ell in edge:
            named = mechanisms.get((b, ell))
            if named is None:
                named = mechanisms[b, ell] = {name: True for name, holds in also.items() if holds(b, ell)}
            # the shape's own reserve: every mechanism on there, not only the region's
            on = which._replace(relaid=True, **named)
            if (b, ell, on) not in seen:
                seen.add((b, ell, on))
                best = max(best, _shape_reserve(m, shapeless, b, ell, at, on))
    return best


@lru_cache(maxsize=8192)
def _shape_reserve(m: ModelSpec, shapeless: TrainSpec, b: int, ell: int, at: ShapePeaks, on: Switching) -> int:
    """The reserve of the setup ``shapeless`` at b × ℓ with the mechanisms ``on``: the (B, L) a planner asks for
    share most of their edges."""
    t = shapeless.at_shape(b, ell)
    pt, loss, step, opt = at(t)
    return single_shape(m, t, pt, loss, step, opt, on, parts_of(at))


def _closed_switches(m: ModelSpec, train: TrainSpec, p: StepParts) -> dict[str, Callable[[int, int], bool]]:
    """The switching mechanisms whose shapes are closed downwards, by ``Switching`` field, with where each is on."""
    on = switches_on(m, train, p)
    found = {
        "workspace": on.workspace,
        "activations": on.activations,
        "tied": on.tied,
        "temporaries": temporaries_switch(m, train, p),
        "tied_sum": tied_sum_switch(m, train, p),
        "fused_relaid": fused_relaid_switch(m, train, p),
        "loss_tails": loss_tails_switch(m, train, p),
        "checkpointed_forward": checkpointed_forward_switch(m, train, p),
    }
    return {name: holds for name, holds in found.items() if holds is not None}


@lru_cache(maxsize=32)
def _regions(
    m: ModelSpec, train: TrainSpec, p: StepParts, at: ShapePeaks
) -> list[tuple[Switching, list[tuple[int, int]]]]:
    """Each switching mechanism (and activations with tied together) that applies, with the upper edge of the
    shapes ≤ (B, L) where it is on (``largest_on``). Cached: ``held_reserved`` asks for them at (B, L), and then
    ``_held_capped`` again where (B, L) is within the edges (read only)."""
    on = switches_on(m, train, p)
    regions: list[tuple[Switching, Callable[[int, int], bool]]] = []
    if on.workspace is not None:
        regions.append((Switching(workspace=True), on.workspace))
    acts: list[Callable[[int, int], bool]] = []
    if on.activations is not None:  # and below each edge where more matrices' tensors fit (held_activations.py)
        act = on.activations
        edges = eligibility_edges(m, train, p, decoder_mlp_width(m)) + scores_edges(m, train, p)
        acts = [act, *(_both(act, e) for e in edges)]
        regions += [(Switching(activations=True), a) for a in acts]
    if on.tied is not None:
        regions.append((Switching(tied=True), on.tied))
        regions += [(Switching(activations=True, tied=True), _both(a, on.tied)) for a in acts]
    temporaries = temporaries_switch(m, train, p)
    if temporaries is not None:
        regions.append((Switching(temporaries=True), temporaries))
    tied_sum = tied_sum_switch(m, train, p)
    if tied_sum is not None:
        regions.append((Switching(tied_sum=True), tied_sum))
    fused = fused_relaid_switch(m, train, p)
    if fused is not None:
        regions.append((Switching(fused_relaid=True), fused))
    tails = loss_tails_switch(m, train, p)
    if tails is not None:
        regions.append((Switching(loss_tails=True), tails))
    forward = checkpointed_forward_switch(m, train, p)
    if forward is not None:  # and below each edge where more matrices' tensors fit the forward's blocks
        width = forward_block_width(m, train.precision.compute.bytes)
        edges = [forward, *(_both(forward, e) for e in eligibility_edges(m, train, p, width))]
        regions += [(Switching(checkpointed_forward=True), f) for f in edges]
    if frozen_head(train, p):
        relaid = frozen_head_regions(m, train, p)
    else:
        # the states beside the chain at each shape; none at (B, L), where the room for them is the largest, means
        # none anywhere (and no step to compute at each shape)
        some = states_beside_chain(m, train, p) > 0
        parts_at = parts_of(at)
        beside = (lambda t: states_beside_chain(m, t, parts_at(t))) if some else None
        grads = chain_gradients_at(m, train, at)
        counts = _relaid_counts(m, train.at_shape(1, 1), p.state_bytes, at, some)
        if len(counts) > 1 << 14:  # a bound on what a long search keeps (a frontier's whole grid visits ~3,500)
            counts.clear()
        relaid = relaid_regions(m, train, p, beside, lambda t: workspace_in_chain(m, t, p), grads, counts)
    regions += [(Switching(relaid=True), on_k) for on_k in relaid]
    if (math := _math_below_window(m, train)) is not None:
        regions.append((NONE, math))
    out = [(which, largest_on(train.micro_batch, train.seq_len, region)) for which, region in regions]
    band = workspace_band(m, train, p)
    if band:
        out.append((Switching(workspace=True), band))
    out += [(Switching(state_rests=True), [pt]) for pt in band_edges(m, train, p)]
    softcap = softcap_remade(m, train) if train.adapters else None
    if softcap is not None:  # on and off every few tokens: the latest shape ≤ (b, L) where it is on, and the
        # latest under each other region's edge (b, ℓ_b), where both are on: a closed region (the workspace's) can
        # stop below L, and its edge's reserve then lacks the softcap block (Gemma-2-2B LoRA 2 × 420 → 2 × 457)
        under = [pt for _, points in out for b, ell in points for pt in latest_on(b, ell, softcap) if pt[0] == b]
        out += [(Switching(softcap=True), [pt]) for pt in sorted(set(under))]
        out.append((Switching(softcap=True), latest_on(train.micro_batch, train.seq_len, softcap)))
    return out


def _math_below_window(m: ModelSpec, train: TrainSpec) -> Callable[[int, int], bool] | None:
    """Where SDPA runs its math kernel only below the sliding window (activations.py ``sdpa_math``: fp32 with grouped
    heads, no mask until the length reaches the window): shorter batches save fp32 probabilities in every layer and
    leave their segments, which a run with dynamic padding keeps (Gemma-3-1B LoRA, fp32, checkpointing, 1 × 511 → 512:
    the single shape's reserve falls by 79 MiB). None where no length runs the math kernel."""
    window = m.sliding_window
    if not m.sliding_layers or window <= 1 or not sdpa_math(m, train.at_shape(train.micro_batch, window - 1)):
        return None
    return lambda b, ell: ell < window  # at (B, L) under the window too: held_reserved asks again at its edges


@lru_cache(maxsize=16)
def _relaid_counts(
    m: ModelSpec, shapeless: TrainSpec, states: int, at: ShapePeaks, beside: bool
) -> dict[tuple[int, ...], int]:
    """The blocks the states reach at each shape (full.py ``relaid_regions``' ``counts``), for one setup whatever its
    (B, L): ``shapeless`` (the setup at 1 × 1), the states' bytes, the steps at other shapes ``at`` reads (for the
    room beside the chain and the gradients in it) and whether the room is counted. The planner's searches ask for
    hundreds of shapes of one setup, each estimate probing the same shapes ≤ (B, L)."""
    return {}


def _both(f: Callable[[int, int], bool], g: Callable[[int, int], bool]) -> Callable[[int, int], bool]:
    """Where both ``f`` and ``g`` are on (closed downwards where both are)."""
    return lambda b, ell: f(b, ell) and g(b, ell)


class _Predicates(NamedTuple):
    workspace: Callable[[int, int], bool] | None
    activations: Callable[[int, int], bool] | None
    tied: Callable[[int, int], bool] | None


def switches_on(m: ModelSpec, train: TrainSpec, p: StepParts) -> _Predicates:
    """For each switching mechanism that applies to the setup, whether it is on at (b, ℓ) (None: it never is)."""
    wb = p.weights
    c, bw = train.precision.compute.bytes, wb.trainable_dtype.bytes
    standard = train.loss is Loss.STANDARD and c != 4 and wb.trainable_layers
    adapters = train.adapters or wb.largest_trainable_numel * bw <= K_SMALL_SIZE
    workspace = activations = tied = None
    if adapters and train.adapters and standard:
        ws = cublas_workspace_block(p)
        per_token = max(workspace_rivals_per_token(m, train, p))
        # eager's scores ∝ b·ℓ², DoRA's weight norm constant (StepParts.forward_layer_temp)
        scores, B, L = p.forward_layer_temp - p.dora_temp, train.micro_batch, train.seq_len

        dequantised = dequantised_block(train, p)
        held = rival_holds_workspace(m, train, p) if dequantised else lambda tokens: per_token * tokens >= ws

        def workspace(b: int, ell: int) -> bool:
            layer_temp = max(p.dora_temp + scores * b * ell * ell // (B * L * L), dequantised)
            return not held(b * ell) and layer_temp < ws and softmax32(b, ell) <= ws

        def softmax32(b: int, ell: int) -> int:
            """Eager's fp32 softmax, freed once cast back (transformers ``eager_attention_forward``:
            ``softmax(attn_weights, dtype=torch.float32).to(query.dtype)``): 4·nh·ℓ² per sequence. One exactly the
            workspace's size does not take it in the replay (Llama-3.2-1B LoRA eager 1 × 512: 32 MiB)."""
            return 4 * m.num_heads * b * ell * ell if train.attn is Attention.EAGER else 0

    if not adapters and wb.trainable_layers and not train.grad_ckpt:
        # the c·I·T block's segment under b·H·I (held_activations.py)
        def activations(b: int, ell: int) -> bool:
            return mlp_tensors_unfit(c, bw, m.hidden_size, decoder_mlp_width(m), b * ell)

    tied_states = (
        m.tie_word_embeddings and wb.embedding_trainable and (p.state_bytes >= p.grad_bytes or not p.state_bytes)
    )
    if not adapters and train.loss is Loss.STANDARD and wb.trainable_layers and tied_states:
        # 4·V·T < V·H·b ⟺ 4·T < H·b (tied_gradient_block)
        def tied(b: int, ell: int) -> bool:
            return 4 * b * ell < bw * m.hidden_size

    return _Predicates(workspace, activations, tied)


def largest_on(B: int, L: int, on: Callable[[int, int], bool]) -> list[tuple[int, int]]:
    """For each micro-batch b ≤ B, the longest length ℓ ≤ L with ``on(b, ℓ)`` (``on`` holds on every smaller
    shape where it holds; micro-batches where it holds at no length are left out).

    ℓ_b never grows with b, and most mechanisms switch at a token count b·ℓ (their blocks are V·T, H·T, I·T), so
    the search for b starts from the length holding the previous edge's tokens, ⌊(b − 1)·ℓ_(b−1) / b⌋, at most
    ℓ_b then: two or three probes a micro-batch where a bisection over [1, ℓ_(b−1)] takes a dozen (a planner's
    frontier asks for hundreds of estimates, each searching every b ≤ B). Where the guess is off (eager's b·ℓ²
    blocks) the search still ends at the same ℓ_b, in more probes."""
    out = []
    hi = L
    for b in range(1, B + 1):
        guess = hi if b == 1 else max(hi * (b - 1) // b, 1)
        ell = _largest_from(partial(on, b), guess, hi)
        if not ell:
            break
        out.append((b, ell))
        hi = ell
    return out


def _largest_from(holds: Callable[[int], bool], guess: int, hi: int) -> int:
    """The largest ℓ in [1, hi] with ``holds(ℓ)`` (true up to some ℓ, false after; 0 where ``holds(1)`` is false),
    searched from ``guess`` in [1, hi]: where it holds there, steps of 1, 2, 4, … up until one fails, then a
    bisection (O(log d) probes for an answer d above the guess); where not, a bisection below it."""
    lo, step = 0, 1  # holds(lo) (0: below every length); the answer is ≤ hi
    if holds(guess):
        lo = guess
        while lo < hi:
            probe = min(guess + step, hi)
            if not holds(probe):
                hi = probe - 1
                break
            lo, step = probe, 2 * step
    else:
        hi = guess - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if holds(mid) else (lo, mid - 1)
    return lo
