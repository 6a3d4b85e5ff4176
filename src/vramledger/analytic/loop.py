"""Training-loop features that change which tensors are alive: optimizer-in-backward, activation offloading,
and torch.compile (accepted, stated as an assumption).

- Optimizer in backward (torchtune ``training/_memory.py`` ``register_optim_in_bwd_hooks``: one optimizer per
  parameter, stepped in the parameter's ``register_post_accumulate_grad_hook``, then ``p.grad = None``): a
  gradient lives only until its own step runs, so instead of every gradient (P·b at the end of backward and through
  the step) one parameter's gradient and its step temporaries are alive at a time. torchtune refuses gradient
  accumulation with it (``lora_finetune_single_device.py``/``full_finetune_single_device.py``), and so do we.
- Activation offloading (torchtune ``training/_activation_offloading.py`` ``OffloadActivations``, a
  ``saved_tensors_hooks`` pair): every saved tensor of at least ``min_offload_size`` (1024 bytes) goes to pinned
  CPU memory in forward and comes back in backward one layer ahead of its use; the output projection runs under
  ``NoOpManager`` (its tensors stay). Modelled: of the per-layer saved tensors, two layers' worth stay on the GPU
  (the one being offloaded/prefetched and the one in use); the once-per-model ones (final norm, logits) stay.
- torch.compile: estimated as eager. What it changes, not modelled: Inductor fuses elementwise chains, so fewer
  intermediates are saved (the norms' fp32 copies, SiLU·mul), usually lowering activation memory; the first steps
  compile, and CUDA graphs (``mode="reduce-overhead"``) keep their own memory pool.
"""

from __future__ import annotations

from vramledger.analytic.weights import WeightBudget
from vramledger.specs import TrainSpec

SRC_OPT_IN_BWD = (
    "torchtune register_optim_in_bwd_hooks: each parameter stepped in its post-accumulate-grad hook, grad then "
    "freed: one parameter's gradient at a time"
)
SRC_OFFLOAD = (
    "torchtune OffloadActivations (saved_tensors_hooks): saved tensors ≥ 1024 B to pinned CPU memory, prefetched "
    "one layer ahead in backward: two layers' worth stay on the GPU"
)
COMPILE_NOTE = (
    "torch.compile: estimated as eager (Inductor's fusion usually saves fewer intermediates, so activations are "
    "likely lower; compilation and CUDA graphs add memory of their own)"
)


def optimizer_in_backward(train: TrainSpec, wb: WeightBudget, grads: int, step_temp: int) -> tuple[int, int]:
    """(gradient bytes, step temporaries) alive at once: one parameter's under optimizer-in-backward."""
    if not train.optimizer_in_backward:
        return grads, step_temp
    one = wb.largest_trainable_numel * wb.trainable_dtype.bytes
    return min(grads, one), min(step_temp, one)


def offloaded_layers(train: TrainSpec, n_trained_layers: int) -> int:
    """Trained layers whose saved tensors stay on the GPU."""
    return min(n_trained_layers, 2) if train.offload_activations else n_trained_layers
