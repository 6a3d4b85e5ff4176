"""Whose model code runs the layers: what each implementation saves for backward beyond the transformers + PEFT
layers that analytic/activations.py models (``analytic/litgpt.py``)."""

from __future__ import annotations

import enum


class ModelCode(str, enum.Enum):
    """The implementation of the decoder layers that the training step runs."""

    TRANSFORMERS = "transformers"
    """transformers' ``modeling_*`` layers with PEFT's LoRA modules (what analytic/activations.py and the trace
    follow)."""
    LITGPT = "litgpt"
    """LitGPT's ``GPT``/``Block`` with its fused ``attn`` linear and ``LoRAQKVLinear`` (litgpt 43c44323 to 00af8b0d,
    2024-04 to 2024-09: the code of its config_hub benchmark table)."""
    LIT_GPT_2023 = "lit-gpt-2023"
    """Lit-GPT 8641822 (2023-10-16, LitGPT's resource tables): the same attention and ``LoRAQKVLinear``, but an
    RMSNorm computed in the input dtype (the fp32 upcast came with 6178c7cc, 2023-10-24)."""
