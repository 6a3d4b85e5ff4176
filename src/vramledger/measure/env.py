"""What the GPU and its software are: NVML (pynvml) first, ``nvidia-smi`` second, nothing when neither works.

Runs inside the worker. Device memory in use is read for the whole device, so the worker reads it once before
CUDA starts (the baseline: other processes and the driver) and subtracts it.
"""

from __future__ import annotations

import importlib.metadata
import platform
import shutil
import subprocess
from typing import Any

_MIB = 2**20


def _norm_uuid(uuid: str) -> str:
    """NVML and nvidia-smi write ``GPU-58b5d47b-…``; torch writes ``58b5d47b-…``: compare the hex part."""
    uuid = uuid.strip().lower()
    return uuid[4:] if uuid.startswith("gpu-") else uuid


def gpu_table() -> list[dict[str, Any]]:
    """One row per visible NVIDIA device: uuid, name, used_bytes, total_bytes, driver, source."""
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        try:
            driver = pynvml.nvmlSystemGetDriverVersion()
            rows = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                uuid = pynvml.nvmlDeviceGetUUID(h)
                name = pynvml.nvmlDeviceGetName(h)
                rows.append(
                    {
                        "uuid": _norm_uuid(uuid.decode() if isinstance(uuid, bytes) else uuid),
                        "name": name.decode() if isinstance(name, bytes) else name,
                        "used_bytes": int(mem.used),
                        "total_bytes": int(mem.total),
                        "driver": driver.decode() if isinstance(driver, bytes) else driver,
                        "source": "nvml",
                    }
                )
            return rows
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no pynvml, no driver: fall through to nvidia-smi
        pass
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=uuid,name,memory.used,memory.total,driver_version",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    rows = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5:
            continue
        try:
            rows.append(
                {
                    "uuid": _norm_uuid(parts[0]),
                    "name": parts[1],
                    "used_bytes": int(float(parts[2]) * _MIB),  # nvidia-smi reports MiB
                    "total_bytes": int(float(parts[3]) * _MIB),
                    "driver": parts[4],
                    "source": "nvidia-smi",
                }
            )
        except ValueError:
            continue
    return rows


def torch_uuid(device_index: int = 0) -> str | None:
    """The UUID of a torch device, in :func:`_norm_uuid` form (None when torch does not expose it)."""
    import torch

    uuid = getattr(torch.cuda.get_device_properties(device_index), "uuid", None)
    return _norm_uuid(str(uuid)) if uuid else None


def row_for(rows: list[dict[str, Any]], uuid: str | None) -> dict[str, Any] | None:
    """The table row of one device: matched by UUID, or the only row when there is one."""
    if uuid is not None:
        for row in rows:
            if row["uuid"] == uuid:
                return row
    return rows[0] if len(rows) == 1 else None


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, Any]:
    """Software versions that move the numbers (torch and CUDA first)."""
    import torch

    from vramledger._version import __version__

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "transformers": package_version("transformers"),
        "peft": package_version("peft"),
        "bitsandbytes": package_version("bitsandbytes"),
        "vramledger": __version__,
    }


def cuda_device_facts() -> dict[str, Any]:
    """The current CUDA device as a measurement record names it: GPU, its memory (torch and NVML), the driver
    and where the NVML figures came from; empty without a visible GPU. Creates the CUDA context."""
    import torch

    if not torch.cuda.is_available():
        return {}
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    info: dict[str, Any] = {"gpu": props.name, "gpu_total_bytes": int(props.total_memory)}
    row = row_for(gpu_table(), torch_uuid(torch.cuda.current_device()))
    if row is not None:
        info["driver"] = row["driver"]
        info["nvml_total_bytes"] = row["total_bytes"]
        info["nvml_source"] = row["source"]
    return info
