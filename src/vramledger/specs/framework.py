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

    @property
    def litgpt(self) -> bool:
        """One of LitGPT's codes (their QLoRA ran under Lightning's BitsandbytesPrecision)."""
        return self in (ModelCode.LITGPT, ModelCode.LIT_GPT_2023)

    @property
    def matmul4bit_keeps_input(self) -> bool:
        """Whether bitsandbytes' ``MatMul4Bit`` keeps its input A for backward under this code's QLoRA.

        bitsandbytes before 0.43.2 kept ``ctx.tensors = (A, B)`` whenever an input needed grad (0.42.0
        ``autograd/_functions.py`` l. 523), A included although backward needs only B; 0.43.2 stopped
        (9e753741, #1270, "fix QLoRA mem bug: delete useless buffered activation"), and 0.50.2 keeps
        ``(None, B)``. The LitGPT codes ran pinned to bitsandbytes 0.41.1 / 0.42.0 (analytic/litgpt_qlora.py);
        transformers + PEFT runs today use a bitsandbytes after the fix."""
        return self.litgpt
