"""What the user asks about: the model, the training setup and the GPU, as frozen validated dataclasses."""

from vramledger.specs.distributed import Sharding, ZeroBuffers
from vramledger.specs.gpu import GPUSpec
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
    "DType",
    "EvalLogits",
    "GPUSpec",
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
]
