"""What a PEFT method other than LoRA (an ``adapter_config.json``, ``TrainSpec.peft_config``) adds to the step.

Legend: in/out a targeted linear's features, r rank, n virtual tokens, L sequence length, H hidden, Dkv = kv
heads × head_dim, c bytes of the compute dtype, a bytes of the adapter's input cast (see ``_cast_bytes``).

- Trainable parameters: ``analytic/peft_methods.py`` (each method's shapes in PEFT 0.21, checked against PEFT's
  own count). They take the adapters' dtype: fp32 under AMP or with PEFT's ``autocast_adapter_dtype``
  (tuners_utils.py ``cast_adapter_dtype``), which also covers LN tuning's copies; prompt encoders are created at
  torch's default dtype, fp32 (peft_model.py ``_setup_prompt_encoder``).
- Frozen buffers the method registers (counted with the frozen base): BOFT's permutation matrices ``boft_P``,
  (factor, in, in) fp32 per adapted linear (tuners/boft/layer.py ``update_layer``); VeRA's shared projections
  ``vera_A`` (r, max in) and ``vera_B`` (max out, r), fp32, once (tuners/vera/model.py ``_init_vera_A_vera_B``);
  OFT's ``rows``/``cols`` int64 indices of the b(b-1)/2 upper-triangle entries per adapted linear
  (tuners/oft/layer.py ``OFTRotationModule``).
- Saved activations per token per layer, where the rule is simple:
  IA3 (tuners/ia3/layer.py ``Linear.forward``): a feedforward module multiplies its input, cast to the vector's
  dtype, by ``ia3_l`` (the product saves that cast: a·in); another module multiplies its output (saves the
  output, c·out).
  LoHa, LoKr (tuners/lycoris_utils.py ``LycorisLayer.forward`` → ``F.linear(input cast to the delta's dtype,
  delta_weight)``), OFT (tuners/oft/layer.py ``Linear.forward``: the input cast to R's dtype, rotated), BOFT
  (tuners/boft/layer.py ``Linear.forward``: ``F.linear`` with the rotated weight) and AdaLoRA
  (tuners/adalora/layer.py ``SVDLinear.forward``: ``x @ (A·E)ᵀ @ Bᵀ``) save their input cast as LoRA does
  (a·in; AdaLoRA also the r-wide middle). VeRA (tuners/vera/layer.py ``Linear.forward``: ``λ_b ·
  F.linear(λ_d · F.linear(x, A), B)``) saves the r-wide and the out-wide products' inputs.
  LN tuning (tuners/ln_tuning/layer.py: the norm's trained copy runs): an RMSNorm whose weight trains also
  saves its normalised value (s·H per targeted norm).
  Prefix tuning (peft_model.py ``PeftModelForCausalLM.forward`` passes the prefix as ``past_key_values``; the
  cache concatenates it to every layer's keys and values, which SDPA saves): 2·c·Dkv·n more per sequence per
  layer. Prompt tuning and p-tuning (the same forward concatenates n virtual embeddings before the input): the
  whole step runs n more tokens per sequence (``step_train``).
  Not counted here: the delta or rotated weight LoHa, LoKr and BOFT build in every forward (out·in per adapted
  linear, saved by ``F.linear``): ``vramledger trace`` gives those exactly (the basis note says so).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from vramledger.analytic.params import Linear, in_layers, layer_linears
from vramledger.analytic.peft_methods import PeftCount, peft_trainable
from vramledger.analytic.sdpa_mask import mask_columns
from vramledger.errors import VramledgerError
from vramledger.specs import DType, ModelSpec, TrainSpec

PROMPT_METHODS = ("PROMPT_TUNING", "P_TUNING")
"""Methods that put n virtual tokens before every sequence's embeddings."""

_INPUT_SAVERS = ("LOHA", "LOKR", "OFT", "BOFT", "ADALORA")
"""Methods whose adapter keeps its input cast for backward, as LoRA's does."""

_MATMUL_METHODS = ("LOHA", "LOKR", "OFT", "BOFT", "ADALORA")
"""Methods whose trainable tensors feed matmuls (autocast makes a bf16 copy); IA3, VeRA's vectors, norms and
prompt embeddings are used elementwise or looked up."""

_LORA_UNMODELLED = (
    "rank_pattern",
    "layers_to_transform",
    "trainable_token_indices",
    "exclude_modules",
    "layer_replication",
)
"""LoRA fields that change what trains but that the LoRA formulas do not take (``trace`` runs them)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PeftWeights:
    """The parameters and buffers a non-LoRA PEFT method adds (``weights.weight_budget`` makes the budget)."""

    count: PeftCount
    trainable_dtype: DType
    buffer_bytes: int
    """Frozen buffers the method registers (BOFT permutations, VeRA projections, OFT indices)."""
    matrix_params: int
    """Trainable parameters used in matmuls (autocast keeps a bf16 copy of each under AMP)."""
    largest_numel: int
    """The largest single trainable tensor."""


def config_of(train: TrainSpec) -> dict[str, Any]:
    """The ``adapter_config.json`` mapping the spec carries (empty without one)."""
    return json.loads(train.peft_config) if train.peft_config is not None else {}


def _linears_named(m: ModelSpec, names: tuple[str, ...]) -> list[Linear]:
    by_name = {lin.name: lin for lin in layer_linears(m)}
    return [by_name[n] for n in names if n in by_name]


def _adapter_dtype(train: TrainSpec, peft_type: str) -> DType:
    prec = train.precision
    adapter_fp32 = train.lora is None or train.lora.adapter_fp32
    if peft_type in ("PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING") or prec.mixed or prec.compute is DType.FP32:
        return DType.FP32
    return DType.FP32 if adapter_fp32 else train.frozen_dtype


def _largest(m: ModelSpec, count: PeftCount, cfg: dict[str, Any]) -> int:
    """The largest single trainable tensor, from the same shapes as peft_methods.py (an upper bound where a
    method splits a module's parameters into several tensors)."""
    n = int(cfg.get("num_virtual_tokens") or 0)
    if count.peft_type == "PROMPT_TUNING":
        return count.trainable_params
    if count.peft_type in ("P_TUNING", "PREFIX_TUNING"):
        return max(n * m.hidden_size, count.trainable_params // max(1, n))
    if count.peft_type == "LN_TUNING":
        return m.hidden_size
    linears = _linears_named(m, count.targets)
    per_module = count.trainable_params // max(1, sum(in_layers(m, lin) * lin.per_layer for lin in linears))
    return max(per_module, 1)


def _buffer_bytes(m: ModelSpec, count: PeftCount, cfg: dict[str, Any], *, boft_fbd_cuda: bool) -> int:
    linears = _linears_named(m, count.targets)
    copies = [(in_layers(m, lin) * lin.per_layer, lin) for lin in linears]
    if count.peft_type == "BOFT":
        factor = int(cfg.get("boft_n_butterfly_factor") or 1) if boft_fbd_cuda else 1
        return sum(k * factor * lin.in_features**2 * 4 for k, lin in copies)
    if count.peft_type == "VERA" and linears:
        r = int(cfg.get("r") or 256)
        return 4 * r * (max(lin.in_features for lin in linears) + max(lin.out_features for lin in linears))
    if count.peft_type == "OFT":
        block, r_cfg = int(cfg.get("oft_block_size") or 32), int(cfg.get("r") or 0)
        return sum(
            k * 2 * 8 * (b * (b - 1) // 2)
            for k, lin in copies
            for b in [block if r_cfg == 0 else lin.in_features // r_cfg]
        )
    return 0


def method_count(m: ModelSpec, train: TrainSpec) -> PeftCount:
    """The method's trainable parameters: from its shapes (peft_methods.py) on a model with formulas, else from
    PEFT itself on the meta device (targets then unnamed)."""
    if m.inventory is None:
        return peft_trainable(m, config_of(train))
    assert train.peft_config is not None and train.peft_type is not None
    n = _meta_count(m.inventory.config_json, train.peft_config)
    return PeftCount(peft_type=train.peft_type, trainable_params=n, targets=())


@lru_cache(maxsize=64)
def _meta_count(config_json: str, peft_config: str) -> int:
    """PEFT 0.21's own count (``get_nb_trainable_parameters``) of the method on the model built on the meta
    device and wrapped by ``get_peft_model`` (catalog/inventory.py ``build_meta_model``, ``apply_peft_config``).
    AdaLoRA's ``ranknum`` is left out: only on the meta device does PEFT make it require grad (trace/build.py)."""
    import warnings

    import torch

    from vramledger.catalog.inventory import apply_peft_config, build_meta_model, hf_config_object

    hf_cfg = hf_config_object(json.loads(config_json), "model")
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        peft_model = apply_peft_config(
            build_meta_model(hf_cfg, where="model"), json.loads(peft_config), adapter_fp32=True
        )
    return sum(p.numel() for n, p in peft_model.named_parameters() if p.requires_grad and ".ranknum." not in n)


def check_lora_fields(cfg: dict[str, Any]) -> None:
    """A LoRA config goes through the LoRA formulas (``LoraSpec``); refuse fields they cannot take."""
    for key in _LORA_UNMODELLED:
        if cfg.get(key):
            raise VramledgerError(
                f"peft config: {key} is not modelled by `estimate` (the LoRA formulas take r, lora_alpha, "
                "target_modules, target_parameters, lora_dropout, use_dora, modules_to_save); `vramledger trace "
                "--peft-config` runs it"
            )
    target = cfg.get("target_modules")
    if isinstance(target, str) and target.lower() not in ("all-linear", "all", "all_linear"):
        raise VramledgerError(
            f"peft config: target_modules {target!r} is a regular expression, which `estimate` does not match for "
            "LoRA; list the module names, or run `vramledger trace --peft-config`"
        )


def peft_weights(m: ModelSpec, train: TrainSpec, *, boft_fbd_cuda: bool = True) -> PeftWeights | None:
    """The parameters of the PEFT method ``train.peft_config`` names; None for LoRA, which the LoRA formulas
    model from ``train.lora`` (after checking that they can)."""
    cfg = config_of(train)
    peft_type = train.peft_type
    if peft_type is None:
        return None
    if peft_type == "LORA":
        check_lora_fields(cfg)
        return None
    if cfg.get("modules_to_save"):
        raise VramledgerError(
            f"peft config: modules_to_save with {peft_type} is not modelled by `estimate`; "
            "`vramledger trace --peft-config` runs it"
        )
    count = peft_trainable(m, cfg, boft_fbd_cuda=boft_fbd_cuda) if m.inventory is None else method_count(m, train)
    return PeftWeights(
        count=count,
        trainable_dtype=_adapter_dtype(train, peft_type),
        buffer_bytes=_buffer_bytes(m, count, cfg, boft_fbd_cuda=boft_fbd_cuda),
        matrix_params=count.trainable_params if peft_type in _MATMUL_METHODS else 0,
        largest_numel=_largest(m, count, cfg),
    )


def _cast_bytes(train: TrainSpec) -> int:
    """Bytes per element of the input an adapter saves: autocast re-casts it to bf16/fp16 under AMP; otherwise
    the cast to the adapter's dtype (the rule of activations.py ``_adapter_bytes`` for LoRA)."""
    if train.precision.mixed:
        return 2
    return _adapter_dtype(train, "").bytes


def peft_activation_parts(
    m: ModelSpec, train: TrainSpec, residual: int, padded: bool, input_of: Mapping[str, str]
) -> list[tuple[str, int]]:
    """(part, bytes per token) that a non-LoRA PEFT method adds to one decoder layer's saved tensors; empty for
    LoRA and the prompt methods (``step_train``). ``residual``: bytes of the residual stream; ``padded``: SDPA
    already gets a mask (activations.py ``padded_sdpa``); ``input_of``: which linears read the same tensor
    (activations.py). Tensors saved once per layer (not per token) are spread over the micro-batch's tokens,
    rounded up."""
    peft_type = train.peft_type
    if peft_type in (None, "LORA") or peft_type in PROMPT_METHODS or m.inventory is not None:
        return []
    cfg = config_of(train)
    count = peft_trainable(m, cfg)
    c, a, T = train.precision.compute.bytes, _cast_bytes(train), train.tokens
    linears = [(lin, lin.per_layer * in_layers(m, lin)) for lin in _linears_named(m, count.targets)]

    def per_layer(width: Any) -> int:
        return sum(copies * width(lin) // m.num_layers for lin, copies in linears)

    def once_per_layer(elements: Any) -> int:
        return -(-per_layer(elements) // T)

    if peft_type == "IA3":
        ff = {str(t) for t in (cfg.get("feedforward_modules") or ["down_proj"])}
        a_ia3 = 4 if _adapter_dtype(train, peft_type) is DType.FP32 else c
        return [
            (
                "IA3 scaled inputs/outputs",
                per_layer(
                    lambda lin: a_ia3 * lin.in_features if lin.name.split(".")[-1] in ff else c * lin.out_features
                ),
            )
        ]
    if peft_type in _INPUT_SAVERS:
        r = int(cfg.get("init_r") or 12) if peft_type == "ADALORA" else 0
        parts = [(f"{peft_type} adapter inputs", per_layer(lambda lin: a * lin.in_features + a * r))]
        if peft_type in ("LOHA", "BOFT") and train.precision.mixed:
            # LoHa's HadaWeight matmuls run under autocast (a bf16 delta), BOFT multiplies x by a rotation cast to
            # x's dtype: the input needs no cast, and the matmul saves the layer's own input, one tensor for the
            # adapters that read it (q/k/v; gate/up).
            widths = {input_of.get(lin.name, lin.name): copies * lin.in_features for lin, copies in linears}
            parts = [(f"{peft_type} adapter inputs", 2 * sum(widths.values()) // m.num_layers)]
        if peft_type == "BOFT":
            # tuners/boft/layer.py Linear.forward: ``result * boft_scale`` saves the base output (c·out); per
            # forward, in × in matrices saved for R's gradient: boft_P cast to x's dtype (factor of them), the
            # butterfly product (factor) and the rotation x is multiplied by (one).
            f = int(cfg.get("boft_n_butterfly_factor") or 1)
            parts.append(("BOFT scaled outputs", per_layer(lambda lin: c * lin.out_features)))
            parts.append(("BOFT rotations", once_per_layer(lambda lin: (2 * f + 1) * c * lin.in_features**2)))
        if peft_type in ("LOHA", "LOKR"):
            # The delta weight (out × in) each forward builds, saved by F.linear for the input's gradient.
            delta = once_per_layer(lambda lin: a * lin.in_features * lin.out_features)
            parts.append((f"{peft_type} delta weights", delta))
        return parts
    if peft_type == "VERA":
        r = int(cfg.get("r") or 256)
        parts = [("VeRA scaled projections", per_layer(lambda lin: a * r + a * lin.out_features))]
        if train.precision.mixed:
            # Under autocast each F.linear casts its slice of vera_A / vera_B (views: autocast caches only leaves)
            # and saves the cast for the input's gradient.
            casts = once_per_layer(lambda lin: 2 * r * (lin.in_features + lin.out_features))
            parts.append(("VeRA projection casts", casts))
        return parts
    if peft_type == "LN_TUNING":
        norms = [t for t in count.targets if t in ("input_layernorm", "post_attention_layernorm")]
        return [("trained norms' normalised values", len(norms) * residual * m.hidden_size)]
    if peft_type == "PREFIX_TUNING":
        return [_prefix_part(m, train, int(cfg.get("num_virtual_tokens") or 0), padded)]
    return []


def _prefix_part(m: ModelSpec, train: TrainSpec, n: int, padded: bool) -> tuple[str, int]:
    """The prefix's n keys and values in every layer. transformers' SDPA mask (masking_utils ``sdpa_mask``) can
    skip the mask only when the keys are the queries' own (no past): with a prefix a mask is built, so
    ``repeat_kv`` copies K and V to every head (as for a padded batch, activations.py), and every layer's SDPA
    makes the boolean (L, L + n) mask an additive one of the compute dtype, its last dimension padded to 16, which
    the memory-efficient kernel saves (torch attention.cpp ``convert_boolean_attn_mask``, ``preprocess_mask``; a
    padded batch's (L, L) mask is counted in activations.py: here only the n more columns)."""
    c, L, Dq, Dkv = train.precision.compute.bytes, train.seq_len, m.q_dim, m.kv_dim

    # With a padded batch K/V are already repeated (activations.py): then only the n more keys and values.
    per_seq = 2 * c * Dq * n if padded else 2 * c * (Dq * (L + n) - Dkv * L)
    per_seq += c * L * (mask_columns(L + n) - (mask_columns(L) if padded else 0))
    return f"prefix keys/values ({n} virtual tokens, repeated to every head) and their mask", -(-per_seq // L)


def step_train(train: TrainSpec) -> TrainSpec:
    """The spec the step runs: prompt and p-tuning add ``num_virtual_tokens`` to every sequence (peft_model.py
    ``PeftModelForCausalLM.forward``: ``torch.cat((prompts, inputs_embeds), dim=1)`` and -100 labels for them),
    so every layer, the logits and the loss see L + n tokens."""
    if train.peft_type not in PROMPT_METHODS:
        return train
    n = int(config_of(train).get("num_virtual_tokens") or 0)
    return replace(train, seq_len=train.seq_len + n)


def peft_source(train: TrainSpec) -> str | None:
    """The ledger source of the adapters' weights for a non-LoRA method: PEFT's method and its targets."""
    peft_type = train.peft_type
    if peft_type in (None, "LORA"):
        return None
    targets = config_of(train).get("target_modules")
    on = f" on {targets if isinstance(targets, str) else ', '.join(map(str, targets))}" if targets else ""
    return f"PEFT 0.21 {peft_type}{on}: its layers' parameter shapes (analytic/peft_methods.py), × adapter dtype"


def peft_basis(m: ModelSpec, train: TrainSpec) -> str | None:
    """What the estimate of a non-LoRA PEFT method rests on, for the ledger's warnings."""
    peft_type = train.peft_type
    if peft_type in (None, "LORA"):
        return None
    count = method_count(m, train)
    where = (
        f"on {len(count.targets)} module kinds ({', '.join(count.targets)}) of every layer, from its parameter shapes"
        if count.targets
        else "in its prompt encoder"
    )
    acts = {
        "PREFIX_TUNING": "activations add the virtual tokens' keys and values in every layer",
        "PROMPT_TUNING": "activations, logits and loss run the virtual tokens too",
        "P_TUNING": "activations, logits and loss run the virtual tokens too",
    }.get(peft_type, "activations add each adapter's saved tensors where PEFT's forward is simple")
    if m.inventory is not None:
        where, acts = "(PEFT's own count, on the meta device)", "activations are the base model's without the adapters'"
    return (
        f"{peft_type} (PEFT 0.21): {count.trainable_params:,} trainable parameters {where}; {acts}; "
        "`vramledger trace --peft-config` gives the exact activations"
    )
