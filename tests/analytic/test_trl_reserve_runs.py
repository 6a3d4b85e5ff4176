"""TRL's ``chunked_nll`` reserve in a run with dynamic padding (analytic/reserve/trl.py ``trl_stranded_bytes``).

What the chain strands at one shape swings with the last chunk's size, B·(L − 1) mod 256, so a single shape's
reserve is not monotone in L. A run with dynamic padding meets the shorter lengths too and the allocator never
gives their segments back, so its estimate takes the most any length of the swing's last period strands; these
tests hold the two consequences: it does not fall as the batch or the length grows, and it is never under what
one allocator keeps when a shorter step comes first. "Does not fall" up to the hidden states' slice gradients the
chain cuts from the blocks it strands (r·H bytes per target token, r ≤ 4): what it strands shrinks by those of
the targets the larger shape adds, and, where the most stranded moves on in the swing, by those of up to two
periods (the window of 256 counts straddles two chunk counts), while the loss's peak need not grow (full
fine-tuning's peak is the head's at short lengths: Qwen2.5-0.5B, 1 × 513 → 1 × 768, 0.875 MiB less of 9.8 GiB,
256·4·896 bytes). Where the freed hidden-states block grows past one of the chain's requests (the workspace), the
chain strands much less from then on; the run still counts the last period before that edge.
"""

from __future__ import annotations

import dataclasses

from hypothesis import example, given, settings
from hypothesis import strategies as st

from vramledger.analytic import estimate
from vramledger.analytic.logits import trl_chunk
from vramledger.analytic.reserve import replay_excess
from vramledger.analytic.reserve.events import Events
from vramledger.analytic.reserve.trl import trl_chain
from vramledger.catalog import resolve_model
from vramledger.specs import Loss, Method, Precision, TrainSpec
from vramledger.specs.train import TRL_CHUNK_TOKENS

WORKSPACE = 32 * 2**20  # Hopper's cuBLAS workspace, the backward thread's (catalog/device_overhead.json)

trl_runs = st.builds(
    TrainSpec,
    method=st.sampled_from([Method.FULL, Method.LORA]),
    precision=st.sampled_from([Precision.BF16_MIXED, Precision.BF16]),
    micro_batch=st.integers(1, 8),
    seq_len=st.integers(2, 2500),
    grad_ckpt=st.booleans(),
    loss=st.just(Loss.CHUNKED_NLL),
)


@settings(max_examples=40, deadline=None)
@example(
    train=TrainSpec(method=Method.LORA, precision=Precision.BF16, micro_batch=1, seq_len=510, loss=Loss.CHUNKED_NLL),
    model="llama-3.2-1b",
    db=0,
    dl=1,
)  # the single shape falls by 0.5 GiB here: a last chunk of 253 tokens, then of 254
@example(
    train=TrainSpec(method=Method.FULL, micro_batch=4, seq_len=2240, grad_ckpt=True, loss=Loss.CHUNKED_NLL),
    model="qwen2.5-0.5b",
    db=0,
    dl=1,
)  # the freed hidden states' block grows to a 32 MiB segment that takes the workspace: 0.42 GB less stranded
@example(
    train=TrainSpec(method=Method.FULL, micro_batch=3, seq_len=184, grad_ckpt=True, loss=Loss.CHUNKED_NLL),
    model="qwen2.5-0.5b",
    db=1,
    dl=521,
)  # 5 KB past one period's slice gradients and the added tokens' (the blocks' 512-byte rounding)
@example(
    train=TrainSpec(method=Method.FULL, micro_batch=2, seq_len=277, grad_ckpt=True, loss=Loss.CHUNKED_NLL),
    model="qwen2.5-0.5b",
    db=3,
    dl=287,
)  # 9.05 MB less at a flat loss peak: 7 KB past one period's allowance
@given(
    train=trl_runs,
    model=st.sampled_from(["qwen2.5-0.5b", "llama-3.2-1b"]),
    db=st.integers(0, 3),
    dl=st.integers(0, 600),
)
def test_a_padded_trl_runs_reserve_does_not_fall_as_the_shape_grows(
    train: TrainSpec, model: str, db: int, dl: int
) -> None:
    m = resolve_model(model)
    more = dataclasses.replace(train, micro_batch=train.micro_batch + db, seq_len=train.seq_len + dl)
    # the hidden states' slice gradients grow by r·H a token (r ≤ 4); the counted window (n − 256, n] straddles two
    # chunk counts, so the count that strands most can move by up to two periods; each of the four blocks the
    # chain's two replayed chunks cut from a stranded one (mm's hidden-state gradient, the slice gradient) is
    # rounded up to kMinBlockSize (512 B)
    slice_gradients = 4 * m.hidden_size * (more.tokens - train.tokens + 2 * TRL_CHUNK_TOKENS) + 4 * 512
    assert estimate(m, more).peak_reserved >= estimate(m, train).peak_reserved - slice_gradients


def _chain(m, train: TrainSpec, workspace: int) -> tuple[tuple[int, int], ...]:  # noqa: ANN001
    """One step's chain at ``train``'s shape, as ``trl_stranded_bytes`` builds it, ending with every block it
    left live freed but the backward thread's workspace (kept for the run, as CublasHandlePool.cpp keeps it)."""
    t = trl_chunk(m, train, train.tokens)
    n = train.micro_batch * (train.seq_len - 1)
    k = min(train.tokens, TRL_CHUNK_TOKENS)
    short = n - k * (-(-n // k) - 1)
    seq = Events()
    trl_chain(seq, t, seq.alloc(t.hidden), workspace, trl_chunk(m, train, short) if 0 < short < k else None)
    live: dict[int, int] = {}
    for i, size in seq.events:
        if size:
            live[i] = size
        else:
            live.pop(i, None)
    return tuple(seq.events) + tuple((i, 0) for i, size in live.items() if size != workspace)


def test_a_shorter_step_first_keeps_what_its_chain_stranded() -> None:
    """Llama-3.2-1B LoRA, bf16-true: alone, the chain at 1 × 508 (a last chunk of 251 tokens) reserves about
    0.5 GiB more than at 1 × 513 (whole chunks) for the same allocated bytes. Replayed through one allocator,
    508 then 513, the 513-token step reuses what it can of the 508-token step's segments and the rest stays
    cached. The padded run's estimate at 513 keeps at least that beyond the single shape's; the packed one is
    the single shape."""
    m = resolve_model("llama-3.2-1b")
    first = TrainSpec(method=Method.LORA, precision=Precision.BF16, micro_batch=1, seq_len=508, loss=Loss.CHUNKED_NLL)
    then = dataclasses.replace(first, seq_len=513)
    a, b = _chain(m, first, WORKSPACE), _chain(m, then, 0)
    offset = 1 + max(i for i, _ in a)
    run_reserved, _ = replay_excess(a + tuple((i + offset, size) for i, size in b))
    alone_reserved, alone_allocated = replay_excess(_chain(m, then, WORKSPACE))
    run_kept, alone_kept = run_reserved - alone_allocated, alone_reserved - alone_allocated
    padded = estimate(m, then).peak_reserved
    packed = estimate(m, dataclasses.replace(then, packing=True)).peak_reserved
    print(f"cached at the 513-token peak: run {run_kept / 2**20:.0f} MiB, alone {alone_kept / 2**20:.0f} MiB")
    print(f"estimate: padded {padded / 2**30:.3f} GiB, packed {packed / 2**30:.3f} GiB")
    assert run_kept > alone_kept + 256 * 2**20  # the shorter step's segments stay
    assert padded - packed >= run_kept - alone_kept
