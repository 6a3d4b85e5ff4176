"""The architecture facts that decide memory, read from a Hugging Face ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass

from vramledger.errors import VramledgerError
from vramledger.specs.vision import VisionSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointQuant:
    """How a pre-quantised checkpoint stores its linear layers (config.json ``quantization_config``)."""

    method: str
    """``gptq``, ``awq``, ``fp8`` (block-wise) or ``mxfp4``."""
    bits: int = 4
    group_size: int = 128
    """Input features per scale/zero group (GPTQ/AWQ); -1: one group."""
    block: tuple[int, int] | None = (128, 128)
    """FP8 scale block (``weight_block_size``); None: one scale per tensor."""
    skip: tuple[str, ...] = ()
    """``modules_to_not_convert``: names (or globs) left in the checkpoint dtype."""


@dataclass(frozen=True, kw_only=True, slots=True)
class InventoryLinear:
    """One kind of matmul weight found in the decoder layers of a model built on the meta device."""

    name: str
    """Path inside a decoder layer, without the layer index (``self_attn.q_proj``, ``mlp.experts.gate_up_proj``)."""
    in_features: int
    out_features: int
    bias: bool
    copies: int = 1
    """Experts stored as one 3-D parameter (E, ·, ·): E; 1 for an ``nn.Linear``."""
    layers: int
    """How many decoder layers hold it (DeepSeek's first dense layers and MoE layers differ)."""
    is_linear: bool = True
    """An ``nn.Linear`` (PEFT's ``all-linear`` can adapt it), not a fused 3-D expert parameter."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModuleInventory:
    """Exact parameter facts of a model that transformers built on the meta device (no memory, no weights).

    Built by ``catalog.inventory.meta_inventory`` for architectures without a formula here; the counts are
    ``numel`` of the real parameters, each shared tensor once.
    """

    total_params: int
    embedding_params: int
    """Input embeddings (``get_input_embeddings``)."""
    lm_head_params: int
    """Output projection, 0 when tied to the input embedding."""
    decoder_layers: int
    layer_params_total: int
    """Parameters of all decoder layers together."""
    last_layer_params: int
    """Parameters of the last decoder layer (what freezing all but the last layers trains, per layer)."""
    linears: tuple[InventoryLinear, ...]
    norms_per_layer: int
    """Norm weights in the last decoder layer other than q/k norms."""
    qk_norm: bool
    other_params: int
    """Everything else: final norm, vision tower and projector of a multimodal model, rotary buffers excluded."""
    model_class: str
    """The transformers class that was built (``DeepseekV3ForCausalLM``)."""
    supports_sdpa: bool
    """The class's ``_supports_sdpa`` (gpt-oss: False, its attention sinks need eager or a kernel)."""
    config_json: str
    """The config.json mapping it was built from (JSON, sorted keys): the one home trace rebuilds it from."""
    transformers_version: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """A decoder-only transformer's shape. Built by ``catalog.hfconfig.model_spec_from_config``."""

    name: str
    """Display name (hub id when known)."""
    family: str
    """``model_type`` from config.json: llama, mistral, qwen2, qwen3, qwen3_moe, mixtral, gemma2, gemma3_text,
    phi3, gpt2, …"""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    """MLP width (dense layers)."""
    num_layers: int
    num_heads: int
    num_kv_heads: int
    """Key/value heads (GQA/MQA); equal to ``num_heads`` for multi-head attention."""
    head_dim: int
    tie_word_embeddings: bool
    max_position_embeddings: int = 0
    qkv_bias: bool = False
    """Biases on q/k/v projections (Qwen2, GPT-2)."""
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys (Qwen3, Gemma 3)."""
    qk_norm_width: int = 0
    """Weights of q_norm + k_norm when they span whole projections (OLMo-2: heads·head_dim + kv_heads·head_dim);
    0: one head_dim each."""
    norms_per_layer: int = 2
    """2 for pre-norm blocks; 4 for Gemma 2/3 (pre and post norms around attention and MLP)."""
    norm_bias: bool = False
    """LayerNorm with bias (GPT-2) rather than RMSNorm."""
    gated_mlp: bool = True
    """SwiGLU/GeGLU (gate, up, down) rather than a plain two-layer MLP (GPT-2)."""
    fused_qkv: bool = False
    """One projection for q, k and v (Phi-3 ``qkv_proj``, GPT-2 ``c_attn``)."""
    fused_gate_up: bool = False
    """One projection for gate and up (Phi-3 ``gate_up_proj``)."""
    learned_positions: int = 0
    """Rows of a learned position embedding (GPT-2 ``wpe``); 0 for rotary models."""
    parallel_residual: bool = False
    """Attention and MLP both read the layer's input and add to it in one step (GPT-NeoX ``use_parallel_residual``,
    Phi, Falcon ``parallel_attn``); with ``norms_per_layer`` 1 they read the very same normed tensor."""
    rotary_dim: int = 0
    """Dimensions of each head that RoPE rotates (Phi ``partial_rotary_factor``, GPT-NeoX ``rotary_pct``); 0: all
    of ``head_dim``."""
    head_bias: bool = False
    """The output layer has a bias (Phi's ``lm_head``)."""
    num_experts: int = 0
    """Routed experts per MoE layer (0: dense)."""
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    sliding_window: int = 0
    """Window of sliding-window attention layers (0: none)."""
    sliding_layers: int = 0
    """How many of the layers use the sliding window."""
    kv_lora_rank: int = 0
    """MLA (DeepSeek-V2/V3): width of the compressed key/value latent, which is what the cache holds (0: not MLA)."""
    qk_rope_head_dim: int = 0
    """MLA: the rotary part of the key, shared by all heads and cached beside the latent."""
    final_logit_softcapping: float = 0.0
    attn_logit_softcapping: float = 0.0
    resid_dropout: float = 0.0
    """Dropout on each sublayer's output and on the embeddings in training (GPT-2 ``resid_pdrop``/``embd_pdrop``)."""
    attn_dropout: float = 0.0
    """Dropout on the attention probabilities in training (GPT-2 ``attn_pdrop``; ``attention_dropout`` elsewhere)."""
    hidden_act: str = "silu"
    native_dtype: str = "bfloat16"
    """``torch_dtype`` / ``dtype`` in config.json: the dtype the checkpoint is stored in."""
    source: str = ""
    """Where this config came from (catalog file and upstream URL, or a local path)."""
    checkpoint_quant: CheckpointQuant | None = None
    """A GPTQ/AWQ/FP8/MXFP4 checkpoint: the storage its linears load in (None: the dtype above)."""
    inventory: ModuleInventory | None = None
    """Exact parameters from a meta-device build, for a ``model_type`` without formulas here (None: formulas)."""
    config_name: str = ""
    """The catalog model whose config is used when the user named a variant (``Qwen/Qwen3-4B-Instruct-2507``
    resolved to ``Qwen/Qwen3-4B``); empty when ``name`` is that model itself."""
    vision: VisionSpec | None = None
    """The vision tower of a vision-language config (``vision_config``: Qwen2/2.5/3-VL, Gemma 3, Llama 4), read by
    ``catalog.vision_config``; None for a text-only model."""

    def __post_init__(self) -> None:
        for fld in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "head_dim"):
            if getattr(self, fld) <= 0:
                raise VramledgerError(f"model config: {fld} must be a positive integer (got {getattr(self, fld)})")
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise VramledgerError(
                f"model config: num_key_value_heads ({self.num_kv_heads}) must divide num_attention_heads "
                f"({self.num_heads})"
            )
        if self.max_position_embeddings < 0:
            raise VramledgerError(
                f"model config: max_position_embeddings must be a positive integer (got {self.max_position_embeddings})"
            )
        if self.num_experts and not (0 < self.experts_per_token <= self.num_experts):
            raise VramledgerError("model config: num_experts_per_tok must be between 1 and the number of experts")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def shared_block_input(self) -> bool:
        """Attention and MLP read one normed tensor (a parallel block with a single norm: Phi, Falcon-7B)."""
        return self.parallel_residual and self.norms_per_layer == 1

    @property
    def rope_dim(self) -> int:
        """Rotated dimensions of each head."""
        return self.rotary_dim or self.head_dim

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim
