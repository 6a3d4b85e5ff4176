"""Guard for speed work on the instant path: the ledgers of a few hundred random CLI setups, byte for byte against
another checkout's (a change meant to make ``estimate`` faster must change no figure, label, source or warning).

Each setup is a random ``vramledger estimate`` command line (a catalog model; full, freeze, LoRA, QLoRA or DoRA,
other PEFT methods from an adapter_config.json, modules_to_save; precision, optimizer, checkpointing, attention, loss;
batch 1-16, length 64-16384, packing; a preset; one GPU or DDP, ZeRO 0-3, FSDP 1/2 with offload; evaluation and
generation; LitGPT's code; images; a GPU for the verdict), drawn with a fixed seed. Each is parsed and
resolved as the CLI does, and its ``--json`` ledger (or its ``error:`` line) is hashed. The setups run in one
process, as a planner's estimates do, so a memo keyed too loosely shows up as a difference; ``--against`` also runs
this checkout's in reverse order.

    PYTHONPATH=src python bench/estimate_check.py --against /path/to/main/src   # compare (exit 1 on a difference)
    PYTHONPATH=src python bench/estimate_check.py --dump ledgers.txt             # one line per setup: hash and argv

Another checkout's ``src`` at a commit: ``git archive COMMIT src | tar -x -C /tmp/base`` (then ``/tmp/base/src``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GPUS = ("rtx-4090", "a100-80gb", "h100-sxm", "l4", "24GiB")
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adamw_8bit", "paged_adamw_8bit", "adafactor", "sgd")
PRECISIONS = ("bf16-mixed", "fp16-mixed", "bf16-true", "fp32")
LOSSES = ("standard", "standard", "standard", "fused", "chunked", "chunked_nll")
ATTENTION = ("sdpa", "sdpa", "eager", "flash_attention_2")
PEFT_CONFIGS = {  # written once into CONFIG_DIR (the same paths in every checkout's run)
    "ia3": {"peft_type": "IA3", "task_type": "CAUSAL_LM"},
    "prefix": {"peft_type": "PREFIX_TUNING", "task_type": "CAUSAL_LM", "num_virtual_tokens": 20},
    "prompt": {"peft_type": "PROMPT_TUNING", "task_type": "CAUSAL_LM", "num_virtual_tokens": 10},
    "loha": {"peft_type": "LOHA", "r": 4, "target_modules": ["q_proj", "v_proj", "o_proj"]},
}
CONFIG_DIR = Path(tempfile.gettempdir()) / "vramledger-estimate-check"


def setups(count: int, seed: int) -> list[list[str]]:
    """``count`` random ``estimate`` command lines (without the command), the same for a seed in every checkout."""
    from vramledger.catalog import model_entries, resolve_model

    rng = random.Random(seed)
    models = sorted(model_entries())
    vision = {name for name in models if resolve_model(name).vision is not None}
    return [_setup(rng, models, vision) for _ in range(count)]


def _setup(rng: random.Random, models: list[str], vision_models: set[str]) -> list[str]:
    model = rng.choice(sorted(vision_models) if rng.random() < 0.1 else models)  # images asked of more of them
    argv = [model, "--json", "--gpu", rng.choice(GPUS)]
    argv += ["--preset", rng.choice(("none", "none", "llamafactory", "hf", "trl"))]
    method = rng.choice(("full", "freeze", "lora", "lora", "qlora", "dora"))
    argv += ["--method", "lora" if method == "dora" else method]
    if method == "dora":
        argv.append("--dora")
    if method in ("lora", "qlora") and rng.random() < 0.1:
        argv += ["--peft-config", str(CONFIG_DIR / f"{rng.choice(sorted(PEFT_CONFIGS))}.json")]
    elif method in ("lora", "qlora", "dora"):
        argv += ["--lora-rank", str(rng.choice((4, 8, 16, 64)))] if rng.random() < 0.5 else []
        argv += ["--modules-to-save", rng.choice(("lm_head", "embed_tokens,lm_head"))] if rng.random() < 0.1 else []
    if method == "qlora" and rng.random() < 0.3:
        argv += ["--quant", rng.choice(("nf4", "fp4", "int8"))]
        argv += ["--legacy-bitsandbytes"] if rng.random() < 0.3 else []
    if method == "freeze":
        argv += ["--freeze-layers", str(rng.choice((1, 2, 4)))]
    argv += ["--precision", rng.choice(PRECISIONS), "--optimizer", rng.choice(OPTIMIZERS)]
    argv += ["--attn", rng.choice(ATTENTION), "--loss", rng.choice(LOSSES)]
    argv.append(rng.choice(("--grad-ckpt", "--no-grad-ckpt")))
    argv += ["--batch", str(rng.randint(1, 16)), "--seq", str(int(2 ** rng.uniform(6, 14)))]
    if rng.random() < 0.3:
        argv.append("--packing")
    if rng.random() < 0.2:
        argv += ["--accum", str(rng.choice((2, 4)))]
    if rng.random() < 0.15:
        argv += ["--eval-batch", str(rng.randint(1, 16)), "--eval-logits", rng.choice(("none", "full", "argmax"))]
        if rng.random() < 0.3:
            argv += ["--predict-with-generate", "--max-new-tokens", str(rng.choice((16, 128)))]
    if rng.random() < 0.1:
        argv += ["--model-code", rng.choice(("litgpt", "lit-gpt-2023"))]
    if model in vision_models and rng.random() < 0.5:
        argv += ["--images", str(rng.randint(1, 2))]
    argv += _distributed(rng)
    return argv


def _distributed(rng: random.Random) -> list[str]:
    world = rng.choice((1, 1, 1, 2, 4, 8))
    if world == 1:
        return []
    argv = ["--world-size", str(world)]
    engine = rng.choice(("ddp", "zero", "zero", "fsdp", "fsdp"))
    if engine == "zero":
        argv += ["--zero", str(rng.randint(0, 3))]
    elif engine == "fsdp":
        argv += ["--fsdp", rng.choice(("full_shard", "shard_grad_op", "hybrid_shard", "no_shard"))]
        argv += ["--fsdp-version", rng.choice(("1", "2"))]
    if engine != "ddp" and rng.random() < 0.3:
        argv += ["--offload", rng.choice(("optimizer", "param"))]
    return argv


def ledger_text(argv: list[str]) -> str:
    """What ``vramledger estimate ARGV`` prints with ``--json`` (its ``error:`` line for a refused setup)."""
    from vramledger.cli import build_parser, parse
    from vramledger.cli.common import resolve_inputs
    from vramledger.cli.estimate import train_ledger
    from vramledger.errors import VramledgerError
    from vramledger.report.json_out import dumps

    try:
        args = parse(build_parser(), ["estimate", *argv])
        return dumps(train_ledger(resolve_inputs(args)))
    except VramledgerError as e:
        return f"error: {e}"


def digests(argvs: list[list[str]]) -> list[str]:
    """One line per setup, in the order given: the SHA-256 of its ledger's text, ``ledger`` or ``error``, its argv."""
    out = []
    for argv in argvs:
        text = ledger_text(argv)
        kind = "error" if text.startswith("error:") else "ledger"
        out.append(f"{hashlib.sha256(text.encode()).hexdigest()} {kind} {' '.join(argv)}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=400, help="setups drawn (default 400)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dump", type=Path, help="write the lines of this checkout to FILE ('-': stdout)")
    ap.add_argument("--against", type=Path, help="another checkout's src: compare its ledgers with this one's")
    args = ap.parse_args()
    CONFIG_DIR.mkdir(exist_ok=True)
    for name, cfg in PEFT_CONFIGS.items():
        (CONFIG_DIR / f"{name}.json").write_text(json.dumps(cfg))
    argvs = setups(args.count, args.seed)
    if args.dump is not None:
        lines = "\n".join(digests(argvs)) + "\n"
        sys.stdout.write(lines) if str(args.dump) == "-" else args.dump.write_text(lines)
    if args.against is None:
        return 0
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(args.against)}
    cmd = [sys.executable, __file__, "--count", str(args.count), "--seed", str(args.seed), "--dump", "-"]
    theirs = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout.splitlines()
    ours = digests(argvs)
    reverse = digests(argvs[::-1])[::-1]  # in the other order: what a memo keyed too loosely would change
    refused = sum(1 for line in ours if line.split(" ", 2)[1] == "error")
    differ = [(t, o, r) for t, o, r in zip(theirs, ours, reverse, strict=True) if not t == o == r]
    for t, o, r in differ[:10]:
        print(f"DIFFERS: {t.split(' ', 1)[1]}\n  theirs {t[:16]}  ours {o[:16]}  ours reversed {r[:16]}")
    print(
        f"{len(argvs)} setups (seed {args.seed}; {refused} refused with an error line, compared too): "
        f"{len(argvs) - len(differ)} identical, {len(differ)} differ ({time.perf_counter() - t0:.0f} s)"
    )
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
