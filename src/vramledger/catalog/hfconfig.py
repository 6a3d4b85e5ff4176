"""Turn a Hugging Face ``config.json`` mapping into a ModelSpec, without transformers and without remote code.

The per-family facts below (which projections carry biases, how many norms a block has, which defaults a
config may omit) are read from transformers 5.x ``models/<family>/modeling_<family>.py`` and
``configuration_<family>.py``; each is cited where it is used.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vramledger.catalog.checkpoint_quant import checkpoint_quant
from vramledger.catalog.vision_config import vision_spec
from vramledger.errors import VramledgerError
from vramledger.specs.model import ModelSpec

# Families whose decoder we model, with the config defaults that matter when a key is absent
# (configuration_<family>.py, transformers 5.x).
_TIE_DEFAULT = {
    "llama": False,
    "mistral": False,
    "mixtral": False,
    "qwen2": False,
    "qwen3": False,
    "qwen3_moe": False,
    "phi3": False,
    "glm4": False,
    "olmo2": False,
    "gemma": True,
    "gemma2": True,
    "gemma3_text": True,
    "gpt2": True,
    # Parallel blocks with LayerNorm and a GELU MLP (modeling_phi.py, modeling_gpt_neox.py, modeling_falcon.py);
    # FalconConfig leaves tie_word_embeddings at PreTrainedConfig's default, True.
    "phi": False,
    "gpt_neox": False,
    "falcon": True,
}
_LAYERNORM_FAMILIES = ("gpt2", "phi", "gpt_neox", "falcon")

# Shape defaults that published configs rely on by omitting the key. Gemma 3's multimodal checkpoints
# (gemma-3-4b/12b/27b) give only the overrides in ``text_config`` and leave vocab_size, head counts and
# head_dim to ``Gemma3TextConfig``'s class defaults (configuration_gemma3.py, transformers 5.x).
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {
        "vocab_size": 262_208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 131_072,
        "sliding_window": 4096,
        "hidden_activation": "gelu_pytorch_tanh",
    },
}


def _get(cfg: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    return default


def _context(cfg: Mapping[str, Any], where: str) -> int:
    """``max_position_embeddings`` (0 when the config does not give it); a given value must be positive."""
    value = _int(cfg, "max_position_embeddings", "n_positions", default=0, where=where)
    given = any(k in cfg for k in ("max_position_embeddings", "n_positions"))
    if given and value <= 0:
        raise VramledgerError(f"{where}: max_position_embeddings must be a positive integer (got {value}); fix it")
    return value


def _int(cfg: Mapping[str, Any], *keys: str, default: int | None = None, where: str) -> int:
    value = _get(cfg, *keys, default=default)
    if value is None:
        raise VramledgerError(f"{where}: missing {keys[0]!r}; is this a decoder LLM config.json?")
    if isinstance(value, bool) or not isinstance(value, int):
        raise VramledgerError(f"{where}: {keys[0]!r} must be an integer (got {value!r})")
    return value


def model_spec_from_config(cfg: Mapping[str, Any], *, name: str, source: str) -> ModelSpec:
    """Read the fields that decide memory from a config.json mapping.

    Multimodal configs with a ``text_config`` (Gemma 3) are read for their language model only.
    """
    where = f"config {source}"
    if not isinstance(cfg, Mapping):
        raise VramledgerError(f"{where}: expected a JSON object")
    text = language_model(cfg)
    family = _family(text)
    if family not in _TIE_DEFAULT:
        # No formula for this family: transformers builds it on the meta device for exact parameters.
        return _generic(cfg, name=name, source=source)
    if family in _FAMILY_DEFAULTS:
        text = {**_FAMILY_DEFAULTS[family], **text}
    gpt2 = family == "gpt2"
    layernorm = family in _LAYERNORM_FAMILIES
    shape = _shape(text, gpt2=gpt2 or family == "falcon", where=where)
    block = _block(text, family, shape, where=where)
    shape = block.shape
    # Experts: Mixtral calls them num_local_experts, Qwen3-MoE num_experts (configuration_*.py).
    experts = _int(text, "num_local_experts", "num_experts", default=0, where=where)
    moe_inter = _int(text, "moe_intermediate_size", default=shape.inter if experts else 0, where=where)
    if family == "qwen3_moe" and _mixes_dense_layers(text):
        # Dense and MoE layers mixed: no formula; the meta-device inventory counts each layer as built.
        return _generic(cfg, name=name, source=source)
    qkv_bias, o_bias, mlp_bias = _biases(text, family)
    window, sliding = _sliding_layers(text, family, shape.layers, where=where)
    dtype = str(_get(text, "torch_dtype", "dtype", default="float32"))
    return ModelSpec(
        name=name,
        family=family,
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.inter,
        num_layers=shape.layers,
        num_heads=shape.heads,
        num_kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        tie_word_embeddings=bool(_get(text, "tie_word_embeddings", default=_TIE_DEFAULT[family])),
        max_position_embeddings=_context(text, where),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        qk_norm=family in ("qwen3", "qwen3_moe", "gemma3_text", "olmo2"),
        # Olmo2Attention: q_norm RMSNorm(heads·head_dim), k_norm RMSNorm(kv_heads·head_dim) over whole projections;
        # Olmo2DecoderLayer has post_attention_layernorm and post_feedforward_layernorm only (modeling_olmo2.py).
        qk_norm_width=(shape.heads + shape.kv_heads) * shape.head_dim if family == "olmo2" else 0,
        # Glm4DecoderLayer: input, post_self_attn, post_attention and post_mlp RMSNorms (modeling_glm4.py).
        norms_per_layer=block.norms,
        norm_bias=layernorm,
        gated_mlp=not layernorm,
        fused_qkv=family in ("phi3", "gpt2", "gpt_neox", "falcon"),
        fused_gate_up=family in ("phi3", "glm4"),  # Glm4MLP.gate_up_proj, like Phi3MLP
        learned_positions=_int(text, "n_positions", default=1024, where=where) if gpt2 else 0,
        parallel_residual=block.parallel,
        rotary_dim=block.rotary_dim,
        head_bias=family == "phi",  # PhiForCausalLM.lm_head = nn.Linear(H, V, bias=True)
        num_experts=experts,
        experts_per_token=_int(text, "num_experts_per_tok", default=2, where=where) if experts else 0,
        moe_intermediate_size=moe_inter,
        sliding_window=window,
        sliding_layers=sliding,
        final_logit_softcapping=float(_get(text, "final_logit_softcapping", default=0.0) or 0.0),
        attn_logit_softcapping=float(_get(text, "attn_logit_softcapping", default=0.0) or 0.0),
        # GPT-2 drops out after attention and after the MLP; PhiDecoderLayer applies its resid_dropout to both too.
        resid_dropout=float(_get(text, "resid_pdrop", default=0.1 if gpt2 else 0.0) or 0.0)
        if family in ("gpt2", "phi")
        else 0.0,
        attn_dropout=float(_get(text, "attn_pdrop", "attention_dropout", default=0.1 if gpt2 else 0.0) or 0.0),
        # FalconMLP applies nn.GELU() and names no activation in its config.
        hidden_act=str(
            _get(
                text,
                "hidden_act",
                "hidden_activation",
                "activation_function",
                default="gelu" if family == "falcon" else "silu",
            )
        ),
        native_dtype=dtype,
        source=source,
        checkpoint_quant=checkpoint_quant(cfg, where),
        vision=vision_spec(cfg, where),
    )


def language_model(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The decoder's settings: a multimodal config's ``text_config``, with the top-level dtype and tying it
    inherits (and ``model_type`` ``<outer>_text``), else the config itself."""
    if not ("text_config" in cfg and isinstance(cfg["text_config"], Mapping)):
        return cfg
    text = dict(cfg["text_config"])
    text.setdefault("model_type", f"{cfg.get('model_type', '')}_text")
    for key in ("torch_dtype", "dtype", "tie_word_embeddings"):
        if key in cfg and key not in text:
            text[key] = cfg[key]
    return text


def _family(cfg: Mapping[str, Any]) -> str:
    """``model_type`` in lower case; Gemma 3's outer ``gemma3`` is read as its decoder, ``gemma3_text``."""
    family = str(_get(cfg, "model_type", default="")).lower()
    return "gemma3_text" if family == "gemma3" else family


def _generic(cfg: Mapping[str, Any], *, name: str, source: str) -> ModelSpec:
    """The spec of a model without a formula, from the meta-device inventory of what transformers builds."""
    from vramledger.catalog.inventory import generic_model_spec

    return generic_model_spec(cfg, name=name, source=source)


@dataclass(frozen=True, slots=True)
class _Shape:
    """The decoder's sizes, as the config gives them (or its family's defaults)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    inter: int


def _shape(cfg: Mapping[str, Any], *, gpt2: bool, where: str) -> _Shape:
    """The sizes, under their Llama names or GPT-2's (``n_embd``, ``n_head``, ``n_layer``, ``n_inner``, whose
    ``None`` means 4 × hidden: GPT2MLP in modeling_gpt2.py; ``gpt2`` also for Falcon, whose ``ffn_hidden_size``
    None means the same)."""
    hidden = _int(cfg, "hidden_size", "n_embd", where=where)
    heads = _int(cfg, "num_attention_heads", "n_head", where=where)
    kv_heads = _int(cfg, "num_key_value_heads", default=heads, where=where)
    if heads <= 0 or hidden <= 0:
        raise VramledgerError(
            f"{where}: hidden_size ({hidden}) and num_attention_heads ({heads}) must be positive integers; fix the "
            "config"
        )
    return _Shape(
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=_int(cfg, "head_dim", default=hidden // heads, where=where),
        layers=_int(cfg, "num_hidden_layers", "n_layer", where=where),
        vocab=_int(cfg, "vocab_size", where=where),
        # FalconConfig names the MLP width ffn_hidden_size (None: 4 × hidden, as GPT-2's n_inner).
        inter=_int(
            cfg, "intermediate_size", "n_inner", "ffn_hidden_size", default=4 * hidden if gpt2 else None, where=where
        ),
    )


@dataclass(frozen=True, slots=True)
class _Block:
    """How a decoder layer is wired: its sizes (Falcon's kv heads settled), how many norms it has,
    whether attention and MLP run in parallel, and how much of each head RoPE rotates."""

    shape: _Shape
    norms: int
    parallel: bool
    rotary_dim: int


def _block(cfg: Mapping[str, Any], family: str, shape: _Shape, *, where: str) -> _Block:
    """The wiring, from transformers 5.x:

    - ``PhiDecoderLayer``: one ``input_layernorm`` feeds attention and MLP, added in parallel;
      ``PhiAttention`` rotates ``int(partial_rotary_factor · head_dim)`` dimensions (configuration_phi.py default
      0.5).
    - ``GPTNeoXLayer``: ``input_layernorm`` and ``post_attention_layernorm``, both on the layer input when
      ``use_parallel_residual`` (default True); ``GPTNeoXAttention`` rotates ``int(rotary_pct · head_dim)``
      (``rotary_pct`` default 0.25; transformers 5 also reads it as ``partial_rotary_factor``).
    - ``FalconDecoderLayer``: ``new_decoder_architecture`` (Falcon-40B) has ``ln_attn`` and ``ln_mlp`` and
      ``num_kv_heads`` key/value heads; otherwise ``input_layernorm`` alone when ``parallel_attn`` (Falcon-7B, and
      one key/value head when ``multi_query``), plus ``post_attention_layernorm`` when not. ``FalconMLP`` is
      ``ffn_hidden_size`` wide (default 4·hidden); RoPE covers the whole head.
    - Everyone else: ``norms_per_layer`` 2, or 4 for Gemma 2/3 and GLM-4 (pre and post norms).
    """
    norms = 4 if family in ("gemma2", "gemma3_text", "glm4") else 2
    parallel, kv_heads = False, shape.kv_heads
    rotary = 0
    if family == "phi":
        parallel, norms = True, 1
        rotary = int(float(_get(cfg, "partial_rotary_factor", default=0.5)) * shape.head_dim)
    elif family == "gpt_neox":
        parallel = bool(_get(cfg, "use_parallel_residual", default=True))
        rotary = int(float(_get(cfg, "rotary_pct", "partial_rotary_factor", default=0.25)) * shape.head_dim)
    elif family == "falcon":
        new_arch = bool(_get(cfg, "new_decoder_architecture", default=False))
        parallel = new_arch or bool(_get(cfg, "parallel_attn", default=True))
        norms = 2 if new_arch or not parallel else 1
        if new_arch:
            kv_heads = _int(cfg, "num_kv_heads", default=shape.heads, where=where)
        elif _get(cfg, "multi_query", default=True):
            kv_heads = 1
    if rotary == shape.head_dim:
        rotary = 0
    shape = _Shape(
        hidden=shape.hidden, heads=shape.heads, kv_heads=kv_heads, head_dim=shape.head_dim, layers=shape.layers,
        vocab=shape.vocab, inter=shape.inter,
    )  # fmt: skip
    return _Block(shape=shape, norms=norms, parallel=parallel, rotary_dim=rotary)


def _mixes_dense_layers(cfg: Mapping[str, Any]) -> bool:
    """Whether some layers of a Qwen3-MoE have a dense MLP (``mlp_only_layers``, or ``decoder_sparse_step`` ≠ 1:
    Qwen3MoeDecoderLayer in modeling_qwen3_moe.py)."""
    sparse_step = _get(cfg, "decoder_sparse_step", default=1)
    return bool(_get(cfg, "mlp_only_layers", default=[]) or sparse_step != 1)


def _biases(cfg: Mapping[str, Any], family: str) -> tuple[bool, bool, bool]:
    """(q/k/v bias, o_proj bias, MLP bias). LlamaAttention (and Mistral/Qwen3/Gemma2 which copy it) uses
    bias=config.attention_bias on all of q/k/v/o; Qwen2Attention hard-codes bias=True on q/k/v and False on o;
    GPT-2's Conv1D layers all have bias."""
    attention_bias = bool(_get(cfg, "attention_bias", default=False))
    gpt2 = family == "gpt2"
    if family == "qwen2":
        qkv_bias, o_bias = True, False
    elif gpt2:
        qkv_bias, o_bias = True, True
    elif family in ("phi3", "mixtral"):
        qkv_bias, o_bias = False, False
    elif family == "phi":  # PhiAttention: q/k/v_proj and dense with bias=True; PhiMLP fc1/fc2 too
        return True, True, True
    elif family == "gpt_neox":  # query_key_value and dense: bias=config.attention_bias (default True); MLP: bias
        qkv_bias = o_bias = bool(_get(cfg, "attention_bias", default=True))
        return qkv_bias, o_bias, True
    elif family == "falcon":  # FalconLinear everywhere with bias=config.bias
        bias = bool(_get(cfg, "bias", default=False))
        return bias, bias, bias
    elif family == "glm4":  # Glm4Attention: q/k/v with bias=attention_bias, o_proj bias=False
        qkv_bias, o_bias = attention_bias, False
    else:
        qkv_bias = o_bias = attention_bias
    mlp_bias = True if gpt2 else bool(_get(cfg, "mlp_bias", default=False)) if family == "llama" else False
    return qkv_bias, o_bias, mlp_bias


def _sliding_layers(cfg: Mapping[str, Any], family: str, layers: int, *, where: str) -> tuple[int, int]:
    """(sliding window, number of layers that slide). transformers 5 writes ``layer_types``; older configs give
    a pattern."""
    window = _int(cfg, "sliding_window", default=0, where=where) or 0
    layer_types = _get(cfg, "layer_types", default=None)
    qwen = family in ("qwen2", "qwen3", "qwen3_moe")
    # Qwen2Config/Qwen3Config/Qwen3MoeConfig.__post_init__ drop sliding_window unless use_sliding_window.
    if qwen and not _get(cfg, "use_sliding_window", default=False):
        window = 0
    if not window:
        sliding = 0
    elif isinstance(layer_types, list):
        sliding = sum(1 for t in layer_types if t == "sliding_attention")
    elif family in ("qwen2", "qwen3"):  # Qwen2Config.__post_init__: layers i >= max_window_layers slide
        sliding = layers - min(layers, _int(cfg, "max_window_layers", default=28, where=where))
    elif family == "gemma2":  # Gemma2DecoderLayer: even-indexed layers slide
        sliding = (layers + 1) // 2
    elif family == "gemma3_text":  # every sliding_window_pattern-th layer is global
        pattern = max(1, _int(cfg, "sliding_window_pattern", default=6, where=where))
        sliding = layers - layers // pattern
    else:
        sliding = layers
    return window, sliding
