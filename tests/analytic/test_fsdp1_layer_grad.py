"""FSDP1's decoder-layer gradient instant (analytic/distributed/fsdp1_layer_grad.py): the fact on PyTorch's FSDP1
itself (fake process group, CPU, live bytes counted per storage), and the estimate's lines derived by hand for
LitGPT's 2023 multi-GPU LoRA rows."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from tests.analytic.test_fsdp_no_sync import _litgpt_lora
from vramledger.analytic import estimate
from vramledger.analytic.distributed.fsdp1_layer_grad import NAME, PREFETCH_LABEL
from vramledger.catalog import resolve_model
from vramledger.ledger import Phase
from vramledger.specs import TrainSpec


class _Live:
    """Live bytes of every storage an op creates, freed with the storage or resized (FSDP1 frees and re-allocates
    its unsharded flat parameters with ``UntypedStorage.resize_``); ``peak`` is the high-water mark."""

    def __init__(self) -> None:
        self.sizes: dict[int, int] = {}
        self.now = self.peak = 0

    def _set(self, key: int, n: int) -> None:
        self.now += n - self.sizes.get(key, 0)
        self.sizes[key] = n
        self.peak = max(self.peak, self.now)

    def _free(self, key: int) -> None:
        self.now -= self.sizes.pop(key, 0)

    def seen(self, out: Any) -> None:
        import torch
        from torch.utils._pytree import tree_leaves

        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in self.sizes:
                storage = t.untyped_storage()
                self._set(storage._cdata, storage.nbytes())
                weakref.finalize(storage, self._free, storage._cdata)

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        live, resize = self, torch.UntypedStorage.resize_

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                out = func(*args, **(kwargs or {}))
                live.seen(out)
                return out

        def resize_(storage: Any, size: int) -> Any:
            out = resize(storage, size)
            if storage._cdata in live.sizes or size:
                if storage._cdata not in live.sizes:
                    weakref.finalize(storage, live._free, storage._cdata)
                live._set(storage._cdata, int(size))
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
        try:
            with Mode():
                yield
        finally:
            torch.UntypedStorage.resize_ = resize  # type: ignore[method-assign]


def test_real_fsdp1_holds_four_units_inside_the_top_layers_backward() -> None:
    """On PyTorch's FSDP1 (rank 0 of 2, fake process group, CPU, bf16, FULL_SHARD, ``use_orig_params=True``,
    default ``BACKWARD_PRE``): three units of a frozen base with trainable adapters, a frozen root, one token. The
    peak of a second ``no_sync`` micro-step's backward is, beyond the shards, the root unsharded and the kept
    unsharded gradients of every unit, four units more: the top unit unsharded, the next one prefetched, the top
    unit's view gradients and their concatenation. The estimate before this module counted one."""
    torch = pytest.importorskip("torch")
    import warnings

    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from vramledger.trace.distributed import fake_process_group

    h, r, world = 256, 8, 2

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = nn.ModuleList(nn.Linear(h, h, bias=False).requires_grad_(False) for _ in range(4))
            self.a, self.b = nn.Linear(h, r, bias=False), nn.Linear(r, h, bias=False)

        def forward(self, x):  # type: ignore[no-untyped-def]
            for i, lin in enumerate(self.base):
                x = x + lin(x) + (self.b(self.a(x)) if i == 0 else 0)
            return x

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(h, h, bias=False).requires_grad_(False)
            self.blocks = nn.Sequential(Block(), Block(), Block())

        def forward(self, x):  # type: ignore[no-untyped-def]
            return self.blocks(self.embed(x))

    c = 2  # bf16
    unit = c * (4 * h * h + 2 * h * r)  # one Block's flat parameter (and its unsharded gradient), in bytes
    root = c * h * h
    live = _Live()
    with fake_process_group(world), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = FSDP(
            Net().to(torch.bfloat16),
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            device_id=torch.device("cpu"),
            use_orig_params=True,
        )
        x = torch.randn(1, h, dtype=torch.bfloat16)
        with live.counting():
            with model.no_sync():
                model(x).sum().backward()  # the first micro-step makes the kept unsharded gradients
            start = live.peak = live.now  # kept gradients and shards; every unit resharded
            with model.no_sync():
                model(x).sum().backward()
    extra = live.peak - start
    print("peak beyond the start:", extra, "expected the root and 4 units:", root + 4 * unit)
    # The root gathered again (analytic/distributed/core.py's root line) and four units: the top unit unsharded, the
    # next one prefetched, the top unit's view gradients and their concatenation; plus one token's hidden states
    # (< 8 KB).
    assert root + 4 * unit <= extra < root + 4 * unit + 8 * 1024


def _litgpt_lora_fsdp(batch: int, accum: int) -> TrainSpec:
    """lit-gpt 8641822 finetune/lora.py on 2 GPUs (rows 42-44: test_fsdp_no_sync.py's setup) at ``batch``."""
    return replace(_litgpt_lora(accum), micro_batch=batch)


def test_litgpt_fsdp_lora_backward_peak_holds_the_layer_gradient_instant() -> None:
    # Llama-2-7B's unit: 4·H² + 3·H·I + 2·H + LoRA r8 on q and v, 2·r·(H + H), in bf16 (use_orig_params=True keeps
    # adapters and base in one flat parameter): the prefetched unit and the views' gradients with their cat.
    H, I, r = 4096, 11008, 8  # noqa: E741
    unit = 2 * (4 * H * H + 3 * H * I + 2 * H + 2 * r * (H + H))
    assert unit == 405_028_864
    ledger = estimate(resolve_model("llama-2-7b"), _litgpt_lora_fsdp(1, 128))
    print("backward moment:", ledger.moments[Phase.BACKWARD])
    assert ledger.moments[Phase.BACKWARD] == NAME
    lines = {i.label: i.bytes for i in ledger.items if i.phase is Phase.BACKWARD}
    assert lines[PREFETCH_LABEL] == unit
    assert lines["this layer's new unsharded gradient: the views' gradients and their cat"] == 2 * unit
    # At micro-batch 4 the top layer's recompute (4 × 1304 tokens of activations) outgrows the three units.
    assert estimate(resolve_model("llama-2-7b"), _litgpt_lora_fsdp(4, 32)).moments[Phase.BACKWARD] != NAME


def test_no_instant_under_fsdp2() -> None:
    # FSDP2 keeps a gradient per trainable parameter (DTensor parameters, no flat views): nothing of this module.
    ledger = estimate(resolve_model("llama-2-7b"), replace(_litgpt_lora_fsdp(1, 128), fsdp_version=2))
    assert all(i.label != PREFETCH_LABEL for i in ledger.items)
