"""Make a fake-CPU run take the code paths a CUDA run takes. Each shim is a context manager that restores all
global state on exit and keeps no module-level state.

Why each exists (tracing.md, checked again here with torch 2.13):
- SDPA: on CPU, ``F.scaled_dot_product_attention`` picks ``_scaled_dot_product_flash_attention_for_cpu``
  (output + log-sum-exp saved, as CUDA flash does) in most cases, but falls back to math where CUDA would
  not (dropout > 0) and runs flash where CUDA falls back to math (fp32 with ``enable_gqa``: CUDA's
  memory-efficient kernel does not take grouped heads). ``sdpa_as_cuda`` applies CUDA's choice.
- Dropout: CPU's ``aten::dropout`` is ``empty_like(x).bernoulli_()`` (a mask in x's dtype); CUDA's is
  ``native_dropout`` with a bool mask (aten/src/ATen/native/Dropout.cpp ``is_fused_kernel_acceptable``).
- Autocast: CPU and CUDA autocast have different op lists (aten/src/ATen/autocast_mode.cpp).
  ``autocast_as_cuda`` applies CUDA's lists whenever CPU autocast is enabled (so checkpoint recomputes,
  which re-enter autocast with the forward's state, follow them too), with the cast cache for parameters.
- Optimizer: PyTorch defaults to foreach on CUDA and to single-tensor on CPU (torch/optim/optimizer.py
  ``_default_to_fused_or_foreach``): ``make_optimizer`` sets the implementation explicitly.
- Packed sequences: see ``no_packed_sequences``.
- Grouped matmuls: see ``grouped_mm_as_cuda``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vramledger.errors import VramledgerError
from vramledger.specs import Optimizer

# -- CUDA autocast op lists (aten/src/ATen/autocast_mode.cpp, torch 2.13: the CUDA KERNEL_* registrations)
_LOWER = frozenset(
    [
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_tbc",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
        "convolution",
        "prelu",
        "addmm",
        "addmv",
        "addr",
        "matmul",
        "einsum",
        "mm",
        "mv",
        "linalg_vecdot",
        "linear",
        "addbmm",
        "baddbmm",
        "bmm",
        "chain_matmul",
        "linalg_multi_dot",
        "scaled_dot_product_attention",
    ]
)
_FP32 = frozenset(
    [
        "acos",
        "asin",
        "cosh",
        "erfinv",
        "exp",
        "expm1",
        "log",
        "log10",
        "log2",
        "log1p",
        "reciprocal",
        "rsqrt",
        "sinh",
        "tan",
        "pow",
        "softplus",
        "layer_norm",
        "group_norm",
        "frobenius_norm",
        "nuclear_norm",
        "cosine_similarity",
        "poisson_nll_loss",
        "cosine_embedding_loss",
        "nll_loss",
        "hinge_embedding_loss",
        "kl_div",
        "l1_loss",
        "smooth_l1_loss",
        "huber_loss",
        "mse_loss",
        "margin_ranking_loss",
        "multilabel_margin_loss",
        "soft_margin_loss",
        "triplet_margin_loss",
        "multi_margin_loss",
        "binary_cross_entropy_with_logits",
        "dist",
        "pdist",
        "cdist",
        "renorm",
        "logsumexp",
        "cross_entropy",
    ]
)
# fp32_set_opt_dtype: run with dtype=float32 unless the caller gave a dtype.
_FP32_OPT_DTYPE = frozenset(
    ["prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm", "linalg_matrix_norm", "sum"]
)
_PROMOTE = frozenset(
    [
        "addcdiv",
        "addcmul",
        "atan2",
        "bilinear",
        "cross",
        "dot",
        "grid_sampler",
        "index_put",
        "scatter_add",
        "tensordot",
    ]
)
_DUNDER = {"__matmul__": "matmul", "__rmatmul__": "matmul", "__pow__": "pow", "__rpow__": "pow"}


def _op_name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    return _DUNDER.get(name, name)


@contextmanager
def autocast_as_cuda() -> Iterator[None]:
    """While CPU autocast is enabled, apply CUDA autocast's op lists instead of CPU's."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_map

    cache: dict[int, Any] = {}

    def cast(t: Any, dtype: Any, *, cacheable: bool) -> Any:
        # autocast_mode.cpp cached_cast: floating tensors except double; fp32 leaves that require grad are
        # cached until the outermost autocast exits (autocast_mode.py __exit__: clear_autocast_cache).
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype in (torch.float64, dtype):
            return t
        if cacheable and t.is_leaf and t.requires_grad and t.dtype == torch.float32 and not t._is_view():
            hit = cache.get(id(t))
            if hit is not None and hit[0] is t:
                return hit[1]
            out = t.to(dtype)
            cache[id(t)] = (t, out)
            return out
        return t.to(dtype)

    class _Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if not torch.is_autocast_enabled("cpu"):
                return func(*args, **kwargs)
            name = _op_name(func)
            if name in _LOWER:
                low = torch.get_autocast_dtype("cpu")
                args, kwargs = tree_map(lambda t: cast(t, low, cacheable=True), (args, kwargs))
            elif name in _FP32:
                args, kwargs = tree_map(lambda t: cast(t, torch.float32, cacheable=False), (args, kwargs))
            elif name in _FP32_OPT_DTYPE and kwargs.get("dtype") is None:
                first = args[0] if args else None
                if isinstance(first, torch.Tensor) and first.is_floating_point():
                    kwargs = {**kwargs, "dtype": torch.float32}
            elif name in _PROMOTE:
                floats = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.is_floating_point()]
                if floats:
                    wide = max((t.dtype for t in floats), key=lambda d: torch.finfo(d).bits)
                    args, kwargs = tree_map(lambda t: cast(t, wide, cacheable=False), (args, kwargs))
            with torch._C._DisableAutocast():
                return func(*args, **kwargs)

    original_clear = torch.clear_autocast_cache

    def clear() -> None:
        cache.clear()
        original_clear()

    torch.clear_autocast_cache = clear
    try:
        with _Mode():
            yield
    finally:
        torch.clear_autocast_cache = original_clear
        cache.clear()


def cuda_sdpa_backend(q: Any, k: Any, v: Any, attn_mask: Any, dropout_p: float, enable_gqa: bool) -> str:
    """The backend CUDA's ``select_sdp_backend`` (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp) picks
    on an
    sm80+ GPU: ``flash``, ``efficient`` or ``math``, by the checks that differ between them here.

    flash: fp16/bf16, no explicit mask, head_dim ≤ 256 and a multiple of 8 (check_head_dim_size_flash), grouped
    heads allowed. efficient: fp16/bf16/fp32, a mask allowed, head_dim a multiple of 8 (4 for fp32), but the same
    number of query and key heads (check_batch_size_and_num_heads_dense<false>). Otherwise math.
    """
    import torch

    d = q.shape[-1]
    low = q.dtype in (torch.float16, torch.bfloat16)
    same_heads = q.shape[-3] == k.shape[-3] if q.dim() >= 3 else True
    if low and attn_mask is None and d <= 256 and d % 8 == 0 and v.shape[-1] == d:
        return "flash"
    if q.dtype in (torch.float16, torch.bfloat16, torch.float32) and same_heads and d % (8 if low else 4) == 0:
        return "efficient"
    _ = dropout_p, enable_gqa
    return "math"


@contextmanager
def sdpa_as_cuda() -> Iterator[list[str]]:
    """Route ``F.scaled_dot_product_attention`` as CUDA would: flash/efficient (no length² tensor; traced with
    the CPU flash kernel, which saves the same output and log-sum-exp) or math. Yields the list of choices
    made."""
    import torch
    from torch.overrides import TorchFunctionMode

    chosen: list[str] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    class _Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is not sdpa:
                return func(*args, **kwargs)
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
            a = dict(zip(names, args, strict=False)) | kwargs
            q, k, v = a["query"], a["key"], a["value"]
            mask, p = a.get("attn_mask"), float(a.get("dropout_p", 0.0))
            causal, scale, gqa = (
                bool(a.get("is_causal", False)),
                a.get("scale"),
                bool(a.get("enable_gqa", False)),
            )
            backend = cuda_sdpa_backend(q, k, v, mask, p, gqa)
            chosen.append(backend)
            mask = cuda_sdpa_mask(mask, q, backend)
            if backend == "math":
                # sdp_utils: math is the composite aten::_scaled_dot_product_attention_math (device
                # independent).
                return torch.ops.aten._scaled_dot_product_attention_math(
                    q, k, v, mask, p, causal, None, scale=scale, enable_gqa=gqa
                )[0]
            dv = v.shape[-1]
            if dv != q.shape[-1]:
                # MLA (DeepSeek-V2/V3): values narrower than queries/keys. CUDA's efficient kernel takes them as
                # they are; the CPU flash kernel does not, so v is zero-padded and the output sliced (the saved
                # v and output are then (d - dv)/d larger than on the GPU: a stated over-estimate).
                v = torch.nn.functional.pad(v, (0, q.shape[-1] - dv))
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, p, causal, attn_mask=mask, scale=scale
            )[0][..., :dv]

    with _Mode():
        yield chosen


def cuda_sdpa_mask(mask: Any, q: Any, backend: str) -> Any:
    """The mask as torch's ``scaled_dot_product_attention`` hands it to the kernel on CUDA (attention.cpp): a
    boolean mask becomes an additive one of the query's dtype (``convert_boolean_attn_mask``: ``at::where(
    mask.logical_not(), -inf, 0)``), and for the memory-efficient kernel a last dimension that is not a multiple of
    16 is padded and sliced back (``preprocess_mask`` / ``pad_bias``: the padded storage stays, saved for backward
    with the bias). The CPU flash kernel the trace runs then saves it as the efficient kernel does."""
    import torch

    from vramledger.analytic.sdpa_mask import mask_columns

    if mask is None:
        return None
    if mask.dtype == torch.bool:
        mask = torch.where(mask.logical_not(), float("-inf"), torch.scalar_tensor(0.0, dtype=q.dtype))
    last = mask.shape[-1]
    if backend == "efficient" and mask_columns(last) != last:
        mask = torch.nn.functional.pad(mask, (0, mask_columns(last) - last))[..., :last]
    return mask


@contextmanager
def grouped_mm_as_cuda() -> Iterator[None]:
    """Let ``aten._grouped_mm`` take the dtypes CUDA's kernel takes. transformers 5's default experts implementation
    (integrations/moe.py ``_grouped_mm``) calls it with the expert weights' dtype, fp32 for full fine-tuning under
    mixed precision; torch 2.13's CUDA kernel runs bf16 on its CUTLASS path and any other dtype on
    ``_grouped_mm_fallback`` (aten/src/ATen/native/cuda/GroupedBlas.cpp), the CPU kernel too, but the meta function
    fake tensors use (torch/_meta_registrations.py ``_meta_grouped_mm_common``) accepts bf16 only. For other dtypes
    this returns the output the kernels allocate (``_create_grouped_mm_output_tensor``: the input's dtype), beneath
    autograd, which records the op's backward as usual. Enter it inside the fake mode and outside the recorder, so
    the recorder sees ``_grouped_mm`` and its output."""
    import torch
    from torch._meta_registrations import _create_grouped_mm_output_tensor
    from torch.utils._python_dispatch import TorchDispatchMode

    grouped = torch.ops.aten._grouped_mm.default

    class _Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is grouped and torch.bfloat16 not in (args[0].dtype, args[1].dtype):
                names = ("mat_a", "mat_b", "offs", "bias", "out_dtype")
                a = dict(zip(names, args, strict=False)) | kwargs
                return _create_grouped_mm_output_tensor(a["mat_a"], a["mat_b"], a.get("offs"), a.get("out_dtype"))
            return func(*args, **kwargs)

    with _Mode():
        yield


@contextmanager
def dropout_as_cuda() -> Iterator[None]:
    """``F.dropout`` in training as CUDA runs it: ``native_dropout`` with a bool mask (Dropout.cpp)."""
    import torch
    from torch.overrides import TorchFunctionMode

    targets = (torch.nn.functional.dropout, torch.dropout)

    class _Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func not in targets:
                return func(*args, **kwargs)
            names = ("input", "p", "training", "inplace") if func is targets[0] else ("input", "p", "train")
            a = dict(zip(names, args, strict=False)) | kwargs
            p = float(a.get("p", 0.5))
            training = bool(a.get("training", a.get("train", True)))
            if not training or p <= 0.0 or p >= 1.0 or a.get("inplace", False):
                return func(*args, **kwargs)
            return torch.ops.aten.native_dropout(a["input"], p, True)[0]

    with _Mode():
        yield


def make_optimizer(params: list[Any], optimizer: Optimizer, *, sgd_momentum: float = 0.0) -> Any:
    """The Trainer's optimizer (:func:`vramledger.optimizers.trainer_optimizer`); bitsandbytes ones refused."""
    from vramledger.optimizers import BITSANDBYTES_OPTIMIZERS, trainer_optimizer

    if optimizer in BITSANDBYTES_OPTIMIZERS:
        raise VramledgerError(
            f"trace: optimizer {optimizer.value} needs bitsandbytes, which does not run on fake tensors; "
            "use `vramledger estimate`, or trace with --optimizer adamw_torch"
        )
    return trainer_optimizer(params, optimizer, sgd_momentum=sgd_momentum, as_on_cuda=True)


@contextmanager
def no_packed_sequences() -> Iterator[None]:
    """transformers masking_utils.py ``find_packed_sequence_indices`` reads the position ids' values to detect
    packed sequences, and on fake tensors (``is_tracing``) cannot, so it assumes packing and builds a 4-D mask
    (which also pushes SDPA off its flash kernel). We trace one unpadded sequence per row with the default
    positions, for which a real run finds no packing: say so."""
    import transformers.masking_utils as mu

    original = mu.find_packed_sequence_indices
    mu.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = original


@contextmanager
def bnb_linear4bit(
    modules: list[Any],
    *,
    lora_layers: list[Any],
    keeps_input: bool,
    state_dtype: Any,
    compute_dtype: Any,
    blocksize: int,
    nested: bool,
) -> Iterator[None]:
    """Run each frozen linear a 4-bit QLoRA base quantises as bitsandbytes' ``Linear4bit`` runs it, on the bf16
    stand-in weight the trace holds (its bytes are swapped for the 4-bit figure afterwards: trace/api.py).

    bitsandbytes 0.49.2 (``nn/modules.py`` ``Linear4bit.forward``; ``autograd/_functions.py`` ``MatMul4Bit``;
    ``functional.py`` ``dequantize_4bit``), for a matmul of more than one token:
    - the input is cast to ``compute_dtype`` (``x.to(self.compute_dtype)``) and the output back to the input's dtype;
    - forward: ``linear(A, dequantize_4bit(B, state).to(A.dtype).t(), bias)``: the weight dequantised in the
      state's dtype (the dtype it was loaded in), cast to A's dtype where they differ, both alive during the cast;
      with double quantisation ``dequantize_4bit`` first dequantises the absmax constants into an fp32 tensor of
      numel / blocksize elements, alive until it returns;
    - ``ctx.tensors = (None, B)``: nothing saved but the 4-bit weight (before 0.43.2 ``(A, B)``: ``keeps_input``);
    - backward: ``matmul(grad_output, dequantize_4bit(B, state).to(grad_output.dtype).t())``, the same temporaries.
    bitsandbytes 0.50 runs the forward through ``gemm_4bit``, whose CUDA dispatch dequantises into A's dtype and
    calls ``F.linear`` past 1536 rows (``backends/cuda/ops.py`` ``_dequant_linear_fallback``) and may take its fused
    kernel, with nothing dequantised, below (by GPU architecture): this shim counts the dequantised weight always.
    ``lora_layers``: PEFT's LoRA layers over those linears, which run PEFT 0.21's ``lora.bnb.Linear4bit.forward``
    (``tuners/lora/bnb.py``, defined only where bitsandbytes is installed) in place of ``lora.Linear.forward``: it
    clones the base layer's output ("As per Tim Dettmers, for 4bit, we need to defensively clone here"), and casts
    the input to the adapter's dtype, and the adapter's output back, only without autocast
    (``requires_conversion = not torch.is_autocast_enabled()``; CPU autocast stands for CUDA's in the trace).
    DoRA's layer reads the base weight through ``dequantize_module_weight`` (``peft/utils/integrations.py``), which
    for a ``Params4bit`` returns ``dequantize_4bit(weight.data, weight.quant_state)``: a new tensor in the state's
    dtype, here too. Restores each module's ``forward`` and PEFT's function on exit."""
    import torch

    def dequantised(B: Any, dtype: Any) -> Any:
        absmax = torch.empty(B.numel() // blocksize, dtype=torch.float32) if nested else None
        state = torch.empty(B.shape, dtype=state_dtype)
        del absmax
        return state.to(dtype)

    class _MatMul4Bit(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, A: Any, B: Any, bias: Any) -> Any:
            out = torch.nn.functional.linear(A, dequantised(B, A.dtype), bias)
            ctx.save_for_backward(A if keeps_input else None, B)
            return out

        @staticmethod
        def backward(ctx: Any, grad_output: Any) -> Any:
            _, B = ctx.saved_tensors
            return torch.matmul(grad_output, dequantised(B, grad_output.dtype)), None, None

    def make_forward(mod: Any) -> Any:
        def forward(x: Any) -> Any:
            inp_dtype = x.dtype
            x = x.to(compute_dtype or inp_dtype)
            bias = None if mod.bias is None else mod.bias.to(x.dtype)
            return _MatMul4Bit.apply(x, mod.weight, bias).to(inp_dtype)

        return forward

    def make_lora_forward(layer: Any) -> Any:
        def forward(x: Any, *args: Any, **kwargs: Any) -> Any:
            # PEFT 0.21.2 tuners/lora/bnb.py Linear4bit.forward, the unmerged path with adapters enabled
            result = layer.base_layer(x, *args, **kwargs)
            result = result.clone()
            for active_adapter in layer.active_adapters:
                if active_adapter not in layer.lora_A:
                    continue
                lora_A = layer.lora_A[active_adapter]
                lora_B = layer.lora_B[active_adapter]
                dropout = layer.lora_dropout[active_adapter]
                scaling = layer.scaling[active_adapter]
                requires_conversion = not torch.is_autocast_enabled("cpu")
                if requires_conversion:
                    expected_dtype = result.dtype
                    x = layer._cast_input_dtype(x, lora_A.weight.dtype)
                if active_adapter not in layer.lora_variant:
                    output = lora_B(lora_A(dropout(x))) * scaling
                    if requires_conversion:
                        output = output.to(expected_dtype)
                    result = result + output
                else:
                    result = layer.lora_variant[active_adapter].forward(
                        layer, active_adapter=active_adapter, x=x, result=result, **kwargs
                    )
                    if requires_conversion:
                        result = result.to(expected_dtype)
            return result

        return forward

    from peft.tuners.lora import dora

    quantised = {id(mod) for mod in modules}
    original_dequantize = dora.dequantize_module_weight

    def dequantize_module_weight(module: Any) -> Any:
        if id(module) in quantised:
            return dequantised(module.weight, state_dtype)
        return original_dequantize(module)

    saved = [(mod, mod.__dict__.get("forward")) for mod in [*modules, *lora_layers]]
    for mod in modules:
        mod.forward = make_forward(mod)
    for layer in lora_layers:
        layer.forward = make_lora_forward(layer)
    dora.dequantize_module_weight = dequantize_module_weight
    try:
        yield
    finally:
        dora.dequantize_module_weight = original_dequantize
        for mod, old in saved:
            if old is None:
                del mod.forward
            else:
                mod.forward = old
