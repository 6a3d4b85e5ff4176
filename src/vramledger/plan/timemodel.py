"""Predicted time of one optimizer step: FLOPs against the GPU's peak at a stated utilisation, plus the costs
that do not shrink with the micro-batch (weight streaming, kernel launches, fixed per-step work), the optimizer
step (memory-bandwidth bound) and, with optimizer offload, PCIe transfers and the CPU optimizer.

Legend: N matmul weights (elements), T tokens per micro-batch (B·L), L sequence length, Dq = heads·head_dim,
nl decoder layers, ntl trained decoder layers (those the backward pass runs through), P trainable parameters.

FLOPs (the ``flops_*`` functions; nothing here needs a GPU):
- Matmuls: a linear layer with |W| weights costs 2·|W| FLOPs per token forward; backward costs 2·|W| for the
  gradient of its input and 2·|W| for the gradient of its weight — 6·N per token in all (Kaplan et al. 2020,
  "Scaling Laws", Table 1; PaLM, Chowdhery et al. 2022, Appendix B; nanoGPT ``model.py`` ``estimate_mfu``). A frozen
  weight skips its weight gradient (torch ``derivatives.yaml``: ``mm`` computes ``mat2``'s gradient only when it
  requires grad), so LoRA costs ≈ 4·N; layers below the lowest trained layer run forward only (method freeze).
  MoE layers touch ``experts_per_token`` of their experts.
- Attention: QKᵀ and AV cost 2·2·Dq·L_keys FLOPs per token forward (PaLM Appendix B: 12·nl·Dq·L for forward and
  backward with backward = 2× forward). Kernels that skip the masked half of a causal matrix (flash, and SDPA
  without an explicit mask) do half: flash-attention ``benchmarks/benchmark_flash_attention.py`` ``flops()``
  divides by 2 when causal and counts backward as 2.5× forward (it recomputes QKᵀ); eager attention computes and
  then masks the full L×L matrix. Sliding-window layers attend to at most the window.
- Gradient checkpointing recomputes each trained decoder layer's forward during backward (torch.utils.checkpoint;
  transformers ``GradientCheckpointingLayer``): + one forward of the trained layers, not of lm_head.

Time (``step_time``), with every constant in ``TimeAssumptions`` below:
- matmul time = FLOPs / (peak × u(T)) with u(T) = u_max · T / (T + T_half): a saturating utilisation. T_half is the
  GPU's ops:byte ratio (peak FLOP/s ÷ memory bytes/s): a [T × K] × [K × M] bf16 GEMM has an arithmetic intensity of
  ≈ T FLOPs per byte when T ≪ K, M, and is memory-bound below the ops:byte ratio (NVIDIA Deep Learning Performance
  docs, "GPU Performance Background User's Guide", Understanding Performance; "Matrix Multiplication Background
  User's Guide"). Algebraically this is "compute time at u_max plus streaming every weight once per pass", so a
  micro-step costs at least the time to read the weights three times, however few tokens it carries.
- memory-bound work: elementwise traffic (activations written in forward, read in backward, gradients written
  and read) and QLoRA's dequantisation of every base weight per pass (bitsandbytes ``autograd/_functions.py``
  ``MatMul4Bit``: ``dequantize_4bit`` in forward and again for the input gradient).
- a micro-step takes max(GPU time, CPU time to launch its kernels) + a fixed cost (eager PyTorch launches are
  asynchronous, so launch time hides behind GPU work unless kernels are short).
- the optimizer step reads and writes parameters, gradients and states once per pass at memory bandwidth
  (torch ``optim/adamw.py`` ``_multi_tensor_adamw``/``_fused_adamw``; bitsandbytes ``optimizer_update_8bit_blockwise``)
  after gradient clipping (HF ``TrainingArguments.max_grad_norm=1.0`` → ``clip_grad_norm_``: a norm pass and a
  scaling pass over the gradients).
- optimizer offload (DeepSpeed ZeRO-Offload, Ren et al. 2021 §4): fp32 gradients to the host every micro-step and,
  when accumulating, the partial sums back (``stage_1_and_2.py`` ``async_accumulate_grad_in_cpu_via_gpu``); the
  CPU Adam (host-memory bound) and the updated low-precision parameters back to the GPU once per optimizer step.
  The GPU side works parameter by parameter (``copy_grads_in_partition``): at the accumulation boundary each
  gradient's norm (``set_norm_for_param_grad_in_gpu``: ``.double().norm(2)``), the overflow check, its fp32 cast
  and copy to the host (``async_inplace_copy_grad_to_fp32_buffer_from_gpu``), at least five launches; on each
  other micro-step its copy to the host and, after the first, the partial sum back and its addition, three.

No GPU was available when these constants were chosen: they are assumptions with their evidence, to be
calibrated on a GPU (bench/ground_truth/constants.py measures them).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from vramledger.analytic.activations import padded_sdpa
from vramledger.analytic.params import layer_linears
from vramledger.analytic.step import step_parts
from vramledger.analytic.weights import weight_budget
from vramledger.specs import Attention, GPUSpec, Method, ModelSpec, Optimizer, Precision, TrainSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class TimeAssumptions:
    """Every constant of the time model, in one place. None is measured yet (no GPU in this session)."""

    mfu_max: float = 0.40
    """Model-FLOPs utilisation reached by large micro-batches. Published training MFU: GPT-3 21.3%, Gopher 32.5%,
    MT-NLG 30.2%, PaLM 46.2% (PaLM paper, Table 3); single-GPU fine-tuning with HF transformers and fused attention
    is commonly reported at 30-50%. We take 40%."""
    fallback_tflops: float = 100.0
    """Peak for a GPU given only by its size (``--gpu 24GiB``): an RTX-4090-class card, halved."""
    fallback_bandwidth_gbs: float = 1000.0
    fallback_host_link_gbs: float = 25.0
    """PCIe 4.0 ×16 moves about 25 GB/s per direction in practice (32 GB/s nominal)."""
    launch_s: float = 8e-6
    """CPU time to dispatch one eager PyTorch op and launch its kernel (Python + dispatcher + cudaLaunchKernel:
    several microseconds; PyTorch blog "Accelerating PyTorch with CUDA Graphs", 2021)."""
    kernels_per_layer_forward: int = 40
    """Kernels of one Llama-style decoder layer's forward in eager mode (counted from ``LlamaDecoderLayer``: two
    RMSNorms of ~8 ops, 7 projections, RoPE ~10 ops, SDPA, SiLU, product, two residual adds)."""
    kernels_per_adapter: int = 6
    """PEFT ``lora.Linear.forward`` adds a cast, dropout, lora_A, lora_B, the scaling and the add."""
    backward_kernel_factor: float = 2.0
    """Backward launches about twice the forward's kernels (one per input gradient, one per weight gradient)."""
    micro_step_fixed_s: float = 0.004
    """Fixed cost of a micro-step outside the kernels: collating and copying the batch, the Trainer's
    ``training_step`` bookkeeping, the loss ``.detach()`` sync."""
    optimizer_fixed_s: float = 0.002
    """Fixed cost of an optimizer step: scheduler, ``zero_grad``, logging."""
    elementwise_passes: float = 4.0
    """Each saved activation byte is written in forward, read in backward, and its gradient written and read."""
    dequant_bandwidth_fraction: float = 0.15
    """Fraction of memory bandwidth that bitsandbytes' per-pass 4-bit dequantisation achieves (small kernels, one
    per weight, launched from Python). Chosen so that QLoRA runs 15-25% slower than LoRA at one 2k-token sequence,
    inside published comparisons (10-40% slower; S. Raschka, "Practical Tips for Finetuning LLMs Using LoRA",
    2023: +39% runtime for a 7B model in Lit-GPT)."""
    host_memory_gbs: float = 40.0
    """Effective host-memory bandwidth of DeepSpeed's CPU Adam (AVX, all cores; dual-channel DDR5 peaks near
    80 GB/s)."""

    def __post_init__(self) -> None:
        assert 0 < self.mfu_max <= 1


DEFAULT_ASSUMPTIONS = TimeAssumptions()


@dataclass(frozen=True, kw_only=True, slots=True)
class Flops:
    """FLOPs per token of one micro-step, by pass."""

    forward: float
    backward: float
    recompute: float
    """Gradient checkpointing's second forward of the trained layers (0 without it)."""
    matmul_forward: float
    """Of ``forward``, the matmul part (the rest is attention)."""
    attention_forward: float

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.recompute


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTime:
    """Predicted time of one optimizer step (seconds), term by term."""

    flops: Flops
    tokens_per_micro_batch: int
    micro_steps: int
    utilisation: float
    """u(T): the matmul utilisation at this micro-batch."""
    compute_s: float
    """Per micro-step: FLOPs / (peak × u(T))."""
    memory_s: float
    """Per micro-step: elementwise traffic and QLoRA dequantisation at memory bandwidth."""
    launch_s: float
    """Per micro-step: CPU time to launch the kernels (hidden behind GPU work when shorter)."""
    fixed_s: float
    """Per micro-step fixed cost."""
    micro_step_s: float
    optimizer_s: float
    """Per optimizer step on the GPU: clip + update at memory bandwidth, plus launches and fixed cost."""
    offload_s: float
    """Per optimizer step: PCIe transfers and the CPU optimizer (0 without offload)."""
    step_s: float
    """Total per optimizer step."""
    tokens_per_step: int
    tokens_per_s: float
    peak_flops: float
    """The peak used (FLOP/s), after the fp32 factor."""
    assumed_gpu: bool
    """Whether the GPU's throughput figures were missing and the fallbacks were used."""

    @property
    def mfu(self) -> float:
        """Achieved model-FLOPs utilisation (all FLOPs counted, recompute included)."""
        return self.flops.total * self.tokens_per_s / self.peak_flops


def _fp32_fraction(gpu: GPUSpec) -> float:
    """fp32 matmul speed as a fraction of the dense bf16 tensor peak. PyTorch does not use TF32 for matmuls by
    default (``torch.backends.cuda.matmul.allow_tf32 = False`` since 1.12). Datasheets: RTX 3090/4090/5090 fp32
    ≈ ½ of their fp32-accumulate tensor peak; A10/L4/L40/L40S/A40 ≈ ¼; A100 19.5/312, H100 67/989, V100 15.7/125
    ≈ 1/8-1/16."""
    if gpu.key.startswith("rtx"):
        return 0.5
    if gpu.key in ("a10", "a10g", "l4", "l40", "l40s", "a40"):
        return 0.25
    return 1 / 12


def gpu_rates(gpu: GPUSpec, a: TimeAssumptions = DEFAULT_ASSUMPTIONS) -> tuple[float, float, float, bool]:
    """(bf16 FLOP/s, memory bytes/s, host link bytes/s, assumed) with the fallbacks for a size-only GPU."""
    assumed = gpu.bf16_tflops <= 0 or gpu.memory_bandwidth_gbs <= 0
    flops = (gpu.bf16_tflops if gpu.bf16_tflops > 0 else a.fallback_tflops) * 1e12
    bw = (gpu.memory_bandwidth_gbs if gpu.memory_bandwidth_gbs > 0 else a.fallback_bandwidth_gbs) * 1e9
    link = (gpu.host_link_gbs if gpu.host_link_gbs > 0 else a.fallback_host_link_gbs) * 1e9
    return flops, bw, link, assumed


def _layer_matmul_weights(m: ModelSpec) -> int:
    """Matmul weights one token touches in one decoder layer (MoE: only its routed experts)."""
    total = 0
    for lin in layer_linears(m):
        copies = m.experts_per_token if (m.is_moe and lin.per_layer == m.num_experts) else lin.per_layer
        total += copies * lin.in_features * lin.out_features
    return total


def _attention_keys(m: ModelSpec, train: TrainSpec, skips_masked: bool) -> float:
    """Mean keys per query summed over the layers, as the kernel computes them."""
    L = train.seq_len
    n_sliding = min(m.sliding_layers, m.num_layers) if m.sliding_window else 0
    n_global = m.num_layers - n_sliding
    if not skips_masked:
        return float(m.num_layers * L)  # eager (or a masked kernel) computes every L×L score, then masks
    W = m.sliding_window
    sliding = (W * (1 - W / (2 * L)) if L > W else L / 2) if n_sliding else 0.0
    return n_global * L / 2 + n_sliding * sliding


def attention_skips_masked(train: TrainSpec) -> bool:
    """Whether the attention kernel skips the masked half: flash, or SDPA without an explicit mask (then PyTorch
    picks the flash or memory-efficient kernel with ``is_causal``)."""
    return train.attn is Attention.FLASH2 or (train.attn is Attention.SDPA and not padded_sdpa(train))


@lru_cache(maxsize=8192)
def flops_per_token(m: ModelSpec, train: TrainSpec) -> Flops:
    """FLOPs per token of one micro-step (see the module docstring for each term's source)."""
    wb = weight_budget(m, train)
    nl, ntl = m.num_layers, wb.trainable_layers
    layer_w = _layer_matmul_weights(m)
    head_w = m.vocab_size * m.hidden_size
    adapter_w = sum(a.params for a in wb.adapted) if train.adapters else 0  # r·(in+out) per adapted linear
    if train.lora is not None and train.lora.dora and train.adapters:
        adapter_w -= sum(a.linear.out_features * a.linear.per_layer for a in wb.adapted)  # magnitude: not a matmul
    skips = attention_skips_masked(train)
    attn_fwd_all = 4 * m.q_dim * _attention_keys(m, train, skips)  # QKᵀ + AV over all layers
    attn_fwd_layer = attn_fwd_all / nl
    attn_bwd_factor = 2.5 if skips else 2.0

    matmul_fwd = 2 * (nl * (layer_w + adapter_w) + head_w)
    forward = matmul_fwd + attn_fwd_all
    # Backward: the input gradient of every matmul from lm_head down to the lowest trained layer; the weight
    # gradient of the trainable ones only.
    grad_input = 2 * (ntl * (layer_w + adapter_w) + head_w) if ntl or wb.head_trainable else 0
    if train.method is Method.FULL:
        trainable_w = nl * layer_w + (head_w if wb.head_trainable else 0)
    elif train.method is Method.FREEZE:
        trainable_w = ntl * layer_w
    else:
        trainable_w = nl * adapter_w
    backward = grad_input + 2 * trainable_w + attn_bwd_factor * attn_fwd_layer * ntl
    recompute = ntl * (2 * (layer_w + adapter_w) + attn_fwd_layer) if train.grad_ckpt else 0.0
    return Flops(
        forward=float(forward),
        backward=float(backward),
        recompute=float(recompute),
        matmul_forward=float(matmul_fwd),
        attention_forward=float(attn_fwd_all),
    )


def _optimizer_bytes_per_param(train: TrainSpec, b: int) -> tuple[float, int]:
    """(bytes read + written per trainable parameter by the update, kernels per tensor when per-tensor)."""
    opt = train.optimizer
    if opt is Optimizer.ADAMW_FUSED:
        return 7 * b, 0  # read p, g, m, v; write p, m, v — one fused kernel (torch _fused_adamw_)
    if opt in (Optimizer.ADAMW, Optimizer.ADAMW_FORLOOP):
        # _multi_tensor_adamw: weight-decay mul_ (2), lerp_ (3), mul_ (2), addcmul_ (3), sqrt (2), div_ (2),
        # add_ (2), addcdiv_ (4): 20 tensor passes of b bytes. The for-loop version does the same per tensor.
        return 20 * b, (10 if opt is Optimizer.ADAMW_FORLOOP else 0)
    if opt in (Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT):
        return 3 * b + 4, 0  # p, g read, p written; two uint8 states read and written
    if opt is Optimizer.LION_8BIT:
        return 3 * b + 2, 0
    if opt is Optimizer.PAGED_ADAMW_32BIT:
        return 3 * b + 16, 0
    if opt is Optimizer.LION:
        return 3 * b + 8, 0
    if opt is Optimizer.ADAFACTOR:
        return 40.0, 12  # fp32 copies of p, g and the update per tensor, factored statistics (HF Adafactor)
    return (5 * b if train.sgd_momentum > 0 else 3 * b), 0


@lru_cache(maxsize=8192)
def _memory_bytes_per_micro_step(m: ModelSpec, train: TrainSpec, a: TimeAssumptions) -> float:
    """Elementwise traffic and dequantisation bytes of one micro-step (dequantisation scaled to full-bandwidth
    bytes by its efficiency)."""
    p = step_parts(m, train)
    wb = p.weights
    layers_bytes = p.layer_bytes * wb.trainable_layers + p.layer_scores_bytes * wb.trainable_layers
    frozen_below = (m.num_layers - wb.trainable_layers) * (p.layer_bytes + p.layer_scores_bytes)  # forward only
    recompute = p.layer_bytes * wb.trainable_layers if train.grad_ckpt else 0
    traffic = a.elementwise_passes * layers_bytes + frozen_below + 2 * recompute
    traffic += p.logits_forward + p.logits_backward
    if train.quant is not None:
        # Each pass over a quantised weight reads its packed codes and writes a compute-dtype copy.
        base = m.num_layers * _layer_matmul_weights(m)
        per = (0.5 if train.quant.bits == 4 else 1.0) + train.precision.compute.bytes
        passes = 2 + (1 if train.grad_ckpt else 0)
        traffic += passes * base * per / a.dequant_bandwidth_fraction
    return float(traffic)


def _kernels_per_micro_step(m: ModelSpec, train: TrainSpec, a: TimeAssumptions) -> float:
    wb = weight_budget(m, train)
    adapters = len(wb.adapted) if train.adapters else 0
    per_layer = a.kernels_per_layer_forward + a.kernels_per_adapter * adapters
    fwd = m.num_layers * per_layer + 20  # embedding, final norm, lm_head, loss
    bwd = a.backward_kernel_factor * (wb.trainable_layers * per_layer + 20)
    rec = wb.trainable_layers * per_layer if train.grad_ckpt else 0
    return fwd + bwd + rec


# DeepSpeed ZeRO-Offload's per-parameter GPU work (module docstring): launches per trainable tensor at the
# accumulation boundary, and on each other micro-step.
_OFFLOAD_BOUNDARY_KERNELS = 5
_OFFLOAD_ACCUMULATE_KERNELS = 3


def _trainable_tensors(m: ModelSpec, train: TrainSpec) -> int:
    wb = weight_budget(m, train)
    if train.adapters:
        return 2 * len(wb.adapted) * m.num_layers
    per_layer = len(layer_linears(m)) + m.norms_per_layer
    if train.method is Method.FREEZE:
        return per_layer * wb.trainable_layers
    return per_layer * m.num_layers + 3


def step_time(m: ModelSpec, train: TrainSpec, gpu: GPUSpec, a: TimeAssumptions = DEFAULT_ASSUMPTIONS) -> StepTime:
    """Predicted seconds per optimizer step of ``train`` (``micro_batch`` × ``grad_accum``) on ``gpu``."""
    return _step_time(m, train, gpu, a)


@lru_cache(maxsize=16384)
def _step_time(m: ModelSpec, train: TrainSpec, gpu: GPUSpec, a: TimeAssumptions) -> StepTime:
    peak, bw, link, assumed = gpu_rates(gpu, a)
    if train.precision is Precision.FP32:
        peak *= _fp32_fraction(gpu)
    fl = flops_per_token(m, train)
    T = train.tokens
    # Tokens at which a weight-streaming GEMM turns compute-bound: the ops:byte ratio, scaled by the compute
    # dtype (fp32 weights are twice the bytes per FLOP).
    t_half = peak / bw * (train.precision.compute.bytes / 2)
    u = a.mfu_max * T / (T + t_half)
    compute = fl.total * T / (peak * u)
    memory = _memory_bytes_per_micro_step(m, train, a) / bw
    launches = _kernels_per_micro_step(m, train, a) * a.launch_s
    micro = max(compute + memory, launches) + a.micro_step_fixed_s

    wb = weight_budget(m, train)
    P = wb.trainable_params
    ranks = train.world_size if train.zero_stage >= 1 else 1
    P_local = P / ranks
    b = wb.trainable_dtype.bytes
    optimizer = a.optimizer_fixed_s
    offload = 0.0
    if train.offload_optimizer and train.zero_stage >= 1:
        # ZeRO-Offload: fp32 gradients to the host each micro-step (and partial sums back while accumulating),
        # the CPU Adam over fp32 master weights and two states (read p, g, m, v; write p, m, v: 28 bytes), the
        # updated low-precision weights back once per optimizer step.
        lowp = train.precision.compute.bytes
        d2h = 4 * P_local * train.grad_accum / link
        h2d = (4 * P_local * (train.grad_accum - 1) + lowp * P_local) / link
        offload = max(d2h, h2d) + 28 * P_local / (a.host_memory_gbs * 1e9)
        per_tensor = _OFFLOAD_BOUNDARY_KERNELS + _OFFLOAD_ACCUMULATE_KERNELS * (train.grad_accum - 1)
        offload += per_tensor * _trainable_tensors(m, train) / ranks * a.launch_s
    else:
        per_param, kernels_per_tensor = _optimizer_bytes_per_param(train, b)
        clip = 3 * b  # clip_grad_norm_: a norm pass (read) and a scaling pass (read + write)
        optimizer += P_local * (per_param + clip) / bw
        optimizer += kernels_per_tensor * _trainable_tensors(m, train) * a.launch_s
    total = train.grad_accum * micro + optimizer + offload
    tokens = T * train.grad_accum * train.world_size
    return StepTime(
        flops=fl,
        tokens_per_micro_batch=T,
        micro_steps=train.grad_accum,
        utilisation=u,
        compute_s=compute,
        memory_s=memory,
        launch_s=launches,
        fixed_s=a.micro_step_fixed_s,
        micro_step_s=micro,
        optimizer_s=optimizer,
        offload_s=offload,
        step_s=total,
        tokens_per_step=tokens,
        tokens_per_s=tokens / total,
        peak_flops=peak,
        assumed_gpu=assumed,
    )
