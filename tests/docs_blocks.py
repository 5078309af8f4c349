"""The fenced blocks of the user docs (README.md and docs/*.md), for the tests that keep them true.

The convention the docs follow (every test of the docs reads it from here):
- ```bash, ```sh or ```shell is a COMMAND block; the docs test runs it on CPU unless its info
  string carries ONE marker word after the language: `gpu` (needs an NVIDIA GPU), `cluster` (needs
  Slurm, Kubernetes, Docker/pyxis, several nodes or the network), `long` (too long for CI) or
  `gpu_compile` (compiles for a GPU with JAX's CUDA plugin: run by tests/gpu_compile/test_docs.py
  in `make test`'s gpu_compile session, where the plugin is on PYTHONPATH).
- Everything else a reader should not run (output, synopses with placeholders) is ```text, and
  every fence names its language, so that no block is ambiguous.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]
COMMAND_LANGUAGES = frozenset({"bash", "sh", "shell"})
MARKERS = frozenset({"gpu", "cluster", "long", "gpu_compile"})

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


@dataclasses.dataclass(frozen=True)
class Block:
    path: pathlib.Path
    line: int  # 1-based line of the opening fence
    language: str
    words: tuple[str, ...]  # the info string's words after the language
    body: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    @property
    def is_command(self) -> bool:
        return self.language in COMMAND_LANGUAGES

    @property
    def runs_on_cpu(self) -> bool:
        return self.is_command and not self.words


def doc_files() -> list[pathlib.Path]:
    """README.md and every docs/*.md, in a stable order."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def blocks(path: pathlib.Path) -> list[Block]:
    """The fenced blocks of one Markdown file, in order (an unclosed fence runs to the end)."""
    return _parse(path)[0]


def prose(path: pathlib.Path) -> str:
    """The file with every fenced block (fences included) blanked out: the text a reader sees as
    prose."""
    return "\n".join(_parse(path)[1])


def _parse(path: pathlib.Path) -> tuple[list[Block], list[str]]:
    lines = path.read_text().splitlines()
    outside = list(lines)
    found = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence = opening["fence"]
        info = opening["info"].strip().split()
        end = i + 1
        while end < len(lines) and not re.match(
                rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[end]):
            end += 1
        found.append(Block(path=path, line=i + 1, language=info[0] if info else "",
                           words=tuple(info[1:]), body="\n".join(lines[i + 1:end])))
        outside[i:end + 1] = [""] * len(outside[i:end + 1])
        i = end + 1
    return found, outside


def all_blocks() -> list[Block]:
    return [block for path in doc_files() for block in blocks(path)]
