"""PyTorch's CUDA caching-allocator settings (``PYTORCH_CUDA_ALLOC_CONF``) and its size rules.

What is modelled is torch 2.13's native caching allocator. Sources (upstream, read for this module):
``c10/core/AllocatorConfig.h`` (shipped in the torch 2.13.0 wheel under ``torch/include``: the constants and
the config keys), ``c10/core/AllocatorConfig.cpp`` (``AcceleratorAllocatorConfig::parseArgs`` and its
``parse*`` helpers: accepted values and their limits), ``c10/cuda/CUDAAllocatorConfig.h`` (the CUDA-only
keys) and ``c10/cuda/CUDACachingAllocator.cpp`` (``round_size``, ``roundup_power2_next_division``,
``get_allocation_size``). The ``.cpp`` files were read from the pytorch main branch of the same era as 2.13
(its headers match the 2.13 wheel's: ``large_segment_size``, ``max_non_split_rounding_size``,
``per_process_memory_fraction``); no 2.13-tagged copy of the ``.cpp`` was available offline.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramledger.errors import VramledgerError

MiB = 2**20

# c10/core/AllocatorConfig.h (torch 2.13): the allocator's fixed sizes.
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: "all sizes are rounded to at least 512 bytes"
K_SMALL_SIZE = 1 * MiB  # kSmallSize: "largest 'small' allocation is 1 MiB"
K_SMALL_BUFFER = 2 * MiB  # kSmallBuffer: "'small' allocations are packed in 2 MiB blocks"
K_MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: "allocations between 1 and 10 MiB may use kLargeBuffer"
K_ROUND_LARGE = 2 * MiB  # kRoundLarge: "round up large allocations to 2 MiB"
K_LARGE_BUFFER = 20 * MiB  # large_segment_size_ default (kLargeBuffer): "20 MB by default"

# c10/core/AllocatorConfig.cpp: roundup_power2_divisions has 16 power-of-two intervals, 1 MiB to 64 GiB.
_ROUNDUP_INTERVALS = 16
_ROUNDUP_START_LOG2 = 20  # kRoundUpPowerOfTwoStart = 1 MB

# Keys of AcceleratorAllocatorConfig::getMutableKeys() and CUDAAllocatorConfig::getKeys() (torch 2.13).
_MODELLED_KEYS = (
    "large_segment_size_mb",
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "expandable_segments",
    "per_process_memory_fraction",
    "backend",
)
# Accepted by torch but without effect on device-memory accounting (host pinned memory, locking, graphs).
_IGNORED_KEYS = (
    "pinned_use_background_threads",
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "release_lock_on_hipmalloc",
    "pinned_use_hip_host_register",
    "graph_capture_record_stream_reuse",
    "pinned_reserve_segment_size_mb",
    "pinned_num_register_threads",
    "pinned_free_catch_all",
    "throw_on_cudamalloc_oom",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class AllocatorConf:
    """The caching-allocator settings that change how much memory is reserved. Defaults are torch's."""

    expandable_segments: bool = False
    """``expandable_segments:True``: one growing segment per pool, mapped in pages (Note [Expandable
    Segments] in CUDACachingAllocator.cpp)."""
    max_split_size_bytes: int | None = None
    """``max_split_size_mb``: blocks this large or larger are never split (``None``: unlimited, the
    default)."""
    max_non_split_rounding_bytes: int | None = None
    """``max_non_split_rounding_mb``: how much larger than an oversize request a cached oversize block may be
    (``None``: equal to the large segment size, as ``AcceleratorAllocatorConfig::parseArgs`` sets it)."""
    garbage_collection_threshold: float = 0.0
    """``garbage_collection_threshold``: fraction of the allowed memory above which old cached blocks are
    freed. Only active with a memory fraction below 1 (``malloc`` checks ``allowed_memory_maximum``)."""
    large_segment_size_bytes: int = K_LARGE_BUFFER
    """``large_segment_size_mb``: segment size for 1-10 MiB requests and page size of large expandable
    segments."""
    roundup_power2_divisions: tuple[int, ...] = (0,) * _ROUNDUP_INTERVALS
    """``roundup_power2_divisions``: divisions per power-of-two interval (1 MiB ... 64 GiB); 0 disables."""
    per_process_memory_fraction: float = 1.0
    """``per_process_memory_fraction``: cap on reserved memory as a fraction of the device total."""
    ignored_keys: tuple[str, ...] = ()
    """Keys given that torch accepts but that do not change device-memory accounting (a caller may warn)."""
    text: str = ""
    """The string this was parsed from, as given."""

    def __post_init__(self) -> None:
        if self.max_split_size_bytes is not None and self.max_split_size_bytes < self.large_segment_size_bytes:
            raise VramledgerError(
                f"alloc conf: max_split_size_mb must be >= {self.large_segment_size_bytes // MiB} "
                "(the large segment size); raise it or leave it unset"
            )
        if self.large_segment_size_bytes <= K_MIN_LARGE_ALLOC or self.large_segment_size_bytes % MiB:
            raise VramledgerError("alloc conf: large_segment_size_mb must be a whole number of MiB above 10")
        if not 0.0 <= self.garbage_collection_threshold < 1.0:
            raise VramledgerError("alloc conf: garbage_collection_threshold must be in (0.0, 1.0)")
        if not 0.0 <= self.per_process_memory_fraction <= 1.0:
            raise VramledgerError("alloc conf: per_process_memory_fraction must be in [0.0, 1.0]")
        if len(self.roundup_power2_divisions) != _ROUNDUP_INTERVALS:
            raise VramledgerError(f"alloc conf: roundup_power2_divisions needs {_ROUNDUP_INTERVALS} entries")

    @property
    def max_split_size(self) -> int:
        """``max_split_size()`` with "unlimited" as a number larger than any request."""
        return self.max_split_size_bytes if self.max_split_size_bytes is not None else 1 << 63

    @property
    def max_non_split_rounding(self) -> int:
        if self.max_non_split_rounding_bytes is not None:
            return self.max_non_split_rounding_bytes
        return self.large_segment_size_bytes


DEFAULT_CONF = AllocatorConf()


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _tokenize(text: str) -> list[str]:
    """ConfigTokenizer (c10/core/AllocatorConfig.h): split on , : [ ] keeping them; whitespace is dropped."""
    out: list[str] = []
    buf = ""
    for ch in text:
        if ch in ",:[]":
            if buf:
                out.append(buf)
                buf = ""
            out.append(ch)
        elif not ch.isspace():
            buf += ch
    if buf:
        out.append(buf)
    return out


def _int_mb(key: str, value: str, minimum: int, *, strict: bool = False) -> int:
    if not value.isdigit():
        raise VramledgerError(f"alloc conf: {key} needs a whole number of MiB, got {value!r}")
    mb = int(value)
    if mb < minimum or (strict and mb == minimum):
        bound = f"> {minimum}" if strict else f">= {minimum}"
        raise VramledgerError(f"alloc conf: {key} too small ({mb}); it must be {bound}")
    return mb * MiB


def _fraction(key: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise VramledgerError(f"alloc conf: {key} needs a number, got {value!r}") from None


def _bool(key: str, value: str) -> bool:
    # ConfigTokenizer::toBool accepts exactly "True" and "False".
    if value == "True":
        return True
    if value == "False":
        return False
    raise VramledgerError(f"alloc conf: {key} must be True or False (torch accepts only these spellings)")


def _roundup_divisions(tokens: list[str]) -> tuple[int, ...]:
    """AcceleratorAllocatorConfig::parseRoundUpPower2Divisions: ``4`` or ``[64:8,256:4,>:1]`` (sizes in
    MB)."""
    divs = [0] * _ROUNDUP_INTERVALS
    if tokens[0] != "[":
        if len(tokens) != 1 or not tokens[0].isdigit() or not _is_pow2(int(tokens[0])):
            raise VramledgerError("alloc conf: roundup_power2_divisions must be a power of 2 or a [size:div,...] list")
        return (int(tokens[0]),) * _ROUNDUP_INTERVALS
    if tokens[-1] != "]":
        raise VramledgerError("alloc conf: roundup_power2_divisions list lacks its closing ']'")
    items = tokens[1:-1]
    # Entries are "size : divisions" triples separated by ",".
    if (
        len(items) % 4 != 3
        or any(items[k] != ":" for k in range(1, len(items), 4))
        or any(items[k] != "," for k in range(3, len(items), 4))
    ):
        raise VramledgerError("alloc conf: roundup_power2_divisions entries must read [size:div,size:div,...]")
    first, last_index = True, 0
    for k in range(0, len(items), 4):
        boundary, value = items[k], items[k + 2]
        if not value.isdigit() or not (int(value) == 0 or _is_pow2(int(value))):
            raise VramledgerError("alloc conf: roundup_power2_divisions divisions must be 0 or a power of 2")
        div = int(value)
        if boundary == ">":
            for j in range(last_index + 1, _ROUNDUP_INTERVALS):
                divs[j] = div
            continue
        if not boundary.isdigit() or not _is_pow2(int(boundary)):
            raise VramledgerError("alloc conf: roundup_power2_divisions sizes must be powers of 2 (in MB)")
        index = min(int(boundary).bit_length() - 1, _ROUNDUP_INTERVALS - 1)
        if first:
            for j in range(index):
                divs[j] = div
            first = False
        divs[index] = div
        last_index = index
    return tuple(divs)


def parse_alloc_conf(text: str) -> AllocatorConf:
    """Parse a ``PYTORCH_CUDA_ALLOC_CONF`` string the way torch 2.13 does.

    >>> parse_alloc_conf("expandable_segments:True,max_split_size_mb:128").max_split_size_bytes
    134217728

    Unknown keys and values torch would reject raise :class:`VramledgerError`; keys torch accepts that do not
    affect device memory (pinned-memory and locking options) are kept in ``ignored_keys``.
    """
    tokens = _tokenize(text)
    pairs: list[tuple[str, list[str]]] = []
    i = 0
    while i < len(tokens):
        key = tokens[i]
        if key in ",:[]":
            raise VramledgerError(f"alloc conf: expected a key at {key!r} in {text!r}; write key:value,key:value")
        j = i + 2
        if j >= len(tokens) or tokens[i + 1] != ":":
            raise VramledgerError(f"alloc conf: key {key!r} has no value; write {key}:VALUE")
        if tokens[j] == "[":
            end = j
            while end < len(tokens) and tokens[end] != "]":
                end += 1
            value = tokens[j : end + 1]
            j = end + 1
        else:
            value = [tokens[j]]
            j += 1
        pairs.append((key, value))
        if j < len(tokens):
            if tokens[j] != ",":
                raise VramledgerError(f"alloc conf: expected ',' after {key}:{''.join(value)} in {text!r}")
            j += 1
        i = j

    known = set(_MODELLED_KEYS) | set(_IGNORED_KEYS)
    for key, _ in pairs:
        if key not in known:
            raise VramledgerError(f"alloc conf: unrecognized key {key!r}; known keys: {', '.join(sorted(known))}")
    # parseArgs reads large_segment_size_mb first: it bounds max_split_size_mb and max_non_split_rounding_mb.
    large = K_LARGE_BUFFER
    for key, value in pairs:
        if key == "large_segment_size_mb":
            large = _int_mb(key, value[0], K_MIN_LARGE_ALLOC // MiB, strict=True)
    kwargs: dict[str, object] = {"large_segment_size_bytes": large}
    ignored: list[str] = []
    for key, value in pairs:
        v = value[0]
        if key in _IGNORED_KEYS:
            ignored.append(key)
        elif key == "max_split_size_mb":
            kwargs["max_split_size_bytes"] = _int_mb(key, v, large // MiB)
        elif key == "max_non_split_rounding_mb":
            kwargs["max_non_split_rounding_bytes"] = _int_mb(key, v, large // MiB)
        elif key == "garbage_collection_threshold":
            gc = _fraction(key, v)
            if not 0.0 < gc < 1.0:  # parseGarbageCollectionThreshold: "set it in (0.0, 1.0)"
                raise VramledgerError(f"alloc conf: garbage_collection_threshold {v} is invalid; set it in (0.0, 1.0)")
            kwargs["garbage_collection_threshold"] = gc
        elif key == "roundup_power2_divisions":
            kwargs["roundup_power2_divisions"] = _roundup_divisions(value)
        elif key == "expandable_segments":
            kwargs["expandable_segments"] = _bool(key, v)
        elif key == "per_process_memory_fraction":
            frac = _fraction(key, v)
            if not 0.0 <= frac <= 1.0:
                raise VramledgerError(f"alloc conf: per_process_memory_fraction {v} is invalid; set it in [0.0, 1.0]")
            kwargs["per_process_memory_fraction"] = frac
        elif key == "backend" and v != "native":
            raise VramledgerError(
                f"alloc conf: backend:{v} is not modelled (only the native caching allocator); drop the key"
            )
    return AllocatorConf(**kwargs, ignored_keys=tuple(ignored), text=text)  # type: ignore[arg-type]


def round_size(size: int, conf: AllocatorConf = DEFAULT_CONF) -> int:
    """``DeviceCachingAllocator::round_size``: at least 512 B, a multiple of 512 B, or the next power-of-two
    division when ``roundup_power2_divisions`` applies to the size's interval."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    # AcceleratorAllocatorConfig::roundup_power2_divisions(size): interval index from log2(size), 1 MiB first.
    log_size = size.bit_length() - 1
    index = min(max(log_size - _ROUNDUP_START_LOG2, 0), _ROUNDUP_INTERVALS - 1)
    divisions = conf.roundup_power2_divisions[index]
    if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
        return _roundup_power2_next_division(size, divisions)
    return K_MIN_BLOCK_SIZE * ((size + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE)


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: e.g. 1200 with 4 divisions of [1024, 2048) rounds to 1280."""
    if _is_pow2(size):
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    power2_division = power2_floor >> (divisions.bit_length() - 1)
    if power2_division == 0:
        return power2_floor << 1
    floor = size & ~(power2_division - 1)
    return size if floor == size else floor + power2_division


def allocation_size(size: int, conf: AllocatorConf = DEFAULT_CONF) -> int:
    """``get_allocation_size``: the cudaMalloc size for a rounded request that no cached block can serve."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return conf.large_segment_size_bytes
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


__all__ = [
    "AllocatorConf",
    "DEFAULT_CONF",
    "K_LARGE_BUFFER",
    "K_MIN_BLOCK_SIZE",
    "K_MIN_LARGE_ALLOC",
    "K_ROUND_LARGE",
    "K_SMALL_BUFFER",
    "K_SMALL_SIZE",
    "allocation_size",
    "parse_alloc_conf",
    "round_size",
]
