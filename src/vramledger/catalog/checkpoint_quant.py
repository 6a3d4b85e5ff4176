"""A pre-quantised checkpoint's storage, read from its config.json ``quantization_config``.

Its own module because both readers of a config need it: ``hfconfig`` (families with formulas) and
``inventory`` (any architecture, built on the meta device), and ``hfconfig`` hands the second kind to
``inventory``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vramledger.errors import VramledgerError
from vramledger.specs.model import CheckpointQuant

# quantization_config.quant_method values and the storage they load as (transformers quantizers/auto.py names).
_CHECKPOINT_METHODS = {"gptq": "gptq", "awq": "awq", "fp8": "fp8", "mxfp4": "mxfp4"}


def checkpoint_quant(cfg: Mapping[str, Any], where: str) -> CheckpointQuant | None:
    """The storage of a pre-quantised checkpoint from its ``quantization_config`` (None for bitsandbytes, which
    quantises at load time and is chosen with --method qlora / --quant, and for unquantised checkpoints)."""
    q = cfg.get("quantization_config")
    if not isinstance(q, Mapping):
        return None
    method = str(q.get("quant_method", "")).lower()
    if method == "bitsandbytes":
        return None
    if method not in _CHECKPOINT_METHODS:
        raise VramledgerError(
            f"{where}: quantization_config.quant_method {method!r} is not modelled; modelled: gptq, awq, fp8, "
            "mxfp4 (and bitsandbytes via --method qlora)"
        )
    block = q.get("weight_block_size")
    return CheckpointQuant(
        method=method,
        bits=int(q.get("bits", q.get("w_bit", 4)) or 4),
        group_size=int(q.get("group_size", q.get("q_group_size", 128)) or 128),
        block=(int(block[0]), int(block[1])) if isinstance(block, list) and len(block) == 2 else None,
        skip=tuple(str(x) for x in (q.get("modules_to_not_convert") or ())),
    )
