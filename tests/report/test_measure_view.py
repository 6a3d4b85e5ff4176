"""`measure` and `accum-check` rendering as pure functions, on CPU, from a fake measured result.

Before, `cli/measure.py` formatted its own table and crashed on every successful run without --json
(`item.category.title` is `str.title`, a method); untested because it needed a GPU.
"""

from __future__ import annotations

import json

from vramledger.ledger import Category, Ledger, LineItem, Phase
from vramledger.report.measure_view import measure_to_dict, render_measure
from vramledger.specs import TrainSpec
from vramledger.units import GiB, MiB

RAW = {
    "environment": {"gpu": "NVIDIA H100 80GB HBM3", "driver": "580.1", "versions": {"torch": "2.13.0"}},
    "counters": {"num_alloc_retries": 0, "num_ooms": 0},
    "wall_s": 12.5,
}


def _ledger(weights: int, acts: int, engine: str) -> Ledger:
    def item(cat: Category, phase: Phase, n: int) -> LineItem:
        return LineItem(category=cat, phase=phase, bytes=n, label=cat.value, source="test")

    items = []
    for phase, a in ((Phase.FORWARD, acts), (Phase.BACKWARD, acts // 2)):
        items += [
            item(Category.WEIGHTS, phase, weights),
            item(Category.ACTIVATIONS, phase, a),
            item(Category.ALLOCATOR_RESERVE, phase, 100 * MiB),
            item(Category.CUDA_CONTEXT, phase, 400 * MiB),
        ]
    return Ledger(model="tiny", params=1, trainable_params=1, items=tuple(items), engine=engine)


def test_render_measure_names_each_category_and_the_errors() -> None:
    from vramledger.catalog import resolve_model

    measured = _ledger(2 * GiB, 1 * GiB, "measure")  # forward peak: 3 GiB allocated
    predicted = _ledger(2 * GiB, 1 * GiB + 307 * MiB, "analytic")  # 3.3 GiB: +10.0% of 3 GiB (307.2 MiB)
    text = render_measure(
        resolve_model("llama-3.2-1b"), TrainSpec(), measured, RAW, {"estimate": predicted}, [], steps=3
    )
    print(text)
    assert "measured on NVIDIA H100 80GB HBM3" in text
    assert f"  {Category.WEIGHTS.display:<34}" in text and f"  {Category.ACTIVATIONS.display:<34}" in text
    assert "peak allocated 3.00 GiB in forward:" in text
    assert "estimate error at the peak (predicted − measured) / measured: allocated +10.0%" in text
    assert "trial took 12.5 s" in text


def test_measure_json_round_trips() -> None:
    measured = _ledger(2 * GiB, 1 * GiB, "measure")
    doc = measure_to_dict(measured, RAW, {"estimate": measured}, ["a note"])
    doc = json.loads(json.dumps(doc, default=str))
    assert doc["measured"]["allocated"] == 3 * GiB
    assert doc["errors"]["estimate"]["allocated"] == 0.0
    assert {i["category"] for i in doc["items"]} == {"weights", "activations", "allocator_reserve", "cuda_context"}
