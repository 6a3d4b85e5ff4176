"""Overhead of the memory callback on a GPU: the same Trainer run with and without ``VramledgerCallback``.

Each arm trains ``--steps`` steps of a catalog model (random weights from its config, bf16 LoRA, nothing
downloaded); the step time is the median of the Trainer's own per-step wall times after ``--warmup`` steps
(``torch.cuda.synchronize`` only here, in the timing, never in the callback). Arms alternate in fresh processes so
neither inherits the other's allocator cache.

    PYTHONPATH=src python bench/callback_overhead.py --model llama-3.2-1b --batch 4 --seq 1024 --steps 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_arm(args: argparse.Namespace, with_callback: bool) -> list[float]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from vramledger.catalog import resolve_model
    from vramledger.measure.modelcfg import hf_config_for

    raw = hf_config_for(resolve_model(args.model))
    cfg = AutoConfig.for_model(**raw)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16).cuda()
    model = get_peft_model(model, LoraConfig(r=16, target_modules="all-linear"))
    g = torch.Generator().manual_seed(0)
    ds = [
        {"input_ids": (ids := torch.randint(3, cfg.vocab_size, (args.seq,), generator=g)), "labels": ids}
        for _ in range(args.batch * (args.steps + 1))
    ]
    times: list[float] = []

    class Timer(TrainerCallback):  # type: ignore[misc]
        t0 = 0.0

        def on_step_begin(self, *a: object, **k: object) -> None:
            torch.cuda.synchronize()
            Timer.t0 = time.perf_counter()

        def on_step_end(self, *a: object, **k: object) -> None:
            torch.cuda.synchronize()
            times.append(time.perf_counter() - Timer.t0)

    with tempfile.TemporaryDirectory() as tmp:
        targs = TrainingArguments(
            output_dir=tmp,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch,
            bf16=True,
            report_to=[],
            save_strategy="no",
            logging_steps=10,
            disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=targs, train_dataset=ds, callbacks=[Timer()])
        if with_callback:
            from vramledger.integrations.hf import VramledgerCallback

            VramledgerCallback.attach(trainer, out=Path(tmp) / "memory.jsonl")
        trainer.train()
    return times[args.warmup :]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--arm", choices=("with", "without"), help="(internal) run one arm here")
    args = p.parse_args()
    if args.arm:
        print(json.dumps(run_arm(args, args.arm == "with")))
        return 0
    results: dict[str, list[float]] = {"without": [], "with": []}
    for _ in range(args.repeats):
        for arm in ("without", "with"):
            out = subprocess.run(
                [sys.executable, __file__, *sys.argv[1:], "--arm", arm], check=True, capture_output=True, text=True
            ).stdout
            results[arm] += json.loads(out.strip().splitlines()[-1])
    base, cb = statistics.median(results["without"]), statistics.median(results["with"])
    print(
        json.dumps(
            {
                "model": args.model,
                "batch": args.batch,
                "seq": args.seq,
                "median_step_s_without": base,
                "median_step_s_with": cb,
                "overhead": cb / base - 1,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
