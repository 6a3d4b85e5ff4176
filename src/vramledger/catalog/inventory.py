"""Any architecture transformers can build: the model made on the meta device, and its exact parameter facts.

For a ``model_type`` without formulas in ``catalog.hfconfig``, the config is handed to transformers
(``AutoConfig.for_model`` + ``AutoModelForCausalLM.from_config``, or ``AutoModelForImageTextToText`` for a
vision-language config) under ``torch.device("meta")``: no memory, no weights, no initialisation. Parameter
counts, shapes and the linear layers of every decoder layer are then read from the real modules.

Never remote code: a config whose ``model_type`` transformers does not ship (it names an ``auto_map`` to a
repository's Python file) is refused with that reason, as is any config naming ``trust_remote_code``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from functools import lru_cache
from typing import Any, NamedTuple

from vramledger.catalog.checkpoint_quant import checkpoint_quant
from vramledger.catalog.vision_config import vision_spec
from vramledger.errors import MissingDependencyError, VramledgerError
from vramledger.specs.model import CheckpointQuant, InventoryLinear, ModelSpec, ModuleInventory

# Per-head (or per-projection) norms on queries and keys: Qwen3/OLMo-2/Gemma 3 ``q_norm``/``k_norm``.
_QK_NORMS = ("q_norm", "k_norm")
# Keys of config.json that describe the checkpoint file rather than the architecture.
_NOT_ARCHITECTURE = ("architectures", "torch_dtype", "dtype", "auto_map", "transformers_version", "_name_or_path")


def _transformers(where: str) -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise VramledgerError(
            f"{where}: this model_type has no formula here and transformers is not installed to build it "
            "on the meta device; install it with: pip install 'vramledger[trace]'"
        ) from exc
    return transformers


def _check_buildable(cfg: Mapping[str, Any], where: str) -> str:
    """The model_type, if transformers ships it; otherwise the reason we refuse (never remote code)."""
    transformers = _transformers(where)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = str(cfg.get("model_type") or "")
    if not model_type:
        raise VramledgerError(f"{where}: no 'model_type'; is this a Hugging Face config.json?")
    if model_type not in CONFIG_MAPPING_NAMES:
        remote = cfg.get("auto_map")
        reason = (
            f"it needs the repository's own Python code (auto_map: {', '.join(sorted(remote))}), which vramledger "
            "never runs"
            if isinstance(remote, Mapping) and remote
            else f"transformers {transformers.__version__} does not know it"
        )
        raise VramledgerError(
            f"{where}: model_type {model_type!r} cannot be built: {reason}; pass the config of a model "
            f"transformers ships{_native_twin(remote)}, or use `vramledger estimate <catalog-name> --config FILE`"
        )
    return model_type


def _native_twin(auto_map: Any) -> str:
    """A hint when the remote classes carry the name of a class transformers ships (Kimi-K2's auto_map names
    ``modeling_deepseek.DeepseekV3ForCausalLM``): the same architecture may be run natively."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not isinstance(auto_map, Mapping):
        return ""
    names = {str(v).split(".")[-1] for v in auto_map.values()}
    for model_type, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if cls in names:
            return (
                f" (its classes are named like transformers' {cls}: if it is that architecture, a copy with "
                f'"model_type": "{model_type}" runs natively)'
            )
    return ""


def hf_config_object(cfg: Mapping[str, Any], where: str) -> Any:
    """transformers' config object for a config.json mapping (defaults filled in by its class)."""
    model_type = _check_buildable(cfg, where)
    from huggingface_hub.errors import StrictDataclassError  # transformers 5's configs validate their fields
    from transformers import AutoConfig

    fields = {k: v for k, v in cfg.items() if k not in _NOT_ARCHITECTURE and k != "model_type"}
    try:
        with _quiet_transformers():
            return AutoConfig.for_model(model_type, **fields)
    except (TypeError, ValueError, StrictDataclassError) as exc:
        said = " ".join(str(exc).split())  # the validation errors span lines
        raise VramledgerError(f"{where}: transformers rejected the config ({said}); fix the named field") from None


def _model_class(hf_cfg: Any, where: str) -> Any:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    # A checkpoint with a vision tower (Llama-4 Scout, Qwen2.5-VL) is built whole, as fine-tuning loads it;
    # AutoModelForCausalLM would drop the tower for llama4.
    multimodal = getattr(hf_cfg, "vision_config", None) is not None
    if multimodal and hf_cfg.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    if hf_cfg.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForCausalLM
    if hf_cfg.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    raise VramledgerError(
        f"{where}: model_type {hf_cfg.model_type!r} has no causal-LM or image-text-to-text class in transformers; "
        "vramledger models decoders that generate text"
    )


def build_meta_model(hf_cfg: Any, *, where: str, attn: str | None = None, dtype: Any = None) -> Any:
    """The transformers model for ``hf_cfg`` on the meta device (call from code that imported torch)."""
    import torch

    auto = _model_class(hf_cfg, where)
    kwargs: dict[str, Any] = {}
    if attn is not None:
        kwargs["attn_implementation"] = attn
    if dtype is not None:
        kwargs["dtype"] = dtype
    with torch.device("meta"), _quiet_transformers(), build_errors(hf_cfg.model_type, where):
        return auto.from_config(hf_cfg, **kwargs)


@contextmanager
def build_errors(model_type: str, where: str) -> Iterator[None]:
    """A config transformers' classes reject while building (an assertion on a field, a shape that does not
    divide) as one line naming it, not a traceback."""
    try:
        yield
    except (AssertionError, ValueError, TypeError, KeyError, AttributeError, RuntimeError) as exc:
        raise VramledgerError(
            f"{where}: transformers could not build {model_type!r} from this config "
            f"({type(exc).__name__}: {exc}); fix the config field it names"
        ) from None


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' config warnings (token ids outside a tiny vocabulary, …) silenced while we build, and its
    verbosity restored after: the library prints nothing."""
    from transformers.utils import logging

    before = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(before)


def decoder_layers(model: Any, num_layers: int) -> Any:
    """The ModuleList of decoder layers: of the lists with ``num_layers`` entries, the one with most parameters
    (a vision tower of the same depth is smaller)."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers]
    if not lists:
        raise VramledgerError(f"model: could not find the {num_layers} decoder layers in {type(model).__name__}")
    return max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters()))


def _layer_linears(layers: Any) -> tuple[tuple[InventoryLinear, ...], int]:
    """The matmul weights of all decoder layers, grouped by (path, shape), and the layers' parameter total."""
    import torch

    found: dict[tuple[str, int, int, bool, int, bool], int] = {}
    seen: set[int] = set()
    total = 0
    for layer in layers:
        linear_params: set[int] = set()
        for path, module in layer.named_modules():
            if isinstance(module, torch.nn.Linear):
                key = (path, module.in_features, module.out_features, module.bias is not None, 1, True)
                found[key] = found.get(key, 0) + 1
                linear_params.update(id(p) for p in module.parameters(recurse=False))
            elif isinstance(module, torch.nn.modules.conv._ConvNd):  # Mamba's conv1d: 3-D, but no experts
                linear_params.update(id(p) for p in module.parameters(recurse=False))
        for path, p in layer.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
            # Fused experts (MixtralExperts, GptOssExperts, DeepseekV3NaiveMoe): one 3-D parameter of E matrices.
            # Orientation differs by family; (E, out, in) as F.linear takes it is assumed (counts do not care).
            if p.dim() == 3 and id(p) not in linear_params:
                key = (path, p.shape[2], p.shape[1], False, p.shape[0], False)
                found[key] = found.get(key, 0) + 1
    linears = tuple(
        InventoryLinear(
            name=k[0], in_features=k[1], out_features=k[2], bias=k[3], copies=k[4], layers=n, is_linear=k[5]
        )
        for k, n in found.items()
    )
    return linears, total


@lru_cache(maxsize=64)
def _inventory_cached(cfg_items: tuple[tuple[str, str], ...], where: str) -> ModuleInventory:
    import json

    cfg = {k: json.loads(v) for k, v in cfg_items}
    hf_cfg = hf_config_object(cfg, where)
    try:
        import torch  # noqa: F401
    except ImportError as exc:  # pragma: no cover
        raise MissingDependencyError("torch", "trace") from exc
    model = build_meta_model(hf_cfg, where=where)
    text = hf_cfg.get_text_config()
    layers = decoder_layers(model, int(text.num_hidden_layers))
    # Layer paths without their index: group equal layers (named_modules inside one layer carry no index).
    linears, layer_total = _layer_linears(layers)
    # Norms over the hidden width (MLA's q_a/kv_a_layernorm act on the narrower latents and are not among them).
    norms = [
        n
        for n, p in layers[-1].named_parameters()
        if p.dim() == 1
        and n.endswith("norm.weight")
        and (p.numel() == text.hidden_size or n.split(".")[-2] in _QK_NORMS)
    ]
    unique = {id(p): p for p in model.parameters()}
    total = sum(p.numel() for p in unique.values())
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    head = 0 if out is None or out.weight is emb else out.weight.numel()
    import transformers

    return ModuleInventory(
        total_params=total,
        embedding_params=emb.numel(),
        lm_head_params=head,
        decoder_layers=len(layers),
        layer_params_total=layer_total,
        last_layer_params=sum(p.numel() for p in layers[-1].parameters()),
        linears=linears,
        other_params=total - emb.numel() - head - layer_total,
        norms_per_layer=sum(1 for n in norms if n.split(".")[-2] not in _QK_NORMS),
        qk_norm=any(n.split(".")[-2] in _QK_NORMS for n in norms),
        model_class=type(model).__name__,
        supports_sdpa=bool(getattr(model, "_supports_sdpa", True)),
        config_json=json.dumps(cfg, sort_keys=True),
        transformers_version=transformers.__version__,
    )


def meta_inventory(cfg: Mapping[str, Any], where: str) -> ModuleInventory:
    """Exact parameter facts of the model ``cfg`` describes, from a meta-device build (cached per config)."""
    import json

    items = tuple(sorted((str(k), json.dumps(v, sort_keys=True)) for k, v in cfg.items()))
    return _inventory_cached(items, where)


def _attr(cfg: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        value = getattr(cfg, n, None)
        if value is not None:
            return value
    return default


def _has(inv: ModuleInventory, *leaves: str) -> bool:
    return any(lin.name.split(".")[-1] in leaves for lin in inv.linears)


def generic_model_spec(cfg: Mapping[str, Any], *, name: str, source: str) -> ModelSpec:
    """A ModelSpec for any decoder transformers can build: exact parameters from the meta-device inventory, and
    the widths the generic activation estimate needs from transformers' own config object (class defaults
    filled in). MLA (DeepSeek-V2/V3) attends with heads of qk_nope_head_dim + qk_rope_head_dim."""
    where = f"config {source}"
    inv = meta_inventory(cfg, where)
    text = hf_config_object(cfg, where).get_text_config()
    hidden = int(text.hidden_size)
    heads = int(_attr(text, "num_attention_heads", default=1))
    kv_heads = int(_attr(text, "num_key_value_heads", default=heads))
    if heads % kv_heads:
        kv_heads = heads
    mla = _attr(text, "qk_nope_head_dim")
    head_dim = int(mla + text.qk_rope_head_dim) if mla else int(_attr(text, "head_dim", default=hidden // heads))
    experts = int(_attr(text, "n_routed_experts", "num_local_experts", "num_experts", default=0) or 0)
    inter = int(_attr(text, "intermediate_size", "moe_intermediate_size", default=4 * hidden))
    layer_types = _attr(text, "layer_types", default=None)
    window = int(_attr(text, "sliding_window", "attention_chunk_size", default=0) or 0)
    sliding = sum(1 for t in layer_types if t != "full_attention") if isinstance(layer_types, list) else 0
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or _attr(text, "dtype", default="float32")
    return ModelSpec(
        name=name,
        family=str(cfg.get("model_type")),
        vocab_size=int(text.vocab_size),
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=int(text.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        tie_word_embeddings=inv.lm_head_params == 0,
        max_position_embeddings=int(_attr(text, "max_position_embeddings", default=0)),
        qk_norm=inv.qk_norm,
        norms_per_layer=inv.norms_per_layer,
        gated_mlp=not _has(inv, "fc1", "c_fc", "dense_h_to_4h"),
        fused_qkv=_has(inv, "qkv_proj", "c_attn", "query_key_value", "Wqkv"),
        fused_gate_up=_has(inv, "gate_up_proj") and not experts,
        num_experts=experts,
        experts_per_token=int(_attr(text, "num_experts_per_tok", default=2)) if experts else 0,
        moe_intermediate_size=int(_attr(text, "moe_intermediate_size", "intermediate_size", default=inter))
        if experts
        else 0,
        sliding_window=window if sliding else 0,
        sliding_layers=sliding if window else 0,
        kv_lora_rank=int(_attr(text, "kv_lora_rank", default=0) or 0) if mla else 0,
        qk_rope_head_dim=int(text.qk_rope_head_dim) if mla else 0,
        attn_dropout=float(_attr(text, "attention_dropout", default=0.0) or 0.0),
        hidden_act=str(_attr(text, "hidden_act", "hidden_activation", default="silu")),
        native_dtype=str(dtype).removeprefix("torch."),
        source=source,
        checkpoint_quant=checkpoint_quant(cfg, where),
        inventory=inv,
        vision=vision_spec(cfg, where),
    )


class PeftAdapters(NamedTuple):
    """What ``get_peft_model`` adapted on the meta device."""

    adapted: tuple[tuple[InventoryLinear, int], ...]
    """Each adapted weight (as in the inventory; the layers holding an adapter) with its adapter parameters in one
    layer."""
    unmatched: tuple[str, ...]
    """The target parameters that matched no parameter."""


@lru_cache(maxsize=256)
def peft_adapters(
    inv: ModuleInventory, *, rank: int, targets: tuple[str, ...] | None, dora: bool, parameters: tuple[str, ...] = ()
) -> PeftAdapters:
    """What PEFT's LoRA adapts in the decoder layers, from ``get_peft_model`` on the meta device: each adapted
    weight (as in the inventory) with the adapter parameters of one copy in one layer.

    PEFT decides the targets itself (tuners_utils.py ``_maybe_include_all_linear_layers``; for MoE models whose
    transformers-5 experts are fused 3-D parameters, utils/transformers_weight_conversion.py
    ``_convert_peft_config_moe`` adds them as ``target_parameters`` with rank 2r for ``gate_up_proj``), so its
    answer is taken rather than re-derived. ``targets`` None means ``all-linear``; ``parameters`` are PEFT's
    ``target_parameters`` (analytic/target_parameters.py), each of which must match a parameter.
    """
    import json

    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:  # pragma: no cover
        raise MissingDependencyError("peft", "trace") from exc
    where = f"model {inv.model_class}"
    hf_cfg = hf_config_object(json.loads(inv.config_json), where)
    model = build_meta_model(hf_cfg, where=where)
    cfg = LoraConfig(
        r=rank,
        target_modules="all-linear" if targets is None else list(targets),
        target_parameters=list(parameters) or None,
        use_dora=dora,
        task_type="CAUSAL_LM",
    )
    import warnings

    import torch

    # torch.device("meta"): PEFT builds each adapter's Linear on the default device before moving it next to its
    # base layer (tuners/lora/layer.py update_layer), so the adapters are allocated and initialised on the CPU
    # otherwise, seconds for a 7B model; on the meta device the shapes are the same and nothing is allocated.
    with _quiet_transformers(), warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        try:
            peft_model = get_peft_model(model, cfg)
        except ValueError as exc:
            raise VramledgerError(f"--lora-targets: PEFT rejected the targets ({exc})") from None
    unmatched = _unmatched_parameter_targets(peft_model, parameters)
    layers = decoder_layers(peft_model, inv.decoder_layers)
    inside = {id(m) for layer in layers for m in layer.modules()}
    # Paths inside a decoder layer (no index, so equal layers group), then adapters outside the layers (PEFT's
    # all-linear also picks a vision tower's linears), once each under their full path.
    modules = [pair for layer in layers for pair in layer.named_modules()]
    modules += [(path, m) for path, m in peft_model.named_modules() if id(m) not in inside]
    found: dict[tuple[str, int, int, int, bool, bool], int] = {}
    for path, module in modules:
        if not hasattr(module, "lora_A") or "default" not in getattr(module, "lora_A", {}):
            continue
        parts = [module.lora_A["default"], module.lora_B["default"]]
        magnitude = getattr(module, "lora_magnitude_vector", {})
        if "default" in magnitude:
            parts.append(magnitude["default"])
        params = sum(p.numel() for part in parts for p in part.parameters())
        name = path.replace(".base_layer", "")
        wrapped = transposed = False
        if getattr(module, "parameter_name", None):  # a ParamWrapper around a parameter (3-D experts, a router)
            name = f"{name}.{module.parameter_name}"
            wrapped = True
            # transformers' experts stored (E, in, out) for ``x @ W`` (integrations/moe.py use_experts_implementation
            # ``is_transposed``: GptOssExperts), which the inventory read as (E, out, in)
            transposed = bool(getattr(module.get_base_layer(), "is_transposed", False))
        a_in, b_out = parts[0].weight.shape[1], parts[1].weight.shape[0]
        key = (name, params, a_in, b_out, wrapped, transposed)
        found[key] = found.get(key, 0) + 1
    by_name = {lin.name: lin for lin in inv.linears}
    out = []
    for (name, params, a_in, b_out, wrapped, transposed), n in found.items():
        # A router held as a bare parameter (DeepseekV3TopkRouter.weight) is no inventory linear: its adapter's
        # shapes give in and out.
        base = by_name.get(name) or InventoryLinear(
            name=name, in_features=a_in, out_features=b_out, bias=False, layers=n, is_linear=not wrapped
        )
        if transposed:
            base = replace(base, in_features=base.out_features, out_features=base.in_features)
        out.append((replace(base, layers=n), params))
    return PeftAdapters(adapted=tuple(out), unmatched=unmatched)


def _unmatched_parameter_targets(peft_model: Any, parameters: tuple[str, ...]) -> tuple[str, ...]:
    """The target parameters that match no parameter PEFT wrapped (PEFT itself only warns), by its rule
    (tuners_utils.py ``_inject_parameters``: the key or a dotted suffix of it)."""
    keys = [
        f"{path.replace('.base_layer', '')}.{module.parameter_name}"
        for path, module in peft_model.named_modules()
        if getattr(module, "parameter_name", None)
    ]
    return tuple(t for t in parameters if not any(k == t or k.endswith(f".{t}") for k in keys))


def spec_to_json(spec: ModelSpec) -> dict[str, Any]:
    """A meta-built spec as stored beside a catalog config (``meta_build``), so that listing the catalog and
    estimating its models stay instant and need no transformers; tests/catalog rebuild and compare each one."""
    from dataclasses import asdict

    out = asdict(spec)
    for key in ("name", "source", "config_name", "vision"):  # vision: re-read from the config (spec_from_json)
        out.pop(key)
    assert out["inventory"] is not None
    out["inventory"].pop("config_json")
    import json

    return dict(json.loads(json.dumps(out)))  # tuples as the lists JSON stores


def spec_from_json(stored: Mapping[str, Any], config: Mapping[str, Any], *, name: str, source: str) -> ModelSpec:
    """The inverse of ``spec_to_json``, for the config it was built from."""
    import json

    fields = dict(stored)
    inv = dict(fields.pop("inventory"))
    linears = tuple(InventoryLinear(**lin) for lin in inv.pop("linears"))
    inventory = ModuleInventory(**inv, linears=linears, config_json=json.dumps(dict(config), sort_keys=True))
    stored_quant = fields.pop("checkpoint_quant", None)
    quant = None
    if stored_quant is not None:
        block = stored_quant["block"]
        quant = CheckpointQuant(
            **{**stored_quant, "skip": tuple(stored_quant["skip"]), "block": tuple(block) if block else None}
        )
    return ModelSpec(
        **fields,
        name=name,
        source=source,
        inventory=inventory,
        checkpoint_quant=quant,
        vision=vision_spec(config, f"config {source}"),
    )


def apply_peft_config(hf: Any, cfg: dict[str, Any], *, adapter_fp32: bool) -> Any:
    """``get_peft_model`` with the config an ``adapter_config.json`` mapping describes, for causal-LM training: the
    trace, the GPU measure's worker and the estimate's count on the meta device (analytic/peft_memory.py)."""
    from peft import PeftConfig, get_peft_model

    # peft_model.py get_peft_model picks PeftModelForCausalLM from task_type; training: not inference_mode.
    cfg = {**cfg, "task_type": "CAUSAL_LM", "inference_mode": False}
    try:
        config = PeftConfig.from_peft_type(**cfg)
        return get_peft_model(hf, config, autocast_adapter_dtype=adapter_fp32)
    except (TypeError, ValueError, KeyError) as exc:
        raise VramledgerError(f"--peft-config: PEFT rejected the config ({exc})") from exc
