"""One measured trial, run alone in its own process: ``python -m vramledger.measure.worker``.

Reads a trial spec (JSON) on stdin and writes one result (JSON) on stdout; everything libraries print goes to
stderr. Running each trial in a fresh process means an out-of-memory error, a fragmented cache or a crashed
CUDA context never reaches the next trial.

What a trial does (the steps of ``transformers.Trainer.training_step`` without the Trainer):

1. builds the model from its config with random weights directly on the device (``AutoModelForCausalLM
   .from_config`` under ``torch.device``), in the dtypes the precision asks for:
   ``bf16-mixed``/``fp16-mixed`` = trainable parameters fp32, frozen ones in the compute dtype, forward under
   ``torch.autocast`` (HF Trainer / Lightning AMP); ``bf16-true``/``fp16-true`` = every parameter in the
   compute dtype, LoRA adapters included; ``fp32`` = everything fp32;
2. QLoRA: swaps every decoder ``nn.Linear`` (not ``lm_head``, transformers' ``_get_keys_to_not_convert``) for
   bitsandbytes ``Linear4bit``/``Linear8bitLt``, without ``prepare_model_for_kbit_training`` (LLaMA-Factory
   does not call it either: norms and embeddings stay in the compute dtype);
3. gradient checkpointing (``use_reentrant=False``), then the method: full, freeze (last N decoder layers
   train) or PEFT LoRA/DoRA (``autocast_adapter_dtype`` = ``LoraSpec.adapter_fp32``);
4. ``steps`` optimizer steps of ``grad_accum`` micro-batches each: forward with ``labels`` (transformers'
   ``ForCausalLMLoss``, logits upcast to fp32), backward, ``optimizer.step()``,
   ``zero_grad(set_to_none=True)``;
5. evaluation (one batch under ``no_grad``, its logits kept as the Trainer's eval loop keeps them) and
   generation (greedy ``generate`` with the KV cache) when the TrainSpec asks for them.

Per phase it records ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` (peak stats reset at each
phase start), the device memory in use from NVML (minus what was in use before this process touched CUDA),
and ``num_alloc_retries``/``num_ooms`` from ``torch.cuda.memory_stats``.

``device: "cpu"`` is a test mode: the same steps on the CPU, with allocated bytes counted by a dispatch mode
(every storage created, freed when it dies) and an optional ``fake_capacity_bytes`` above which it raises
``torch.OutOfMemoryError``. The environment variable ``VRAMLEDGER_WORKER_FAULT`` (``crash`` | ``oom`` |
``hang``) injects a failure after the model is built, for the isolation tests.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

FAULT_ENV = "VRAMLEDGER_WORKER_FAULT"


class Unsupported(Exception):
    """The trial asks for something this harness cannot run (reported as status ``unsupported``)."""


# -- memory probes -------------------------------------------------------------------------------------------


class CudaProbe:
    """Peak allocator statistics per phase, and the device's memory in use as NVML sees it."""

    def __init__(self) -> None:
        from vramledger.measure import env

        self._env = env
        self._baseline_rows = env.gpu_table()  # before this process creates a CUDA context
        import torch

        torch.cuda.init()
        self._uuid = env.torch_uuid(torch.cuda.current_device())
        base = env.row_for(self._baseline_rows, self._uuid)
        self.baseline_used = base["used_bytes"] if base else None
        self.nvml_source = base["source"] if base else None

    def device_used(self) -> int | None:
        """Bytes in use on our device now, less the baseline (None without NVML or nvidia-smi)."""
        if self.baseline_used is None:
            return None
        row = self._env.row_for(self._env.gpu_table(), self._uuid)
        return None if row is None else row["used_bytes"] - self.baseline_used

    def begin(self) -> None:
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def end(self) -> dict[str, Any]:
        import torch

        torch.cuda.synchronize()
        reading: dict[str, Any] = {
            "allocated": int(torch.cuda.max_memory_allocated()),
            "reserved": int(torch.cuda.max_memory_reserved()),
            "allocated_now": int(torch.cuda.memory_allocated()),
            "reserved_now": int(torch.cuda.memory_reserved()),
            "device": None,
            "context": None,
        }
        used = self.device_used()
        if used is not None:
            # The caching allocator never returns memory within a phase (no empty_cache), so the reserved
            # bytes now are the phase's peak reserved, and what NVML shows beyond them is the CUDA context,
            # cuBLAS/cuDNN workspaces' driver side and library code.
            reading["context"] = max(0, used - reading["reserved_now"])
            reading["device"] = reading["reserved"] + reading["context"]
        return reading

    def counters(self) -> dict[str, int]:
        import torch

        stats = torch.cuda.memory_stats()
        return {
            "num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
            "num_ooms": int(stats.get("num_ooms", 0)),
        }


class CountingProbe:
    """CPU test mode: bytes of live tensor storages, counted by a dispatch mode; an optional fake capacity above
    which it raises ``torch.OutOfMemoryError`` as the CUDA allocator would (``on_oom``, if set, is called first
    with the bytes the failing op asked for, like the CUDA out-of-memory observer)."""

    def __init__(self, capacity: int | None) -> None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten
        from torch.utils.weak import WeakIdKeyDictionary

        probe = self
        self.capacity = capacity
        self.live = 0
        self.peak = 0
        self.ooms = 0
        self.on_oom: Any = None
        seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

        def free(n: int) -> None:
            probe.live -= n

        class _Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                new = 0
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                        st = t.untyped_storage()
                        if st not in seen:
                            n = st.nbytes()
                            seen[st] = n
                            weakref.finalize(st, free, n)
                            probe.live += n
                            new += n
                probe.peak = max(probe.peak, probe.live)
                if probe.capacity is not None and probe.live > probe.capacity:
                    probe.ooms += 1
                    if probe.on_oom is not None:
                        probe.on_oom(new)
                    raise torch.OutOfMemoryError(
                        f"simulated: {func} tried to allocate {new} bytes; {probe.live} bytes live exceed the "
                        f"fake capacity {probe.capacity}"
                    )
                return out

        self.mode = _Count()

    def device_used(self) -> int | None:
        return None

    def begin(self) -> None:
        self.peak = self.live

    def end(self) -> dict[str, Any]:
        return {
            "allocated": self.peak,
            "reserved": self.peak,
            "allocated_now": self.live,
            "reserved_now": self.live,
            "device": None,
            "context": None,
        }

    def counters(self) -> dict[str, int]:
        return {"num_alloc_retries": 0, "num_ooms": self.ooms}


# -- model building ------------------------------------------------------------------------------------------


def _dtype(name: str) -> Any:
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _quantize_linears(model: Any, quant: Any, compute_dtype: Any, device: Any) -> int:
    """Replace decoder ``nn.Linear`` layers by bitsandbytes ones, one at a time; returns how many."""
    import torch

    try:
        import bitsandbytes as bnb
    except ImportError as exc:
        raise Unsupported("QLoRA needs bitsandbytes (pip install bitsandbytes)") from exc
    if device.type != "cuda":
        raise Unsupported("QLoRA runs on a CUDA GPU only")
    targets = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, torch.nn.Linear) and name.split(".")[-1] != "lm_head"
    ]
    for name, old in targets:
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        has_bias = old.bias is not None
        if quant["bits"] == 4:
            new = bnb.nn.Linear4bit(
                old.in_features,
                old.out_features,
                bias=has_bias,
                compute_dtype=compute_dtype,
                compress_statistics=quant["double_quant"],
                quant_type=quant["quant_type"],
                device="meta",
            )
            new.weight = bnb.nn.Params4bit(
                old.weight.data.to("cpu"),
                requires_grad=False,
                compress_statistics=quant["double_quant"],
                quant_type=quant["quant_type"],
                blocksize=quant["blocksize"],
            )
        else:
            new = bnb.nn.Linear8bitLt(
                old.in_features,
                old.out_features,
                bias=has_bias,
                has_fp16_weights=False,
                threshold=6.0,
                device="meta",
            )
            new.weight = bnb.nn.Int8Params(old.weight.data.to("cpu"), requires_grad=False, has_fp16_weights=False)
        if has_bias:
            new.bias = torch.nn.Parameter(old.bias.data.to("cpu"), requires_grad=False)
        setattr(parent, name.rsplit(".", 1)[-1], new.to(device))  # .to(cuda) quantizes
        del old
    return len(targets)


def build_model(spec: dict[str, Any], train: Any, device: Any) -> tuple[Any, dict[str, Any]]:
    """The model on ``device`` with the method and dtypes of ``train`` applied, and notes for the result."""
    import torch
    import transformers

    from vramledger.specs import Method, Precision

    cfg = dict(spec["hf_config"])
    model_type = cfg.pop("model_type")
    cfg.pop("torch_dtype", None)
    cfg.pop("dtype", None)
    config = transformers.AutoConfig.for_model(model_type, **cfg)
    config.use_cache = False

    p = train.precision
    compute = _dtype(p.compute.value) if p is not Precision.FP32 else torch.float32
    trainable_dtype = _dtype(p.trainable.value)
    # Build in the dtype most parameters end in, so that no full-size copy is made in another dtype.
    build_dtype = trainable_dtype if train.method is Method.FULL else compute
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=build_dtype, attn_implementation=train.attn.value
        )
    notes: dict[str, Any] = {"model_class": type(model).__name__}
    if train.method is Method.QLORA:
        notes["quantized_linears"] = _quantize_linears(model, spec["train"]["quant"], compute, device)
    if train.grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    if train.peft_config is not None:  # any PEFT method, from its adapter_config.json (trace/build.py)
        import json

        from vramledger.catalog.inventory import apply_peft_config

        model = apply_peft_config(model, json.loads(train.peft_config), adapter_fp32=train.lora.adapter_fp32)
    elif train.method in (Method.LORA, Method.QLORA):
        import peft

        from vramledger.analytic.target_parameters import peft_names

        lora = train.lora
        targets: Any = "all-linear" if lora.all_linear else list(lora.targets)
        lcfg = peft.LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=targets,
            target_parameters=list(peft_names(lora)) or None,  # analytic/target_parameters.py
            use_dora=lora.dora,
            task_type="CAUSAL_LM",
        )
        model = peft.get_peft_model(model, lcfg, autocast_adapter_dtype=lora.adapter_fp32)
    elif train.method is Method.FREEZE:
        layers = model.model.layers
        n = train.freeze_trainable_layers
        for q in model.parameters():
            q.requires_grad_(False)
        for layer in list(layers)[len(layers) - n :] if n else []:
            for q in layer.parameters():
                q.requires_grad_(True)

    # Dtype rule: trainable params in the trainable dtype (fp32 under AMP; the compute dtype when "true"),
    # frozen ones in the compute dtype; bitsandbytes' packed weights (uint8/int8) are left alone. Under AMP
    # PEFT's autocast_adapter_dtype already upcast the adapters; adapter_fp32=False keeps them in the compute
    # dtype.
    adapters_keep = train.adapters and not train.lora.adapter_fp32
    for name, q in model.named_parameters():
        if not q.is_floating_point():
            continue
        lora_kept = adapters_keep and "lora_" in name
        want = trainable_dtype if q.requires_grad and not lora_kept else compute
        if q.dtype != want:
            q.data = q.data.to(want)
    model.train()
    return model, notes


def build_optimizer(train: Any, params: list[Any]) -> Any:
    """The optimizer the HF Trainer builds (:func:`vramledger.optimizers.trainer_optimizer`)."""
    from vramledger.optimizers import trainer_optimizer

    try:
        return trainer_optimizer(params, train.optimizer, sgd_momentum=train.sgd_momentum)
    except ImportError as exc:
        raise Unsupported(f"optimizer {train.optimizer.value} needs bitsandbytes (pip install bitsandbytes)") from exc


def _tensor_bytes(tensors: Any) -> int:
    import torch

    seen: set[int] = set()
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def _optimizer_state_bytes(opt: Any) -> int:
    return _tensor_bytes(v for state in opt.state.values() for v in state.values())


# -- the trial -----------------------------------------------------------------------------------------------


def _check_supported(train: Any) -> None:
    from vramledger.specs import Loss

    if train.loss is not Loss.STANDARD:
        raise Unsupported(f"loss {train.loss.value} is not run by the harness (transformers' standard loss only)")
    if train.world_size > 1 or train.zero_stage or train.offload_optimizer or train.offload_params:
        raise Unsupported("the harness measures one GPU without ZeRO/FSDP or offload")


@contextmanager
def _phase(probe: Any, readings: dict[str, Any], name: str) -> Iterator[None]:
    probe.begin()  # synchronizes, so the wall time below is the phase's GPU time too
    readings["_current"] = name
    t0 = time.perf_counter()
    yield
    reading = probe.end()
    reading["time_s"] = round(time.perf_counter() - t0, 6)
    readings[name] = reading


class Probe(Protocol):
    """What a trial reads memory through: :class:`CudaProbe` on a GPU, :class:`CountingProbe` in CPU test mode."""

    def begin(self) -> None: ...
    def end(self) -> dict[str, Any]: ...
    def counters(self) -> dict[str, int]: ...


def _open_probe(spec: dict[str, Any], device: Any) -> tuple[Probe, Any]:
    """The probe for ``device`` and the mode the trial runs under (the CPU counter's dispatch mode)."""
    import contextlib

    import torch

    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise Unsupported("no CUDA GPU is visible to the worker")
        return CudaProbe(), contextlib.nullcontext()
    probe = CountingProbe(spec.get("fake_capacity_bytes"))
    return probe, probe.mode


def _load(spec: dict[str, Any], train: Any, device: Any, probe: Probe, result: dict[str, Any]) -> Any:
    """Step 1-3 of the module docstring: the model built, quantized, checkpointed and wrapped; its readings."""
    import torch

    probe.begin()
    model, notes = build_model(spec, train, device)
    if device.type == "cuda":
        if spec.get("snapshot"):
            # Where the recorded stream has this empty_cache, so that a replay can do the same.
            traces = torch.cuda.memory._snapshot()["device_traces"]
            result["empty_cache_at_entry"] = len(traces[torch.cuda.current_device()])
        # Our build leaves transient blocks (the random init, dtype casts, quantization) that a real
        # from_pretrained load, one tensor at a time, does not: drop them from the cache.
        torch.cuda.empty_cache()
    load = probe.end()
    result["notes"] = notes
    result["params"] = sum(q.numel() for q in model.parameters())
    result["trainable_params"] = sum(q.numel() for q in model.parameters() if q.requires_grad)
    result["weights_bytes"] = load["allocated_now"]
    result["load"] = load
    return model


def _inject_fault() -> None:
    """The isolation tests' failures (``VRAMLEDGER_WORKER_FAULT``), after the model is built."""
    import torch

    fault = os.environ.get(FAULT_ENV, "")
    if fault == "crash":
        os.abort()
    if fault == "hang":
        time.sleep(3600)
    if fault == "oom":
        raise torch.OutOfMemoryError("injected by VRAMLEDGER_WORKER_FAULT=oom")


def _autocast(train: Any, device: Any) -> Any:
    """A factory of the forward's autocast context (HF Trainer / Lightning AMP), a no-op without AMP."""
    import contextlib

    import torch

    from vramledger.specs import Precision

    if train.precision not in (Precision.BF16_MIXED, Precision.FP16_MIXED):
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=_dtype(train.precision.compute.value))


def _train_steps(model: Any, train: Any, ids: Any, steps: int, probe: Probe, result: dict[str, Any]) -> None:
    """Step 4: ``steps`` optimizer steps of ``grad_accum`` micro-batches, each phase read on its own."""
    import torch

    from vramledger.specs import Precision
    from vramledger.trace.step import padding_mask

    params = [q for q in model.parameters() if q.requires_grad]
    if not params:
        raise Unsupported("nothing to train: no parameter requires a gradient")
    opt = build_optimizer(train, params)
    scaler = torch.amp.GradScaler(ids.device.type) if train.precision is Precision.FP16_MIXED else None
    # The batch the trace and the estimate price (trace/step.py padding_mask): a padded batch's worst case, every
    # row full but the last, which ends in one pad token; packed (or one row) gets no mask.
    mask = padding_mask(train, ids)
    masked = {} if mask is None else {"attention_mask": mask}
    labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
    autocast = _autocast(train, ids.device)
    for step in range(steps):
        readings: dict[str, Any] = {}
        result["phase"] = "forward"
        for micro in range(train.grad_accum):
            with _phase(probe, readings, f"forward.{micro}"), autocast():
                # Keep only the loss, as Trainer.training_step does: the logits die with the outputs.
                loss = model(input_ids=ids, labels=labels, **masked).loss / train.grad_accum
            result["phase"] = "backward"
            with _phase(probe, readings, f"backward.{micro}"):
                (scaler.scale(loss) if scaler else loss).backward()
                del loss
        result["phase"] = "optimizer"
        with _phase(probe, readings, "optimizer"):
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            if step == 0:
                result["gradients_bytes"] = _tensor_bytes(q.grad for q in params)
            opt.zero_grad(set_to_none=True)
        readings.pop("_current", None)
        result["steps"].append(readings)
    result["optimizer_state_bytes"] = _optimizer_state_bytes(opt)


def _evaluate(model: Any, train: Any, ids: Any, probe: Probe, result: dict[str, Any], extra: dict[str, Any]) -> None:
    """Step 5a: one evaluation batch under ``no_grad``, its logits kept as the Trainer's eval loop keeps them."""
    import torch

    result["phase"] = "eval"
    model.eval()
    eval_ids = ids.new_zeros((train.eval_batch, train.eval_seq_len or train.seq_len))
    with _phase(probe, extra, "eval"), torch.no_grad(), _autocast(train, ids.device)():
        out = model(input_ids=eval_ids, labels=eval_ids)
        kept = (out.loss, out.logits)  # the Trainer's prediction_step returns both
        del out, kept
    model.train()


def _generate(model: Any, train: Any, ids: Any, probe: Probe, result: dict[str, Any], extra: dict[str, Any]) -> None:
    """Step 5b: greedy ``generate`` with the KV cache, exactly ``generation_max_new_tokens`` new tokens."""
    import torch

    result["phase"] = "generate"
    model.eval()
    n_new = train.generation_max_new_tokens or 128
    prompt = ids.new_zeros((train.eval_batch or train.micro_batch, train.eval_seq_len or train.seq_len))
    with _phase(probe, extra, "generate"), torch.no_grad(), _autocast(train, ids.device)():
        model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=n_new,
            min_new_tokens=n_new,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
        )
    model.train()


def _close(spec: dict[str, Any], device: Any, probe: Probe, result: dict[str, Any], t0: float) -> None:
    """What every trial reports however it ended: wall time, counters, the allocator's stats, the snapshot."""
    import torch

    result["wall_s"] = round(time.perf_counter() - t0, 3)
    result["counters"] = probe.counters()
    if device.type != "cuda":
        return
    result["memory_stats"] = dict(torch.cuda.memory_stats())
    snapshot = spec.get("snapshot")
    if snapshot:
        try:
            torch.cuda.memory._dump_snapshot(snapshot)
            result["snapshot"] = snapshot
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)


def run_trial(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one trial in this process and return its result mapping (the steps of the module docstring)."""
    import torch

    from vramledger.measure.serial import train_from_dict

    train = train_from_dict(spec["train"])
    device = torch.device(spec.get("device", "cuda"))
    result: dict[str, Any] = {"status": "running", "phase": "load", "steps": []}
    _check_supported(train)
    torch.manual_seed(int(spec.get("seed", 0)))
    probe, mode = _open_probe(spec, device)
    result["probe"] = "cuda" if device.type == "cuda" else "cpu-counter"
    if spec.get("snapshot") and device.type == "cuda":
        # From before the build, so that the recorded stream replays from an empty allocator. Context "all"
        # keeps the Python and C++ stacks of every event for memory_viz; None records the events alone
        # (action, address, size, stream), which is what an allocator replay needs, at a fraction of the cost.
        torch.cuda.memory._record_memory_history(
            max_entries=int(spec.get("history_entries", 1_000_000)), context=spec.get("history_context", "all")
        )
    t0 = time.perf_counter()
    with mode:
        try:
            model = _load(spec, train, device, probe, result)
            _inject_fault()
            vocab = int(spec["hf_config"].get("vocab_size") or 32000)
            gen = torch.Generator(device=device).manual_seed(int(spec.get("seed", 0)))
            ids = torch.randint(0, vocab, (train.micro_batch, train.seq_len), device=device, generator=gen)
            _train_steps(model, train, ids, int(spec.get("steps", 3)), probe, result)
            extra: dict[str, Any] = {}
            if train.eval_batch:
                _evaluate(model, train, ids, probe, result, extra)
            if train.predict_with_generate or train.generation_max_new_tokens:
                _generate(model, train, ids, probe, result, extra)
            extra.pop("_current", None)
            result["extra_phases"] = extra
            result["status"] = "ok"
        except Unsupported:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes a result, the OOM ones marked
            oom = isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()
            result["status"] = "oom" if oom else "error"
            result["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            if not oom:
                result["traceback"] = traceback.format_exc()[-4000:]
        finally:
            _close(spec, device, probe, result, t0)
    result["phases"] = summarize(result)
    return result


def summarize(result: dict[str, Any]) -> dict[str, dict[str, int | None]]:
    """Per phase, the highest reading over every step and micro-batch (peak allocated, reserved, device)."""
    out: dict[str, dict[str, int | None]] = {}
    if "load" in result:
        load = result["load"]
        # The load phase is reported settled (weights resident), not at the transient peak of our build.
        out["load"] = {
            "allocated": load["allocated_now"],
            "reserved": load["reserved_now"],
            "device": None if load["context"] is None else load["reserved_now"] + load["context"],
            "context": load["context"],
        }
    readings = [r for step in result.get("steps", []) for r in step.items()]
    readings += list(result.get("extra_phases", {}).items())
    for key, r in readings:
        phase = key.split(".")[0]
        cur = out.setdefault(phase, {"allocated": 0, "reserved": 0, "device": None, "context": None})
        cur["allocated"] = max(int(cur["allocated"] or 0), r["allocated"])
        cur["reserved"] = max(int(cur["reserved"] or 0), r["reserved"])
        if r["device"] is not None:
            cur["device"] = max(int(cur["device"] or 0), r["device"])
            cur["context"] = max(int(cur["context"] or 0), r["context"])
    return out


def _environment(spec: dict[str, Any]) -> dict[str, Any]:
    from vramledger.measure import env

    info: dict[str, Any] = {"versions": env.versions()}
    if spec.get("device", "cuda") == "cuda":
        info.update(env.cuda_device_facts())
    return info


def main() -> int:
    # Our result goes to the real stdout; anything a library prints goes to stderr.
    result_fd = os.dup(1)
    os.dup2(2, 1)
    spec: dict[str, Any] = {}
    try:
        spec = json.loads(sys.stdin.read())
        result = {"status": "ok", "phases": {}} if spec.get("probe_only") else run_trial(spec)
    except Unsupported as exc:
        result = {"status": "unsupported", "error": str(exc)}
    except Exception as exc:  # noqa: BLE001 - a bad spec or a failed import is still a result
        result = {
            "status": "error",
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
        }
    try:
        result["environment"] = _environment(spec)
    except Exception as exc:  # noqa: BLE001
        result["environment"] = {"error": f"{type(exc).__name__}: {exc}"}
    with os.fdopen(result_fd, "w") as out:
        out.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
