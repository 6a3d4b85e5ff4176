"""The searches behind a padded run's reserve (reserve/runs.py): the upper edge of a set of shapes closed
downwards (``largest_on``, searched from a guess), and the counts the planner's many (B, L) of one setup share.

Truths used: a brute-force scan of every shape, written here; the same figures computed with every cache of
runs.py emptied before each shape.
"""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from vramledger.analytic.reserve import runs
from vramledger.analytic.reserve.runs import largest_on
from vramledger.analytic.step import _ShapePeaks, step_parts
from vramledger.catalog import resolve_model
from vramledger.specs import Attention, Method, Precision, TrainSpec


def _scan(B: int, L: int, on: Callable[[int, int], bool]) -> list[tuple[int, int]]:
    """Every shape tried: for each b ≤ B the longest ℓ ≤ L where ``on`` holds, up to the first b with none."""
    out = []
    for b in range(1, B + 1):
        ell = max((ell for ell in range(1, L + 1) if on(b, ell)), default=0)
        if not ell:
            break
        out.append((b, ell))
    return out


@settings(max_examples=300, deadline=None)
@given(
    B=st.integers(1, 12),
    L=st.integers(1, 300),
    tokens=st.integers(0, 4000),
    square=st.integers(0, 40_000),
    drops=st.lists(st.integers(0, 60), min_size=12, max_size=12),
)
def test_the_edge_is_the_scans(B: int, L: int, tokens: int, square: int, drops: list[int]) -> None:
    """Sets closed downwards as the mechanisms make them: under a token count (b·ℓ ≤ T), under eager's b·ℓ², and
    an arbitrary staircase (each b's longest length a drop below the previous one's), and where all three hold."""
    stairs = [300 - sum(drops[: b + 1]) for b in range(12)]

    def on(b: int, ell: int) -> bool:
        return b * ell <= tokens and b * ell * ell <= square * 10 and ell <= stairs[b - 1]

    for pred in (on, lambda b, ell: b * ell <= tokens, lambda b, ell: ell <= stairs[b - 1]):
        assert largest_on(B, L, pred) == _scan(B, L, pred)


def _uncached(fn: Callable[[], int]) -> int:
    for cached in (runs._held_capped, runs._regions, runs._shape_reserve, runs._relaid_counts):
        cached.cache_clear()
    return fn()


def test_shapes_of_one_setup_share_counts_without_changing_a_figure() -> None:
    """Qwen2.5-0.5B full fine-tuning under checkpointing (the relaid regions' counts, shared by every (B, L)), fp32
    (the gradients in the chain at each shape) and eager bf16 (eager's blocks): each shape's held reserve, asked for
    in turn after the others, equals the figure computed with every cache emptied."""
    m = resolve_model("qwen2.5-0.5b")
    at = _ShapePeaks(m, None)
    setups = [
        TrainSpec(method=Method.FULL, grad_ckpt=True),
        TrainSpec(method=Method.FULL, grad_ckpt=True, precision=Precision.FP32),
        TrainSpec(method=Method.FULL, attn=Attention.EAGER),
    ]
    shapes = [(16, 8192), (8, 2048), (1, 8192), (4, 512), (16, 1024), (3, 700), (8, 2048), (2, 4096)]
    trains = [setup.at_shape(b, ell) for setup in setups for b, ell in shapes]
    warm = [runs.held_reserved(m, t, at, step_parts(m, t)) for t in trains]
    cold = [_uncached(lambda t=t: runs.held_reserved(m, t, at, step_parts(m, t))) for t in trains]
    assert warm == cold
    assert all(warm)  # a mechanism on at every shape: the searches ran


def _lattice(L: int) -> list[int]:
    """The lattice's distinct lengths up to the first ≥ L (runs.py ``_lattice_length``), written out."""
    out: list[int] = []
    k = 0
    while not out or out[-1] < L:
        ell = 8 * -(-(2 ** (k / 64)) // 8)
        if not out or int(ell) != out[-1]:
            out.append(int(ell))
        k += 1
    return out


@settings(max_examples=200, deadline=None)
@given(
    B=st.integers(1, 6),
    L=st.integers(1, 400),
    slope=st.integers(0, 50),
    below_gap=st.lists(st.integers(0, 3000), min_size=1, max_size=40),
    figures=st.lists(st.one_of(st.none(), st.integers(0, 30_000)), min_size=1, max_size=40),
)
def test_the_lattice_search_is_the_largest_figure_over_every_shape(
    B: int, L: int, slope: int, below_gap: list[int], figures: list[int | None]
) -> None:
    """``lattice_envelope`` against a scan of every lattice shape (b ≤ B, ℓ ≤ L⁺): the largest figure, each at most its
    shape's bound (the bound itself where there is none). The bound never falls as (b, ℓ) grows; the cheap one below it
    (``below``, which lets the search skip the bound) is anything under it; the figures anything, above the bound
    too."""
    train = TrainSpec(method=Method.FULL, micro_batch=B, seq_len=L)
    asked: list[tuple[int, int]] = []

    def bound(t: TrainSpec) -> int:
        asked.append((t.micro_batch, t.seq_len))
        return 1000 * t.micro_batch + slope * t.seq_len

    def below(t: TrainSpec) -> int:
        return bound(t) - below_gap[(t.micro_batch * 7 + t.seq_len) % len(below_gap)]

    def replayed(t: TrainSpec) -> int | None:
        return figures[(t.micro_batch * 13 + t.seq_len // 8) % len(figures)]

    def figure(b: int, ell: int) -> int:
        t = train.at_shape(b, ell)
        r, most = replayed(t), bound(t)
        return most if r is None else min(most, r)

    scan = max(figure(b, ell) for b in range(1, B + 1) for ell in _lattice(L))
    assert runs.lattice_envelope(train, below, bound, replayed) == scan


def test_the_padded_envelope_is_the_scan_of_its_shapes() -> None:
    """Qwen2.5-0.5B full, bf16-true, 2 × 1024: the replayed envelope equals the largest of min(closed forms, replayed
    figure) over every lattice shape it meets (the closed forms where the two steps are not replayed), each computed
    on its own; and the cheap bound the search reads first is never above the closed forms."""
    m = resolve_model("qwen2.5-0.5b")
    at = _ShapePeaks(m, None)
    train = TrainSpec(method=Method.FULL, precision=Precision.BF16, micro_batch=2, seq_len=1024)
    figures, replayed = [], 0
    for b in range(1, 3):
        for ell in _lattice(1024):
            t = train.at_shape(b, ell)
            closed, r = runs.closed_at(m, t, at=at), runs.replay_figure(m, t, at=at)
            assert runs.closed_below(m, t, at=at) <= closed
            figures.append(closed if r is None else min(closed, r))
            replayed += r is not None
    assert replayed > 20  # the longer shapes of both batches
    assert runs.replayed_envelope(m, train, at) == max(figures)
