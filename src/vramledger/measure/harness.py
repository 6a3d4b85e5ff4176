"""The measure harness: run each trial in a fresh worker process and turn its readings into a Ledger.

An out-of-memory error leaves the CUDA caching allocator fragmented and sometimes the context unusable, so a
trial never shares a process with another (the same reason Lightning's batch-size finder and Accelerate's
``find_executable_batch_size`` are fragile in-process). The parent never touches CUDA itself: a context here
would show up in the device memory the worker reads from NVML.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from vramledger.errors import VramledgerError
from vramledger.ledger import Basis, Category, Ledger, LineItem, Phase
from vramledger.specs import ModelSpec, TrainSpec

DEFAULT_STEPS = 3
"""Optimizer steps per trial: step 1 creates the optimizer states, steps 2+ run with them resident."""

DEFAULT_TIMEOUT_S = 900.0

STATUSES = ("ok", "oom", "error", "unsupported", "crashed", "timeout")

_SOURCE = "measured on {gpu}: torch.cuda.max_memory_{what} over {steps} steps (vramledger.measure.worker)"


@dataclass(frozen=True, kw_only=True, slots=True)
class TrialResult:
    """What one worker process reported (or how it died)."""

    status: str
    """``ok`` | ``oom`` | ``error`` | ``unsupported`` | ``crashed`` (killed, no result) | ``timeout``."""
    raw: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """The worker's result mapping as it wrote it (empty when it wrote none)."""
    error: str = ""
    """One line on what went wrong (empty when ``ok``)."""
    returncode: int | None = None
    stderr_tail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def fits(self) -> bool:
        """Whether the step ran; raises on failures that say nothing about memory."""
        if self.status in ("ok", "oom"):
            return self.status == "ok"
        raise VramledgerError(f"trial failed ({self.status}): {self.error}", exit_code=1)


def _worker_env(extra: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])  # src/vramledger/measure/harness.py -> src
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if extra:
        env.update(extra)
    return env


def trial_spec(
    model: ModelSpec,
    train: TrainSpec,
    *,
    steps: int = DEFAULT_STEPS,
    device: str = "cuda",
    snapshot: Path | None = None,
    hf_config: Mapping[str, Any] | None = None,
    fake_capacity_bytes: int | None = None,
    seed: int = 0,
    history_context: str | None = "all",
) -> dict[str, Any]:
    """The JSON mapping the worker reads: the model's config, the TrainSpec and the run settings."""
    from vramledger.measure.modelcfg import hf_config_for
    from vramledger.measure.serial import train_to_dict

    if steps < 1:
        raise VramledgerError(f"--steps must be at least 1 (got {steps}); 3 makes the optimizer states resident")
    return {
        "model_name": model.name,
        "hf_config": dict(hf_config) if hf_config is not None else hf_config_for(model),
        "train": train_to_dict(train),
        "steps": steps,
        "device": device,
        "snapshot": str(snapshot) if snapshot else None,
        "history_context": history_context,
        "fake_capacity_bytes": fake_capacity_bytes,
        "seed": seed,
    }


def run_worker(
    spec: Mapping[str, Any], *, timeout_s: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None
) -> TrialResult:
    """Run one trial in a fresh ``python -m vramledger.measure.worker`` and collect its result."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "vramledger.measure.worker"],
            input=json.dumps(dict(spec)),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=_worker_env(env),
        )
    except subprocess.TimeoutExpired as exc:
        tail = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        return TrialResult(status="timeout", error=f"no result within {timeout_s:g} s", stderr_tail=tail[-2000:])
    raw: dict[str, Any] | None = None
    for line in reversed(proc.stdout.strip().splitlines()):
        try:
            raw = json.loads(line)
            break
        except json.JSONDecodeError:
            continue
    if raw is None:
        return TrialResult(
            status="crashed",
            error=f"the worker exited with code {proc.returncode} and wrote no result",
            returncode=proc.returncode,
            stderr_tail=proc.stderr[-2000:],
        )
    status = str(raw.get("status", "error"))
    if status not in STATUSES:
        status = "error"
    return TrialResult(
        status=status,
        raw=raw,
        error=str(raw.get("error", "")).splitlines()[0] if raw.get("error") else "",
        returncode=proc.returncode,
        stderr_tail=proc.stderr[-2000:],
    )


def ledger_from_result(result: TrialResult, model: ModelSpec, train: TrainSpec) -> Ledger:
    """A Ledger (engine ``measure``) from a successful trial.

    Per phase: the weights resident after loading, the optimizer states (bytes of their tensors; from step 2
    on they are live in every phase), the gradients in the optimizer phase, and the rest of the measured peak
    as one line (activations, temporaries, partial gradients: a measurement cannot tell them apart); then the
    allocator's reserve (max reserved − max allocated) and, where NVML was read, the CUDA context.
    """
    if not result.ok:
        raise VramledgerError(f"trial did not run ({result.status}): {result.error}", exit_code=1)
    raw = result.raw
    phases: Mapping[str, Mapping[str, Any]] = raw.get("phases", {})
    env = raw.get("environment", {})
    gpu = str(env.get("gpu", "cpu (test mode)"))
    steps = len(raw.get("steps", ()))
    items: list[LineItem] = []
    for name, fig in phases.items():
        phase = Phase(name)
        items += _allocated_items(phase, int(fig["allocated"]), raw, gpu=gpu, steps=steps)
        items += _outside_allocated_items(phase, fig, env, gpu=gpu, steps=steps)
    counters = raw.get("counters", {})
    warnings: list[str] = []
    if counters.get("num_alloc_retries"):
        warnings.append(
            f"the allocator freed its cache and retried {counters['num_alloc_retries']} time(s): "
            "the step ran at the edge of memory, and reserved is lower than it would be with room to spare"
        )
    settings = {
        "gpu": gpu,
        "steps": steps,
        "versions": env.get("versions", {}),
        "driver": env.get("driver"),
        "counters": counters,
        "wall_s": raw.get("wall_s"),
    }
    return Ledger(
        model=model.name,
        params=int(raw.get("params", 0)),
        trainable_params=int(raw.get("trainable_params", 0)),
        items=tuple(items),
        engine="measure",
        warnings=tuple(warnings) + tuple(train.warnings),
        settings=MappingProxyType(settings),
    )


def _allocated_items(phase: Phase, alloc: int, raw: Mapping[str, Any], *, gpu: str, steps: int) -> list[LineItem]:
    """A phase's peak allocated bytes split into the tensors the worker sized (each capped by what is left of the
    peak) and one line for the rest."""
    m = Basis.MEASUREMENT
    source = _SOURCE.format(gpu=gpu, what="allocated", steps=steps)
    opt_state = int(raw.get("optimizer_state_bytes", 0))
    grads = int(raw.get("gradients_bytes", 0))
    known: list[tuple[Category, int, str]] = [
        (Category.WEIGHTS, int(raw.get("weights_bytes", 0)), "weights resident after loading")
    ]
    if phase is not Phase.LOAD and steps > 1 and opt_state:
        known.append((Category.OPTIMIZER_STATE, opt_state, "optimizer state tensors (measured sizes)"))
    if phase is Phase.OPTIMIZER and grads:
        known.append((Category.GRADIENTS, grads, "gradients at the optimizer step (measured sizes)"))
    items: list[LineItem] = []
    budget = alloc
    for cat, n, label in known:
        n = min(n, budget)
        budget -= n
        items.append(LineItem(category=cat, phase=phase, bytes=n, label=label, source=source, basis=m))
    if phase is not Phase.LOAD:
        rest_cat = Category.TEMPORARIES if phase is Phase.OPTIMIZER else Category.ACTIVATIONS
        label = {
            Phase.OPTIMIZER: "rest of the peak: optimizer temporaries",
            Phase.GENERATE: "rest of the peak: KV cache, logits and activations",
        }.get(phase, "rest of the peak: activations, temporaries, gradients so far")
        items.append(LineItem(category=rest_cat, phase=phase, bytes=budget, label=label, source=source, basis=m))
    return items


def _outside_allocated_items(
    phase: Phase, fig: Mapping[str, Any], env: Mapping[str, Any], *, gpu: str, steps: int
) -> list[LineItem]:
    """A phase's device memory beyond the allocated peak: the allocator's reserve and, where NVML was read, the
    CUDA context."""
    m = Basis.MEASUREMENT
    items = [
        LineItem(
            category=Category.ALLOCATOR_RESERVE,
            phase=phase,
            bytes=max(0, int(fig["reserved"]) - int(fig["allocated"])),
            label="max reserved − max allocated",
            source=_SOURCE.format(gpu=gpu, what="reserved", steps=steps),
            basis=m,
        )
    ]
    if fig.get("context") is not None:
        items.append(
            LineItem(
                category=Category.CUDA_CONTEXT,
                phase=phase,
                bytes=int(fig["context"]),
                label="device memory in use (NVML) − reserved",
                source=f"{env.get('nvml_source', 'nvml')} memory used less the baseline",
                basis=m,
            )
        )
    return items


def cuda_available() -> bool:
    """Whether a CUDA GPU is visible, without creating a CUDA context in this process."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def require_gpu(command: str = "measure") -> None:
    """Exit 2 with one line when no CUDA GPU is visible."""
    if not cuda_available():
        raise VramledgerError(
            f"{command} needs a CUDA GPU and none is visible here (torch.cuda.is_available() is False); "
            "use `vramledger estimate` on this machine, or run measure on the GPU machine"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    result: TrialResult
    ledger: Ledger | None
    """The measured ledger (None when the trial did not run)."""


def measure(
    model: ModelSpec,
    train: TrainSpec,
    *,
    steps: int = DEFAULT_STEPS,
    snapshot: Path | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    device: str = "cuda",
    fake_capacity_bytes: int | None = None,
    env: Mapping[str, str] | None = None,
    history_context: str | None = "all",
) -> Measurement:
    """Measure one training setup in a fresh process. ``device="cpu"`` is the test mode (see the worker).

    ``history_context``: what the snapshot's history keeps of each event (``"all"``: its stacks, for
    memory_viz; ``None``: the event alone, enough to replay the allocation stream).
    """
    if train.images:  # the worker's batch is token ids only (measure/worker.py)
        raise VramledgerError(
            "measure --images: the GPU trial feeds text only so far; `vramledger trace` runs the tower with images"
        )
    spec = trial_spec(
        model,
        train,
        steps=steps,
        device=device,
        snapshot=snapshot,
        fake_capacity_bytes=fake_capacity_bytes,
        history_context=history_context,
    )
    result = run_worker(spec, timeout_s=timeout_s, env=env)
    return Measurement(result=result, ledger=ledger_from_result(result, model, train) if result.ok else None)
