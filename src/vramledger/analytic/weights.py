"""Which parameters exist, which train, and how many bytes each group takes.

Legend: P parameters; r LoRA rank; in/out a linear layer's features; bytes per element from the dtype.

Sources:
- PEFT 0.21 ``tuners/lora/layer.py`` ``LoraLayer.update_layer``: lora_A is Linear(in, r), lora_B Linear(r, out),
  no biases; DoRA adds ``lora_magnitude_vector`` of size out. ``tuners_utils.cast_adapter_dtype``: with
  ``autocast_adapter_dtype=True`` (the default) bf16/fp16 adapter weights are upcast to fp32.
  ``target_modules="all-linear"`` picks every ``nn.Linear``/``Conv1D`` except the output layer
  (``_maybe_include_all_linear_layers``).
- bitsandbytes ``functional.quantize_4bit``: two 4-bit codes per byte and one fp32 absmax per ``blocksize``
  (64) elements; with double quantisation (``compress_statistics``) the absmax are stored as uint8 with one fp32
  absmax per 256 of them. ``Linear8bitLt`` / ``Int8Params``: int8 weights plus one fp32 scale (SCB) per row.
  transformers' bnb quantizer leaves the output layer (lm_head) unquantised (``get_keys_to_not_convert``);
  Lightning's ``BitsandbytesPrecision`` (LitGPT's QLoRA) quantises it too (``lm_head_quantised``).
- LoRA on the output layer (``lm_head`` in ``target_modules``; LitGPT ``lora_head``): one more adapter,
  r·(H + V) (+ V for DoRA). PEFT ``utils/other.py`` ``ModulesToSaveWrapper`` (``modules_to_save``): the original
  module stays (frozen) and a ``copy.deepcopy`` of it trains, so each saved module adds its parameters once more
  as trainable, in the adapters' dtype (with their gradients and optimizer states).
- LLaMA-Factory ``model/adapter.py`` ``_setup_freeze_tuning``: method freeze trains the last
  ``freeze_trainable_layers`` decoder layers (all their modules), nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from vramledger.analytic.params import (
    Linear,
    count_params,
    embedding_params,
    in_layers,
    layer_linears,
    layer_params,
    linears_numel,
)
from vramledger.analytic.target_parameters import (
    formula_parameter_targets,
    peft_names,
    unknown_error,
    wrapper_params,
)
from vramledger.errors import VramledgerError
from vramledger.specs import DType, LoraSpec, Method, ModelCode, ModelSpec, QuantSpec, TrainSpec
from vramledger.specs.model import CheckpointQuant

if TYPE_CHECKING:
    from vramledger.analytic.peft_memory import PeftWeights


@dataclass(frozen=True, kw_only=True, slots=True)
class Adapted:
    """One LoRA-adapted linear layer (per decoder layer)."""

    linear: Linear
    params: int
    """Adapter parameters for one copy: r·(in + out), plus out for DoRA's magnitude."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightBudget:
    total_params: int
    trainable_params: int
    frozen_bytes: int
    """Bytes of parameters that do not train (quantised storage included)."""
    trainable_bytes: int
    """Bytes of trainable parameters in their storage dtype."""
    trainable_dtype: DType
    trainable_layers: int
    """Decoder layers whose weights or adapters train (activations are saved only from the first of them on)."""
    adapted: tuple[Adapted, ...]
    """LoRA-adapted projections of one decoder layer."""
    trainable_matrix_params: int
    """Trainable parameters that are matmul weights (autocast caches a low-precision copy of each)."""
    largest_trainable_numel: int
    """Largest single trainable tensor (for per-tensor optimizer temporaries)."""
    largest_frozen_matrix_numel: int
    """Largest frozen matmul weight of a decoder layer (QLoRA dequantises one at a time)."""
    frozen_matrix_params: int
    """Frozen matmul weights (decoder linears and lm_head): under autocast an fp32 one is cast on every use."""
    embedding_trainable: bool
    head_trainable: bool
    norms_trainable: bool
    lm_head_weight_numel: int


def _matches(name: str, targets: tuple[str, ...]) -> bool:
    # PEFT check_target_module_exists: a target matches the module's name or a dotted suffix of it.
    leaf = name.split(".")[-1]
    return any(t in (name, leaf) for t in targets)


def adapted_linears(m: ModelSpec, train: TrainSpec) -> tuple[Adapted, ...]:
    assert train.lora is not None
    lora = train.lora
    if m.inventory is not None:
        adapted = _inventory_adapted(m, lora)
        if train.freeze_vision_tower and m.vision is not None:  # LLaMA-Factory keeps adapters out of the tower
            adapted = tuple(a for a in adapted if not m.vision.holds(a.linear.name))
        return adapted
    linears = litgpt_linears(m) if train.model_code.litgpt else layer_linears(m)
    targets = lora.layer_targets
    tower = () if train.freeze_vision_tower else siglip_linears(m, train)
    if lora.all_linear:
        picked = [lin for lin in linears + tower if lin.lora_targetable]
    else:
        picked = [lin for lin in linears if _matches(lin.name, targets)]
        unknown = [t for t in targets if not any(_matches(lin.name, (t,)) for lin in linears)]
        if unknown:
            names = ", ".join(sorted({lin.name.split(".")[-1] for lin in linears}))
            raise VramledgerError(
                f"lora targets: {', '.join(unknown)} not found in {m.family} layers; choose from {names} or 'all'"
            )
        picked += [lin for lin in tower if _matches(lin.name, targets)]
        if any(not lin.lora_targetable for lin in picked):
            raise VramledgerError(
                "lora targets: expert projections are fused 3-D parameters in transformers 5, not nn.Linear; "
                "target the attention projections or 'all'"
            )
    out = []
    for lin in picked:
        p = lora.rank * (lin.in_features + lin.out_features) + (lin.out_features if lora.dora else 0)
        out.append(Adapted(linear=lin, params=p * lin.per_layer))
    named = _parameter_adapters(m, linears, lora) if lora.parameters else []  # raises for a name matching nothing
    if lora.all_linear and m.family in _PEFT_MOE_CONVERTED:
        # PEFT adds the named parameters to the ones its conversion adapts (a set): the same weights, at its ranks
        out += _converted_moe_adapters(linears, lora.rank)
    else:
        out += named
    return tuple(out)


_FUSED_QKV = ("query_key_value", "qkv_proj")


def litgpt_linears(m: ModelSpec) -> tuple[Linear, ...]:
    """The layer's linears as LitGPT's LoRA sees them, under the names LoRA targets use here:

    - its one fused ``attn`` linear is adapted part by part, ``q_proj``, ``k_proj`` and ``v_proj`` (litgpt 43c44323
      ``lora.py`` ``LoRAQKVLinear.__init__`` l. 231-243, lit-gpt 8641822 the same: ``lora_A`` (r · enabled parts,
      in), ``lora_B`` (Σ enabled widths, r), so r·(in + width) per part);
    - a gated MLP is ``LLaMAMLP``'s two linears ``fc_1`` and ``fc_2`` (``model.py``), each a ``LoRALinear`` with its
      own adapter and dropout, where transformers fuses them (Phi-3's ``gate_up_proj``)."""
    out: list[Linear] = []
    for lin in layer_linears(m):
        if lin.name in _FUSED_QKV:
            H, Dq, Dkv = lin.in_features, m.q_dim, m.kv_dim
            out += [Linear("q_proj", H, Dq, lin.bias), Linear("k_proj", H, Dkv, lin.bias),
                    Linear("v_proj", H, Dkv, lin.bias)]  # fmt: skip
        elif lin.name == "gate_up_proj":
            half = lin.out_features // 2
            out += [Linear("gate_proj", lin.in_features, half, lin.bias),
                    Linear("up_proj", lin.in_features, half, lin.bias)]  # fmt: skip
        else:
            out.append(lin)
    return tuple(out)


def siglip_linears(m: ModelSpec, train: TrainSpec) -> tuple[Linear, ...]:
    """The linears of Gemma 3's SigLIP tower, one per tower layer under its full path, when images make the model
    Gemma3ForConditionalGeneration (the language-model formula leaves them out; a meta-built model lists its own):
    modeling_siglip.py ``SiglipAttention`` q/k/v/out_proj and ``SiglipMLP`` fc1/fc2, all with biases. PEFT's
    ``all-linear`` picks them, and a target name matches them as it matches the decoder's."""
    from vramledger.specs.vision import ImageRule

    v = m.vision
    if v is None or m.inventory is not None or v.rule is not ImageRule.FIXED or not train.images:
        return ()
    h, i_w = v.hidden_size, v.intermediate_size
    shapes = [(f"self_attn.{n}", h, h) for n in ("q_proj", "k_proj", "v_proj", "out_proj")]
    shapes += [("mlp.fc1", h, i_w), ("mlp.fc2", i_w, h)]
    return tuple(
        Linear(name=f"vision_tower.vision_model.encoder.layers.{i}.{n}", in_features=a, out_features=b, bias=True,
               layers=1)
        for i in range(v.depth)
        for n, a, b in shapes
    )  # fmt: skip


def head_adapter_params(m: ModelSpec, train: TrainSpec) -> int:
    """LoRA on lm_head: r·(H + V), plus V for DoRA's magnitude (0 without a head adapter)."""
    lora = train.lora
    if lora is None or not lora.head:
        return 0
    return lora.rank * (m.hidden_size + m.vocab_size) + (m.vocab_size if lora.dora else 0)


_SAVED_EMBEDDING = ("embed_tokens", "wte")


def saved_module_params(m: ModelSpec, train: TrainSpec) -> tuple[int, int]:
    """(embedding, lm_head) parameters of the trained copies PEFT's ``modules_to_save`` makes (0 when not listed).

    The head's copy is V×H even when the embedding is tied: PEFT wraps ``lm_head`` on its own."""
    lora = train.lora
    if lora is None or not lora.modules_to_save:
        return 0, 0
    known = (*_SAVED_EMBEDDING, "lm_head")
    unknown = [name for name in lora.modules_to_save if name.split(".")[-1] not in known]
    if unknown:
        raise VramledgerError(
            f"modules_to_save: {', '.join(unknown)} not modelled; choose from embed_tokens and lm_head"
        )
    leaves = {name.split(".")[-1] for name in lora.modules_to_save}
    embed = embedding_params(m) if leaves & set(_SAVED_EMBEDDING) else 0
    head = m.vocab_size * m.hidden_size if "lm_head" in leaves else 0
    return embed, head


# PEFT 0.21 with transformers 5 (utils/transformers_weight_conversion.py ``_convert_peft_config_moe``, for model
# types whose conversion pattern is mixtral's or qwen2_moe's): "all-linear" also adapts the router ``gate.weight``
# and the fused experts as ``target_parameters``, ``gate_up_proj`` at rank 2r (gate and up were two v4 linears).
_PEFT_MOE_CONVERTED = ("mixtral", "qwen3_moe")


def _converted_moe_adapters(linears: tuple[Linear, ...], r: int) -> list[Adapted]:
    """ParamWrapper adapters (analytic/target_parameters.py ``wrapper_params``) on the router and both expert
    stacks, ``gate_up_proj`` at rank 2r."""
    out = []
    for lin in linears:
        if lin.name in ("gate", "experts.gate_up_proj", "experts.down_proj"):
            rank = 2 * r if lin.name.endswith("gate_up_proj") else r
            out.append(Adapted(linear=lin, params=wrapper_params(lin, rank)))
    return out


def _parameter_adapters(m: ModelSpec, linears: tuple[Linear, ...], lora: LoraSpec) -> list[Adapted]:
    """ParamWrapper adapters on the parameters ``lora.parameters`` name, at rank r (target_parameters.py)."""
    return [
        Adapted(linear=lin, params=wrapper_params(lin, lora.rank))
        for lin in formula_parameter_targets(m, linears, lora)
    ]


def _inventory_adapted(m: ModelSpec, lora: LoraSpec) -> tuple[Adapted, ...]:
    """A model without formulas: PEFT itself, on the meta device, says what it adapts (its MoE conversions
    included); transformers and peft are imported here only for such models."""
    assert m.inventory is not None
    linears = layer_linears(m)
    attention = any(lin.name.split(".")[-1] in ("q_proj", "qkv_proj", "query_key_value", "Wqkv") for lin in linears)
    dense = all(lin.lora_targetable for lin in linears) and not lora.parameters
    if m.inventory.model_class.endswith("ForCausalLM") and attention and dense:
        # Dense attention text model: PEFT adapts exactly the nn.Linear modules named (all of them for all-linear;
        # the output layer is no decoder-layer linear), r·(in + out) each, so no torch is needed. (State-space
        # layers go to PEFT, which refuses some of their modules: tuners/lora/model.py Mamba checks.)
        picked = linears if lora.all_linear else tuple(lin for lin in linears if _matches(lin.name, lora.targets))
        if picked or lora.all_linear:
            return tuple(
                Adapted(
                    linear=lin,
                    params=lora.rank * (lin.in_features + lin.out_features) + (lin.out_features if lora.dora else 0),
                )
                for lin in picked
            )
    from vramledger.catalog.inventory import peft_adapters

    found = peft_adapters(
        m.inventory,
        rank=lora.rank,
        targets=None if lora.all_linear else lora.targets,
        dora=lora.dora,
        parameters=peft_names(lora),
    )
    if found.unmatched:
        unknown = [given for given, t in zip(lora.parameters, peft_names(lora), strict=True) if t in found.unmatched]
        choices = ", ".join(lin.name for lin in linears if not lin.lora_targetable)
        raise unknown_error(unknown, m.family, choices)
    return tuple(
        Adapted(
            linear=Linear(
                lin.name,
                lin.in_features,
                lin.out_features,
                lin.bias,
                per_layer=lin.copies,
                lora_targetable=lin.is_linear,
                layers=0 if lin.layers == m.num_layers else lin.layers,
            ),
            params=params,
        )
        for lin, params in found.adapted
    )


def quantised_tensors(numel: int, out_features: int, q: QuantSpec) -> tuple[int, ...]:
    """The bytes of each tensor one bitsandbytes-quantised weight is stored as (the allocator rounds each).

    4-bit (bitsandbytes/functional.py ``quantize_4bit``): ``(n + 1) // 2`` packed uint8 bytes and one fp32 absmax
    per ``blocksize`` elements; with double quantisation (``compress_statistics``) the absmax is itself
    block-quantised (``quantize_blockwise``, blocks of 256): one uint8 per block plus one fp32 per 256 blocks.
    8-bit (``Int8Params``): one int8 per element plus the fp32 row scales ``SCB`` (one per output row).
    """
    if q.bits == 8:
        return numel, 4 * out_features
    blocks = -(-numel // q.blocksize)
    packed = -(-numel // 2)
    if q.double_quant:
        return packed, blocks, 4 * -(-blocks // 256)
    return packed, 4 * blocks


def quantised_bytes(numel: int, out_features: int, q: QuantSpec) -> int:
    """Storage of one bitsandbytes-quantised weight (see module docstring)."""
    return sum(quantised_tensors(numel, out_features, q))


def lm_head_quantised(train: TrainSpec) -> bool:
    """Whether bitsandbytes quantises lm_head as well: under Lightning's ``BitsandbytesPrecision`` (LitGPT's QLoRA,
    model_code litgpt / lit-gpt-2023) ``module_init_context`` patches ``torch.nn.Linear`` with its ``_Linear4bit``
    while LitGPT builds ``GPT`` (Lightning 438f29f0 ``plugins/precision/bitsandbytes.py`` l. 140, 71aed751 l. 130),
    and LitGPT passes no ``ignore_modules`` (litgpt 43c44323 ``finetune/lora.py`` l. 123, lit-gpt 8641822 l. 74), so
    lm_head (``model.py`` l. 25; ``lora.py``'s ``LoRALinear.linear``, l. 121) is 4-bit too. LitGPT never ties it to
    the embedding. transformers skips it (``get_keys_to_not_convert``)."""
    return (
        train.quant is not None
        and train.quant.bits == 4
        and train.model_code in (ModelCode.LITGPT, ModelCode.LIT_GPT_2023)
    )


@lru_cache(maxsize=4096)
def weight_budget(m: ModelSpec, train: TrainSpec) -> WeightBudget:
    """The parameters of ``train``'s method and their bytes: every one trained (full), the top layers (freeze), or
    adapters over a frozen, possibly quantised base (LoRA, QLoRA)."""
    # No parameter depends on the micro-batch or the length: one budget per setup, whatever shapes a search asks for.
    return _setup_budget(m, train.at_shape(1, 1))


@lru_cache(maxsize=256)
def _setup_budget(m: ModelSpec, train: TrainSpec) -> WeightBudget:
    if train.method is Method.FULL:
        return _full_budget(m, train)
    if train.method is Method.FREEZE:
        return _freeze_budget(m, train)
    if train.peft_config is not None:  # a PEFT method from adapter_config.json: analytic/peft_memory.py
        from vramledger.analytic.peft_memory import peft_weights

        pw = peft_weights(m, train)  # None for LoRA, which the adapter budget models
        if pw is not None:
            return _peft_budget(m, train, pw)
    return _adapter_budget(m, train)


def _full_budget(m: ModelSpec, train: TrainSpec) -> WeightBudget:
    from vramledger.analytic.vision_params import full_tuning_tower_params

    # A vision tower frozen by --freeze-vision-tower keeps its load dtype and no gradient; Gemma 3's, which the
    # language-model count leaves out, is added when it trains.
    frozen_tower, trained_tower = full_tuning_tower_params(m, train)
    total = count_params(m) + trained_tower
    train_dt = train.precision.trainable
    linears = layer_linears(m)
    lm_head_numel = m.vocab_size * m.hidden_size
    largest = max(embedding_params(m), max(lin.in_features * lin.out_features for lin in linears))
    # Autocast casts what matmul-type ops use (torch autocast_mode.cpp lower_precision_fp list: linear, matmul):
    # every linear's weight and bias, and the lm_head weight (the embedding itself when tied). aten::embedding
    # and the norms' elementwise weights are not cast.
    matrix = linears_numel(m, linears) + lm_head_numel
    return WeightBudget(
        total_params=total,
        trainable_params=total - frozen_tower,
        frozen_bytes=frozen_tower * train.frozen_dtype.bytes,
        trainable_bytes=(total - frozen_tower) * train_dt.bytes,
        trainable_dtype=train_dt,
        trainable_layers=m.num_layers,
        adapted=(),
        trainable_matrix_params=matrix,
        largest_trainable_numel=largest,
        largest_frozen_matrix_numel=0,
        frozen_matrix_params=0,
        embedding_trainable=True,
        head_trainable=True,
        norms_trainable=True,
        lm_head_weight_numel=lm_head_numel,
    )


def _freeze_budget(m: ModelSpec, train: TrainSpec) -> WeightBudget:
    total = count_params(m)
    frozen_dt, train_dt = train.frozen_dtype, train.precision.trainable
    linears = layer_linears(m)
    lm_head_numel = m.vocab_size * m.hidden_size
    largest_frozen = max(lin.in_features * lin.out_features for lin in linears)
    k = min(train.freeze_trainable_layers, m.num_layers)
    trainable = k * layer_params(m)
    matrix = k * sum(lin.in_features * lin.out_features * lin.per_layer for lin in linears)
    return WeightBudget(
        total_params=total,
        trainable_params=trainable,
        frozen_bytes=(total - trainable) * frozen_dt.bytes,
        trainable_bytes=trainable * train_dt.bytes,
        trainable_dtype=train_dt,
        trainable_layers=k,
        adapted=(),
        trainable_matrix_params=matrix,
        largest_trainable_numel=max(lin.in_features * lin.out_features for lin in linears) if k else 0,
        largest_frozen_matrix_numel=largest_frozen,
        frozen_matrix_params=linears_numel(m, linears, weights_only=True) - matrix + lm_head_numel,
        embedding_trainable=False,
        head_trainable=False,
        norms_trainable=k > 0,
        lm_head_weight_numel=lm_head_numel,
    )


def _adapter_budget(m: ModelSpec, train: TrainSpec) -> WeightBudget:
    """LoRA / QLoRA: adapters train; the base is frozen (quantised for QLoRA)."""
    total = count_params(m)
    prec = train.precision
    frozen_dt = train.frozen_dtype
    linears = layer_linears(m)
    lm_head_numel = m.vocab_size * m.hidden_size
    largest_frozen = max(lin.in_features * lin.out_features for lin in linears)
    assert train.lora is not None
    adapted = adapted_linears(m, train)
    head_adapter = head_adapter_params(m, train)
    saved_embed, saved_head = saved_module_params(m, train)
    adapter_params = sum(in_layers(m, a.linear) * a.params for a in adapted) + head_adapter + saved_embed + saved_head
    adapter_dt = DType.FP32 if (train.lora.adapter_fp32 or prec.compute is DType.FP32) else frozen_dt
    # The trained copies of modules_to_save keep the module's dtype (PEFT's cast_adapter_dtype casts only LoRA
    # layers), upcast to fp32 under AMP as LLaMA-Factory upcasts every trainable parameter.
    saved_dt = DType.FP32 if (prec.mixed or prec.compute is DType.FP32) else frozen_dt
    largest_adapter = max(
        [train.lora.rank * max(a.linear.in_features, a.linear.out_features) for a in adapted]
        + [train.lora.rank * m.vocab_size if head_adapter else 0]
        + [m.vocab_size * m.hidden_size if (saved_embed or saved_head) else 0]
    )
    return WeightBudget(
        total_params=total + adapter_params,
        trainable_params=adapter_params,
        frozen_bytes=_frozen_base_bytes(m, train),
        trainable_bytes=(adapter_params - saved_embed - saved_head) * adapter_dt.bytes
        + (saved_embed + saved_head) * saved_dt.bytes,
        trainable_dtype=adapter_dt,
        trainable_layers=m.num_layers if (adapted or saved_embed) else 0,
        adapted=adapted,
        # The embedding copy is looked up, not multiplied: autocast casts no copy of it.
        trainable_matrix_params=adapter_params - saved_embed,
        largest_trainable_numel=largest_adapter,
        largest_frozen_matrix_numel=largest_frozen,
        frozen_matrix_params=linears_numel(m, linears, weights_only=True) + lm_head_numel,
        embedding_trainable=bool(saved_embed),
        head_trainable=bool(saved_head),
        norms_trainable=False,
        lm_head_weight_numel=lm_head_numel,
    )


def _peft_budget(m: ModelSpec, train: TrainSpec, pw: PeftWeights) -> WeightBudget:
    """Another PEFT method over the same frozen base: its trainable count and buffers (analytic/peft_memory.py)."""
    total = count_params(m)
    linears = layer_linears(m)
    lm_head_numel = m.vocab_size * m.hidden_size
    n = pw.count.trainable_params
    return WeightBudget(
        total_params=total + n,
        trainable_params=n,
        frozen_bytes=_frozen_base_bytes(m, train) + pw.buffer_bytes,
        trainable_bytes=n * pw.trainable_dtype.bytes,
        trainable_dtype=pw.trainable_dtype,
        trainable_layers=m.num_layers,
        adapted=(),
        trainable_matrix_params=pw.matrix_params,
        largest_trainable_numel=pw.largest_numel,
        largest_frozen_matrix_numel=max(lin.in_features * lin.out_features for lin in linears),
        frozen_matrix_params=linears_numel(m, linears, weights_only=True) + lm_head_numel,
        embedding_trainable=False,
        head_trainable=False,
        norms_trainable=pw.count.peft_type == "LN_TUNING",
        lm_head_weight_numel=lm_head_numel,
    )


def _frozen_base_bytes(m: ModelSpec, train: TrainSpec) -> int:
    """The frozen base under the adapters: bitsandbytes-quantised (QLoRA), a pre-quantised checkpoint's storage, or
    plain in the frozen dtype."""
    total = count_params(m)
    frozen_dt = train.frozen_dtype
    linears = layer_linears(m)
    if train.quant is not None:
        q = train.quant
        quantised = sum(
            in_layers(m, lin) * lin.per_layer * quantised_bytes(lin.in_features * lin.out_features, lin.out_features, q)
            for lin in linears
        )
        # Everything else (embeddings, norms, biases, lm_head) stays in the frozen dtype.
        other = total - linears_numel(m, linears, weights_only=True)
        if lm_head_quantised(train):  # a 4-bit lm_head of its own beside the embedding, tied or not
            head = m.vocab_size * m.hidden_size
            quantised += quantised_bytes(head, m.vocab_size, q)
            other -= 0 if m.tie_word_embeddings else head
        frozen_bytes = quantised + other * frozen_dt.bytes
    elif m.checkpoint_quant is not None and m.checkpoint_quant.method != "mxfp4":
        # A GPTQ/AWQ/FP8 checkpoint keeps its packed storage under the adapters (PEFT wraps the quantised layer).
        # MXFP4 is not: its kernels have no backward, so fine-tuning loads it dequantised (Mxfp4Config(dequantize
        # =True), as the gpt-oss fine-tuning recipes do).
        frozen_bytes = checkpoint_storage_bytes(m, frozen_dt.bytes)
    else:
        frozen_bytes = total * frozen_dt.bytes
    return frozen_bytes


# -- storage of pre-quantised checkpoints (GPTQ, AWQ, FP8, MXFP4), per linear layer -----------------------------
# Each is the buffers the loading layer registers, so bytes = Σ numel × element size; ``g = ⌈in / group_size⌉``
# groups (group_size -1: one group of the whole input).


def gptq_bytes(in_features: int, out_features: int, *, bits: int = 4, group_size: int = 128, bias: bool = False) -> int:
    """auto-gptq / optimum / gptqmodel ``QuantLinear.__init__`` (qlinear_cuda.py, qlinear_exllama.py):
    qweight int32 (in·bits/32, out), qzeros int32 (g, out·bits/32), scales fp16 (g, out), g_idx int32 (in),
    bias fp16 (out). Zero points are stored packed for every group even when symmetric."""
    g = -(-in_features // (group_size if group_size > 0 else in_features))
    qweight = 4 * (in_features // 32 * bits) * out_features
    qzeros = 4 * g * (out_features // 32 * bits)
    return qweight + qzeros + 2 * g * out_features + 4 * in_features + (2 * out_features if bias else 0)


def awq_bytes(in_features: int, out_features: int, *, bits: int = 4, group_size: int = 128, bias: bool = False) -> int:
    """AutoAWQ ``WQLinear_GEMM.__init__`` (awq/modules/linear/gemm.py): qweight int32 (in, out/(32/bits)),
    qzeros int32 (in/group, out/(32/bits)), scales fp16 (in/group, out), bias fp16 (out); no g_idx."""
    g = in_features // (group_size if group_size > 0 else in_features)
    per_int = 32 // bits
    return (
        4 * in_features * (out_features // per_int)
        + 4 * g * (out_features // per_int)
        + 2 * g * out_features
        + (2 * out_features if bias else 0)
    )


def fp8_block_bytes(in_features: int, out_features: int, *, block: tuple[int, int] | None = (128, 128)) -> int:
    """transformers integrations/finegrained_fp8.py ``FP8Linear``: weight float8 (out, in) and weight_scale_inv
    fp32 (⌈out/128⌉, ⌈in/128⌉) for block-wise scales (DeepSeek-V3, Qwen3-FP8), one fp32 scale per tensor
    otherwise."""
    if block is None:
        return out_features * in_features + 4
    scales = -(-out_features // block[0]) * -(-in_features // block[1])
    return out_features * in_features + 4 * scales


def mxfp4_bytes(numel: int) -> int:
    """OCP MXFP4 as gpt-oss ships its experts (transformers integrations/mxfp4.py ``Mxfp4GptOssExperts``: two
    FP4 values per uint8, ``*_blocks`` (…, in/32, 16), and one E8M0 uint8 scale per 32 values, ``*_scales``)."""
    return numel // 2 + -(-numel // 32)


def _skipped(name: str, skip: tuple[str, ...]) -> bool:
    """``modules_to_not_convert`` entries match a module path by substring or glob (transformers
    quantizers ``should_convert_module``)."""
    from fnmatch import fnmatch

    path = f"model.layers.0.{name}"
    return any(s in name or fnmatch(path, s) or fnmatch(path, f"{s}.*") for s in skip)


def checkpoint_linear_bytes(lin: Linear, cq: CheckpointQuant, dtype_bytes: int) -> int:
    """Storage of one decoder-layer linear (all its copies) as the pre-quantised checkpoint loads it."""
    if _skipped(lin.name, cq.skip):
        return lin.numel * dtype_bytes
    i, o, n = lin.in_features, lin.out_features, lin.per_layer
    if cq.method == "gptq":
        return n * gptq_bytes(i, o, bits=cq.bits, group_size=cq.group_size, bias=lin.bias)
    if cq.method == "awq":
        return n * awq_bytes(i, o, bits=cq.bits, group_size=cq.group_size, bias=lin.bias)
    if cq.method == "fp8":
        return n * fp8_block_bytes(i, o, block=cq.block) + (n * o * dtype_bytes if lin.bias else 0)
    # mxfp4: transformers converts only the fused experts (Mxfp4GptOssExperts); nn.Linear stays in the dtype.
    # Its expert biases become fp32 parameters: 4 − dtype more bytes than the bias counted with the rest. GptOss
    # stores experts as (E, in, out) for ``x @ W``, which the inventory reads as (E, out, in): the bias has the
    # inventory's in_features.
    if lin.lora_targetable:
        return lin.numel * dtype_bytes
    return n * mxfp4_bytes(i * o) + n * i * (4 - dtype_bytes)


def checkpoint_storage_bytes(m: ModelSpec, dtype_bytes: int) -> int:
    """All parameters of a pre-quantised checkpoint as loaded: the decoder linears in its storage, the rest
    (embeddings, norms, lm_head, biases held apart) in the dtype. Plain ``count × dtype`` without one."""
    total = count_params(m)
    if m.checkpoint_quant is None:
        return total * dtype_bytes
    linears = layer_linears(m)
    quantised = sum(
        in_layers(m, lin) * checkpoint_linear_bytes(lin, m.checkpoint_quant, dtype_bytes) for lin in linears
    )
    return quantised + (total - linears_numel(m, linears)) * dtype_bytes
