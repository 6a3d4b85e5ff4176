"""Refresh the upstream example corpus from a local clone, and rewrite SOURCES.md.

    python tests/upstream/refresh.py axolotl /path/to/axolotl [--commit REV] [--add examples/x.yaml ...]

Every file already in ``tests/upstream/<framework>/`` is copied again, byte for byte, from ``REV`` (default the
clone's ``HEAD``) at the same relative path, and ``--add`` copies further ones; a file gone upstream is reported
and left for you to remove. SOURCES.md records, per file, the repository, the commit and the git blob id of the
content (``git hash-object``), which ``test_corpus.py`` recomputes, so a file edited by hand is caught. The clone
may be bare. Nothing is downloaded: fetch the clone yourself. Then run ``pytest tests/upstream`` and update the
expectations of the files whose estimate changed.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent


@dataclass(frozen=True)
class Upstream:
    repo: str
    """owner/name on GitHub."""
    licence: str
    """The licence of the repository (its LICENSE file at the commit)."""


UPSTREAMS = {
    "llamafactory": Upstream("hiyouga/LLaMA-Factory", "Apache-2.0"),
    "axolotl": Upstream("axolotl-ai-cloud/axolotl", "Apache-2.0"),
    "trl": Upstream("huggingface/trl", "Apache-2.0"),
    "torchtune": Upstream("pytorch/torchtune", "BSD-3-Clause"),
}


def blob_id(data: bytes) -> str:
    """git's object id of a file's content (``git hash-object``): sha1 of ``blob <size>\\0<content>``."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # noqa: S324 - git's id, not security


def corpus_files(framework: str) -> list[str]:
    root = HERE / framework
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def _git(clone: Path, *args: str) -> bytes:
    return subprocess.run(["git", "-C", str(clone), *args], check=True, capture_output=True).stdout


def refresh(framework: str, clone: Path, rev: str, add: list[str]) -> None:
    commit = _git(clone, "rev-parse", f"{rev}^{{commit}}").decode().strip()
    date = _git(clone, "show", "-s", "--format=%cI", commit).decode().strip()
    for rel in sorted(set(corpus_files(framework)) | set(add)):
        try:
            data = _git(clone, "show", f"{commit}:{rel}")
        except subprocess.CalledProcessError:
            print(f"{framework}/{rel}: not in {UPSTREAMS[framework].repo}@{commit[:12]}; remove it", file=sys.stderr)
            continue
        dest = HERE / framework / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
    stamp = HERE / framework / ".commit"
    stamp.write_text(f"{commit} {date}\n")
    write_sources()


def write_sources() -> None:
    """SOURCES.md from the corpus folders and the commit each was copied from (``<framework>/.commit``)."""
    out = [
        "# Sources of the upstream example corpus",
        "",
        "Verbatim copies of example configs of four fine-tuning frameworks, at the upstream path, taken from the",
        "commit below; `refresh.py` rewrites this file. Blob: the git object id of the content (`git hash-object`),",
        "equal to the upstream file's at that commit (`git ls-tree <commit> <path>`); `test_corpus.py` checks it.",
        "Each folder carries its repository's LICENSE, as both licences ask of copies (Apache-2.0 §4(a), BSD-3-Clause",
        "clause 1).",
        "",
    ]
    for framework, up in UPSTREAMS.items():
        if not (HERE / framework / ".commit").is_file():
            continue
        commit, date = (HERE / framework / ".commit").read_text().split()
        out += [
            f"## {framework}: [{up.repo}](https://github.com/{up.repo})",
            "",
            f"Commit `{commit}` ({date}); licence {up.licence} "
            f"([LICENSE](https://github.com/{up.repo}/blob/{commit}/LICENSE)).",
            "",
            "| path | blob |",
            "|---|---|",
        ]
        for rel in corpus_files(framework):
            data = (HERE / framework / rel).read_bytes()
            out.append(f"| [{rel}](https://github.com/{up.repo}/blob/{commit}/{rel}) | `{blob_id(data)}` |")
        out.append("")
    (HERE / "SOURCES.md").write_text("\n".join(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("framework", choices=sorted(UPSTREAMS))
    p.add_argument("clone", type=Path, help="a local clone (or bare mirror) of the framework's repository")
    p.add_argument("--commit", default="HEAD", help="the revision to copy from (default HEAD)")
    p.add_argument("--add", nargs="*", default=[], help="further upstream paths to add to the corpus")
    args = p.parse_args()
    refresh(args.framework, args.clone, args.commit, args.add)


if __name__ == "__main__":
    main()
