"""Print the corpus results as the Markdown table of docs/upstream.md: ``python -m tests.upstream.results``.

Each run of test_corpus.py's ``RUNS``, estimated as the test does (from the framework's root, offline): the model the
estimate names, the method and precision it read, the micro-batch × length and the peak allocated memory (no GPU
given, so no verdict); a documented failure shows its reason.
"""

from __future__ import annotations

from typing import Any

from tests.upstream.test_corpus import FAILS, RUNS, _estimate


def _row(run_id: str, ledger: dict[str, Any]) -> str:
    s = ledger["settings"]
    how = [f"{s['method']}", s["precision"]]
    if "quant" in s:
        how.append(f"{s['quant']['bits']}-bit base")
    dist = s.get("distributed")
    if dist:
        how.append(f"{dist['engine']} × {dist['world_size']}")
    peak = ledger["peak_allocated_bytes"] / 2**30
    return (
        f"| `{run_id}` | {ledger['model']} | {' '.join(how[:2])}{' (' + ', '.join(how[2:]) + ')' if how[2:] else ''} "
        f"| {s['micro_batch']} × {s['seq_len']:,} | {peak:.2f} GiB |"
    )


def main() -> None:
    print("| run | model | method | batch × length | peak allocated |")
    print("|---|---|---|---|---:|")
    for run in RUNS:
        if run.id in FAILS:
            print(f"| `{run.id}` | — | — | — | fails: {FAILS[run.id][1].split(';')[0]} |")
        else:
            print(_row(run.id, _estimate(run).ledger))


if __name__ == "__main__":
    main()
