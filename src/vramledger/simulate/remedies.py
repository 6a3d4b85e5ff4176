"""The remedies for a late OOM, each measured by the same simulation (same samples, seeds and GPU)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vramledger.allocator.conf import AllocatorConf, parse_alloc_conf
from vramledger.simulate.api import Simulation, capacity_of, simulate
from vramledger.simulate.batching import Order, pad_to
from vramledger.simulate.engine import Replayer
from vramledger.simulate.lengths import Lengths
from vramledger.simulate.schedule import RunSpec
from vramledger.simulate.templates import StepTemplates
from vramledger.specs import GPUSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class RemedyOutcome:
    label: str
    """What changes, in words."""
    setting: str
    """How to set it (the framework's key or the environment variable)."""
    high_water_reserved_bytes: int
    oom_step: int | None
    oom_probability: float


def _conf_with(conf: AllocatorConf, text: str) -> AllocatorConf:
    joined = f"{conf.text},{text}" if conf.text else text
    return parse_alloc_conf(joined)


def _candidates(
    spec: RunSpec, conf: AllocatorConf, samples: list[int], bucket: int
) -> list[tuple[str, str, RunSpec, str | None]]:
    """(label, setting, run spec, extra allocator settings) for each remedy that changes something (padding to
    64 does not when the replay's buckets are already multiples of 64)."""
    out: list[tuple[str, str, RunSpec, str | None]] = []
    cut = sorted(min(x, spec.cutoff) for x in samples)
    p99 = cut[min(len(cut) - 1, int(0.99 * len(cut)))] if cut else spec.cutoff
    lower = pad_to(p99, spec.pad_multiple or 8)
    if lower < spec.cutoff:
        out.append(
            (
                f"cutoff {lower} (the samples' p99)",
                f"cutoff_len: {lower}",
                dataclasses.replace(spec, cutoff=lower),
                None,
            )
        )
    if spec.order is not Order.GROUP_BY_LENGTH and not spec.packing:
        out.append(
            ("group by length", "group_by_length: true", dataclasses.replace(spec, order=Order.GROUP_BY_LENGTH), None)
        )
    if (spec.pad_multiple or 1) < 64 and bucket % 64 and not spec.packing:
        out.append(
            (
                "pad to a multiple of 64",
                "pad_to_multiple_of=64 (data collator)",
                dataclasses.replace(spec, pad_multiple=64),
                None,
            )
        )
    if not spec.packing:
        out.append(("packing", "packing: true", dataclasses.replace(spec, packing=True), None))
    if spec.eval_every and spec.eval_batches and not spec.empty_cache_after_eval:
        out.append(
            (
                "empty_cache after evaluation",
                "torch.cuda.empty_cache() in on_evaluate",
                dataclasses.replace(spec, empty_cache_after_eval=True),
                None,
            )
        )
    if not conf.expandable_segments:
        out.append(
            (
                "expandable segments",
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                spec,
                "expandable_segments:True",
            )
        )
        if conf.max_split_size_bytes is None:
            out.append(
                (
                    "max_split_size_mb 128",
                    "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128",
                    spec,
                    "max_split_size_mb:128",
                )
            )
    return out


def try_remedies(
    templates: StepTemplates,
    lengths: Lengths,
    spec: RunSpec,
    base: Simulation,
    *,
    gpu: GPUSpec | None,
    conf: AllocatorConf,
    seed: int,
    shuffles: int,
    replayer: Replayer | None = None,
) -> list[RemedyOutcome]:
    """Re-simulate the run under each remedy; the order is the list's, results are not ranked."""
    out = []
    for label, setting, rspec, extra in _candidates(spec, conf, list(base.sample_lengths), base.run.bucket):
        rconf = conf if extra is None else _conf_with(conf, extra)
        rep = (
            replayer
            if extra is None
            else Replayer(
                templates,
                conf=rconf,
                capacity_bytes=capacity_of(gpu),
                device_total_bytes=None if gpu is None else gpu.memory_bytes,
            )
        )
        sim = simulate(templates, lengths, rspec, gpu=gpu, conf=rconf, seed=seed, shuffles=shuffles, replayer=rep)
        out.append(
            RemedyOutcome(
                label=label,
                setting=setting,
                high_water_reserved_bytes=sim.run.high_water_reserved_bytes,
                oom_step=sim.run.oom_step,
                oom_probability=sim.oom_probability,
            )
        )
    return out
