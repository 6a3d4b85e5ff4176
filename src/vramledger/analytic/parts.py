"""The data the analytic step is assembled from: ``StepParts`` (sizes) and ``Moment`` (line items at one instant).

Data flows one way through the analytic step: ``step.step_parts`` computes a ``StepParts`` from the specs; the
moments of training (``step.moments``), of evaluation (``evaluation.eval_moments``) and the allocator reserve
(``reserve.phase_reserves``) are plain functions of it; ``step.ledger_items`` turns the moments into the ledger's
lines. This module imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vramledger.analytic.distributed import Buffer
from vramledger.analytic.paged import PAGED_SOURCE
from vramledger.analytic.weights import WeightBudget
from vramledger.ledger import OUTSIDE_ALLOCATED, Basis, Category, LineItem, Phase
from vramledger.specs import ModelSpec, TrainSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class StepParts:
    """The quantities every moment is assembled from, in bytes (exposed for tests, the reserve and the planner)."""

    weights: WeightBudget
    frozen_bytes: int
    trainable_bytes: int
    master_bytes: int
    grad_bytes: int
    autocast_copy_bytes: int
    """Autocast's bf16/fp16 weight copies alive when forward ends: the trainable fp32 matrices' cached copies and, for
    a frozen base loaded in fp32, the frozen casts autograd saved (all but the first layer's inputs without
    checkpointing, lm_head's alone under it): analytic/step.py ``_autocast_casts``."""
    state_bytes: int
    paged_state_bytes: int
    """Paged optimizer states: CUDA managed memory (analytic/paged.py), not part of ``state_bytes``."""
    step_temp_bytes: int
    saved_layers_bytes: int
    """Saved activations of all trained layers (or their checkpointed inputs)."""
    layer_bytes: int
    """Saved activations of one trained layer (recomputed in backward under checkpointing)."""
    recompute_bytes: int
    """Under checkpointing, what recomputing one trained layer allocates: ``layer_bytes`` less the checkpointed
    input that the recompute reads again (analytic/activations.py ``checkpoint_reused_bytes_per_token``); 0 without."""
    scores_bytes: int
    """Length² bytes of all trained layers (0 under checkpointing, where one layer's is recomputed)."""
    layer_scores_bytes: int
    extra_saved_bytes: int
    """Final norm, RoPE tables and other once-per-model saved tensors."""
    rope_saved_bytes: int = 0
    """The RoPE tables, part of ``extra_saved_bytes``: all of it that outlives the final norm's and lm_head's
    backward."""
    logits_forward: int
    logits_saved: int
    logits_backward: int
    logits_head: int
    kept_logits_bytes: int = 0
    """LitGPT's fp32 ``logits`` list, alive at every moment after the first micro-step's loss (analytic/logits.py
    ``litgpt_kept_logits_bytes``); not part of the ``logits_*`` fields."""
    final_hidden_bytes: int
    """The final hidden state, alive during the loss (a temporary)."""
    head_cast_bytes: int
    """lm_head's bf16 weight cast under AMP (a trainable fp32 head, or a frozen head loaded in fp32): saved by
    autograd even under checkpointing (lm_head is outside it), freed by lm_head's backward."""
    recompute_cast_bytes: int = 0
    """Under checkpointing, the bf16 weight casts one trained layer's recompute saves again in backward."""
    layer_backward_temp: int
    """The top layer's MLP backward: gradients of the hidden states and the MLP intermediates."""
    softmax_backward_temp: int = 0
    """Eager attention's softmax backward in the top layer: its length² gradients, (c+4)·nh·L² per sequence."""
    softmax_backward_freed: int = 0
    """Of one trained layer's saved activations, what its backward has freed when eager attention's softmax backward
    runs (analytic/activations.py ``softmax_backward_freed_bytes_per_token``)."""
    dora_temp: int
    forward_layer_temp: int
    """Largest transient inside one layer's forward (eager's pre-softmax scores, DoRA's weight norm)."""
    dequant_temp: int
    """QLoRA: bitsandbytes dequantises one frozen weight to the compute dtype per matmul (forward and backward)."""
    workspace_bytes: int
    """cuBLAS and cuBLASLt workspaces of both threads' handles (forward and autograd's backward)."""
    optimizer_source: str
    logits_source: str
    buffers: tuple[Buffer, ...] = ()
    """Data-parallel engine buffers (DDP buckets, FSDP all-gathers, ZeRO buckets), with the phases they live in."""


@dataclass(kw_only=True, slots=True)
class Moment:
    """The line items live at one instant of one phase, grouped by category in the order they were first added.

    >>> mo = Moment(name="example", phase=Phase.FORWARD)
    >>> mo.add(Category.WEIGHTS, "base", 10, "a source")
    >>> mo.add(Category.GRADIENTS, "none", 0, "zero bytes add no line")
    >>> mo.total, len(mo.items)
    (10, 1)
    """

    name: str
    """What happens at this instant (the ledger's moment name of the phase)."""
    phase: Phase
    lines: dict[Category, list[tuple[str, int, str, Basis]]] = field(default_factory=dict)
    """(label, bytes, source, basis) of each line, by category. The ``LineItem``s are made when asked for
    (``items``): of the moments modelled in a phase, only the one holding its peak needs them."""

    def add(self, cat: Category, label: str, n: int, source: str, basis: Basis = Basis.FORMULA) -> None:
        """One line of ``n`` bytes; nothing for ``n`` ≤ 0."""
        if n > 0:
            self.lines.setdefault(cat, []).append((label, int(n), source, basis))

    @property
    def items(self) -> tuple[LineItem, ...]:
        return tuple(
            LineItem(category=cat, phase=self.phase, bytes=n, label=label, source=source, basis=basis)
            for cat, lines in self.lines.items()
            for label, n, source, basis in lines
        )

    @property
    def total(self) -> int:
        """Allocated bytes (managed memory is outside PyTorch's allocator)."""
        return sum(n for cat, lines in self.lines.items() if cat not in OUTSIDE_ALLOCATED for _, n, _, _ in lines)


SOURCES = {
    "weights": "Σ parameters × dtype bytes (analytic/params.py, weights.py: transformers 5 modeling_*, PEFT, bnb)",
    "grads": "one gradient per trainable parameter, in its dtype (torch AccumulateGrad)",
    "autocast": "torch autocast_mode.cpp cached_cast: bf16 copy of each fp32 leaf weight, kept while autograd needs it",
    "acts": "per-layer saved tensors (analytic/activations.py: LlamaRMSNorm, sdpa_attention_forward, LlamaMLP, PEFT)",
    "ckpt": "torch.utils.checkpoint (non-reentrant): each layer keeps only its input hidden state",
    "kept_logits": "Lightning Fabric convert_output casts the output to fp32; litgpt finetune/lora.py l. 276 "
    "`logits = model(...)` is rebound only when the next forward returns",
}
"""The sources of the lines every moment shares."""


def add_persistent(mo: Moment, p: StepParts, train: TrainSpec, *, grads: int, autocast: bool, states: bool) -> None:
    """Weights, master copy, autocast copies (if ``autocast``), states (if ``states``), ``grads`` bytes of
    gradients, and the cuBLAS workspaces: what lives through the whole step."""
    if p.frozen_bytes:
        label = "frozen base" + (" (quantised)" if train.quant is not None else "")
        mo.add(Category.WEIGHTS, label, p.frozen_bytes, SOURCES["weights"])
    if p.trainable_bytes:
        label = "adapters" if train.adapters else "trainable"
        source = SOURCES["weights"]
        if train.peft_config is not None:  # named after the PEFT method and its targets
            from vramledger.analytic.peft_memory import peft_source

            source = peft_source(train) or source
        mo.add(Category.WEIGHTS, f"{label} ({p.weights.trainable_dtype.value})", p.trainable_bytes, source)
    if p.master_bytes:
        mo.add(
            Category.MASTER_WEIGHTS,
            "fp32 master copy (ZeRO shard)",
            p.master_bytes,
            "DeepSpeed bf16/fp16 optimizer: fp32 master partition, 4·P/N",
        )
    if autocast and p.autocast_copy_bytes:
        mo.add(Category.WEIGHTS, "bf16 copies made by autocast", p.autocast_copy_bytes, SOURCES["autocast"])
    if states and p.state_bytes:
        mo.add(Category.OPTIMIZER_STATE, "optimizer states", p.state_bytes, p.optimizer_source)
    if states:
        mo.add(Category.MANAGED_MEMORY, "paged optimizer states", p.paged_state_bytes, PAGED_SOURCE)
    if grads:
        mo.add(Category.GRADIENTS, "gradients", grads, SOURCES["grads"])
    if p.kept_logits_bytes:
        mo.add(
            Category.LOGITS_LOSS,
            "LitGPT's fp32 logits, kept until the next forward returns",
            p.kept_logits_bytes,
            SOURCES["kept_logits"],
        )
    mo.add(
        Category.WORKSPACE,
        "cuBLAS workspaces",
        p.workspace_bytes,
        "torch CublasHandlePool.cpp getChosenWorkspaceSize, one per handle (forward and backward threads)",
    )


def add_activations(mo: Moment, p: StepParts, train: TrainSpec, *, saved_logits: bool = False) -> None:
    """The activations every trained layer saved for backward (or its checkpointed input), and the length² ones."""
    if p.saved_layers_bytes:
        label = "layer inputs (checkpointed)" if train.grad_ckpt else "saved by every trained layer"
        mo.add(
            Category.ACTIVATIONS, label, p.saved_layers_bytes, SOURCES["ckpt"] if train.grad_ckpt else SOURCES["acts"]
        )
    if p.extra_saved_bytes:
        mo.add(Category.ACTIVATIONS, "final norm, RoPE tables", p.extra_saved_bytes, SOURCES["acts"])
    if p.scores_bytes:
        mo.add(
            Category.ATTENTION_SCORES,
            "length² tensors of every layer",
            p.scores_bytes,
            "eager softmax fp32 + cast probs (or padded SDPA's additive mask), analytic/activations.py",
        )
    if saved_logits and p.logits_saved:
        mo.add(Category.LOGITS_LOSS, "log-softmax output kept for backward", p.logits_saved, p.logits_source)


def embedding_gradient_before_accumulation(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """A trained embedding's V×H gradient from ``embedding_dense_backward``, live at the end of backward beside the
    gradient it is added to: lm_head's (tied) or an earlier micro-step's (accumulation); 0 otherwise."""
    if not p.weights.embedding_trainable or not (m.tie_word_embeddings or train.grad_accum > 1):
        return 0
    return p.weights.lm_head_weight_numel * p.weights.trainable_dtype.bytes


TIED_SUM = (
    "torch/csrc/autograd/input_buffer.cpp accumulate: lm_head's V×H gradient waits in the tied weight's "
    "AccumulateGrad input buffer until embedding_dense_backward's arrives, and the two dense gradients are summed "
    "out of place (old_var + var, as the trace of torch 2.13 shows: an add of V×H); three V×H tensors live at once"
)


def tied_gradient_sum(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """A tied, trained embedding: the out-of-place sum of lm_head's and the embedding's gradients (``TIED_SUM``), a
    third V×H tensor beside the two at the end of backward; the trace shows it (``add``, Llama-3.2-1B full SGD 2 ×
    1024: 11.23 GiB at backward's peak = every gradient + two more V×H fp32). FSDP's flat parameters accumulate
    otherwise (analytic/distributed/fsdp_no_sync.py): left out there."""
    if not (m.tie_word_embeddings and p.weights.embedding_trainable) or train.fsdp is not None:
        return 0
    return p.weights.lm_head_weight_numel * p.weights.trainable_dtype.bytes
