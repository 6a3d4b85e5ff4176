"""The optimizer the Hugging Face Trainer builds for each ``optim`` name, as a torch object.

One home for both engines that run real code: ``trace`` (fake tensors on the CPU) and ``measure`` (a GPU).
``transformers`` ``trainer.py`` ``Trainer.get_optimizer_cls_and_kwargs`` maps the names; the implementation
torch picks by itself on CUDA (``torch/optim/optimizer.py`` ``_default_to_fused_or_foreach``: foreach when
every parameter is on CUDA) can be made explicit (``as_on_cuda``), so that a CPU trace runs the allocations of
the GPU's kernels; a real run leaves the choice to torch. The learning rate does not change memory; it is
fixed.
"""

from __future__ import annotations

from typing import Any

from vramledger.specs import Optimizer

BITSANDBYTES_OPTIMIZERS = frozenset(
    {Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT, Optimizer.PAGED_ADAMW_32BIT, Optimizer.LION,
     Optimizer.LION_8BIT}
)  # fmt: skip
"""Built by bitsandbytes (``bnb.optim``): they need a CUDA device and do not run on fake tensors."""


def trainer_optimizer(
    params: list[Any], optimizer: Optimizer, *, sgd_momentum: float = 0.0, as_on_cuda: bool = False
) -> Any:
    """The optimizer over ``params``; ImportError when a bitsandbytes optimizer is asked for without it."""
    import torch

    lr = 1e-5
    foreach = True if as_on_cuda else None
    if optimizer is Optimizer.ADAMW:
        return torch.optim.AdamW(params, lr=lr, foreach=foreach)
    if optimizer is Optimizer.ADAMW_FUSED:
        return torch.optim.AdamW(params, lr=lr, fused=True)
    if optimizer is Optimizer.ADAMW_FORLOOP:
        return torch.optim.AdamW(params, lr=lr, foreach=False)
    if optimizer is Optimizer.SGD:
        return torch.optim.SGD(params, lr=lr, momentum=sgd_momentum, foreach=foreach)
    if optimizer is Optimizer.ADAFACTOR:
        from transformers.optimization import Adafactor

        # trainer.py: optim "adafactor" -> Adafactor(scale_parameter=False, relative_step=False)
        return Adafactor(params, lr=lr, scale_parameter=False, relative_step=False)
    import bitsandbytes as bnb

    table = {
        Optimizer.ADAMW_8BIT: bnb.optim.AdamW8bit,
        Optimizer.PAGED_ADAMW_8BIT: bnb.optim.PagedAdamW8bit,
        Optimizer.PAGED_ADAMW_32BIT: bnb.optim.PagedAdamW32bit,
        Optimizer.LION: bnb.optim.Lion,
        Optimizer.LION_8BIT: bnb.optim.Lion8bit,
    }
    return table[optimizer](params, lr=lr)
