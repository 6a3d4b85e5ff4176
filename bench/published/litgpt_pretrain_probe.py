"""LitGPT's pretraining step (extensions/thunder/pretrain.py ``--compiler null``) run on fake tensors: its peak.

    python bench/published/litgpt_pretrain_probe.py /path/to/litgpt/checkout [--commit 101e31d2] [--accum 128]

The thunder README's eager rows (144, 146, 149; table of 101e31d2, 2024-05-06) ran this loop on TinyLlama 1.1B,
micro-batch 4, block 2048. This probe reads ``litgpt/{model,config}.py`` at ``--commit`` from a git checkout (into a
temporary directory: nothing of LitGPT is kept here), builds ``GPT(Config.from_name("tiny-llama-1.1b"))`` on
PyTorch's fake tensors (no memory, no GPU) and replays one micro-step of ``fit`` as Fabric runs it on one GPU:

- ``fabric.init_module`` / ``HalfPrecision.convert_module``: every parameter and buffer in bf16;
- ``torch.optim.AdamW(..., fused=True)`` with its two states, and, when ``--accum`` > 1, the gradients of the
  earlier micro-steps (``no_backward_sync``: they live through every forward);
- ``forward_and_loss``: ``_FabricModule.forward`` runs the model under ``forward_context`` (bf16 default dtype), then
  ``convert_output`` casts the logits to ``torch.get_default_dtype()`` (fp32: lightning ``fabric/wrappers.py``
  l. 137-148, ``plugins/precision/half.py`` ``convert_output``); ``chunked_cross_entropy(logits, targets,
  chunk_size=0)`` is one ``F.cross_entropy`` (litgpt ``utils.py`` l. 278-282); then ``backward``.

Every allocation (each storage once, rounded to 512 B) is counted while it lives; the peak is printed with its
largest tensors, beside the measured figure and vramledger's estimate of row 149. SDPA is routed as on CUDA
(``trace/shims.py`` ``sdpa_as_cuda``). Not part of the test suite: it needs a LitGPT checkout.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from litgpt_fake import LiveBytes, extract  # noqa: E402  bench/published/litgpt_fake.py


def replay(package: str, *, batch: int, accum: int) -> tuple[int, list[tuple[int, str]]]:
    """(peak live bytes, the largest groups of tensors live at the peak) of one micro-step."""
    import importlib

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramledger.trace.shims import sdpa_as_cuda

    model_mod = importlib.import_module(f"{package}.model")
    config_mod = importlib.import_module(f"{package}.config")
    with FakeTensorMode(), sdpa_as_cuda(), LiveBytes() as live:
        config = config_mod.Config.from_name("tiny-llama-1.1b")
        torch.set_default_dtype(torch.bfloat16)  # fabric.init_module under bf16-true
        model = model_mod.GPT(config)
        torch.set_default_dtype(torch.float32)
        model.cos, model.sin = model.cos.to(torch.bfloat16), model.sin.to(torch.bfloat16)  # convert_module
        params = list(model.parameters())
        optimizer = torch.optim.AdamW(params, lr=4e-4, weight_decay=0.1, betas=(0.9, 0.95), fused=True)
        for p in params:  # the states exist from the first optimizer step on
            optimizer.state[p] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
            if accum > 1:
                p.grad = torch.zeros_like(p)
        data = torch.randint(0, config.padded_vocab_size, (batch, model.max_seq_length + 1))
        input_ids, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        torch.set_default_dtype(torch.bfloat16)  # forward_context
        logits = model(input_ids)
        torch.set_default_dtype(torch.float32)
        logits = logits.to(torch.get_default_dtype())  # convert_output
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        del logits  # forward_and_loss returns the loss only
        (loss / accum).backward()
    return live.peak, live.largest(12)


def estimate_row(row: int) -> float:
    import run  # bench/published/run.py

    (r,) = [r for r in run.load_mapping().rows if r.row == row]
    p = run.predict(r)
    assert p is not None
    return p.allocated / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkout", type=Path, help="a git checkout of Lightning-AI/litgpt")
    ap.add_argument("--commit", default="101e31d2", help="the LitGPT commit to read (default: 101e31d2)")
    ap.add_argument("--batch", type=int, default=4, help="micro-batch (pretrain.py's default: 4)")
    ap.add_argument("--accum", type=int, default=128, help="micro-steps per optimizer step (512 // 4 on 1 GPU)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        package = extract(args.checkout, args.commit, Path(tmp))
        sys.path.insert(0, tmp)
        peak, largest = replay(package, batch=args.batch, accum=args.accum)
    print(f"{package} {args.commit}: TinyLlama 1.1B pretraining step, micro-batch {args.batch}, accum {args.accum}")
    print(f"  peak live bytes on fake tensors: {peak / 1e9:.2f} GB; published (row 149): 29.84 GB; "
          f"vramledger estimate (row 149): {estimate_row(149):.2f} GB")  # fmt: skip
    for n, what in largest:
        print(f"  {n / 1e9:7.3f} GB  {what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
