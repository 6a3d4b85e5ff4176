"""What the user asks about: the model, the training setup and the GPU, as frozen validated dataclasses."""

from vramledger.specs.cache import CacheKind
from vramledger.specs.distributed import Sharding, ZeroBuffers
from vramledger.specs.framework import ModelCode
from vramledger.specs.gpu import DEFAULT_HEADROOM, GPUSpec, check_headroom
from vramledger.specs.load import LoadPath
from vramledger.specs.model import ModelSpec
from vramledger.specs.train import (
    Attention,
    DType,
    EvalLogits,
    LoraSpec,
    Loss,
    Method,
    Optimizer,
    Precision,
    QuantSpec,
    TrainSpec,
)

__all__ = [
    "DEFAULT_HEADROOM",
    "Attention",
    "CacheKind",
    "DType",
    "EvalLogits",
    "GPUSpec",
    "LoadPath",
    "ModelCode",
    "LoraSpec",
    "Loss",
    "Method",
    "ModelSpec",
    "Optimizer",
    "Precision",
    "QuantSpec",
    "Sharding",
    "TrainSpec",
    "ZeroBuffers",
    "check_headroom",
]
