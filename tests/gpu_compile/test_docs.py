"""The docs' ```bash gpu_compile blocks (commands that compile for a GPU with JAX's CUDA plugin), run as
tests/test_docs_commands.py runs the others: each file's blocks in order, in one temporary directory, with
this session's PYTHONPATH (which holds the plugin) kept."""

from __future__ import annotations

import pathlib
import subprocess
import time

import pytest

from tests.docs_blocks import REPO, blocks, doc_files
from tests.test_docs_commands import BLOCK_TIMEOUT_S, _run, _tail

pytestmark = pytest.mark.gpu_compile


def _gpu_compile_blocks(path: pathlib.Path):
    return [b for b in blocks(path) if b.is_command and b.words == ("gpu_compile",)]


def _files() -> list[pathlib.Path]:
    return [path for path in doc_files() if _gpu_compile_blocks(path)]


def test_the_docs_have_gpu_compile_commands():
    assert _files(), "no ```bash gpu_compile block in the docs: the GPU compiler's commands are untested"


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(REPO)))
def test_documented_gpu_compile_commands_run(path: pathlib.Path, tmp_path: pathlib.Path):
    for block in _gpu_compile_blocks(path):
        start = time.monotonic()
        try:
            done = _run(block.body, cwd=tmp_path)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{block.where}: still running after {BLOCK_TIMEOUT_S} s")
        assert done.returncode == 0, (
            f"{block.where}: exits {done.returncode} after {time.monotonic() - start:.0f} s:\n"
            f"{block.body}\n--- stdout (end) ---\n{_tail(done.stdout)}\n"
            f"--- stderr (end) ---\n{_tail(done.stderr)}")
