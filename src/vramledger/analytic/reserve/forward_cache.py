"""The cache a LoRA model's forward leaves free at its end, without checkpointing and under it.

Without checkpointing each decoder layer saves its activations and frees its transients; the caching allocator
(``CUDACachingAllocator.cpp``: best fit by size, a new segment when no cached block is large enough, segments
never merged or released) serves the next layer's saved tensors from the blocks the previous layer freed, so that
layer's transients need new segments, and the saved tensors leave the rest of the blocks they were cut from too
small for what comes next. The free cache therefore grows through forward: the first layer's transients (W1),
then a remainder per layer (r), and it is still free at the loss's backward peak (the final norm and the loss
make no request of that size that they do not get elsewhere): the trace replay shows it, at step 2's peak, in
blocks made by the adapted projections' transients of every layer (bench/reserve/replay_causes.jsonl; measured
on the traces once the final norm is done, bench/reserve/forward_cache.jsonl: Qwen2.5-1.5B LoRA 1 × 8192: W1
524 MiB, r 32.7 MiB, 1.35 GiB in all; Phi-3-mini 4 × 1024: 300 MiB, 24.8 MiB, 1.02 GiB).

What each layer allocates is PEFT's ``lora.Linear.forward`` (peft/tuners/lora/layer.py) for each adapted
projection: the frozen base's output ``self.base_layer(x)`` (c·out·T), ``_cast_input_dtype(x, lora_A.weight.dtype)``
(4·in·T with fp32 adapters under autocast, freed once lora_A has its autocast copy, c·in·T, which it saves),
``lora_B(...)`` and ``* scaling`` (c·out·T each), the sum ``result + ...`` (the projection's output); around them
transformers' ``LlamaDecoderLayer``: ``LlamaRMSNorm`` (``hidden_states.to(torch.float32)`` saved, ``pow``, the
product, the cast back and the weight product), ``apply_rotary_pos_emb`` on q and k (``q * cos``,
``rotate_half``'s ``neg`` and ``cat``, ``* sin``, the sum, saved), SDPA's output (saved), the residual sums, the
MLP's ``act_fn(gate)`` (saved) and ``act_fn(gate) * up`` (freed after down_proj). That sequence, n layers of it
and the final norm, is replayed through ``allocator/model.py`` (the port of the caching allocator). Every size is
proportional to the tokens T; replayed at ``T_REF`` tokens, where every request is far above the allocator's 10 MiB
and 2 MiB thresholds, the free cache per token is a property of the architecture alone, and the estimate is that
per-token figure × T, which never falls as T grows: within 6% of the traced forwards where the residual stream's
requests are ≥ 10 MiB. Below that the allocator's 20 MiB segments for smaller requests change the layout (the
trace holds up to 39% more, the 8-layer toy of bench/reserve/ at 1 × 4096, or 12% less, Llama-3.2-1B at 1 × 1024).
Eager attention's score blocks are not in the sequence (reserve/ counts the largest as stranded). DoRA (its
``DoraLinearVariant.forward`` is another sequence), architectures whose projections are not named like Llama's
(``q_proj`` … ``down_proj``, or Phi-3's fused ``qkv_proj``/``gate_up_proj``) and MoE layers are not modelled (0).

Under checkpointing. transformers runs each decoder layer through ``torch.utils.checkpoint`` with
``use_reentrant=False`` (``modeling_utils.py`` ``gradient_checkpointing_enable``; trace/build.py), whose saved-tensor
hooks (``_checkpoint_hook.pack_hook``) store a ``_Holder`` for every tensor autograd would save: a layer's forward
keeps only its input (the checkpoint's saved argument) and its output, and frees each of the tensors above when the
layer's code drops it (the autocast copy once ``lora_A`` has run, the RMSNorm's fp32 input once its product is made,
RoPE's results and SDPA's output after ``o_proj``, the MLP's halves after their product). Its transients make the
first layer's segments; every later layer's output, saved as the next layer's input, is cut from them by best fit,
and where what is left no longer holds a layer's working set (its MLP's c·I·T blocks, ``down_proj``'s fp32 input
4·I·T) a layer makes one more segment (Llama-3-8B 1 × 16384: a 448 MiB one at layers 10, 20, 23, 26 and 29 in the
trace). Step 1's backward makes no segment for its recomputed layers (``_recomputation_hook``: each layer's forward
again, its saved tensors kept this time, then its backward): by then the loss has freed its fp32 logits blocks, far
larger, and they are cut from those (the trace: none in any of the ten configs of
bench/reserve/forward_cache_ckpt.jsonl). So at step 2's loss peak the layers' cache is step 1's forward segments
less what step 2's forward keeps in them: the same sequence, the layers' own tensors dropped, replayed at ``T_REF``
(``checkpointed_forward_cache``): within 25% of the trace (under it on the 7B-8B configs, whose per-layer pattern
of new segments is shifted: the sequence leaves out the forward thread's cuBLAS workspace and RoPE's cos and sin,
made before the first layer). Qwen3's ``q_norm`` and ``k_norm`` are in the sequence; eager attention (its scores
grow with ℓ², not with T), DoRA and Phi-3's fused projections (their views' lifetimes) are not (None: the
one-layer term of ``stranded_bytes`` stands).

Legend: T tokens per micro-batch, H hidden, I intermediate, c compute-dtype bytes, in/out a projection's features.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from vramledger.allocator.blocks import Block
from vramledger.allocator.model import CachingAllocatorModel
from vramledger.analytic.activations import (
    computes_scores,
    explicit_mask,
    layer_activations,
    padded_sdpa,
    peft_casts_adapter_input,
)
from vramledger.analytic.params import layer_linears
from vramledger.analytic.parts import StepParts
from vramledger.analytic.reserve.full import blocks_with_states, logits_blocks
from vramledger.analytic.reserve.workspace import cublas_workspace_block
from vramledger.analytic.weights import Adapted
from vramledger.specs import Attention, Loss, ModelSpec, TrainSpec

# Tokens the layer sequence is replayed at: its smallest request (RoPE's ``neg`` of a 128-wide k, c·64·T) is then
# far above kMinLargeAlloc (10 MiB), so the replayed layout scales with T.
T_REF = 1 << 17
# Losses whose requests at the peak are larger than these blocks (the standard loss's V·T ones, TRL's 4·256·V chunks);
# a fused or chunked loss's chunk requests are cut from what the layers left cached (shape.py ``stranded_bytes``).
_LOSSES_ABOVE = (Loss.STANDARD, Loss.CHUNKED_NLL)
_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FUSED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # Phi-3


def adapter_forward_cache(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """Bytes the forward of a LoRA model without checkpointing leaves cached and free at the loss: the per-token
    figure of the replayed layer sequence × T (0 where the layers are not modelled: DoRA, whose
    ``DoraLinearVariant.forward`` is another sequence, MoE, other projection names; and under a fused or chunked
    loss, whose chunks reuse these blocks)."""
    if train.grad_ckpt or not _modelled(m, train, p):
        return 0
    return (_per_token(m, train, p, checkpointed=False) or 0) * train.tokens // T_REF


def checkpointed_forward_cache(
    m: ModelSpec, train: TrainSpec, p: StepParts, *, gathered_per_layer: bool = False
) -> int | None:
    """Bytes the forward of a LoRA model under checkpointing leaves cached and free at the loss: the per-token figure
    of the replayed checkpointed layers × T (see "Under checkpointing" above); None where the layers are not modelled
    (as ``adapter_forward_cache``, and Phi-3's fused projections, whose views' lifetimes are not written out; eager
    attention, whose scores grow with ℓ², not with T). ``gathered_per_layer``: the base is FSDP2's, each layer's
    unsharded parameters gathered before its forward and freed after it, one block per parameter
    (_fsdp_param.py ``alloc_all_gather_outputs``, ``free_unsharded_param``); the next layer's, of the same sizes, are
    cut back from those blocks (best fit, exact sizes), so the layers' transients lie as with whole weights
    (distributed/fsdp_workspace.py)."""
    if (
        not train.grad_ckpt
        or not _modelled(m, train, p)
        or computes_scores(m, train)
        or not (gathered_per_layer or one_copy_weights(train) or _four_bit_whole(train))
    ):
        return None
    if train.loss is not Loss.STANDARD:  # TRL's chunked_nll under checkpointing: trl.py's own chain
        return None
    free = _per_token(m, train, p, checkpointed=True)
    return None if free is None else free * train.tokens // T_REF


def second_forward_spill(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """Bytes step 2's forward needs beyond the segments step 1's forward made (LoRA without checkpointing, SDPA
    without a mask): the per-token figure of the layer sequence replayed twice, every block freed in between, × T
    (0 where the layers are not modelled, as ``adapter_forward_cache``; eager attention, whose score blocks are not in
    the sequence, and a mask every batch has, Gemma 3's images; a quantised, sharded or offloaded base).

    Step 1's forward makes its segments one layer at a time, each for a request nothing cached then holds. Step 2's
    forward finds all of them free at once (backward has freed every saved activation), and best fit
    (``get_free_block``: the smallest cached block at least as large) lays the same requests out otherwise: the early
    layers' saved tensors are cut from segments step 1 made for later, larger requests, and the last layers find
    nothing left that holds theirs. The trace shows it: Llama-3-8B LoRA 2 × 2048, step 2's forward needs no block
    outside step 1's forward segments until the last layer, whose tensors then take 640 MiB of the logits chain's
    blocks (bench/reserve/replay_causes.jsonl); the sequence replayed twice needs 1184 MiB more in step 2 (an 8-layer
    Llama 1 × 4096: 64 MiB, 44 MiB of the chain in the trace)."""
    # a padded batch of full rows drops the mask (see ``spilled_chain_blocks``): the unmasked sequence is its
    sdpa_unmasked = train.attn is Attention.SDPA and not computes_scores(m, train)
    if explicit_mask(m, train) and not padded_sdpa(train):
        return 0
    if train.grad_ckpt or not sdpa_unmasked or not one_copy_weights(train) or not _modelled(m, train, p):
        return 0
    wb = p.weights
    c = train.precision.compute.bytes
    cast = wb.trainable_dtype.bytes == 4 and c != 4
    return _spill(m, wb.adapted, wb.trainable_layers, c, cast) * train.tokens // T_REF


def spilled_chain_blocks(m: ModelSpec, train: TrainSpec, p: StepParts, *, workspace_lost: bool = False) -> int:
    """Bytes of the fp32 logits blocks step 2 makes again because its forward's spill (``second_forward_spill``)
    sits in them at its loss peak (the standard loss, c < 4): beyond the one the backward thread's workspace
    already costs where it took one (``workspace_lost``: workspace.py, counted there).

    The spilled requests are cut from the smallest cached blocks that hold them (``get_free_block``), the logits
    chain's, which step 1's loss made and freed: the c·V·T logits block first, then one fp32 4·V·T block after
    another, a split block's rest before a whole one (full.py ``blocks_with_states``, as for AdamW's states; the
    workspace's block first where it has one). Step 2's loss peak holds three fp32 blocks at once (the log-softmax
    and the two gradients of ``nll_loss_backward`` and ``_log_softmax_backward_data``), so each block a saved
    activation sits in is made again, whole. The trace: Llama-3-8B LoRA 2 × 2048 keeps 528 MiB of its last
    layer's tensors in the 1002 MiB logits block and 112 MiB in an fp32 one, and step 2 makes one 2004 MiB block
    again (the spill replayed: 1184 MiB, one block); Mistral-7B 4 × 1024 (c·V·T = 256 MiB, 4·V·T = 512 MiB: the same
    layers, a quarter of the vocabulary) makes two again (replayed: two).

    A padded batch (``padded_sdpa``) gets a mask and K/V repeated for it (analytic/activations.py), which the layer
    sequence leaves out; but a run with dynamic padding also meets batches whose rows all reach L, where transformers
    drops the mask (masking_utils.py ``_ignore_causal_mask_sdpa``) and SDPA takes the grouped K/V: that step's
    allocated is the padded one's less what the mask adds, and its reserve has these blocks. So the padded shape
    counts them less those bytes (never below 0): the larger of the two steps' reserves."""
    spill = second_forward_spill(m, train, p)
    chain = logits_blocks(m, train)
    if not spill or len(chain) != 4:
        return 0
    hole, fp32 = chain[0], chain[1:]
    workspace = cublas_workspace_block(p) if workspace_lost else 0
    reached = blocks_with_states(max(spill - hole, 0) + workspace, 0, fp32)
    remade = max(reached - (1 if workspace_lost else 0), 0) * fp32[0]
    return max(remade - mask_bytes(m, train, p), 0) if padded_sdpa(train) else remade


def mask_bytes(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """What a padded batch's saved activations hold beyond the same batch's without a mask: every trained layer's
    repeated K/V and the additive mask (activations.py ``layer_activations``, with and without ``packing``)."""
    wb = p.weights
    masked = layer_activations(m, train, wb)
    unmasked = layer_activations(m, replace(train, packing=True), wb)
    per_layer = (masked.per_token - unmasked.per_token) * train.tokens
    per_layer += (masked.scores_per_seq - unmasked.scores_per_seq) * train.micro_batch
    if not train.grad_ckpt:
        return wb.trainable_layers * per_layer
    # Under checkpointing one layer is recomputed at a time, and the checkpoints keep the boolean mask, the same
    # tensor for every layer (step.py ``_saved_activations``): once.
    B, L = train.micro_batch, train.seq_len
    kept = B * L * L * (2 if m.sliding_layers else 1) if padded_sdpa(train) and wb.trainable_layers else 0
    return per_layer + kept


def one_copy_weights(train: TrainSpec) -> bool:
    """The base's weights are whole tensors on the device, each in its own block: not quantised (bitsandbytes
    dequantises a weight-sized block for every matmul), not sharded or flattened (ZeRO-3's partitions, FSDP's flat
    parameters, gathered per layer), not offloaded."""
    return train.quant is None and not _sharded(train)


def _four_bit_whole(train: TrainSpec) -> bool:
    """A 4-bit base, not sharded or offloaded: its layers run the sequence with PEFT's 4-bit LoRA layer (``_Layer``
    ``clone``); the weight each matmul dequantises is a block of the weight's size, not of T's, left out of the
    per-token figure."""
    return train.quant is not None and train.quant.bits == 4 and not _sharded(train)


def _sharded(train: TrainSpec) -> bool:
    """The base's weights sharded, flattened or offloaded (ZeRO-3, FSDP sharding parameters, parameter offload)."""
    return train.zero_stage >= 3 or (train.fsdp is not None and train.fsdp.shards_params) or train.offload_params


def _modelled(m: ModelSpec, train: TrainSpec, p: StepParts) -> bool:
    wb = p.weights
    return bool(train.adapters and wb.adapted and not m.is_moe and not p.dora_temp and train.loss in _LOSSES_ABOVE)


def _per_token(m: ModelSpec, train: TrainSpec, p: StepParts, *, checkpointed: bool) -> int | None:
    wb = p.weights
    c = train.precision.compute.bytes
    cast = wb.trainable_dtype.bytes == 4 and c != 4 and peft_casts_adapter_input(train)
    return _free_at_end(m, wb.adapted, wb.trainable_layers, c, cast, checkpointed, _four_bit_whole(train))


@lru_cache(maxsize=256)
def _free_at_end(
    m: ModelSpec, adapted: tuple[Adapted, ...], layers: int, c: int, cast: bool, checkpointed: bool, clone: bool
) -> int | None:
    """Reserved − allocated after ``layers`` decoder layers' forward and the final norm at ``T_REF`` tokens,
    replayed from an empty cache (what else the step's cache holds is counted elsewhere); 0 (None under
    checkpointing) where the projections are not named like Llama's or Phi-3's (Phi-3's under checkpointing)."""
    layer = _sequence(m, adapted, c, cast, checkpointed, clone)
    if layer is None:
        return None if checkpointed else 0
    before = layer.r.free_bytes
    layer.model_forward(layers)
    return layer.r.free_bytes - before


@lru_cache(maxsize=256)
def _spill(m: ModelSpec, adapted: tuple[Adapted, ...], layers: int, c: int, cast: bool) -> int:
    """What a second forward at ``T_REF`` tokens reserves beyond the first's segments, every block freed between
    them (``second_forward_spill``); 0 where the projections are not named like Llama's or Phi-3's."""
    layer = _sequence(m, adapted, c, cast, checkpointed=False)
    if layer is None:
        return 0
    reserved = []
    for _ in range(2):
        layer.model_forward(layers)
        reserved.append(layer.r.model.reserved)
        for i in list(layer.r.live):  # backward frees every saved activation
            layer.r.free(i)
    return reserved[1] - reserved[0]


def _sequence(
    m: ModelSpec, adapted: tuple[Adapted, ...], c: int, cast: bool, checkpointed: bool, clone: bool = False
) -> _Layer | None:
    """A decoder layer's sequence on an empty replay; None where the projections are not named like Llama's or
    Phi-3's (Phi-3's under checkpointing)."""
    # by leaf name: a multimodal model's decoder names them by path (``self_attn.q_proj``)
    shapes = {_leaf(lin.name): (lin.in_features, lin.out_features) for lin in layer_linears(m)}
    fused = set(shapes) == set(_FUSED)
    if (not fused and set(shapes) != set(_NAMES)) or (fused and checkpointed):
        return None
    adapted_names = {_leaf(a.linear.name) for a in adapted}
    return _Layer(_Replay(), m, adapted_names, shapes, c, cast, checkpointed, fused, clone=clone)


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


class _Replay:
    """Allocations and frees replayed through the allocator model as they come (``alloc`` numbers a block)."""

    def __init__(self) -> None:
        self.model = CachingAllocatorModel()
        self.live: dict[int, Block] = {}
        self.count = 0

    def alloc(self, size: int) -> int:
        blk = self.model.malloc(size)
        assert blk is not None, "an unlimited device never runs out"
        self.count += 1
        self.live[self.count] = blk
        return self.count

    def free(self, i: int) -> None:
        self.model.free(self.live.pop(i))

    @property
    def free_bytes(self) -> int:
        return self.model.reserved - self.model.allocated


class _Layer:
    """One decoder layer's forward at ``T_REF`` tokens, freeing its transients in program order (the order of
    transformers' ``LlamaDecoderLayer`` and PEFT's ``lora.Linear``). Without checkpointing the tensors autograd saves
    stay allocated; under checkpointing (``checkpointed``) the layer runs inside ``torch.utils.checkpoint``'s
    non-reentrant forward, whose saved-tensor hooks (``_checkpoint_hook``) keep none of them, so each is freed when
    the layer's Python code drops it, and only the layer's input (the checkpoint's saved argument) and its output
    stay (``_drop``)."""

    def __init__(
        self,
        r: _Replay,
        m: ModelSpec,
        adapted: set[str],
        shapes: dict[str, tuple[int, int]],
        c: int,
        cast: bool,
        checkpointed: bool = False,
        fused: bool = False,
        *,
        tokens: int = T_REF,
        trained: bool = False,
        weight_casts: bool = False,
        clone: bool = False,
    ) -> None:
        self.r, self.m, self.adapted, self.shapes, self.c, self.cast = r, m, adapted, shapes, c, cast
        self.checkpointed, self.fused = checkpointed, fused
        # ``trained``: full fine-tuning, every weight trained, so autograd also saves each projection's input (the
        # norms' outputs, SDPA's output, the MLP's product) and each norm's cast before its weight product
        # (spill.py ``displaced_remade``); ``tokens``: T, where the sequence is replayed at the step's own size
        # ``weight_casts``: autocast's c-byte copy of each trained fp32 weight, cached at its first matmul and saved by
        # it (autocast_mode.cpp ``cached_cast``)
        self.T, self.trained, self.weight_casts = tokens, trained, weight_casts
        # ``trained``: the saved input of each projection, with the projections that save it (their matmuls), for a
        # backward that frees it once their weights' gradients are made (spill.py ``_backward``)
        self.inputs: dict[int, tuple[str, ...]] = {}
        # ``clone``: PEFT's 4-bit LoRA layer (``lora.bnb.Linear4bit.forward``): ``result = result.clone()`` of the base
        # output
        self.clone = clone

    def model_forward(self, layers: int) -> None:
        """The embedding's output (the first layer's input), ``layers`` decoder layers and the final norm (never
        checkpointed: its fp32 input saved, its output lm_head's input)."""
        x = self.r.alloc(self.c * self.m.hidden_size * self.T)
        for _ in range(layers):
            x = self.forward(x, self.fused)
        self.norm()

    @property
    def residual_bytes(self) -> int:
        """An element of the residual stream: the embedding's output, the layers' sums."""
        return self.c

    def embed(self) -> int:
        """The embedding's output, the first layer's input (spill.py ``_forward``)."""
        return self.r.alloc(self.residual_bytes * self.m.hidden_size * self.T)

    def forward_done(self) -> None:
        """The model's forward returns after the final norm: what it held for every layer goes (none here: Gemma 3's
        sliding mask, gemma_layer.py)."""

    @property
    def held_by_caller(self) -> bool:
        """Whether the residual stream's blocks live as long as Python holds them, no norm saving them (a trained
        c-byte layer: its norms save their fp32 casts, not their inputs; spill.py ``_forward``). transformers'
        ``LlamaModel.forward`` holds a layer's input x while the layer runs (``hidden_states =
        decoder_layer(hidden_states, ...)`` rebinds it only once the layer returns), the last layer's output until
        the final norm returns (``hidden_states = self.norm(hidden_states)``) and the embedding's output to its own
        return (``inputs_embeds``); ``LlamaDecoderLayer.forward``'s ``residual`` goes at the layer's return, before
        x. In the trace of the mid toy model of bench/reserve/ (full, bf16-true, 4 × 1024) each layer's input is freed
        right after its output's residual sum, and the embedding's output after the final norm. The LoRA sequence
        (not ``trained``) still frees x at the attention's residual sum, as its figures were measured with. Not for an
        fp32 stream (autocast's with fp32 weights, amp_layer.py; fp32 layers, math_layer.py): ``LlamaRMSNorm``'s
        ``to(torch.float32)`` returns x itself and ``x * rsqrt`` saves it, so autograd holds it to backward."""
        return self.trained and not self.checkpointed and self.residual_bytes != 4

    def final_norm(self) -> None:
        """The model's final norm, never checkpointed: its fp32 input saved, its output lm_head's input."""
        self.norm()

    def _drop(self, *blocks: int) -> None:
        """Blocks autograd would save: freed here under checkpointing only."""
        if self.checkpointed:
            for i in blocks:
                self.r.free(i)

    def forward(self, x: int, fused: bool) -> int:
        """Returns the layer's output block; ``x`` (the layer's input) is freed by the first residual sum, or kept
        under checkpointing (the checkpoint saves it)."""
        r, c, T, H = self.r, self.c, self.T, self.m.hidden_size
        normed = self.norm(saved=not self.checkpointed)
        if fused:
            qkv = self._linear("qkv_proj")  # q, k and v are views of it, and SDPA saves v: it stays
        else:
            q, k = self._qk("q_proj", self.m.q_dim), self._qk("k_proj", self.m.kv_dim)
            v = self._linear("v_proj")  # saved by SDPA
        embedded = [self._rope(width) for width in (self.m.q_dim, self.m.kv_dim)]  # saved by SDPA
        if not fused:
            r.free(q)
            r.free(k)
        if self.trained and not fused:
            self.inputs[normed] = ("q_proj", "k_proj", "v_proj")
        attn = r.alloc(c * self.m.q_dim * T)  # SDPA's output, saved by o_proj's lora_A (or its autocast copy)
        if self.trained:
            self.inputs[attn] = ("o_proj",)
        out_attn = self._linear("o_proj")
        self._drop(attn, *embedded, qkv if fused else v)
        if not self.trained:  # q, k and v's matmuls save it when their weights are trained
            r.free(normed)
        h = r.alloc(c * H * T)  # residual + attention
        r.free(out_attn)
        if not self.checkpointed and not self.held_by_caller:
            r.free(x)
        normed = self.norm(saved=not self.checkpointed)
        if fused:
            gate = self._linear("gate_up_proj")  # gate and up are views of it, saved by act_fn and the product
            width = self.shapes["gate_up_proj"][1] // 2
        else:
            gate = self._linear("gate_proj")  # saved by act_fn
            width = self.shapes["gate_proj"][1]
        act = r.alloc(c * width * T)  # act_fn(gate), saved by the product
        if not fused:
            self._drop(gate)
            up = self._linear("up_proj")  # saved by the product
        product = r.alloc(c * width * T)  # down_proj's input: its base does not save it, lora_A saves a copy
        if self.trained and not fused:
            self.inputs[normed] = ("gate_proj", "up_proj")
            self.inputs[product] = ("down_proj",)
        self._drop(act, gate if fused else up)
        down = self._linear("down_proj")
        if not self.trained:  # saved by down_proj's, gate's and up's matmuls when their weights are trained
            r.free(product)
            r.free(normed)
        out = r.alloc(c * H * T)  # residual + MLP
        r.free(down)
        r.free(h)
        return out

    def norm(self, width: int = 0, *, saved: bool = True, out_bytes: int = 0) -> int:
        """LlamaRMSNorm over ``width`` features (default H): ``to(float32)`` (saved, else freed once the normalised
        product is made), ``pow(2)``, the normalised product, its cast back, the weight product (returned; freed
        when the block is done with it; ``out_bytes`` an element, c by default: 4 with fp32 weights under autocast,
        which leaves ``mul`` to type promotion)."""
        r, c, n = self.r, self.c, (width or self.m.hidden_size) * self.T
        f32 = r.alloc(4 * n)
        r.free(r.alloc(4 * n))
        prod = r.alloc(4 * n)
        if not saved:
            r.free(f32)
        down = r.alloc(c * n)
        out = r.alloc((out_bytes or c) * n)
        if not self.trained:  # the weight product saves it where the norm's weight is trained
            r.free(down)
        r.free(prod)
        return out

    def _qk(self, name: str, width: int) -> int:
        """q or k's projection and, where the model has them (Qwen3's ``q_norm``/``k_norm``), its RMSNorm over the
        head dimension (saved by RoPE's products; the projection's output is then dropped)."""
        proj = self._linear(name)
        if not self.m.qk_norm:
            return proj
        normed = self.norm(width, saved=not self.checkpointed)
        self.r.free(proj)
        return normed

    def _rope(self, width: int, in_bytes: int = 0, out_bytes: int = 0) -> int:
        """apply_rotary_pos_emb on one of q, k: ``q * cos``, ``rotate_half`` (``neg``, ``cat``), ``* sin``, the sum
        (returned: saved by SDPA). ``in_bytes``: an element of q (c by default); ``out_bytes``: of the products with
        cos and sin, which type promotion makes fp32 where cos and sin are (under autocast with an fp32 residual
        stream, ``LlamaRotaryEmbedding.forward`` returns them in the hidden states' dtype)."""
        r, n = self.r, width * self.T
        i, o = in_bytes or self.c, out_bytes or self.c
        cos = r.alloc(o * n)
        neg = r.alloc(i * n // 2)
        cat = r.alloc(i * n)
        r.free(neg)
        sin = r.alloc(o * n)
        r.free(cat)
        out = r.alloc(o * n)
        r.free(cos)
        r.free(sin)
        return out

    def _linear(self, name: str) -> int:
        """One projection: the frozen base's output, and where it is adapted PEFT's ``lora.Linear.forward``."""
        r, c, T = self.r, self.c, self.T
        fin, fout = self.shapes[name]
        if self.weight_casts:
            r.alloc(c * fin * fout)
        base = r.alloc(c * fout * T)
        if name not in self.adapted:
            return base
        if self.clone:
            copy = r.alloc(c * fout * T)
            r.free(base)
            base = copy
        x32 = r.alloc(4 * fin * T) if self.cast else 0
        if self.cast:
            self._drop(r.alloc(c * fin * T))  # autocast's copy for lora_A: saved, dropped under checkpointing
        lora_b = r.alloc(c * fout * T)
        scaled = r.alloc(c * fout * T)
        r.free(lora_b)
        out = r.alloc(c * fout * T)
        r.free(scaled)
        r.free(base)
        if x32:
            r.free(x32)
        return out
