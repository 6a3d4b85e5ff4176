"""Time and peak host memory of `vramledger trace` for 8B-class shapes (batch 4, length 4096), imports
included.

Each case runs in a fresh subprocess (so imports are counted and memory is not shared):

    PYTHONPATH=src python bench/trace_bench.py
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

# Qwen/Qwen2.5-7B config.json (https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json), memory fields.
QWEN25_7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "rope_theta": 1000000.0,
    "torch_dtype": "bfloat16",
}

CHILD = """
import json, sys, time
t0 = time.perf_counter()
from vramledger.catalog import resolve_model
from vramledger.catalog.hfconfig import model_spec_from_config
from vramledger.specs import Method, TrainSpec
from vramledger.trace import trace_step
name, method, cfg = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
model = model_spec_from_config(cfg, name=name, source="bench") if cfg else resolve_model(name)
ledger = trace_step(model, TrainSpec(method=Method(method), micro_batch=4, seq_len=4096), config=cfg or None)
print(json.dumps({"seconds": time.perf_counter() - t0, "peak": ledger.peak_allocated,
                  "phase": ledger.peak_phase.value, "moment": ledger.moments.get(ledger.peak_phase, "")}))
"""


def main() -> None:
    cases = [("llama-3-8b", m, {}) for m in ("full", "lora")] + [("Qwen2.5-7B", m, QWEN25_7B) for m in ("full", "lora")]
    print(f"{'model':<12} {'method':<6} {'wall s':>7} {'host MiB':>9} {'peak GiB':>9}  peak moment")
    for name, method, cfg in cases:
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        t0 = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", CHILD, name, method, json.dumps(cfg)],
            capture_output=True,
            text=True,
            check=True,
        )
        wall = time.perf_counter() - t0
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB, max over children so far
        r = json.loads(out.stdout.strip().splitlines()[-1])
        host = f"{rss / 1024:.0f}" if rss > before else f"<={rss / 1024:.0f}"
        print(f"{name:<12} {method:<6} {wall:>7.1f} {host:>9} {r['peak'] / 2**30:>9.2f}  {r['phase']}: {r['moment']}")


if __name__ == "__main__":
    main()
