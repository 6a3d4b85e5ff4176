"""Optimizer states (created lazily at the first step) and the temporaries of the step itself.

Legend: P trainable parameters, b bytes per trainable element (their storage dtype), n largest single tensor.

- torch 2.13 ``torch/optim/adamw.py`` (``_init_group``): ``exp_avg`` and ``exp_avg_sq`` are
  ``zeros_like(param)``, so in the parameter's dtype (bf16 under pure bf16): 2·P·b. The foreach implementation
  (the default on CUDA, ``_default_to_fused_or_foreach``) computes ``exp_avg_sq_sqrt = torch._foreach_sqrt(...)``
  over the whole group: a further P·b temporary. The fused kernel has none; the for-loop one needs one tensor's
  worth (n·b). Adam (``adam.py``) is the same.
- bitsandbytes ``optim/optimizer.py`` ``Optimizer2State.init_state``: 8-bit states are uint8 with one fp32 absmax
  per 256-element block (``blocksize=256`` for the blockwise kernels), for tensors of at least
  ``min_8bit_size=4096`` elements; smaller tensors and ``optim_bits=32`` keep fp32 states. Paged variants
  allocate the same bytes as CUDA managed memory (outside torch's allocator: they count on the device until the
  driver pages them out under pressure).
- transformers ``optimization.py`` ``Adafactor`` (HF defaults: ``beta1=None``, factored second moment for ≥ 2-D):
  row and column statistics (R + C) per matrix, a full second moment for vectors. ``step`` works one parameter
  at a time in fp32: with a 16-bit parameter it makes ``grad.float()`` and ``p.float()``, and then holds two
  n·4 tensors at once three times over (``update = grad**2 + eps``: the square and the sum; ``_approx_sq_grad``:
  the old update and ``torch.mul(r_factor, c_factor)``; ``p_data_fp32.add_(-update)``: the update and its
  negation), so 4·n·4 at its peak (2·n·4 with fp32 parameters, whose ``float()`` is the tensor itself).
- ``torch.optim.SGD``: one momentum buffer per parameter when momentum > 0, none otherwise.
- Lion (bitsandbytes ``Lion``/``Lion8bit``): one state, fp32 (32-bit) or uint8 + absmax (8-bit).
"""

from __future__ import annotations

from dataclasses import dataclass

from vramledger.analytic.weights import WeightBudget
from vramledger.specs import ModelSpec, Optimizer, TrainSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerBytes:
    states: int
    step_temporaries: int
    paged: bool
    source: str


def _eight_bit(numel: int) -> int:
    return numel + 4 * -(-numel // 256)


def optimizer_bytes(m: ModelSpec, train: TrainSpec, wb: WeightBudget) -> OptimizerBytes:
    P, b, n = wb.trainable_params, wb.trainable_dtype.bytes, wb.largest_trainable_numel
    Pb = wb.trainable_bytes  # P·b, exact when trainable parameters mix dtypes (fp32 adapters, bf16 saved modules)
    opt = train.optimizer
    if opt in (Optimizer.ADAMW, Optimizer.ADAMW_FUSED, Optimizer.ADAMW_FORLOOP):
        temp = {Optimizer.ADAMW: Pb, Optimizer.ADAMW_FUSED: 0, Optimizer.ADAMW_FORLOOP: n * b}[opt]
        impl = {Optimizer.ADAMW: "foreach", Optimizer.ADAMW_FUSED: "fused", Optimizer.ADAMW_FORLOOP: "for-loop"}[opt]
        return OptimizerBytes(
            states=2 * Pb,
            step_temporaries=temp,
            paged=False,
            source=f"torch AdamW ({impl}): exp_avg + exp_avg_sq in the parameter dtype, 2·P·{b} B"
            + ("; _foreach_sqrt temporary P·b" if temp and opt is Optimizer.ADAMW else ""),
        )
    if opt in (Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT, Optimizer.LION_8BIT):
        states_per = 1 if opt is Optimizer.LION_8BIT else 2
        # Tensors below min_8bit_size keep fp32 states: in practice norms and biases (small).
        return OptimizerBytes(
            states=states_per * _eight_bit(P),
            step_temporaries=0,
            paged=opt is Optimizer.PAGED_ADAMW_8BIT,
            source=f"bitsandbytes 8-bit: {states_per} uint8 state(s) + fp32 absmax per 256 elements",
        )
    if opt in (Optimizer.PAGED_ADAMW_32BIT, Optimizer.LION):
        states_per = 1 if opt is Optimizer.LION else 2
        return OptimizerBytes(
            states=states_per * 4 * P,
            step_temporaries=0,
            paged=opt is Optimizer.PAGED_ADAMW_32BIT,
            source=f"bitsandbytes 32-bit: {states_per} fp32 state(s) per parameter",
        )
    if opt is Optimizer.ADAFACTOR:
        # Factored: a matrix R×C keeps R + C; approximate as P / min(R, C)·2 using the hidden size as the short side.
        factored = 2 * P // max(1, m.hidden_size) * b
        copies = 2 if b < 4 else 0  # grad.float() and p.float() of a 16-bit parameter (module docstring)
        return OptimizerBytes(
            states=factored,
            step_temporaries=(2 + copies) * n * 4,
            paged=False,
            source="HF Adafactor: row+column second-moment statistics; one tensor at a time: fp32 copies of a 16-bit "
            "param and grad, and two fp32 update tensors at once",
        )
    assert opt is Optimizer.SGD
    momentum = Pb if train.sgd_momentum > 0 else 0
    return OptimizerBytes(
        states=momentum,
        step_temporaries=0,
        paged=False,
        source="torch SGD: one momentum buffer per parameter" if momentum else "torch SGD without momentum: no state",
    )
