"""The KV-cache formula held against what transformers really keeps after ``generate()``.

Tiny configs with random weights run on CPU (fp32, a handful of new tokens; under a second in all). We sum the
storage of every key/value tensor in the returned ``past_key_values`` (``untyped_storage().nbytes()``: a sliding
window layer keeps a *view* of a larger concatenation, and the storage is what occupies memory) and compare with
``evaluation.kv_cache_bytes``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from vramledger.analytic.evaluation import kv_cache_bytes  # noqa: E402
from vramledger.specs import ModelSpec  # noqa: E402

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)


def _spec(family: str, *, kv: int, window: int = 0, sliding: int = 0) -> ModelSpec:
    return ModelSpec(
        name=f"tiny-{family}",
        family=family,
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=kv,
        head_dim=16,
        tie_word_embeddings=False,
        sliding_window=window,
        sliding_layers=sliding,
    )


def _model(kind: str, kv: int, window: int):
    torch.manual_seed(0)
    cfg = dict(COMMON, num_key_value_heads=kv)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    if kind == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**cfg, sliding_window=window)).eval()
    # Gemma 2: layer_types alternate sliding (even index) and full attention.
    return transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(**cfg, sliding_window=window, query_pre_attn_scalar=16)
    ).eval()


def _cache_storage(model, batch: int, prompt: int, new: int, static: bool) -> tuple[int, int]:
    ids = torch.randint(3, 100, (batch, prompt))
    kw = {"cache_implementation": "static"} if static else {}
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            return_dict_in_generate=True,
            pad_token_id=0,
            **kw,
        )
    assert out.sequences.shape == (batch, prompt + new)
    layers = out.past_key_values.layers
    storage = sum(x.untyped_storage().nbytes() for layer in layers for x in (layer.keys, layer.values))
    return storage, len(layers)


CASES = [
    # id, model kind, kv heads, window, sliding layers (of 4), batch, prompt, new tokens, static
    ("llama-mha", "llama", 4, 0, 0, 3, 12, 5, False),
    ("llama-gqa", "llama", 2, 0, 0, 3, 12, 5, False),
    ("llama-mqa", "llama", 1, 0, 0, 2, 9, 4, False),
    ("llama-gqa-static", "llama", 2, 0, 0, 3, 12, 5, True),
    ("mistral-window-passed", "mistral", 2, 8, 4, 3, 12, 5, False),
    ("mistral-window-not-reached", "mistral", 2, 8, 4, 3, 5, 2, False),
    ("mistral-prefill-only", "mistral", 2, 8, 4, 3, 12, 1, False),
    ("mistral-window-static", "mistral", 2, 8, 4, 3, 12, 5, True),
    ("gemma2-hybrid", "gemma2", 2, 8, 2, 3, 12, 5, False),
    ("gemma2-hybrid-static", "gemma2", 2, 8, 2, 2, 12, 6, True),
]


@pytest.mark.parametrize(
    ("kind", "kv", "window", "sliding", "batch", "prompt", "new", "static"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_cache_bytes_match_generate(kind, kv, window, sliding, batch, prompt, new, static) -> None:
    got, n_layers = _cache_storage(_model(kind, kv, window), batch, prompt, new, static)
    assert n_layers == 4
    want = kv_cache_bytes(
        _spec(kind, kv=kv, window=window, sliding=sliding),
        batch=batch,
        prompt=prompt,
        new_tokens=new,
        dtype_bytes=4,
        static=static,
    ).at_end
    print(
        f"{kind} kv={kv} W={window} B={batch} P={prompt} N={new} static={static}: "
        f"expected {want}, got {got}, match {want == got}"
    )
    assert got == want
