"""Record every allocation and free of a traced step: size, storage, phase, module and op.

A ``TorchDispatchMode`` sits above the fake-tensor mode: every op's outputs pass through it, and each output whose
storage we have not seen is an allocation. A ``weakref.finalize`` on that storage reports the free. Nothing here
holds a tensor or a storage: the recorder must never extend a lifetime (tracing.md: ModTracker kept DoRA temporaries
alive until the garbage collector ran).

Module attribution. Forward: forward pre/post hooks on every module keep a stack of module paths (they also fire in
the recompute of non-reentrant checkpointing). Backward: the autograd node being executed
(``torch._C._current_autograd_node``) carries the sequence number it was created with in forward; the forward hooks
log (sequence number, module) intervals, so a bisect maps a backward op back to its forward module.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from vramledger.ledger import Phase

BLOCK = 512
"""The CUDA caching allocator rounds every request up to a multiple of 512 bytes
(c10/cuda/CUDACachingAllocator.cpp, ``kMinBlockSize = 512`` and ``round_size``)."""


def round_block(nbytes: int) -> int:
    """Bytes the CUDA caching allocator hands out for a request (0 stays 0: no block)."""
    return 0 if nbytes <= 0 else -(-nbytes // BLOCK) * BLOCK


@dataclass(frozen=True, slots=True)
class Event:
    """One allocation or free, in time order. ``category`` is filled in after the step (see classify.py)."""

    kind: str
    """``alloc`` or ``free``."""
    storage: int
    """A storage id unique within the trace (never reused)."""
    bytes: int
    """Size rounded up to 512 B, as the CUDA caching allocator does."""
    phase: Phase
    step: int
    """Training step (1 or 2); 0 for loading."""
    module: str
    """Dotted module path (``model.layers.0.self_attn.q_proj``); empty outside any module."""
    op: str
    """The aten op that allocated (``mm``, ``_to_copy``…); for a free, the op that allocated it."""
    category: str = ""
    """A ``Category`` value, assigned after the step; ``host`` for tensors a CUDA run keeps on the host."""
    stream: str = ""
    """The CUDA stream the allocation is made on: empty for the default stream (FSDP's collectives have their own;
    trace/distributed.py)."""


@dataclass(slots=True)
class StorageInfo:
    """What we know about one storage, kept while the trace runs (no reference to the storage itself)."""

    sid: int
    bytes: int
    phase: Phase
    step: int
    module: str
    op: str
    shape: tuple[int, ...]
    dtype: str
    alloc_index: int
    free_index: int = -1
    in_recompute: bool = False
    param_cast: bool = False
    """A dtype cast of a loaded parameter (autocast's weight cast)."""
    category: str = ""
    stream: str = ""


def _local(t: Any) -> Any:
    """A DTensor's memory is its local shard's (trace/distributed.py); any other tensor is itself."""
    local = getattr(t, "_local_tensor", None)
    return t if local is None else local


class Recorder:
    """Collects allocation events. Use ``recording(model)`` to attach the module hooks and the dispatch
    mode."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.storages: dict[int, StorageInfo] = {}
        self._live: dict[int, int] = {}  # StorageImpl address -> sid (addresses are unique among live storages)
        self._next_sid = 0
        self.phase = Phase.LOAD
        self.step = 0
        self._stack: list[str] = []
        self._seq_starts: list[int] = []
        self._seq_modules: list[str] = []
        self.param_names: dict[int, str] = {}
        self.stream = ""
        """The stream new allocations are made on (set while FSDP's collectives run)."""
        self.stream_categories: dict[str, str] = {}
        """Category of every allocation made on a named stream, and (key ``resize_``) of storages re-allocated by
        ``resize_``: FSDP's unsharded parameters and collective buffers (trace/distributed.py)."""

    # -- module attribution
    # ------------------------------------------------------------------------------------
    def _log_seq(self) -> None:
        import torch

        seq = torch._C._autograd._get_sequence_nr()
        if self._seq_starts and self._seq_starts[-1] == seq:
            self._seq_modules[-1] = self.current_forward_module()
        else:
            self._seq_starts.append(seq)
            self._seq_modules.append(self.current_forward_module())

    def current_forward_module(self) -> str:
        return self._stack[-1] if self._stack else ""

    def push(self, name: str) -> None:
        self._stack.append(name)
        if self.phase is Phase.FORWARD:
            self._log_seq()

    def pop(self) -> None:
        if self._stack:
            self._stack.pop()
        if self.phase is Phase.FORWARD:
            self._log_seq()

    def module_now(self) -> tuple[str, bool]:
        """(module path, whether we are in a checkpoint recompute) for the op running now."""
        import torch

        if self._stack:
            return self._stack[-1], self.phase is Phase.BACKWARD
        if self.phase is Phase.BACKWARD:
            node = torch._C._current_autograd_node()
            if node is not None:
                var = getattr(node, "variable", None)  # AccumulateGrad: the parameter itself
                if var is not None:
                    name = self.param_names.get(id(var), "")
                    return name.rsplit(".", 1)[0], False
                i = bisect.bisect_right(self._seq_starts, node._sequence_nr()) - 1
                if i >= 0:
                    return self._seq_modules[i], False
        return "", False

    # -- allocations
    # ---------------------------------------------------------------------------------------------
    def on_output(self, t: Any, op: str) -> None:
        t = _local(t)
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._live:
            return
        nbytes = round_block(storage.nbytes())
        sid = self._next_sid
        self._next_sid += 1
        self._live[key] = sid
        module, recompute = self.module_now()
        info = StorageInfo(
            sid=sid,
            bytes=nbytes,
            phase=self.phase,
            step=self.step,
            module=module,
            op=op,
            shape=tuple(int(s) for s in t.shape),
            dtype=str(t.dtype).removeprefix("torch."),
            alloc_index=len(self.events),
            in_recompute=recompute,
            stream=self.stream,
            category=self.stream_categories.get(self.stream, "") if self.stream else "",
        )
        self.storages[sid] = info
        self.events.append(Event("alloc", sid, nbytes, self.phase, self.step, module, op, stream=self.stream))
        weakref.finalize(storage, self._on_free, key, sid)

    def _on_free(self, key: int, sid: int) -> None:
        if self._live.get(key) == sid:
            del self._live[key]
        info = self.storages[sid]
        if info.free_index >= 0:  # already freed by a resize to 0
            return
        info.free_index = len(self.events)
        self.events.append(
            Event("free", sid, info.bytes, self.phase, self.step, info.module, info.op, stream=info.stream)
        )

    def on_resize(self, storage: Any, before: int, after: int) -> None:
        """A storage resized in place (FSDP's free and re-allocation of unsharded parameters): to 0 frees the
        block, from 0 allocates a new one."""
        key = storage._cdata
        if after == 0 and key in self._live:
            self._on_free(key, self._live[key])
        elif before == 0 and after > 0 and key not in self._live:
            sid = self._next_sid
            self._next_sid += 1
            self._live[key] = sid
            module, recompute = self.module_now()
            self.storages[sid] = StorageInfo(
                sid=sid,
                bytes=round_block(after),
                phase=self.phase,
                step=self.step,
                module=module,
                op="resize_",
                shape=(after,),
                dtype="uint8",
                alloc_index=len(self.events),
                in_recompute=recompute,
                stream=self.stream,
                category=self.stream_categories.get(self.stream or "resize_", ""),
            )
            self.events.append(
                Event("alloc", sid, round_block(after), self.phase, self.step, module, "resize_", stream=self.stream)
            )
            weakref.finalize(storage, self._on_free, key, sid)

    def sid_of(self, t: Any) -> int | None:
        """The storage id of a live tensor (None when it was allocated outside the recording)."""
        return self._live.get(_local(t).untyped_storage()._cdata)

    def mark(self, t: Any, category: str) -> None:
        sid = self.sid_of(t)
        if sid is not None:
            self.storages[sid].category = category


def _dispatch_mode(recorder: Recorder) -> Any:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class _Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            op = func._overloadpacket.__name__
            n_before = recorder._next_sid
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    recorder.on_output(t, op)
            if op == "_to_copy" and recorder._next_sid > n_before and isinstance(args[0], torch.Tensor):
                src = recorder.sid_of(args[0])
                if src is not None and recorder.storages[src].phase is Phase.LOAD:
                    recorder.storages[n_before].param_cast = True
            return out

    return _Mode()


def dispatch_mode(recorder: Recorder) -> Any:
    """The mode that sees every op's outputs; enter it inside (after) the fake-tensor mode."""
    return _dispatch_mode(recorder)


@contextmanager
def module_hooks(recorder: Recorder, model: Any) -> Iterator[Recorder]:
    """Forward hooks on every module of ``model`` for attribution; removed on exit."""
    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda _m, _a, n=name: recorder.push(n)))
        handles.append(module.register_forward_hook(lambda _m, _a, _o: recorder.pop(), always_call=True))
    for name, p in model.named_parameters():
        recorder.param_names[id(p)] = name
    try:
        yield recorder
    finally:
        for h in handles:
            h.remove()
