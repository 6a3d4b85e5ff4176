"""Trainable parameters of PEFT methods beyond LoRA, from an ``adapter_config.json`` mapping, without torch.

Legend: in/out a targeted linear's features, r the method's rank, n virtual tokens, L decoder layers, H hidden.

Each formula is the parameter shapes the method's layer creates in PEFT 0.21 (file cited per method), summed over
the targeted ``nn.Linear`` modules of every decoder layer (``analytic.params.layer_linears``). Targets follow
PEFT: a list matches a module's name or a dotted suffix of it (``check_target_module_exists``), a string is a
regex matched in full, ``all-linear`` takes every decoder linear, and an absent list takes PEFT's per-model
default (``utils/constants.py``: ``q_proj``/``v_proj`` for LoRA-like methods; ``k_proj``, ``v_proj``,
``down_proj`` for IA3; the two layer norms and the final norm for LN tuning, on Llama-like models).
Every method is checked against PEFT's own ``get_nb_trainable_parameters`` in tests/analytic/test_peft_methods.py.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vramledger.analytic.params import Linear, in_layers, layer_linears
from vramledger.errors import VramledgerError
from vramledger.specs import ModelSpec

_LORA_LIKE_DEFAULT = ("q_proj", "v_proj")


@dataclass(frozen=True, kw_only=True, slots=True)
class PeftCount:
    peft_type: str
    """PEFT's name for the method (``IA3``, ``LOHA``, …)."""
    trainable_params: int
    targets: tuple[str, ...]
    """Names of the decoder-layer modules it adapts (empty for prompt methods)."""


def _field(cfg: Mapping[str, Any], key: str, default: Any) -> Any:
    value = cfg.get(key)
    return default if value is None else value


def _targets(m: ModelSpec, cfg: Mapping[str, Any], default: tuple[str, ...]) -> list[Linear]:
    """The decoder linears PEFT adapts (tuners_utils.py ``check_target_module_exists``)."""
    linears = [lin for lin in layer_linears(m) if lin.lora_targetable]
    spec = cfg.get("target_modules")
    if spec is None:
        spec = list(default)
    if isinstance(spec, str):
        if spec.lower() == "all-linear":
            return linears
        return [lin for lin in linears if re.fullmatch(spec, lin.name)]
    names = [str(t) for t in spec]
    picked = [
        lin
        for lin in linears
        if any(lin.name == t or lin.name.endswith(f".{t}") or lin.name == t.split(".")[-1] for t in names)
    ]
    if not picked:
        raise VramledgerError(
            f"peft config: target_modules {names} match no linear of {m.family}; "
            f"choose from {', '.join(sorted({lin.name.split('.')[-1] for lin in linears}))}"
        )
    return picked


def _sum(m: ModelSpec, linears: list[Linear], per_module: Any) -> int:
    return sum(in_layers(m, lin) * lin.per_layer * per_module(lin.in_features, lin.out_features) for lin in linears)


def factorization(dimension: int, factor: int = -1) -> tuple[int, int]:
    """PEFT tuners/lokr/layer.py ``factorization``: two factors of ``dimension``, the first ≤ the second, near
    ``factor`` (or the square root for -1)."""
    if factor > 0 and dimension % factor == 0:
        return factor, dimension // factor
    if factor == -1:
        factor = dimension
    m, n = 1, dimension
    length = m + n
    while m < n:
        new_m = m + 1
        while dimension % new_m:
            new_m += 1
        new_n = dimension // new_m
        if new_m + new_n > length or new_m > factor:
            break
        m, n = new_m, new_n
    return (n, m) if m > n else (m, n)


def _lokr(cfg: Mapping[str, Any]) -> Any:
    # tuners/lokr/layer.py Linear.update_layer: in = b·d and out = a·c factorised; w1 (a, c) whole unless
    # decompose_both and r < max(a, c)/2 (then w1_a (a, r), w1_b (r, c)); w2 (b, d) whole unless r < max(b, d)/2
    # (then w2_a (b, r), w2_b (r, d)).
    r = int(_field(cfg, "r", 8))
    both = bool(_field(cfg, "decompose_both", False))
    factor = int(_field(cfg, "decompose_factor", -1))

    def count(i: int, o: int) -> int:
        in_m, in_n = factorization(i, factor)
        out_l, out_k = factorization(o, factor)
        w1 = r * (out_l + in_m) if both and r < max(out_l, in_m) / 2 else out_l * in_m
        w2 = r * (out_k + in_n) if r < max(out_k, in_n) / 2 else out_k * in_n
        return w1 + w2

    return count


def _oft(cfg: Mapping[str, Any]) -> Any:
    # tuners/oft/layer.py Linear.update_layer: r blocks of size b with r·b = in (r from oft_block_size, default 32),
    # each an upper triangle of b(b-1)/2 free values (OFTRotationModule.weight (r, n_elements)); block_share: one.
    block = int(_field(cfg, "oft_block_size", 32))
    r_cfg = int(_field(cfg, "r", 0))
    share = bool(_field(cfg, "block_share", False))

    def count(i: int, o: int) -> int:
        b = block if r_cfg == 0 else i // r_cfg
        r = i // b if r_cfg == 0 else r_cfg
        return (1 if share else r) * b * (b - 1) // 2

    return count


def _boft(cfg: Mapping[str, Any], fbd_cuda: bool) -> Any:
    # tuners/boft/layer.py Linear.update_layer: boft_R (factor, blocks, b, b) with blocks·b = in, and boft_s (out, 1).
    # Without its compiled CUDA extension (get_fbd_cuda() fails: no nvcc/ninja, or no GPU) PEFT forces the
    # butterfly factor to 1.
    b_cfg = int(_field(cfg, "boft_block_size", 4))
    n_cfg = int(_field(cfg, "boft_block_num", 0))
    factor = int(_field(cfg, "boft_n_butterfly_factor", 1)) if fbd_cuda else 1

    def count(i: int, o: int) -> int:
        b = b_cfg if n_cfg == 0 else i // n_cfg
        return factor * (i // b) * b * b + o

    return count


def _prompt(m: ModelSpec, cfg: Mapping[str, Any], peft_type: str) -> int:
    n = int(_field(cfg, "num_virtual_tokens", 0))
    H = int(_field(cfg, "token_dim", m.hidden_size))
    if peft_type == "PROMPT_TUNING":
        # tuners/prompt_tuning/model.py PromptEmbedding: Embedding(n · submodules, token_dim); 1 for a decoder.
        return n * H
    if peft_type == "P_TUNING":
        # tuners/p_tuning/model.py PromptEncoder (MLP): Embedding(n, H) + Linear(H, h) + Linear(h, h) +
        # Linear(h, H), with biases; h = encoder_hidden_size (default token_dim).
        h = int(_field(cfg, "encoder_hidden_size", H))
        if str(_field(cfg, "encoder_reparameterization_type", "MLP")).upper() != "MLP":
            raise VramledgerError("peft config: p-tuning with an LSTM encoder is not modelled; use the MLP encoder")
        return n * H + (H * h + h) + (h * h + h) + (h * H + H)
    # PREFIX_TUNING, tuners/prefix_tuning/model.py PrefixEncoder; utils/other.py _prepare_prompt_learning_config
    # sets token_dim = head_dim · kv_heads for grouped-query models.
    kv = m.num_kv_heads * m.head_dim
    width = m.num_layers * 2 * kv
    if bool(_field(cfg, "prefix_projection", False)):
        h = int(_field(cfg, "encoder_hidden_size", kv))
        return n * kv + (kv * h + h) + (h * width + width)
    return n * width


def _ln_tuning(m: ModelSpec, cfg: Mapping[str, Any]) -> PeftCount:
    # tuners/ln_tuning/layer.py LNTuningLayer: a trainable copy of each targeted norm; default targets
    # (constants.py, llama): input_layernorm, post_attention_layernorm, norm (the final one).
    targets = tuple(_field(cfg, "target_modules", ("input_layernorm", "post_attention_layernorm", "norm")))
    per_norm = m.hidden_size * (2 if m.norm_bias else 1)
    layer_norms = sum(1 for t in targets if t in ("input_layernorm", "post_attention_layernorm"))
    final = 1 if "norm" in targets else 0
    return PeftCount(
        peft_type="LN_TUNING", trainable_params=(m.num_layers * layer_norms + final) * per_norm, targets=targets
    )


def peft_trainable(m: ModelSpec, cfg: Mapping[str, Any], *, boft_fbd_cuda: bool = True) -> PeftCount:
    """Trainable parameters of the PEFT method an ``adapter_config.json`` describes, on model ``m``.
    ``boft_fbd_cuda``: whether BOFT's CUDA extension compiles (else PEFT uses a butterfly factor of 1).

    >>> from vramledger.catalog import resolve_model
    >>> peft_trainable(resolve_model("llama-3-8b"), {"peft_type": "IA3"}).trainable_params
    524288
    """
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if m.inventory is not None:
        raise VramledgerError(
            f"peft config: {peft_type} on {m.family} (no formula here) is counted by `vramledger trace`"
        )
    if peft_type in ("PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING"):
        return PeftCount(peft_type=peft_type, trainable_params=_prompt(m, cfg, peft_type), targets=())
    if peft_type == "LN_TUNING":
        return _ln_tuning(m, cfg)
    r = int(_field(cfg, "r", 8))
    if peft_type == "IA3":
        # tuners/ia3/layer.py Linear.update_layer: one vector ia3_l of in_features for a feedforward module
        # (it scales the input), of out_features otherwise.
        linears = _targets(m, cfg, ("k_proj", "v_proj", "down_proj"))
        ff = [str(t) for t in _field(cfg, "feedforward_modules", ["down_proj"])]
        total = sum(
            in_layers(m, lin) * lin.per_layer * (lin.in_features if lin.name.split(".")[-1] in ff else lin.out_features)
            for lin in linears
        )
        return PeftCount(peft_type=peft_type, trainable_params=total, targets=tuple(lin.name for lin in linears))
    if peft_type == "LORA":
        # tuners/lora/layer.py: lora_A (r, in), lora_B (out, r); DoRA adds a magnitude of out. rsLoRA, PiSSA and
        # OLoRA change the scaling or the initialisation, not the shapes.
        dora = bool(_field(cfg, "use_dora", False))
        per = lambda i, o: r * (i + o) + (o if dora else 0)  # noqa: E731
    elif peft_type == "ADALORA":
        # tuners/adalora/layer.py SVDLinear.update_layer at init_r: lora_A (r, in), lora_E (r, 1), lora_B (out, r).
        r = int(_field(cfg, "init_r", 12))
        per = lambda i, o: r * (i + o + 1)  # noqa: E731
    elif peft_type == "LOHA":
        # tuners/loha/layer.py: hada_w1_a (out, r), hada_w1_b (r, in), hada_w2_a (out, r), hada_w2_b (r, in).
        per = lambda i, o: 2 * r * (i + o)  # noqa: E731
    elif peft_type == "LOKR":
        per = _lokr(cfg)
    elif peft_type == "VERA":
        # tuners/vera/layer.py: vera_lambda_d (r) and vera_lambda_b (out) train; vera_A/vera_B are shared frozen
        # buffers. Default r = 256.
        r = int(_field(cfg, "r", 256))
        per = lambda i, o: r + o  # noqa: E731
    elif peft_type == "OFT":
        per = _oft(cfg)
    elif peft_type == "BOFT":
        per = _boft(cfg, boft_fbd_cuda)
    else:
        raise VramledgerError(
            f"peft config: peft_type {peft_type} has no formula here; modelled: LORA, ADALORA, LOHA, LOKR, VERA, "
            "OFT, BOFT, IA3, PROMPT_TUNING, P_TUNING, PREFIX_TUNING, LN_TUNING (`vramledger trace` runs any)"
        )
    linears = _targets(m, cfg, _LORA_LIKE_DEFAULT)
    return PeftCount(
        peft_type=peft_type, trainable_params=_sum(m, linears, per), targets=tuple(lin.name for lin in linears)
    )
