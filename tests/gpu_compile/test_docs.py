"""The docs' ```bash gpu_compile blocks (commands that compile for a GPU with JAX's CUDA plugin),
run as tests/test_docs_commands.py runs the others: each file's blocks in order, in one temporary
directory, with this session's PYTHONPATH (which holds the plugin) kept.

A block that is one `python -m paxlite ...` command (the plans they all are), or one piped into a
second command, calls paxlite's entry point in this process (tests/in_process.py) and gives its
output to the second command through bash: a process of its own would pay a Python, JAX and CUDA
plugin start-up on top of the same compile. A GPU target is compiled beside the CPU, whatever the
number of CPU devices, so the plan is the one a reader's process makes (its eight simulated devices
are not counted). Any other block runs in bash, as the CPU blocks do."""

from __future__ import annotations

import dataclasses
import pathlib
import shlex
import subprocess
import time

import pytest

from tests.docs_blocks import REPO, Block, blocks, doc_files
from tests.in_process import paxlite_command
from tests.test_docs_commands import _SHELL_SYNTAX, BLOCK_TIMEOUT_S, _environment, _run, _tail

pytestmark = pytest.mark.gpu_compile
_PIPE = " | "


def _gpu_compile_blocks(path: pathlib.Path):
    return [b for b in blocks(path) if b.is_command and b.words == ("gpu_compile",)]


def _files() -> list[pathlib.Path]:
    return [path for path in doc_files() if _gpu_compile_blocks(path)]


def _paxlite_and_pipe(block: Block) -> tuple[list[str], str | None] | None:
    """(the arguments after `python -m paxlite`, the command its output is piped into or None) for
    a block of one such command; None for any other block (it runs in bash)."""
    command = block.body.replace("\\\n", " ").strip()
    if "\n" in command:
        return None
    head, _, piped = command.partition(_PIPE)
    if _SHELL_SYNTAX.search(head):
        return None
    words = shlex.split(head)
    if words[:3] != ["python", "-m", "paxlite"]:
        return None
    return words[3:], piped or None


def test_the_docs_have_gpu_compile_commands():
    assert _files(), ("no ```bash gpu_compile block in the docs: the GPU compiler's commands are "
                      "untested")


def test_a_plan_piped_into_python_is_split_for_this_process():
    block = Block(path=REPO / "docs" / "x.md", line=1, language="bash", words=("gpu_compile",),
                  body="python -m paxlite plan --devices=8 \\\n"
                       "  '--fdl.ICI_MESH_SHAPE=[2,2,2]' \\\n"
                       "  | python -c \"import sys; print(sys.stdin.read())\"")
    assert _paxlite_and_pipe(block) == (
        ["plan", "--devices=8", "--fdl.ICI_MESH_SHAPE=[2,2,2]"],
        "python -c \"import sys; print(sys.stdin.read())\"")
    for body in ("python -m paxlite plan\npython -m paxlite plan", "echo $HOME", "ls | wc"):
        assert _paxlite_and_pipe(dataclasses.replace(block, body=body)) is None, body


def _run_block(block: Block, *, cwd: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
               capfd: pytest.CaptureFixture) -> tuple[int, str, str]:
    """The block's exit status and output (the last command's, as bash with pipefail gives)."""
    split = _paxlite_and_pipe(block)
    if split is None:
        done = _run(block.body, cwd=cwd)
        return done.returncode, done.stdout, done.stderr
    args, piped = split
    monkeypatch.chdir(cwd)
    planned = paxlite_command(monkeypatch, capfd)(*args)
    if planned.returncode != 0 or piped is None:
        return planned.returncode, planned.stdout, planned.stderr
    done = subprocess.run(["bash", "-c", "set -euo pipefail\n" + piped], input=planned.stdout,
                          cwd=cwd, env=_environment(), capture_output=True, text=True,
                          timeout=BLOCK_TIMEOUT_S, check=False)
    return done.returncode, done.stdout, planned.stderr + done.stderr


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(REPO)))
def test_documented_gpu_compile_commands_run(path: pathlib.Path, tmp_path: pathlib.Path,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capfd: pytest.CaptureFixture):
    for block in _gpu_compile_blocks(path):
        start = time.monotonic()
        try:
            returncode, stdout, stderr = _run_block(block, cwd=tmp_path, monkeypatch=monkeypatch,
                                                    capfd=capfd)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{block.where}: still running after {BLOCK_TIMEOUT_S} s")
        assert returncode == 0, (
            f"{block.where}: exits {returncode} after {time.monotonic() - start:.0f} s:\n"
            f"{block.body}\n--- stdout (end) ---\n{_tail(stdout)}\n"
            f"--- stderr (end) ---\n{_tail(stderr)}")
