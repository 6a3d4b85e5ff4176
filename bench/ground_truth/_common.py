"""What the three ground-truth scripts share: arguments, the environment record, the model, the probes.

The scripts run as ``python bench/ground_truth/NAME.py``, so this file is importable as ``_common`` (the
script's folder is ``sys.path[0]``). Nothing here touches CUDA at import time: a parent process that only
orchestrates subprocesses must not create a CUDA context (it would hold device memory, and environment
variables such as ``PYTORCH_CUDA_ALLOC_CONF`` are read once, at the allocator's first use).

Models are built with random weights from the bundled catalog configs (``vramledger.catalog.resolve_model``
+ ``vramledger.measure.modelcfg.hf_config_for``), the way ``vramledger.measure.worker.build_model`` does for
``bf16-mixed``: LoRA = frozen weights bf16, adapters fp32 (PEFT ``autocast_adapter_dtype``); full = fp32
weights; the forward runs under ``torch.autocast(dtype=torch.bfloat16)``. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

GIB = 2**30
MIB = 2**20

# --smoke shrinks every model to this (a few hundred thousand parameters) so a CPU run takes seconds.
SMOKE_OVERRIDES: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
}


def parse_args(doc: str | None, extra: list[tuple[str, dict[str, Any]]] = ()) -> argparse.Namespace:  # type: ignore[assignment]
    """``--out DIR [--device cuda|cpu] [--smoke]`` plus the script's own (hidden) child-process flags."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="folder the result files are written to")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--smoke", action="store_true", help="a tiny model and a few steps (CPU test mode)")
    for name, kw in extra:
        p.add_argument(name, **kw)
    return p.parse_args()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Deadline:
    """A hard time budget: every loop asks ``left()`` before starting work it could not finish."""

    def __init__(self, seconds: float) -> None:
        self.t0 = time.monotonic()
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.t0)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


def environment(device: str) -> dict[str, Any]:
    """GPU name, driver, CUDA and library versions (``vramledger.measure.env``); None where absent."""
    from vramledger.measure import env

    info: dict[str, Any] = {
        "versions": env.versions(),
        "device": device,
        "host": socket.gethostname(),
        "gpu": None,
        "gpu_total_bytes": None,
        "driver": None,
        "nvml_total_bytes": None,
        "nvml_source": None,
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "CUDA_MODULE_LOADING": os.environ.get("CUDA_MODULE_LOADING"),
    }
    info["cuda"] = info["versions"].get("cuda")
    if device == "cuda":
        info.update(env.cuda_device_facts())
    return info


def hf_config(model_name: str, smoke: bool) -> dict[str, Any]:
    """The bundled config.json mapping of a catalog model, shrunk under ``--smoke``."""
    from vramledger.catalog import resolve_model
    from vramledger.measure.modelcfg import hf_config_for

    cfg = dict(hf_config_for(resolve_model(model_name)))
    if smoke:
        cfg.update(SMOKE_OVERRIDES)
    return cfg


def build_model(
    model_name: str,
    device: Any,
    *,
    method: str = "lora",
    lora_rank: int = 16,
    attn: str = "sdpa",
    grad_ckpt: bool = False,
    smoke: bool = False,
) -> Any:
    """A causal LM with random weights on ``device`` (bf16-mixed; ``method`` = ``lora`` | ``full``)."""
    import torch
    import transformers

    cfg = hf_config(model_name, smoke)
    model_type = cfg.pop("model_type")
    cfg.pop("torch_dtype", None)
    cfg.pop("dtype", None)
    config = transformers.AutoConfig.for_model(model_type, **cfg)
    config.use_cache = False
    dtype = torch.bfloat16 if method == "lora" else torch.float32
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    if grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if method == "lora":
        import peft

        lcfg = peft.LoraConfig(
            r=lora_rank,
            lora_alpha=2 * lora_rank,
            lora_dropout=0.0,
            target_modules="all-linear",
            task_type="CAUSAL_LM",
        )
        model = peft.get_peft_model(model, lcfg, autocast_adapter_dtype=True)
        if grad_ckpt:
            # PEFT's wrapper: the embedding output must require grad for non-reentrant checkpointing to
            # see a grad path into the first block (transformers' enable_input_require_grads).
            model.enable_input_require_grads()
    model.train()
    return model


def model_config(model_name: str, smoke: bool) -> dict[str, Any]:
    """What the JSON records say about the model: the catalog name and the config actually built."""
    cfg = hf_config(model_name, smoke)
    keys = (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "tie_word_embeddings",
    )
    return {"name": model_name, "smoke_overrides": SMOKE_OVERRIDES if smoke else None, **{k: cfg.get(k) for k in keys}}


# -- memory readings -----------------------------------------------------------------------------------------


class Probe:
    """Per-phase peak memory: the CUDA caching allocator's statistics, or on CPU the measure worker's byte counter
    (:class:`vramledger.measure.worker.CountingProbe`: an optional fake capacity, ``.capacity``, above which it
    raises ``torch.OutOfMemoryError``), so the scripts' control flow runs without a GPU."""

    def __init__(self, device: Any) -> None:
        self.cuda = device.type == "cuda"
        from vramledger.measure.worker import CountingProbe

        self.counter = None if self.cuda else CountingProbe(None)

    def __enter__(self) -> Probe:
        if self.counter is not None:
            self.counter.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.counter is not None:
            self.counter.mode.__exit__(*exc)

    def begin(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            assert self.counter is not None
            self.counter.peak = self.counter.live

    def read(self) -> dict[str, int]:
        """Peak allocated/reserved since ``begin``, the current ones, and the allocator's counters."""
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            stats = torch.cuda.memory_stats()
            return {
                "max_allocated": int(torch.cuda.max_memory_allocated()),
                "max_reserved": int(torch.cuda.max_memory_reserved()),
                "allocated": int(torch.cuda.memory_allocated()),
                "reserved": int(torch.cuda.memory_reserved()),
                "num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
                "num_ooms": int(stats.get("num_ooms", 0)),
            }
        c = self.counter
        assert c is not None
        return {
            "max_allocated": c.peak,
            "max_reserved": c.peak,
            "allocated": c.live,
            "reserved": c.live,
            "num_alloc_retries": 0,
            "num_ooms": c.ooms,
        }


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=str) + "\n")


def child_command(script: str, args: argparse.Namespace, *extra: str) -> list[str]:
    """The command line that reruns ``script`` as a child with the parent's --out/--device/--smoke."""
    cmd = [sys.executable, script, "--out", str(args.out), "--device", args.device]
    if args.smoke:
        cmd.append("--smoke")
    return cmd + list(extra)
