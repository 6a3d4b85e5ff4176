"""How a framework puts a quantised base on the GPU (what each path costs at load: ``analytic/load.py``)."""

from __future__ import annotations

import enum


class LoadPath(str, enum.Enum):
    """The load path of a QLoRA base."""

    TRANSFORMERS = "transformers"
    """``from_pretrained`` with a ``BitsAndBytesConfig``: each weight is quantised as it is moved to the GPU."""
    TORCHTUNE = "torchtune"
    """torchtune's QLoRA recipes: each ``FrozenNF4Linear`` is built in bf16 on the GPU and converted there by
    torchao's ``to_nf4``."""
