"""The files the user owns: read them with bounds, and write outputs without ever harming one.

Reading: only regular files (a FIFO would block forever, ``/dev/zero`` never ends), at most ``MAX_CONFIG_BYTES``
(a training config or a ``config.json`` is a few KiB; 64 MiB of YAML took a minute to parse), YAML through
``yaml.SafeLoader`` only, with the alias expansion bounded (a "billion laughs" document is a few hundred bytes
that expand to billions of nodes once anything walks them) and the nesting depth bounded.

Writing (``--html``, ``--png``, ``--write-config``, ``convert --out``): an existing file is refused unless
``--force``; a path that resolves (through symlinks) to one of the command's inputs is refused always; the
bytes go to a temporary file in the same folder that is renamed over the target only once complete, so an
interrupted run leaves either the old file or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from vramledger.errors import VramledgerError
from vramledger.units import MiB, fmt_bytes

MAX_CONFIG_BYTES = 1 * MiB
"""Largest config file read (training configs, DeepSpeed/accelerate configs, model ``config.json``): real ones
are a few KiB, and a MiB of YAML already takes about a second to parse."""
MAX_SCRIPT_BYTES = 4 * MiB
"""Largest training script ``accum-check --script`` reads."""
MAX_NODES = 1_000_000
"""Most YAML/JSON values a config may expand to, aliases counted each time they are used."""
MAX_DEPTH = 200
"""Deepest nesting of mappings and lists in a config."""


# -- reading -------------------------------------------------------------------------------------------------------
def _stat_input(path: Path, what: str) -> os.stat_result:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise VramledgerError(f"{what}: no file at {path}; check the path") from None
    except OSError as exc:
        raise VramledgerError(
            f"{what}: cannot read {path} ({exc.strerror or exc.__class__.__name__}); check the path"
        ) from None
    return st


def read_text(path: Path, what: str = "config", *, max_bytes: int = MAX_CONFIG_BYTES) -> str:
    """The UTF-8 text of a regular file of at most ``max_bytes``; a clear error for anything else.

    >>> read_text(Path("/dev/zero"))
    Traceback (most recent call last):
    vramledger.errors.VramledgerError: config: /dev/zero is not a regular file (a device or pipe); pass a file
    """
    st = _stat_input(path, what)
    if stat.S_ISDIR(st.st_mode):
        raise VramledgerError(f"{what}: {path} is a folder; pass a file")
    if not stat.S_ISREG(st.st_mode):
        raise VramledgerError(f"{what}: {path} is not a regular file (a device or pipe); pass a file")
    if st.st_size > max_bytes:
        raise VramledgerError(
            f"{what}: {path} is {fmt_bytes(st.st_size)}, more than the {fmt_bytes(max_bytes)} a config can be; "
            "pass the training config itself"
        )
    try:
        with open(path, "rb") as fh:
            data = fh.read(max_bytes + 1)
    except OSError as exc:
        raise VramledgerError(
            f"{what}: cannot read {path} ({exc.strerror or exc.__class__.__name__}); check its permissions"
        ) from None
    if len(data) > max_bytes:  # grew while we read it
        raise VramledgerError(f"{what}: {path} is larger than {fmt_bytes(max_bytes)}; pass the config itself")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise VramledgerError(f"{what}: {path} is not UTF-8 text; pass a text file") from None


def _check_json_shape(data: Any, what: str, path: Path) -> None:
    """Bound the nesting (iteratively: a recursive walk would itself overflow)."""
    stack: list[tuple[Any, int]] = [(data, 0)]
    seen = 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        if depth > MAX_DEPTH or seen > MAX_NODES:
            raise VramledgerError(f"{what}: {path} is nested too deeply or too large to be a config; fix the file")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


def _expanded_size(root: Any) -> int:
    """How many values a composed YAML node graph expands to, each alias counted every time it is used.

    Memoised on node identity, iterative (post-order), so a billion-laughs graph costs its node count, not
    its expansion; raises when the expansion or the depth exceeds the bounds.
    """
    import yaml

    size: dict[int, int] = {}
    stack: list[tuple[Any, int, bool]] = [(root, 0, False)]
    while stack:
        node, depth, done = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError("depth")
        if id(node) in size:
            continue
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [x for kv in node.value for x in kv]
        else:
            size[id(node)] = 1
            continue
        if done:
            total = 1 + sum(size[id(c)] for c in children)
            if total > MAX_NODES:
                raise ValueError("size")
            size[id(node)] = total
        else:
            stack.append((node, depth, True))
            stack.extend((c, depth + 1, False) for c in children if id(c) not in size)
    return size[id(root)]


def parse_yaml(text: str, what: str, path: Path) -> Any:
    """``yaml.SafeLoader`` with the alias expansion and the depth bounded before anything is constructed."""
    import yaml

    # libyaml's parser when PyYAML has it (4x faster), with the same safe constructor
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        try:
            _expanded_size(node)
        except ValueError:
            raise VramledgerError(
                f"{what}: {path} expands to more than {MAX_NODES:,} values or {MAX_DEPTH} levels (YAML aliases "
                "used over and over?); a training config is far smaller: fix the file"
            ) from None
        return loader.construct_document(node)
    finally:
        loader.dispose()


def load_mapping_text(text: str, what: str, path: Path) -> Any:
    """Parse config text (JSON for ``.json`` files, else YAML, of which JSON is a subset) with bounds."""
    import yaml

    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
            _check_json_shape(data, what, path)
            return data
        return parse_yaml(text, what, path)
    except json.JSONDecodeError as exc:
        raise VramledgerError(
            f"{what}: {path} is not valid JSON (line {exc.lineno}: {exc.msg}); fix the file"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or exc.__class__.__name__
        raise VramledgerError(f"{what}: {path} is not valid YAML{where}: {problem}; fix the file") from None
    except (RecursionError, MemoryError):
        raise VramledgerError(f"{what}: {path} is nested too deeply or too large to read; fix the file") from None


def load_file(path: Path, what: str = "config") -> Any:
    """A config file's content: ``read_text`` then ``load_mapping_text``."""
    return load_mapping_text(read_text(path, what), what, path)


def user_path(text: str) -> Path:
    """``Path(text).expanduser()``, or the path as given when ``~user`` names no one (expanduser would raise)."""
    try:
        return Path(text).expanduser()
    except (RuntimeError, KeyError, ValueError):
        return Path(text)


def path_exists(text: str) -> bool:
    """``Path(text).expanduser().exists()`` that answers False for names no file can have (too long, NUL)."""
    try:
        return user_path(text).exists()
    except (OSError, ValueError, RuntimeError):
        return False


# -- writing -------------------------------------------------------------------------------------------------------
def _same_file(a: Path, b: Path) -> bool:
    try:
        if a.resolve() == b.resolve():
            return True
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except (OSError, RuntimeError, ValueError):
        return False


def check_output(path: Path, option: str, *, force: bool, inputs: Iterable[Path] = ()) -> None:
    """Refuse an output path that is empty, a folder, one of the inputs (through symlinks too), or, without
    ``force``, an existing file. Call it for every output before writing any."""
    if str(path) in ("", "."):
        raise VramledgerError(f"{option}: the path is empty; name a file")
    for src in inputs:
        if _same_file(path, src):
            raise VramledgerError(
                f"{option}: {path} is the input {src}; vramledger never writes over its inputs: pick another path"
            )
    try:
        exists = os.path.lexists(path)
        is_dir = path.is_dir()
    except (OSError, ValueError) as exc:
        raise VramledgerError(f"{option}: cannot use {path} ({exc}); pick another path") from None
    if is_dir:
        raise VramledgerError(f"{option}: {path} is a folder; name a file")
    if exists and not force:
        raise VramledgerError(f"{option}: {path} exists; pass --force to replace it, or pick another path")


def write_atomic(path: Path, data: bytes | str, option: str) -> Path:
    """Write through a temporary file in the same folder, then rename it over ``path`` (atomic on POSIX).

    A symlink at ``path`` is replaced by the new file; the file it pointed to is left as it was.
    """
    payload = data.encode("utf-8") if isinstance(data, str) else data
    folder = path.parent if str(path.parent) else Path(".")
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name[:40]}.", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        raise VramledgerError(
            f"{option}: cannot write {path} ({exc.strerror or exc.__class__.__name__}); pick another path"
        ) from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return path


def input_paths(values: Sequence[object]) -> list[Path]:
    """The existing files among the command's arguments (config, DeepSpeed/accelerate config, model path)."""
    out = []
    for v in values:
        if v is None or v == "":
            continue
        if path_exists(str(v)):
            out.append(user_path(str(v)))
    return out


def unique_path(path: Path) -> Path:
    """``path``, or ``name.1.ext``, ``name.2.ext``… when it exists: nothing the user has is overwritten."""
    if not path.exists():
        return path
    stem, suffix = path.name.split(".", 1) if "." in path.name else (path.name, "")
    n = 1
    while True:
        candidate = path.with_name(f"{stem}.{n}" + (f".{suffix}" if suffix else ""))
        if not candidate.exists():
            return candidate
        n += 1
