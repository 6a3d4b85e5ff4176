"""What the callbacks do at an out-of-memory failure: keep the evidence and write the post-mortem.

Called from PyTorch's OOM observer (``DeviceCachingAllocator::malloc`` calls it after its retries failed and its
lock was released, before raising), so the snapshot shows the allocator exactly as it failed. The live tensors
the callback knows (parameters, their gradients, the optimizer's state) are attributed by address, exactly; the
rest by their allocation stacks (``explain.attribute``). Files go beside the JSONL, never over an existing one.
"""

from __future__ import annotations

from typing import Any


def known_tensors(model: Any, optimizer: Any) -> dict[int, Any]:
    """Data pointers of the tensors whose role is certain: parameters, their gradients, the optimizer's state."""
    from vramledger.explain.attribute import Bucket

    out: dict[int, Any] = {}
    for p in model.parameters() if model is not None else ():
        if p.is_cuda:
            out[p.data_ptr()] = Bucket.WEIGHTS
            if p.grad is not None:
                out[p.grad.data_ptr()] = Bucket.GRADIENTS
    inner = getattr(optimizer, "optimizer", optimizer)
    for state in getattr(inner, "state", {}).values():
        for t in state.values() if isinstance(state, dict) else ():
            if getattr(t, "is_cuda", False):
                out[t.data_ptr()] = Bucket.OPTIMIZER_STATE
    return out
