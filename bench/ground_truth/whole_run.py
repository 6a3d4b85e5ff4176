"""Ground truth for ``simulate``: the memory of a whole training run, step by step, with dynamic padding.

A one-step measurement misses what a real run does over time: batches of varying length (each padded to its
longest sample), the caching allocator growing its reserve to the longest batch seen and keeping it
(``reserved`` creeps up, ``num_alloc_retries`` when it cannot), and the evaluation/generation phases that
interleave with training. This script runs such a run and records every step.

Default run: Llama-3.2-1B (bundled config, random weights), LoRA r16 all-linear, bf16 autocast, AdamW (torch,
foreach), sdpa, no checkpointing, micro-batch 4, 200 optimizer steps, no accumulation. Sample token lengths
are drawn from a log-normal (``random.Random(0).lognormvariate(log(300), 0.8)``, floored at 16, capped at the
cutoff 2048); each batch is right-padded to its longest sample, ``attention_mask`` marks the padding and the
labels are the input ids with the padding set to -100. Every 50 steps: evaluation (4 batches of 8 under
``torch.no_grad``, the loss and logits kept as ``transformers.Trainer.prediction_step`` returns them, then
dropped) and greedy ``generate`` of 64 new tokens on 4 prompts of 256 tokens.

Per step / phase it records the batch shape, ``torch.cuda.max_memory_allocated`` and
``torch.cuda.max_memory_reserved`` (after ``torch.cuda.reset_peak_memory_stats`` at the phase start),
``torch.cuda.memory_allocated``/``memory_reserved`` at its end, ``num_alloc_retries`` from
``torch.cuda.memory_stats`` and the wall time (``torch.cuda.synchronize`` + ``time.perf_counter``).

Files: ``whole_run.jsonl`` (a header line with the environment and config, one line per step/eval/generate,
a summary line with the high-water step of reserved and the longest batch), ``lengths.json`` (the exact
sample-length sequences, with the seed and distribution), and ``whole_run_expandable.jsonl``: a shorter run
in a child process started with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (the allocator reads it
once, at CUDA init), to compare reserved creep.

The parent only orchestrates: each run is a child process (``--run``), so the parent never holds a CUDA
context and a crash or timeout of one run leaves the other's file.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import _common as C

TOTAL_BUDGET_S = 240.0  # run_all.sh kills at 270 s


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    model: str = "meta-llama/Llama-3.2-1B"
    """Catalog model; its bundled config.json is built with random weights."""
    method: str = "lora"
    """``lora`` (r16, all-linear, adapters fp32) or ``full``."""
    lora_rank: int = 16
    attn: str = "sdpa"
    micro_batch: int = 4
    steps: int = 200
    """Optimizer steps (grad accumulation 1)."""
    cutoff: int = 2048
    min_len: int = 16
    seed: int = 0
    mu: float = math.log(300)
    sigma: float = 0.8
    eval_every: int = 50
    eval_batches: int = 4
    eval_batch: int = 8
    eval_seed: int = 1
    gen_batch: int = 4
    gen_prompt_len: int = 256
    gen_new_tokens: int = 64
    lr: float = 1e-4
    budget_s: float = 150.0
    """The step loop stops (the summary says ``truncated``) when this many seconds have passed."""


SMOKE = dict(
    model="meta-llama/Llama-3.2-1B",
    micro_batch=2,
    steps=6,
    cutoff=64,
    min_len=4,
    mu=math.log(16),
    eval_every=3,
    eval_batches=2,
    eval_batch=2,
    gen_batch=2,
    gen_prompt_len=8,
    gen_new_tokens=4,
)


def sample_lengths(n: int, *, seed: int, mu: float, sigma: float, lo: int, hi: int) -> list[int]:
    """``n`` token lengths: round(lognormal(mu, sigma)) clipped to [lo, hi], from ``random.Random(seed)``.

    Pure Python (no numpy, no torch) so a simulator can regenerate the sequence exactly.

    >>> sample_lengths(3, seed=0, mu=math.log(300), sigma=0.8, lo=16, hi=2048)[:1] == \
        sample_lengths(1, seed=0, mu=math.log(300), sigma=0.8, lo=16, hi=2048)
    True
    """
    rng = random.Random(seed)
    return [min(hi, max(lo, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def lengths_record(cfg: RunConfig) -> dict[str, Any]:
    train = sample_lengths(
        cfg.steps * cfg.micro_batch, seed=cfg.seed, mu=cfg.mu, sigma=cfg.sigma, lo=cfg.min_len, hi=cfg.cutoff
    )
    ev = sample_lengths(
        cfg.eval_batches * cfg.eval_batch, seed=cfg.eval_seed, mu=cfg.mu, sigma=cfg.sigma, lo=cfg.min_len, hi=cfg.cutoff
    )
    return {
        "distribution": "round(random.Random(seed).lognormvariate(mu, sigma)) clipped to [min_len, cutoff]",
        "seed": cfg.seed,
        "eval_seed": cfg.eval_seed,
        "mu": cfg.mu,
        "sigma": cfg.sigma,
        "min_len": cfg.min_len,
        "cutoff": cfg.cutoff,
        "micro_batch": cfg.micro_batch,
        "eval_batch": cfg.eval_batch,
        "train_lengths": train,
        "train_batch_padded_len": [max(train[i : i + cfg.micro_batch]) for i in range(0, len(train), cfg.micro_batch)],
        "eval_lengths": ev,
        "eval_batch_padded_len": [max(ev[i : i + cfg.eval_batch]) for i in range(0, len(ev), cfg.eval_batch)],
        "gen": {"batch": cfg.gen_batch, "prompt_len": cfg.gen_prompt_len, "new_tokens": cfg.gen_new_tokens},
    }


def make_batch(lengths: list[int], vocab: int, gen: Any, device: Any) -> dict[str, Any]:
    """Right-padded ids (pad id 0), attention mask, labels with padding at -100 (DataCollatorForSeq2Seq)."""
    import torch

    b, L = len(lengths), max(lengths)
    ids = torch.randint(3, vocab, (b, L), generator=gen)
    mask = torch.zeros((b, L), dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    ids = ids * mask
    labels = ids.masked_fill(mask == 0, -100)
    return {k: v.to(device) for k, v in (("input_ids", ids), ("attention_mask", mask), ("labels", labels))}


class Recorder:
    """One JSON line per record, flushed at once so a killed run keeps what it measured."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = path.open("w")

    def write(self, rec: dict[str, Any]) -> None:
        import json

        self._f.write(json.dumps(rec, default=str) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _phase(probe: C.Probe, device: Any, fn: Any) -> tuple[dict[str, Any], Any]:
    """Run ``fn`` between a peak reset and a reading; the reading carries the wall time."""
    probe.begin()
    t = time.perf_counter()
    out = fn()
    C.sync(device)
    wall = time.perf_counter() - t
    return {**probe.read(), "wall_s": round(wall, 5)}, out


def evaluate(model: Any, cfg: RunConfig, lens: list[int], vocab: int, device: Any) -> None:
    """Trainer's eval loop without the Trainer: per batch, forward under no_grad, keep (loss, logits)."""
    import torch

    gen = torch.Generator().manual_seed(cfg.eval_seed)
    model.eval()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        for i in range(0, len(lens), cfg.eval_batch):
            batch = make_batch(lens[i : i + cfg.eval_batch], vocab, gen, device)
            out = model(**batch)
            kept = (out.loss.detach(), out.logits)  # prediction_step returns (loss, logits, labels)
            del out, kept, batch
    model.train()


def generate(model: Any, cfg: RunConfig, vocab: int, device: Any) -> None:
    import torch

    gen = torch.Generator().manual_seed(cfg.eval_seed + 1)
    prompt = torch.randint(3, vocab, (cfg.gen_batch, cfg.gen_prompt_len), generator=gen).to(device)
    model.eval()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=cfg.gen_new_tokens,
            min_new_tokens=cfg.gen_new_tokens,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
        )
    model.train()


def run(cfg: RunConfig, device_name: str, smoke: bool, path: Path) -> None:
    """One whole run in this process, written line by line to ``path``."""
    import torch

    device = torch.device(device_name)
    deadline = C.Deadline(cfg.budget_s)
    rec = Recorder(path)
    rec.write(
        {
            "kind": "header",
            "environment": C.environment(device_name),
            "config": asdict(cfg),
            "model_config": C.model_config(cfg.model, smoke),
            "notes": "per-step peaks after reset_peak_memory_stats at the step start; lengths in lengths.json",
        }
    )
    lens = lengths_record(cfg)
    train_lens, eval_lens = lens["train_lengths"], lens["eval_lengths"]
    torch.manual_seed(cfg.seed)
    data_gen = torch.Generator().manual_seed(cfg.seed)
    probe = C.Probe(device)
    hi_reserved = {"step": None, "max_reserved": -1}
    longest = {"step": None, "padded_len": -1}
    status, error = "ok", None
    steps_done = 0
    with probe:
        try:
            probe.begin()
            t = time.perf_counter()
            model = C.build_model(
                cfg.model, device, method=cfg.method, lora_rank=cfg.lora_rank, attn=cfg.attn, smoke=smoke
            )
            if device.type == "cuda":
                torch.cuda.empty_cache()  # drop the random-init transients a real from_pretrained lacks
            vocab = int(model.config.vocab_size)
            params = [p for p in model.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(params, lr=cfg.lr, foreach=True)
            rec.write(
                {
                    "kind": "load",
                    **probe.read(),
                    "wall_s": round(time.perf_counter() - t, 3),
                    "params": sum(p.numel() for p in model.parameters()),
                    "trainable_params": sum(p.numel() for p in params),
                }
            )
            C.log(f"model built; {len(train_lens) // cfg.micro_batch} steps to run")

            def step_fn(batch: dict[str, Any]) -> float:
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = model(**batch).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return float(loss.detach())

            for step in range(1, cfg.steps + 1):
                if deadline.left() <= 0:
                    status = "truncated"
                    C.log(f"time budget spent after {steps_done} steps")
                    break
                lens_b = train_lens[(step - 1) * cfg.micro_batch : step * cfg.micro_batch]

                def one_step(lens_b: list[int] = lens_b) -> float:
                    # The batch is built and moved inside the phase, as a DataLoader's batch would arrive.
                    return step_fn(make_batch(lens_b, vocab, data_gen, device))

                reading, loss = _phase(probe, device, one_step)
                steps_done = step
                L = max(lens_b)
                rec.write(
                    {
                        "kind": "step",
                        "step": step,
                        "batch": [len(lens_b), L],
                        "tokens": sum(lens_b),
                        "loss": round(loss, 4),
                        **reading,
                    }
                )
                if reading["max_reserved"] > hi_reserved["max_reserved"]:
                    hi_reserved = {"step": step, "max_reserved": reading["max_reserved"], "padded_len": L}
                if longest["padded_len"] < L:
                    longest = {"step": step, "padded_len": L, "max_reserved": reading["max_reserved"]}
                if step % 25 == 0 or step == 1:
                    C.log(
                        f"step {step}: batch {len(lens_b)}x{L} peak reserved "
                        f"{reading['max_reserved'] / C.GIB:.2f} GiB, {reading['wall_s']:.3f} s"
                    )
                if cfg.eval_every and step % cfg.eval_every == 0:
                    r_eval, _ = _phase(probe, device, lambda: evaluate(model, cfg, eval_lens, vocab, device))
                    rec.write(
                        {
                            "kind": "eval",
                            "after_step": step,
                            "batches": [[cfg.eval_batch, L2] for L2 in lens["eval_batch_padded_len"]],
                            **r_eval,
                        }
                    )
                    r_gen, _ = _phase(probe, device, lambda: generate(model, cfg, vocab, device))
                    rec.write(
                        {
                            "kind": "generate",
                            "after_step": step,
                            "batch": [cfg.gen_batch, cfg.gen_prompt_len],
                            "new_tokens": cfg.gen_new_tokens,
                            **r_gen,
                        }
                    )
                    C.log(
                        f"eval+generate after step {step}: eval peak reserved "
                        f"{r_eval['max_reserved'] / C.GIB:.2f} GiB, generate {r_gen['max_reserved'] / C.GIB:.2f} GiB"
                    )
        except Exception as exc:  # noqa: BLE001 - an OOM (or any failure) ends the run as a record
            status = "oom" if C.is_oom(exc) else "error"
            error = f"{type(exc).__name__}: {exc}"[:3000]
            C.log(f"run ended by {error[:200]}")
    final = probe.read()
    rec.write(
        {
            "kind": "summary",
            "status": status,
            "error": error,
            "steps_done": steps_done,
            "high_water_reserved": hi_reserved,
            "longest_batch": longest,
            "final": final,
            "wall_s": round(deadline.elapsed(), 2),
        }
    )
    rec.close()


def main() -> int:
    args = C.parse_args(
        __doc__,
        [
            ("--run", {"choices": ("main", "expandable"), "help": "(internal) run one run in this process"}),
            ("--steps", {"type": int, "default": None, "help": "optimizer steps (default 200; 100 expandable)"}),
            ("--budget", {"type": float, "default": None, "help": "(internal) seconds for the step loop"}),
        ],
    )
    cfg = RunConfig(**SMOKE) if args.smoke else RunConfig()
    if args.run is not None:
        steps = args.steps or (cfg.steps if args.run == "main" else max(1, cfg.steps // 2))
        cfg = replace(cfg, steps=steps, budget_s=args.budget or cfg.budget_s)
        name = "whole_run.jsonl" if args.run == "main" else "whole_run_expandable.jsonl"
        run(cfg, args.device, args.smoke, args.out / name)
        return 0

    deadline = C.Deadline(TOTAL_BUDGET_S)
    args.out.mkdir(parents=True, exist_ok=True)
    C.write_json(args.out / "lengths.json", lengths_record(replace(cfg, steps=args.steps or cfg.steps)))
    C.log(f"wrote {args.out / 'lengths.json'}")
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    plans = [
        ("main", args.steps or cfg.steps, 150.0, env),
        (
            "expandable",
            max(1, (args.steps or cfg.steps) // 2),
            60.0,
            {**env, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
        ),
    ]
    for name, steps, budget, child_env in plans:
        # Model build + evals + process start cost ~30 s beyond the step loop; keep a margin for the kill.
        left = deadline.left() - 10
        if left < 30:
            C.log(f"skip the {name} run: {left:.0f} s left")
            continue
        budget = min(budget, left - 35)
        cmd = C.child_command(__file__, args, "--run", name, "--steps", str(steps), "--budget", f"{budget:.0f}")
        C.log(f"{name} run: {steps} steps, loop budget {budget:.0f} s")
        try:
            rc = subprocess.run(cmd, env=child_env, timeout=left).returncode
            C.log(f"{name} run exit code {rc}")
        except subprocess.TimeoutExpired:
            C.log(f"{name} run killed after {left:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
