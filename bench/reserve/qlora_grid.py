"""QLoRA's reserve: the estimate against the allocator replay of the traced QLoRA step.

The trace runs QLoRA as bitsandbytes and PEFT do (trace/shims.py ``bnb_linear4bit``: each 4-bit weight dequantised
for every matmul, forward and backward; PEFT's 4-bit LoRA layer), so its replay is the reference here, as for the
98 configurations of run_grid.py. Each configuration is traced as one shape (every row full), and compared with the
estimate of a packed run (the same single shape: ``packed``) and of a run with dynamic padding (``padded``, which
also holds what the shorter batches of such a run leave cached, so it sits at or above the single shape).

    python bench/reserve/qlora_grid.py            # trace what is missing (~10-90 s each), then print the table
    python bench/reserve/qlora_grid.py --analytic # recompute the estimate's columns only
    python bench/reserve/qlora_grid.py --table    # the markdown table (docs/reserve.md, "QLoRA")
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from run_grid import GPU, analytic_figures, trace_figures  # noqa: E402

from vramledger.catalog import resolve_model  # noqa: E402
from vramledger.specs import Attention, LoraSpec, Method, ModelSpec, Precision, QuantSpec, TrainSpec  # noqa: E402

OUT = Path(__file__).with_name("qlora_grid.jsonl")

# (model, batch, length, checkpointing, attention, LoRA, precision): nf4 with double quantisation, compute in the
# dtype the base loads in (LLaMA-Factory's QLoRA), AdamW; LoRA rank 8 on every linear unless named ("q,v dropout":
# q_proj and v_proj with dropout 0.05; "dora": every linear with DoRA, whose bf16-mixed step the estimate does not
# follow: README Known limits).
Row = tuple[str, int, int, bool, str, str, str]
ROWS: list[Row] = [
    ("qwen2.5-0.5b", 2, 1024, False, "sdpa", "all", "bf16-mixed"),
    ("qwen2.5-0.5b", 4, 2048, True, "sdpa", "all", "bf16-mixed"),
    ("qwen2.5-0.5b", 1, 4096, False, "sdpa", "all", "bf16-mixed"),
    ("qwen2.5-0.5b", 2, 512, False, "eager", "all", "bf16-mixed"),
    ("llama-3.2-1b", 1, 512, False, "sdpa", "all", "bf16-mixed"),
    ("llama-3.2-1b", 1, 512, True, "sdpa", "all", "bf16-mixed"),
    ("llama-3.2-1b", 2, 2048, True, "sdpa", "all", "bf16-mixed"),
    ("llama-3.2-1b", 1, 8192, True, "sdpa", "all", "bf16-mixed"),
    ("llama-3.2-1b", 2, 1024, False, "sdpa", "q,v dropout", "bf16-mixed"),
    ("llama-3.2-1b", 4, 1024, False, "eager", "all", "bf16-mixed"),
    ("qwen3-0.6b", 2, 2048, False, "sdpa", "all", "bf16-mixed"),
    ("qwen3-0.6b", 8, 1024, True, "sdpa", "all", "bf16-mixed"),
    ("llama-3.2-3b", 1, 2048, False, "sdpa", "all", "bf16-mixed"),
    ("llama-3.2-3b", 4, 4096, True, "sdpa", "all", "bf16-mixed"),
    ("llama-3-8b", 1, 1024, False, "sdpa", "all", "bf16-mixed"),
    ("llama-3-8b", 2, 4096, True, "sdpa", "all", "bf16-mixed"),
    # added once the first 16 were within ±3% or explained: pure bf16, DoRA, 256 and 16k tokens, eager under
    # checkpointing, more families
    ("qwen2.5-0.5b", 4, 256, False, "sdpa", "all", "bf16-true"),
    ("llama-3.2-1b", 2, 1024, False, "sdpa", "all", "bf16-true"),
    ("llama-3.2-1b", 1, 2048, True, "sdpa", "dora", "bf16-true"),
    ("qwen2.5-1.5b", 2, 1024, False, "sdpa", "dora", "bf16-true"),
    ("llama-3.2-1b", 1, 16384, True, "sdpa", "all", "bf16-mixed"),
    ("qwen2.5-1.5b", 2, 1024, True, "eager", "all", "bf16-mixed"),
    ("qwen2.5-1.5b", 1, 4096, False, "sdpa", "q,v dropout", "bf16-true"),
    ("mistral-7b", 1, 2048, True, "sdpa", "all", "bf16-mixed"),
    ("qwen2.5-7b", 2, 2048, True, "sdpa", "all", "bf16-mixed"),
    ("qwen2.5-7b", 1, 1024, False, "sdpa", "all", "bf16-true"),
    ("gemma-2-2b", 2, 1024, True, "eager", "all", "bf16-mixed"),
    ("phi-3-mini", 2, 1024, False, "sdpa", "all", "bf16-mixed"),
    # DoRA under autocast: the stream and the 4-bit linears' outputs in fp32 (activations.py quantised_outputs_fp32)
    ("llama-3.2-1b", 1, 2048, False, "sdpa", "dora", "bf16-mixed"),
    ("qwen2.5-0.5b", 2, 1024, True, "sdpa", "dora", "bf16-mixed"),
    # other shapes of the same models, around the workspace's edges (its rivals against 32 MiB)
    ("qwen2.5-0.5b", 2, 256, False, "sdpa", "all", "bf16-mixed"),
    ("qwen2.5-0.5b", 3, 1024, False, "sdpa", "all", "bf16-mixed"),
    ("llama-3.2-1b", 1, 1024, False, "sdpa", "all", "bf16-mixed"),
    ("llama-3.2-1b", 1, 4096, False, "sdpa", "all", "bf16-mixed"),
    ("qwen3-0.6b", 2, 1536, False, "sdpa", "all", "bf16-mixed"),
    ("qwen3-0.6b", 3, 2048, False, "sdpa", "all", "bf16-mixed"),
    ("llama-3-8b", 1, 2048, False, "sdpa", "all", "bf16-mixed"),
    ("qwen2.5-7b", 4, 512, True, "sdpa", "all", "bf16-mixed"),
]


def config_id(row: Row) -> str:
    name, b, L, ckpt, attn, lora, precision = row
    base = f"{name}/qlora/b{b}/L{L}/{'ckpt' if ckpt else 'nockpt'}/{attn}/{lora.replace(' ', '-').replace(',', '')}"
    return base if precision == "bf16-mixed" else f"{base}/{precision}"


def specs(row: Row) -> tuple[ModelSpec, TrainSpec]:
    name, b, L, ckpt, attn, lora, precision = row
    pure = precision != "bf16-mixed"
    adapters = {
        "all": LoraSpec(adapter_fp32=not pure),
        "q,v dropout": LoraSpec(targets=("q_proj", "v_proj"), dropout=0.05, adapter_fp32=not pure),
        "dora": LoraSpec(dora=True, adapter_fp32=not pure),
    }[lora]
    train = TrainSpec(
        method=Method.QLORA,
        precision=Precision(precision),
        micro_batch=b,
        seq_len=L,
        grad_ckpt=ckpt,
        attn=Attention(attn),
        quant=QuantSpec(),
        lora=adapters,
    )
    return resolve_model(name), train


def estimates(model: ModelSpec, train: TrainSpec) -> dict[str, Any]:
    return {
        "padded": analytic_figures(model, train),
        "packed": analytic_figures(model, dataclasses.replace(train, packing=True)),
    }


def table(done: dict[str, dict[str, Any]]) -> str:
    def gap(x: int, ref: int) -> float:
        return 100.0 * (x / ref - 1.0)

    rows = [
        "| config | replay alloc GiB | replay reserved GiB | estimate alloc | packed reserved | padded reserved |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    cols: dict[str, list[float]] = {"alloc": [], "packed": [], "padded": []}
    for cid, rec in done.items():
        t, a = rec["trace"], rec["analytic"]
        g = {
            "alloc": gap(a["packed"]["peak_allocated"], t["peak_allocated"]),
            "packed": gap(a["packed"]["peak_reserved"], t["replay_peak_reserved"]),
            "padded": gap(a["padded"]["peak_reserved"], t["replay_peak_reserved"]),
        }
        for k, v in g.items():
            cols[k].append(v)
        rows.append(
            f"| {cid} | {t['replay_peak_allocated'] / 2**30:.2f} | {t['replay_peak_reserved'] / 2**30:.2f} | "
            + " | ".join(f"{v:+.1f}%" for v in g.values())
            + " |"
        )
    for name, f in {
        "median": lambda v: f"{statistics.median(v):+.1f}%",
        "worst below": lambda v: f"{min(v):+.1f}%",
        "worst above": lambda v: f"{max(v):+.1f}%",
        "within ±3%": lambda v: f"{sum(abs(x) <= 3 for x in v)}/{len(v)}",
    }.items():
        rows.append(f"| **{name}** | | | " + " | ".join(f(cols[k]) for k in cols) + " |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--analytic", action="store_true", help="recompute the estimate's columns only")
    ap.add_argument("--table", action="store_true", help="print the markdown table")
    args = ap.parse_args()
    done: dict[str, dict[str, Any]] = {}
    if OUT.exists():
        done = {rec["id"]: rec for rec in map(json.loads, OUT.read_text().splitlines())}
    if not args.table:
        for row in ROWS:
            cid = config_id(row)
            model, train = specs(row)
            if cid in done and not args.analytic:
                continue
            if cid not in done:
                if args.analytic:
                    continue
                done[cid] = {"id": cid, "trace": trace_figures(model, train, None)}
                print(cid, f"{done[cid]['trace']['seconds']} s", flush=True)
            done[cid]["analytic"] = estimates(model, train)
            OUT.write_text("".join(json.dumps(rec) + "\n" for rec in done.values()))
    assert GPU is None  # both engines on an unlimited device, as in run_grid.py
    print(table(done))


if __name__ == "__main__":
    main()
