"""Give every live block of a snapshot a line of the bill, from the stack that allocated it (or its address).

Rules, in order, over a block's frames (innermost first, as ``torch.cuda.memory._snapshot`` lists them: the
flame graphs of torch/cuda/_memory_viz.py ``_write_blocks`` reverse them to put the root first);
"modeling frames" are ``forward`` frames in transformers' ``models/*/modeling_*.py``:
1. a frame in ``torch/optim/``: optimizer state when the stack passes ``_init_group`` (where AdamW, SGD, Adafactor
   create ``state[p]``, torch/optim/adamw.py ``_init_group``), else step temporaries;
2. a frame in transformers' ``cache_utils.py`` (``DynamicCache.update``): KV cache;
3. transformers' loss code (``loss/loss_utils.py`` ``ForCausalLMLoss``, ``fixed_cross_entropy``) or torch's
   ``cross_entropy``/``log_softmax``/``nll_loss``: logits and loss;
4. ``torch/utils/checkpoint.py``: a forward recomputed in backward: activations;
5. exactly one modeling frame: the causal-LM ``forward`` itself runs the output layer and the upcast of the logits
   (``LlamaForCausalLM.forward``: ``self.lm_head(...)``), while every decoder allocation also has the base model's
   and the layer's ``forward`` above it: logits and loss;
6. no modeling frame, and loading code (``modeling_utils.py`` ``from_pretrained``, ``Module._apply``/``to``/``cuda``,
   PEFT's ``inject_adapter``/``update_layer``, accelerate's ``set_module_tensor_to_device``, safetensors,
   bitsandbytes' modules): weights (with a forward on the stack, the same files allocate activations and
   temporaries: PEFT's LoRA ``forward``, bitsandbytes' dequantisation);
7. ``AccumulateGrad`` (C++ frames, ``stacks="all"``): gradients;
8. any other modeling frame: activations (alive at the snapshot, so saved for backward);
9. ``torch/autograd/``: backward; anything else: other.
A live block with no frames at all is either older than the recording (no ``alloc`` in the trace: usually the
weights, loaded before ``_record_memory_history``) or was allocated by the autograd engine's device thread, which
has no Python stack (an ``alloc`` in the trace: gradients and backward temporaries).

When the caller knows the live tensors (the callback: parameters, their ``.grad``, the optimizer's state), their
addresses decide first, exactly. Next, a ``category`` written on the block's latest ``alloc`` trace entry decides:
torch's own ``_memory_viz._profile_to_snapshot`` writes the memory profiler's categories there
(``torch/profiler/_memory_profiler.py`` ``Category``, lowercased), and ``vramledger trace --snapshot`` writes the
ledger's (``ledger.Category`` values); both vocabularies are read (``_RECORDED``).
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from vramledger.explain.snapshot import Block, SnapshotFacts, device_trace
from vramledger.ledger import Category


class Bucket(str, enum.Enum):
    """Where a live block's bytes go in the post-mortem."""

    WEIGHTS = "weights"
    GRADIENTS = "gradients"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATIONS = "activations"
    LOGITS_LOSS = "logits_loss"
    KV_CACHE = "kv_cache"
    BACKWARD = "backward"
    TEMPORARIES = "temporaries"
    WORKSPACE = "workspace"
    UNRECORDED = "unrecorded"
    OTHER = "other"

    @property
    def category(self) -> Category | None:
        """The ledger category this bucket lines up with (None: no single one)."""
        return _CATEGORY.get(self)

    @property
    def display(self) -> str:
        return _TITLES[self]


_CATEGORY = {
    Bucket.WEIGHTS: Category.WEIGHTS,
    Bucket.GRADIENTS: Category.GRADIENTS,
    Bucket.OPTIMIZER_STATE: Category.OPTIMIZER_STATE,
    Bucket.ACTIVATIONS: Category.ACTIVATIONS,
    Bucket.LOGITS_LOSS: Category.LOGITS_LOSS,
    Bucket.KV_CACHE: Category.KV_CACHE,
    Bucket.TEMPORARIES: Category.TEMPORARIES,
    Bucket.WORKSPACE: Category.WORKSPACE,
}
_TITLES = {
    Bucket.WEIGHTS: "weights",
    Bucket.GRADIENTS: "gradients",
    Bucket.OPTIMIZER_STATE: "optimizer state",
    Bucket.ACTIVATIONS: "activations",
    Bucket.LOGITS_LOSS: "logits and loss",
    Bucket.KV_CACHE: "KV cache",
    Bucket.BACKWARD: "backward (gradients, temporaries)",
    Bucket.TEMPORARIES: "optimizer-step temporaries",
    Bucket.WORKSPACE: "cuBLAS/cuDNN workspaces",
    Bucket.UNRECORDED: "older than the recording",
    Bucket.OTHER: "other",
}

# A recorded category → bucket: the memory profiler's names (torch/profiler/_memory_profiler.py ``Category``:
# INPUT, TEMPORARY, ACTIVATION, GRADIENT, AUTOGRAD_DETAIL, PARAMETER, OPTIMIZER_STATE) and the ledger's own.
# Not listed ("unknown", "input"): the frames decide.
_RECORDED = {
    "parameter": Bucket.WEIGHTS,
    "gradient": Bucket.GRADIENTS,
    "optimizer_state": Bucket.OPTIMIZER_STATE,
    "activation": Bucket.ACTIVATIONS,
    "temporary": Bucket.TEMPORARIES,
    "autograd_detail": Bucket.BACKWARD,
    Category.WEIGHTS.value: Bucket.WEIGHTS,
    Category.MASTER_WEIGHTS.value: Bucket.WEIGHTS,
    Category.GRADIENTS.value: Bucket.GRADIENTS,
    Category.OPTIMIZER_STATE.value: Bucket.OPTIMIZER_STATE,
    Category.ACTIVATIONS.value: Bucket.ACTIVATIONS,
    Category.ATTENTION_SCORES.value: Bucket.ACTIVATIONS,
    Category.LOGITS_LOSS.value: Bucket.LOGITS_LOSS,
    Category.KV_CACHE.value: Bucket.KV_CACHE,
    Category.TEMPORARIES.value: Bucket.TEMPORARIES,
    Category.WORKSPACE.value: Bucket.WORKSPACE,
}

_LOSS_NAMES = frozenset(
    {
        "ForCausalLMLoss",
        "fixed_cross_entropy",
        "cross_entropy",
        "log_softmax",
        "nll_loss",
        "chunked_nll",
        "LigerFusedLinearCrossEntropyFunction",
    }
)
_LOAD_NAMES = frozenset(
    {
        "_apply",
        "to",
        "cuda",
        "update_layer",
        "set_module_tensor_to_device",
        "load_file",
        "_load_state_dict_into_meta_model",
        "from_pretrained",
        "_create_new_module",
        "inject_adapter",
        "get_peft_model",
    }
)
_LOAD_FILES = (
    "modeling_utils.py",
    "accelerate/utils/modeling.py",
    "safetensors/torch.py",
    "bitsandbytes/nn/modules.py",
)


def _file(frame: Mapping[str, Any]) -> str:
    return str(frame.get("filename", "")).replace("\\", "/")


def _name(frame: Mapping[str, Any]) -> str:
    return str(frame.get("name", ""))


def _is_modeling(frame: Mapping[str, Any]) -> bool:
    f = _file(frame)
    return "/models/" in f and "/modeling_" in f


def _short(frame: Mapping[str, Any]) -> str:
    return f"{'/'.join(_file(frame).rsplit('/', 2)[-2:])}:{frame.get('line', '?')} {_name(frame)}"


def where(frames: Iterable[Mapping[str, Any]]) -> str:
    """The innermost frame outside ``torch.nn``'s generic module code, as ``dir/file.py:line name``."""
    frames = list(frames)
    for frame in frames:
        f = _file(frame)
        if "/torch/nn/" not in f and f not in ("", "??"):
            return _short(frame)
    return _short(frames[0]) if frames else ""


def bucket_of(frames: tuple[Mapping[str, Any], ...]) -> Bucket:
    """The bucket of one block from its allocation stack (rules 1-9 of the module docstring)."""
    files = [_file(f) for f in frames]
    names = [_name(f) for f in frames]
    modeling = sum(1 for f in frames if _is_modeling(f))
    if any("/torch/optim/" in f for f in files):
        return Bucket.OPTIMIZER_STATE if "_init_group" in names else Bucket.TEMPORARIES
    if any(f.endswith("cache_utils.py") for f in files):
        return Bucket.KV_CACHE
    if any("/transformers/loss/" in f for f in files) or _LOSS_NAMES.intersection(names):
        return Bucket.LOGITS_LOSS
    if any(f.endswith("torch/utils/checkpoint.py") for f in files):
        return Bucket.ACTIVATIONS
    if modeling == 1:
        return Bucket.LOGITS_LOSS
    if modeling == 0 and (any(f.endswith(_LOAD_FILES) for f in files) or _LOAD_NAMES.intersection(names)):
        return Bucket.WEIGHTS
    if any("AccumulateGrad" in n or "accumulate_grad" in n for n in names):
        return Bucket.GRADIENTS
    if modeling:
        return Bucket.ACTIVATIONS
    if any("/torch/autograd/" in f for f in files):
        return Bucket.BACKWARD
    return Bucket.OTHER


@dataclass(frozen=True, kw_only=True, slots=True)
class Share:
    """The live bytes of one bucket."""

    bucket: Bucket
    bytes: int
    blocks: int
    example: str
    """Where the largest block of this bucket was allocated (``file.py:line function``), or how it was known."""


def attribute(
    snap: SnapshotFacts,
    *,
    traced_addresses: frozenset[int] = frozenset(),
    known: Mapping[int, Bucket] | None = None,
    recorded: Mapping[int, Bucket] | None = None,
) -> tuple[Share, ...]:
    """Live bytes by bucket, largest first.

    ``traced_addresses``: addresses with an ``alloc`` in the trace (tells the autograd thread's stackless blocks from
    blocks older than the recording). ``known``: tensor data pointers → bucket (exact, checked first).
    ``recorded``: block address → bucket from the trace's ``category`` entries (``recorded_categories``), next.
    """
    ptrs = sorted(known or {})
    totals: dict[Bucket, list[Any]] = {}
    for block in snap.blocks:
        if not block.live:
            continue
        bucket, example = _classify(block, ptrs, known or {}, recorded or {}, traced_addresses)
        entry = totals.setdefault(bucket, [0, 0, 0, ""])
        entry[0] += block.size
        entry[1] += 1
        if block.size > entry[2]:
            entry[2], entry[3] = block.size, example
    shares = [Share(bucket=b, bytes=v[0], blocks=v[1], example=v[3]) for b, v in totals.items()]
    return tuple(sorted(shares, key=lambda s: -s.bytes))


def _classify(
    block: Block,
    ptrs: list[int],
    known: Mapping[int, Bucket],
    recorded: Mapping[int, Bucket],
    traced: frozenset[int],
) -> tuple[Bucket, str]:
    i = bisect.bisect_left(ptrs, block.address)
    if i < len(ptrs) and ptrs[i] < block.address + block.size:
        return known[ptrs[i]], "a live tensor at this address"
    if block.address in recorded:
        return recorded[block.address], where(block.frames) or "the category recorded with its allocation"
    if block.frames:
        return bucket_of(block.frames), where(block.frames)
    if block.address in traced:
        return Bucket.BACKWARD, "autograd thread (no Python stack)"
    return Bucket.UNRECORDED, "before the recording began"


def traced_allocs(snapshot: Mapping[str, Any], device: int = 0) -> frozenset[int]:
    """Addresses of every ``alloc`` in the recorded trace of ``device``."""
    trace = device_trace(snapshot, device)
    return frozenset(
        int(e["addr"])
        for e in trace
        if isinstance(e, Mapping) and e.get("action") == "alloc" and isinstance(e.get("addr"), int)
    )


def recorded_categories(snapshot: Mapping[str, Any], device: int = 0) -> dict[int, Bucket]:
    """Block address → bucket, from the ``category`` of the latest ``alloc`` at each address (see ``_RECORDED``).

    >>> recorded_categories({"device_traces": [[{"action": "alloc", "addr": 512, "category": "gradient"}]]})
    {512: <Bucket.GRADIENTS: 'gradients'>}
    """
    out: dict[int, Bucket] = {}
    for e in device_trace(snapshot, device):
        if isinstance(e, Mapping) and e.get("action") == "alloc" and isinstance(e.get("addr"), int):
            bucket = _RECORDED.get(str(e.get("category", "")))
            if bucket is None:
                out.pop(int(e["addr"]), None)
            else:
                out[int(e["addr"])] = bucket
    return out
