"""Trace: the real model code on fake tensors, on CPU, without a GPU or weights.

``trace_step(model, train)`` returns the same ``Ledger`` as ``vramledger.analytic.estimate`` (engine ``trace``);
``trace_events(model, train)`` returns the raw allocation/free events for the allocator model to replay. Heavy
imports (torch, transformers, peft) happen inside the functions.
"""

from vramledger.trace.api import trace_events, trace_step

__all__ = ["trace_events", "trace_step"]
