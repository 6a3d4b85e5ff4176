"""Shared fixtures: a hand-built ledger whose numbers are written here, and the 8B LoRA example of the docs."""

from __future__ import annotations

import pytest

from vramledger.ledger import Basis, Category, Ledger, LineItem, Phase, make_verdict
from vramledger.units import GiB, MiB

C, P = Category, Phase


def item(cat: Category, phase: Phase, n: int) -> LineItem:
    return LineItem(category=cat, phase=phase, bytes=n, label=cat.value, source="test", basis=Basis.ASSUMPTION)


@pytest.fixture
def hand_ledger() -> Ledger:
    """Weights 8 GiB throughout; 4 GiB activations in forward; 2 GiB activations + 1 GiB gradients in backward;
    1 GiB gradients + 2 GiB optimizer state + 512 MiB temporaries in the optimizer step; 512 MiB reserve in
    forward and backward; 500 MiB CUDA context everywhere. On a 16 GiB GPU with 8% headroom.

    By hand, device totals: load 8 GiB + 500 MiB; forward 12 GiB + 1012 MiB; backward 11 GiB + 1012 MiB;
    optimizer 11 GiB + 1012 MiB. The peak is forward; usable = 0.92 × 16 GiB = 14.72 GiB, so it fits.
    """
    items = [
        item(C.WEIGHTS, P.LOAD, 8 * GiB),
        item(C.CUDA_CONTEXT, P.LOAD, 500 * MiB),
        item(C.WEIGHTS, P.FORWARD, 8 * GiB),
        item(C.ACTIVATIONS, P.FORWARD, 4 * GiB),
        item(C.ALLOCATOR_RESERVE, P.FORWARD, 512 * MiB),
        item(C.CUDA_CONTEXT, P.FORWARD, 500 * MiB),
        item(C.WEIGHTS, P.BACKWARD, 8 * GiB),
        item(C.ACTIVATIONS, P.BACKWARD, 2 * GiB),
        item(C.GRADIENTS, P.BACKWARD, 1 * GiB),
        item(C.ALLOCATOR_RESERVE, P.BACKWARD, 512 * MiB),
        item(C.CUDA_CONTEXT, P.BACKWARD, 500 * MiB),
        item(C.WEIGHTS, P.OPTIMIZER, 8 * GiB),
        item(C.GRADIENTS, P.OPTIMIZER, 1 * GiB),
        item(C.OPTIMIZER_STATE, P.OPTIMIZER, 2 * GiB),
        item(C.TEMPORARIES, P.OPTIMIZER, 512 * MiB),
        item(C.CUDA_CONTEXT, P.OPTIMIZER, 500 * MiB),
    ]
    ledger = Ledger(model="hand/model", params=4 * 10**9, trainable_params=10**7, items=tuple(items), engine="test")
    return Ledger(
        model=ledger.model,
        params=ledger.params,
        trainable_params=ledger.trainable_params,
        items=ledger.items,
        engine="test",
        verdict=make_verdict(ledger.device_total, "Test GPU 16GiB", 16 * GiB, 0.08),
    )


@pytest.fixture(scope="session")
def lora8b():
    """The docs' example: Llama-3-8B, LoRA, micro-batch 4, 2048 tokens, gradient checkpointing, RTX 4090."""
    from vramledger.analytic import estimate
    from vramledger.catalog import resolve_gpu, resolve_model
    from vramledger.specs import Method, TrainSpec

    model, gpu = resolve_model("llama-3-8b"), resolve_gpu("rtx-4090")
    train = TrainSpec(method=Method.LORA, micro_batch=4, seq_len=2048, grad_ckpt=True)
    return model, train, gpu, estimate(model, train, gpu=gpu, headroom=0.08)


@pytest.fixture(scope="session")
def full_page(lora8b):
    """The HTML page of the 8B example with every figure: bill, cliff (grid and curves), a timeline and remedies
    (the analytic engine has no timeline and no plan, so a small trace and three remedies are made up here)."""
    pytest.importorskip("matplotlib")
    import dataclasses

    from vramledger.ledger import TimelineSample
    from vramledger.report.figures import all_figures
    from vramledger.report.html import render_html

    model, train, gpu, ledger = lora8b
    w = ledger.bytes_of(C.WEIGHTS, P.FORWARD)
    samples = tuple(
        TimelineSample(
            index=i,
            phase=ph,
            live_bytes=w + a,
            by_category={C.WEIGHTS: w, C.ACTIVATIONS: a},
            op="aten::mm",
            module=f"model.layers.{i}",
        )
        for i, (ph, a) in enumerate([(P.FORWARD, 0), (P.FORWARD, GiB), (P.BACKWARD, 2 * GiB), (P.OPTIMIZER, 0)])
    )
    traced = dataclasses.replace(ledger, timeline=samples)
    remedies = [
        ("as is", ledger.device_total, 10.0),
        ("micro-batch 1 × accum 4", 20 * GiB, 12.5),
        ("qlora", 12 * GiB, 14.0),
    ]
    figs = all_figures(traced, model=model, train=train, gpu=gpu, remedies=remedies)
    return traced, render_html(traced, figs)
