"""Ground truth for two constants the estimator assumes today: the CUDA context's size and training speed.

(a) ``context``, in a fresh child process with ``CUBLAS_WORKSPACE_CONFIG`` removed from its environment:
the device memory in use (NVML, else ``nvidia-smi``; ``torch.cuda.mem_get_info`` once CUDA is up) and the
caching allocator's ``torch.cuda.memory_reserved``/``memory_allocated`` at each point of a CUDA start-up:

  before CUDA init -> ``torch.cuda.init()`` + a 1-byte tensor -> bf16 matmul inputs -> first bf16 matmul
  (cuBLAS handle + workspace) -> bf16 ``F.linear`` with bias (cuBLASLt epilogue) -> SDPA inputs -> first
  ``F.scaled_dot_product_attention`` under ``sdpa_kernel(SDPBackend.FLASH_ATTENTION)`` -> the same under
  ``EFFICIENT_ATTENTION`` -> conv inputs -> first cuDNN ``F.conv2d`` -> ``torch._C._cuda_clearCublasWorkspaces``
  + ``torch.cuda.empty_cache``.

Each point's delta is split into what went through the caching allocator (reserved delta: cuBLAS workspaces
are allocated there) and what the driver holds outside it (device delta - reserved delta: the context,
loaded kernels/modules, library handles).

(b) ``throughput``: tokens/s of training steps (Llama-3.2-1B, Qwen2.5-0.5B; LoRA r16 all-linear and full
fine-tuning; bf16 autocast, AdamW foreach, sdpa) at a few batch x sequence points, with and without gradient
checkpointing (``use_reentrant=False``; the ratio is the recompute overhead), and the cost of gradient
accumulation: the same tokens per optimizer step as 1 x B and as k micro-steps of B/k. Timing:
``torch.cuda.synchronize`` + ``time.perf_counter`` around each optimizer step, 2 warm-up steps, the median
of 3 timed steps (all timed steps are kept).

Writes ``constants.json``: ``{"environment", "context", "throughput"}``. Each part runs in its own child
process (a crash or timeout in one leaves the other).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _common as C

TOTAL_BUDGET_S = 150.0  # run_all.sh kills at 170 s
CONTEXT_TIMEOUT_S = 45.0
WARMUP, TIMED = 2, 3

THROUGHPUT = {
    "models": ["meta-llama/Llama-3.2-1B", "Qwen/Qwen2.5-0.5B"],
    "methods": ["lora", "full"],
    "points": [[4, 512], [8, 1024], [4, 2048]],
    "accum": {"batch": 8, "seq": 1024, "k": [1, 2, 4, 8]},
}
SMOKE_THROUGHPUT = {**THROUGHPUT, "points": [[2, 32], [2, 64]], "accum": {"batch": 4, "seq": 32, "k": [1, 2, 4]}}


# -- (a) the CUDA context ------------------------------------------------------------------------------------


class ContextProbe:
    """Readings of one device: NVML used bytes, driver free/total, the caching allocator's counters."""

    def __init__(self, device: Any) -> None:
        from vramledger.measure import env

        self.env = env
        self.cuda = device.type == "cuda"
        self.baseline_rows = env.gpu_table() if self.cuda else []  # before CUDA init
        self.uuid: str | None = None
        self.points: list[dict[str, Any]] = []

    def _nvml_used(self, rows: list[dict[str, Any]]) -> int | None:
        row = self.env.row_for(rows, self.uuid)
        return None if row is None else int(row["used_bytes"])

    def point(self, name: str, started: bool = True) -> None:
        import torch

        rec: dict[str, Any] = {
            "point": name,
            "nvml_used": None,
            "nvml_source": None,
            "driver_used": None,
            "reserved": None,
            "allocated": None,
        }
        if self.cuda:
            if started:
                torch.cuda.synchronize()
                if self.uuid is None:
                    self.uuid = self.env.torch_uuid(torch.cuda.current_device())
                    base = self._nvml_used(self.baseline_rows)
                    self.points[0]["nvml_used"] = base  # the baseline row, matched now that the uuid is known
                free, total = torch.cuda.mem_get_info()
                rec["driver_used"] = int(total - free)
                rec["reserved"] = int(torch.cuda.memory_reserved())
                rec["allocated"] = int(torch.cuda.memory_allocated())
                rows = self.env.gpu_table()
            else:
                rows = self.baseline_rows
            rec["nvml_used"] = self._nvml_used(rows)
            rec["nvml_source"] = rows[0]["source"] if rows else None
        self.points.append(rec)
        C.log(f"context point {name}: nvml {rec['nvml_used']}, reserved {rec['reserved']}")

    def deltas(self) -> list[dict[str, Any]]:
        """Per point, the change since the previous one, split into allocator and driver-side bytes."""
        out = []
        for prev, cur in zip(self.points, self.points[1:], strict=False):
            d: dict[str, Any] = {"point": cur["point"]}
            for key in ("nvml_used", "driver_used", "reserved", "allocated"):
                a, b = prev[key], cur[key]
                d[f"{key}_delta"] = None if a is None or b is None else b - a
            dev = d["nvml_used_delta"] if d["driver_used_delta"] is None else d["driver_used_delta"]
            d["outside_allocator_delta"] = (
                None if dev is None or d["reserved_delta"] is None else dev - d["reserved_delta"]
            )
            out.append(d)
        return out


def _try(errors: dict[str, str], name: str, fn: Any) -> None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - a backend missing on this GPU is a fact to record
        errors[name] = f"{type(exc).__name__}: {exc}"[:500]
        C.log(f"context step {name} failed: {errors[name][:120]}")


def measure_context(device_name: str) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = torch.device(device_name)
    probe = ContextProbe(device)
    errors: dict[str, str] = {}
    probe.point("before_cuda_init", started=False)
    if device.type == "cuda":
        torch.cuda.init()
    keep = [torch.empty(1, dtype=torch.uint8, device=device)]
    probe.point("init_and_1_byte_tensor")
    bf = torch.bfloat16
    a, b = torch.randn(1024, 1024, dtype=bf, device=device), torch.randn(1024, 1024, dtype=bf, device=device)
    bias = torch.randn(1024, dtype=bf, device=device)
    probe.point("matmul_inputs")
    _try(errors, "bf16_matmul", lambda: keep.append(a @ b))
    probe.point("bf16_matmul")
    _try(errors, "bf16_linear_bias", lambda: keep.append(F.linear(a, b, bias)))
    probe.point("bf16_linear_bias_cublaslt")
    q, k, v = (torch.randn(4, 16, 1024, 64, dtype=bf, device=device) for _ in range(3))
    probe.point("sdpa_inputs")

    def sdpa(backend: Any) -> None:
        with sdpa_kernel(backend):
            keep.append(F.scaled_dot_product_attention(q, k, v, is_causal=True))

    _try(errors, "sdpa_flash", lambda: sdpa(SDPBackend.FLASH_ATTENTION))
    probe.point("sdpa_flash")
    _try(errors, "sdpa_efficient", lambda: sdpa(SDPBackend.EFFICIENT_ATTENTION))
    probe.point("sdpa_efficient")
    x = torch.randn(8, 64, 56, 56, dtype=bf, device=device)
    w = torch.randn(64, 64, 3, 3, dtype=bf, device=device)
    probe.point("conv_inputs")
    _try(errors, "cudnn_conv", lambda: keep.append(F.conv2d(x, w, padding=1)))
    probe.point("cudnn_conv")
    if device.type == "cuda":
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()
        probe.point("cublas_workspaces_cleared_and_empty_cache")
    return {
        "points": probe.points,
        "deltas": probe.deltas(),
        "errors": errors,
        "cudnn_enabled": bool(torch.backends.cudnn.enabled),
        "shapes": {
            "matmul": [1024, 1024, 1024],
            "sdpa_qkv": [4, 16, 1024, 64],
            "conv_x": [8, 64, 56, 56],
            "conv_w": [64, 64, 3, 3],
            "dtype": "bfloat16",
        },
        "notes": "driver_used = mem_get_info total - free (whole device); nvml_used likewise, MiB-granular "
        "under nvidia-smi; outside_allocator_delta = device delta - reserved delta",
    }


# -- (b) throughput ------------------------------------------------------------------------------------------


def _timed_steps(model: Any, opt: Any, ids: Any, k: int, device: Any, probe: C.Probe) -> dict[str, Any]:
    """WARMUP + TIMED optimizer steps of k micro-batches each; the wall time of each timed step."""
    import torch

    times = []
    probe.begin()
    for i in range(WARMUP + TIMED):
        C.sync(device)
        t = time.perf_counter()
        for micro in ids.chunk(k, dim=0) if k > 1 else (ids,):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(input_ids=micro, labels=micro).loss / k
            loss.backward()
            del loss
        opt.step()
        opt.zero_grad(set_to_none=True)
        C.sync(device)
        if i >= WARMUP:
            times.append(time.perf_counter() - t)
    med = statistics.median(times)
    tokens = ids.numel()
    return {
        "step_s": [round(t, 5) for t in times],
        "median_step_s": round(med, 5),
        "tokens_per_step": tokens,
        "tokens_per_s": round(tokens / med, 1),
        "max_reserved": probe.read()["max_reserved"],
    }


def _ids(b: int, L: int, vocab: int, device: Any) -> Any:
    import torch

    return torch.randint(3, vocab, (b, L), generator=torch.Generator().manual_seed(0)).to(device)


def measure_throughput(device_name: str, smoke: bool, deadline: C.Deadline, path: Path) -> None:
    """Every model x method x checkpointing x point, then the accumulation sweep; the file is rewritten
    after each measurement so a killed run keeps what it measured."""
    import torch

    device = torch.device(device_name)
    plan = SMOKE_THROUGHPUT if smoke else THROUGHPUT
    rows: list[dict[str, Any]] = []
    result = {"plan": plan, "warmup": WARMUP, "timed": TIMED, "rows": rows, "complete": False}
    probe = C.Probe(device)

    def record(row: dict[str, Any]) -> None:
        rows.append(row)
        C.write_json(path, result)

    for model_name in plan["models"]:
        for method in plan["methods"]:
            if deadline.left() < 10:
                record({"model": model_name, "method": method, "skipped": "time budget"})
                continue
            try:
                model = C.build_model(model_name, device, method=method, smoke=smoke)
            except Exception as exc:  # noqa: BLE001
                record({"model": model_name, "method": method, "error": f"{type(exc).__name__}: {exc}"[:500]})
                continue
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, foreach=True)
            vocab = model.config.vocab_size
            base = {
                "model": model_name,
                "method": method,
                "params": sum(p.numel() for p in model.parameters()),
                "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
            }
            sweeps: list[tuple[bool, int, int, int]] = [
                (ck, b, L, 1) for ck in (False, True) for b, L in plan["points"]
            ]
            if model_name == plan["models"][0]:
                acc = plan["accum"]
                sweeps += [(False, acc["batch"], acc["seq"], k) for k in acc["k"]]
            for ckpt, b, L, k in sweeps:
                row = {**base, "grad_ckpt": ckpt, "batch": b, "seq": L, "grad_accum": k, "micro_batch": b // k}
                if deadline.left() < 5:
                    record({**row, "skipped": "time budget"})
                    continue
                if ckpt:
                    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                else:
                    model.gradient_checkpointing_disable()
                try:
                    row.update(_timed_steps(model, opt, _ids(b, L, vocab, device), k, device, probe))
                    C.log(f"{model_name} {method} ckpt={ckpt} {b}x{L} k={k}: {row['tokens_per_s']:.0f} tok/s")
                except Exception as exc:  # noqa: BLE001 - an OOM at a large point is a result
                    row["error"] = f"{type(exc).__name__}: {exc}"[:500]
                    row["oom"] = C.is_oom(exc)
                    opt.zero_grad(set_to_none=True)
                    C.log(f"{model_name} {method} ckpt={ckpt} {b}x{L} k={k}: {row['error'][:100]}")
                record(row)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            del model, opt
            if device.type == "cuda":
                torch.cuda.empty_cache()
    result["complete"] = True
    result["derived"] = derive(rows)
    C.write_json(path, result)


def derive(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Checkpointing's slowdown per (model, method, point) and the per-micro-step cost of accumulation."""

    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return (r["model"], r["method"], r.get("batch"), r.get("seq"), r.get("grad_accum"))

    ok = [r for r in rows if "median_step_s" in r]
    plain = {key(r): r for r in ok if not r["grad_ckpt"]}
    ckpt = [
        {
            "model": r["model"],
            "method": r["method"],
            "batch": r["batch"],
            "seq": r["seq"],
            "ckpt_over_plain_time": round(r["median_step_s"] / plain[key(r)]["median_step_s"], 4),
        }
        for r in ok
        if r["grad_ckpt"] and key(r) in plain
    ]
    accum = []
    for r in ok:
        k = r["grad_accum"]
        one = plain.get((r["model"], r["method"], r["batch"], r["seq"], 1))
        if k > 1 and one is not None:
            accum.append(
                {
                    "model": r["model"],
                    "method": r["method"],
                    "batch": r["batch"],
                    "seq": r["seq"],
                    "k": k,
                    "step_s_k": r["median_step_s"],
                    "step_s_1": one["median_step_s"],
                    "overhead_per_extra_micro_step_s": round((r["median_step_s"] - one["median_step_s"]) / (k - 1), 6),
                }
            )
    return {"grad_ckpt": ckpt, "grad_accum": accum}


# -- orchestration -------------------------------------------------------------------------------------------


def main() -> int:
    args = C.parse_args(
        __doc__,
        [
            ("--part", {"choices": ("context", "throughput"), "help": "(internal) run one part here"}),
            ("--budget", {"type": float, "default": 100.0, "help": "(internal) seconds for the throughput part"}),
        ],
    )
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part == "context":
        C.write_json(args.out / "constants_context.json", measure_context(args.device))
        return 0
    if args.part == "throughput":
        measure_throughput(args.device, args.smoke, C.Deadline(args.budget), args.out / "constants_throughput.json")
        return 0

    deadline = C.Deadline(TOTAL_BUDGET_S)
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    parts: dict[str, Any] = {}
    for part in ("context", "throughput"):
        left = deadline.left()
        timeout = min(CONTEXT_TIMEOUT_S, left) if part == "context" else left
        cmd = C.child_command(__file__, args, "--part", part, "--budget", f"{max(10.0, timeout - 25):.0f}")
        C.log(f"part {part} (timeout {timeout:.0f} s)")
        try:
            rc = subprocess.run(cmd, env=env, timeout=timeout).returncode
            C.log(f"part {part} exit code {rc}")
        except subprocess.TimeoutExpired:
            C.log(f"part {part} killed by its timeout")
        f = args.out / f"constants_{part}.json"
        if f.exists():
            parts[part] = json.loads(f.read_text())
            f.unlink()
        else:
            parts[part] = None
    parts_env = C.environment(args.device) if args.device == "cpu" else None
    if args.device == "cuda":
        # Reading the environment needs CUDA; do it in a child so that this process never holds a context.
        code = "import json, _common as C; print(json.dumps(C.environment('cuda'), default=str))"
        try:
            path = os.pathsep.join([str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")])
            out = subprocess.run(
                [sys.executable, "-c", code],
                capture_output=True,
                text=True,
                timeout=60,
                env={**os.environ, "PYTHONPATH": path},
            ).stdout
            parts_env = json.loads(out.strip().splitlines()[-1])
        except Exception as exc:  # noqa: BLE001
            parts_env = {"error": f"{type(exc).__name__}: {exc}"}
    C.write_json(
        args.out / "constants.json",
        {
            "environment": parts_env,
            "config": {
                "throughput": SMOKE_THROUGHPUT if args.smoke else THROUGHPUT,
                "warmup": WARMUP,
                "timed": TIMED,
                "smoke": args.smoke,
                "CUBLAS_WORKSPACE_CONFIG": "removed from the children's environment",
            },
            **parts,
        },
    )
    C.log(f"wrote {args.out / 'constants.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
