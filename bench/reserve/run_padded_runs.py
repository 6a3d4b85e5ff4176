"""The padded runs' references traced with their attention mask: each grid config with dynamic padding, its
envelope of single shapes re-measured on the masked batch.

run_runs.py's ``envelope_fine`` (the most any single length ℓ ≤ L reserves on its own, the reference of the grid's
"now vs the run's envelope") was traced before the trace fed a padded batch its mask. Since then a padded train
(micro-batch > 1, SDPA, not packed: analytic/activations.py ``padded_sdpa``) is traced as the worst padded batch
(trace/step.py ``padding_mask``: the last row ends in one pad token), which builds transformers' 4-D boolean mask,
``repeat_kv``'s copies of K and V and each layer's additive mask saved for SDPA's memory-efficient kernel, as the
estimate prices them. Here, for each such config of the grid (run_grid.specs: no packing):
- the run is traced once as step templates (``vramledger.simulate.templates.build_templates``, the masked batch at
  a reference length, every allocation re-derived at any length; the additive mask's 16-column padding is a rule of
  its own, ``mask_allocs`` counts the allocations that carry it: none means no mask was traced);
- single shape (load + 3 steps, run_runs.py ``single``) at the sweep's lengths ≤ L and at every L/32 from L/2 to L;
- real traces at L and L − 8 (two steps, replayed on an unlimited device, run_runs.py ``traced_single``) check the
  templates there (``BELOW``: at L, a multiple of 16, the templates make one transient mask per layer that the
  trace does not);
- ``reference.envelope_fine``: the most of all of these (the real traces included).

The reference length: build_templates picks the smallest candidate prime L0 whose forms (L0 ± 1, L0, b·L0,
⌈L0⌉₁₆) are none of the config's integers; a head dimension the config does not state (derived as hidden_size /
num_attention_heads: Qwen2.5, the grid's custom Llamas) is missed, and ⌈61⌉₁₆ = 64 then re-derives every (…, L0, 64)
query/key/value at (…, L, ⌈L⌉₁₆) (tiny LoRA 4 × 512: templates 610 MiB against the real trace's 494). Here L0 also
avoids every integer of the ModelSpec (``reference_of``).

Run:  nice -n 10 python bench/reserve/run_padded_runs.py        # the configs missing from the JSONL, cheapest first
      python bench/reserve/run_padded_runs.py --below           # add the check at L − 8 where a record lacks it
      python bench/reserve/run_padded_runs.py --table           # envelope before (unmasked) → after, and the checks
Output: bench/reserve/runs_padded.jsonl, one JSON object per config (bytes everywhere). No GPU: an unlimited device,
Hopper's cuBLAS workspaces (as run_grid.py). Templates and traces are cached in .streams/ (``padded_templates``,
``padded_L…``), apart from run_runs.py's unmasked ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "src"))
sys.path.insert(0, str(HERE))

import run_grid  # noqa: E402
import run_runs  # noqa: E402

from vramledger.simulate.templates import StepTemplates  # noqa: E402

OUT = HERE / "runs_padded.jsonl"
GiB = 2**30


def padded_configs() -> list[str]:
    """The grid's configs whose trace feeds the mask (``padded_sdpa``), cheapest first (runs.jsonl's trace
    seconds)."""
    from vramledger.analytic.activations import padded_sdpa

    seconds = {r["id"]: r["trace_seconds"] for r in map(json.loads, run_runs.OUT.read_text().splitlines())}
    ids = [run_grid.config_id(r) for r in run_grid.GRID if padded_sdpa(run_grid.specs(r)[1])]
    return sorted(ids, key=lambda c: seconds.get(c, float("inf")))


def reference_of(cid: str) -> int:
    """build_templates' reference length, avoiding every integer of the ModelSpec too (its derived head_dim)."""
    from vramledger.catalog.config_of import config_of
    from vramledger.simulate.templates import _config_ints, reference_length

    model, train, cfg = run_grid.specs(run_runs._rows()[cid])  # noqa: SLF001
    dims = _config_ints(cfg if cfg is not None else config_of(model))
    dims += [getattr(model, f.name) for f in dataclasses.fields(model) if type(getattr(model, f.name)) is int]
    dims += [train.lora.rank] if train.lora is not None else []
    return reference_length(dims, [train.micro_batch])


def mask_allocs(t: StepTemplates) -> int:
    """Allocations of a later step's forward and backward whose size follows the mask's 16-column padding."""
    rules = [r for k, r in zip(t.fb.kinds, t.fb.rules, strict=True) if k and r is not None]
    return sum(any(q > 1 for *_, q in r.terms) for r in rules)


BELOW = 8
"""The second check's length is L − BELOW: not a multiple of 16 (every grid L is one), a length whose additive mask
SDPA pads to 16 columns as the templates (traced at a prime) do at every length; at a multiple of 16 the trace
makes no padded copy and the templates make one more transient mask per layer (simulate/templates.py)."""


def _check(cid: str, t: StepTemplates, n: int) -> dict[str, int | float]:
    """A real trace at ``n`` against the templates' replay of the same two steps."""
    traced = run_runs.traced_single(cid, n, "padded_")
    return {
        "length": n,
        "traced_peak_reserved": traced["peak_reserved"],
        "traced_peak_allocated": traced["peak_allocated"],
        "traced_seconds": traced["seconds"],
        "templates_peak_reserved": run_runs.single(t, n, 2)["peak_reserved"],
    }


def record(cid: str) -> dict[str, Any]:
    t, seconds = run_runs.templates_of(cid, "padded_templates", reference_of(cid))
    L = run_runs._rows()[cid].seq  # noqa: SLF001
    lengths = sorted({run_runs._round8(L * f) for f in run_runs.SWEEP if f <= 1})  # noqa: SLF001
    rec = {
        "id": cid,
        "trace_seconds": seconds,
        "reference_len": t.reference_len,
        "mask_allocs": mask_allocs(t),
        "checks": {"trace_L": _check(cid, t, L), "trace_below_L": _check(cid, t, L - BELOW)},
        "single": {str(n): run_runs.single(t, n) for n in lengths},
        "fine": run_runs.fine_single(t, L),
    }
    return rec | {"reference": reference(rec)}


def reference(rec: dict[str, Any]) -> dict[str, Any]:
    """``envelope_fine``: the most of the masked single shapes (templates, 3 steps) at the sweep's lengths ≤ L and
    every L/32 from L/2 to L, and the real traces at L and L − BELOW (2 steps); ``single``: the real trace at L;
    ``envelope_run``: the most of it and runs.jsonl's ``envelope_fine`` (the batches without a mask).

    A run with dynamic padding meets both kinds of batch: one with a padded row (the mask) and one whose rows all
    reach its length (every row cut at the cutoff, say), for which transformers drops the mask (masking_utils.py
    ``_ignore_causal_mask_sdpa``: no masked token and ``kv_length == q_length``) and which reserves what the
    unmasked traces of runs.jsonl measured; the estimate prices the worse (analytic/activations.py ``sdpa_math``:
    the unmasked batch where SDPA then runs its math kernel). ``envelope_run`` is the grid's reference."""
    candidates = {f"single {n}": v["peak_reserved"] for n, v in rec["single"].items()}
    candidates |= {f"fine {n}": v for n, v in rec["fine"].items()}
    candidates |= {f"trace {c['length']}": c["traced_peak_reserved"] for c in rec["checks"].values()}
    at = max(candidates, key=lambda k: candidates[k])
    unmasked = {r["id"]: r for r in map(json.loads, run_runs.OUT.read_text().splitlines())}[rec["id"]]
    return {
        "single": rec["checks"]["trace_L"]["traced_peak_reserved"],
        "envelope_fine": candidates[at],
        "envelope_fine_at": at,
        "unmasked_envelope_fine": unmasked["reference"]["envelope_fine"],
        "envelope_run": max(candidates[at], unmasked["reference"]["envelope_fine"]),
    }


def table(recs: list[dict[str, Any]]) -> str:
    """Per config: the unmasked envelope (runs.jsonl) → the masked one, where the masked one peaks, and the
    templates against the real traces at L and L − BELOW."""
    rows = [
        "| config | envelope unmasked GiB | masked GiB (Δ) | at | trace at L GiB | templates (vs) | trace at L − 8 "
        "| templates (vs) |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]

    def check(c: dict[str, Any] | None) -> str:
        if c is None:
            return "— | —"
        a, b = c["traced_peak_reserved"], c["templates_peak_reserved"]
        return f"{a / GiB:.2f} | {b / GiB:.2f} ({'equal' if a == b else f'{b / a - 1:+.2%}'})"

    for r in recs:
        ref = r["reference"]
        before = ref["unmasked_envelope_fine"]
        rows.append(
            f"| {r['id']} | {before / GiB:.2f} | {ref['envelope_fine'] / GiB:.2f} "
            f"({ref['envelope_fine'] / before - 1:+.1%}) | {ref['envelope_fine_at']} | {check(r['checks']['trace_L'])} "
            f"| {check(r['checks'].get('trace_below_L'))} |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", action="store_true", help="print the markdown table of the recorded configs")
    ap.add_argument("--below", action="store_true", help="add the check at L − BELOW where a record lacks it")
    ap.add_argument("--only", help="one config id, printed, not saved")
    args = ap.parse_args()
    done = {r["id"]: r for r in map(json.loads, OUT.read_text().splitlines())} if OUT.exists() else {}
    if args.below:  # the check at L − BELOW, added to records made without it; every reference recomputed
        for cid, r in done.items():
            if "trace_below_L" not in r["checks"]:
                t, _ = run_runs.templates_of(cid, "padded_templates")
                r["checks"]["trace_below_L"] = _check(cid, t, r["checks"]["trace_L"]["length"] - BELOW)
                print(cid, r["checks"]["trace_below_L"], flush=True)
            r["reference"] = reference(r)
            OUT.write_text("".join(json.dumps(x) + "\n" for x in done.values()))
        return
    if args.table:
        print(table([done[c] for c in padded_configs() if c in done]))
        return
    if args.only:
        print(json.dumps(record(args.only), indent=1))
        return
    for cid in padded_configs():
        if cid in done:
            continue
        t0 = time.perf_counter()
        rec = record(cid)
        assert rec["mask_allocs"] > 0, f"{cid}: no mask traced"
        with OUT.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        ref, c = rec["reference"], rec["checks"]["trace_L"]
        print(
            f"{cid:56s} {time.perf_counter() - t0:6.1f}s  L0 {rec['reference_len']}  envelope "
            f"{(ref['unmasked_envelope_fine'] or 0) / GiB:.2f} → {ref['envelope_fine'] / GiB:.2f} "
            f"({ref['envelope_fine_at']})  trace at L {c['traced_peak_reserved'] / GiB:.3f}, "
            f"templates {c['templates_peak_reserved'] / GiB:.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
