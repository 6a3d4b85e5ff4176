"""The real FSDP2, FSDP1 and DDP wrappers traced on the fake process group, checked against the single-GPU trace
and against hand derivations of what each wrapper allocates."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from tests.trace._trace_tiny import TINY
from vramledger.catalog.hfconfig import model_spec_from_config
from vramledger.errors import VramledgerError
from vramledger.ledger import Phase
from vramledger.specs import Method, Precision, Sharding, TrainSpec
from vramledger.trace import trace_events, trace_step
from vramledger.trace.recorder import round_block

CFG = dict(TINY["llama"])
M = model_spec_from_config(CFG, name="tiny-llama", source="test")
BASE = TrainSpec(method=Method.FULL, precision=Precision.BF16, micro_batch=2, seq_len=40)


@functools.cache
def _single():  # type: ignore[no-untyped-def]
    return trace_step(M, BASE, config=CFG)


def _param_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of the tiny Llama (LlamaForCausalLM, untied), from the config."""
    H, I, V, kv = CFG["hidden_size"], CFG["intermediate_size"], CFG["vocab_size"], 64  # 2 KV heads × head_dim 32
    layer = [(H, H), (kv, H), (kv, H), (H, H), (I, H), (I, H), (H, I), (H,), (H,)]
    return [(V, H)] + layer * CFG["num_hidden_layers"] + [(H,), (V, H)]


@pytest.mark.parametrize(("version", "exact"), [(1, True), (2, False)], ids=["fsdp1", "fsdp2"])
def test_world_size_one_equals_the_single_gpu_trace(version: int, exact: bool) -> None:
    single = _single()
    wrapped = trace_step(M, dataclasses.replace(BASE, fsdp=Sharding.FULL_SHARD, fsdp_version=version), config=CFG)
    print("single", single.peak_allocated, "wrapped", wrapped.peak_allocated)
    # FSDP1 switches to NO_SHARD at world size 1 (fully_sharded_data_parallel.py): the flat parameter is the model,
    # one allocation per unit where the plain model rounds each tensor (and its gradient and two states) to 512 B.
    # FSDP2 still all-gathers into a copy, one unit at a time, and its sharded states are padded DTensors: the peak
    # moves by well under 0.2% (backward's all-gathered unit beside the padded batch's activations, 0.12% here).
    if exact:
        assert abs(wrapped.peak_allocated - single.peak_allocated) <= 4 * 512 * len(_param_shapes())
    else:
        assert abs(wrapped.peak_allocated - single.peak_allocated) <= 0.002 * single.peak_allocated


def test_ddp_holds_a_second_copy_of_the_gradients_in_every_phase() -> None:
    # reducer.cpp Reducer::initialize_buckets: bucket gradients for every trainable parameter, bf16 here, allocated
    # at construction (gradient_as_bucket_view=False) and kept. Buckets pack parameters contiguously in 25 MiB
    # buckets (one bucket here), so their bytes are the parameters' bytes, rounded once.
    single = _single()
    ddp = trace_step(M, dataclasses.replace(BASE, world_size=2), config=CFG)
    grads = round_block(sum(2 * _numel(s) for s in _param_shapes()))
    for phase in (Phase.LOAD, Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER):
        print(phase, ddp.allocated(phase) - single.allocated(phase), grads)
        assert ddp.allocated(phase) - single.allocated(phase) == grads


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_fsdp2_load_is_each_parameter_padded_shard() -> None:
    # _fsdp_param.py: each parameter chunked on dim 0 over the ranks (rank 0 gets ceil(dim0 / N) rows), a DTensor
    # whose local tensor is the only memory (recorder fix 1: never the DTensor's global size).
    N = 4
    ledger = trace_step(M, dataclasses.replace(BASE, world_size=N, fsdp=Sharding.FULL_SHARD), config=CFG)
    expected = sum(round_block(2 * -(-s[0] // N) * _numel(s[1:])) for s in _param_shapes())
    expected += 2 * round_block(4 * 16)  # LlamaRotaryEmbedding's inv_freq and original_inv_freq buffers, unsharded
    print("load", ledger.allocated(Phase.LOAD), "expected", expected)
    assert ledger.allocated(Phase.LOAD) == expected


def test_fsdp2_collectives_are_tagged_by_stream_and_resizes_recorded() -> None:
    import torch
    import torch.distributed as dist

    original = torch.UntypedStorage.resize_
    events = trace_events(M, dataclasses.replace(BASE, world_size=4, fsdp=Sharding.FULL_SHARD), config=CFG)
    streams = {e.stream for e in events if e.kind == "alloc"}
    assert {"all_gather", "reduce_scatter"} <= streams
    # unsharded parameters re-allocated by resize_ (recorder fix 2), and freed again before the step ends
    resized = {e.storage for e in events if e.kind == "alloc" and e.op == "resize_"}
    freed = {e.storage for e in events if e.kind == "free"}
    assert resized and resized <= freed
    # global state restored: the patch removed, the fake process group destroyed
    assert torch.UntypedStorage.resize_ is original
    assert not dist.is_initialized()


def test_fsdp2_reduce_scatter_input_is_the_default_streams() -> None:
    """torch 2.13 _fsdp_collectives.py ``foreach_reduce``: ``reduce_scatter_input`` (the unit's bf16 unsharded
    gradients, r·E) is allocated and filled by ``foreach_reduce_scatter_copy_in`` before ``with
    device_handle.stream(reduce_scatter_stream)``; only ``reduce_output`` (r·E/N) is the reduce-scatter stream's.
    Tiny Llama, 4 ranks, pure bf16 (every dim divisible by 4, so no padding): a layer E = 2·128² + 2·64·128 +
    3·128·352 + 2·128 = 184,576 elements; the root (embedding, final norm, lm_head) 2·1000·128 + 128 = 256,128.
    Backward runs the layers last to first, then the root."""
    events = trace_events(M, dataclasses.replace(BASE, world_size=4, fsdp=Sharding.FULL_SHARD), config=CFG)
    layer, root = 2 * 128 * 128 + 2 * 64 * 128 + 3 * 128 * 352 + 2 * 128, 2 * 1000 * 128 + 128
    units = [layer] * CFG["num_hidden_layers"] + [root]
    step1 = [e for e in events if e.kind == "alloc" and e.step == 1 and e.phase is Phase.BACKWARD]
    inputs = [e.bytes for e in step1 if not e.stream and e.op == "empty" and e.category == "gradients"]
    outputs = [e.bytes for e in step1 if e.stream == "reduce_scatter"]
    print("inputs", inputs, "outputs", outputs)
    assert inputs == [round_block(2 * e) for e in units]
    assert outputs == [round_block(2 * e // 4) for e in units]


@pytest.mark.parametrize("sharding", [Sharding.FULL_SHARD, Sharding.NO_SHARD], ids=["full_shard", "no_shard"])
def test_fsdp1_streams_under_mixed_precision(sharding: Sharding) -> None:
    """FSDP1 has three streams of its own (_runtime_utils.py ``_init_streams``): ``_unshard`` casts each unit's
    fp32 shard to bf16 on the pre-unshard stream (_flat_param.py ``_use_low_precision_shard``, 2·E/N), gathers on
    the unshard stream (2·E), and ``_post_backward_hook`` reduces on the post-backward stream: FULL_SHARD the bf16
    shard (2·E/N) and its fp32 cast, NO_SHARD (nothing gathered, N = 1 for the cast) only the fp32 cast of the whole
    gradient (``_cast_grad_to_param_dtype``, 4·E). Tiny Llama at 2 ranks, step 1's forward then backward: the root
    (E = 256,128) and the two layers (E = 184,576) forward; backward from the last layer, the root last."""
    from collections import Counter

    t = dataclasses.replace(BASE, precision=Precision.BF16_MIXED, world_size=2, fsdp=sharding, fsdp_version=1)
    events = trace_events(M, t, config=CFG)
    layer, root = 2 * 128 * 128 + 2 * 64 * 128 + 3 * 128 * 352 + 2 * 128, 2 * 1000 * 128 + 128
    n = 2 if sharding is Sharding.FULL_SHARD else 1
    got = Counter((e.stream, e.bytes) for e in events if e.kind == "alloc" and e.step == 1 and e.stream)
    want: Counter[tuple[str, int]] = Counter()
    # each layer is cast (and gathered) for its forward and again for its backward; the root is not resharded
    # after forward under FULL_SHARD (the root FSDP instance), while NO_SHARD frees its bf16 copy after forward
    for e, times in ((root, 1 if n > 1 else 2), (layer, 2), (layer, 2)):
        want["pre_unshard", round_block(2 * e // n)] += times
        if n > 1:
            want["all_gather", round_block(2 * e)] += times
            want["reduce_scatter", round_block(2 * e // n)] += 1  # the bf16 shard, then its fp32 cast
        want["reduce_scatter", round_block(4 * e // n)] += 1
    print("got", sorted(got.items()), "want", sorted(want.items()))
    assert got == want


def test_fsdp2_hsdp_casts_on_the_all_reduce_stream() -> None:
    """FSDP2 HSDP (torch 2.13 _fsdp_collectives.py ``foreach_reduce`` with a replicate group): ``reduce_output``
    (bf16, 2·E/N) on the reduce-scatter stream, then ``post_reduce_stream = all_reduce_stream``, so the fp32 cast
    (``_to_dtype_if_needed``, 4·E/N) is the all-reduce stream's. Tiny Llama on 4 ranks, 2 per node (N = 2)."""
    from collections import Counter

    t = dataclasses.replace(
        BASE, precision=Precision.BF16_MIXED, world_size=4, gpus_per_node=2, fsdp=Sharding.HYBRID_SHARD
    )
    events = trace_events(M, t, config=CFG)
    layer, root = 2 * 128 * 128 + 2 * 64 * 128 + 3 * 128 * 352 + 2 * 128, 2 * 1000 * 128 + 128
    streams = ("reduce_scatter", "all_reduce")
    got = Counter((e.stream, e.bytes) for e in events if e.kind == "alloc" and e.step == 1 and e.stream in streams)
    want = Counter({("reduce_scatter", round_block(2 * layer // 2)): 2, ("reduce_scatter", round_block(root)): 1})
    want += Counter({("all_reduce", round_block(4 * layer // 2)): 2, ("all_reduce", round_block(2 * root)): 1})
    print("got", sorted(got.items()), "want", sorted(want.items()))
    assert got == want


def test_fsdp_shards_shrink_the_step_and_estimate_agrees() -> None:
    from vramledger.analytic import estimate

    t = dataclasses.replace(BASE, world_size=4, fsdp=Sharding.FULL_SHARD)
    traced, single = trace_step(M, t, config=CFG), _single()
    assert traced.allocated(Phase.OPTIMIZER) < single.allocated(Phase.OPTIMIZER)
    est = estimate(M, t)
    print("trace", traced.allocated(Phase.OPTIMIZER), "estimate", est.allocated(Phase.OPTIMIZER))
    assert abs(est.allocated(Phase.OPTIMIZER) - traced.allocated(Phase.OPTIMIZER)) <= 0.03 * traced.peak_allocated


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"zero_stage": 3, "world_size": 8}, "DeepSpeed ZeRO-3 is not traced"),
        (
            {"fsdp": Sharding.FULL_SHARD, "world_size": 8, "offload_params": True, "offload_optimizer": True},
            "CPU offload is not traced",
        ),
        (
            {
                "fsdp": Sharding.FULL_SHARD,
                "fsdp_version": 1,
                "world_size": 2,
                "method": Method.LORA,
                "precision": Precision.BF16_MIXED,
            },
            "FSDP1 flattens each unit into one tensor of one dtype",
        ),
    ],
    ids=["zero", "offload", "fsdp1-mixed-dtypes"],
)
def test_untraceable_setups_say_so(kw: dict[str, object], message: str) -> None:
    with pytest.raises(VramledgerError, match=message):
        trace_step(M, dataclasses.replace(BASE, **kw), config=CFG)  # type: ignore[arg-type]


def test_trace_cli_runs_fsdp_from_flags(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import json

    from vramledger.cli import main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CFG))
    code = main(
        [
            "trace",
            str(cfg),
            "--method",
            "full",
            "--precision",
            "bf16-true",
            "--batch",
            "2",
            "--seq",
            "40",
            "--world-size",
            "2",
            "--fsdp",
            "full_shard",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["settings"]["distributed"] == {
        "wrapper": "FSDP2 full_shard",
        "world_size": 2,
        "rank": 0,
        "process_group": "torch.testing._internal.distributed.fake_pg (backend 'fake')",
    }


def test_fsdp1_hybrid_shard_shards_over_a_node_and_casts_on_the_all_reduce_stream() -> None:
    """FSDP1 HYBRID_SHARD on 4 ranks, 2 per node: each unit is sharded over the node's 2 ranks (N = 2, not the
    world's 4: _init_utils.py ``_init_process_group_state_for_hybrid_shard``, the shard group is the mesh's
    dimension 1), cast (2·E/N, pre-unshard stream) and gathered (2·E, unshard stream) as under FULL_SHARD; the
    post-backward stream reduce-scatters the bf16 shard (2·E/N), then ``_reduce_grad`` all-reduces it across nodes
    inside ``_all_reduce_stream`` and there ``_accumulate_sharded_grad`` casts it to fp32 (4·E/N): the all-reduce
    stream's. Tiny Llama (root E = 256,128, layers E = 184,576), step 1."""
    from collections import Counter

    t = dataclasses.replace(
        BASE, precision=Precision.BF16_MIXED, world_size=4, gpus_per_node=2, fsdp=Sharding.HYBRID_SHARD, fsdp_version=1
    )
    events = trace_events(M, t, config=CFG)
    layer, root = 2 * 128 * 128 + 2 * 64 * 128 + 3 * 128 * 352 + 2 * 128, 2 * 1000 * 128 + 128
    got = Counter((e.stream, e.bytes) for e in events if e.kind == "alloc" and e.step == 1 and e.stream)
    want: Counter[tuple[str, int]] = Counter()
    for e, times in ((root, 1), (layer, 2), (layer, 2)):  # the root is not resharded after forward
        want["pre_unshard", round_block(2 * e // 2)] += times
        want["all_gather", round_block(2 * e)] += times
        want["reduce_scatter", round_block(2 * e // 2)] += 1
        want["all_reduce", round_block(4 * e // 2)] += 1
    print("got", sorted(got.items()), "want", sorted(want.items()))
    assert got == want
