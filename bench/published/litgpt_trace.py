"""Trace LitGPT's own training step, at the commit each published LitGPT row was measured with, on fake tensors.

    nice -n 10 env PYTHONPATH=src python bench/published/litgpt_trace.py [--only ROW ...] [--redo] [--checkout DIR]

For every LitGPT training row of published_memory.csv (mapped in mapping.yaml, or listed there as not expressible
because the estimate lacks LitGPT's model family or method), this reads LitGPT's model code at the row's commit
from a git checkout (default: the bare mirror /work/.mirror/Lightning-AI+litgpt/repo; into a temporary directory,
nothing of LitGPT is kept here, bench/published/litgpt_fake.py), builds ``GPT(Config.from_name(...))`` on PyTorch's
fake tensors (no memory, no GPU) and replays the loop of the row's script as Fabric runs it on one GPU:

- ``fabric.init_module`` under ``bf16-true`` (lightning ``plugins/precision/half.py`` ``HalfPrecision``: the default
  dtype is bf16 while the model is built), the script's ``mark_only_*_as_trainable``, ``fabric.setup_module``
  (``convert_module``: ``module.to(bf16)``), the optimizer the script builds (``torch.optim.AdamW``, foreach as
  PyTorch picks on CUDA, or ``fused=True`` where the script says so), then ``fit``'s ``model.max_seq_length = ...``;
- the loop body, line by line as the script has it (cited per kind in :data:`SCRIPTS`): ``_FabricModule.forward``
  (lightning ``fabric/wrappers.py``: ``convert_input``, the forward under ``forward_context`` with bf16 as default
  dtype, then ``convert_output``, which casts every floating output to ``torch.get_default_dtype()``, fp32),
  LitGPT's own ``chunked_cross_entropy`` of that commit, ``fabric.backward(loss / accum)``, and ``optimizer.step()``
  / ``optimizer.zero_grad()`` when not accumulating. The loop's locals live as in the script: ``logits`` (the list of
  lm_head chunks) stays bound through backward, the optimizer step and the next micro-step's forward;
- a first iteration (a whole optimizer step: its states exist from then on), then two measured iterations: with
  ``accum`` > 1 the first accumulates and the second steps (its forward and backward run beside the first one's
  gradients, as every micro-step after the first does); with ``accum`` = 1 both step. The row is compared with the
  measured iterations' peak (the steady state, each micro-step beside the previous one's kept tensors), or, for
  lit-gpt 8641822's scripts, which run their longest sample first and only once (``Script.longest_first``), with
  the first iteration's peak; both are recorded.

Allocated bytes are counted as ``torch.cuda.max_memory_allocated`` counts them (each storage once, rounded to 512 B;
the optimizer's host ``step`` counters not counted), SDPA and dropout run as on CUDA (``vramledger.trace.shims``).
The sanity ``validate`` runs on one 16-token sample (no grad; what the 2023 adapters keep from it stays); not
replayed: the evaluation during training and ``generate`` (no grad; their peak is below the step's unless a
validation sample is much longer than the training ones), checkpoint saving, and anything outside the step.
Building the model is not measured (the peak restarts after ``fabric.setup``).

QLoRA (``--quantize bnb.nf4[-dq]``) runs under Lightning's ``BitsandbytesPrecision``: bitsandbytes' kernels do not
run on fake tensors, so every ``nn.Linear`` (lm_head too) keeps the tensors bitsandbytes stores its weight as
(analytic/weights.py ``quantised_tensors``) and runs through a stand-in of bitsandbytes 0.41.1/0.42.0 ``MatMul4Bit``
(the fp16 dequantised weight and its bf16 cast in forward and backward; the input kept as a plain ``ctx`` attribute,
alive as long as the graph), and ``PagedAdamW`` allocates nothing through PyTorch (its states are managed memory).

The multi-GPU rows of lit-gpt 8641822's LoRA script and litgpt 43c44323's full fine-tuning script (``devices > 1``) run
under PyTorch's FSDP1 on a fake process group of the row's world size, rank 0, as Lightning's ``FSDPStrategy`` wraps
the model for those scripts (:func:`replay_fsdp`): the first micro-step, the steady state at the row's length and, for
the 2023 rows, later micro-steps at shorter lengths are recorded, and the steady state (for the 2023 rows an upper
bound) is the figure compared (:func:`_fsdp_record`).

Rows that cannot run here are written with the reason and never guessed: DDP and thunder's FSDP, bf16-mixed, the
Thunder compiler, inference.

Results go to litgpt_trace.jsonl, one object per row, written as each row finishes; rows already there are skipped
unless ``--redo``. ``run.py --trace`` reads the file (it never re-traces) for the tables of docs/published.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import json
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run  # noqa: E402  bench/published/run.py
from litgpt_fake import LiveBytes, extract  # noqa: E402  bench/published/litgpt_fake.py

MIRROR = Path("/work/.mirror/Lightning-AI+litgpt/repo")
SETUP_KEYS = (
    "model", "method", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "precision", "optimizer",
    "batch", "seq", "accum", "loss", "world_size", "quant", "metric", "gpu", "grad_ckpt", "fsdp", "fsdp_version",
)  # fmt: skip
"""The setup keys a row's record keeps (tests/published/test_litgpt_trace.py checks them against mapping.yaml)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Script:
    """What one LitGPT training script does in its step (the replay follows these lines)."""

    path: str
    """The script, in LitGPT's tree at the row's commit."""
    module: str
    """The package module whose ``GPT``/``Config`` the script imports: model, lora, adapter, adapter_v2."""
    chunked_head: bool
    """``model(input_ids, lm_head_chunk_size=128)`` and ``logits[-1] = logits[-1][..., :-1, :]`` (the fine-tuning
    scripts with few trainable weights); otherwise whole logits and ``logits[..., :-1, :]``."""
    loss_chunk: int
    """``chunked_cross_entropy``'s ``chunk_size``: 128 by default, 0 (one cross-entropy) in thunder's pretrain."""
    logits_local: bool
    """The logits are a local of a function that returns the loss only (thunder's ``forward_and_loss``), so they
    are freed before backward; in the fine-tuning scripts ``logits`` is a local of the loop and outlives it."""
    fused: bool
    """``torch.optim.AdamW(..., fused=True)``; otherwise PyTorch's default, foreach on CUDA (torch/optim/
    optimizer.py ``_default_to_fused_or_foreach``)."""
    longest_first: bool = False
    """The first micro-step holds the longest sample and the later ones random ones, padded to their own longest
    (lit-gpt 8641822 ``finetune/lora.py`` l. 212 ``get_batch(..., longest_seq_ix if iter_num == 0 else None)``,
    l. 290-292 ``ix[0] = longest_seq_ix``; adapter.py l. 170 alike). The row is then compared with the first
    iteration's peak: the only micro-step at the longest length, with no previous micro-step alive beside it. The
    measured iterations' steady state at that length (a previous micro-step of the same length alive: its logits,
    and under QLoRA every MatMul4Bit input) does not occur in such a run, and is kept beside it as an upper bound."""


SCRIPTS: dict[str, Script] = {
    # lit-gpt 8641822 finetune/lora.py l. 146-152 (AdamW(trainable, lr, weight_decay)), l. 207-212 (the loop);
    # adapter.py / adapter_v2.py l. 106 and l. 172-182, the same loop.
    "lora-2023": Script(path="finetune/lora.py", module="lora", chunked_head=True, loss_chunk=128,
                        logits_local=False, fused=False, longest_first=True),
    "adapter-2023": Script(path="finetune/adapter.py", module="adapter", chunked_head=True, loss_chunk=128,
                           logits_local=False, fused=False, longest_first=True),
    "adapter_v2-2023": Script(path="finetune/adapter_v2.py", module="adapter_v2", chunked_head=True,
                              loss_chunk=128, logits_local=False, fused=False, longest_first=True),
    # litgpt 43c44323 litgpt/finetune/lora.py l. 180-189 (AdamW), l. 274-286 (the loop); 2b195c7f..00af8b0d
    # l. 207-211 (instantiate_torch_optimizer("AdamW", ...)), l. 302-314.
    "lora-2024": Script(path="litgpt/finetune/lora.py", module="lora", chunked_head=True, loss_chunk=128,
                        logits_local=False, fused=False),
    # litgpt 43c44323 litgpt/finetune/full.py l. 135-138, l. 227-238; 00af8b0d l. 157-158, l. 253-264.
    "full-2024": Script(path="litgpt/finetune/full.py", module="model", chunked_head=False, loss_chunk=128,
                        logits_local=False, fused=False),
    # litgpt 101e31d2 extensions/thunder/pretrain.py l. 204-210 (AdamW fused), l. 298-312, l. 368-372.
    "pretrain-thunder": Script(path="extensions/thunder/pretrain.py", module="model", chunked_head=False,
                               loss_chunk=0, logits_local=True, fused=True),
}  # fmt: skip

CONFIG_HUB_COMMITS = {
    # config_hub/finetune/README.md: the commit that added each row's line (git blame at 26857050; the 2024-04 rows
    # kept their values when 5895df10 reformatted the table, and e5493986 only dropped the QLoRA 4xA10G lines).
    **dict.fromkeys((81, 82, 83, 84, 85, 86, 87, 88, 94, 95, 96, 97, 98, 99, 109, 110, 111, 112), "43c44323"),
    **dict.fromkeys((113, 114, 115, 119, 120, 121, 122, 123, 124), "43c44323"),
    **dict.fromkeys((89, 91, 92, 93), "2b195c7f"),  # Gemma 2 2B / 9B (2024-08-02)
    **dict.fromkeys((90, 103, 104, 105, 106, 107, 108), "00af8b0d"),  # gemma2b/qlora, Llama 3.2 (2024-09-27)
    **dict.fromkeys((100, 101, 102), "fd71063c"),  # Llama 3.1 (2024-07-24)
    **dict.fromkeys((116, 117, 118), "f247be87"),  # Phi-3 (2024-07-05)
}
LIT_GPT_2023 = "8641822"
"""tutorials/resource-tables.md: "lit-gpt commit 8641822" (table dated 2023-10-20)."""
TUTORIAL_COMMITS = {
    # tutorials/0_to_litgpt.md: added by 3cf6493c (2024-03-28) with "Memory used: 13.90 GB" for
    # config_hub/finetune/phi-2/lora.yaml, whose settings there are row 114's.
    139: ("3cf6493c", "lora-2024"),
    # tutorials/prepare_dataset.md and neurips_challenge_quickstart.md as the CSV quotes them (c195451d, 2023-09-29):
    # finetune/lora.py of that commit (the loop of 8641822's, longest sample first, before BitsandbytesPrecision).
    **dict.fromkeys((140, 141, 142, 143), ("c195451d", "lora-2023")),
    # tutorials/quantize.md: its Falcon-7B figures were added by 982abcbc (2023-10-05; inference, not replayed)
    **dict.fromkeys((72, 73, 74, 75, 76, 77), ("982abcbc", "lora-2023")),
}
THUNDER = "101e31d2"
"""extensions/thunder/README.md: the table and commands of 101e31d2 (2024-05-06)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """One row: what to replay, or why it is not traced."""

    row: int
    commit: str
    script: str
    """A key of :data:`SCRIPTS` (or the script named in the reason when not traced)."""
    config_name: str
    """LitGPT's ``Config.from_name`` name."""
    setup: Mapping[str, Any]
    """The row's setup in mapping.yaml's names (from the mapping, or from the CSV for rows it does not map)."""
    measured_gb: float | None
    """The row's figure (decimal GB; None for an OOM row): the mapping's reading, or the CSV's value."""
    reason: str | None = None
    """Why the row is not traced (None: traced)."""


# -- plans --------------------------------------------------------------------------------------------------------
def _litgpt_name(csv_model: str) -> str:
    if csv_model.startswith("TinyLlama 1.1B"):
        return "tiny-llama-1.1b"
    return csv_model.split("/")[-1]


FSDP_SCRIPTS = ("lora-2023", "full-2024")
"""Scripts whose ``FSDPStrategy`` is replayed (:func:`_fsdp_wrap`): lit-gpt 8641822 ``finetune/lora.py`` l. 83-89 and
litgpt 43c44323 ``litgpt/finetune/full.py`` l. 89-96 build the same one."""


def fsdp_replayed(setup: Mapping[str, Any], script: str) -> bool:
    """Whether the row runs under FSDP1 FULL_SHARD with a script whose FSDP set-up is replayed here."""
    return (
        int(setup.get("world_size", 1)) > 1
        and setup.get("fsdp") == "full_shard"
        and int(setup.get("fsdp_version", 1)) == 1
        and script in FSDP_SCRIPTS
    )


def _not_traced(setup: Mapping[str, Any], *, multi_gpu: bool) -> str | None:
    if setup.get("mode", "train") == "infer":
        return "inference row (the step replayed here is training)"
    if setup.get("quant") and setup.get("method") == "full":
        return "a quantised base under full fine-tuning is not replayed"
    if multi_gpu:
        return "several GPUs: DDP and thunder's FSDP are not replayed"
    if str(setup.get("precision", "bf16-true")) != "bf16-true":
        return "bf16-mixed (fp32 weights under Fabric's autocast) is not replayed"
    return None


def _mapped_plan(r: run.Row) -> Plan | None:
    s = r.setup
    csv_model = run.read_csv()[r.row - 1]["model"]
    multi = int(s.get("world_size", 1)) > 1
    if r.row in TUTORIAL_COMMITS:
        commit, script = TUTORIAL_COMMITS[r.row]
    elif r.source.startswith("litgpt tutorials/"):
        commit, script = LIT_GPT_2023, "lora-2023"
    elif r.source.startswith("litgpt config_hub/"):
        commit, script = CONFIG_HUB_COMMITS[r.row], "full-2024" if s.get("method") == "full" else "lora-2024"
    elif r.source.startswith("litgpt extensions/thunder/"):
        commit, script = THUNDER, "pretrain-thunder"
    else:
        return None
    multi = multi and not fsdp_replayed(s, script)
    return Plan(row=r.row, commit=commit, script=script, config_name=_litgpt_name(csv_model), setup=s,
                measured_gb=r.measured_gb, reason=_not_traced(s, multi_gpu=multi))  # fmt: skip


# Rows mapping.yaml lists as not expressible (LitGPT's adapters the estimate lacks), with their setups from the CSV:
# the 2023 tables ran finetune/{adapter,adapter_v2}.py's defaults with the CSV's micro-batch, longest sample and
# accumulation.
EXTRA: dict[int, dict[str, Any]] = {
    24: {"method": "adapter", "batch": 1, "seq": 1034, "accum": 128},
    27: {"method": "adapter", "batch": 1, "seq": 1304, "accum": 128},
    30: {"method": "adapter_v2", "batch": 1, "seq": 1034, "accum": 128},
    33: {"method": "adapter_v2", "batch": 1, "seq": 1304, "accum": 128},
}  # fmt: skip
# Their 4-bit rows: the same script and setup with ``--quantize bnb.nf4`` / ``bnb.nf4-dq`` (the CSV's precision), which
# swaps AdamW for bitsandbytes' PagedAdamW (lit-gpt 8641822 adapter.py and adapter_v2.py, as finetune/lora.py
# l. 148-151).
_PAGED = {"optimizer": "paged_adamw_32bit"}
EXTRA.update({
    **{n: {**EXTRA[base], **_PAGED, "quant": quant}
       for n, base, quant in (
           (25, 24, "nf4"), (26, 24, "nf4-dq"), (28, 27, "nf4"), (29, 27, "nf4-dq"), (31, 30, "nf4"),
           (32, 30, "nf4-dq"), (34, 33, "nf4"), (35, 33, "nf4-dq"))},
})  # fmt: skip


def _extra_reason(rec: Mapping[str, str]) -> str:
    """Why a LitGPT row mapping.yaml does not express is not traced either (rows not in :data:`EXTRA`)."""
    method, precision = rec["method"], rec["precision"]
    if "inference" in method:
        return "inference row (the step replayed here is training)"
    if "4bit" in method or "qlora" in method:
        return "QLoRA or a 4-bit adapter whose setup is not written here (litgpt_trace.EXTRA)"
    if "mixed" in precision:
        return "bf16-mixed (fp32 weights under Fabric's autocast) is not replayed"
    if "FSDP" in rec["notes"] or "devices=2" in rec["notes"]:
        return "several GPUs (FSDP or DDP): this replays one process"
    return "a tutorial's figure whose commit, GPU or accumulation is not stated"


def _extra_plans(mapping: run.Mapping_) -> list[Plan]:
    """Plans for the LitGPT training rows mapping.yaml lists as not expressible by model family or method."""
    csv_rows = run.read_csv()
    families = {n for n, missing in mapping.unexpressible if "model family" in missing or "Adapter" in missing}
    out = []
    for n in sorted(families):
        rec = csv_rows[n - 1]
        if "Lightning-AI/litgpt" not in rec["source"]:
            continue
        method = rec["method"]
        commit = LIT_GPT_2023 if "resource-tables" in rec["source"] else CONFIG_HUB_COMMITS.get(n, "")
        setup = {"model": rec["model"], "precision": "bf16-true", "optimizer": "adamw_torch", **EXTRA.get(n, {})}
        setup.setdefault("metric", "oom" if rec["metric"] == "OOM" else "allocated")
        kind = {"qlora": "lora"}.get(str(setup.get("method", method)), str(setup.get("method", method)))
        script = f"{kind}-2023" if commit == LIT_GPT_2023 else f"{kind}-2024"
        reason = None
        if n not in EXTRA:
            reason = _extra_reason(rec)
            setup["method"] = method
        out.append(Plan(row=n, commit=commit or "-", script=script, config_name=_litgpt_name(rec["model"]),
                        setup=setup, measured_gb=float(rec["value_gb"]) if rec["value_gb"] else None,
                        reason=reason))  # fmt: skip
    return out


def plans(mapping: run.Mapping_ | None = None) -> list[Plan]:
    """Every LitGPT row this traces or reports as not traced, mapped rows first."""
    mapping = mapping or run.load_mapping()
    mapped = [p for r in mapping.rows if (p := _mapped_plan(r)) is not None]
    return mapped + _extra_plans(mapping)


# -- the replay ---------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _default_dtype(dtype: Any) -> Iterator[None]:
    """lightning ``plugins/precision/utils.py`` ``_DtypeContextManager``: the default dtype inside, restored after."""
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _lora_kwargs(package: str, setup: Mapping[str, Any]) -> dict[str, Any]:
    """``Config.from_name`` keywords for the row's LoRA (lit-gpt 2023 ``r``/``to_query``; litgpt ``lora_r``...)."""
    targets = set(setup.get("lora_targets", ["all"]))
    every = "all" in targets
    on = {
        "query": every or "q_proj" in targets, "key": every or "k_proj" in targets,
        "value": every or "v_proj" in targets, "projection": every or "o_proj" in targets, "mlp": every,
        "head": "lm_head" in targets,
    }  # fmt: skip
    values = {"r": int(setup["lora_rank"]), "alpha": int(setup.get("lora_alpha", 16)),
              "dropout": float(setup.get("lora_dropout", 0.05)), **on}  # fmt: skip
    if package == "litgpt":
        return {f"lora_{k}": v for k, v in values.items()}
    return {k if k in ("r", "alpha", "dropout") else f"to_{k}": v for k, v in values.items()}


def _mark_trainable(mod: Any, method: str, model: Any) -> None:
    if method in ("lora", "qlora"):
        mod.mark_only_lora_as_trainable(model)
    elif method == "adapter":
        mod.mark_only_adapter_as_trainable(model)
    elif method == "adapter_v2":
        mod.mark_only_adapter_v2_as_trainable(model)


class _PagedAdamW:
    """bitsandbytes' ``PagedAdamW`` as ``max_memory_allocated`` sees it: nothing. Its states are paged buffers
    (bitsandbytes 0.41.1/0.42.0 ``optim/optimizer.py`` ``get_state_buffer`` → ``F.get_paged``: ``cudaMallocManaged``,
    outside PyTorch's allocator), its ``step`` a Python int, its update in place; ``zero_grad`` is torch's
    (``set_to_none``)."""

    def __init__(self, params: list[Any]) -> None:
        self.params = params
        self.state: dict[Any, Any] = {}

    def step(self) -> None:
        pass

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def _optimizer(params: list[Any], script: Script, setup: Mapping[str, Any]) -> Any:
    """The script's AdamW: ``fused=True`` where it says so, else PyTorch's default on CUDA (foreach); with a
    quantised base LitGPT swaps in bitsandbytes' ``PagedAdamW`` (lit-gpt 8641822 ``finetune/lora.py`` l. 148-151,
    litgpt 43c44323 l. 183-186: ``if quantize: optimizer_cls = bnb.optim.PagedAdamW``)."""
    import torch

    if str(setup.get("optimizer", "")).startswith("paged"):
        return _PagedAdamW(params)
    if script.fused:
        return torch.optim.AdamW(params, lr=4e-4, weight_decay=0.1, betas=(0.9, 0.95), fused=True)
    return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.02, foreach=True)


def _convert_module(model: Any) -> None:
    """``HalfPrecision.convert_module``: ``module.to(dtype=bf16)``. The parameters are bf16 already (built under
    the init context), so only floating buffers (RoPE tables) change; done by hand because ``Module.to`` swaps
    fake parameters and refuses ones a weakref observes."""
    import torch

    for p in model.parameters():
        assert p.dtype in (torch.bfloat16, torch.uint8), p.dtype  # uint8: a quantised weight's packed codes
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_floating_point() and buf.dtype != torch.bfloat16:
                module._buffers[name] = buf.to(torch.bfloat16)


def _quantise_linears(model: Any, quant: str) -> None:
    """Lightning's ``BitsandbytesPrecision`` on fake tensors: every ``nn.Linear`` of ``GPT`` 4-bit, lm_head and LoRA's
    base linears included (``module_init_context`` patches ``torch.nn.Linear``, no ``ignore_modules``:
    analytic/weights.py ``lm_head_quantised``). Each weight's bf16 storage is replaced by the tensors bitsandbytes
    stores it as (analytic/weights.py ``quantised_tensors``: packed codes, absmax, nested absmax), and its forward by
    bitsandbytes' ``MatMul4Bit`` (:func:`_matmul4bit`)."""
    import torch

    from vramledger.analytic.weights import quantised_tensors

    spec = run._quant(quant)
    for mod in [m for m in model.modules() if type(m) is torch.nn.Linear]:
        shape = tuple(mod.weight.shape)
        sizes = quantised_tensors(shape[0] * shape[1], shape[0], spec)
        packed, *state = (torch.empty(n, dtype=torch.uint8) for n in sizes)
        mod.weight = torch.nn.Parameter(packed, requires_grad=False)  # Params4bit: the packed codes are its data
        mod.quant_state = state
        mod.forward = _linear4bit_forward(mod, shape)


def _linear4bit_forward(mod: Any, shape: tuple[int, ...]) -> Any:
    def forward(x: Any) -> Any:
        # bitsandbytes Linear4bit.forward → matmul_4bit: the gemv path only for a single vector without grad.
        return _matmul4bit().apply(x, shape, mod.bias)

    return forward


def _dequantised(shape: tuple[int, ...], dtype: Any) -> Any:
    """``F.dequantize_4bit(B, state).to(dtype)``: the state is fp16 (Lightning's ``_Linear4bit.quantize`` casts to
    half first), so an fp16 copy and its cast are alive together (analytic/litgpt_qlora.py, 2)."""
    import torch

    return torch.empty(shape, dtype=torch.float16).to(dtype)


@functools.cache
def _matmul4bit() -> Any:
    """bitsandbytes' ``MatMul4Bit`` on fake tensors (built on first use: torch is imported inside)."""
    import torch

    class MatMul4Bit(torch.autograd.Function):
        """bitsandbytes 0.41.1/0.42.0 ``autograd/_functions.py`` ``MatMul4Bit``: forward ``linear(A,
        dequantize_4bit(B).to(A.dtype), bias)`` and ``ctx.tensors = (A, B)`` when A or B needs grad, a plain
        attribute that autograd never releases (fixed in 0.43.2, analytic/litgpt_qlora.py, 3); backward
        ``grad_A = grad_output @ dequantize_4bit(B).to(grad_output.dtype)``."""

        @staticmethod
        def forward(ctx: Any, A: Any, shape: tuple[int, ...], bias: Any) -> Any:
            out = torch.nn.functional.linear(A, _dequantised(shape, A.dtype), bias)
            if ctx.needs_input_grad[0]:
                ctx.tensors = (A,)
            ctx.shape = shape
            return out

        @staticmethod
        def backward(ctx: Any, grad_output: Any) -> Any:
            return grad_output @ _dequantised(ctx.shape, grad_output.dtype), None, None

    return MatMul4Bit


def _fabric_forward(model: Any) -> Any:
    """lightning ``fabric/wrappers.py`` ``_FabricModule.forward`` under ``HalfPrecision("bf16-true")``."""
    import torch
    from torch.utils._pytree import tree_map

    def forward(*args: Any, **kwargs: Any) -> Any:
        with _default_dtype(torch.bfloat16):  # forward_context
            out = model(*args, **kwargs)
        # convert_output: apply_to_collection(..., _convert_fp_tensor, dst_type=torch.get_default_dtype())
        dst = torch.get_default_dtype()
        return tree_map(lambda t: t.to(dst) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, out)

    return forward


def _build(mod: Any, plan: Plan, script: Script) -> tuple[Any, Any]:
    """``GPT(Config.from_name(...))`` as the script builds it under Fabric's ``bf16-true``: (model, config)."""
    import torch

    s = plan.setup
    method = str(s.get("method", "full"))
    kwargs = _lora_kwargs(mod.__name__.split(".")[0], s) if method in ("lora", "qlora") else {}
    config = mod.Config.from_name(plan.config_name, **kwargs)
    with _default_dtype(torch.bfloat16):  # fabric.init_module: HalfPrecision's init context
        model = mod.GPT(config)
    _mark_trainable(mod, method, model)
    if s.get("quant"):  # fabric.setup_module under BitsandbytesPrecision: convert_module quantises
        _quantise_linears(model, str(s["quant"]))
    if script.loss_chunk == 0:
        model.max_seq_length = int(s["seq"])  # pretrain.py: before fabric.setup
    _convert_module(model)  # fabric.setup_module: HalfPrecision.convert_module
    return model, config


def _micro_step(
    forward: Any, loss_fn: Any, script: Script, shape: tuple[int, int], vocab: int, accum: int, held: list[Any]
) -> None:
    """One micro-step of the script's loop: forward, loss, ``fabric.backward(loss / accum)``. ``held[0]`` is the
    loop's ``logits``: rebound when the forward returns (the previous micro-step's list lives until then), alive
    through backward, the optimizer step and the next forward; None where the script's function frees them."""
    import torch

    from vramledger.trace.step import _backward  # loss.backward() past the shims' torch-function modes

    batch, seq = shape
    data = torch.randint(0, vocab, (batch, seq + 1))
    input_ids, targets = data[:, :seq].contiguous(), data[:, 1:].contiguous()
    del data
    if script.logits_local:  # forward_and_loss: the logits die with the function's frame
        held[0] = None
        loss = loss_fn(forward(input_ids), targets, chunk_size=0)
    elif script.chunked_head:
        held[0] = forward(input_ids, lm_head_chunk_size=128)
        held[0][-1] = held[0][-1][..., :-1, :]
        loss = loss_fn(held[0], targets[..., 1:])
    else:
        held[0] = forward(input_ids)
        loss = loss_fn(held[0][..., :-1, :], targets[..., 1:])
    _backward(loss / accum)  # fabric.backward


def replay(package: str, plan: Plan) -> tuple[int, int, list[tuple[int, str]]]:
    """(peak live bytes of the measured iterations, the peak of the first iteration, the largest groups live at the
    peak) of the row's loop on fake tensors. The first iteration has no previous micro-step alive beside it (its
    optimizer states are created at its step): what a run whose first micro-step is its longest holds then, as
    lit-gpt 8641822's loop does (``get_batch(..., longest_seq_ix if iter_num == 0 else None)``)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramledger.trace.shims import dropout_as_cuda, sdpa_as_cuda

    script = SCRIPTS[plan.script]
    mod = importlib.import_module(f"{package}.{script.module}")
    loss_fn = importlib.import_module(f"{package}.utils").chunked_cross_entropy
    s = plan.setup
    batch, seq, accum = int(s["batch"]), int(s["seq"]), int(s.get("accum", 1))
    with FakeTensorMode(), sdpa_as_cuda(), dropout_as_cuda(), LiveBytes() as live:
        model, config = _build(mod, plan, script)
        optimizer = _optimizer([p for p in model.parameters() if p.requires_grad], script, s)
        if script.loss_chunk != 0:
            model.max_seq_length = seq  # fit: min(longest_seq_length, train.max_seq_length)
        forward = _fabric_forward(model)
        vocab = config.padded_vocab_size
        # Building the model is not measured: LitGPT loads (and Lightning quantises) layer by layer into a model whose
        # weights are already in their final form; here the bf16 model exists whole before its linears are quantised.
        live.restart_peak()
        # fit's sanity ``validate`` (no grad; the LoRA and full scripts keep nothing from it). lit-gpt 8641822's
        # adapters keep the prefix K/V it computes (adapter.py l. 124-141, ``adapter_kv_cache``, never cleared;
        # finetune/adapter.py l. 213-214 runs validate under no_grad because of it): training reuses them.
        with torch.no_grad():
            forward(torch.randint(0, vocab, (1, 16)))
        first = 0  # the peak of the validate and iteration 0
        # Iteration 0 is a whole optimizer step (the states exist from it on); 1 and 2 are measured: with accum > 1
        # the first accumulates and the second steps, with accum = 1 both step.
        logits: list[Any] = [None]  # the loop's local
        for it in (0, 1, 2):
            is_accumulating = accum > 1 and it == 1
            _micro_step(forward, loss_fn, script, (batch, seq), vocab, accum, logits)
            if not is_accumulating:
                optimizer.step()
                optimizer.zero_grad()
            if it == 0:
                if not script.fused:  # torch/optim/adamw.py _init_group: ``step`` stays on the host
                    for state in optimizer.state.values():
                        live.forget(state["step"])
                first = live.peak
                live.restart_peak()
    return live.peak, first, live.largest(8)


LATER = (8, 4, 2)
"""FSDP rows: later micro-steps at ``seq // k`` tokens (and at 3/4 of ``seq``), each after one of its own length."""


def _fsdp_wrap(mod: Any, model: Any, world_size: int) -> Any:
    """Lightning 71aed751 ``FSDPStrategy.setup_module`` as lit-gpt 8641822 ``finetune/lora.py`` l. 83-89 configures
    it: ``FullyShardedDataParallel(module, cpu_offload=CPUOffload(False), mixed_precision=FSDPPrecision(
    "bf16-true").mixed_precision_config`` (bf16 parameters, reductions and buffers), ``sharding_strategy=FULL_SHARD``,
    ``auto_wrap_policy=ModuleWrapPolicy({Block})``, ``use_orig_params=True`` (the strategy's default for torch ≥ 2.0),
    ``limit_all_gathers=True``; FSDP1's own ``backward_prefetch=BACKWARD_PRE``), then ``_setup_activation_
    checkpointing``: ``apply_activation_checkpointing(module, checkpoint_wrapper(checkpoint_impl=NO_REENTRANT),
    check_fn=isinstance Block)`` (fabric/strategies/fsdp.py l. 272-300, 736-757). The device is the CPU (the fake
    process group's ranks, rank 0 traced)."""
    import functools

    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    bf16 = torch.bfloat16
    wrapped = FSDP(
        model,
        cpu_offload=CPUOffload(offload_params=False),
        mixed_precision=MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, buffer_dtype=bf16),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.device("cpu"),
        auto_wrap_policy=ModuleWrapPolicy({mod.Block}),
        use_orig_params=True,
        limit_all_gathers=True,
    )
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    apply_activation_checkpointing(wrapped, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, mod.Block))
    return wrapped


def replay_fsdp(package: str, plan: Plan) -> dict[str, Any]:
    """The row's loop under FSDP1 on a fake process group of the row's world size, rank 0 (:func:`_fsdp_wrap`), as
    lit-gpt 8641822 ``finetune/lora.py`` runs it with ``devices > 1``: every micro-step but the accumulation window's
    last inside ``fabric.no_backward_sync(model, enabled=is_accumulating)`` (l. 214-215: FSDP's ``no_sync``).

    litgpt 43c44323 ``litgpt/finetune/full.py`` (l. 227-238) runs the same loop on whole logits.

    Returns the peaks (bytes): ``first``, the sanity validate and iteration 0 (the longest sample, accumulating: no
    gradient exists before its backward); ``steady``, after a synchronising micro-step and its optimizer step (the
    states exist from then on), two accumulating micro-steps (when ``accum`` > 1) and a synchronising one at the same
    length, each beside the previous micro-step's logits and, from the second on, the unsharded gradients
    ``no_sync`` keeps; ``later``, for the scripts that run their longest
    sample first and for shorter lengths (:data:`LATER`), an accumulating micro-step after one of its own length: what
    a later, random batch of that padded length holds."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramledger.trace.distributed import fake_process_group, recorded_resizes
    from vramledger.trace.shims import dropout_as_cuda, sdpa_as_cuda

    script = SCRIPTS[plan.script]
    mod = importlib.import_module(f"{package}.{script.module}")
    loss_fn = importlib.import_module(f"{package}.utils").chunked_cross_entropy
    s = plan.setup
    batch, seq, accum = int(s["batch"]), int(s["seq"]), int(s.get("accum", 1))
    longest_first = script.longest_first and plan.measured_gb is not None
    lengths = [seq // k for k in LATER] + [3 * seq // 4] if longest_first else []
    peaks: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(fake_process_group(int(s["world_size"])))
        for ctx in (FakeTensorMode(), sdpa_as_cuda(), dropout_as_cuda()):
            stack.enter_context(ctx)
        live = stack.enter_context(LiveBytes())
        stack.enter_context(recorded_resizes(live))  # type: ignore[arg-type]  # LiveBytes.on_resize
        model, config = _build(mod, plan, script)
        wrapped = _fsdp_wrap(mod, model, int(s["world_size"]))
        optimizer = _optimizer([p for p in wrapped.parameters() if p.requires_grad], script, s)
        model.max_seq_length = seq  # train(): model.max_seq_length = longest_seq_length
        forward = _fabric_forward(wrapped)
        vocab = config.padded_vocab_size
        live.restart_peak()
        with torch.no_grad():  # the sanity validate
            forward(torch.randint(0, vocab, (1, 16)))

        logits: list[Any] = [None]  # the loop's local

        def micro_step(length: int, accumulating: bool) -> None:
            sync = wrapped.no_sync() if accumulating else contextlib.nullcontext()
            with sync:  # fabric.no_backward_sync(model, enabled=is_accumulating)
                _micro_step(forward, loss_fn, script, (batch, length), vocab, accum, logits)
            if not accumulating:
                optimizer.step()
                optimizer.zero_grad()

        micro_step(seq, accum > 1)
        peaks["first"] = live.peak
        if accum > 1:  # close the first accumulation window: the optimizer's states exist from its step on
            micro_step(seq, False)
        live.restart_peak()
        for accumulating in (accum > 1, accum > 1, False):  # the first makes the kept gradients again
            micro_step(seq, accumulating)
        peaks["steady"], peaks["largest"] = live.peak, live.largest(8)
        peaks["later"] = {}
        for length in lengths:
            micro_step(length, True)  # after the step's zero_grad: makes the kept gradients again
            live.restart_peak()
            micro_step(length, True)
            peaks["later"][str(length)] = live.peak
    return peaks


# -- the results file ---------------------------------------------------------------------------------------------
def _record(plan: Plan, **extra: Any) -> dict[str, Any]:
    import torch

    setup = {k: plan.setup[k] for k in SETUP_KEYS if k in plan.setup}
    rec: dict[str, Any] = {"row": plan.row, "commit": plan.commit, "script": SCRIPTS[plan.script].path
                           if plan.script in SCRIPTS else plan.script, "config": plan.config_name, "setup": setup,
                           "measured_gb": plan.measured_gb,
                           "longest_first": plan.script in SCRIPTS and SCRIPTS[plan.script].longest_first}  # fmt: skip
    rec.update(extra)
    rec["torch"] = torch.__version__
    return rec


def write_jsonl(records: Mapping[int, Mapping[str, Any]], path: Path = run.LITGPT_TRACE) -> None:
    """Rewrite the file, ordered by row (a partial file stays valid: each line is one row)."""
    lines = [json.dumps(records[n], separators=(", ", ": ")) for n in sorted(records)]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)


def trace_plan(plan: Plan, checkout: Path) -> dict[str, Any]:
    """The JSONL record of one row: traced (peak bytes, the largest groups, seconds) or why not."""
    if plan.reason is not None:
        return _record(plan, traced=False, reason=plan.reason)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        package = extract(checkout, plan.commit, Path(tmp))
        sys.path.insert(0, tmp)
        try:
            if fsdp_replayed(plan.setup, plan.script):
                return _fsdp_record(plan, replay_fsdp(package, plan), round(time.perf_counter() - t0, 1))
            steady, first, largest = replay(package, plan)
        finally:
            sys.path.remove(tmp)
            for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
                del sys.modules[name]
    seconds = round(time.perf_counter() - t0, 1)
    # The figure compared with the row: the measured iterations' peak, or, for a script whose only micro-step at its
    # longest length is the first, that micro-step's (Script.longest_first). Both are kept.
    peak = first if SCRIPTS[plan.script].longest_first else steady
    error = None if plan.measured_gb is None else round(peak / 1e9 / plan.measured_gb - 1, 5)
    return _record(plan, traced=True, peak_bytes=peak, error=error, steady_peak_bytes=steady,
                   first_step_peak_bytes=first, largest=[[n, what] for n, what in largest],
                   seconds=seconds)  # fmt: skip


def _fsdp_record(plan: Plan, peaks: Mapping[str, Any], seconds: float) -> dict[str, Any]:
    """An FSDP row's record (:func:`replay_fsdp`). The figure compared is the steady state at the row's length, an
    upper bound: under ``no_sync`` a later micro-step runs beside the unsharded gradients that the first one (the
    longest sample) lacks until its backward, so the run's peak is that of its longest later batch, between the
    first micro-step's peak and this one's, wherever the data puts it."""
    steady = peaks["steady"]
    error = None if plan.measured_gb is None else round(steady / 1e9 / plan.measured_gb - 1, 5)
    no_sync = int(plan.setup.get("accum", 1)) > 1
    return _record(plan, traced=True, peak_bytes=steady, error=error, steady_peak_bytes=steady,
                   first_step_peak_bytes=peaks["first"], later_peak_bytes=peaks["later"], fsdp=True,
                   fsdp_no_sync=no_sync, largest=[[n, what] for n, what in peaks["largest"]],
                   seconds=seconds)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", type=int, nargs="*", help="trace only these rows")
    ap.add_argument("--redo", action="store_true", help="trace rows already in the results file again")
    ap.add_argument("--checkout", type=Path, default=MIRROR, help="a LitGPT git checkout or bare mirror")
    ap.add_argument("--out", type=Path, default=run.LITGPT_TRACE, help="the results file (default: litgpt_trace.jsonl)")
    ap.add_argument("--commit", help="replay at this LitGPT commit instead of the row's (an experiment: use --out)")
    args = ap.parse_args(argv)
    records = run.read_litgpt_trace(args.out)
    for plan in plans():
        if args.only and plan.row not in args.only:
            continue
        if plan.row in records and not args.redo:
            continue
        if args.commit:
            plan = dataclasses.replace(plan, commit=args.commit)
        try:
            rec = trace_plan(plan, args.checkout)
        except Exception as exc:  # a replay that fails is reported and not written: fix it, then run it again
            print(f"row {plan.row} ({plan.config_name}, {plan.commit}): FAILED {exc!r}", file=sys.stderr, flush=True)
            continue
        records[plan.row] = rec
        write_jsonl(records, args.out)
        what = f"{rec['peak_bytes'] / 1e9:.2f} GB in {rec['seconds']} s" if rec["traced"] else rec["reason"]
        print(f"row {plan.row} ({plan.config_name}, {plan.commit}): {what}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
