"""Synthetic memory snapshots in exactly ``torch.cuda.memory._snapshot()``'s format (torch/cuda/memory.py
docstring: segments of blocks with address, size, requested_size, state, frames; device_traces of actions),
with frames naming the transformers and torch functions that allocate in a real step. Labelled synthetic: real
snapshots come from bench/ground_truth/oom_fixtures.py on a GPU."""

from __future__ import annotations

from typing import Any

import pytest

MiB = 2**20


def frame(filename: str, line: int, name: str) -> dict[str, Any]:
    return {"filename": filename, "line": line, "name": name}


SITE = "/usr/lib/python3.11/site-packages"
TRAINER = frame(f"{SITE}/transformers/trainer.py", 3790, "training_step")
CAUSAL = frame(f"{SITE}/transformers/models/llama/modeling_llama.py", 460, "forward")
MODEL = frame(f"{SITE}/transformers/models/llama/modeling_llama.py", 390, "forward")
LAYER = frame(f"{SITE}/transformers/models/llama/modeling_llama.py", 300, "forward")
MLP = frame(f"{SITE}/transformers/models/llama/modeling_llama.py", 150, "forward")
LINEAR = frame(f"{SITE}/torch/nn/modules/linear.py", 125, "forward")
CALL = frame(f"{SITE}/torch/nn/modules/module.py", 1775, "_call_impl")
LOSS = frame(f"{SITE}/transformers/loss/loss_utils.py", 36, "fixed_cross_entropy")
INIT_GROUP = frame(f"{SITE}/torch/optim/adamw.py", 160, "_init_group")
OPT_STEP = frame(f"{SITE}/torch/optim/adamw.py", 230, "step")
CACHE = frame(f"{SITE}/transformers/cache_utils.py", 120, "update")
PEFT_MODEL = frame(f"{SITE}/peft/peft_model.py", 1850, "forward")
LORA_FWD = frame(f"{SITE}/peft/tuners/lora/layer.py", 720, "forward")
LORA_INIT = frame(f"{SITE}/peft/tuners/lora/layer.py", 150, "update_layer")
INJECT = frame(f"{SITE}/peft/tuners/tuners_utils.py", 500, "inject_adapter")
GET_PEFT = frame(f"{SITE}/peft/mapping_func.py", 120, "get_peft_model")
CKPT = frame(f"{SITE}/torch/utils/checkpoint.py", 1120, "unpack_hook")

# (bucket expected by hand, size, state, frames, traced): one 1 GiB segment, listed in address order
BLOCKS: list[tuple[str, int, str, list[dict[str, Any]], bool]] = [
    ("unrecorded", 200 * MiB, "active_allocated", [], False),  # the weights, loaded before the recording
    ("free", 300 * MiB, "inactive", [], True),
    (
        "activations",
        100 * MiB,
        "active_allocated",
        [LINEAR, CALL, MLP, CALL, LAYER, CALL, MODEL, CALL, CAUSAL, TRAINER],
        True,
    ),
    ("free", 260 * MiB, "inactive", [], True),
    ("logits_loss", 64 * MiB, "active_allocated", [LINEAR, CALL, CAUSAL, CALL, TRAINER], True),
    ("logits_loss", 32 * MiB, "active_allocated", [LOSS, CAUSAL, TRAINER], True),
    ("optimizer_state", 40 * MiB, "active_allocated", [INIT_GROUP, OPT_STEP, TRAINER], True),
    ("backward", 24 * MiB, "active_allocated", [], True),  # autograd engine thread: traced, no Python stack
    ("kv_cache", 4 * MiB, "active_allocated", [CACHE, LAYER, MODEL, CAUSAL], True),
    # PEFT: adapters created by get_peft_model are weights; a LoRA forward under the decoder is an activation
    ("weights", 2 * MiB, "active_allocated", [LORA_INIT, INJECT, GET_PEFT], True),
    (
        "activations",
        8 * MiB,
        "active_allocated",
        [LORA_FWD, CALL, MLP, CALL, LAYER, MODEL, CAUSAL, PEFT_MODEL, TRAINER],
        True,
    ),
    # gradient checkpointing: the layer's forward recomputed from the unpack hook (one modeling frame on top)
    ("activations", 6 * MiB, "active_allocated", [LINEAR, CALL, MLP, CALL, LAYER, CKPT], True),
]
BASE = 0x7F0000000000
REQUEST = 400 * MiB


def make_snapshot() -> dict[str, Any]:
    blocks, trace, addr = [], [], BASE
    for _, size, state, frames, traced in BLOCKS:
        blocks.append({"address": addr, "size": size, "requested_size": size, "state": state, "frames": frames})
        if traced:
            trace.append({"action": "alloc", "addr": addr, "size": size, "stream": 0, "frames": frames})
        addr += size
    total = sum(s for _, s, *_ in BLOCKS)
    allocated = sum(s for _, s, st, *_ in BLOCKS if st != "inactive")
    trace.append({"action": "oom", "size": REQUEST, "stream": 0, "device_free": 12 * MiB, "frames": []})
    segment = {
        "device": 0,
        "address": BASE,
        "total_size": total,
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "allocated_size": allocated,
        "active_size": allocated,
        "blocks": blocks,
    }
    return {"segments": [segment], "device_traces": [trace]}


@pytest.fixture
def snapshot() -> dict[str, Any]:
    return make_snapshot()
