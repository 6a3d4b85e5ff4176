"""The inference bill in the terminal: the lines of the generate peak, the verdict, and how many sequences fit."""

from __future__ import annotations

from vramledger.analytic.inference import Concurrency
from vramledger.ledger import Category, Ledger, Phase
from vramledger.report.verdict import verdict_sentence
from vramledger.units import fmt_bytes


def render_infer(ledger: Ledger, concurrency: Concurrency | None = None) -> str:
    s = ledger.settings
    ph = Phase.GENERATE
    lines = [
        f"{ledger.model}  (analytic, inference)",
        f"generate: batch {s.get('batch')} × (prompt {s.get('prompt')} + {s.get('new_tokens')} new tokens), "
        f"{s.get('dtype')}{', ' + str(s.get('quant')) if s.get('quant') else ''}"
        f"{' computing in ' + str(s.get('bnb_compute_dtype')) if s.get('bnb_compute_dtype') else ''}, "
        f"{s.get('cache')} cache, "
        f"attn {s.get('attn')}",
        "",
    ]
    for cat in ledger.categories():
        if cat.allocated and ledger.bytes_of(cat, ph):
            lines.append(f"{cat.display:<30}{fmt_bytes(ledger.bytes_of(cat, ph)):>12}")
    lines += [
        "-" * 42,
        f"{'peak allocated':<30}{fmt_bytes(ledger.allocated(ph)):>12}",
        f"{'+ ' + Category.ALLOCATOR_RESERVE.display:<30}"
        f"{fmt_bytes(ledger.bytes_of(Category.ALLOCATOR_RESERVE, ph)):>12}",
        f"{'+ ' + Category.CUDA_CONTEXT.display:<30}{fmt_bytes(ledger.bytes_of(Category.CUDA_CONTEXT, ph)):>12}",
        f"{'= device total (nvidia-smi)':<30}{fmt_bytes(ledger.device(ph)):>12}",
        "",
        f"peak: {ledger.moments.get(ph, '')}",
    ]
    v = ledger.verdict
    if v is not None:
        lines.append(verdict_sentence(v))
    if ledger.advice:
        lines.append(ledger.advice)
    if concurrency is not None:
        c = concurrency
        if c.max_batch:
            lines.append(
                f"max concurrency on {c.gpu}: {c.max_batch} sequences of this length fit next to the weights "
                f"({fmt_bytes(c.weights_bytes)}; KV cache {fmt_bytes(c.cache_per_sequence)} per sequence; device "
                f"total {fmt_bytes(c.device_at_max)} of {fmt_bytes(c.usable_bytes)} usable)"
            )
        else:
            lines.append(
                f"max concurrency on {c.gpu}: none — one sequence already needs {fmt_bytes(c.device_at_max)} of "
                f"{fmt_bytes(c.usable_bytes)} usable"
            )
    from vramledger.report.terminal import wrap

    return "\n".join(wrap(line) for line in lines)


def infer_to_dict(ledger: Ledger, concurrency: Concurrency | None) -> dict[str, object]:
    from vramledger.report.json_out import ledger_to_dict

    out = ledger_to_dict(ledger)
    if concurrency is not None:
        out["max_concurrency"] = {
            "max_batch": concurrency.max_batch,
            "usable_bytes": concurrency.usable_bytes,
            "weights_bytes": concurrency.weights_bytes,
            "kv_cache_per_sequence_bytes": concurrency.cache_per_sequence,
            "device_at_max_bytes": concurrency.device_at_max,
            "gpu": concurrency.gpu,
        }
    return out
