"""An accelerate config YAML (FSDP, DeepSpeed or plain multi-GPU), and the HF Trainer's ``fsdp``/``fsdp_config``
keys → sharding stage, offload, checkpointing and world size.

FSDP sharding maps onto ``TrainSpec.fsdp`` (``specs/distributed.py`` ``Sharding``): ``FULL_SHARD`` shards
parameters, gradients and optimizer states; ``SHARD_GRAD_OP`` keeps parameters whole between forward and backward;
``NO_SHARD`` is DDP; FSDP2's ``reshard_after_forward=True/False`` is FULL_SHARD/SHARD_GRAD_OP. Defaults are
accelerate 1.15's (``utils/dataclasses.py`` ``FullyShardedDataParallelPlugin``:
``sharding_strategy='FULL_SHARD'``, ``reshard_after_forward=True`` for ``fsdp_version=2``).
"""

from __future__ import annotations

from typing import Any

from vramledger.adapters._base import Reader, as_int
from vramledger.errors import VramledgerError
from vramledger.specs import Precision, Sharding

ACC = "accelerate utils/dataclasses.py FullyShardedDataParallelPlugin"

_STAGE = {
    "FULL_SHARD": Sharding.FULL_SHARD,
    "SHARD_GRAD_OP": Sharding.SHARD_GRAD_OP,
    "NO_SHARD": Sharding.NO_SHARD,
    "HYBRID_SHARD": Sharding.HYBRID_SHARD,
    "HYBRID_SHARD_ZERO2": Sharding.SHARD_GRAD_OP,
}
_HARMLESS_FSDP = frozenset(
    [
        "auto_wrap_policy",
        "transformer_layer_cls_to_wrap",
        "min_num_params",
        "backward_prefetch",
        "forward_prefetch",
        "state_dict_type",
        "sync_module_states",
        "use_orig_params",
        "cpu_ram_efficient_loading",
        "limit_all_gathers",
        "version",
        "sharding_strategy",
        "reshard_after_forward",
        "offload_params",
        "activation_checkpointing",
    ]
)
_HARMLESS_ACCELERATE = frozenset(
    [
        "compute_environment",
        "debug",
        "distributed_type",
        "downcast_bf16",
        "machine_rank",
        "main_training_function",
        "main_process_ip",
        "main_process_port",
        "rdzv_backend",
        "same_network",
        "tpu_env",
        "tpu_use_cluster",
        "tpu_use_sudo",
        "use_cpu",
        "num_machines",
        "num_processes",
        "mixed_precision",
        "fsdp_config",
        "deepspeed_config",
        "gpu_ids",
        "enable_cpu_affinity",
        "dynamo_config",
        "megatron_lm_config",
        "ipex_config",
        "mpirun_config",
    ]
)


def _strip(cfg: dict[str, Any]) -> dict[str, Any]:
    """accelerate writes ``fsdp_`` prefixed keys; the HF Trainer accepts both spellings (TrainingArguments
    ``fsdp_config`` handling strips ``fsdp_``)."""
    return {(k[5:] if k.startswith("fsdp_") else k): v for k, v in cfg.items()}


def apply_fsdp_config(r: Reader, cfg: dict[str, Any], *, where: str, strategy_words: tuple[str, ...] = ()) -> None:
    """Map one FSDP config mapping (accelerate's ``fsdp_config`` or the Trainer's) onto ``r``."""
    c = _strip(cfg)
    version = as_int(c.get("version") or 1)
    if version not in (1, 2):
        raise VramledgerError(f"{r.source}: fsdp_version must be 1 or 2 (got {c.get('version')!r})")
    stage: Sharding | None = None
    how = ""
    words = [w.upper() for w in strategy_words]
    named = next((w for w in words if w in _STAGE), None)
    if version == 2 and "reshard_after_forward" in c:
        v = c["reshard_after_forward"]
        if not isinstance(v, bool):
            raise VramledgerError(f"{r.source}: fsdp_reshard_after_forward must be true or false (got {v!r})")
        stage = Sharding.FULL_SHARD if v else Sharding.SHARD_GRAD_OP
        how = f"file: {where}fsdp_reshard_after_forward={str(v).lower()}"
    elif "sharding_strategy" in c:
        s = c["sharding_strategy"]
        key = _STAGE_BY_NUMBER.get(as_int(s) or -1) if as_int(s) is not None else str(s).upper()
        if key not in _STAGE:
            raise VramledgerError(f"{r.source}: fsdp_sharding_strategy must be one of {', '.join(_STAGE)} (got {s!r})")
        stage, how = _STAGE[key], f"file: {where}fsdp_sharding_strategy={key}"
        if key == "HYBRID_SHARD_ZERO2":
            r.warn(f"fsdp {key}: modelled as SHARD_GRAD_OP within a node (gpus_per_node)")
    elif named is not None:
        stage, how = _STAGE[named], f"file: fsdp={named.lower()}"
    else:
        stage, how = (
            Sharding.FULL_SHARD,
            f"default: accelerate ({ACC} sharding_strategy=FULL_SHARD / reshard_after_forward=True)",
        )
    r.set("fsdp", stage, how)
    r.set(
        "fsdp_version",
        version,
        f"file: {where}fsdp_version" if c.get("version") else f"default: accelerate ({ACC} fsdp_version=1)",
    )
    offload = c.get("offload_params")
    if offload is True or str(offload).lower() == "true" or "OFFLOAD" in words:
        # CPUOffload(offload_params=True) keeps parameters and gradients on the CPU; the optimizer steps there.
        r.set("offload_params", True, f"file: {where}fsdp_offload_params")
        r.set("offload_optimizer", True, f"file: {where}fsdp_offload_params (the optimizer steps on the CPU)")
    ac = c.get("activation_checkpointing")
    if ac is True or str(ac).lower() == "true":
        r.set("grad_ckpt", True, f"file: {where}fsdp_activation_checkpointing")
    for key, value in c.items():
        if key not in _HARMLESS_FSDP and value is not None:
            r.warn(f"ignored: {where}fsdp_{key}={value} (not modelled)")


_STAGE_BY_NUMBER = {i + 1: name for i, name in enumerate(_STAGE)}


def read_trainer_fsdp(r: Reader, fsdp: Any, fsdp_config: dict[str, Any] | None) -> None:
    """The HF Trainer's ``fsdp: "full_shard auto_wrap offload"`` (a string or list) and ``fsdp_config``."""
    if fsdp in (None, False, "", []):
        return
    if isinstance(fsdp, str):
        words = tuple(fsdp.split())
    elif isinstance(fsdp, list) and all(isinstance(w, str) for w in fsdp):
        words = tuple(fsdp)
    elif fsdp is True:
        words = ("full_shard",)
    else:
        raise VramledgerError(f"{r.source}: fsdp must be a string like 'full_shard auto_wrap' (got {fsdp!r})")
    apply_fsdp_config(r, fsdp_config or {}, where="fsdp_config.", strategy_words=words)


def read_accelerate(r: Reader) -> None:
    """An ``accelerate config`` YAML: distributed type, processes, mixed precision, and its FSDP/DeepSpeed part."""
    dist = str(r.raw.get("distributed_type", "NO")).upper()
    n = as_int(r.raw.get("num_processes", 1))
    if n is None or n < 1:
        raise VramledgerError(
            f"{r.source}: num_processes must be a positive integer (got {r.raw.get('num_processes')!r})"
        )
    if dist in ("FSDP", "DEEPSPEED", "MULTI_GPU") or n > 1:
        # num_processes counts the GPUs of all machines (accelerate's config: "the number of GPUs in all nodes").
        r.set("world_size", n, f"file: {r.source} num_processes")
    mp = str(r.raw.get("mixed_precision", "no")).lower()
    r.extras["mixed_precision"] = {
        "bf16": Precision.BF16_MIXED,
        "fp16": Precision.FP16_MIXED,
        "no": Precision.FP32,
    }.get(mp)
    if mp == "fp8":
        r.warn(f"ignored: mixed_precision=fp8 ({r.source}; fp8 training is not modelled)")
    if dist == "FSDP":
        cfg = r.raw.get("fsdp_config") or {}
        if not isinstance(cfg, dict):
            raise VramledgerError(f"{r.source}: fsdp_config must be a mapping (got {cfg!r})")
        apply_fsdp_config(r, cfg, where=f"{r.source} ")
    elif dist == "DEEPSPEED":
        cfg = r.raw.get("deepspeed_config") or {}
        if not isinstance(cfg, dict):
            raise VramledgerError(f"{r.source}: deepspeed_config must be a mapping (got {cfg!r})")
        r.extras["deepspeed_file"] = cfg.get("deepspeed_config_file")
        stage = as_int(cfg.get("zero_stage", 2))
        if stage not in (0, 1, 2, 3):
            raise VramledgerError(
                f"{r.source}: deepspeed_config.zero_stage must be 0-3 (got {cfg.get('zero_stage')!r})"
            )
        if "deepspeed_config_file" not in cfg:
            r.set("zero_stage", stage, f"file: {r.source} deepspeed_config.zero_stage")
            for key, field in (
                ("offload_optimizer_device", "offload_optimizer"),
                ("offload_param_device", "offload_params"),
            ):
                dev = str(cfg.get(key, "none")).lower()
                if dev in ("cpu", "nvme"):
                    r.set(field, True, f"file: {r.source} deepspeed_config.{key}={dev}")
    elif dist not in ("NO", "MULTI_GPU"):
        r.warn(f"ignored: distributed_type={dist} ({r.source}; only FSDP, DeepSpeed and multi-GPU DDP are modelled)")
    for key in r.raw:
        if key not in _HARMLESS_ACCELERATE and r.raw[key] is not None:
            r.warn(f"ignored: {key} ({r.source}; not an accelerate setting vramledger knows)")
