"""Parameter counts: every weight tensor of a decoder, enumerated as the modeling code creates it.

Legend: H hidden size, I MLP width, E experts, V vocabulary, Dq = heads × head_dim, Dkv = kv_heads × head_dim.

The layout follows transformers 5.x ``modeling_<family>.py``: ``LlamaDecoderLayer`` (q/k/v/o_proj,
gate/up/down_proj, input_layernorm, post_attention_layernorm), ``Qwen3Attention`` (q_norm/k_norm over
head_dim), ``Gemma2DecoderLayer`` (four norms), ``Phi3Attention.qkv_proj`` / ``Phi3MLP.gate_up_proj``,
``GPT2Block`` (Conv1D c_attn/c_proj/c_fc, LayerNorm with bias, learned ``wpe``), ``PhiDecoderLayer`` (q/k/v_proj and
``dense``, fc1/fc2, one LayerNorm, all with biases; ``lm_head`` with a bias), ``GPTNeoXLayer`` and
``FalconDecoderLayer`` (fused ``query_key_value``, ``dense``, ``dense_h_to_4h``/``dense_4h_to_h``; one or two
LayerNorms), ``MixtralSparseMoeBlock`` and
``Qwen3MoeSparseMoeBlock`` (router ``gate`` H→E without bias, E experts as fused 3-D ``gate_up_proj`` and
``down_proj`` parameters). Gemma's RMSNorm stores ``weight`` (applied as 1 + weight) of H elements, like the
others.
Tied embeddings (``tie_word_embeddings``) share one V×H matrix between input and output, counted once.
Every catalog model's count is checked against its published figure in tests/catalog/test_params.py and was
cross-checked against ``sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())`` on
the meta device (transformers 5.23).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from vramledger.specs.model import ModelSpec


@dataclass(frozen=True, slots=True)
class Linear:
    """A linear layer inside each decoder layer (or ``per_layer`` copies of it, for experts)."""

    name: str
    """Module name as PEFT matches ``target_modules`` against it (``q_proj``, ``c_attn``, …)."""
    in_features: int
    out_features: int
    bias: bool
    per_layer: int = 1
    """Copies per decoder layer: E for expert projections, 1 otherwise."""
    lora_targetable: bool = True
    """Whether PEFT's ``all-linear`` picks it (an ``nn.Linear``/``Conv1D``, not the output layer, not a fused
    expert parameter)."""
    layers: int = 0
    """How many decoder layers hold it; 0: every layer (always so for the families with formulas)."""

    @property
    def numel(self) -> int:
        per_copy = self.in_features * self.out_features + (self.out_features if self.bias else 0)
        return self.per_layer * per_copy


def in_layers(m: ModelSpec, lin: Linear) -> int:
    """Decoder layers holding ``lin``."""
    return lin.layers or m.num_layers


def linears_numel(m: ModelSpec, linears: tuple[Linear, ...] | list[Linear], *, weights_only: bool = False) -> int:
    """Elements of these linears across the whole model (biases too unless ``weights_only``)."""
    return sum(
        in_layers(m, lin) * (lin.per_layer * lin.in_features * lin.out_features if weights_only else lin.numel)
        for lin in linears
    )


@lru_cache(maxsize=256)
def layer_linears(m: ModelSpec) -> tuple[Linear, ...]:
    """The linear layers of one decoder layer."""
    if m.inventory is not None:
        # Built on the meta device (catalog/inventory.py): the layers' nn.Linear modules and 3-D expert weights.
        return tuple(
            Linear(
                lin.name,
                lin.in_features,
                lin.out_features,
                lin.bias,
                per_layer=lin.copies,
                lora_targetable=lin.is_linear,
                layers=0 if lin.layers == m.num_layers else lin.layers,
            )
            for lin in m.inventory.linears
        )
    H, Dq, Dkv, I = m.hidden_size, m.q_dim, m.kv_dim, m.intermediate_size  # noqa: E741 (legend: I = MLP width)
    out: list[Linear] = []
    if m.family == "gpt2":  # GPT2Attention.c_attn = Conv1D(3H, H); c_proj = Conv1D(H, H)
        out += [Linear("c_attn", H, 3 * H, True), Linear("c_proj", H, H, True)]
    elif m.family in ("gpt_neox", "falcon"):
        # GPTNeoXAttention / FalconAttention: fused ``query_key_value`` (Dq + 2·Dkv outputs) and ``dense``.
        out += [Linear("query_key_value", H, Dq + 2 * Dkv, m.qkv_bias), Linear("dense", Dq, H, m.o_bias)]
    elif m.family == "phi":  # PhiAttention: q/k/v_proj and ``dense``
        out += [
            Linear("q_proj", H, Dq, m.qkv_bias),
            Linear("k_proj", H, Dkv, m.qkv_bias),
            Linear("v_proj", H, Dkv, m.qkv_bias),
            Linear("dense", Dq, H, m.o_bias),
        ]
    elif m.fused_qkv:  # Phi3Attention.qkv_proj: Dq + 2·Dkv outputs
        out += [Linear("qkv_proj", H, Dq + 2 * Dkv, m.qkv_bias), Linear("o_proj", Dq, H, m.o_bias)]
    else:
        out += [
            Linear("q_proj", H, Dq, m.qkv_bias),
            Linear("k_proj", H, Dkv, m.qkv_bias),
            Linear("v_proj", H, Dkv, m.qkv_bias),
            Linear("o_proj", Dq, H, m.o_bias),
        ]
    if m.is_moe:
        E, Im = m.num_experts, m.moe_intermediate_size
        # transformers 5.x modeling_mixtral.py / modeling_qwen3_moe.py: the router ``gate`` is a
        # ``MixtralTopKRouter``/``Qwen3MoeTopKRouter`` holding a bare ``nn.Parameter(E, H)`` (no bias) applied
        # with F.linear, and the experts are ``MixtralExperts``/``Qwen3MoeExperts`` with two 3-D parameters,
        # ``gate_up_proj`` (E, 2·Im, H) and ``down_proj`` (E, H, Im). None of them is an nn.Linear, so PEFT's
        # ``all-linear`` picks none of them as modules; PEFT 0.21's MoE conversion adds them as target_parameters
        # (weights.py ``_converted_moe_adapters``).
        out += [
            Linear("gate", H, E, False, lora_targetable=False),
            Linear("experts.gate_up_proj", H, 2 * Im, False, per_layer=E, lora_targetable=False),
            Linear("experts.down_proj", Im, H, False, per_layer=E, lora_targetable=False),
        ]
    elif m.family == "gpt2":  # GPT2MLP: c_fc = Conv1D(I, H), c_proj = Conv1D(H, I)
        out += [Linear("c_fc", H, I, True), Linear("c_proj", I, H, True)]
    elif m.family == "phi":  # PhiMLP: fc1, activation, fc2
        out += [Linear("fc1", H, I, m.mlp_bias), Linear("fc2", I, H, m.mlp_bias)]
    elif m.family in ("gpt_neox", "falcon"):  # GPTNeoXMLP / FalconMLP: dense_h_to_4h, activation, dense_4h_to_h
        out += [Linear("dense_h_to_4h", H, I, m.mlp_bias), Linear("dense_4h_to_h", I, H, m.mlp_bias)]
    elif m.fused_gate_up:  # Phi3MLP.gate_up_proj: 2I outputs
        out += [Linear("gate_up_proj", H, 2 * I, m.mlp_bias), Linear("down_proj", I, H, m.mlp_bias)]
    else:
        out += [
            Linear("gate_proj", H, I, m.mlp_bias),
            Linear("up_proj", H, I, m.mlp_bias),
            Linear("down_proj", I, H, m.mlp_bias),
        ]
    return tuple(out)


def layer_norm_params(m: ModelSpec) -> int:
    """Norm weights in one decoder layer (LayerNorm adds a bias; Qwen3/Gemma 3 add q_norm and k_norm)."""
    per_norm = m.hidden_size * (2 if m.norm_bias else 1)
    return m.norms_per_layer * per_norm + ((m.qk_norm_width or 2 * m.head_dim) if m.qk_norm else 0)


def layer_params(m: ModelSpec) -> int:
    """Parameters of one decoder layer (of the last one, where layers differ)."""
    if m.inventory is not None:
        return m.inventory.last_layer_params
    return sum(lin.numel for lin in layer_linears(m)) + layer_norm_params(m)


def embedding_params(m: ModelSpec) -> int:
    """Input embedding (V×H) plus learned positions (GPT-2 ``wpe``)."""
    if m.inventory is not None:
        return m.inventory.embedding_params
    return m.vocab_size * m.hidden_size + m.learned_positions * m.hidden_size


def head_params(m: ModelSpec) -> int:
    """Final norm plus the output projection (0 extra when tied to the input embedding); for a meta-built
    model, everything outside the embedding and the decoder layers (a vision tower and projector too)."""
    if m.inventory is not None:
        return m.inventory.lm_head_params + m.inventory.other_params
    final_norm = m.hidden_size * (2 if m.norm_bias else 1)
    head = (0 if m.tie_word_embeddings else m.vocab_size * m.hidden_size) + (m.vocab_size if m.head_bias else 0)
    return final_norm + head


def count_params(m: ModelSpec) -> int:
    """Total parameters, each shared tensor once (as ``sum(p.numel() for p in model.parameters())``)."""
    if m.inventory is not None:
        return m.inventory.total_params
    return embedding_params(m) + m.num_layers * layer_params(m) + head_params(m)


def active_params(m: ModelSpec) -> int:
    """Parameters touched per token: for MoE only ``experts_per_token`` of the experts."""
    if not m.is_moe:
        return count_params(m)
    expert_numel = linears_numel(m, [lin for lin in layer_linears(m) if lin.per_layer == m.num_experts])
    idle = expert_numel * (m.num_experts - m.experts_per_token) // m.num_experts
    return count_params(m) - idle
