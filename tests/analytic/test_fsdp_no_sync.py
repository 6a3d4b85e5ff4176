"""FSDP under gradient accumulation keeps unsharded gradients (FSDP1's ``no_sync``, FSDP2's
``set_requires_gradient_sync(False)``): hand derivations of the estimate, and the facts it rests on checked on
PyTorch's own FSDP1 and FSDP2 running on a fake process group."""

from dataclasses import replace

import pytest

from vramledger.analytic import estimate
from vramledger.catalog import resolve_model
from vramledger.ledger import Category, Phase
from vramledger.specs import LoraSpec, Method, Precision, Sharding, TrainSpec
from vramledger.trace.distributed import fake_process_group

L2_7B = resolve_model("llama-2-7b")
L8B = resolve_model("llama-3.1-8b")
P8B = 8_030_261_248  # Llama-3.1-8B, the published parameter count (model card: 8.03B)


def _grads(ledger, phase: Phase) -> int:  # type: ignore[no-untyped-def]
    return sum(i.bytes for i in ledger.items if i.phase is phase and i.category is Category.GRADIENTS)


def _litgpt_lora(accum: int) -> TrainSpec:
    """LitGPT's resource-table run (lit-gpt 8641822 finetune/lora.py on 2 GPUs): LoRA r=8 on q and v, bf16-true,
    FSDP1 FULL_SHARD with Block wrap and Block checkpointing, micro-batch 1 of the 1304-token longest sample."""
    return TrainSpec(
        method=Method.LORA,
        precision=Precision.BF16,
        lora=LoraSpec(rank=8, alpha=16, targets=("q_proj", "v_proj"), dropout=0.05, adapter_fp32=False),
        micro_batch=1,
        seq_len=1304,
        grad_accum=accum,
        grad_ckpt=True,
        world_size=2,
        fsdp=Sharding.FULL_SHARD,
        fsdp_version=1,
    )


def test_lora_under_no_sync_keeps_every_layer_units_whole_gradient() -> None:
    # Llama-2-7B decoder layer: q, k, v, o (4·H²) + gate, up, down (3·H·I) + two RMSNorms (2·H), H=4096, I=11008;
    # LoRA r=8 on q and v adds 2·r·(H + H). With use_orig_params=True each layer is one flat parameter holding base
    # and adapters, so its unsharded gradient has the whole unit's size: 32 layers × elements × 2 bytes (bf16).
    H, I, r = 4096, 11008, 8
    unit = 4 * H * H + 3 * H * I + 2 * H + 2 * r * (H + H)
    kept = 32 * unit * 2
    assert kept == 12_960_923_648
    accumulating = estimate(L2_7B, _litgpt_lora(64))
    print("gradients per rank in forward:", _grads(accumulating, Phase.FORWARD), "expected", kept)
    assert _grads(accumulating, Phase.FORWARD) == kept
    assert _grads(accumulating, Phase.BACKWARD) == kept
    # the optimizer step sees the reduce-scattered shard: half the flat gradient on each of 2 ranks
    assert _grads(accumulating, Phase.OPTIMIZER) == kept // 2
    # one micro-step per optimizer step never enters no_sync: the shard is all; forward's peak is the batch moved
    # to the GPU beside the previous step's shard, which FSDP1 (use_orig_params) frees only in the root's
    # pre-forward (_flat_param.py _reset_flat_param_grad_info_if_needed), never an unsharded gradient
    single = estimate(L2_7B, _litgpt_lora(1))
    assert _grads(single, Phase.FORWARD) == kept // 2
    assert _grads(single, Phase.OPTIMIZER) == kept // 2
    assert any(n.startswith("FSDP1 with gradient accumulation") for n in accumulating.warnings)


def test_full_fine_tuning_under_no_sync_keeps_the_whole_model_gradient() -> None:
    # LitGPT's config_hub llama-3-8b/full.yaml: bf16-true, 4 devices, global batch 64, micro-batch 4: 4 micro-steps.
    t = TrainSpec(
        method=Method.FULL,
        precision=Precision.BF16,
        micro_batch=4,
        seq_len=512,
        grad_accum=4,
        grad_ckpt=True,
        world_size=4,
        fsdp=Sharding.FULL_SHARD,
        fsdp_version=1,
    )
    ledger = estimate(L8B, t)
    assert _grads(ledger, Phase.FORWARD) == 2 * P8B  # every parameter's bf16 gradient, unsharded
    assert _grads(ledger, Phase.BACKWARD) == 2 * P8B  # the root's own unsharded-gradient line is inside it
    assert _grads(ledger, Phase.OPTIMIZER) == -(-2 * P8B // 4)
    # the end of backward: the root unit's new gradient, its pieces (embedding and untied head, V·H each) and their
    # concatenation (2·V·H + H), 2·u·E_root, less the embedding's piece that the single-GPU step already counts
    V, H = 128256, 4096
    root = 2 * V * H + H
    assert ledger.moments[Phase.BACKWARD].startswith("end of backward")
    new_grad = sum(
        i.bytes for i in ledger.items if i.phase is Phase.BACKWARD and i.label.startswith("root unit's new gradient")
    )
    assert new_grad == 2 * 2 * root - 2 * V * H
    # bf16 shard of weights (2·P/4) + AdamW states (4·P/4) + unsharded gradients (2·P): over a 24 GB A10G before
    # any activation, as LitGPT's table reports (OOM on 4 x A10G)
    assert 2 * P8B // 4 + 4 * P8B // 4 + 2 * P8B > 24e9
    assert ledger.peak_allocated > 24e9


def test_fsdp2_without_gradient_sync_keeps_every_trainable_gradient_unsharded() -> None:
    # FSDP2 + accumulation: set_requires_gradient_sync(False) on the accumulating micro-steps keeps each trainable
    # parameter's unsharded gradient (bf16 here) until the synchronising one: 2·P in forward and backward, the shard
    # at the optimizer step; no root concatenation line (parameters are not views of a flat one).
    t = TrainSpec(method=Method.FULL, precision=Precision.BF16, grad_accum=4, world_size=4, fsdp=Sharding.FULL_SHARD)
    assert t.fsdp_version == 2
    ledger = estimate(L8B, t)
    print("gradients in forward:", _grads(ledger, Phase.FORWARD), "expected", 2 * P8B)
    assert _grads(ledger, Phase.FORWARD) == 2 * P8B
    assert _grads(ledger, Phase.BACKWARD) == 2 * P8B
    assert _grads(ledger, Phase.OPTIMIZER) == -(-2 * P8B // 4)
    assert not any(i.label.startswith("root unit's") for i in ledger.items)
    assert any(n.startswith("FSDP2 with gradient accumulation") for n in ledger.warnings)
    # without accumulation nothing is kept: the shard, as before
    one = estimate(L8B, TrainSpec(method=Method.FULL, precision=Precision.BF16, world_size=4, fsdp=Sharding.FULL_SHARD))
    assert _grads(one, Phase.FORWARD) == 0


def test_fsdp2_lora_keeps_only_the_adapters_gradients() -> None:
    # The LitGPT LoRA step of the test above under FSDP2: one gradient per trainable parameter, so only the adapters'
    # (32 layers x q and v x r·(H + H), bf16), where FSDP1's whole units keep 12.96 GB.
    H, r = 4096, 8
    adapters = 32 * 2 * r * (H + H)
    t = replace(_litgpt_lora(64), fsdp_version=2)
    got = _grads(estimate(L2_7B, t), Phase.FORWARD)
    print("gradients per rank in forward:", got, "expected", 2 * adapters)
    assert got == 2 * adapters


def _adapter_block(h: int, r: int) -> type:
    """A unit mixing a frozen h×h base with trainable rank-r adapters (LoRA's shape)."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = nn.Linear(h, h, bias=False).requires_grad_(False)
            self.a, self.b = nn.Linear(h, r, bias=False), nn.Linear(r, h, bias=False)

        def forward(self, x):  # type: ignore[no-untyped-def]
            return self.base(x) + self.b(self.a(x))

    return Block


def test_real_fsdp2_keeps_unsharded_gradients_without_gradient_sync() -> None:
    """The fact the FSDP2 model rests on, on PyTorch's ``fully_shard`` (rank 0 of 4 on the fake process group, a
    ``cpu`` mesh, bf16 parameters): two accumulating micro-steps with ``set_requires_gradient_sync(False)`` leave
    each trainable parameter's unsharded gradient on its unsharded parameter, none on the frozen ones and no sharded
    gradient; the synchronising micro-step reduce-scatters them into local shards of 1/4 and drops the unsharded."""
    torch = pytest.importorskip("torch")
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    h, r, world = 64, 4, 4
    Block = _adapter_block(h, r)  # noqa: N806

    with fake_process_group(world):
        model = nn.Sequential(nn.Linear(h, h, bias=False), Block(), Block()).to(torch.bfloat16)
        mesh = init_device_mesh("cpu", (world,))
        for block in model[1:]:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if hasattr(m, "_get_fsdp_state")]
        params = [fp for g in groups if g is not None for fp in g.fsdp_params]

        def unsharded() -> list[int]:
            return sorted(fp._unsharded_param.grad.numel() for fp in params if fp._unsharded_param.grad is not None)

        x = torch.randn(2, h, dtype=torch.bfloat16)
        model.set_requires_gradient_sync(False)
        for _ in range(2):
            model(x).sum().backward()
        trainable = sorted([h * h] + [h * r, r * h] * 2)  # the root's linear and both blocks' adapters
        print("kept unsharded:", unsharded(), "expected", trainable)
        assert unsharded() == trainable
        assert all(fp.sharded_param.grad is None for fp in params)
        model.set_requires_gradient_sync(True)
        model(x).sum().backward()
        shards = sorted(fp.sharded_param.grad.to_local().numel() for fp in params if fp.sharded_param.grad is not None)
        print("after the sync:", unsharded(), shards)
        assert unsharded() == [] and shards == sorted(n // world for n in trainable)


def test_real_fsdp1_keeps_unsharded_flat_gradients_inside_no_sync() -> None:
    """The fact the estimate rests on, on PyTorch's FSDP1 itself (rank 0 of 4 on the fake process group, CPU): a
    unit mixing a frozen weight with trainable adapters (``use_orig_params=True``) keeps a gradient of the unit's
    whole unsharded size inside ``no_sync``, and of its shard's size after a synchronising backward; a frozen root
    keeps none."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.testing._internal.distributed.fake_pg import FakeStore

    h, r, world = 64, 4, 4
    Block = _adapter_block(h, r)  # noqa: N806

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(h, h, bias=False).requires_grad_(False)
            self.blocks = nn.Sequential(Block(), Block(), Block())

        def forward(self, x):  # type: ignore[no-untyped-def]
            return self.blocks(self.embed(x))

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        model = FSDP(
            Net(),
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            device_id=torch.device("cpu"),
            use_orig_params=True,
        )
        handles = [m._handle for m in model.modules() if isinstance(m, FSDP) and m._handle is not None]

        def grad_numels() -> list[int]:
            return [0 if hd.flat_param.grad is None else hd.flat_param.grad.numel() for hd in handles]

        x = torch.randn(2, h)
        with model.no_sync():
            model(x).sum().backward()
        unit = h * h + 2 * h * r  # the frozen base and both adapters, flattened together
        print("inside no_sync:", grad_numels())
        assert sorted(grad_numels()) == [0, unit, unit, unit]  # the frozen root (embed) has no gradient
        model(x).sum().backward()  # the synchronising micro-step: reduce-scatter to the shard
        print("after the sync:", grad_numels())
        assert sorted(grad_numels()) == [0, unit // world, unit // world, unit // world]
    finally:
        dist.destroy_process_group()


def test_real_fsdp1_root_gradient_is_concatenated_beside_the_kept_one() -> None:
    """The root transient of analytic/distributed/fsdp_no_sync.py on PyTorch's FSDP1 (rank 0 of 4, fake process group,
    CPU, bf16): a LitGPT-shaped model (embedding, Block units, final norm, untied head), fully trained, a second
    ``no_sync`` micro-step profiled with PyTorch's memory profiler. At its peak the autograd temporaries are the
    root's gradient pieces (embedding and head, V·H each) and their concatenation (the unit, 2·V·H + 2·H): 2·u·E_root,
    beside the kept unsharded gradients of the whole model."""
    torch = pytest.importorskip("torch")
    import warnings

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.profiler import ProfilerActivity, profile
    from torch.testing._internal.distributed.fake_pg import FakeStore

    V, H, T, world = 8192, 256, 64, 4

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.ModuleList(nn.Linear(H, H, bias=False) for _ in range(4))

        def forward(self, x):  # type: ignore[no-untyped-def]
            for lin in self.lin:
                x = x + lin(x)
            return x

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(V, H)
            self.h = nn.ModuleList([Block(), Block()])
            self.ln_f = nn.LayerNorm(H)
            self.lm_head = nn.Linear(H, V, bias=False)

        def forward(self, idx):  # type: ignore[no-untyped-def]
            x = self.wte(idx)
            for block in self.h:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = FSDP(
                GPT().to(torch.bfloat16),
                auto_wrap_policy=ModuleWrapPolicy({Block}),
                sharding_strategy=ShardingStrategy.FULL_SHARD,
                device_id=torch.device("cpu"),
                use_orig_params=True,
            )
        idx = torch.randint(0, V, (1, T))

        def micro_step() -> None:
            with model.no_sync():
                logits = model(idx)
                torch.nn.functional.cross_entropy(logits.float().view(-1, V), idx.view(-1)).backward()

        micro_step()  # the first creates the unsharded gradients
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as p:
            micro_step()
        try:
            from torch.profiler._memory_profiler import Action
            from torch.profiler._memory_profiler import Category as MemCategory

            memory = p._memory_profile()
            timeline, categories = memory.timeline, memory._categories
        except (ImportError, AttributeError):  # pragma: no cover - a private API
            pytest.skip("this torch has no memory profiler timeline")
        live: dict = {}  # type: ignore[type-arg]
        cur = peak = 0
        at_peak: dict = {}  # type: ignore[type-arg]
        for _t, action, (key, version), size in timeline:
            if action in (Action.PREEXISTING, Action.CREATE):
                live[key] = (version, size)
                cur += size
            elif action is Action.DESTROY:
                cur -= live.pop(key, (version, size))[1]
            elif action is Action.INCREMENT_VERSION and key in live:
                live[key] = (version, live[key][1])
            if cur > peak:
                peak, at_peak = cur, dict(live)
        temps = sum(
            size
            for key, (version, size) in at_peak.items()
            if categories.get(key, version) is MemCategory.AUTOGRAD_DETAIL
        )
        grads = sum(
            size for key, (version, size) in at_peak.items() if categories.get(key, version) is MemCategory.GRADIENT
        )
        root = 2 * V * H + 2 * H  # embedding, head, final norm's weight and bias
        whole = root + 2 * 4 * H * H
        print("autograd temporaries at the peak", temps, "expected", 2 * 2 * root, "; kept gradients", grads, 2 * whole)
        assert grads == 2 * whole
        assert abs(temps - 2 * 2 * root) <= 0.01 * 2 * 2 * root
    finally:
        dist.destroy_process_group()
