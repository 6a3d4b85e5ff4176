"""Full fine-tuning (and freeze): the logits chain's blocks, the optimizer states step 1 creates into them, the
whole blocks step 2 makes again, and the activation, temporary and tied-gradient blocks the per-parameter tensors
cannot use."""

from __future__ import annotations

from collections.abc import Callable

from vramledger.allocator.conf import K_MIN_LARGE_ALLOC, K_SMALL_SIZE, allocation_size
from vramledger.analytic.activations import computes_scores
from vramledger.analytic.parts import StepParts
from vramledger.specs import Loss, ModelSpec, Optimizer, TrainSpec


def logits_blocks(m: ModelSpec, train: TrainSpec) -> tuple[int, ...]:
    """The blocks of the standard loss's logits chain, smallest first: with c < 4 the c·V·T logits, then three fp32
    4·V·T blocks: the fp32 copy (the logits themselves with c = 4), the fp32 log-softmax and the fp32
    ``_log_softmax_backward_data`` gradient (transformers ``ForCausalLMLoss``; the trace shows each in a segment of
    its own). None for a chunked or fused loss.

    With c = 4 ``logits.float()`` returns the logits themselves (torch ``Tensor.float``: no copy when the dtype
    already matches), so the chain is three 4·V·T blocks, not two: lm_head's ``mm`` output, ``_log_softmax``'s and
    ``_log_softmax_backward_data``'s (torch/nn/functional.py ``cross_entropy``: ``log_softmax`` then ``nll_loss``;
    ``nll_loss_backward``'s gradient is cut from the logits' block, freed once the loss is computed). The replays
    of Qwen2.5-0.5B and Llama-3.2-1B in fp32 (bench/reserve/replay_states.jsonl) show those three segments, and step 2
    making all three again where step 1's states sit in them."""
    if train.loss is not Loss.STANDARD:
        return ()
    T, V, c = train.tokens, m.vocab_size, train.precision.compute.bytes
    return ((c * V * T,) if c != 4 else ()) + (4 * V * T,) * 3


def activations_unused(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """Full fine-tuning without checkpointing where c·I·T < b·H·I (``switches_on``): every activation block is
    smaller than a decoder matrix's gradient, state or foreach temporary (b·H·I), so ``optimizer.step()`` makes
    its own segments and the saved activations' stay cached at its peak (bench/reserve/replay_causes.jsonl). The
    length² blocks are left out where their segments (``scores_segments``) hold such a tensor."""
    room, scores = scores_segments(m, train, p)
    fits = room >= p.weights.trainable_dtype.bytes * m.hidden_size * decoder_mlp_width(m)
    return p.saved_layers_bytes + (0 if fits else p.scores_bytes) + p.extra_saved_bytes


def scores_segments(m: ModelSpec, train: TrainSpec, p: StepParts) -> tuple[int, int]:
    """The length² blocks the layers saved, as (segment of one, bytes in all). In fp32 eager attention and SDPA's
    math kernel save one block per layer, the fp32 probabilities, 4·nh·L² per sequence (analytic/activations.py
    ``_attention_parts``), whose segments per-parameter tensors up to their size fit once backward has freed them:
    from 10 MiB a segment of its own (Llama-3.2-1B fp32 1 × 2048: 512 MiB blocks against 64 MiB MLP tensors), under
    it a 20 MiB kLargeBuffer segment (``get_allocation_size``) that the next layer's block, made before this one is
    freed, shares where two fit, and which ``try_merge_blocks`` makes whole again once both are freed (Qwen2.5-0.5B
    fp32 4 × 215: 9.9 MiB blocks, two to a segment, where 16.6 MiB MLP tensors fit). Counted with the blocks'
    bytes only (a lower bound of the segments' room). Otherwise counted among the blocks of at most c·I·T, as
    before: eager's fp32 softmax and its cast under c < 4 are two blocks, not told apart here."""
    c, scores = train.precision.compute.bytes, p.scores_bytes
    if block := fp32_scores_block(m, train, p):
        shared = block > K_SMALL_SIZE and 2 * block <= allocation_size(block)
        return (allocation_size(block) if shared else held_room(block)), scores
    return held_room(c * decoder_mlp_width(m) * train.tokens), scores


def fp32_scores_block(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """One layer's saved fp32 probabilities, 4·nh·L² per sequence, where ``scores_segments`` counts them as blocks of
    their own (fp32 eager attention or SDPA's math kernel, every trained layer saving one); 0 elsewhere."""
    c = train.precision.compute.bytes
    if c == 4 and computes_scores(m, train) and p.scores_bytes == p.weights.trainable_layers * p.layer_scores_bytes:
        return p.layer_scores_bytes
    return 0


def tied_gradient_block(p: StepParts) -> int:
    """A V·H gradient block step 2 makes again for a tied embedding (full fine-tuning), where 4·V·T < V·H·b.

    With tied weights backward holds three V·H tensors at once: lm_head's gradient (already in ``.grad``), the
    embedding's (``embedding_dense_backward``) and their sum (AccumulateGrad's out-of-place ``add``). After step 1
    the two freed ones are exactly the size of the embedding's states, which ``_init_group`` creates first (the
    embedding is the first parameter), so best fit puts the states there. Step 2's backward then finds two V·H
    blocks (the sum's, freed by ``zero_grad``, and the foreach temporary's of step 1's optimizer) and, where the
    freed fp32 logits blocks are smaller than V·H, nothing else: it makes one more (the replay shows the ``add``
    block made in step 2). With an fp32 compute dtype too: Llama-3.2-1B fp32 1 × 512, the trace's replay makes the
    1.05 GB ``add`` block in step 2 (bench/reserve/replay_causes.jsonl), so ``switches_on`` applies it there as well.
    """
    return p.weights.lm_head_weight_numel * p.weights.trainable_dtype.bytes


def decoder_mlp_width(m: ModelSpec) -> int:
    """I: the MLP width one token goes through (top-k experts' for a MoE)."""
    return m.moe_intermediate_size * m.experts_per_token if m.is_moe else m.intermediate_size


def _activations_too_small_for_parameters(m: ModelSpec, train: TrainSpec, p: StepParts) -> bool:
    """No checkpointing and c·I·T < b·H·I: no gradient, state or foreach temporary of a decoder matrix fits in an
    activation block."""
    c, b = train.precision.compute.bytes, p.weights.trainable_dtype.bytes
    I = decoder_mlp_width(m)  # noqa: E741
    return not train.grad_ckpt and c * I * train.tokens < b * m.hidden_size * I


def temporaries_unused_by_activations(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """The foreach temporaries' segments, cached at step 2's loss peak where every c·I·T activation is larger than
    a decoder matrix's per-parameter tensor (b·H·I) and so cannot use them (term 1)."""
    c, b = train.precision.compute.bytes, p.weights.trainable_dtype.bytes
    I = decoder_mlp_width(m)  # noqa: E741
    if train.grad_ckpt or not p.weights.trainable_layers or c * I * train.tokens <= b * m.hidden_size * I:
        return 0
    return p.step_temp_bytes


def states_in_logits(m: ModelSpec, train: TrainSpec, p: StepParts, r1: int, stranded: int) -> int:
    """Bytes of optimizer states step 1 puts into the logits chain's blocks.

    The cache outside the logits blocks after step 1's backward is R1 less the weights, the chain and the
    stranded blocks (none of it usable when the activation blocks are too small); the gradients G are already
    in it. States beyond what is left go into the logits blocks; and one state of the V·H embedding (or lm_head)
    goes there anyway when it is larger than every activation block (c·I·T, a layer's forward transients).
    """
    S = p.state_bytes
    chain = logits_blocks(m, train)
    if not S or not chain:
        return 0
    wb = p.weights
    W = p.frozen_bytes + p.trainable_bytes + p.master_bytes + p.workspace_bytes
    outside = 0
    if not _activations_too_small_for_parameters(m, train, p):
        outside = max(r1 - W - sum(chain) - stranded, 0)
    into = min(S, max(S + p.grad_bytes - outside, 0))
    n_states = max(round(S / max(p.grad_bytes, 1)), 1)
    one_state = wb.lm_head_weight_numel * S // max(n_states * wb.trainable_params, 1)
    if one_state > max(train.precision.compute.bytes * decoder_mlp_width(m) * train.tokens, p.forward_layer_temp):
        into = max(into, one_state)
    return into


def gradients_in_chain(m: ModelSpec, train: TrainSpec, p: StepParts, r1: int) -> int:
    """Bytes of gradients step 1's backward cuts from the logits chain's blocks under checkpointing (full
    fine-tuning; 0 without checkpointing): the gradients G less the cache outside the chain, R1 less the weights
    and the chain (the stranded layer's blocks and the checkpointed inputs' among it), at most the chain.

    Under checkpointing (torch/utils/checkpoint.py, ``use_reentrant=False``) backward frees only the checkpointed
    inputs and one recomputed layer's transients, whose segments the next layer reuses; every layer's gradients
    stay live until ``optimizer.step()``, so once that cache is full best fit (CUDACachingAllocator.cpp
    ``get_free_block``) cuts them from the chain's blocks, free after lm_head's backward. ``Adam._init_group``
    (torch/optim/adam.py) then creates the states after them, so the states start where the gradients stop
    (``relaid_counted``). Qwen2.5-0.5B fp32, 8 × 512 (replay_states.jsonl, and a per-segment count of the replay
    at step 1's first state): 1.52 GiB of the 1.84 GiB of gradients sit in the fp32 logits blocks (1.19 GiB
    counted), the states reach all three 2.32 GiB blocks and step 2 makes the three again (16.69 GiB replayed); in
    bf16-mixed at the same shape autocast's cached casts and the larger forward segments hold all but 0.64 GiB
    of them. Without checkpointing the saved activations backward frees hold the gradients (``blocks_with_states``).

    Counted with c = 4 only. With c < 4 R1 (a lower bound: shape.py ``forward_segments``) leaves out forward
    segments that hold gradients in the replays, so the room comes out short and the count too high: Qwen3-0.6B
    eager, bf16-true, 8 × 1024 keeps 1.3 GiB of eager attention's fp32 softmax and cast blocks free outside the
    chain at step 1's first state, where R1 leaves 0.88 GiB of room for 1.11 GiB of gradients; counted, the states
    reach an fp32 block the replay leaves whole (+4.5% over the replay's 19.62 GiB, against +0.7% without)."""
    chain = logits_blocks(m, train)
    if not train.grad_ckpt or not chain or train.precision.compute.bytes != 4:
        return 0
    W = p.frozen_bytes + p.trainable_bytes + p.master_bytes + p.workspace_bytes
    outside = max(r1 - W - sum(chain), 0)
    return min(max(p.grad_bytes - outside, 0), sum(chain))


def relaid_bytes(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """fp32 logits bytes step 2 makes again because step 1's states sit in those blocks (term 2).

    Step 2's backward needs three fp32 4·V·T blocks at once (the saved log-softmax and two gradients); the space
    the states took in them is made again, up to the states' size. A request no larger than the V·H gradient
    (lm_head's or the embedding's) finds a freed gradient or foreach-temporary block instead. Counted as if the
    states went into the logits blocks whatever else is cached (an over-estimate where they fit in activation
    blocks): the bytes they really take there shrink as a longer sequence brings larger activation blocks, and
    the estimate must not fall with the shape.
    """
    chain = logits_blocks(m, train)
    fp32 = [x for x in chain if x == 4 * m.vocab_size * train.tokens]
    head = p.weights.lm_head_weight_numel * p.weights.trainable_dtype.bytes
    if not p.state_bytes or not fp32 or fp32[0] <= head:
        return 0
    return min(p.state_bytes, sum(fp32))


def remade_blocks(m: ModelSpec, train: TrainSpec) -> tuple[int, tuple[int, ...]]:
    """The c·V·T logits block (0 with c = 4), and the blocks step 2's backward needs whole, in the order step 1's
    optimizer states reach them: the standard loss's fp32 4·V·T logits blocks (three with c < 4: the fp32 copy,
    the log-softmax, ``_log_softmax_backward_data``'s gradient; two with c = 4), then, with eager attention, the
    two fp32 4·nh·L² blocks per sequence of a layer's attention backward (the upcast gradient of the probabilities
    and ``_softmax_backward_data``'s output: transformers ``eager_attention_forward`` computes the softmax in fp32).
    Empty for a chunked or fused loss."""
    chain = logits_blocks(m, train)
    if not chain:
        return 0, ()
    hole = chain[0] if len(chain) == 4 else 0
    fp32 = chain[1:] if hole else chain
    eager = 4 * m.num_heads * train.seq_len * train.seq_len * train.micro_batch
    return hole, fp32 + ((eager, eager) if computes_scores(m, train) else ())


def blocks_with_states(S: int, hole: int, blocks: tuple[int, ...]) -> int:
    """How many of ``blocks`` step 1's optimizer states S reach, counted as if they all go into the logits chain
    and these blocks: what the c·V·T block (``hole``) cannot hold spills into them in order, each whole one after
    the previous one is full.

    torch/optim/adam.py ``Adam._init_group`` (AdamW subclasses it) creates ``exp_avg`` then ``exp_avg_sq`` with
    ``torch.zeros_like``, parameter by parameter, after step 1's backward, into whatever the cache holds. Each takes
    the smallest cached block at least as large (CUDACachingAllocator.cpp ``get_free_block``, best fit), and a
    larger one is split, its rest staying cached (``alloc_found_block``, ``should_split``): the c·V·T block fills
    first, and a split block's rest, smaller than a whole one, before the next whole one.
    bench/reserve/replay_states.jsonl measures it: step 2 makes again the counted number of fp32 logits blocks on
    17 of the 24 full fine-tuning configs with AdamW where 4·V·T exceeds the V·H gradient (the gradients, placed
    in step 1's backward, fill the activation blocks the states could otherwise use); one block off on the others.

    >>> blocks_with_states(S=300, hole=50, blocks=(100, 100, 100))  # 250 past the hole: three blocks reached
    3
    >>> blocks_with_states(S=120, hole=50, blocks=(100, 100, 100))
    1
    """
    spill, reached = S - hole, 0
    for size in blocks:
        if spill <= 0:
            break
        reached, spill = reached + 1, spill - size
    return reached


def relaid_regions(
    m: ModelSpec,
    train: TrainSpec,
    p: StepParts,
    beside: Callable[[TrainSpec], int] | None = None,
    workspace: Callable[[TrainSpec], bool] | None = None,
    grads: Callable[[TrainSpec], int] | None = None,
    counts: dict[tuple[int, ...], int] | None = None,
) -> list[Callable[[int, int], bool]]:
    """For each k ≥ 1, where the states reach at least k of the blocks step 2 needs whole (``blocks_with_states``),
    for full fine-tuning with AdamW and the standard loss: a set of shapes (b, ℓ) closed downwards (the blocks grow
    with the shape, the states do not, and the room ``beside`` them outside the chain, shape.py
    ``states_beside_chain`` at that shape, grows with it); the first also where the backward workspace takes an
    fp32 block (``workspace``, shape.py ``workspace_in_chain``: closed downwards too). ``grads``: the gradients in
    the chain at that shape (``gradients_in_chain``: the room outside the chain grows with the shape, so they do not
    grow). None with adapters, another optimizer or a chunked or fused loss. ``counts``: the blocks reached at each
    shape (b, ℓ), and under the key (b, ℓ, 1) whether the workspace takes an fp32 block there, filled as the searches
    go, for a caller that shares it between setups differing only in their shape (and whose ``beside``, ``grads`` and
    ``workspace`` then agree at each shape)."""
    wb = p.weights
    small = wb.largest_trainable_numel * wb.trainable_dtype.bytes <= K_SMALL_SIZE
    _, blocks = remade_blocks(m, train)
    if train.adapters or small or not blocks or not wb.trainable_layers:
        return []
    if train.optimizer not in _ADAM_INIT_GROUP:  # without states, the workspace's block alone (``relaid_counted``)
        if large_pool_states(m, train, p) or workspace is None:
            return []
        lost_at = workspace
        return [lambda b, ell: lost_at(train.at_shape(b, ell))]

    memo = {} if counts is None else counts  # each k's search visits the shapes the others did

    def reached(b: int, ell: int) -> int:
        n = memo.get((b, ell))
        if n is None:
            t = train.at_shape(b, ell)
            hole, at = remade_blocks(m, t)
            S = p.state_bytes - (beside(t) if beside else 0) + (grads(t) if grads else 0)
            n = memo[b, ell] = blocks_with_states(S, hole, at)
        return n

    def lost(b: int, ell: int) -> bool:
        if workspace is None:
            return False
        n = memo.get((b, ell, 1))  # the same shared memo, its own key: a search asks for the same shapes again
        if n is None:
            n = memo[b, ell, 1] = int(workspace(train.at_shape(b, ell)))
        return bool(n)

    out: list[Callable[[int, int], bool]] = []
    for k in range(1, len(blocks) + 1):

        def on(b: int, ell: int, k: int = k) -> bool:
            return reached(b, ell) >= k or (k == 1 and lost(b, ell))

        out.append(on)
    if workspace is not None:
        # where the workspace takes an fp32 block, one count makes that block again whole, where the states alone
        # give the bound (``relaid_counted``): inside the first region the figure falls at the workspace's own
        # edge, so that edge is a region of its own (qwen2.5-0.5b full, bf16-true, checkpointing, 3 × 1149 → 1150
        # fell by 107 MiB without it)
        out.append(lost)
    return out


def large_pool_states(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """Bytes of the optimizer's states that are large-pool blocks, the only ones that can sit in the logits chain's
    blocks: all of them but for Adafactor, whose states are vectors.

    transformers ``Adafactor.step`` (optimization.py; HF's defaults, ``beta1=None``: no first moment) keeps, for a
    matrix, the factored second moment ``exp_avg_sq_row`` (shape[:-1]) and ``exp_avg_sq_col`` (shape[-1:]), and a
    full ``exp_avg_sq`` only for vectors (the norms' weights): fp32 vectors of V, I or H elements, each a small-pool
    block (CUDACachingAllocator.cpp: requests up to kSmallSize, 1 MiB, are served from 2 MiB small segments) while no
    dimension exceeds 262,144. The replays of Qwen2.5-0.5B full with Adafactor (bench/reserve/packed_adafactor.jsonl)
    put none in the chain: step 2 makes again only the fp32 block the backward workspace took, as with SGD."""
    if train.optimizer is not Optimizer.ADAFACTOR:
        return p.state_bytes
    widest = max(m.vocab_size, m.hidden_size, m.intermediate_size, m.q_dim, m.kv_dim)
    return p.state_bytes if 4 * widest > K_SMALL_SIZE else 0


# torch.optim.AdamW in its three implementations: states created by Adam._init_group (torch/optim/adam.py).
_ADAM_INIT_GROUP = (Optimizer.ADAMW, Optimizer.ADAMW_FUSED, Optimizer.ADAMW_FORLOOP)


def relaid_counted(
    m: ModelSpec, train: TrainSpec, p: StepParts, beside: int = 0, workspace: bool = False, grads: int = 0
) -> int:
    """The blocks step 2 makes again because step 1's states sit in them, counted at this shape (term 2,
    ``on.relaid``): none where the states fit in the c·V·T logits block, the blocks they reach made again whole
    where they reach two or more (``blocks_with_states``), the bound min(S, 3·4·V·T) in between.

    A block with a state inside cannot serve step 2's request of its own size (``get_free_block`` needs one free
    block at least that large; blocks of different segments never merge, ``try_merge_blocks``), so each block a
    state reached is made again whole: the blocks' bytes, not the states' (Qwen2.5-0.5B full, 8 × 512: states of
    1.59 fp32 logits blocks, two made again, 4.98 GB, where min(S, 3·4·V·T) counts 3.95 GB; Llama-3.2-3B eager,
    2 × 2048: the three fp32 logits blocks and an eager backward block; Qwen3-0.6B 4 × 4096: states 0.48 of a
    4·V·T block, the c·V·T block 0.5, none made again). Where the count is one (S − c·V·T < 4·V·T), whether a
    state reaches an fp32 block at all depends on the room the gradients leave in the c·V·T block and the
    activation blocks, which the estimate does not model (replay_states.jsonl: Qwen2.5-0.5B 16 × 256 one block,
    Qwen2.5-1.5B 8 × 512 three): there the bound stays. The count falls as the shape grows, so a run with dynamic
    padding counts it at the longest shapes ≤ (B, L) where it is at least 1, 2, … (``relaid_regions``,
    ``held_reserved``); a packed run counts it at its one shape (``on_at``). As in ``relaid_bytes``, where a 4·V·T
    request is no larger than the V·H gradient it finds a freed gradient block instead (0 then). ``beside``: the states
    best fit puts outside the chain where step 2's loss peak has free blocks for them (shape.py
    ``states_beside_chain``), left out of the count; ``workspace``: the backward workspace sits in the fp32 copy's block
    (shape.py ``workspace_in_chain``), which step 2 then makes again whole, at least; ``grads``: the gradients step 1's
    backward cut from the chain before the states came (``gradients_in_chain``), counted with the states as if they fill
    the blocks first: the states start where they stop. An over-count where the gradients alone fill a whole block,
    which ``zero_grad`` frees before step 2 (G past the outside room by more than a block).

    An optimizer without states (SGD without momentum) puts nothing in the chain, but the backward workspace's block is
    made again all the same: Qwen3-0.6B full, SGD, bf16-mixed, checkpointing, 2 × 1024 (c·I·T 12 MiB, 4·H·T 8 MiB, both
    under the 32 MiB workspace): the workspace sits in the fp32 copy's block from step 1's backward and step 2's
    ``_log_softmax_backward_data`` makes a 1.16 GiB segment (8.89 GiB replayed, 7.67 estimated without it). So does
    Adafactor, whose states are small-pool vectors (``large_pool_states``): Qwen2.5-0.5B full, Adafactor, bf16-true,
    checkpointing, 2 × 1024 (6.42 GiB replayed, 5.19 estimated without it; bench/reserve/packed_adafactor.jsonl).
    """
    hole, blocks = remade_blocks(m, train)
    head = p.weights.lm_head_weight_numel * p.weights.trainable_dtype.bytes
    if blocks and train.optimizer not in _ADAM_INIT_GROUP and not large_pool_states(m, train, p):
        return blocks[0] if workspace and blocks[0] > head else 0  # no state reaches the chain
    if train.optimizer not in _ADAM_INIT_GROUP or not blocks:
        return relaid_bytes(m, train, p)
    reached = blocks_with_states(p.state_bytes - beside + grads, hole, blocks)
    if blocks[0] <= head:
        return 0
    least = blocks[0] if workspace else 0
    if reached == 0:
        return least
    return max(relaid_bytes(m, train, p), least) if reached == 1 else sum(blocks[:reached])


def eager_backward_segments(m: ModelSpec, train: TrainSpec) -> int:
    """Eager attention's two fp32 backward blocks, made as new segments after step 1's loss peak where they are
    larger than every block backward has freed by then (full fine-tuning, the standard loss).

    A layer's attention backward holds two fp32 4·nh·L² blocks per sequence at once (``remade_blocks``). The
    largest blocks freed by then are the fp32 4·V·T logits blocks; where 4·nh·L²·B > 4·V·T (nh·L > V) best fit
    finds none that holds them (``get_free_block``) and two segments are made on top of step 1's loss-peak reserve
    (mid toy model of bench/reserve/, eager, 1 × 2048, nh·L = 32,768 > V = 32,000: the replay reserves 6.12 GB
    at step 1's loss peak and 6.67 GB before its optimizer, the two 268 MB blocks of ``_to_copy`` and
    ``_softmax_backward_data`` made in between)."""
    if not computes_scores(m, train) or train.loss is not Loss.STANDARD:
        return 0
    eager = 4 * m.num_heads * train.seq_len * train.seq_len * train.micro_batch
    return 2 * eager if eager > 4 * m.vocab_size * train.tokens else 0


def held_room(block: int) -> int:
    """The free block a block forward made offers once freed: its whole segment from 10 MiB
    (``get_allocation_size``), the block's own bytes under it (held_activations.py ``_room`` says why)."""
    return allocation_size(block) if block >= K_MIN_LARGE_ALLOC else block
