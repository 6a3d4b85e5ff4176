"""TRL's ``chunked_nll`` (analytic/logits.py): its chunks' blocks, replayed through the allocator model, and what
they leave cached at one shape and over a run with dynamic padding (``trl_stranded_bytes``)."""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from vramledger.allocator.conf import allocation_size
from vramledger.analytic.logits import TrlChunk, trl_chunk
from vramledger.analytic.reserve.events import Events, replay_excess
from vramledger.specs import ModelSpec, TrainSpec
from vramledger.specs.train import TRL_CHUNK_TOKENS


def trl_chain(seq: Events, t: TrlChunk, hidden: int, workspace: int = 0, last: TrlChunk | None = None) -> int:
    """TRL's ``chunked_nll`` (analytic/logits.py), block by block: two chunks' forwards, then two chunks'
    recomputes and backwards (the allocator's cache is made by then); returns the hidden states' gradient.
    ``workspace``: the backward thread's cuBLAS workspace, made at the first recompute's matmul (0: counted
    elsewhere, as ``step_sequence`` does). ``last``: the last chunk's sizes where it is shorter (None: as ``t``);
    forward runs it last, backward first."""
    rounds = min(t.chunks, 2)
    order = [t] * rounds if last is None or rounds < 2 else [t, last]
    kept = seq.alloc(t.hidden)  # hidden[order]
    for ti in order:
        w, logits, lsm = _trl_chunk_forward(seq, ti, keep_head=False)
        seq.free(lsm)
        seq.free(logits)
    seq.free(hidden)
    grad_hidden = buffer = None
    for i, t in enumerate(reversed(order)):
        w, logits, lsm = _trl_chunk_forward(seq, t, keep_head=True, workspace=workspace if i == 0 else 0)
        seq.free(logits)
        g1, g2 = seq.alloc(t.fp32), seq.alloc(t.fp32)  # nll_loss_backward, _log_softmax_backward_data
        seq.free(lsm)
        seq.free(g1)
        g16 = seq.alloc(t.grad_cast)
        seq.free(g2)
        gw, gh = seq.alloc(t.weight_grad), seq.alloc(t.grad_h)
        seq.free(w)
        seq.free(g16)
        if t.weight_grad:
            wc = seq.alloc(t.weight_cast) if t.weight_cast else gw
            if wc != gw:
                seq.free(gw)
            if buffer is None:
                buffer = wc
            elif t.first_sum_out_of_place and rounds == 2:
                total = seq.alloc(t.buffer)
                seq.free(buffer)
                seq.free(wc)
                buffer = total
            else:
                seq.free(wc)
        part = seq.alloc(t.hidden)  # slice_backward's zero-padded gradient, summed in place after the first
        seq.free(gh)
        if grad_hidden is None:
            grad_hidden = part
        else:
            seq.free(part)
    seq.free(kept)
    if buffer is not None:
        seq.free(buffer)  # AccumulateGrad: the head's gradient (counted with the gradients) takes it
    assert grad_hidden is not None
    return grad_hidden


def _trl_chunk_forward(seq: Events, t: TrlChunk, *, keep_head: bool, workspace: int = 0) -> tuple[int, int, int]:
    """One chunk's ``_chunk``: the matmul's copies, the logits, log_softmax, the entropy's two temporaries. In the
    recompute (``keep_head``) mm's saved head stays; ``workspace`` (never freed) is made by the matmul before its
    output; returns (saved head, logits, log-softmax)."""
    up = seq.alloc(t.h_up)
    w32 = seq.alloc(t.head32)
    cast = seq.alloc(t.cast)
    seq.alloc(workspace)
    logits = seq.alloc(t.logits)
    seq.free(up)
    saved = cast if t.cast else w32
    for block in (w32, cast):
        if not (keep_head and block == saved):
            seq.free(block)
    upcast = seq.alloc(t.upcast)
    lsm = seq.alloc(t.fp32)
    seq.free(upcast)
    e, prod = seq.alloc(t.fp32), seq.alloc(t.fp32)
    seq.free(e)
    seq.free(prod)
    return (saved if keep_head else 0), logits, lsm


def trl_stranded_bytes(m: ModelSpec, train: TrainSpec, workspace: int) -> int:
    """TRL's ``chunked_nll``: the chain's blocks cached and free at its backward peak, from replaying the chain
    alone (``trl_chain``) through the allocator model, the backward thread's cuBLAS workspace included.

    The trace replay (Qwen2.5-0.5B, TRL's LoRA config, 2 × 256: 3.15 GiB reserved) shows the mechanism. Forward
    runs the chunks under ``torch.utils.checkpoint`` without saving: the head's copy (``w.float()``, autocast's
    cast) is freed before the chunk's fp32 log-softmax, ``exp`` and product, which best fit cuts from its
    segment (``get_free_block``, ``should_split``). The recompute keeps the copy for mm's backward, so those
    fp32 blocks need segments of their own. The autograd thread's first matmul is the first recompute's
    (CublasHandlePool.cpp ``getCurrentCUDABlasHandle``: a handle and workspace per thread, allocated through the
    caching allocator and never freed); best fit puts the workspace in the smallest freed block that holds it,
    forward's l·k·V logits block, and from then on each chunk's logits are cut from an fp32 4·k·V block and one
    more fp32 block is made per recompute (bench/reserve/ causes: the segments step 1's backward makes are
    ``_log_softmax``, ``mul``, ``mul``, each 4·k·V). TRL's targets are B·(L−1) tokens (``labels[..., 1:]``), so
    the last chunk is shorter; backward recomputes it first (the engine runs the latest chunk's node first), and
    the segments it makes (rounded to 2 MiB, ``round_size``) can be too small for a full chunk's 4·k·V requests.
    The figure swings with the last chunk's size, B·(L−1) mod 256: by three to six fp32 4·256·V blocks with bf16
    weights or a trained head, by half of one under bf16-mixed LoRA (Qwen2.5-0.5B, Llama-3.2-1B/3B at 1 to 4
    × 1025-1280; not yet checked on traces at many lengths), so a single shape's is not monotone in L. A packed
    run meets one shape and gets it; a run with dynamic padding meets the shorter lengths too and keeps the
    segments they made (docs/reserve.md "Runs"), so it gets the most the chain strands at any target count in the
    swing's last period (``_trl_run_stranded``). Counted whatever else forward freed (a layer's transient larger
    than the workspace would take it instead: an over-estimate of at most one fp32 chunk block there).
    """
    if train.packing:
        return _trl_shape_stranded(m, train, workspace)
    return _trl_run_stranded(m, train, workspace)


def _trl_run_stranded(m: ModelSpec, train: TrainSpec, workspace: int) -> int:
    """The most the chain strands at any target count of the swing's last period, n' in (n − 256, n] with n =
    B·(L − 1): the shapes (b, ℓ) ≤ (B, L) a padded run meets (shorter batches, an epoch's last, partial batch)
    give target counts b·(ℓ − 1) there, and counting every n' there bounds them from above (by at most the
    swing) and never falls as n grows. Each at b = B's tokens n' + B, the most any b ≤ B gives. Lower target
    counts repeat the same last-chunk sizes, stranding less by the slice gradients (r·H·T, cut from the
    stranded blocks) that grow with the count, at a lower loss peak, as long as the freed hidden-states block
    serves the same requests; where it grows past one of them, that request stops taking a chain block
    (``_hidden_edges``: Qwen2.5-0.5B full, bf16-mixed, 4 × 2241: the 32 MiB workspace fits the freed 32 MiB
    hidden segment and the chain strands 1.10 GB, against 1.52 GB at 4 × 2240, where it went into a logits
    block), so the last period below each such edge is counted too."""
    n, B = train.micro_batch * (train.seq_len - 1), train.micro_batch
    dtypes = replace(train, micro_batch=1, seq_len=1)  # the chain's sizes depend on the shape only through n, T
    ends = {n, *_hidden_edges(m, dtypes, n, B, workspace)}
    return max(_trl_period_stranded(m, dtypes, end, B, workspace) for end in ends)


@lru_cache(maxsize=4096)
def _trl_period_stranded(m: ModelSpec, dtypes: TrainSpec, n: int, B: int, workspace: int) -> int:
    """The most the chain strands at a target count in (n − 256, n], each with n' + B tokens."""
    low = max(n - TRL_CHUNK_TOKENS + 1, 1)
    return max((_trl_chain_stranded(m, dtypes, k, k + B, workspace) for k in range(low, n + 1)), default=0)


def _hidden_edges(m: ModelSpec, dtypes: TrainSpec, n: int, B: int, workspace: int) -> set[int]:
    """For each request of the chain (and the workspace) that the freed hidden-states block holds at n target
    counts but not at fewer, the largest count below n where it does not. The block forward frees is one
    segment (``allocation_size``: 2 MiB rounding, 20 MiB segments between 1 and 10 MiB), so whether best fit
    can cut a request from it (``get_free_block``) depends on the count through that segment's size only."""
    t = trl_chunk(m, dtypes, n + B)
    requests = {workspace, t.h_up, t.head32, t.cast, t.logits, t.fp32, t.upcast, t.grad_cast, t.grad_h}
    requests |= {t.weight_grad, t.weight_cast, t.buffer}

    def segment(k: int) -> int:
        return allocation_size(trl_chunk(m, dtypes, k + B).hidden)

    edges = set()
    for size in sorted(requests - {0}):
        if segment(n) < size or segment(1) >= size:
            continue  # the same at every count ≤ n
        lo, hi = 1, n  # segment(lo) < size ≤ segment(hi): the largest count where the block cannot hold it
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if segment(mid) < size else (lo, mid)
        edges.add(lo)
    return edges


def _trl_shape_stranded(m: ModelSpec, train: TrainSpec, workspace: int) -> int:
    """What the chain strands at one shape (TRL's targets are ``labels[..., 1:]``)."""
    n = train.micro_batch * (train.seq_len - 1)
    return _trl_chain_stranded(m, replace(train, micro_batch=1, seq_len=1), n, train.tokens, workspace)


@lru_cache(maxsize=8192)
def _trl_chain_stranded(m: ModelSpec, dtypes: TrainSpec, n: int, tokens: int, workspace: int) -> int:
    """``trl_chain`` for ``n`` target tokens of a ``tokens``-token batch, replayed alone through the allocator
    model: its reserved less its allocated peak."""
    if n < 1:
        return 0
    t = trl_chunk(m, dtypes, tokens)
    k = min(tokens, TRL_CHUNK_TOKENS)
    short = n - k * (-(-n // k) - 1)
    last = trl_chunk(m, dtypes, short) if 0 < short < k else None
    seq = Events()
    trl_chain(seq, t, seq.alloc(t.hidden), workspace, last)
    reserved, allocated = replay_excess(tuple(seq.events))
    return max(reserved - allocated, 0)
