"""What the user asks about: the model, the training setup and the GPU, as frozen validated dataclasses."""

from vramledger.specs.cache import CacheKind
from vramledger.specs.gpu import GPUSpec
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
    "Attention",
    "CacheKind",
    "DType",
    "EvalLogits",
    "GPUSpec",
    "LoadPath",
    "LoraSpec",
    "Loss",
    "Method",
    "ModelSpec",
    "Optimizer",
    "Precision",
    "QuantSpec",
    "TrainSpec",
]
