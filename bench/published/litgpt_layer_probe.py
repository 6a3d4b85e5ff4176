"""What LitGPT's decoder layer saves for backward beyond transformers + PEFT, measured on the real code (CPU, bf16).

    python bench/published/litgpt_layer_probe.py /path/to/litgpt/checkout [--commit 43c44323]

Reads ``litgpt/{model,config,lora}.py`` at ``--commit`` from a git checkout of Lightning-AI/litgpt into a temporary
directory (nothing of LitGPT is kept here), builds one ``lora.Block`` and one transformers ``LlamaDecoderLayer`` with
PEFT LoRA of the same shapes (and, fully trained, one ``model.Block`` beside a bare ``LlamaDecoderLayer``), runs
each forward, walks the autograd graph from the output (every node's ``_saved_*`` tensors, each storage counted
once, parameters and RoPE tables excluded) and prints the difference per token beside ``analytic/litgpt.py``'s
figure. CPU dropout keeps a mask in the compute dtype where CUDA keeps a bool, so the
analytic figure is shown with the CPU mask. Not part of the test suite: it needs a LitGPT checkout.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import Any

from litgpt_fake import extract  # bench/published/litgpt_fake.py


def saved_bytes(out: Any, exclude: set[int]) -> int:
    """Bytes of the distinct storages the autograd graph behind ``out`` keeps for backward."""
    import torch

    seen: dict[int, int] = {}
    nodes, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in nodes:
            continue
        nodes.add(node)
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            try:
                value = getattr(node, attr)
            except Exception:  # noqa: S112 - some saved attributes raise once freed
                continue
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in exclude:
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        stack.extend(n for n, _ in node.next_functions)
    return sum(seen.values())


_B, _T, _H, _HD, _INTER = 2, 64, 256, 32, 512
"""The probe's shapes: batch, length, hidden size, head size, MLP width."""


def _hf_config(heads: int, kv_heads: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=_H, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=_HD,
        intermediate_size=_INTER, num_hidden_layers=1, vocab_size=64, attn_implementation="sdpa",
    )  # fmt: skip


def _lit_config_args(package: str, heads: int, kv_heads: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """LitGPT ``Config`` keywords for the probe's shapes: (shape, the norm/MLP class names of that package)."""
    shape = dict(
        n_embd=_H, n_head=heads, n_query_groups=kv_heads, intermediate_size=_INTER, n_layer=1, block_size=_T,
        padded_vocab_size=64, vocab_size=64, bias=False, parallel_residual=False, rotary_percentage=1.0,
    )  # fmt: skip
    if package == "litgpt":
        return shape, {"head_size": _HD, "mlp_class_name": "LLaMAMLP", "norm_class_name": "RMSNorm"}
    # lit-gpt 2023: head_size = n_embd // n_head, private class names
    return shape, {"_mlp_class": "LLaMAMLP", "_norm_class": "RMSNorm"}


def _saved_by_lit_block(block: Any, build_rope_cache: Any, rope_n_elem: int) -> int:
    """Bytes a LitGPT block's forward saves for backward (parameters and RoPE tables excluded)."""
    import torch

    dt = torch.bfloat16
    try:
        cos, sin = build_rope_cache(_T, rope_n_elem)
    except TypeError:  # lit-gpt 2023 takes the dtype
        cos, sin = build_rope_cache(_T, rope_n_elem, dtype=dt)
    cos, sin = cos.to(dt), sin.to(dt)
    x = torch.randn(_B, _T, _H, dtype=dt, requires_grad=True)
    exclude = {p.untyped_storage().data_ptr() for p in block.parameters()}
    exclude |= {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}
    return saved_bytes(block(x, cos, sin), exclude)


def _saved_by_hf_layer(layer: Any, hc: Any) -> int:
    """Bytes a transformers decoder layer's forward saves for backward (parameters and RoPE tables excluded)."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    x = torch.randn(_B, _T, _H, dtype=torch.bfloat16, requires_grad=True)
    ce, se = LlamaRotaryEmbedding(hc)(x, torch.arange(_T)[None].expand(_B, _T))
    exclude = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    exclude |= {ce.untyped_storage().data_ptr(), se.untyped_storage().data_ptr()}
    out = layer(x, position_embeddings=(ce, se), attention_mask=None)
    return saved_bytes(out[0] if isinstance(out, tuple) else out, exclude)


def measure(package: str, *, heads: int, kv_heads: int, all_targets: bool, dropout: float) -> tuple[int, int]:
    """(LitGPT bytes, transformers + PEFT bytes) saved by one layer, B=2, T=64, H=256, head 32, bf16."""
    import importlib

    import torch
    from peft import LoraConfig, inject_adapter_in_model
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    r, dt = 4, torch.bfloat16
    torch.manual_seed(0)
    lit = importlib.import_module(f"{package}.lora")
    build_rope_cache = importlib.import_module(f"{package}.model").build_rope_cache
    shape, classes = _lit_config_args(package, heads, kv_heads)
    lora = {"r": r, "alpha": 16, "dropout": dropout, "query": True, "key": all_targets, "value": True,
            "projection": all_targets, "mlp": all_targets}  # fmt: skip
    if package == "litgpt":
        names = {k: f"lora_{k}" for k in lora}
    else:  # lit-gpt 2023: short LoRA names
        names = {k: k if k in ("r", "alpha", "dropout") else f"to_{k}" for k in lora}
    cfg = lit.Config(**shape, **classes, **{names[k]: v for k, v in lora.items()})
    try:
        block = lit.Block(cfg, 0)
    except TypeError:  # before Gemma 2 (litgpt 916a84ca) Block took no index
        block = lit.Block(cfg)
    block = block.to(dt)
    lit.mark_only_lora_as_trainable(block)
    n_lit = _saved_by_lit_block(block, build_rope_cache, cfg.rope_n_elem)

    hc = _hf_config(heads, kv_heads)
    layer = LlamaDecoderLayer(hc, 0).to(dt).requires_grad_(False)
    targets = ["q_proj", "v_proj"] + (["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"] if all_targets else [])
    layer = inject_adapter_in_model(LoraConfig(r=r, lora_alpha=16, target_modules=targets, lora_dropout=dropout), layer)
    for name, p in layer.named_parameters():
        p.requires_grad_("lora_" in name)
    return n_lit, _saved_by_hf_layer(layer.to(dt), hc)


def measure_full(package: str, *, heads: int, kv_heads: int) -> tuple[int, int]:
    """(LitGPT bytes, transformers bytes) saved by one fully trained layer (every weight and norm trains), as
    pretraining and full fine-tuning run it; same shapes as :func:`measure`."""
    import importlib

    import torch
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    dt = torch.bfloat16
    torch.manual_seed(0)
    model = importlib.import_module(f"{package}.model")
    shape, classes = _lit_config_args(package, heads, kv_heads)
    cfg = model.Config(**shape, **classes)
    try:
        block = model.Block(cfg, 0)
    except TypeError:
        block = model.Block(cfg)
    n_lit = _saved_by_lit_block(block.to(dt), model.build_rope_cache, cfg.rope_n_elem)
    hc = _hf_config(heads, kv_heads)
    return n_lit, _saved_by_hf_layer(LlamaDecoderLayer(hc, 0).to(dt), hc)


def analytic_full(code: str, *, heads: int, kv_heads: int) -> int:
    """analytic/litgpt.py's bytes per token for a fully trained layer of the probe's shapes."""
    from vramledger.analytic.litgpt import litgpt_layer_extra_bytes_per_token
    from vramledger.analytic.weights import weight_budget
    from vramledger.catalog import resolve_model
    from vramledger.specs import Method, ModelCode, Precision, TrainSpec

    m = dataclasses.replace(
        resolve_model("llama-3-8b"), hidden_size=256, num_heads=heads, num_kv_heads=kv_heads, head_dim=32,
        intermediate_size=512, num_layers=1, vocab_size=64,
    )  # fmt: skip
    train = TrainSpec(method=Method.FULL, precision=Precision.BF16, model_code=ModelCode(code))
    return litgpt_layer_extra_bytes_per_token(m, train, weight_budget(m, train))


def analytic(code: str, *, heads: int, kv_heads: int, all_targets: bool, dropout: float) -> int:
    """analytic/litgpt.py's bytes per token for the probe's shapes, with CPU's dropout mask (c bytes, not 1)."""
    from vramledger.analytic.litgpt import litgpt_layer_extra_bytes_per_token
    from vramledger.analytic.weights import weight_budget
    from vramledger.catalog import resolve_model
    from vramledger.specs import LoraSpec, Method, ModelCode, Precision, TrainSpec

    m = dataclasses.replace(
        resolve_model("llama-3-8b"), hidden_size=256, num_heads=heads, num_kv_heads=kv_heads, head_dim=32,
        intermediate_size=512, num_layers=1, vocab_size=64,
    )  # fmt: skip
    targets = ("all",) if all_targets else ("q_proj", "v_proj")
    train = TrainSpec(
        method=Method.LORA, precision=Precision.BF16, model_code=ModelCode(code),
        lora=LoraSpec(rank=4, alpha=16, targets=targets, dropout=dropout, adapter_fp32=False),
    )  # fmt: skip
    per_token = litgpt_layer_extra_bytes_per_token(m, train, weight_budget(m, train))
    shared = (3 if all_targets else 2) - 1 if dropout > 0 else 0
    return per_token - shared * 256 * (2 - 1)  # CPU's mask is bf16: one byte more per shared element


# -- parallel blocks (Phi, GPT-NeoX/StableLM-Alpha, Falcon): absolute bytes against the estimate ---------------------
# Tiny configs of each family, the same shapes for LitGPT's Config and for transformers' config.json (which the
# estimate reads): hidden 256, 8 heads of 32, MLP 1024.
_FAMILIES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "phi-1_5": (
        {"model_type": "phi", "partial_rotary_factor": 0.5, "hidden_act": "gelu_new", "resid_pdrop": 0.0},
        {"n_query_groups": 8, "shared_attention_norm": True, "rotary_percentage": 0.5, "bias": True,
         "gelu_approximate": "tanh", "lm_head_bias": True},
    ),
    "phi-2": (
        {"model_type": "phi", "partial_rotary_factor": 0.4, "hidden_act": "gelu_new", "resid_pdrop": 0.1},
        {"n_query_groups": 8, "shared_attention_norm": True, "rotary_percentage": 0.4, "bias": True,
         "gelu_approximate": "tanh", "lm_head_bias": True},
    ),
    "stablelm-alpha": (
        {"model_type": "gpt_neox", "rotary_pct": 0.25, "hidden_act": "gelu", "use_parallel_residual": True},
        {"n_query_groups": 8, "shared_attention_norm": False, "rotary_percentage": 0.25, "bias": True},
    ),
    "falcon-7b": (
        {"model_type": "falcon", "multi_query": True, "parallel_attn": True, "new_decoder_architecture": False,
         "bias": False},
        {"n_query_groups": 1, "shared_attention_norm": True, "rotary_percentage": 1.0, "bias": False},
    ),
    "falcon-40b": (
        {"model_type": "falcon", "num_kv_heads": 2, "new_decoder_architecture": True, "bias": False},
        {"n_query_groups": 2, "shared_attention_norm": False, "rotary_percentage": 1.0, "bias": False},
    ),
}  # fmt: skip
_FI = 4 * _H


def family_model(family: str) -> Any:
    """The estimate's ModelSpec of the tiny ``family`` config."""
    from vramledger.catalog.hfconfig import model_spec_from_config

    hf = {"hidden_size": _H, "num_attention_heads": 8, "intermediate_size": _FI, "num_hidden_layers": 1,
          "vocab_size": 64, **_FAMILIES[family][0]}  # fmt: skip
    return model_spec_from_config(hf, name=f"tiny-{family}", source="probe")


def measure_family(package: str, family: str, *, lora: bool, all_targets: bool, dropout: float) -> int:
    """Bytes one LitGPT block of ``family`` saves for backward (B=2, T=64, bf16): LoRA on q,v (or every linear),
    or, without ``lora``, every weight trained."""
    import importlib

    import torch

    torch.manual_seed(0)
    mod = importlib.import_module(f"{package}.lora" if lora else f"{package}.model")
    shape = dict(
        n_embd=_H, n_head=8, intermediate_size=_FI, n_layer=1, block_size=_T, padded_vocab_size=64, vocab_size=64,
        parallel_residual=True, **_FAMILIES[family][1],
    )  # fmt: skip
    if package == "litgpt":
        classes: dict[str, Any] = {"mlp_class_name": "GptNeoxMLP", "norm_class_name": "LayerNorm"}
    else:
        classes = {"_mlp_class": "GptNeoxMLP", "_norm_class": "LayerNorm"}
    lora_kw: dict[str, Any] = {}
    if lora:
        keys = {"r": 4, "alpha": 16, "dropout": dropout, "query": True, "key": all_targets, "value": True,
                "projection": all_targets, "mlp": all_targets}  # fmt: skip
        if package == "litgpt":
            lora_kw = {f"lora_{k}": v for k, v in keys.items()}
        else:
            lora_kw = {k if k in ("r", "alpha", "dropout") else f"to_{k}": v for k, v in keys.items()}
    cfg = mod.Config(**shape, **classes, **lora_kw)
    try:
        block = mod.Block(cfg, 0)
    except TypeError:
        block = mod.Block(cfg)
    block = block.to(torch.bfloat16)
    if lora:
        mod.mark_only_lora_as_trainable(block)
    build_rope_cache = importlib.import_module(f"{package}.model").build_rope_cache
    return _saved_by_lit_block(block, build_rope_cache, cfg.rope_n_elem)


def analytic_family(code: str, family: str, *, lora: bool, all_targets: bool, dropout: float) -> tuple[int, int]:
    """The estimate's (bytes per token, length² bytes per sequence) for that block: analytic/activations.py's
    layer plus analytic/litgpt.py's difference, with CPU's dropout mask (c bytes per element, not 1)."""
    from vramledger.analytic.activations import layer_activations
    from vramledger.analytic.litgpt import litgpt_layer_extra_bytes_per_token, litgpt_layer_extra_scores_per_seq
    from vramledger.analytic.weights import weight_budget
    from vramledger.specs import LoraSpec, Method, ModelCode, Precision, TrainSpec

    m = family_model(family)
    targets = ("all",) if all_targets else ("q_proj", "v_proj")
    train = TrainSpec(
        method=Method.LORA if lora else Method.FULL, precision=Precision.BF16, model_code=ModelCode(code),
        micro_batch=_B, seq_len=_T, packing=True,
        lora=LoraSpec(rank=4, alpha=16, targets=targets, dropout=dropout, adapter_fp32=False) if lora else None,
    )  # fmt: skip
    wb = weight_budget(m, train)
    la = layer_activations(m, train, wb)
    per_token = la.per_token + litgpt_layer_extra_bytes_per_token(m, train, wb)
    # LitGPT's dropout masks: one H-wide for q,k,v together, and one per other adapted linear's input.
    masks = (_H + ((m.q_dim + _H + _FI) if all_targets else 0)) if lora and dropout > 0 else 0
    scores = la.scores_per_seq + litgpt_layer_extra_scores_per_seq(m, train)
    if scores:
        # lit-gpt 2023's multi-query attention on SDPA's math kernel: on CPU, PyTorch 2.13 runs it in fp32 for bf16
        # inputs (the scaled q, K and V broadcast, and the probabilities: twice the bytes CUDA's bf16 keeps).
        per_token += 3 * m.q_dim * (4 - 2)
        scores *= 2
    return per_token + masks * (2 - 1), scores


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkout", type=Path, help="a git checkout of Lightning-AI/litgpt")
    ap.add_argument("--commit", default="43c44323", help="the LitGPT commit to read (default: 43c44323)")
    ap.add_argument(
        "--families", action="store_true",
        help="the parallel blocks (Phi, StableLM-Alpha, Falcon): absolute bytes against the estimate's layer",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.families:
        return main_families(args.checkout, args.commit)
    with tempfile.TemporaryDirectory() as tmp:
        package = extract(args.checkout, args.commit, Path(tmp))
        code = "litgpt" if package == "litgpt" else "lit-gpt-2023"
        sys.path.insert(0, tmp)
        print(
            f"{package} {args.commit} ({code}): bytes per token saved beyond transformers + PEFT, one layer (B·T = 128)"
        )
        for heads, kv, all_targets, dropout in ((8, 8, False, 0.05), (8, 2, False, 0.05), (8, 2, False, 0.0),
                                                (8, 8, True, 0.05), (8, 2, True, 0.05), (8, 2, True, 0.0)):  # fmt: skip
            n_lit, n_hf = measure(package, heads=heads, kv_heads=kv, all_targets=all_targets, dropout=dropout)
            got = analytic(code, heads=heads, kv_heads=kv, all_targets=all_targets, dropout=dropout)
            print(
                f"  heads {heads}/{kv} {'all' if all_targets else 'q,v'} dropout {dropout}: measured "
                f"{(n_lit - n_hf) / 128:+.1f}, analytic/litgpt.py {got:+d}"
            )
        for heads, kv in ((8, 8), (8, 2)):
            n_lit, n_hf = measure_full(package, heads=heads, kv_heads=kv)
            got = analytic_full(code, heads=heads, kv_heads=kv)
            diff = (n_lit - n_hf) / 128
            print(f"  heads {heads}/{kv} full (no LoRA): measured {diff:+.1f}, analytic/litgpt.py {got:+d}")
    return 0


def main_families(checkout: Path, commit: str) -> int:
    """Print, per family and setup, the bytes per token LitGPT's block saves and the estimate's figure."""
    with tempfile.TemporaryDirectory() as tmp:
        package = extract(checkout, commit, Path(tmp))
        code = "litgpt" if package == "litgpt" else "lit-gpt-2023"
        sys.path.insert(0, tmp)
        tokens = _B * _T
        print(f"{package} {commit} ({code}): bytes per token saved by one block (B·T = {tokens}), CPU dropout masks")
        for family in _FAMILIES:
            for lora, all_targets, dropout in ((True, False, 0.05), (True, True, 0.05), (True, True, 0.0),
                                               (False, False, 0.0)):  # fmt: skip
                got = measure_family(package, family, lora=lora, all_targets=all_targets, dropout=dropout)
                per_token, per_seq = analytic_family(code, family, lora=lora, all_targets=all_targets, dropout=dropout)
                est = per_token + per_seq * _B / tokens
                what = f"LoRA {'all' if all_targets else 'q,v'} dropout {dropout}" if lora else "full"
                print(
                    f"  {family:15s} {what:24s} measured {got / tokens:9.1f}  estimate {est:9.1f}  "
                    f"({est - got / tokens:+.1f})"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
