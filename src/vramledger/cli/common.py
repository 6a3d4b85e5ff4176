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

from vramledger.adapters._base import ATTN_NAMES, OPTIMIZER_NAMES
from vramledger.cli.args import (
    MAX_BATCH,
    MAX_EVAL_BATCH,
    count,
    fraction,
    image_size,
    in_path,
    name,
    out_path,
    real,
    tokens,
)
from vramledger.errors import VramledgerError
from vramledger.specs import (
    DEFAULT_HEADROOM,
    Attention,
    DType,
    EvalLogits,
    GPUSpec,
    LoraSpec,
    Loss,
    Method,
    ModelCode,
    ModelSpec,
    Optimizer,
    Precision,
    QuantSpec,
    TrainSpec,
    check_headroom,
)

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

OPTIMIZER_ALIASES = OPTIMIZER_NAMES | {
    # command-line shorthands on top of the framework names (one table: adapters._base.OPTIMIZER_NAMES)
    "adamw-foreach": Optimizer.ADAMW,
    "adamw-fused": Optimizer.ADAMW_FUSED,
    "fused": Optimizer.ADAMW_FUSED,
    "adamw-forloop": Optimizer.ADAMW_FORLOOP,
    "adamw-8bit": Optimizer.ADAMW_8BIT,
    "paged-adamw-8bit": Optimizer.PAGED_ADAMW_8BIT,
    "paged-adamw-32bit": Optimizer.PAGED_ADAMW_32BIT,
    "lion": Optimizer.LION,
    "lion-8bit": Optimizer.LION_8BIT,
}
ATTN_ALIASES = ATTN_NAMES | {"flash": Attention.FLASH2, "fa2": Attention.FLASH2}
"""``--attn``: transformers' names (adapters._base.ATTN_NAMES) and two shorthands."""


def _choice(table: dict[str, Any], field: str, value: str) -> Any:
    key = value.strip().lower()
    if key not in table:
        raise VramledgerError(f"{field}: unknown value {value!r}; choose one of {', '.join(sorted(table))}")
    return table[key]


def _short(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


def add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="catalog name or hub id (see `vramledger models`), or a config.json path")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides for --config (LLaMA-Factory style)")
    p.add_argument(
        "--config", type=in_path, help="a training config: LLaMA-Factory, HF TrainingArguments, TRL, axolotl"
    )
    p.add_argument("--format", type=name, help="the config's kind, when it cannot be detected from its content")
    p.add_argument("--deepspeed", type=in_path, help="a DeepSpeed JSON config")
    p.add_argument(
        "--preset",
        type=name,
        help="without --config: the defaults of hf | llamafactory | trl | axolotl, or none for vramledger's "
        "bare ones (default llamafactory: checkpointing on, fused AdamW, LoRA rank 8 on all linear layers)",
    )
    p.add_argument("--accelerate-config", type=in_path, help="an accelerate (FSDP) YAML config")


def add_train_options(p: argparse.ArgumentParser) -> None:
    """Flags that describe the training setup (same for estimate, trace, fit, plan, measure)."""
    g = p.add_argument_group(
        "training setup",
        "Flags override --config and --preset. What no flag sets comes from the config, else from the preset "
        "(llamafactory unless --preset says otherwise: LoRA rank 8 on all linear layers, checkpointing on, "
        "adamw_torch_fused, bf16-mixed); each '(default …)' below is vramledger's bare one, --preset none.",
    )
    g.add_argument("--method", type=name, help="full | freeze | lora | qlora (default lora)")
    g.add_argument("--lora-rank", type=count(what="rank"), help="LoRA rank r (default 16)")
    g.add_argument(
        "--lora-alpha",
        type=real(0, 1e6, lo_open=True, what="alpha"),
        help="LoRA alpha (default 2 × rank; no memory effect)",
    )
    g.add_argument(
        "--lora-targets", type=name, help="comma-separated module names, or 'all' (default all linear layers)"
    )
    g.add_argument(
        "--lora-target-parameters",
        type=name,
        metavar="NAMES",
        help="comma-separated parameters adapted through PEFT's ParamWrapper (target_parameters), e.g. "
        "mlp.experts.gate_up_proj,mlp.experts.down_proj",
    )
    g.add_argument("--lora-dropout", type=fraction, help="LoRA dropout (default 0)")
    g.add_argument("--dora", action="store_true", default=None, help="weight-decomposed LoRA")
    g.add_argument(
        "--modules-to-save",
        type=name,
        help="modules trained in full beside the adapters (PEFT modules_to_save): embed_tokens,lm_head",
    )
    g.add_argument(
        "--peft-config",
        type=in_path,
        metavar="PATH",
        help="a PEFT adapter_config.json (or its folder): any PEFT method (IA3, prefix tuning, …)",
    )
    g.add_argument("--quant", type=name, help="qlora base: nf4 | fp4 | int8 (default nf4)")
    g.add_argument("--no-double-quant", action="store_true", default=None, help="qlora without double quantisation")
    g.add_argument(
        "--bnb-compute-dtype",
        type=name,
        help="4-bit base: bnb_4bit_compute_dtype fp32 | bf16 | fp16 (default: the load dtype, as LLaMA-Factory, "
        "axolotl and TRL set it; BitsAndBytesConfig alone defaults to fp32)",
    )
    g.add_argument(
        "--legacy-bitsandbytes",
        action="store_true",
        default=None,
        help="qlora on bitsandbytes before 0.43.2, whose 4-bit matmul keeps every quantised linear's input",
    )
    g.add_argument(
        "--freeze-layers", type=count(what="number of layers"), help="method freeze: trainable last layers (default 2)"
    )
    g.add_argument("--batch", type=count(hi=MAX_BATCH, what="batch"), help="micro-batch size per GPU (default 1)")
    g.add_argument(
        "--seq",
        type=tokens(what="length"),
        help="sequence length in tokens (default 2048; 32k = 32,768); with --images, text tokens (the images' add "
        "to it)",
    )
    g.add_argument(
        "--accum", type=count(hi=MAX_BATCH, what="step count"), help="gradient accumulation steps (default 1)"
    )
    g.add_argument(
        "--precision",
        type=name,
        help="bf16-mixed (=bf16) | fp16-mixed (=fp16) | bf16-true | fp16-true | fp32 (default bf16-mixed)",
    )
    g.add_argument(
        "--optimizer",
        type=name,
        help="adamw_torch (foreach) | adamw_torch_fused | adamw_8bit | paged_adamw_8bit | "
        "adafactor | sgd | lion_32bit | … (default adamw_torch)",
    )
    g.add_argument("--sgd-momentum", type=fraction, help="SGD momentum (default 0)")
    ck = g.add_mutually_exclusive_group()
    ck.add_argument("--grad-ckpt", dest="grad_ckpt", action="store_true", default=None, help="gradient checkpointing")
    ck.add_argument("--no-grad-ckpt", dest="grad_ckpt", action="store_false", help="no gradient checkpointing")
    g.add_argument("--attn", type=name, help="eager | sdpa | flash_attention_2 (default sdpa)")
    g.add_argument("--loss", type=name, help="standard | fused (Liger) | chunked | chunked_nll (default standard)")
    g.add_argument(
        "--packing",
        action="store_true",
        default=None,
        help="every batch packed to --batch x --seq (no padding mask; the reserve of that one shape); default: "
        "dynamic padding (a padded batch when --batch > 1, and the shorter batches' cache kept)",
    )
    g.add_argument(
        "--model-code",
        type=name,
        help="whose decoder layers run: transformers (with PEFT) | litgpt | lit-gpt-2023 (default transformers)",
    )
    g.add_argument(
        "--eval-batch", type=count(hi=MAX_EVAL_BATCH, what="batch"), help="evaluation batch size (adds an eval phase)"
    )
    g.add_argument("--eval-seq", type=tokens(what="length"), help="evaluation sequence length (default: --seq)")
    g.add_argument(
        "--eval-logits", type=name, help="what eval keeps for metrics: none (loss only) | full | argmax (default none)"
    )
    g.add_argument(
        "--eval-accum",
        type=count(hi=MAX_BATCH, what="step count"),
        help="eval_accumulation_steps (default: unset, predictions stay on GPU)",
    )
    g.add_argument(
        "--eval-steps",
        type=count(what="step count"),
        help="eval batches per evaluation (for predictions kept on the GPU)",
    )
    g.add_argument("--predict-with-generate", action="store_true", default=None, help="generate during evaluation")
    g.add_argument(
        "--max-new-tokens",
        type=count(what="token count"),
        help="tokens generated per eval sequence (predict_with_generate)",
    )
    g.add_argument(
        "--images",
        type=count(lo=0, hi=MAX_BATCH, what="image count"),
        help="images per sample (vision-language models: Qwen2/2.5/3-VL, Gemma 3, Llama 4; default 0)",
    )
    g.add_argument(
        "--image-size",
        type=image_size,
        metavar="WxH",
        help="pixels of each image before the processor (default: the model's resolution)",
    )
    fv = g.add_mutually_exclusive_group()
    fv.add_argument(
        "--freeze-vision-tower",
        dest="freeze_vision_tower",
        action="store_true",
        default=None,
        help="keep adapters out of the vision tower and projector (LLaMA-Factory's default)",
    )
    fv.add_argument(
        "--no-freeze-vision-tower",
        dest="freeze_vision_tower",
        action="store_false",
        help="adapt the vision tower too (PEFT's all-linear does)",
    )
    add_distributed_options(p)


def add_gpu_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--gpu", type=name, help="GPU for the verdict: a catalog name (see `vramledger gpus`) or a size like 24GiB"
    )
    p.add_argument(
        "--headroom",
        type=fraction,
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
    model_name: str = ""
    """The model as the user named it (argument or config key): what any file we write must name, since a
    catalog entry's hub id may differ (``Qwen/Qwen2.5-7B-Instruct`` resolves to the base model's shapes)."""
    config_format: str = ""
    """The format of ``--config`` (detected or given), empty without one."""
    notes: tuple[str, ...] = ()
    """What the user should know about how the input was read (the preset used). ``cli.main`` prints them as
    ``note:`` lines on stderr once the command has answered (never before an error, never into ``--json``)."""


def _lora_from_flags(args: argparse.Namespace, base: LoraSpec | None) -> LoraSpec | None:
    given = {
        "rank": args.lora_rank,
        "alpha": args.lora_alpha,
        "targets": tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
        if args.lora_targets is not None
        else None,
        "parameters": tuple(t.strip() for t in args.lora_target_parameters.split(",") if t.strip())
        if getattr(args, "lora_target_parameters", None) is not None
        else None,
        "dropout": args.lora_dropout,
        "dora": args.dora,
        "modules_to_save": tuple(t.strip() for t in args.modules_to_save.split(",") if t.strip())
        if getattr(args, "modules_to_save", None) is not None
        else None,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return base
    lora = base or LoraSpec()
    if "rank" in given and "alpha" not in given and base is None:
        given["alpha"] = 2.0 * given["rank"]
    return dataclasses.replace(lora, **given)


def _preset(args: argparse.Namespace, model_name: str, provenance: dict[str, str]) -> tuple[TrainSpec, str]:
    """A flag-only setup starts from a framework's defaults (``--preset``, default LLaMA-Factory's), not from
    vramledger's bare ones (checkpointing off, foreach AdamW, rank 16), which no framework uses."""
    from vramledger.adapters import DEFAULT_PRESET, PRESETS, preset_config
    from vramledger.adapters.detect import normalise_format

    given = getattr(args, "preset", None)
    if given is not None and given.strip().lower() == "none":
        return TrainSpec(), ""
    kind = DEFAULT_PRESET if given is None else normalise_format(given, option="--preset", choices=tuple(PRESETS))
    if kind not in PRESETS:
        raise VramledgerError(f"--preset: no preset for {kind}; choose one of {', '.join(PRESETS)} or none")
    rc = preset_config(kind, model_name)
    provenance.update(rc.provenance)
    t = rc.train
    parts = [f"gradient checkpointing {'on' if t.grad_ckpt else 'off'}", t.optimizer.value, t.precision.value]
    if t.lora is not None:
        targets = "all linear layers" if t.lora.all_linear else ",".join(t.lora.targets)
        parts.append(f"{t.method.value} rank {t.lora.rank} on {targets}")
    else:
        parts.append(f"{t.method.value} fine-tuning")
    how = "" if given is not None else " (the default; --preset hf|llamafactory|trl|axolotl|none to change)"
    return t, f"preset: {kind} defaults{how}: {', '.join(parts)}; flags override them"


@dataclasses.dataclass(kw_only=True, slots=True)
class _Base:
    """Where the setup starts: the config file's (with its provenance and warnings) or a framework preset's."""

    train: TrainSpec
    model_name: str
    provenance: dict[str, str]
    warnings: list[str]
    config_format: str = ""
    preset_note: str = ""


def _base_setup(args: argparse.Namespace) -> _Base:
    """The config file read through its adapter, or, for flags alone, the preset; and the model's name."""
    provenance: dict[str, str] = {}
    warnings: list[str] = []
    model_name = args.model
    overrides = list(getattr(args, "overrides", []) or [])
    if model_name and "=" in model_name and getattr(args, "config", None):
        overrides.insert(0, model_name)
        model_name = None
    base = TrainSpec()
    config_format = ""
    preset_note = ""
    if getattr(args, "preset", None) is not None and getattr(args, "config", None) is not None:
        raise VramledgerError(
            "--preset: only for setups given by flags; --config already sets the framework's defaults (drop --preset)"
        )
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
        config_format = resolved.format
    elif overrides:
        raise VramledgerError(f"unexpected argument {overrides[0]!r}: KEY=VALUE overrides need --config FILE")
    elif model_name:
        base, preset_note = _preset(args, model_name, provenance)
    if not model_name:
        raise VramledgerError("model: none given; pass a catalog name (e.g. llama-3.1-8b), a config.json, or --config")
    return _Base(
        train=base,
        model_name=model_name,
        provenance=provenance,
        warnings=warnings,
        config_format=config_format,
        preset_note=preset_note,
    )


# Flags that set a TrainSpec field as given (validated by their argparse types).
_PLAIN_FLAGS = (
    ("batch", "micro_batch"),
    ("seq", "seq_len"),
    ("accum", "grad_accum"),
    ("grad_ckpt", "grad_ckpt"),
    ("freeze_layers", "freeze_trainable_layers"),
    ("sgd_momentum", "sgd_momentum"),
    ("packing", "packing"),
    ("legacy_bitsandbytes", "legacy_bitsandbytes"),
    ("eval_batch", "eval_batch"),
    ("eval_seq", "eval_seq_len"),
    ("eval_accum", "eval_accumulation_steps"),
    ("eval_steps", "eval_steps_total"),
    ("predict_with_generate", "predict_with_generate"),
    ("max_new_tokens", "generation_max_new_tokens"),
    ("images", "images"),
    ("image_size", "image_size"),
    ("freeze_vision_tower", "freeze_vision_tower"),
)


def _flag_changes(args: argparse.Namespace, base: TrainSpec) -> dict[str, Any]:
    """The TrainSpec fields the flags set (flags win over the file and the preset)."""
    changes: dict[str, Any] = {}
    if args.method is not None:
        changes["method"] = _choice({m.value: m for m in Method}, "--method", args.method)
    if args.precision is not None:
        changes["precision"] = _choice(PRECISION_ALIASES, "--precision", args.precision)
    if args.optimizer is not None:
        changes["optimizer"] = _choice(OPTIMIZER_ALIASES, "--optimizer", args.optimizer)
    if args.attn is not None:
        changes["attn"] = _choice(ATTN_ALIASES, "--attn", args.attn)
    if args.loss is not None:
        loss = {x.value: x for x in Loss} | {"liger": Loss.FUSED}
        changes["loss"] = _choice(loss, "--loss", args.loss)
    for flag, fld in _PLAIN_FLAGS:
        value = getattr(args, flag, None)
        if value is not None:
            changes[fld] = value
    if args.seq is not None and (args.images or base.images):
        changes["seq_includes_images"] = False  # --seq counts text tokens; the images' tokens come on top
    if getattr(args, "model_code", None) is not None:
        changes["model_code"] = _choice({c.value: c for c in ModelCode}, "--model-code", args.model_code)
    if getattr(args, "eval_logits", None) is not None:
        changes["eval_logits"] = _choice({e.value: e for e in EvalLogits}, "--eval-logits", args.eval_logits)
    method = changes.get("method", base.method)
    if method in (Method.LORA, Method.QLORA):
        lora = _lora_from_flags(args, base.lora)
        if lora is not None and lora is not base.lora:
            changes["lora"] = lora
    litgpt = changes.get("model_code", base.model_code).litgpt
    if litgpt and method in (Method.LORA, Method.QLORA):
        lora = changes.get("lora", base.lora) or LoraSpec()  # LitGPT keeps adapters in the model dtype (no upcast)
        if lora.adapter_fp32:
            changes["lora"] = dataclasses.replace(lora, adapter_fp32=False)
    bnb_compute = _bnb_compute_dtype(getattr(args, "bnb_compute_dtype", None))
    if args.quant is not None or args.no_double_quant is not None:
        q = args.quant.strip().lower() if args.quant is not None else "nf4"
        if q not in ("nf4", "fp4", "int8"):
            raise VramledgerError(f"--quant: unknown value {args.quant!r}; choose nf4, fp4 or int8")
        changes["quant"] = QuantSpec(
            bits=8 if q == "int8" else 4,
            quant_type="nf4" if q == "int8" else q,
            double_quant=not args.no_double_quant,
            compute_dtype=bnb_compute,
        )
        if "method" not in changes and base.method is not Method.QLORA:
            changes["method"] = Method.QLORA
    elif bnb_compute is not None:
        quant = base.quant or (QuantSpec() if changes.get("method", base.method) is Method.QLORA else None)
        if quant is None:
            raise VramledgerError("--bnb-compute-dtype: only for a 4-bit base; add --method qlora or --quant nf4")
        changes["quant"] = dataclasses.replace(quant, compute_dtype=bnb_compute)
    if bnb_compute is not None and changes["quant"].bits != 4:
        raise VramledgerError("--bnb-compute-dtype: only for a 4-bit base (int8 has no compute dtype); drop it")
    if getattr(args, "legacy_bitsandbytes", None) and changes.get("method", base.method) is not Method.QLORA:
        raise VramledgerError("--legacy-bitsandbytes: only for a 4-bit base; add --method qlora")
    dist = distributed_changes(args)
    for key, flag in (("fsdp", "fsdp"), ("zero_stage", "zero")):  # the other flag's implied companion
        if key in dist and getattr(args, flag, None) is None and dist[key] == getattr(base, key):
            del dist[key]  # --zero 3 clears an FSDP the setup never had: nothing the flags changed
    changes.update(dist)
    if getattr(args, "peft_config", None) is not None:
        from vramledger.adapters.peft_config import flag_changes

        changes.update(flag_changes(args.peft_config, base, changes))
    return changes


def _resolve_model(args: argparse.Namespace, model_name: str) -> ModelSpec:
    """The model by name; a word that was meant as a config override is said to be one."""
    from vramledger.catalog import resolve_model

    try:
        return resolve_model(model_name)
    except VramledgerError as exc:
        if model_name == args.model and getattr(args, "config", None) is not None:
            # `--config f.yaml lora_rank` meant an override, not a model: say so
            raise VramledgerError(
                f"{exc}; if {_short(model_name)!r} is meant as an override of the config, write KEY=VALUE "
                f"(e.g. {_short(model_name)}=8)"
            ) from None
        raise


def resolve_inputs(args: argparse.Namespace) -> Inputs:
    """Build the specs from a config file (if any) and the flags (which win)."""
    from vramledger.catalog import resolve_gpu, variant_note

    start = _base_setup(args)
    changes = _flag_changes(args, start.train)
    for key in changes:
        start.provenance[key] = "flag"
    if changes.get("method", start.train.method) is not Method.QLORA and "method" in changes:
        changes.setdefault("quant", None)  # leaving QLoRA drops the quantised base
    train = dataclasses.replace(start.train, **changes)
    if train.peft_type not in (None, "LORA") or train.method not in (Method.LORA, Method.QLORA):
        start.provenance.pop("lora", None)  # another PEFT method, or no adapters: the LoRA settings do not apply
    gpu = resolve_gpu(args.gpu) if getattr(args, "gpu", None) is not None else None
    headroom = check_headroom(DEFAULT_HEADROOM if getattr(args, "headroom", None) is None else args.headroom)
    model = _resolve_model(args, start.model_name)
    # Image settings (LLaMA-Factory's defaults among them) say nothing about a step without images or a tower.
    for key in ("image_size", "image_max_pixels", "image_min_pixels", "seq_includes_images", "freeze_vision_tower"):
        if not (train.images and model.vision) and not (key == "freeze_vision_tower" and model.vision):
            start.provenance.pop(key, None)
    note = variant_note(model)
    if note is not None:
        start.warnings.append(note)
    notes = (start.preset_note,) if start.preset_note else ()
    args.notes = notes
    return Inputs(
        model=model,
        train=train,
        gpu=gpu,
        headroom=headroom,
        provenance=start.provenance,
        warnings=tuple(start.warnings),
        model_name=start.model_name,
        config_format=start.config_format,
        notes=notes,
    )


# -- report outputs (HTML page, PNG figures, text bars), shared by estimate, trace, fit and plan ---------------------
def add_output_options(p: argparse.ArgumentParser) -> None:
    """``--html FILE``, ``--png DIR`` and ``--bars`` (figures need the ``report`` extra: matplotlib)."""
    g = p.add_argument_group("reports")
    g.add_argument("--html", type=out_path, metavar="FILE", help="write a self-contained HTML report (table + figures)")
    g.add_argument("--png", type=out_path, metavar="DIR", help="write the figures as PNG files into DIR")
    add_force_option(g)
    g.add_argument(
        "--bars",
        action="store_true",
        default=None,
        help="show text bars of the bill (default: when the output is a terminal)",
    )


def add_force_option(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--force",
        action="store_true",
        help="replace output files that exist (an input is never replaced, even with --force)",
    )


_OUTPUTS = (("html", "--html"), ("write_config", "--write-config"), ("out", "--out"), ("snapshot", "--snapshot"))
"""The attribute and flag of every option that names a file to write (``--png DIR`` is checked per figure)."""


def input_files(args: argparse.Namespace) -> list[Path]:
    """The files this command reads: the model path, the configs, the script, and paths given as overrides."""
    from vramledger.userfiles import input_paths

    values: list[object] = [
        getattr(args, k, None)
        for k in ("model", "config", "deepspeed", "accelerate_config", "script", "evidence", "peft_config")
    ]
    values += [o.partition("=")[2] for o in getattr(args, "overrides", None) or [] if "=" in o]
    return input_paths(values)


def check_outputs(args: argparse.Namespace) -> None:
    """Before any work: refuse every output that exists (unless ``--force``) or is one of the inputs.

    Called by ``cli.main`` for every command, so a slow command (trace, measure) never runs only to find that
    its output would replace a file. ``--png DIR`` checks every figure file it may write (``report.png``).
    """
    from vramledger.userfiles import check_output

    force = bool(getattr(args, "force", False))
    inputs = input_files(args)
    for attr, option in _OUTPUTS:
        path = getattr(args, attr, None)
        if isinstance(path, Path):
            check_output(path, option, force=force, inputs=inputs)
    png = getattr(args, "png", None)
    if isinstance(png, Path):
        from vramledger.report.png import png_paths

        if png.exists() and not png.is_dir():
            raise VramledgerError(f"--png: {png} is a file, not a folder; name a folder for the figures")
        for path in png_paths(png):
            check_output(path, "--png", force=force, inputs=inputs)


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


def _bnb_compute_dtype(text: str | None) -> DType | None:
    """``--bnb-compute-dtype``: torch's names (float32, bfloat16, float16) or ours."""
    if text is None:
        return None
    key = text.strip().lower().removeprefix("torch.")
    names = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "bf16": "bf16", "bfloat16": "bf16"}
    names |= {"fp16": "fp16", "float16": "fp16", "half": "fp16"}
    if key not in names:
        raise VramledgerError(f"--bnb-compute-dtype: unknown value {text!r}; choose fp32, bf16 or fp16")
    return DType(names[key])


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
        table: dict[str, Any] = {s.value: s for s in Sharding} | {
            "none": None,
            "hybrid": Sharding.HYBRID_SHARD,
            "full": Sharding.FULL_SHARD,
        }
        out["fsdp"] = _choice(table, "--fsdp", fsdp.replace("-", "_"))
        if out["fsdp"] is not None:
            out["zero_stage"] = 0
    if getattr(args, "fsdp_version", None) is not None:
        if args.fsdp_version not in (1, 2):
            raise VramledgerError(f"--fsdp-version must be 1 or 2 (got {args.fsdp_version})")
        out["fsdp_version"] = args.fsdp_version
    offload = getattr(args, "offload", None)
    if offload is not None:
        kind = _choice(
            {"optimizer": "optimizer", "param": "param", "params": "param", "none": "none"}, "--offload", offload
        )
        out["offload_optimizer"] = kind != "none"
        out["offload_params"] = kind == "param"
    return out
