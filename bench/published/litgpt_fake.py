"""What the LitGPT probes share: LitGPT's model code read from a git checkout, and live bytes counted on fake tensors.

- :func:`extract` writes ``{model,config,lora,adapter,adapter_v2,rmsnorm}.py`` of a LitGPT commit into a temporary
  directory (nothing of LitGPT is kept in this tree), with a small ``utils.py`` holding the helpers those files
  import and LitGPT's own ``chunked_cross_entropy`` copied from the commit's ``utils.py`` (its source, read with
  ``ast``; the rest of that file imports Lightning, which is not installed here).
- :class:`LiveBytes` counts what ``torch.cuda.max_memory_allocated`` counts: every storage once, from the op that
  creates it until it is freed, rounded up to the caching allocator's 512-byte blocks (c10/cuda/
  CUDACachingAllocator.cpp ``round_size``: ``kMinBlockSize`` = 512), and keeps the peak and what was live at it.

Used by litgpt_layer_probe.py, litgpt_pretrain_probe.py and litgpt_trace.py.
"""

from __future__ import annotations

import ast
import collections
import subprocess
import weakref
from pathlib import Path
from typing import Any

_UTILS = """
import math
from typing import Dict, List, Mapping, Optional, Union

import torch


def find_multiple(n, k):
    return n if n % k == 0 else n + k - (n % k)


def map_old_state_dict_weights(state_dict, mapping, prefix):
    for old, new in mapping.items():
        if prefix + old in state_dict:
            state_dict[prefix + new] = state_dict.pop(prefix + old)
    return state_dict
"""

_FILES = ("model.py", "config.py", "lora.py", "adapter.py", "adapter_v2.py", "rmsnorm.py")


def _git(checkout: Path, *args: str) -> subprocess.CompletedProcess[str]:
    flag = "--git-dir" if (checkout / "HEAD").is_file() and not (checkout / ".git").exists() else "-C"
    return subprocess.run(["git", flag, str(checkout), *args], capture_output=True, text=True)


def _function_source(module_text: str, name: str) -> str:
    """The source of the top-level function ``name`` in ``module_text`` ('' when absent)."""
    for node in ast.parse(module_text).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(module_text, node) or ""
    return ""


def extract(checkout: Path, commit: str, into: Path) -> str:
    """Write LitGPT's package at ``commit`` into ``into``; returns its name (``litgpt``, or ``lit_gpt`` before
    2024-03). ``checkout`` is a work tree or a bare repository (the git mirror)."""
    ls = _git(checkout, "ls-tree", "--name-only", commit)
    if ls.returncode != 0:
        raise FileNotFoundError(f"{checkout}: no commit {commit} ({ls.stderr.strip()})")
    package = "litgpt" if "litgpt" in ls.stdout.split() else "lit_gpt"
    pkg = into / package
    pkg.mkdir()
    for name in _FILES:
        show = _git(checkout, "show", f"{commit}:{package}/{name}")
        if show.returncode == 0:
            text = show.stdout.replace("from lightning_utilities.core.imports import RequirementCache", "")
            text = text.replace('bool(RequirementCache("flash-attn>=2.0.0.post1"))', "False")  # no flash-attn
            (pkg / name).write_text(text)
    init = f"from {package}.model import GPT\nfrom {package}.config import Config\n"
    (pkg / "__init__.py").write_text(init)
    utils = _git(checkout, "show", f"{commit}:{package}/utils.py").stdout
    loss = _function_source(utils, "chunked_cross_entropy")
    # 43c44323 divides by ``max(1, non_masked_elems)``: a real run has at least one target, so ``max`` returns the
    # same 0-d tensor; fake tensors hold no value to compare, so the comparison is dropped (no byte changes).
    loss = loss.replace("max(1, non_masked_elems)", "non_masked_elems")
    (pkg / "utils.py").write_text(_UTILS + "\n\n" + loss + "\n")
    return package


class LiveBytes:
    """A dispatch mode counting live bytes as the CUDA caching allocator's ``allocated`` does (each storage once,
    rounded to 512 B). ``peak`` is the high-water mark; :meth:`largest` groups what was live at it by op, shape and
    dtype. Enter it inside a ``FakeTensorMode`` (it only observes; it allocates nothing itself).
    """

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0
        self._live: dict[int, tuple[int, str]] = {}
        self._at_peak: dict[int, tuple[int, str]] = {}
        self._mode: Any = None

    def _free(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.now -= entry[0]

    def _seen(self, func: Any, out: Any) -> None:
        import torch
        from torch.utils._pytree import tree_leaves

        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self._live:
                continue
            n = -(-storage.nbytes() // 512) * 512
            self._live[key] = (n, f"{func._overloadpacket.__name__} {tuple(t.shape)} {t.dtype}")
            self.now += n
            weakref.finalize(storage, self._free, key)
            if self.now > self.peak:
                self.peak = self.now
                self._at_peak = dict(self._live)

    def __enter__(self) -> LiveBytes:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                out = func(*args, **(kwargs or {}))
                counter._seen(func, out)
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)
        self._mode = None

    def on_resize(self, storage: Any, before: int, nbytes: int) -> None:
        """``storage`` now holds ``nbytes`` (FSDP frees and re-allocates its unsharded flat parameters by resizing
        their storage in place: torch distributed/utils.py ``_free_storage``/``_alloc_storage``); called by
        vramledger's ``trace.distributed.recorded_resizes``, as for its own recorder."""
        key = storage._cdata
        n = -(-nbytes // 512) * 512
        old, what = self._live.get(key, (0, "resize_"))
        if key not in self._live:
            if not n:
                return
            weakref.finalize(storage, self._free, key)
        self._live[key] = (n, what)
        self.now += n - old
        if self.now > self.peak:
            self.peak = self.now
            self._at_peak = dict(self._live)

    def forget(self, t: Any) -> None:
        """Stop counting ``t``'s storage (a tensor a CUDA run keeps on the host, e.g. a non-fused optimizer's
        ``step`` counter)."""
        self._free(t.untyped_storage()._cdata)

    def restart_peak(self) -> None:
        """Make what is live now the peak (the set-up before the measured steps is not measured)."""
        self.peak = self.now
        self._at_peak = dict(self._live)

    def largest(self, n: int = 12) -> list[tuple[int, str]]:
        """The ``n`` largest groups of tensors live at the peak: (bytes, "op shape dtype")."""
        groups: collections.Counter[str] = collections.Counter()
        for size, what in self._at_peak.values():
            groups[what] += size
        return [(size, what) for what, size in groups.most_common(n)]
