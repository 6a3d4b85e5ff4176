"""FSDP1 under ``CPUOffload(offload_params=True)``: each unit's reduce-scattered gradient stays on the GPU until the end
of backward (analytic/distributed/core.py ``FSDP1_OFFLOAD_GRADS_SOURCE``). The fact on PyTorch's FSDP1 itself (fake
process group, CPU), and the estimate's line and post-backward pool derived by hand for PEFT's FSDP QLoRA guide
(Llama-2-70B, LoRA r 8 on every linear in fp32 adapters, 2 ranks: published row 165)."""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import replace
from typing import Any
from unittest import mock

import pytest

from tests.analytic.test_quant_state import KV, L70B, LAYERS, H, I, _qlora
from vramledger.analytic.distributed.core import OFFLOAD_GRADS_LABEL
from vramledger.analytic.distributed.stream_pools import side_pools
from vramledger.analytic.weights import weight_budget
from vramledger.ledger import Phase
from vramledger.specs import Method, ModelSpec, Precision, Sharding, TrainSpec

# LoRA r 8 on q, k, v, o, gate, up, down: r·(in + out) each
LORA = LAYERS * 8 * (2 * (H + H) + 2 * (H + KV) + 3 * (H + I))
SHARDED_FP32 = 4 * LORA // 2  # rank 0's fp32 shard of the adapters' gradients (each unit padded: < 1 KiB more)


def _qlora_offload(**kw: Any) -> TrainSpec:
    """PEFT's FSDP QLoRA guide (row 165): test_quant_state.py's setup with ``fsdp_offload_params``."""
    return _qlora(offload_params=True, offload_optimizer=True, **kw)


def test_real_fsdp1_keeps_every_offloaded_gradient_shard_until_the_end_of_backward() -> None:
    """PyTorch's FSDP1, rank 0 of 2 on the fake process group, CPU, ``CPUOffload(offload_params=True)``, bf16
    ``MixedPrecision`` over fp32 adapters, each adapter a unit of its own (PEFT's wrap policy), one backward. Every
    tensor ``_offload_grad`` copies to the host is the unit's sharded gradient in the parameter's dtype, and all of
    them are still alive when the end-of-backward callback starts (``prepare_gradient_for_optim`` of the first
    unit), then freed: they are live together, not one at a time. Two calls that need a GPU are stubbed, neither of
    which holds a tensor: ``pin_memory`` (identity) and the CPU stream's ``synchronize`` (no-op)."""
    torch = pytest.importorskip("torch")
    import warnings

    from torch import nn
    from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy, _flat_param, _runtime_utils
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from vramledger.trace.distributed import fake_process_group

    h, r, blocks = 64, 8, 3

    class Adapter(nn.Linear):
        pass

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = nn.Linear(h, h, bias=False).requires_grad_(False)
            self.a, self.b = Adapter(h, r, bias=False), Adapter(r, h, bias=False)

        def forward(self, x):  # type: ignore[no-untyped-def]
            return x + self.base(x) + self.b(self.a(x))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(h, h, bias=False).requires_grad_(False)
            self.blocks = nn.Sequential(*(Block() for _ in range(blocks)))

        def forward(self, x):  # type: ignore[no-untyped-def]
            return self.blocks(self.embed(x))

    offloaded: list[tuple[weakref.ref[Any], torch.dtype, int]] = []
    alive_at_end: list[int] = []
    offload_grad, prepare = _runtime_utils._offload_grad, _flat_param.FlatParamHandle.prepare_gradient_for_optim

    def spy_offload(state: Any, handle: Any, grad: Any) -> None:
        offloaded.append((weakref.ref(grad), grad.dtype, grad.numel()))
        offload_grad(state, handle, grad)

    def spy_prepare(self: Any) -> None:
        if not alive_at_end:
            alive_at_end.append(sum(ref() is not None for ref, _, _ in offloaded))
        prepare(self)

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(_runtime_utils, "_offload_grad", spy_offload))
        stack.enter_context(mock.patch.object(_flat_param.FlatParamHandle, "prepare_gradient_for_optim", spy_prepare))
        stack.enter_context(mock.patch.object(torch.Tensor, "pin_memory", lambda t, *a, **k: t))
        stack.enter_context(mock.patch.object(torch.cpu.Stream, "synchronize", lambda s: None, create=True))
        stack.enter_context(fake_process_group(2))
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")
        net = Net().to(torch.bfloat16)
        for mod in net.modules():
            if isinstance(mod, Adapter):
                mod.float()
        model = FSDP(
            net,
            auto_wrap_policy=ModuleWrapPolicy({Adapter, Block}),
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            device_id=torch.device("cpu"),
            cpu_offload=CPUOffload(offload_params=True),
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
            use_orig_params=False,
        )
        model(torch.randn(2, h, dtype=torch.bfloat16)).float().sum().backward()
    # one per adapter unit, each rank 0's half of an r×h weight, cast back to the adapters' fp32
    assert [(dtype, n) for _, dtype, n in offloaded] == [(torch.float32, r * h // 2)] * (2 * blocks)
    assert alive_at_end == [2 * blocks]
    assert all(ref() is None for ref, _, _ in offloaded)


def test_end_of_backward_holds_the_sharded_adapter_gradients() -> None:
    # Without accumulation nothing else holds gradients at the end of backward: rank 0's fp32 half of the
    # adapters' gradients, 4 bytes × 103,546,880 / 2.
    assert LORA == 103_546_880
    every = [mo for mo in _backward_moments(_qlora_offload()) if mo.name.startswith("end of backward")]
    assert len(every) == 1
    lines = {i.label: i.bytes for i in every[0].items}
    assert lines[OFFLOAD_GRADS_LABEL] == SHARDED_FP32


def test_accumulation_adds_only_what_exceeds_the_kept_unsharded_gradients() -> None:
    # Under no_sync the other micro-steps end backward with the bf16 unsharded gradients, 2 × 103,546,880 bytes,
    # the same as the fp32 half: the end of backward holds one or the other, never both.
    every = [mo for mo in _backward_moments(_qlora_offload(grad_accum=2)) if mo.name.startswith("end of backward")]
    lines = {i.label: i.bytes for i in every[0].items}
    assert OFFLOAD_GRADS_LABEL not in lines
    assert sum(b for label, b in lines.items() if label.startswith("unsharded gradients kept")) == 2 * LORA


def test_post_backward_pool_holds_every_sharded_gradient_at_once() -> None:
    # They are live together in the post-backward stream's pool, so it caches at least their sum. Each layer's
    # adapters shard to 4 × 1,294,336 / 2 = 2,588,672 bytes, a 1-10 MB request that the caching allocator serves from
    # 20 MiB segments (CUDACachingAllocator.cpp kLargeBuffer), seven to a segment, the bf16 reduce-scatter output
    # (freed once cast) in the rest: at most one segment per seven layers' shards, and one more.
    shard = 4 * LORA // LAYERS // 2
    assert shard == 2_588_672
    train = _qlora_offload()
    pools = side_pools(L70B, train, weight_budget(L70B, train))
    assert SHARDED_FP32 <= pools.reduce_scatter <= (-(-LAYERS // 7) + 1) * 20 * 2**20
    # FSDP2 copies each to the host and drops it at once: one 20 MiB segment serves every layer in turn.
    fsdp2 = replace(train, fsdp_version=2)
    assert side_pools(L70B, fsdp2, weight_budget(L70B, fsdp2)).reduce_scatter == 20 * 2**20


def _backward_moments(train: TrainSpec, m: ModelSpec = L70B) -> list[Any]:
    """The end-of-backward moments the estimate chooses its backward peak from (analytic/step.py ``moments``)."""
    from vramledger.analytic import step

    p = step.step_parts(m, train, None)
    out = [*step._end_of_backward(m, train, p)]
    for mo in out:
        step.add_buffers(mo, Phase.BACKWARD, p.buffers)
    return out


def test_root_flattening_moments_hold_every_shard_but_the_roots() -> None:
    # Llama-3.1-8B full fine-tuning, fp32 parameters under bf16-mixed, 8 ranks: the ends of backward are FSDP1's
    # root-flattening moments (fsdp_root_flatten.py), when every decoder layer's fp32 shard is made and the root's
    # (embeddings, final norm, untied output layer) not yet: 4·8,030,261,248/8 − 4·⌈1,050,677,248/8⌉ bytes.
    from vramledger.catalog import resolve_model

    m = resolve_model("llama-3.1-8b")
    train = TrainSpec(
        method=Method.FULL,
        precision=Precision.BF16_MIXED,
        grad_ckpt=True,
        world_size=8,
        fsdp=Sharding.FULL_SHARD,
        fsdp_version=1,
        offload_params=True,
    )
    ends = [mo for mo in _backward_moments(train, m) if mo.name.startswith("end of backward")]
    assert ends and all("flattens" in mo.name or "sums" in mo.name for mo in ends)
    for mo in ends:
        lines = {i.label: i.bytes for i in mo.items}
        assert lines[OFFLOAD_GRADS_LABEL] == 4 * 8_030_261_248 // 8 - 4 * -(-1_050_677_248 // 8)
