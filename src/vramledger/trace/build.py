"""Build the Hugging Face model for a traced step: config, method, dtypes, checkpointing, with no real memory.

The model is built on the ``meta`` device (no memory, no initialisation cost), the method is applied there (PEFT
adapters, frozen layers, dtype casts as the loaders do them), and only then are the parameters converted, inside the
fake-tensor mode, into fake CPU tensors (``materialise``). Building PEFT directly under fake mode fails
(``Module.to()`` swaps tensors the fake converter holds a weakref to: tracing.md), and converting with ``_apply``
unties tied embeddings, so ``materialise`` re-links every shared parameter and checks the count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vramledger.errors import MissingDependencyError, VramledgerError
from vramledger.specs import Attention, DType, Method, ModelSpec, Precision, TrainSpec


def torch_dtype(d: DType) -> Any:
    import torch

    return {DType.FP32: torch.float32, DType.BF16: torch.bfloat16, DType.FP16: torch.float16}[d]


def build_on_meta(model: ModelSpec, train: TrainSpec, config: Mapping[str, Any]) -> tuple[Any, list[str]]:
    """The HF model with the method applied, on the meta device. Returns (model, warnings)."""
    try:
        import torch
        from transformers import AutoConfig
    except ImportError as exc:  # pragma: no cover - exercised only without the extra installed
        raise MissingDependencyError(exc.name or "transformers", "trace") from exc

    warnings: list[str] = []
    cfg_dict = {k: v for k, v in dict(config).items() if k not in ("architectures", "torch_dtype", "dtype")}
    model_type = str(cfg_dict.pop("model_type", model.family))
    if model_type == "gemma3" and "vision_config" not in cfg_dict:
        model_type = "gemma3_text"  # catalog/config_of.py gives the decoder alone unless images are fed
    if model.inventory is not None:
        # Any architecture transformers ships (catalog/inventory.py): its own config class and Auto class.
        from vramledger.catalog.inventory import hf_config_object

        hf_cfg = hf_config_object(config, f"model {model.name}")
    else:
        hf_cfg = AutoConfig.for_model(model_type, **cfg_dict)
    hf_cfg.use_cache = False  # the Trainer / LLaMA-Factory train with use_cache=False
    attn = train.attn.value
    if train.attn is Attention.FLASH2:
        # flash-attn is a CUDA-only package. SDPA's CUDA flash backend keeps the same tensors (output and
        # log-sum-exp; flash_attn_interface.py _flash_attn_forward), so we trace sdpa in its place.
        attn = "sdpa"
        warnings.append(
            "flash_attention_2 traced as SDPA's flash backend (same saved tensors; flash-attn is CUDA-only)"
        )
    # The dtype the checkpoint is loaded in (``from_pretrained(dtype=...)``): the compute dtype, or ``base_dtype``
    # (TRL's default float32 under bf16 autocast). PEFT then makes each adapter in its base layer's dtype
    # (tuners_utils.py ``_move_adapter_to_device_of_base_layer``) and, with ``autocast_adapter_dtype``, upcasts
    # bf16/fp16 adapters to fp32 (``cast_adapter_dtype``): an fp32 base gets fp32 adapters either way.
    frozen_dt = torch_dtype(train.frozen_dtype)
    trainable_dt = torch_dtype(train.precision.trainable)
    with torch.device("meta"):
        try:
            hf = _from_config(model, hf_cfg, attn, frozen_dt)
        except (ValueError, VramledgerError) as exc:
            if attn != "sdpa" or "does not support" not in str(exc):
                raise
            # e.g. Gemma 2 in transformers 5.x: no SDPA (soft-capping); its default is eager, so trace that.
            warnings.append(f"{model_type} has no SDPA attention in this transformers: traced with eager")
            hf = _from_config(model, hf_cfg, "eager", frozen_dt)
    hf.config.use_cache = False
    hf.train()

    if train.method is Method.FULL:
        # LLaMA-Factory model/adapter.py _setup_full_tuning: trainable parameters upcast to fp32 unless
        # pure_bf16; the forbidden modules (a vision tower and projector under freeze_vision_tower) stay frozen in
        # the load dtype.
        for p in hf.parameters():
            p.requires_grad_(True)
        hf.to(trainable_dt)
        tower = model.vision if train.freeze_vision_tower else None
        for name, p in hf.named_parameters():
            if tower is not None and tower.holds(name):
                p.requires_grad_(False)
                p.data = p.data.to(frozen_dt)
    elif train.method is Method.FREEZE:
        # LLaMA-Factory _setup_freeze_tuning: the last N decoder layers train (upcast to fp32 unless
        # pure_bf16).
        from vramledger.catalog.inventory import decoder_layers

        layers = decoder_layers(hf, model.num_layers)
        hf.requires_grad_(False)
        n = min(train.freeze_trainable_layers, len(layers))
        for layer in list(layers)[len(layers) - n :]:
            layer.requires_grad_(True)
            layer.to(trainable_dt)

    if train.grad_ckpt:
        # transformers modeling_utils.py _activation_checkpointing_enable: use_reentrant=False by default, and the
        # input embeddings' output made to require grad (enable_input_require_grads).
        hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})

    if train.peft_config is not None:
        hf = _apply_peft_config(hf, train, trainable_dt, warnings)
    elif train.adapters:
        hf = _apply_lora(hf, train, trainable_dt, warnings)
    if train.method is Method.QLORA:
        four_bit = train.quant is not None and train.quant.bits == 4
        warnings.append(
            "bitsandbytes quantised layers do not run on fake tensors: the base was traced in "
            f"{train.frozen_dtype.value} and its quantised weight bytes replaced by the analytic figure"
            + (", each linear run as Linear4bit runs it (its weight dequantised for every matmul)" if four_bit else "")
        )
    return hf, warnings


def _from_config(model: ModelSpec, hf_cfg: Any, attn: str, dtype: Any) -> Any:
    from transformers import AutoModelForCausalLM

    if model.inventory is not None:
        from vramledger.catalog.inventory import build_meta_model

        return build_meta_model(hf_cfg, where=f"model {model.name}", attn=attn, dtype=dtype)
    from vramledger.catalog.inventory import build_errors

    with build_errors(hf_cfg.model_type, f"model {model.name}"):
        return AutoModelForCausalLM.from_config(hf_cfg, attn_implementation=attn, dtype=dtype)


def _apply_lora(hf: Any, train: TrainSpec, trainable_dt: Any, warnings: list[str]) -> Any:
    import torch

    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:  # pragma: no cover
        raise MissingDependencyError("peft", "trace") from exc
    from vramledger.analytic.target_parameters import peft_names
    from vramledger.trace.vision_inputs import tower_exclusion

    lora = train.lora
    assert lora is not None
    targets: str | list[str] = "all-linear" if lora.all_linear else list(lora.targets)
    if lora.all_linear:
        _refuse_linear_subclasses(hf)
    if lora.all_linear and lora.head:
        # PEFT's "all-linear" leaves the output layer out; name every linear leaf and lm_head instead.
        leaves = {n.rsplit(".", 1)[-1] for n, mod in hf.named_modules() if isinstance(mod, torch.nn.Linear)}
        targets = sorted(leaves - {"lm_head"}) + ["lm_head"]
    cfg = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # PEFT annotates int, accepts float
        lora_dropout=lora.dropout,
        target_modules=targets,
        target_parameters=list(peft_names(lora)) or None,  # analytic/target_parameters.py
        modules_to_save=list(lora.modules_to_save) or None,
        exclude_modules=tower_exclusion(hf, train),  # trace/vision_inputs.py: None unless --freeze-vision-tower
        use_dora=lora.dora,
        task_type="CAUSAL_LM",
    )
    try:
        peft_model = get_peft_model(hf, cfg, autocast_adapter_dtype=lora.adapter_fp32)
    except ValueError as exc:
        raise VramledgerError(f"--lora-targets: PEFT rejected the targets ({exc})") from exc
    _ = torch
    return _upcast_trainable(peft_model, train, trainable_dt)


def _upcast_trainable(peft_model: Any, train: TrainSpec, trainable_dt: Any) -> Any:
    # LLaMA-Factory model/adapter.py: trainable adapter weights are cast to fp32 unless pure_bf16; PEFT's
    # autocast_adapter_dtype (tuners_utils.py cast_adapter_dtype) already upcasts bf16/fp16 adapters.
    if train.precision.mixed or train.precision is Precision.FP32:
        for p in peft_model.parameters():
            if p.requires_grad and p.dtype != trainable_dt:
                p.data = p.data.to(trainable_dt)
    return peft_model


_DATA_INITS = ("pissa", "olora", "loftq", "eva", "corda", "orthogonal")
"""``init_lora_weights`` values that read the base weights (an SVD, a QR, calibration data): impossible on the
meta device, and the same shapes as the default initialisation."""


def _apply_peft_config(hf: Any, train: TrainSpec, trainable_dt: Any, warnings: list[str]) -> Any:
    """Any PEFT method from its ``adapter_config.json``, as ``PeftConfig.from_pretrained`` rebuilds it
    (PEFT 0.21 config.py ``from_peft_type``: the method's config class, unknown newer keys dropped with a
    warning), applied with ``get_peft_model`` so that the method's own layers and forward run."""
    import json

    try:
        import peft  # noqa: F401 - a missing one is said here
    except ImportError as exc:  # pragma: no cover
        raise MissingDependencyError("peft", "trace") from exc
    assert train.peft_config is not None
    cfg = json.loads(train.peft_config)
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and init.lower().split("_")[0] in _DATA_INITS:
        cfg["init_lora_weights"] = True
        warnings.append(
            f"init_lora_weights {init!r} reads real weights: traced with the default initialisation "
            "(the same shapes and memory)"
        )
    from vramledger.catalog.inventory import apply_peft_config

    peft_model = apply_peft_config(hf, cfg, adapter_fp32=train.lora is None or train.lora.adapter_fp32)
    _as_on_the_gpu(peft_model, warnings)
    return _upcast_trainable(peft_model, train, trainable_dt)


def _as_on_the_gpu(peft_model: Any, warnings: list[str]) -> None:
    """Undo what differs when PEFT runs on the meta device, and what fake tensors cannot decide."""
    dropped = False
    for name, module in peft_model.named_modules():
        # AdaLoRA's ``ranknum`` (tuners/adalora/layer.py update_layer) is made on the CPU with requires_grad=False;
        # tuners_utils.py _move_adapter_to_device_of_base_layer then re-registers ``ranknum.to("meta")`` as a new
        # Parameter, which requires grad. On a real device ``.to`` returns the same one.
        if name.endswith(".ranknum"):
            module.requires_grad_(False)
        # LoHa/LoKr (tuners/loha/layer.py, tuners/lokr/layer.py forward): ``torch.rand(1) > module_dropout`` decides
        # on a random number, which a fake tensor does not hold. Out of training mode the wrapper always applies
        # its adapter (the case a run takes when module_dropout is 0, the default); only the wrapper's own flag
        # changes, the base layer keeps training mode.
        module_dropout = getattr(module, "module_dropout", None)
        if isinstance(module_dropout, dict) and hasattr(module, "rank_dropout"):
            module.training = False
            dropped |= any(module_dropout.values()) or any(module.rank_dropout.values())
    if dropped:
        warnings.append("LoHa/LoKr module and rank dropout traced as off: the adapter applied in every step")


def _refuse_linear_subclasses(hf: Any) -> None:
    """PEFT's all-linear wraps every ``nn.Linear``, subclasses too, and its ``lora.Linear.forward`` (PEFT 0.21
    tuners/lora/layer.py) takes the base layer's output as one tensor. A subclass returning something else
    (transformers 5.23 ``Llama4Router`` returns (scores, logits)) fails there with AttributeError in the real run;
    say so, and how to target around it."""
    import torch

    odd = sorted(
        {
            type(m).__name__
            for m in hf.modules()
            if isinstance(m, torch.nn.Linear) and type(m).forward is not torch.nn.Linear.forward
        }
    )
    if odd:
        raise VramledgerError(
            f"--lora-targets all: PEFT would wrap {', '.join(odd)}, an nn.Linear whose forward does not return one "
            "tensor, and the step fails in PEFT's lora.Linear.forward; name the projections instead "
            "(e.g. --lora-targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj)"
        )


def shared_parameters(model: Any) -> list[list[tuple[Any, str]]]:
    """Groups of (module, attribute) that hold the same Parameter (tied embeddings)."""
    groups: dict[int, list[tuple[Any, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                groups.setdefault(id(p), []).append((module, name))
    return [g for g in groups.values() if len(g) > 1]


def repeated_modules(model: Any) -> list[tuple[Any, str, Any]]:
    """(parent, name, module) for every registration of a module after its first: PEFT registers some modules
    under two parents (peft_model.py ``_setup_prompt_encoder``: ``word_embeddings``; tuners/vera/layer.py: each
    layer's ``vera_A``/``vera_B``, one shared BufferDict), which ``_apply`` would convert once per parent."""
    seen: set[int] = set()
    out = []
    for parent in model.modules():
        for name, child in parent._modules.items():
            if child is None:
                continue
            if id(child) in seen:
                out.append((parent, name, child))
            seen.add(id(child))
    return out


def materialise(model: Any) -> Any:
    """Replace every meta parameter and buffer by an uninitialised tensor on the CPU. Call inside the fake
    mode:
    the tensors are then fake (no memory) and each one is an allocation the recorder sees."""
    import torch

    tied = shared_parameters(model)
    before = sum(p.numel() for p in model.parameters())
    for group in tied:  # unlink the copies first so that ``_apply`` converts each shared tensor once
        for module, name in group[1:]:
            module._parameters[name] = None
    repeats = repeated_modules(model)
    for parent, name, _ in repeats:  # and every module registered twice (PEFT's word_embeddings, VeRA's A/B)
        parent._modules[name] = None
    model._apply(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu"))
    for parent, name, child in repeats:
        parent._modules[name] = child
    for module in model.modules():
        # PEFT peft_model.py _setup_prompt_encoder keeps the virtual tokens' ids (torch.arange) as a plain dict
        # attribute, not a buffer: made again here so that they are tensors of this mode too.
        tokens = getattr(module, "prompt_tokens", None)
        if isinstance(tokens, dict):
            for key, t in tokens.items():
                tokens[key] = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    for group in tied:
        first_module, first_name = group[0]
        for module, name in group[1:]:
            module._parameters[name] = first_module._parameters[first_name]
    after = sum(p.numel() for p in model.parameters())
    assert before == after, f"parameter count changed while materialising: {before} -> {after}"
    return model
