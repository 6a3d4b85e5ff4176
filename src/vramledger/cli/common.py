"""Options shared by every command that takes a model and a training setup, and their resolution into specs.

Flags default to None so that we know which ones the user gave: a flag overrides a config file, which
overrides the framework's defaults (the adapters know those), which override ours (TrainSpec's defaults).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramledger.errors import VramledgerError
from vramledger.specs import (
    Attention,
    EvalLogits,
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

DEFAULT_HEADROOM = 0.08
"""Fraction of the GPU kept free by default: see README, "Why 8% headroom"."""

PRECISION_ALIASES = {
    "fp32": Precision.FP32,
    "32": Precision.FP32,
    "bf16": Precision.BF16_MIXED,
    "bf16-mixed": Precision.BF16_MIXED,
    "amp-bf16": Precision.BF16_MIXED,
    "fp16": Precision.FP16_MIXED,
    "fp16-mixed": Precision.FP16_MIXED,
    "amp-fp16": Precision.FP16_MIXED,
    "bf16-true": Precision.BF16,
    "pure-bf16": Precision.BF16,
    "bf16-pure": Precision.BF16,
    "fp16-true": Precision.FP16,
    "pure-fp16": Precision.FP16,
    "fp16-pure": Precision.FP16,
}

OPTIMIZER_ALIASES = {o.value: o for o in Optimizer} | {
    "adamw": Optimizer.ADAMW,
    "adamw-foreach": Optimizer.ADAMW,
    "adamw_torch_foreach": Optimizer.ADAMW,
    "adamw-fused": Optimizer.ADAMW_FUSED,
    "fused": Optimizer.ADAMW_FUSED,
    "adamw-forloop": Optimizer.ADAMW_FORLOOP,
    "adamw_bnb_8bit": Optimizer.ADAMW_8BIT,
    "adamw-8bit": Optimizer.ADAMW_8BIT,
    "paged-adamw-8bit": Optimizer.PAGED_ADAMW_8BIT,
    "paged_adamw": Optimizer.PAGED_ADAMW_32BIT,
    "paged-adamw-32bit": Optimizer.PAGED_ADAMW_32BIT,
    "lion": Optimizer.LION,
    "lion-8bit": Optimizer.LION_8BIT,
}


def _choice(table: dict[str, Any], field: str, value: str) -> Any:
    key = value.strip().lower()
    if key not in table:
        raise VramledgerError(f"{field}: unknown value {value!r}; choose one of {', '.join(sorted(table))}")
    return table[key]


def add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="catalog name or hub id (see `vramledger models`), or a config.json path")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides for --config (LLaMA-Factory style)")
    p.add_argument("--config", type=Path, help="a training config: LLaMA-Factory, HF TrainingArguments, TRL, axolotl")
    p.add_argument("--format", help="the config's kind, when it cannot be detected from its content")
    p.add_argument("--deepspeed", type=Path, help="a DeepSpeed JSON config")
    p.add_argument("--accelerate-config", type=Path, help="an accelerate (FSDP) YAML config")


def add_train_options(p: argparse.ArgumentParser) -> None:
    """Flags that describe the training setup (same for estimate, trace, fit, plan, measure)."""
    g = p.add_argument_group("training setup")
    g.add_argument("--method", help="full | freeze | lora | qlora (default lora)")
    g.add_argument("--lora-rank", type=int, help="LoRA rank r (default 16)")
    g.add_argument("--lora-alpha", type=float, help="LoRA alpha (default 2 × rank; no memory effect)")
    g.add_argument("--lora-targets", help="comma-separated module names, or 'all' (default all linear layers)")
    g.add_argument("--lora-dropout", type=float, help="LoRA dropout (default 0)")
    g.add_argument("--dora", action="store_true", default=None, help="weight-decomposed LoRA")
    g.add_argument("--quant", help="qlora base: nf4 | fp4 | int8 (default nf4)")
    g.add_argument("--no-double-quant", action="store_true", default=None, help="qlora without double quantisation")
    g.add_argument("--freeze-layers", type=int, help="method freeze: trainable last layers (default 2)")
    g.add_argument("--batch", type=int, help="micro-batch size per GPU (default 1)")
    g.add_argument("--seq", type=int, help="sequence length in tokens (default 2048)")
    g.add_argument("--accum", type=int, help="gradient accumulation steps (default 1)")
    g.add_argument(
        "--precision",
        help="bf16-mixed (=bf16) | fp16-mixed (=fp16) | bf16-true | fp16-true | fp32 (default bf16-mixed)",
    )
    g.add_argument("--optimizer", help="adamw_torch (foreach) | adamw_torch_fused | adamw_8bit | paged_adamw_8bit | "
                   "adafactor | sgd | lion_32bit | … (default adamw_torch)")
    g.add_argument("--sgd-momentum", type=float, help="SGD momentum (default 0)")
    ck = g.add_mutually_exclusive_group()
    ck.add_argument("--grad-ckpt", dest="grad_ckpt", action="store_true", default=None, help="gradient checkpointing")
    ck.add_argument("--no-grad-ckpt", dest="grad_ckpt", action="store_false", help="no gradient checkpointing")
    g.add_argument("--attn", help="eager | sdpa | flash_attention_2 (default sdpa)")
    g.add_argument("--loss", help="standard | fused (Liger) | chunked (default standard)")
    g.add_argument("--packing", action="store_true", default=None,
                   help="sequences packed to --seq (no padding mask); default: a padded batch when --batch > 1")
    g.add_argument("--eval-batch", type=int, help="evaluation batch size (adds an eval phase)")
    g.add_argument("--eval-seq", type=int, help="evaluation sequence length (default: --seq)")
    g.add_argument("--eval-logits", help="what eval keeps for metrics: none (loss only) | full | argmax (default none)")
    g.add_argument("--eval-accum", type=int, help="eval_accumulation_steps (default: unset, predictions stay on GPU)")
    g.add_argument("--eval-steps", type=int, help="eval batches per evaluation (for predictions kept on the GPU)")
    g.add_argument("--predict-with-generate", action="store_true", default=None, help="generate during evaluation")
    g.add_argument("--max-new-tokens", type=int, help="tokens generated per eval sequence (predict_with_generate)")
    add_distributed_options(p)


def add_gpu_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu", help="GPU for the verdict: a catalog name (see `vramledger gpus`) or a size like 24GiB")
    p.add_argument(
        "--headroom",
        type=float,
        help=f"fraction of GPU memory to keep free (default {DEFAULT_HEADROOM:g}; see README)",
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Inputs:
    """Everything a command needs, resolved from flags and config files."""

    model: ModelSpec
    train: TrainSpec
    gpu: GPUSpec | None
    headroom: float
    provenance: dict[str, str]
    """Setting → where its value came from (flag, file, framework default, vramledger default)."""
    warnings: tuple[str, ...] = ()


def _lora_from_flags(args: argparse.Namespace, base: LoraSpec | None) -> LoraSpec | None:
    given = {
        "rank": args.lora_rank,
        "alpha": args.lora_alpha,
        "targets": tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
        if args.lora_targets is not None
        else None,
        "dropout": args.lora_dropout,
        "dora": args.dora,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return base
    lora = base or LoraSpec()
    if "rank" in given and "alpha" not in given and base is None:
        given["alpha"] = 2.0 * given["rank"]
    return dataclasses.replace(lora, **given)


def resolve_inputs(args: argparse.Namespace) -> Inputs:
    """Build the specs from a config file (if any) and the flags (which win)."""
    from vramledger.catalog import resolve_gpu, resolve_model

    provenance: dict[str, str] = {}
    warnings: list[str] = []
    model_name = args.model
    overrides = list(getattr(args, "overrides", []) or [])
    if model_name and "=" in model_name and getattr(args, "config", None):
        overrides.insert(0, model_name)
        model_name = None
    base = TrainSpec()
    if any(getattr(args, k, None) is not None for k in ("config", "deepspeed", "accelerate_config")):
        from vramledger.adapters import load_config

        resolved = load_config(
            args.config,
            fmt=args.format,
            overrides=overrides,
            deepspeed=args.deepspeed,
            accelerate_config=args.accelerate_config,
            require_model=not model_name,
        )
        base = resolved.train
        provenance.update(resolved.provenance)
        warnings.extend(resolved.warnings)
        model_name = model_name or resolved.model
    elif overrides:
        raise VramledgerError(f"unexpected argument {overrides[0]!r}: KEY=VALUE overrides need --config FILE")
    if not model_name:
        raise VramledgerError("model: none given; pass a catalog name (e.g. llama-3.1-8b), a config.json, or --config")

    changes: dict[str, Any] = {}
    if args.method is not None:
        changes["method"] = _choice({m.value: m for m in Method}, "--method", args.method)
    if args.precision is not None:
        changes["precision"] = _choice(PRECISION_ALIASES, "--precision", args.precision)
    if args.optimizer is not None:
        changes["optimizer"] = _choice(OPTIMIZER_ALIASES, "--optimizer", args.optimizer)
    if args.attn is not None:
        attn = {a.value: a for a in Attention} | {"flash": Attention.FLASH2, "fa2": Attention.FLASH2}
        changes["attn"] = _choice(attn, "--attn", args.attn)
    if args.loss is not None:
        loss = {x.value: x for x in Loss} | {"liger": Loss.FUSED}
        changes["loss"] = _choice(loss, "--loss", args.loss)
    for flag, fld in (
        ("batch", "micro_batch"),
        ("seq", "seq_len"),
        ("accum", "grad_accum"),
        ("grad_ckpt", "grad_ckpt"),
        ("freeze_layers", "freeze_trainable_layers"),
        ("sgd_momentum", "sgd_momentum"),
        ("packing", "packing"),
        ("eval_batch", "eval_batch"),
        ("eval_seq", "eval_seq_len"),
        ("eval_accum", "eval_accumulation_steps"),
        ("eval_steps", "eval_steps_total"),
        ("predict_with_generate", "predict_with_generate"),
        ("max_new_tokens", "generation_max_new_tokens"),
    ):
        value = getattr(args, flag, None)
        if value is not None:
            changes[fld] = value
    if getattr(args, "eval_logits", None) is not None:
        changes["eval_logits"] = _choice({e.value: e for e in EvalLogits}, "--eval-logits", args.eval_logits)
    method = changes.get("method", base.method)
    if method in (Method.LORA, Method.QLORA):
        lora = _lora_from_flags(args, base.lora)
        if lora is not None and lora is not base.lora:
            changes["lora"] = lora
    if args.quant is not None or args.no_double_quant is not None:
        q = args.quant.lower() if args.quant else "nf4"
        if q not in ("nf4", "fp4", "int8"):
            raise VramledgerError(f"--quant: unknown value {args.quant!r}; choose nf4, fp4 or int8")
        changes["quant"] = QuantSpec(
            bits=8 if q == "int8" else 4,
            quant_type="nf4" if q == "int8" else q,
            double_quant=not args.no_double_quant,
        )
        if "method" not in changes and base.method is not Method.QLORA:
            changes["method"] = Method.QLORA
    changes.update(distributed_changes(args))
    for key in changes:
        provenance[key] = "flag"
    if changes.get("method", base.method) is not Method.QLORA and "method" in changes:
        changes.setdefault("quant", None)  # leaving QLoRA drops the quantised base
    train = dataclasses.replace(base, **changes)

    gpu = resolve_gpu(args.gpu) if getattr(args, "gpu", None) else None
    headroom = DEFAULT_HEADROOM if getattr(args, "headroom", None) is None else args.headroom
    if not 0.0 <= headroom < 1.0:
        raise VramledgerError(f"--headroom must be a fraction in [0, 1) (got {headroom}); e.g. --headroom 0.08")
    return Inputs(
        model=resolve_model(model_name),
        train=train,
        gpu=gpu,
        headroom=headroom,
        provenance=provenance,
        warnings=tuple(warnings),
    )


# -- report outputs (HTML page, PNG figures, text bars), shared by estimate, trace, fit and plan ---------------------
def add_output_options(p: argparse.ArgumentParser) -> None:
    """``--html FILE``, ``--png DIR`` and ``--bars`` (figures need the ``report`` extra: matplotlib)."""
    g = p.add_argument_group("reports")
    g.add_argument("--html", type=Path, metavar="FILE", help="write a self-contained HTML report (table + figures)")
    g.add_argument("--png", type=Path, metavar="DIR", help="write the figures as PNG files into DIR")
    g.add_argument("--bars", action="store_true", default=None,
                   help="show text bars of the bill (default: when the output is a terminal)")


def show_bars(args: argparse.Namespace) -> bool:
    """Whether to print the text bars: ``--bars``, or stdout is a terminal and no ``--json``."""
    import sys

    if getattr(args, "json", False):
        return False
    return bool(getattr(args, "bars", None)) or sys.stdout.isatty()


def write_outputs(
    args: argparse.Namespace,
    ledger: Any,
    *,
    inputs: Inputs | None = None,
    remedies: Any = None,
) -> list[Path]:
    """Write what ``--html`` and ``--png`` ask for; return the paths written (the caller reports them).

    ``inputs`` (the resolved specs) adds the OOM-cliff figures; ``remedies`` (a plan's results: objects with
    ``label``, ``device_bytes``, ``step_seconds``, or such triples) adds the remedies figure.
    """
    html_path, png_dir = getattr(args, "html", None), getattr(args, "png", None)
    if html_path is None and png_dir is None:
        return []
    from vramledger.report.figures import all_figures

    figs = all_figures(
        ledger,
        model=None if inputs is None else inputs.model,
        train=None if inputs is None else inputs.train,
        gpu=None if inputs is None else inputs.gpu,
        headroom=DEFAULT_HEADROOM if inputs is None else inputs.headroom,
        remedies=remedies,
    )
    written: list[Path] = []
    if html_path is not None:
        from vramledger.report.html import write_html

        written.append(write_html(html_path, ledger, figs))
    if png_dir is not None:
        from vramledger.report.png import write_pngs

        written.extend(write_pngs(png_dir, figs))
    return written


# -- several GPUs ----------------------------------------------------------------------------------------------------
def add_distributed_options(p: argparse.ArgumentParser) -> None:
    """``--world-size`` (or ``--nproc-per-node`` × ``--nnodes``), ``--zero``, ``--fsdp``, ``--fsdp-version``,
    ``--offload``: the data-parallel setup, per rank (see docs/distributed.md)."""
    g = p.add_argument_group("several GPUs (per-rank memory)")
    g.add_argument("--world-size", type=int, help="data-parallel GPUs in all (default 1; DDP unless --zero/--fsdp)")
    g.add_argument("--nproc-per-node", type=int, help="GPUs per node (torchrun's name); world size = this × --nnodes")
    g.add_argument("--nnodes", type=int, help="nodes (default 1)")
    g.add_argument("--zero", type=int, help="DeepSpeed ZeRO stage 0 | 1 | 2 | 3")
    g.add_argument("--fsdp", help="PyTorch FSDP: full_shard | shard_grad_op | hybrid_shard | no_shard")
    g.add_argument("--fsdp-version", type=int, help="FSDP 1 (FullyShardedDataParallel) or 2 (fully_shard; default)")
    g.add_argument("--offload", help="to the CPU: optimizer (states, master copy) | param (also parameters) | none")


def distributed_changes(args: argparse.Namespace) -> dict[str, Any]:
    """TrainSpec fields the distributed flags set (flags win over the config file)."""
    from vramledger.specs import Sharding

    out: dict[str, Any] = {}
    world, per_node, nodes = (getattr(args, k, None) for k in ("world_size", "nproc_per_node", "nnodes"))
    for flag, value in (("--world-size", world), ("--nproc-per-node", per_node), ("--nnodes", nodes)):
        if value is not None and value < 1:
            raise VramledgerError(f"{flag} must be a positive integer (got {value}); e.g. {flag} 8")
    if per_node is not None or nodes is not None:
        implied = (per_node or 1) * (nodes or 1)
        if world is not None and world != implied:
            raise VramledgerError(
                f"--world-size {world} but --nproc-per-node × --nnodes = {implied}; give one or make them agree"
            )
        world = implied
        if per_node is not None:
            out["gpus_per_node"] = per_node
    if world is not None:
        out["world_size"] = world
    zero, fsdp = getattr(args, "zero", None), getattr(args, "fsdp", None)
    if zero is not None and fsdp is not None and zero > 0 and fsdp.strip().lower() != "none":
        raise VramledgerError("--zero and --fsdp exclude each other (DeepSpeed or FSDP): pass one")
    if zero is not None:
        if zero not in (0, 1, 2, 3):
            raise VramledgerError(f"--zero: DeepSpeed ZeRO stage must be 0, 1, 2 or 3 (got {zero})")
        out["zero_stage"] = zero
        if zero:
            out["fsdp"] = None
    if fsdp is not None:
        table: dict[str, Any] = {s.value: s for s in Sharding} | {"none": None, "hybrid": Sharding.HYBRID_SHARD,
                                                                     "full": Sharding.FULL_SHARD}
        out["fsdp"] = _choice(table, "--fsdp", fsdp.replace("-", "_"))
        if out["fsdp"] is not None:
            out["zero_stage"] = 0
    if getattr(args, "fsdp_version", None) is not None:
        if args.fsdp_version not in (1, 2):
            raise VramledgerError(f"--fsdp-version must be 1 or 2 (got {args.fsdp_version})")
        out["fsdp_version"] = args.fsdp_version
    offload = getattr(args, "offload", None)
    if offload is not None:
        kind = _choice({"optimizer": "optimizer", "param": "param", "params": "param", "none": "none"}, "--offload",
                       offload)
        out["offload_optimizer"] = kind != "none"
        out["offload_params"] = kind == "param"
    return out
