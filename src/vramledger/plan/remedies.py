"""The remedies for an OOM, in the seeds' order, each as the variants of a TrainSpec (or of the model) it offers.

The order is the healthy one: fix the precision, shrink the micro-batch and accumulate (keeping the global
batch), checkpoint, fuse or chunk the loss, shrink the optimizer state, train adapters instead of weights (and
quantise the base), offload the optimizer state to the CPU, use a fused attention kernel — and only then change
the task: a shorter sequence, a smaller model. Each remedy has a price, which the time model prices:
accumulation saves only one micro-batch's activations and costs more, smaller kernels; checkpointing costs a
recomputed forward; offload costs PCIe transfers and a CPU optimizer; 8-bit states and QLoRA cost
(de)quantisation.

Variants are built with ``dataclasses.replace`` on the frozen TrainSpec, so they can be cached and compared.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

from vramledger.errors import VramledgerError
from vramledger.specs import (
    Attention,
    GPUSpec,
    LoraSpec,
    Loss,
    Method,
    ModelSpec,
    Optimizer,
    Precision,
    QuantSpec,
    TrainSpec,
)


class Remedy(str, enum.Enum):
    """A remedy, in the seeds' order (the order of the members): its title and the price it costs.

    A ``str`` enum, so that JSON and string comparisons see the key (``Remedy.GRAD_CKPT == "grad_ckpt"``).
    """

    PRECISION = "precision"
    MICRO_BATCH = "micro_batch"
    GRAD_CKPT = "grad_ckpt"
    LOSS = "loss"
    OPTIMIZER = "optimizer"
    ADAPTERS = "adapters"
    OFFLOAD = "offload"
    ATTENTION = "attention"
    SEQ_LEN = "seq_len"
    MODEL = "model"

    def __str__(self) -> str:
        return self.value

    @property
    def title(self) -> str:  # type: ignore[override]  # str.title is a method; a remedy's title is its name
        return _TITLES[self]

    @property
    def price(self) -> str:
        return _PRICES[self]

    @property
    def changes_task(self) -> bool:
        return self in (Remedy.SEQ_LEN, Remedy.MODEL)


_TITLES = {
    Remedy.PRECISION: "precision",
    Remedy.MICRO_BATCH: "smaller micro-batch + accumulation",
    Remedy.GRAD_CKPT: "gradient checkpointing",
    Remedy.LOSS: "fused / chunked loss",
    Remedy.OPTIMIZER: "optimizer state",
    Remedy.ADAPTERS: "LoRA / QLoRA / rank",
    Remedy.OFFLOAD: "CPU offload of optimizer state",
    Remedy.ATTENTION: "attention kernel",
    Remedy.SEQ_LEN: "shorter sequence",
    Remedy.MODEL: "smaller model",
}

_PRICES = {
    Remedy.PRECISION: "none on tensor-core GPUs (fp32 matmuls are slower)",
    Remedy.MICRO_BATCH: "more, smaller kernels per optimizer step; saves only one micro-batch's activations",
    Remedy.GRAD_CKPT: "a recomputed forward of every trained layer",
    Remedy.LOSS: "about none (chunks of the same matmul)",
    Remedy.OPTIMIZER: "(de)quantisation of 8-bit states; paged states spill to host memory under pressure",
    Remedy.ADAPTERS: "a different model update (adapters, not weights); QLoRA dequantises every weight per pass",
    Remedy.OFFLOAD: "PCIe transfers every micro-step and a CPU optimizer step",
    Remedy.ATTENTION: "none: fused kernels are faster",
    Remedy.SEQ_LEN: "CHANGES THE TASK: samples are truncated or split",
    Remedy.MODEL: "CHANGES THE TASK: a smaller model of the same family",
}

ORDER: tuple[Remedy, ...] = tuple(Remedy)
"""Remedies in the seeds' order."""

TITLES = {r.value: r.title for r in Remedy}
PRICE = {r.value: r.price for r in Remedy}
TASK_CHANGING = frozenset(r for r in Remedy if r.changes_task)

# FlashAttention-2 runs on Ampere, Ada and Hopper (Dao-AILab/flash-attention README, "Installation and
# features"), and on AMD MI200/MI300 through its ROCm backend; Blackwell is supported by recent releases.
_FA2_ARCHS = frozenset({"ampere", "ada", "hopper", "blackwell", "cdna2", "cdna3"})


@dataclass(frozen=True, kw_only=True, slots=True)
class Change:
    """One setting a remedy changed."""

    remedy: Remedy
    """Which remedy (its key, e.g. ``"grad_ckpt"``, is accepted and converted)."""
    setting: str
    before: str
    after: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "remedy", Remedy(self.remedy))

    @property
    def changes_task(self) -> bool:
        return self.remedy.changes_task

    def __str__(self) -> str:
        return f"{self.setting} {self.before} -> {self.after}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Variant:
    """A remedy applied: the new specs and what changed."""

    model: ModelSpec
    train: TrainSpec
    change: Change


def _v(m: ModelSpec, t: TrainSpec, key: str, setting: str, before: object, after: object, **kw: Any) -> Variant:
    return Variant(
        model=m,
        train=dataclasses.replace(t, **kw),
        change=Change(remedy=Remedy(key), setting=setting, before=str(before), after=str(after)),
    )


def divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def precision_variants(m: ModelSpec, t: TrainSpec, gpu: GPUSpec) -> list[Variant]:
    half = Precision.BF16_MIXED if gpu.supports_bf16 else Precision.FP16_MIXED
    if t.precision is Precision.FP32:
        out = [_v(m, t, "precision", "precision", t.precision.value, half.value, precision=half)]
        if t.method in (Method.FULL, Method.FREEZE) and gpu.supports_bf16:
            # AMP keeps fp32 weights and adds bf16 autocast copies: with short sequences it can use more memory
            # than fp32 (the planner drops a variant that saves nothing); pure bf16 always saves.
            out.append(_v(m, t, "precision", "precision", t.precision.value, "bf16-true", precision=Precision.BF16))
        return out
    if t.precision.mixed and t.method in (Method.FULL, Method.FREEZE) and gpu.supports_bf16:
        # LLaMA-Factory ``pure_bf16``: no fp32 master weights, bf16 optimizer states (updates rounded to bf16).
        return [_v(m, t, "precision", "precision", t.precision.value, "bf16-true", precision=Precision.BF16)]
    return []


def micro_batch_variants(m: ModelSpec, t: TrainSpec, global_batch: int) -> list[Variant]:
    """Every smaller divisor of the global batch, accumulating to keep it (largest first)."""
    out = []
    for d in sorted(divisors(global_batch), reverse=True):
        if d < t.micro_batch:
            out.append(
                _v(
                    m,
                    t,
                    "micro_batch",
                    "micro-batch x accum",
                    f"{t.micro_batch}x{t.grad_accum}",
                    f"{d}x{global_batch // d}",
                    micro_batch=d,
                    grad_accum=global_batch // d,
                )
            )
    return out


def grad_ckpt_variants(m: ModelSpec, t: TrainSpec) -> list[Variant]:
    return [] if t.grad_ckpt else [_v(m, t, "grad_ckpt", "gradient checkpointing", "off", "on", grad_ckpt=True)]


def loss_variants(m: ModelSpec, t: TrainSpec) -> list[Variant]:
    after = {
        Loss.STANDARD: (Loss.CHUNKED, Loss.FUSED),
        Loss.CHUNKED: (Loss.FUSED,),
        Loss.CHUNKED_NLL: (Loss.FUSED,),
        Loss.FUSED: (),
    }[t.loss]
    return [_v(m, t, "loss", "loss", t.loss.value, x.value, loss=x) for x in after]


def optimizer_variants(m: ModelSpec, t: TrainSpec, *, include_paged: bool = True) -> list[Variant]:
    if t.offload_optimizer:
        return []  # the optimizer runs on the CPU (DeepSpeed CPUAdam)
    o = t.optimizer
    after: tuple[Optimizer, ...] = ()
    if o is Optimizer.ADAMW:
        after = (Optimizer.ADAMW_FUSED, Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT)
    elif o in (Optimizer.ADAMW_FUSED, Optimizer.ADAMW_FORLOOP):
        after = (Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT)
    elif o is Optimizer.PAGED_ADAMW_32BIT:
        after = (Optimizer.PAGED_ADAMW_8BIT,)
    elif o is Optimizer.LION:
        after = (Optimizer.LION_8BIT,)
    if not include_paged:
        after = tuple(x for x in after if not x.value.startswith("paged"))
    return [_v(m, t, "optimizer", "optimizer", o.value, x.value, optimizer=x) for x in after]


def adapter_variants(m: ModelSpec, t: TrainSpec) -> list[Variant]:
    """Full → LoRA r16 or QLoRA r16 (nf4); LoRA → QLoRA; a rank above 8 → half of it. Not from method freeze:
    it saves activations only for its few trained layers, where LoRA on every layer saves them for all."""
    out: list[Variant] = []
    if t.method is Method.FREEZE:
        return out
    if t.method is Method.FULL:
        lora = LoraSpec(rank=16, alpha=32.0, adapter_fp32=t.precision is not Precision.BF16)
        out.append(_v(m, t, "adapters", "method", t.method.value, "lora r16", method=Method.LORA, lora=lora))
        out.append(
            _v(
                m,
                t,
                "adapters",
                "method",
                t.method.value,
                "qlora r16 nf4",
                method=Method.QLORA,
                lora=lora,
                quant=QuantSpec(),
            )
        )
        return out
    assert t.lora is not None
    if t.method is Method.LORA:
        out.append(_v(m, t, "adapters", "method", "lora", "qlora nf4", method=Method.QLORA, quant=QuantSpec()))
    if t.lora.rank > 8:
        r = max(8, t.lora.rank // 2)
        out.append(_v(m, t, "adapters", "LoRA rank", t.lora.rank, r, lora=dataclasses.replace(t.lora, rank=r)))
    return out + _expert_free_targets(m, t)


def _expert_free_targets(m: ModelSpec, t: TrainSpec) -> list[Variant]:
    """``all-linear`` on an MoE model whose fused experts PEFT adapts through ParamWrapper (analytic/activations.py
    ``merged_experts``: their adapters, states and a merged copy of every expert stack per forward) → the modules
    ``all-linear`` would pick without the conversion, named: PEFT converts only ``all-linear`` (transformers 5
    ``_convert_peft_config_moe``), so named targets adapt no expert stack (and on DeepSeek the dense and shared-expert
    MLPs instead)."""
    assert t.lora is not None
    if not t.lora.all_linear or t.peft_config is not None:
        return []
    from vramledger.analytic.params import layer_linears
    from vramledger.analytic.weights import weight_budget

    if all(a.linear.lora_targetable for a in weight_budget(m, t).adapted):
        return []
    names = tuple(dict.fromkeys(lin.name.split(".")[-1] for lin in layer_linears(m) if lin.lora_targetable))
    if not names:
        return []
    lora = dataclasses.replace(t.lora, targets=names, parameters=())  # named target parameters are experts too
    return [_v(m, t, "adapters", "LoRA targets", "all-linear", ",".join(names) + " (no experts)", lora=lora)]


def offload_variants(m: ModelSpec, t: TrainSpec) -> list[Variant]:
    """Optimizer state to the CPU. The analytic estimate models offload only under ZeRO (``step_parts``), which is
    also how it is done in practice on one GPU: DeepSpeed ZeRO-Offload (stage 2 + ``offload_optimizer``; LLaMA-Factory
    ``examples/deepspeed/ds_z2_offload_config.json``)."""
    if t.offload_optimizer:
        return []
    if t.zero_stage == 0:
        return [
            _v(m, t, "offload", "optimizer state", "GPU", "CPU (ZeRO-2 offload)", zero_stage=2, offload_optimizer=True)
        ]
    return [_v(m, t, "offload", "optimizer state", "GPU", "CPU", offload_optimizer=True)]


def attention_variants(m: ModelSpec, t: TrainSpec, gpu: GPUSpec) -> list[Variant]:
    out: list[Variant] = []
    fa2 = t.precision is not Precision.FP32 and (gpu.arch in _FA2_ARCHS or not gpu.arch)
    if t.attn is Attention.EAGER:
        out.append(_v(m, t, "attention", "attention", "eager", "sdpa", attn=Attention.SDPA))
    if t.attn is not Attention.FLASH2 and fa2:
        out.append(_v(m, t, "attention", "attention", t.attn.value, "flash_attention_2", attn=Attention.FLASH2))
    return out


def seq_variants(m: ModelSpec, t: TrainSpec, lengths: list[int]) -> list[Variant]:
    return [_v(m, t, "seq_len", "sequence length", t.seq_len, L, seq_len=L) for L in lengths if t.seq_len > L]


def smaller_models(m: ModelSpec, *, limit: int = 2) -> list[ModelSpec]:
    """Catalog models of the same family (``model_type``) with fewer parameters, largest first; those sharing the
    vocabulary (the same tokenizer generation) before the others."""
    from vramledger.analytic.params import count_params
    from vramledger.catalog import model_entries

    own = count_params(m)
    found: dict[tuple[str, int], ModelSpec] = {}
    for entry in model_entries().values():
        spec = entry.spec()
        n = count_params(spec)
        if spec.family == m.family and n < own:
            found.setdefault((spec.name, n), spec)
    ranked = sorted(found.values(), key=lambda s: (s.vocab_size != m.vocab_size, -count_params(s)))
    return ranked[:limit]


def model_variants(m: ModelSpec, t: TrainSpec) -> list[Variant]:
    return [
        Variant(model=s, train=t, change=Change(remedy=Remedy.MODEL, setting="model", before=m.name, after=s.name))
        for s in smaller_models(m)
    ]


def variants(key: str, m: ModelSpec, t: TrainSpec, gpu: GPUSpec, *, global_batch: int) -> list[Variant]:
    """The variants one remedy offers for this setup (seq_len's are built by the planner, which searches them)."""
    try:
        if key == "precision":
            return precision_variants(m, t, gpu)
        if key == "micro_batch":
            return micro_batch_variants(m, t, global_batch)
        if key == "grad_ckpt":
            return grad_ckpt_variants(m, t)
        if key == "loss":
            return loss_variants(m, t)
        if key == "optimizer":
            return optimizer_variants(m, t)
        if key == "adapters":
            return adapter_variants(m, t)
        if key == "offload":
            return offload_variants(m, t)
        if key == "attention":
            return attention_variants(m, t, gpu)
        if key == "model":
            return model_variants(m, t)
    except VramledgerError:
        return []  # a combination the specs reject (e.g. flash attention in fp32) is simply not offered
    if key == "seq_len":
        return []
    raise ValueError(f"unknown remedy {key!r}")
