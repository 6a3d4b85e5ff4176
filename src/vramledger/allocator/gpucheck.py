"""Check the allocator model on a real GPU: replay torch's own alloc/free sequence, compare peak reserved.

A training step runs on CUDA with ``torch.cuda.memory._record_memory_history`` on; its trace (every
``alloc`` and ``free_completed`` of the caching allocator, in order, with requested sizes) is replayed through
:func:`~vramledger.allocator.replay.replay` under the same ``PYTORCH_CUDA_ALLOC_CONF``, and the replayed
peaks, retries and device allocations are compared with ``torch.cuda.memory_stats()``. This isolates the
allocator model's error from the tracer's (the fake-tensor trace is checked elsewhere).

Each configuration must run in a fresh process (the allocator reads its settings once, at CUDA start)::

    python -m vramledger.allocator.gpucheck CONFIG_NAME OUT.json

``tests/trace/test_allocator_gpu.py`` (marked ``gpu``) runs all of :data:`CONFIGS` that way and collects a
CSV.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from vramledger.allocator.conf import parse_alloc_conf
from vramledger.allocator.replay import AllocEvent, replay

_MAX_ENTRIES = 20_000_000


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuCheckConfig:
    """One training workload: a Llama-shaped model from a config (no download), bf16, AdamW."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int = 32000
    batch: int = 2
    seq_lens: tuple[int, ...] = (1024, 1024, 1024)
    """One entry per optimizer step; differing lengths mimic dynamic padding."""
    lora_rank: int | None = None
    grad_ckpt: bool = False
    alloc_conf: str = ""
    memory_fraction: float | None = None
    """``torch.cuda.set_per_process_memory_fraction`` (also what enables garbage collection)."""


_SMALL: dict[str, Any] = {"hidden": 1024, "layers": 8, "heads": 16, "kv_heads": 4, "intermediate": 2816}
_MID: dict[str, Any] = {"hidden": 2048, "layers": 16, "heads": 16, "kv_heads": 8, "intermediate": 5632}
_VAR = (384, 1000, 640, 1024, 512, 900)

CONFIGS: Mapping[str, GpuCheckConfig] = {
    c.name: c
    for c in (
        GpuCheckConfig(name="small-full", **_SMALL, batch=4, seq_lens=(512,) * 3),
        GpuCheckConfig(
            name="small-full-expandable",
            **_SMALL,
            batch=4,
            seq_lens=(512,) * 3,
            alloc_conf="expandable_segments:True",
        ),
        GpuCheckConfig(
            name="small-full-maxsplit64",
            **_SMALL,
            batch=4,
            seq_lens=(512,) * 3,
            alloc_conf="max_split_size_mb:64",
        ),
        GpuCheckConfig(name="mid-full", **_MID),
        GpuCheckConfig(name="mid-full-ckpt", **_MID, grad_ckpt=True),
        GpuCheckConfig(name="mid-lora16", **_MID, lora_rank=16),
        GpuCheckConfig(name="mid-lora16-expandable", **_MID, lora_rank=16, alloc_conf="expandable_segments:True"),
        GpuCheckConfig(name="mid-full-varlen", **_MID, seq_lens=_VAR),
        GpuCheckConfig(name="mid-full-varlen-expandable", **_MID, seq_lens=_VAR, alloc_conf="expandable_segments:True"),
        GpuCheckConfig(name="mid-full-varlen-roundup4", **_MID, seq_lens=_VAR, alloc_conf="roundup_power2_divisions:4"),
        GpuCheckConfig(
            name="mid-full-varlen-gc",
            **_MID,
            seq_lens=_VAR,
            memory_fraction=0.5,
            alloc_conf="garbage_collection_threshold:0.6",
        ),
    )
}


def events_from_snapshot(snapshot: Mapping[str, Any], device: int = 0) -> tuple[list[AllocEvent], int]:
    """Alloc/free events from a ``torch.cuda.memory._snapshot()``'s ``device_traces``.

    ``alloc`` opens a storage at an address, ``free_completed`` (when the block is back in the pool) closes it;
    segment, OOM and snapshot entries are the allocator's own doing and are skipped. Returns the events and the
    number of frees of storages allocated before recording began (they cannot be replayed; should be 0).
    """
    events: list[AllocEvent] = []
    by_addr: dict[int, int] = {}
    unmatched = 0
    for entry in snapshot["device_traces"][device]:
        action = entry["action"]
        if action == "alloc":
            nid = len(events)
            by_addr[entry["addr"]] = nid
            events.append(AllocEvent.alloc(nid, int(entry["size"])))
        elif action == "free_completed":
            nid_or_none = by_addr.pop(entry["addr"], None)
            if nid_or_none is None:
                unmatched += 1
            else:
                events.append(AllocEvent.free(nid_or_none))
    return events, unmatched


def _train(cfg: GpuCheckConfig) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    mc = LlamaConfig(
        hidden_size=cfg.hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        intermediate_size=cfg.intermediate,
        vocab_size=cfg.vocab,
        max_position_embeddings=4096,
        attn_implementation="sdpa",  # type: ignore[call-arg]  # a PretrainedConfig kwarg
    )
    model = LlamaForCausalLM(mc).to(device="cuda", dtype=torch.bfloat16)  # type: ignore[call-arg]
    if cfg.grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.lora_rank is not None:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=cfg.lora_rank, lora_alpha=2 * cfg.lora_rank, target_modules=targets))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    g = torch.Generator(device="cuda").manual_seed(0)
    for seq in cfg.seq_lens:
        ids = torch.randint(0, cfg.vocab, (cfg.batch, seq), device="cuda", generator=g)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del ids, loss
    torch.cuda.synchronize()


def run_config(cfg: GpuCheckConfig) -> dict[str, Any]:
    """Run one workload on CUDA and replay it. Needs a fresh process (see the module docstring)."""
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = cfg.alloc_conf
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("vramledger.allocator.gpucheck needs a CUDA device")
    if cfg.memory_fraction is not None:
        torch.cuda.set_per_process_memory_fraction(cfg.memory_fraction)
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=_MAX_ENTRIES)
    _train(cfg)
    snap = torch.cuda.memory._snapshot()
    stats = torch.cuda.memory_stats()
    props = torch.cuda.get_device_properties(0)
    entries = len(snap["device_traces"][0])
    events, unmatched = events_from_snapshot(snap)
    conf_text = cfg.alloc_conf
    if cfg.memory_fraction is not None:
        conf_text = ",".join(x for x in (conf_text, f"per_process_memory_fraction:{cfg.memory_fraction}") if x)
    res = replay(events, capacity_bytes=None, conf=parse_alloc_conf(conf_text), device_total_bytes=props.total_memory)
    torch_reserved = int(stats["reserved_bytes.all.peak"])
    return {
        "config": asdict(cfg),
        "torch_version": torch.__version__,
        "gpu": props.name,
        "trace_entries": entries,
        "trace_truncated": entries >= _MAX_ENTRIES,
        "unmatched_frees": unmatched,
        "events": len(events),
        "torch_peak_reserved": torch_reserved,
        "model_peak_reserved": res.peak_reserved_bytes,
        "reserved_error_pct": 100.0 * (res.peak_reserved_bytes - torch_reserved) / torch_reserved,
        "torch_peak_allocated": int(stats["allocated_bytes.all.peak"]),
        "model_peak_allocated": res.peak_allocated_bytes,
        "torch_num_alloc_retries": int(stats["num_alloc_retries"]),
        "model_num_alloc_retries": res.num_alloc_retries,
        "torch_num_device_alloc": int(stats.get("num_device_alloc", -1)),
        "model_num_device_alloc": res.num_device_alloc,
        "model_reserve_at_peak": res.reserve_at_peak_bytes,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] not in CONFIGS:
        sys.stderr.write(f"usage: python -m vramledger.allocator.gpucheck {{{','.join(CONFIGS)}}} OUT.json\n")
        return 2
    result = run_config(CONFIGS[args[0]])
    with open(args[1], "w") as fh:
        json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
