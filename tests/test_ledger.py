"""The ledger's derived figures against their definitions in ``ledger.py``'s docstring, summed line by line here.

allocated = the phase's allocated lines; reserved = allocated + allocator reserve; device total = reserved + CUDA
context + NCCL + managed memory; the peak phase holds the largest device total (ties: more allocated, then the
earlier phase). The ledger computes them in one pass over the lines; these sums are written out per term.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from vramledger.ledger import Category, Ledger, LineItem, Phase

_ALLOCATED = (
    Category.WEIGHTS,
    Category.MASTER_WEIGHTS,
    Category.GRADIENTS,
    Category.OPTIMIZER_STATE,
    Category.ACTIVATIONS,
    Category.ATTENTION_SCORES,
    Category.LOGITS_LOSS,
    Category.KV_CACHE,
    Category.TEMPORARIES,
    Category.WORKSPACE,
)
_OUTSIDE = (Category.CUDA_CONTEXT, Category.NCCL, Category.MANAGED_MEMORY)

lines = st.lists(
    st.builds(
        lambda c, p, n: LineItem(category=c, phase=p, bytes=n, label="x", source="y"),
        st.sampled_from(list(Category)),
        st.sampled_from(list(Phase)),
        st.integers(0, 3) | st.integers(0, 1 << 40),  # small figures make ties
    ),
    min_size=1,
    max_size=40,
)


def _sum(items: list[LineItem], phase: Phase, cats: tuple[Category, ...]) -> int:
    return sum(i.bytes for i in items if i.phase is phase and i.category in cats)


@given(lines)
def test_derived_figures_match_their_definitions(items: list[LineItem]) -> None:
    led = Ledger(model="m", params=0, trainable_params=0, items=tuple(items), engine="analytic")
    phases = [p for p in Phase if any(i.phase is p for i in items)]
    alloc = {p: _sum(items, p, _ALLOCATED) for p in phases}
    reserved = {p: alloc[p] + _sum(items, p, (Category.ALLOCATOR_RESERVE,)) for p in phases}
    device = {p: reserved[p] + _sum(items, p, _OUTSIDE) for p in phases}
    for p in Phase:
        assert led.allocated(p) == alloc.get(p, 0)
        assert led.reserved(p) == reserved.get(p, 0)
        assert led.device(p) == device.get(p, 0)
        assert led.by_category(p) == {c: n for c in Category if (n := _sum(items, p, (c,)))}
    best = max(device.values())
    most = max(alloc[p] for p in phases if device[p] == best)
    assert led.peak_phase == next(p for p in phases if device[p] == best and alloc[p] == most)
    assert led.device_total == best
    assert led.peak_allocated == max(alloc.values())
    assert led.peak_reserved == max(reserved.values())
    assert led.device_total_without_cache == max(device[p] - (reserved[p] - alloc[p]) for p in phases)
