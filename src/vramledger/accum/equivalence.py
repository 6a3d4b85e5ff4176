"""Is gradient accumulation the same as one large batch? An experiment on a tiny real model, on CPU.

We build a tiny model of a catalog architecture (Llama 3's config with its sizes shrunk; random weights from a
fixed seed; nothing is downloaded), draw micro-batches of sequences with different lengths and different
numbers of target tokens (prompt tokens and padding labelled -100, as SFT collators do), and compare three
gradients:

* ``g_ref``: one backward pass over the whole global batch, loss = mean over all its target tokens;
* (a) the naive loop: each micro-batch's own token mean, divided by the number of micro-batches, accumulated;
* (b) each micro-batch's *summed* token loss divided by the number of target tokens of the whole global batch,
  accumulated. This is transformers' ``num_items_in_batch`` fix (2024): ``Trainer._get_num_items_in_batch``
  (transformers 5.23 ``trainer.py``) counts ``labels[..., 1:].ne(-100)`` over all micro-batches of one
  optimizer step; ``Trainer.training_step`` then skips its ``loss / current_gradient_accumulation_steps``
  because the loss is already scaled; and ``fixed_cross_entropy`` (``loss/loss_utils.py``) switches to
  ``reduction="sum"`` and divides by ``num_items_in_batch``. We call the model exactly that way.

Why (a) differs: with ``n_i`` target tokens in micro-batch ``i`` of ``M`` and ``N = Σ n_i``, a token of
micro-batch ``i`` gets weight ``1/(M·n_i)`` under (a) and ``1/N`` in the large batch; the two agree only when
every ``n_i`` equals ``N/M``. (b) gives every token ``1/N``: the same sum, only summed in another order.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vramledger.errors import MissingDependencyError, VramledgerError

if TYPE_CHECKING:
    import torch

DTYPES = ("fp32", "fp64")

# Sizes of the tiny model. Everything else (activation, norm, RoPE, GQA, untied head) comes from the catalog
# entry's config.json, so the experiment runs the architecture's real modeling code.
_TINY_SIZES: dict[str, int] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 128,
}
# Relative error below which two gradients are "equal up to rounding". Unit roundoff u is 2**-24 ≈ 6.0e-8 in
# float32 and 2**-53 ≈ 1.1e-16 in float64. Summing n terms in a different order changes the result by at most
# about n·u relative (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., §4.2), typically
# √n·u. The gradients here are sums over a few hundred target tokens and over hidden dims of 64-128, so the
# expected gap is a few u (measured: ~3.5u in both dtypes); the thresholds leave a margin of ~170u (fp32)
# and ~10⁶u (fp64), while (a)'s weighting error is of order 10⁻¹.
ROUNDING_TOLERANCE: dict[str, float] = {"fp32": 1e-5, "fp64": 1e-10}
_PAD_ID = 0
_IGNORE = -100  # torch.nn.functional.cross_entropy's default ignore_index; transformers uses the same


@dataclass(frozen=True, kw_only=True, slots=True)
class EquivalenceConfig:
    """The experiment's settings."""

    micro_batches: int = 4
    """Accumulation steps: how many micro-batches make one global batch."""
    rows_per_micro_batch: int = 2
    """Sequences in each micro-batch."""
    min_len: int = 4
    """Shortest sequence, in tokens (before padding)."""
    max_len: int = 48
    """Longest sequence, in tokens."""
    vary_lengths: bool = True
    """Draw sequence and prompt lengths at random. False: every sequence has ``max_len`` tokens, all of them
    targets, so every micro-batch has the same number of target tokens (the case where (a) is exact too)."""
    seed: int = 0
    """Seeds the weights and the synthetic data."""
    dtype: str = "fp32"
    """``fp32`` or ``fp64``: the dtype of the weights and of the whole computation."""
    catalog_model: str = "llama-3-8b"
    """Catalog entry whose architecture (config.json minus its sizes) the tiny model copies."""

    def __post_init__(self) -> None:
        if self.micro_batches < 1:
            raise VramledgerError(f"--micro-batches must be at least 1 (got {self.micro_batches})")
        if self.rows_per_micro_batch < 1:
            raise VramledgerError(f"rows_per_micro_batch must be at least 1 (got {self.rows_per_micro_batch})")
        if not 2 <= self.min_len <= self.max_len <= _TINY_SIZES["max_position_embeddings"]:
            raise VramledgerError(
                f"sequence lengths must satisfy 2 <= min_len <= max_len <= "
                f"{_TINY_SIZES['max_position_embeddings']} (got {self.min_len}..{self.max_len})"
            )
        if self.dtype not in DTYPES:
            raise VramledgerError(f"--dtype must be one of {', '.join(DTYPES)} (got {self.dtype!r})")


@dataclass(frozen=True, kw_only=True, slots=True)
class GradientComparison:
    """One way of accumulating, compared with the large-batch gradient."""

    key: str
    """``mean_of_means`` (a) or ``global_token_mean`` (b)."""
    description: str
    rel_error: float
    """‖g − g_ref‖ / ‖g_ref‖ over all parameters, computed in float64."""
    cosine: float
    """cos(g, g_ref) over all parameters, computed in float64."""
    within_rounding: bool
    """``rel_error`` is below ``ROUNDING_TOLERANCE[dtype]``: the same gradient up to floating-point error."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EquivalenceResult:
    config: EquivalenceConfig
    architecture: str
    """Model class that ran, e.g. ``LlamaForCausalLM``."""
    tiny_sizes: dict[str, int]
    num_params: int
    rows_per_micro_batch: int
    target_tokens: tuple[int, ...]
    """Target tokens (labels != -100 after the causal shift) in each micro-batch."""
    batch_dependent_layers: tuple[str, ...]
    """Modules whose output for one sequence depends on the others in its batch (BatchNorm) or on the RNG
    (dropout with p > 0): reasons beyond the loss weighting for accumulation to differ. Empty for Llama."""
    reference_loss: float
    tolerance: float
    """``ROUNDING_TOLERANCE[dtype]``."""
    comparisons: tuple[GradientComparison, ...]
    setup_s: float
    """Wall time of importing torch and transformers and building the tiny model."""
    elapsed_s: float
    """Wall time of the experiment itself: the data, three forward/backward sweeps and the comparisons."""
    torch_version: str = ""
    transformers_version: str = ""

    @property
    def total_target_tokens(self) -> int:
        return sum(self.target_tokens)

    def comparison(self, key: str) -> GradientComparison:
        for c in self.comparisons:
            if c.key == key:
                return c
        raise KeyError(key)


def _import_torch_transformers() -> tuple[Any, Any]:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a hard requirement of this command
        raise MissingDependencyError("torch", "trace") from exc
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover
        raise MissingDependencyError("transformers", "trace") from exc
    return torch, transformers


def _tiny_model(cfg: EquivalenceConfig, torch: Any, transformers: Any) -> Any:
    from vramledger.catalog import model_entries

    entries = model_entries()
    if cfg.catalog_model not in entries:
        raise VramledgerError(f"catalog_model {cfg.catalog_model!r} is not in the catalog; see `vramledger models`")
    raw = {k: v for k, v in entries[cfg.catalog_model].config.items() if k not in ("torch_dtype", "dtype")}
    raw.update(_TINY_SIZES)
    model_type = raw.pop("model_type")
    hf_config = transformers.AutoConfig.for_model(model_type, **raw)
    # fork_rng: seed the weights without leaving the caller's global RNG changed.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    model.to(torch.float64 if cfg.dtype == "fp64" else torch.float32)
    model.train()
    return model


def _micro_batches(cfg: EquivalenceConfig, torch: Any) -> list[dict[str, torch.Tensor]]:
    """Right-padded micro-batches: input_ids, attention_mask, labels (prompt and padding = -100)."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    vocab = _TINY_SIZES["vocab_size"]
    out = []
    for _ in range(cfg.micro_batches):
        rows = cfg.rows_per_micro_batch
        if cfg.vary_lengths:
            lengths = torch.randint(cfg.min_len, cfg.max_len + 1, (rows,), generator=gen).tolist()
        else:
            lengths = [cfg.max_len] * rows
        width = max(lengths)
        ids = torch.randint(1, vocab, (rows, width), generator=gen)
        mask = torch.zeros(rows, width, dtype=torch.long)
        labels = torch.full((rows, width), _IGNORE, dtype=torch.long)
        for r, n in enumerate(lengths):
            # A prompt of up to half the sequence is not trained on (SFT); at least one target remains.
            prompt = int(torch.randint(0, n // 2 + 1, (1,), generator=gen)) if cfg.vary_lengths else 0
            ids[r, n:] = _PAD_ID
            mask[r, :n] = 1
            labels[r, prompt:n] = ids[r, prompt:n]
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def _count_targets(labels: torch.Tensor) -> int:
    # As Trainer._get_num_items_in_batch (transformers 5.23 trainer.py) counts for a causal LM: the loss
    # shifts labels left by one, so position 0's label is never a target.
    return int(labels[..., 1:].ne(_IGNORE).sum())


def _pad_cat(batches: list[dict[str, torch.Tensor]], torch: Any) -> dict[str, torch.Tensor]:
    width = max(b["input_ids"].shape[1] for b in batches)
    fill = {"input_ids": _PAD_ID, "attention_mask": 0, "labels": _IGNORE}
    return {
        k: torch.cat([torch.nn.functional.pad(b[k], (0, width - b[k].shape[1]), value=v) for b in batches])
        for k, v in fill.items()
    }


def _take_grad(model: Any, torch: Any) -> torch.Tensor:
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).to(torch.float64)
    model.zero_grad(set_to_none=True)
    return flat


def _compare(key: str, description: str, g: torch.Tensor, g_ref: torch.Tensor, tolerance: float) -> GradientComparison:
    ref_norm = float(g_ref.norm())
    rel = float((g - g_ref).norm()) / ref_norm
    cos = float(g.dot(g_ref)) / (float(g.norm()) * ref_norm)
    # Rounding can push a cosine of identical directions a few ulps above 1.
    return GradientComparison(
        key=key, description=description, rel_error=rel, cosine=min(cos, 1.0), within_rounding=rel < tolerance
    )


def _batch_dependent_layers(model: Any, torch: Any) -> tuple[str, ...]:
    found = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            found.append(f"{name} ({type(module).__name__}: statistics over the micro-batch)")
        elif isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            found.append(f"{name} ({type(module).__name__} p={module.p}: random masks differ per pass)")
    cfg = model.config
    for attr in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        p = getattr(cfg, attr, 0.0) or 0.0
        if isinstance(p, float) and p > 0:
            found.append(f"config.{attr}={p} (functional dropout: random masks differ per pass)")
    for attr in ("num_experts", "num_local_experts"):
        if getattr(cfg, attr, None):
            found.append(f"config.{attr} (MoE routing capacity and auxiliary loss depend on the batch)")
    return tuple(found)


def run_equivalence(cfg: EquivalenceConfig | None = None) -> EquivalenceResult:
    """Run the experiment and return the two comparisons.

    >>> r = run_equivalence(EquivalenceConfig(dtype="fp64"))        # doctest: +SKIP
    >>> r.comparison("global_token_mean").rel_error < 1e-10          # doctest: +SKIP
    True
    """
    cfg = cfg or EquivalenceConfig()
    start = time.perf_counter()
    torch, transformers = _import_torch_transformers()
    model = _tiny_model(cfg, torch, transformers)  # transformers imports the model's modules lazily, here
    setup = time.perf_counter() - start
    start = time.perf_counter()
    batches = _micro_batches(cfg, torch)
    counts = tuple(_count_targets(b["labels"]) for b in batches)
    total = sum(counts)
    m = cfg.micro_batches

    # Reference: one pass over the concatenated global batch; the model's loss is the mean over its targets.
    out = model(**_pad_cat(batches, torch))
    out.loss.backward()
    reference_loss = float(out.loss.detach())
    g_ref = _take_grad(model, torch)

    # (a) the naive loop: `loss = model(**mb).loss / accum_steps; loss.backward()`.
    for b in batches:
        (model(**b).loss / m).backward()
    g_a = _take_grad(model, torch)

    # (b) transformers' fix: the model's loss sums token losses and divides by the global target count.
    num_items = torch.tensor(total)
    for b in batches:
        model(**b, num_items_in_batch=num_items).loss.backward()
    g_b = _take_grad(model, torch)
    elapsed = time.perf_counter() - start

    if not math.isfinite(float(g_ref.norm())) or float(g_ref.norm()) == 0.0:
        raise VramledgerError("the reference gradient is zero or not finite; try another --seed", exit_code=1)

    tol = ROUNDING_TOLERANCE[cfg.dtype]
    comparisons = (
        _compare("mean_of_means", f"mean of per-micro-batch mean losses / {m}", g_a, g_ref, tol),
        _compare("global_token_mean", f"summed token loss / {total} targets (num_items_in_batch)", g_b, g_ref, tol),
    )
    return EquivalenceResult(
        config=cfg,
        architecture=type(model).__name__,
        tiny_sizes=dict(_TINY_SIZES),
        num_params=sum(p.numel() for p in model.parameters()),
        rows_per_micro_batch=cfg.rows_per_micro_batch,
        target_tokens=counts,
        batch_dependent_layers=_batch_dependent_layers(model, torch),
        reference_loss=reference_loss,
        tolerance=tol,
        comparisons=comparisons,
        setup_s=setup,
        elapsed_s=elapsed,
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
    )
