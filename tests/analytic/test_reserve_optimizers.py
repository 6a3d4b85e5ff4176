"""The reserve of the optimizers other than foreach AdamW (analytic/reserve/optimizers.py ``end_of_backward_bound``,
``casts_unused``, ``_relaid_without_temporaries``, ``temporaries_switch``, ``checkpointed_forward_switch``, with
ckpt_forward.py ``forward_left_free``), from the caching allocator's rules.

Truths: hand-built allocation sequences replayed through ``allocator/model.py`` (the port of
CUDACachingAllocator.cpp: best fit by size, blocks of different segments never merge, requests ≥ 10 MiB get a
segment of their size rounded to 2 MiB), and hand derivations from a model's published shapes. The grid test
(test_reserve.py) holds the closed form against the replays of real traced steps.
"""

from __future__ import annotations

import dataclasses

from hypothesis import example, given, settings
from hypothesis import strategies as st

from vramledger.analytic import estimate
from vramledger.analytic.reserve import replay_excess
from vramledger.analytic.reserve.ckpt_forward import forward_left_free
from vramledger.analytic.reserve.full import relaid_counted
from vramledger.analytic.reserve.optimizers import casts_unused, checkpointed_forward_switch
from vramledger.analytic.reserve.shape import workspace_in_chain
from vramledger.analytic.step import step_parts
from vramledger.catalog import resolve_model
from vramledger.ledger import Phase
from vramledger.specs import Method, Optimizer, Precision, TrainSpec

MiB = 2**20


def test_autocast_copies_too_small_for_the_gradients_stay_cached() -> None:
    """Forward caches four 32 MiB bf16 copies (an MLP matrix's, c·H·I) and frees them when it ends; backward's fp32
    gradients of two 16 MiB attention matrices fit one copy's block (split), the four 64 MiB MLP gradients fit none
    and get segments of their own. At the end of backward three copies' blocks are cached and free: 96 MiB =
    copies − fitting gradients (4·32 − 2·16). With two fp32 states per attention matrix (fused AdamW, made in the
    blocks left) only 32 MiB stays free: 4·32 − 3·(2·16)."""
    weights = ((1, 200 * MiB),)
    copies = tuple((2 + i, 32 * MiB) for i in range(4)) + tuple((2 + i, 0) for i in range(4))
    grads = ((6, 16 * MiB), (7, 16 * MiB)) + tuple((8 + i, 64 * MiB) for i in range(4))
    states = tuple((12 + i, 16 * MiB) for i in range(4))
    sgd = replay_excess(weights + copies + grads)
    fused = replay_excess(weights + copies + grads + states)
    print(
        f"cached free: SGD {(sgd[0] - sgd[1]) // MiB} MiB (96 expected), fused {(fused[0] - fused[1]) // MiB} MiB (32)"
    )
    assert sgd[0] - sgd[1] == 96 * MiB
    assert fused[0] - fused[1] == 32 * MiB


def test_casts_unused_for_llama_3_2_1b_by_hand() -> None:
    """Llama-3.2-1B (H 2048, 8 KV heads of 64, I 8192, 16 layers), fp32 weights under bf16 autocast. Per layer q and
    o are H·H, k and v H·512, gate, up and down H·I: the bf16 copies are 2·16·(2·2048² + 2·2048·512 + 3·2048·8192)
    bytes; an fp32 gradient fits the largest copy (2·2048·8192 B) when it is q, k, v or o's (4·2048² ≤ 2·2048·8192),
    not an MLP matrix's. SGD (one tensor per matrix): copies − 4·16·(2·2048² + 2·2048·512); fused AdamW (three: the
    gradient and two states) fills them all."""
    per_layer = 2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192
    small = 2 * 2048 * 2048 + 2 * 2048 * 512
    copies, fitting = 2 * 16 * per_layer, 4 * 16 * small
    m = resolve_model("llama-3.2-1b")
    got = {}
    for opt in (Optimizer.SGD, Optimizer.ADAMW_FUSED):
        train = TrainSpec(method=Method.FULL, optimizer=opt, micro_batch=2, seq_len=1024, grad_ckpt=True)
        got[opt] = casts_unused(m, train, step_parts(m, train))
    print(f"expected SGD {copies - fitting}, fused 0; got {got}")
    assert got == {Optimizer.SGD: copies - fitting, Optimizer.ADAMW_FUSED: 0}


def test_adafactors_temporaries_pair_up_only_in_blocks_of_two() -> None:
    """Adafactor's four t-byte temporaries after backward freed three fp32 logits blocks F: best fit puts two in a
    block where F ≥ 2t (no new segment), one where t ≤ F < 2t (three placed, the fourth in a new segment of t, and
    each block's F − t cached beside them). t = 100 MiB; F = 200 and 190 MiB."""

    def step(F: int) -> tuple[tuple[int, int], ...]:
        chain = tuple((1 + i, F) for i in range(3)) + tuple((1 + i, 0) for i in range(3))
        return chain + tuple((10 + i, 100 * MiB) for i in range(4))

    got = [replay_excess(step(F * MiB)) for F in (200, 190)]
    print(f"reserved, allocated: F = 200 MiB {[x // MiB for x in got[0]]}, F = 190 MiB {[x // MiB for x in got[1]]}")
    assert got[0] == (600 * MiB, 600 * MiB)
    assert got[1] == (670 * MiB, 570 * MiB)


@settings(max_examples=40, deadline=None)
@example(
    train=TrainSpec(method=Method.FULL, optimizer=Optimizer.ADAMW_FUSED, micro_batch=2, seq_len=1023),
    model="llama-3.2-1b",
    db=0,
    dl=1,
)  # 4·V·T reaches the V×H gradient: the fused step's one re-made fp32 block gives way to ``relaid_bytes``'s
@example(
    train=TrainSpec(method=Method.FULL, optimizer=Optimizer.SGD, micro_batch=2, seq_len=1023, grad_ckpt=True),
    model="llama-3.2-1b",
    db=0,
    dl=1,
)  # the tied V×H block the SGD run's shorter batches make stops at 2 × 1024
@example(
    train=TrainSpec(
        method=Method.FULL, optimizer=Optimizer.ADAMW_FUSED, precision=Precision.FP32, seq_len=449, grad_ckpt=True
    ),
    model="qwen2.5-0.5b",
    db=0,
    dl=448,
)  # fused AdamW's re-made fp32 block stops where 4·V·T outgrows the head's gradient (1 × 896): held, not dropped
@given(
    train=st.builds(
        TrainSpec,
        method=st.just(Method.FULL),
        optimizer=st.sampled_from([Optimizer.SGD, Optimizer.ADAMW_FUSED, Optimizer.ADAFACTOR]),
        precision=st.sampled_from([Precision.BF16_MIXED, Precision.BF16, Precision.FP32]),
        micro_batch=st.integers(1, 8),
        seq_len=st.integers(1, 3000),
        grad_ckpt=st.booleans(),
    ),
    model=st.sampled_from(["llama-3.2-1b", "qwen2.5-0.5b", "llama-3.2-3b"]),
    db=st.integers(0, 4),
    dl=st.integers(0, 1024),
)
def test_reserved_never_falls_as_batch_or_length_grows(train: TrainSpec, model: str, db: int, dl: int) -> None:
    """The end-of-backward reserve of the optimizers without step temporaries (reserve/optimizers.py
    ``end_of_backward_bound``) switches terms off as the shape grows, as the foreach AdamW one does: the estimate's
    reserved must still never fall as the micro-batch or the length grows (the planner's searches rely on it)."""
    m = resolve_model(model)
    more = dataclasses.replace(train, micro_batch=train.micro_batch + db, seq_len=train.seq_len + dl)
    got = [
        max(estimate(m, t).reserved(ph) for ph in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER))
        for t in (train, more)
    ]
    assert got[1] >= got[0]


def _checkpointed_forward_then_backward(input_bytes: int) -> tuple[tuple[int, int], ...]:
    """Three checkpointed layers under autocast, then backward's gradients. Each layer keeps its input and three
    32 MiB copies of its MLP matrices (``cached_cast``) and frees its 32 MiB transients (transformers ``LlamaMLP``:
    gate, its ``act_fn``, up, their product; ``torch.utils.checkpoint`` keeps none of them); autocast's exit frees
    the copies, backward the inputs; then six 16 MiB gradients (q and o's, fp32) and nine 64 MiB MLP gradients."""
    seq: list[tuple[int, int]] = [(1, 200 * MiB)]
    ids = iter(range(10, 100))
    kept: list[int] = []
    for _ in range(3):
        x, c1, g, s, c2, u, prod, c3 = (next(ids) for _ in range(8))
        seq += [(x, input_bytes), (c1, 32 * MiB), (g, 32 * MiB), (s, 32 * MiB), (g, 0), (c2, 32 * MiB)]
        seq += [(u, 32 * MiB), (prod, 32 * MiB), (s, 0), (u, 0), (c3, 32 * MiB), (prod, 0)]
        kept += [x, c1, c2, c3]
    seq += [(i, 0) for i in kept]
    seq += [(100 + i, 16 * MiB) for i in range(6)] + [(200 + i, 64 * MiB) for i in range(9)]
    return tuple(seq)


def test_the_checkpointed_forwards_segments_stay_cached_beside_the_mlp_gradients() -> None:
    """What ``forward_left_free`` counts, on a hand-built step: at the last layer's MLP product the forward holds the
    three inputs (12 MiB each, segments of their own), eight copies (the last ``down_proj``'s comes after) and three
    transients; every one of those blocks is free at the end of backward, but for the 16 MiB gradients cut from
    them (the 64 MiB ones fit none): 3·12 + 8·32 + 3·32 − 6·16 = 292 MiB at least. The replay keeps 8 MiB more: a
    later layer's input is cut from a freed 32 MiB transient (best fit), which then needs a new segment."""
    reserved, allocated = replay_excess(_checkpointed_forward_then_backward(12 * MiB))
    bound = 3 * 12 * MiB + 8 * 32 * MiB + 3 * 32 * MiB - 6 * 16 * MiB
    print(f"free at the end of backward: replay {(reserved - allocated) // MiB} MiB, bound {bound // MiB} MiB")
    assert bound <= reserved - allocated < bound + 32 * MiB


def test_forward_left_free_for_llama_3_2_1b_by_hand() -> None:
    """Llama-3.2-1B (H 2048, I 8192, 16 layers) full, bf16-mixed, SGD, checkpointing, 2 × 1024 (T 2048): the inputs
    16·4·H·T (fp32 residual) and the padded batch's boolean mask B·L² (every checkpointed layer's input, held until
    backward), the last layer's transients 3·2·I·T + 2·4·H·T, the copies as in
    ``test_casts_unused_for_llama_3_2_1b_by_hand``; less q, k, v and o's fp32 gradients (no larger than a 32 MiB
    block), the backward thread's 32 MiB cuBLAS workspace (Hopper) and the last ``down_proj``'s copy (2·H·I). The
    replay of the traced step keeps 1.44 GiB of whole 32 MiB blocks free at step 2's end of backward."""
    H, I, T, n = 2048, 8192, 2048, 16  # noqa: E741
    copies = 2 * n * (2 * H * H + 2 * H * 512 + 3 * H * I)
    fitting = 4 * n * (2 * H * H + 2 * H * 512)
    mask = 2 * 1024 * 1024
    expected = n * 4 * H * T + mask + (3 * 2 * I + 2 * 4 * H) * T + copies - fitting - 32 * MiB - 2 * H * I
    m = resolve_model("llama-3.2-1b")
    train = TrainSpec(method=Method.FULL, optimizer=Optimizer.SGD, micro_batch=2, seq_len=1024, grad_ckpt=True)
    got = forward_left_free(m, train, step_parts(m, train))
    print(f"expected {expected / 2**30:.3f} GiB, got {got / 2**30:.3f} GiB")
    assert got == expected


def test_the_checkpointed_forward_switch_stops_where_the_mlp_gradient_fits_a_segment() -> None:
    """The MLP block 2·I·T gets a segment rounded up to 2 MiB (``get_allocation_size``): 62 MiB at T = 3968 (under
    the 64 MiB fp32 MLP gradient), 64 MiB from T = 3970, where the gradients fit the transients' blocks."""
    m = resolve_model("llama-3.2-1b")
    train = TrainSpec(method=Method.FULL, optimizer=Optimizer.SGD, micro_batch=2, seq_len=1024, grad_ckpt=True)
    on = checkpointed_forward_switch(m, train, step_parts(m, train))
    assert on is not None
    print(f"on at 2 × 1984: {on(2, 1984)}, at 2 × 1985: {on(2, 1985)}")
    assert on(2, 1984) and not on(2, 1985)
    foreach = dataclasses.replace(train, optimizer=Optimizer.ADAMW)  # its step's temporaries set the reserve
    assert checkpointed_forward_switch(m, foreach, step_parts(m, foreach)) is None


def test_without_states_the_workspaces_logits_block_is_made_again() -> None:
    """SGD keeps no state, but under checkpointing the backward thread's 32 MiB cuBLAS workspace is cut from the fp32
    copy's logits block in step 1 where every block forward freed is smaller (Qwen3-0.6B 2 × 1024: c·I·T 12 MiB,
    RMSNorm's fp32 4·H·T 8 MiB, q_norm's 4·nh·hd·T 16 MiB), and step 2 makes that 4·V·T block again: the replay of the
    traced step makes a 1,187 MiB segment in step 2's ``_log_softmax_backward_data`` (8.89 GiB reserved). At 4 × 1024
    q_norm's fp32 block is 32 MiB and holds the workspace (the replay: in a 32 MiB segment of forward's ``pow``,
    nothing made in step 2)."""
    m = resolve_model("qwen3-0.6b")
    V = 151936
    got = {}
    for b in (2, 4):
        train = TrainSpec(method=Method.FULL, optimizer=Optimizer.SGD, micro_batch=b, seq_len=1024, grad_ckpt=True)
        p = step_parts(m, train)
        got[b] = relaid_counted(m, train, p, workspace=workspace_in_chain(m, train, p))
    print(f"made again: 2 × 1024 {got[2] / MiB:.0f} MiB (4·V·T = {4 * V * 2048 / MiB:.0f}), 4 × 1024 {got[4]}")
    assert got == {2: 4 * V * 2048, 4: 0}
