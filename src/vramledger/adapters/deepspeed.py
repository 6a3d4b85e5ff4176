"""A DeepSpeed JSON config → ZeRO stage, offload, precision, batch (and world size where the batch sizes give it).

``"auto"`` values are resolved as transformers' ``integrations/deepspeed.py`` ``HfTrainerDeepSpeedConfig`` does:
``trainer_config_process`` fills micro batch, accumulation and bf16/fp16 from TrainingArguments and refuses explicit
values that disagree with them (``fill_match``); ``trainer_config_finalize`` fills the hidden-size based buckets:
``reduce_bucket_size = hidden²``, ``stage3_prefetch_bucket_size = 0.9·hidden²``,
``stage3_param_persistence_threshold = 10·hidden``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vramledger.adapters._base import Reader, as_int
from vramledger.adapters.hf import TrainerFlags
from vramledger.errors import VramledgerError
from vramledger.specs import Optimizer, Precision, ZeroBuffers

HF_DS = "transformers integrations/deepspeed.py HfTrainerDeepSpeedConfig"
DS_ZERO = "deepspeed runtime/zero/config.py DeepSpeedZeroConfig"

# DeepSpeed's defaults for the buffers that take device memory (deepspeed runtime/zero/config.py
# DeepSpeedZeroConfig: reduce_bucket_size, allgather_bucket_size, prefetch_bucket_size, max_live_parameters,
# max_reuse_distance, param_persistence_threshold, sub_group_size).
BUCKET_DEFAULTS: dict[str, int] = {
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "sub_group_size": 1_000_000_000,
}
# Stage-3 keys may also be written without the ``stage3_`` prefix (DeepSpeedZeroConfig field aliases).
_ALIASES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
}
# "auto" bucket sizes as multiples of hidden² or hidden (trainer_config_finalize).
_AUTO_BUCKETS = {
    "reduce_bucket_size": ("hidden²", lambda h: h * h),
    "stage3_prefetch_bucket_size": ("0.9·hidden²", lambda h: int(0.9 * h * h)),
    "stage3_param_persistence_threshold": ("10·hidden", lambda h: 10 * h),
}

_HARMLESS_TOP = frozenset(
    [
        "gradient_clipping",
        "steps_per_print",
        "wall_clock_breakdown",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "scheduler",
        "prescale_gradients",
        "gradient_predivide_factor",
        "comms_logger",
        "tensorboard",
        "wandb",
        "csv_monitor",
        "flops_profiler",
        "dump_state",
        "memory_breakdown",
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "fp16",
        "bf16",
        "zero_optimization",
        "optimizer",
        "checkpoint",
    ]
)
_HARMLESS_ZERO = frozenset(
    [
        "stage",
        "offload_optimizer",
        "offload_param",
        "round_robin_gradients",
        "reduce_scatter",
        "allgather_partitions",
        "load_from_fp32_weights",
        "elastic_checkpoint",
        "ignore_unused_parameters",
        "legacy_stage1",
        "cpu_offload",
    ]
)


@dataclass(frozen=True, kw_only=True, slots=True)
class DeepSpeedConfig:
    """The resolved ZeRO settings, including those TrainSpec does not model (the communication buffers)."""

    stage: int = 0
    offload_optimizer: str = "none"
    """``none``, ``cpu`` or ``nvme``."""
    offload_param: str = "none"
    buckets: dict[str, int] | None = None
    """Bucket sizes in elements (resolved; DeepSpeed's defaults where absent)."""
    source: str = ""


# Top-level DeepSpeed sections that can change memory but are not modelled: each present one earns a warning.
_UNMODELLED_TOP = (
    "activation_checkpointing",
    "data_types",
    "communication_data_type",
    "tensor_parallel",
    "sequence_parallel_size",
    "pipeline",
    "compression_training",
    "amp",
    "torch_autocast",
)


def _device(r: Reader, node: Any, key: str) -> str:
    if node is None:
        return "none"
    if not isinstance(node, dict):
        raise VramledgerError(f"{r.source}: zero_optimization.{key} must be a mapping with a device (got {node!r})")
    dev = str(node.get("device", "none")).lower()
    if dev not in ("none", "cpu", "nvme"):
        raise VramledgerError(f"{r.source}: zero_optimization.{key}.device must be none, cpu or nvme (got {dev!r})")
    for sub, value in node.items():
        if sub != "device" and dev != "none":
            r.warn(f"ignored: deepspeed {key}.{sub}={value} (not modelled)")
    return dev


def _is_auto(v: Any) -> bool:
    return isinstance(v, str) and v.strip().lower() == "auto"


def _enabled(r: Reader, section: str) -> bool | str | None:
    node = r.raw.get(section)
    if node is None:
        return None
    if not isinstance(node, dict):
        raise VramledgerError(f'{r.source}: {section} must be a mapping like {{"enabled": true}} (got {node!r})')
    v = node.get("enabled", False)
    if _is_auto(v):
        return "auto"
    if isinstance(v, bool):
        return v
    raise VramledgerError(f'{r.source}: {section}.enabled must be true, false or "auto" (got {v!r})')


def read(
    r: Reader,
    *,
    trainer: TrainerFlags | None,
    micro_batch: int | None,
    grad_accum: int | None,
    hidden_size: int | None,
) -> DeepSpeedConfig:
    """Map a DeepSpeed config (already read into ``r``) onto TrainSpec fields recorded on ``r``."""
    zero = r.raw.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise VramledgerError(f"{r.source}: zero_optimization must be a mapping (got {zero!r})")
    stage = _stage(r, zero)
    off_opt, off_par = _offload(r, zero, stage)
    buckets = _buffers(r, zero, stage, hidden_size)
    _precision(r, trainer)
    _batch(r, trainer, micro_batch, grad_accum)
    _optimizer(r)
    for key in _UNMODELLED_TOP:
        if r.raw.get(key) is not None:
            r.warn(f"ignored: deepspeed {key} (not modelled)")
    for key in r.raw:
        if key not in _HARMLESS_TOP and r.raw[key] is not None and key not in _UNMODELLED_TOP:
            r.warn(f"ignored: deepspeed {key} (not a DeepSpeed setting vramledger knows)")
    return DeepSpeedConfig(
        stage=stage, offload_optimizer=off_opt, offload_param=off_par, buckets=buckets, source=r.source
    )


def _stage(r: Reader, zero: dict[str, Any]) -> int:
    stage = as_int(zero.get("stage", 0))
    if stage is None or stage not in (0, 1, 2, 3):
        raise VramledgerError(f"{r.source}: zero_optimization.stage must be 0, 1, 2 or 3 (got {zero.get('stage')!r})")
    r.set(
        "zero_stage",
        stage,
        f"file: {r.source} zero_optimization.stage" if "stage" in zero else f"default: deepspeed ({DS_ZERO} stage=0)",
    )
    return stage


def _offload(r: Reader, zero: dict[str, Any], stage: int) -> tuple[str, str]:
    """The devices the optimizer states and the parameters are offloaded to (``none``, ``cpu``, ``nvme``)."""
    src = r.source
    off_opt = _device(r, zero.get("offload_optimizer"), "offload_optimizer")
    off_par = _device(r, zero.get("offload_param"), "offload_param")
    if zero.get("cpu_offload") is True:  # the pre-0.5 spelling of offload_optimizer.device=cpu
        off_opt = "cpu"
    if off_opt != "none":
        r.set("offload_optimizer", True, f"file: {src} zero_optimization.offload_optimizer.device={off_opt}")
    if off_par != "none":
        if stage != 3:
            r.warn(
                f"ignored: deepspeed offload_param (DeepSpeed offloads parameters only with ZeRO-3; stage is {stage})"
            )
        else:
            r.set("offload_params", True, f"file: {src} zero_optimization.offload_param.device={off_par}")
    for dev, what in ((off_opt, "optimizer"), (off_par, "param")):
        if dev == "nvme":
            r.warn(f"deepspeed offload_{what} to nvme: modelled as CPU offload (device memory is the same)")
    return off_opt, off_par


def _buffers(r: Reader, zero: dict[str, Any], stage: int, hidden_size: int | None) -> dict[str, int]:
    """ZeRO's bucket sizes and switches: resolved, reported, not modelled."""
    src = r.source
    buckets: dict[str, int] = {}
    switches: dict[str, bool] = {}
    shown_keys: dict[str, str] = {}
    for raw_key, value in zero.items():
        key = _ALIASES.get(raw_key, raw_key)
        if key in BUCKET_DEFAULTS:
            shown = _bucket(r, raw_key, key, value, hidden_size, buckets, switches)
            if key.startswith("stage3_") and stage != 3:
                continue
            shown_keys[key] = f"file: {src} zero_optimization.{raw_key} ({shown} elements)"
        elif key == "stage3_gather_16bit_weights_on_model_save":
            if value is True and stage == 3:
                r.warn(
                    "ignored: deepspeed stage3_gather_16bit_weights_on_model_save (gathers the full 16-bit "
                    "model at each save; that spike is not modelled)"
                )
        elif key in ("overlap_comm", "contiguous_gradients"):
            if not isinstance(value, bool):
                raise VramledgerError(f"{src}: zero_optimization.{raw_key} must be true or false (got {value!r})")
            switches[key] = value
            shown_keys[key] = f"file: {src} zero_optimization.{raw_key}={str(value).lower()}"
        elif key not in _HARMLESS_ZERO:
            r.warn(f"ignored: deepspeed zero_optimization.{raw_key}={value} (not modelled)")
    for key, default in BUCKET_DEFAULTS.items():
        buckets.setdefault(key, default)
    if stage and shown_keys:  # None stands for DeepSpeed's defaults
        r.set("zero_buffers", zero_buffers(buckets, switches), "; ".join(shown_keys.values()))
    return buckets


def _bucket(
    r: Reader,
    raw_key: str,
    key: str,
    value: Any,
    hidden_size: int | None,
    buckets: dict[str, int],
    switches: dict[str, bool],
) -> str:
    """One bucket size into ``buckets`` (``"auto"`` resolved from the hidden size when known); returns it as
    shown in the provenance."""
    if not _is_auto(value):
        n = as_int(value)
        if n is None or n < 0:
            raise VramledgerError(
                f"{r.source}: zero_optimization.{raw_key} must be a number of elements (got {value!r})"
            )
        buckets[key] = n
        return f"{n:,}"
    if key not in _AUTO_BUCKETS:
        raise VramledgerError(f'{r.source}: zero_optimization.{raw_key} cannot be "auto"; give a number')
    formula, fn = _AUTO_BUCKETS[key]
    if hidden_size:
        buckets[key] = fn(hidden_size)
        return f"auto = {formula} = {buckets[key]:,}"
    switches[f"auto:{key}"] = True
    return f"auto = {formula}"


def _precision(r: Reader, trainer: TrainerFlags | None) -> None:
    src = r.source
    bf16, fp16 = _enabled(r, "bf16"), _enabled(r, "fp16")
    if trainer is not None:
        for section, ds_val, hf_val in (("bf16", bf16, trainer.bf16), ("fp16", fp16, trainer.fp16)):
            if isinstance(ds_val, bool) and ds_val != hf_val:
                raise VramledgerError(
                    f"{src}: {section}.enabled={str(ds_val).lower()} but the training config has {section}="
                    f'{str(hf_val).lower()}; set one to match or use "auto" ({HF_DS}.fill_match refuses this)'
                )
    elif bf16 is True:
        r.set("precision", Precision.BF16_MIXED, f"file: {src} bf16.enabled")
    elif fp16 is True:
        r.set("precision", Precision.FP16_MIXED, f"file: {src} fp16.enabled")


def _batch(r: Reader, trainer: TrainerFlags | None, micro_batch: int | None, grad_accum: int | None) -> None:
    """Micro-batch and accumulation (``auto`` takes the training config's), and the GPU count that
    ``train_batch_size`` implies."""
    src = r.source
    mb = _batch_value(
        r,
        "train_micro_batch_size_per_gpu",
        micro_batch,
        "per_device_train_batch_size",
        "micro_batch",
        trainer is not None,
    )
    ga = _batch_value(
        r,
        "gradient_accumulation_steps",
        grad_accum,
        "gradient_accumulation_steps",
        "grad_accum",
        trainer is not None,
    )
    tbs = r.raw.get("train_batch_size")
    if tbs is not None and not _is_auto(tbs):
        n = as_int(tbs)
        if n is None or n < 1:
            raise VramledgerError(f'{src}: train_batch_size must be a positive integer or "auto" (got {tbs!r})')
        if mb and ga:
            if n % (mb * ga):
                raise VramledgerError(
                    f"{src}: train_batch_size={n} is not micro batch ({mb}) × accumulation ({ga}) × GPUs; fix it "
                    'or use "auto"'
                )
            r.set("world_size", n // (mb * ga), f"file: {src} train_batch_size / (micro batch × accumulation)")


def _optimizer(r: Reader) -> None:
    opt = r.raw.get("optimizer")
    if opt is None:
        return
    kind = str(opt.get("type", "")) if isinstance(opt, dict) else ""
    if kind.lower() in ("adam", "adamw", "fusedadam"):
        # DeepSpeed builds FusedAdam (or DeepSpeedCPUAdam when offloading): one multi-tensor kernel.
        r.set("optimizer", Optimizer.ADAMW_FUSED, f"file: {r.source} optimizer.type={kind}")
    else:
        r.warn(
            f"ignored: deepspeed optimizer.type={kind or opt!r} (only Adam/AdamW are modelled; the "
            "training config's optimizer is used)"
        )


def zero_buffers(buckets: dict[str, int], switches: dict[str, bool]) -> ZeroBuffers:
    """The resolved buckets as the spec's ``ZeroBuffers`` (the analytic model's input)."""
    return ZeroBuffers(
        reduce_bucket_size=buckets["reduce_bucket_size"],
        allgather_bucket_size=buckets["allgather_bucket_size"],
        prefetch_bucket_size=buckets["stage3_prefetch_bucket_size"],
        max_live_parameters=buckets["stage3_max_live_parameters"],
        param_persistence_threshold=buckets["stage3_param_persistence_threshold"],
        overlap_comm=switches.get("overlap_comm"),
        contiguous_gradients=switches.get("contiguous_gradients", True),
        auto=tuple(sorted(k.removeprefix("auto:") for k in switches if k.startswith("auto:"))),
    )


def _batch_value(
    r: Reader, ds_key: str, hf_value: int | None, hf_key: str, field: str, has_trainer: bool
) -> int | None:
    v = r.raw.get(ds_key)
    if v is None or _is_auto(v):
        return hf_value
    n = as_int(v)
    if n is None or n < 1:
        raise VramledgerError(f'{r.source}: {ds_key} must be a positive integer or "auto" (got {v!r})')
    if has_trainer:
        if hf_value is not None and n != hf_value:
            raise VramledgerError(
                f"{r.source}: {ds_key}={n} but the training config has {hf_key}={hf_value}; make them match or use "
                f'"auto" ({HF_DS}.fill_match refuses this)'
            )
        return n
    r.set(field, n, f"file: {r.source} {ds_key}")
    return n
