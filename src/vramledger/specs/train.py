"""The training setup: method, precision, optimizer, shapes and switches. Frozen and validated on creation."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields
from typing import Any

from vramledger.errors import VramledgerError
from vramledger.specs.cache import CacheKind
from vramledger.specs.distributed import Sharding, ZeroBuffers
from vramledger.specs.framework import ModelCode
from vramledger.specs.load import LoadPath


class DType(str, enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def bytes(self) -> int:
        return 4 if self is DType.FP32 else 2


class Method(str, enum.Enum):
    FULL = "full"
    FREEZE = "freeze"
    LORA = "lora"
    QLORA = "qlora"


class Precision(str, enum.Enum):
    """How parameters are stored and how the forward computes.

    ``*-mixed`` is torch autocast (AMP) as the HF Trainer and LLaMA-Factory run it: trainable parameters stay
    fp32 (they are the master weights), frozen ones are loaded in the compute dtype, and matmuls run in the
    compute dtype. ``*-true`` is "pure" (LLaMA-Factory's ``pure_bf16``): every parameter, gradient and optimizer
    state in that dtype (Lightning's names for both).
    """

    FP32 = "fp32"
    BF16_MIXED = "bf16-mixed"
    FP16_MIXED = "fp16-mixed"
    BF16 = "bf16-true"
    FP16 = "fp16-true"

    @property
    def compute(self) -> DType:
        return _COMPUTE[self.value]

    @property
    def mixed(self) -> bool:
        return self in (Precision.BF16_MIXED, Precision.FP16_MIXED)

    @property
    def trainable(self) -> DType:
        """dtype of trainable parameters (and so of their gradients and torch optimizer states)."""
        return DType.FP32 if self in (Precision.FP32, Precision.BF16_MIXED, Precision.FP16_MIXED) else self.compute

    @property
    def frozen(self) -> DType:
        """dtype of frozen parameters (loaded in the compute dtype)."""
        return self.compute


_COMPUTE = {
    "fp32": DType.FP32,
    "bf16-mixed": DType.BF16,
    "bf16-true": DType.BF16,
    "fp16-mixed": DType.FP16,
    "fp16-true": DType.FP16,
}


class Optimizer(str, enum.Enum):
    """Optimizer names as the HF Trainer spells them (``TrainingArguments.optim``)."""

    ADAMW = "adamw_torch"
    """torch.optim.AdamW with its default implementation on CUDA: foreach."""
    ADAMW_FUSED = "adamw_torch_fused"
    ADAMW_FORLOOP = "adamw_torch_forloop"
    """torch.optim.AdamW(foreach=False): one parameter at a time."""
    ADAMW_8BIT = "adamw_8bit"
    PAGED_ADAMW_8BIT = "paged_adamw_8bit"
    PAGED_ADAMW_32BIT = "paged_adamw_32bit"
    ADAFACTOR = "adafactor"
    SGD = "sgd"
    LION = "lion_32bit"
    LION_8BIT = "lion_8bit"


class Attention(str, enum.Enum):
    EAGER = "eager"
    SDPA = "sdpa"
    FLASH2 = "flash_attention_2"


class Loss(str, enum.Enum):
    STANDARD = "standard"
    """transformers' ForCausalLMLoss: full logits, upcast to fp32, cross-entropy."""
    FUSED = "fused"
    """Fused linear cross-entropy (Liger ``LigerFusedLinearCrossEntropyLoss``): logits never materialised whole."""
    CHUNKED = "chunked"
    """Logits and loss computed in chunks of tokens, each chunk's log-softmax kept (torchtune's
    ``CEWithChunkedOutputLoss``, LitGPT's ``chunked_cross_entropy``)."""
    CHUNKED_NLL = "chunked_nll"
    """TRL's ``loss_type: chunked_nll`` (SFTTrainer's default): lm_head and the loss per chunk of tokens, each chunk
    under ``torch.utils.checkpoint``, so nothing of a chunk's logits is kept from forward into backward."""


TRL_CHUNK_TOKENS = 256
"""trl ``trl/trainer/sft_trainer.py`` ``_CHUNKED_LM_HEAD_CHUNK_SIZE = 256``: the tokens per chunk of
``Loss.CHUNKED_NLL``, a constant (no setting of TRL's changes it)."""


class EvalLogits(str, enum.Enum):
    """What the HF Trainer's eval loop keeps of each eval batch's logits (trainer.py ``evaluation_loop``)."""

    NONE = "none"
    """``prediction_loss_only``: no ``compute_metrics`` (``Trainer.evaluate`` passes ``prediction_loss_only=True``
    then), only the loss. LLaMA-Factory's default (``compute_accuracy: false``, no ``predict_with_generate``)."""
    FULL = "full"
    """``compute_metrics`` without ``preprocess_logits_for_metrics``: B·L·V logits per eval batch, kept."""
    ARGMAX = "argmax"
    """``preprocess_logits_for_metrics`` reducing to token ids (LLaMA-Factory ``compute_accuracy``:
    ``sft/metric.py eval_logit_processor`` = ``torch.argmax(logits, -1)``): B·L int64 per batch, kept."""


_ALL = ("all",)


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraSpec:
    rank: int = 16
    """``r``: the adapter's inner dimension."""
    alpha: float = 32.0
    """``lora_alpha`` (scales the update; no memory effect)."""
    targets: tuple[str, ...] = _ALL
    """Module names to adapt (``q_proj``, ``v_proj``, …) or ``("all",)`` for every linear layer but the output;
    ``lm_head`` adds an adapter on the output layer (with ``all``: every linear and the head, LitGPT's
    ``lora_head``)."""
    dropout: float = 0.0
    """``lora_dropout``: above 0 each adapted projection saves a dropout mask and a dropped copy of its input."""
    dora: bool = False
    """``use_dora``: weight-decomposed LoRA (a magnitude vector and a per-forward weight norm)."""
    adapter_fp32: bool = True
    """PEFT's ``autocast_adapter_dtype=True`` default keeps adapter weights fp32 over a bf16/fp16 base."""
    modules_to_save: tuple[str, ...] = ()
    """Modules trained in full beside the adapters (PEFT ``modules_to_save``, axolotl ``lora_modules_to_save``,
    LLaMA-Factory ``additional_target``): ``embed_tokens`` and/or ``lm_head``. PEFT's ``ModulesToSaveWrapper``
    keeps the frozen original and trains a copy, with its gradient and optimizer state."""
    parameters: tuple[str, ...] = ()
    """PEFT's ``target_parameters`` (axolotl and TRL ``lora_target_parameters``): parameters adapted through
    ``ParamWrapper`` rather than modules, named as PEFT matches them, the whole path or a dotted suffix of it
    (``mlp.experts.gate_up_proj``, ``23.mlp.experts.down_proj``): fused 3-D expert weights, a bare router weight."""

    def __post_init__(self) -> None:
        if isinstance(self.parameters, str):
            object.__setattr__(self, "parameters", tuple(t.strip() for t in self.parameters.split(",") if t.strip()))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int):
            raise VramledgerError(f"lora rank must be an integer (got {self.rank!r}); try --lora-rank 16")
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", tuple(t.strip() for t in self.targets.split(",") if t.strip()))
        if self.rank < 1:
            raise VramledgerError(f"lora rank must be a positive integer (got {self.rank}); try --lora-rank 16")
        if not (math.isfinite(self.alpha) and self.alpha >= 0):
            raise VramledgerError(f"lora alpha must be a finite number ≥ 0 (got {self.alpha}); e.g. twice the rank")
        if not (math.isfinite(self.dropout) and 0.0 <= self.dropout < 1.0):
            raise VramledgerError(f"lora dropout must be in [0, 1) (got {self.dropout})")
        if not self.targets and not self.parameters:
            raise VramledgerError("lora targets are empty; pass --lora-targets all or e.g. q_proj,v_proj")
        if self.parameters and (self.dropout > 0 or self.dora):
            # PEFT 0.21 tuners/lora/layer.py ParamWrapper.__init__/update_layer raise ValueError for both
            what = f"lora_dropout {self.dropout}" if self.dropout > 0 else "use_dora"
            raise VramledgerError(
                f"lora target parameters: PEFT's ParamWrapper does not work with {what}; set lora_dropout 0 and "
                "use_dora false, or drop the target parameters"
            )

    @property
    def all_linear(self) -> bool:
        return any(t.lower() in ("all", "all-linear", "all_linear") for t in self.targets)

    @property
    def head(self) -> bool:
        """An adapter on the output layer (``lm_head`` among the targets)."""
        return "lm_head" in self.targets

    @property
    def layer_targets(self) -> tuple[str, ...]:
        """The targets inside the decoder layers (``lm_head`` removed)."""
        return tuple(t for t in self.targets if t != "lm_head")


@dataclass(frozen=True, kw_only=True, slots=True)
class QuantSpec:
    """bitsandbytes quantisation of the frozen base (QLoRA)."""

    bits: int = 4
    """4 (``Linear4bit``) or 8 (``Linear8bitLt``)."""
    quant_type: str = "nf4"
    """``nf4`` or ``fp4`` (4-bit only)."""
    double_quant: bool = True
    """``bnb_4bit_use_double_quant``: quantise the absmax constants too."""
    blocksize: int = 64
    """bitsandbytes' 4-bit block size (64 by default in ``bitsandbytes.functional.quantize_4bit``)."""
    compute_dtype: DType | None = None
    """``bnb_4bit_compute_dtype``: None is the dtype the weights were loaded in (what LLaMA-Factory, axolotl and
    TRL pass); ``BitsAndBytesConfig``'s own default is float32 (transformers ``utils/quantization_config.py``), so a
    config that names none computes in fp32: ``Linear4bit.forward`` casts the input ``x.to(self.compute_dtype)``
    and ``MatMul4Bit`` casts the dequantised weight ``.to(A.dtype)`` (bitsandbytes ``nn/modules.py``,
    ``autograd/_functions.py``)."""

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise VramledgerError(f"quantisation bits must be 4 or 8 (got {self.bits})")
        if self.quant_type not in ("nf4", "fp4"):
            raise VramledgerError(f"quant type must be nf4 or fp4 (got {self.quant_type!r})")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainSpec:
    """One training setup. Variants via ``dataclasses.replace``."""

    method: Method = Method.LORA
    precision: Precision = Precision.BF16_MIXED
    optimizer: Optimizer = Optimizer.ADAMW
    micro_batch: int = 1
    """Sequences per forward/backward (``per_device_train_batch_size``)."""
    seq_len: int = 2048
    """Tokens per sequence (padded or packed length of the longest batch)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step. Costs time, not memory (beyond one micro-batch's activations)."""
    grad_ckpt: bool = False
    """Gradient checkpointing per decoder layer (transformers' ``gradient_checkpointing_enable``)."""
    attn: Attention = Attention.SDPA
    loss: Loss = Loss.STANDARD
    loss_chunk_tokens: int = 1024
    """Tokens per chunk for ``Loss.CHUNKED`` (``Loss.CHUNKED_NLL`` uses TRL's fixed ``TRL_CHUNK_TOKENS``)."""
    lora: LoraSpec | None = None
    """Adapter settings (method lora/qlora); defaults applied when None."""
    quant: QuantSpec | None = None
    """Quantisation of the base (method qlora); nf4 with double quantisation when None."""
    peft_config: str | None = None
    """A PEFT ``adapter_config.json`` as canonical JSON (sorted keys, so the spec stays hashable): its
    ``peft_type`` (``IA3``, ``PREFIX_TUNING``, …) is the adapter method, trained on the base that ``method``
    (lora or qlora) sets; for ``LORA`` the ``lora`` field carries its fields (``adapters.peft_config.peft_changes``
    builds both). None: LoRA as ``lora`` describes it."""
    freeze_trainable_layers: int = 2
    """For method ``freeze``: how many of the last decoder layers train (LLaMA-Factory's default is 2)."""
    sgd_momentum: float = 0.0
    """SGD momentum: above 0, one momentum buffer per parameter."""
    base_dtype: DType | None = None
    """dtype the frozen weights are loaded in, when not the compute dtype (TRL loads fp32 by default)."""
    packing: bool = False
    """Sequences packed to ``seq_len`` (every micro-batch is full length)."""
    # -- evaluation (the HF Trainer's eval loop) --------------------------------------------------------------
    eval_batch: int | None = None
    """``per_device_eval_batch_size``; None when no evaluation runs."""
    eval_seq_len: int | None = None
    """Evaluation sequence length (defaults to ``seq_len``)."""
    eval_accumulation_steps: int | None = None
    """HF ``eval_accumulation_steps``: None keeps every eval step's logits on the GPU until the end."""
    eval_steps_total: int = 0
    """Eval batches per evaluation (for logits accumulated on the GPU); 0 when unknown."""
    eval_logits: EvalLogits = EvalLogits.NONE
    """What the eval loop keeps of each batch's logits for metrics (``compute_metrics`` and
    ``preprocess_logits_for_metrics``)."""
    predict_with_generate: bool = False
    generation_max_new_tokens: int = 0
    generation_cache: CacheKind = CacheKind.DYNAMIC
    """The KV cache eval generation keeps: ``DynamicCache`` (transformers ≥ 4.36 and 5.x) unless set to the legacy
    tuple cache of older versions (``analytic/kv_cache.py``)."""
    # -- several GPUs ------------------------------------------------------------------------------------------
    world_size: int = 1
    """Data-parallel ranks (GPUs) sharing ZeRO/FSDP shards."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage (0-3); FSDP FULL_SHARD ≈ 3, SHARD_GRAD_OP ≈ 2."""
    offload_optimizer: bool = False
    """Optimizer states (and the fp32 master copy) on the CPU."""
    offload_params: bool = False
    fsdp: Sharding | None = None
    """PyTorch FSDP's sharding strategy; None: no FSDP (DDP when ``world_size > 1`` and ``zero_stage == 0``)."""
    fsdp_version: int = 2
    """1: ``FullyShardedDataParallel`` (flat parameters); 2: ``fully_shard`` (per-parameter DTensors)."""
    gpus_per_node: int = 8
    """GPUs per node: HYBRID_SHARD shards over these only."""
    zero_buffers: ZeroBuffers | None = None
    """DeepSpeed's bucket sizes (its defaults when None)."""
    # -- training-loop features (analytic/loop.py, analytic/load.py) ---------------------------------------------
    optimizer_in_backward: bool = False
    """torchtune ``optimizer_in_bwd``: each parameter stepped as its gradient is ready, the gradient freed."""
    offload_activations: bool = False
    """torchtune ``enable_activation_offloading``: saved activations to CPU memory, prefetched in backward."""
    compile: bool = False
    """``torch.compile``: accepted and estimated as eager, with a stated assumption (analytic/loop.py)."""
    load_path: LoadPath = LoadPath.TRANSFORMERS
    """How a quantised base is put on the GPU (analytic/load.py)."""
    model_code: ModelCode = ModelCode.TRANSFORMERS
    """Whose decoder layers run: transformers + PEFT, or LitGPT's own (analytic/litgpt.py)."""
    legacy_bitsandbytes: bool = False
    """bitsandbytes before 0.43.2, whose ``MatMul4Bit`` keeps its input (``matmul4bit_keeps_input``); the LitGPT
    codes imply it."""
    # -- images (vision-language models: analytic/vision.py) ---------------------------------------------------
    images: int = 0
    """Images per sample (``--images``); 0: text only."""
    image_size: tuple[int, int] | None = None
    """(width, height) of each image in pixels as the dataset holds it; None: the model's default resolution."""
    image_max_pixels: int | None = None
    """LLaMA-Factory ``image_max_pixels``: a larger image is first scaled down to this many pixels
    (``data/mm_plugin.py`` ``_preprocess_image``); None: no such step."""
    image_min_pixels: int | None = None
    """LLaMA-Factory ``image_min_pixels``: a smaller image is first scaled up to this many pixels."""
    freeze_vision_tower: bool = False
    """No adapters in the vision tower and projector, and no gradient through them under full fine-tuning
    (LLaMA-Factory ``freeze_vision_tower``/``freeze_multi_modal_projector``, both true by default:
    ``model/model_utils/visual.py`` ``get_forbidden_modules``); False: PEFT's ``all-linear`` adapts the tower's
    linears too. Under full fine-tuning the tower's weights stay frozen in their load dtype (analytic/vision.py
    ``full_tuning_tower_params``)."""
    seq_includes_images: bool = False
    """The sequence length already counts the image tokens (LLaMA-Factory truncates to ``cutoff_len`` after the
    image placeholders are expanded); False: the language model sees ``seq_len`` plus the images' tokens."""
    warnings: tuple[str, ...] = field(default=(), compare=False)
    """Notes gathered while building this spec (e.g. from a config file), shown with the result."""

    def __post_init__(self) -> None:
        _coerce_enums(self)
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise VramledgerError(f"{name} must be an integer (got {value!r})")
        if not (math.isfinite(self.sgd_momentum) and 0.0 <= self.sgd_momentum < 1.0):
            raise VramledgerError(f"SGD momentum must be in [0, 1) (got {self.sgd_momentum}); e.g. --sgd-momentum 0.9")
        if self.micro_batch < 1:
            raise VramledgerError(f"batch must be a positive integer (got {self.micro_batch}); try --batch 1")
        if self.seq_len < 1:
            raise VramledgerError(f"sequence length must be a positive integer (got {self.seq_len}); try --seq 2048")
        if self.grad_accum < 1:
            raise VramledgerError(f"gradient accumulation must be at least 1 (got {self.grad_accum})")
        if self.loss_chunk_tokens < 1:
            raise VramledgerError("loss chunk size must be a positive number of tokens")
        if self.world_size < 1:
            raise VramledgerError("world size must be at least 1")
        if self.zero_stage not in (0, 1, 2, 3):
            raise VramledgerError(f"ZeRO stage must be 0, 1, 2 or 3 (got {self.zero_stage})")
        if self.fsdp is not None and self.zero_stage:
            raise VramledgerError(
                f"FSDP and DeepSpeed ZeRO-{self.zero_stage} exclude each other: pass --fsdp or --zero, not both"
            )
        if self.fsdp_version not in (1, 2):
            raise VramledgerError(f"fsdp version must be 1 or 2 (got {self.fsdp_version}); try --fsdp-version 2")
        if self.gpus_per_node < 1:
            raise VramledgerError("gpus per node must be at least 1; try --nproc-per-node 8")
        if self.eval_batch is not None and self.eval_batch < 1:
            raise VramledgerError(f"eval batch must be a positive integer (got {self.eval_batch})")
        if self.eval_seq_len is not None and self.eval_seq_len < 1:
            raise VramledgerError(f"eval sequence length must be a positive integer (got {self.eval_seq_len})")
        if self.eval_accumulation_steps is not None and self.eval_accumulation_steps < 1:
            raise VramledgerError(
                f"eval_accumulation_steps must be a positive integer (got {self.eval_accumulation_steps}); e.g. 1"
            )
        if self.eval_steps_total < 0 or self.generation_max_new_tokens < 0:
            raise VramledgerError("eval steps and generation max new tokens must be 0 or more")
        if self.optimizer_in_backward and self.grad_accum > 1:
            raise VramledgerError(
                "optimizer in backward cannot accumulate gradients (torchtune refuses it too); set "
                "gradient_accumulation_steps 1 or turn optimizer_in_bwd off"
            )
        if self.images < 0:
            raise VramledgerError(f"images per sample must be 0 or more (got {self.images}); e.g. --images 1")
        if self.image_size is not None and (
            len(self.image_size) != 2
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.image_size)
        ):
            raise VramledgerError(
                f"image size must be two positive integers (got {self.image_size!r}); e.g. --image-size 1024x768"
            )
        for name in ("image_max_pixels", "image_min_pixels"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise VramledgerError(f"{name} must be a positive number of pixels (got {getattr(self, name)})")
        if self.freeze_trainable_layers < 0:
            raise VramledgerError("freeze: the number of trainable layers must be 0 or more")
        if self.method is Method.QLORA and self.quant is None:
            object.__setattr__(self, "quant", QuantSpec())
        if self.method in (Method.LORA, Method.QLORA) and self.lora is None:
            object.__setattr__(self, "lora", LoraSpec())
        if self.quant is not None and self.method is not Method.QLORA:
            raise VramledgerError(
                f"a quantised base can only be trained with adapters: use --method qlora (got --method "
                f"{self.method.value} with quantisation)"
            )
        if self.peft_config is not None and not self.adapters:
            raise VramledgerError(
                f"a PEFT config trains adapters: use --method lora or qlora (got --method {self.method.value})"
            )
        if self.attn is Attention.FLASH2 and self.precision is Precision.FP32:
            raise VramledgerError("flash_attention_2 runs only in fp16/bf16; use --precision bf16-mixed or --attn sdpa")

    @property
    def adapters(self) -> bool:
        return self.method in (Method.LORA, Method.QLORA)

    @property
    def peft_type(self) -> str | None:
        """The PEFT method of ``peft_config`` (``LORA``, ``IA3``, …), None without one."""
        if self.peft_config is None:
            return None
        import json

        return str(json.loads(self.peft_config).get("peft_type", "LORA")).upper()

    @property
    def frozen_dtype(self) -> DType:
        """dtype of frozen (non-quantised) weights: as loaded, else the compute dtype."""
        return self.base_dtype or self.precision.frozen

    @property
    def matmul4bit_keeps_input(self) -> bool:
        """Whether bitsandbytes' 4-bit matmul keeps its input for backward: before 0.43.2 only
        (``ModelCode.matmul4bit_keeps_input`` gives the sources)."""
        return self.legacy_bitsandbytes or self.model_code.matmul4bit_keeps_input

    @property
    def keeps_unsharded_grads(self) -> bool:
        """FSDP1 sharding under gradient accumulation: the accumulating micro-steps run inside ``no_sync`` (Fabric's
        ``no_backward_sync``, accelerate's ``accumulate``), so every rank keeps unsharded gradients between optimizer
        steps (analytic/distributed/fsdp_no_sync.py)."""
        return (
            self.fsdp is not None
            and self.fsdp.shards_params
            and self.fsdp_version == 1
            and self.grad_accum > 1
            and self.world_size > 1
        )

    @property
    def distributed(self) -> bool:
        """Several GPUs, or one of the multi-GPU engines (ZeRO, FSDP, offload) even on one."""
        return (
            self.world_size > 1
            or bool(self.zero_stage)
            or self.fsdp is not None
            or self.offload_optimizer
            or self.offload_params
        )

    def at_shape(self, micro_batch: int, seq_len: int) -> TrainSpec:
        """This setup at another micro-batch and length, without running ``__post_init__`` again: the other fields
        were checked and coerced when this one was made, and the shape alone cannot invalidate them. The reserve's
        searches over shapes (analytic/reserve/runs.py) make hundreds of thousands of these, where
        ``dataclasses.replace`` spent most of a ``plan``'s time validating."""
        if micro_batch < 1 or seq_len < 1:
            raise VramledgerError(f"a shape needs a positive batch and length (got {micro_batch} x {seq_len})")
        new = object.__new__(TrainSpec)
        for name in _TRAIN_FIELDS:
            object.__setattr__(new, name, getattr(self, name))
        object.__setattr__(new, "micro_batch", micro_batch)
        object.__setattr__(new, "seq_len", seq_len)
        return new

    @property
    def tokens(self) -> int:
        """Tokens per micro-batch."""
        return self.micro_batch * self.seq_len


_TRAIN_FIELDS = tuple(f.name for f in fields(TrainSpec))

ENUM_FIELDS: dict[str, type[enum.Enum]] = {
    "method": Method,
    "precision": Precision,
    "optimizer": Optimizer,
    "attn": Attention,
    "loss": Loss,
    "eval_logits": EvalLogits,
    "base_dtype": DType,
    "generation_cache": CacheKind,
    "load_path": LoadPath,
    "model_code": ModelCode,
}
"""TrainSpec fields that take an Enum: a string naming one of its values is accepted (``method="lora"``)."""
_INT_FIELDS = (
    "micro_batch",
    "seq_len",
    "grad_accum",
    "loss_chunk_tokens",
    "freeze_trainable_layers",
    "eval_batch",
    "eval_seq_len",
    "eval_accumulation_steps",
    "eval_steps_total",
    "generation_max_new_tokens",
    "world_size",
    "zero_stage",
    "images",
    "image_max_pixels",
    "image_min_pixels",
)


def _coerce_enums(spec: Any) -> None:
    """Turn strings into the Enum members they name (``TrainSpec(method="lora")``), or say what is allowed."""
    for name, kind in ENUM_FIELDS.items():
        value = getattr(spec, name)
        if value is None or isinstance(value, kind):
            continue
        if isinstance(value, str):
            key = value.strip().lower()
            for member in kind:
                if key in (member.value, member.name.lower()):
                    object.__setattr__(spec, name, member)
                    break
            else:
                choices = ", ".join(repr(m.value) for m in kind)
                raise VramledgerError(f"TrainSpec {name}: unknown value {value!r}; choose one of {choices}")
        else:
            raise VramledgerError(f"TrainSpec {name}: expected a {kind.__name__} or its name (got {value!r})")
