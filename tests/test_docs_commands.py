"""Every command in the docs that can run on CPU is run here, so the docs cannot drift from the code.

The convention is in tests/docs_blocks.py: ```bash / ```sh / ```shell blocks are commands and run
unless marked `gpu`, `cluster` or `long`; output and synopses are ```text. One test per doc file runs
its command blocks in order, each with bash (`set -euo pipefail`), in one fresh temporary directory
(a later block may use what an earlier one wrote), with `python` on PATH being this interpreter,
`$PAXLITE_REPO` the repository root and JAX_PLATFORMS=cpu. The simulated devices of
tests/conftest.py are taken out of the environment: a reader's CPU has one device.

Error transcripts in ```text blocks (a `$ python -m paxlite...` line followed by `paxlite: error:`
lines) are run too: the command must exit 2 and print the documented message, where `...` in the
documented line stands for text left out.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

from tests.docs_blocks import MARKERS, REPO, Block, all_blocks, blocks, doc_files

BLOCK_TIMEOUT_S = 180  # one block; each file's blocks should take well under 30 s on 2 cores
_FORCED_DEVICES = re.compile(r"--xla_force_host_platform_device_count=\S+")


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = _FORCED_DEVICES.sub("", env.get("XLA_FLAGS", "")).strip()
    if not env["XLA_FLAGS"]:
        del env["XLA_FLAGS"]
    env.pop("JAX_NUM_CPU_DEVICES", None)
    env["JAX_PLATFORMS"] = "cpu"
    env["PAXLITE_REPO"] = str(REPO)
    # `python` is this interpreter, as `. .venv/bin/activate` makes it for a reader.
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
    return env


def _run(script: str, *, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], cwd=cwd, env=_environment(),
                          capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S, check=False)


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.splitlines()[-lines:])


def test_every_fence_names_its_language_and_command_markers_are_known():
    problems = []
    for block in all_blocks():
        if not block.language:
            problems.append(f"{block.where}: fence without a language (```bash for commands, "
                            "```text for output and synopses)")
        elif block.is_command and (len(block.words) > 1 or not set(block.words) <= MARKERS):
            problems.append(f"{block.where}: ```{block.language} {' '.join(block.words)}: a command "
                            f"block takes at most one marker, one of {', '.join(sorted(MARKERS))}")
    assert not problems, "\n".join(problems)


# A line of a ```text block that reads like a complete paxlite command: no synopsis brackets or
# alternatives, no elision, no UPPERCASE placeholder value (=NAME, =DIR, a bare JOB_DIR).
_PAXLITE_LINE = re.compile(r"^\s*(?:[A-Z_]+=\S+\s+)*python -m paxlite\b")
_PLACEHOLDER = re.compile(r"[\[|<]|\.\.\.|=[A-Z][A-Z_]*(?![\w\[])|(?:^|\s)[A-Z][A-Z_]{2,}(?:\s|$)")


def test_text_blocks_hold_no_runnable_paxlite_commands():
    problems = []
    for block in all_blocks():
        if block.language != "text":
            continue
        # A command continued with a backslash is one command: its placeholders may be on any line.
        for offset, line in enumerate(block.body.replace("\\\n", " ").splitlines(), start=1):
            command = line.split("#", 1)[0]
            if command.lstrip().startswith("$ "):
                continue  # a transcript: checked by test_documented_errors_are_what_the_code_prints
            if _PAXLITE_LINE.match(command) and not _PLACEHOLDER.search(command):
                problems.append(f"{block.where}+{offset}: {line.strip()}")
    assert not problems, (
        "runnable-looking commands in ```text blocks: put them in a ```bash block (marked gpu, "
        "cluster or long if they cannot run on CPU) so that this test runs them:\n"
        + "\n".join(problems))


def _files_with_commands() -> list[pathlib.Path]:
    return [path for path in doc_files() if any(b.runs_on_cpu for b in blocks(path))]


@pytest.mark.slow
@pytest.mark.parametrize("path", _files_with_commands(), ids=lambda p: str(p.relative_to(REPO)))
def test_documented_commands_run(path: pathlib.Path, tmp_path: pathlib.Path):
    timings = []
    for block in blocks(path):
        if not block.runs_on_cpu:
            continue
        start = time.monotonic()
        try:
            done = _run(block.body, cwd=tmp_path)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{block.where}: still running after {BLOCK_TIMEOUT_S} s; make it cheaper "
                        "(tiny experiment, --fdl.MAX_STEPS=3) or mark it `long`")
        timings.append(f"{block.where} {time.monotonic() - start:.1f} s")
        assert done.returncode == 0, (
            f"{block.where}: the documented command block exits {done.returncode}:\n{block.body}\n"
            f"--- stdout (end) ---\n{_tail(done.stdout)}\n--- stderr (end) ---\n{_tail(done.stderr)}")
    print("\n".join(timings))


def _transcripts() -> list[tuple[Block, str, list[str]]]:
    """(block, command, documented error lines) for each `$ python -m paxlite...` in ```text."""
    found = []
    for block in all_blocks():
        if block.language != "text":
            continue
        lines = block.body.splitlines()
        for i, line in enumerate(lines):
            if not line.startswith("$ ") or "python -m paxlite" not in line:
                continue
            errors = []
            for following in lines[i + 1:]:
                if following.startswith("$ "):
                    break
                if following.startswith("paxlite: error:"):
                    errors.append(following)
            if errors:
                found.append((block, line[2:].split("  #", 1)[0].strip(), errors))
    return found


def _fragments_in_order(documented: str, actual: str) -> bool:
    position = 0
    for fragment in re.split(r"\s*\(?\.\.\.\)?\s*", documented):
        if not fragment:
            continue
        found = actual.find(fragment, position)
        if found < 0:
            return False
        position = found + len(fragment)
    return True


@pytest.mark.slow
@pytest.mark.parametrize("block, command, errors", _transcripts(),
                         ids=[f"{b.where}:{c.replace('python -m paxlite.main ', '')[:60]}"
                              for b, c, _ in _transcripts()])
def test_documented_errors_are_what_the_code_prints(block: Block, command: str, errors: list[str],
                                                     tmp_path: pathlib.Path):
    done = _run(command, cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 2, (
        f"{block.where}: `{command}` exits {done.returncode}, the docs show a user error (exit 2)"
        f":\n{_tail(output)}")
    for error in errors:
        assert _fragments_in_order(error, output), (
            f"{block.where}: `{command}` does not print what the docs say.\n"
            f"documented: {error}\nprinted:\n{_tail(output)}")
