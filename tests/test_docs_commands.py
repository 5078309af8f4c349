"""Every command in the docs that can run on CPU is run here, so the docs cannot drift from the
code.

The convention is in tests/docs_blocks.py: ```bash / ```sh / ```shell blocks are commands and run
unless marked `gpu`, `cluster` or `long`; output and synopses are
```text. One test per doc file runs its command blocks in order, each with bash (`set -euo
pipefail`), in one fresh temporary directory (a later block may use what an earlier one wrote), with
`python` on PATH being this interpreter, `$PAXLITE_REPO` the repository root and JAX_PLATFORMS=cpu.
The simulated devices of tests/conftest.py are taken out of the environment: a reader's CPU has one
device. Python writes its bytecode cache as a reader's does (PYTHONDONTWRITEBYTECODE is dropped).

Error transcripts in ```text blocks (a `$ python -m paxlite...` line followed by `paxlite: error:`
lines) are run too: the command must exit 2 and print the documented message, where `...` in the
documented line stands for text left out. Most of them call the same entry point in this process
(tests/in_process.py: the same arguments, the documented environment variables, an empty temporary
working directory), saving an interpreter and JAX start-up each; those whose message depends on
what this process has otherwise (its eight devices, the flags of the modules it has imported) run
as a process of their own (_OWN_PROCESS says which, and why).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shlex
import subprocess
import time

import pytest

from tests.docs_blocks import MARKERS, REPO, Block, all_blocks, blocks, doc_files
from tests.fork_server import paxlite_python
from tests.in_process import Result, paxlite_command, paxlite_main

BLOCK_TIMEOUT_S = 180  # one block; each file's blocks should take well under 30 s on 2 cores
_FORCED_DEVICES = re.compile(r"--xla_force_host_platform_device_count=\S+")


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = _FORCED_DEVICES.sub("", env.get("XLA_FLAGS", "")).strip()
    if not env["XLA_FLAGS"]:
        del env["XLA_FLAGS"]
    env.pop("JAX_NUM_CPU_DEVICES", None)
    env["JAX_PLATFORMS"] = "cpu"
    # A reader's Python caches paxlite's compiled modules; without the cache each of the ~45
    # commands here would compile them again (~0.25 CPU-s a process).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PAXLITE_REPO"] = str(REPO)
    # `python` is this interpreter, as `. .venv/bin/activate` makes it for a reader.
    env["PATH"] = os.pathsep.join([os.path.dirname(paxlite_python()), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
    return env


def _run(script: str, *, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", "set -euo pipefail\n" + script],
        cwd=cwd,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
        check=False,
    )


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.splitlines()[-lines:])


def test_every_fence_names_its_language_and_command_markers_are_known():
    problems = []
    for block in all_blocks():
        if not block.language:
            problems.append(f"{block.where}: fence without a language (```bash for commands, "
                            "```text for output and synopses)")
        elif block.is_command and (len(block.words) > 1 or not set(block.words) <= MARKERS):
            problems.append(f"{block.where}: ```{block.language} {' '.join(block.words)}: a "
                            "command block takes at most one marker, one of "
                            f"{', '.join(sorted(MARKERS))}")
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
            f"--- stdout (end) ---\n{_tail(done.stdout)}\n--- stderr (end) "
            f"---\n{_tail(done.stderr)}")
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


# Transcripts that run as a process of their own, as a reader runs them, with why: what they print
# depends on something this test process has otherwise. The others call the same entry point here.
_OWN_PROCESS = {
    "python -m paxlite.main --fdl_config=Synthetic126M --job_log_dir=job":
        "counts the devices: a reader's CPU has one, this process the eight of tests/conftest.py",
    "python -m paxlite.main --fdl_config=TinySynthetic --fdl.PERCORE_BATCH_SIZE=0.5 "
    "--job_log_dir=job":
        "counts the devices: 0.5 x 8 devices is a whole batch, so this process would see no error",
    "python -m paxlite.main --exp=Pile126M --job_log_dir=job":
        "absl's 'Did you mean' after the documented line names the near flags of every module "
        "imported so far: orbax's in this process, none in a reader's",
}
# Characters bash would expand or read as syntax, where shlex.split would not. Globs are not among
# them: bash leaves a pattern that matches nothing as it is, as it does the mesh shapes [1,1,1] in
# the empty directory these commands run in.
_SHELL_SYNTAX = re.compile(r"[$`~|&;<>(){}\\#]")
_ENTRY_POINTS = ("paxlite.main", "paxlite")  # python -m MODULE: tests/in_process.py calls both
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")


def _environment_and_words(command: str) -> tuple[dict[str, str], list[str]]:
    """`A=1 B=2 python -m ...` -> ({A: 1, B: 2}, [python, -m, ...])."""
    words = shlex.split(command)
    env = {}
    while words and _ASSIGNMENT.fullmatch(words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    return env, words


def _why_own_process(command: str) -> str | None:
    """Why `command` runs as a process of its own; None: it runs in this process."""
    if command in _OWN_PROCESS:
        return _OWN_PROCESS[command]
    if _SHELL_SYNTAX.search(command):
        return "shell syntax, which bash expands"
    env, words = _environment_and_words(command)
    if len(words) < 3 or words[:2] != ["python", "-m"] or words[2] not in _ENTRY_POINTS:
        return "not an entry point tests/in_process.py calls"
    if "ENABLE_TE" in env and importlib.util.find_spec("transformer_engine") is not None:
        return ("Transformer Engine is installed: ENABLE_TE=1's message then depends on JAX's "
                "backend, here the test session's, and the import would load TE into this process")
    return None


def _run_in_process(command: str, *, cwd: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                    capfd: pytest.CaptureFixture) -> Result:
    """`command` (one _why_own_process lets through) by its entry point in this process: the same
    arguments, its environment-variable prefixes set, `cwd` the working directory. The rest of the
    environment is this process's; its XLA_FLAGS are left as they are, so that JAX, if this starts
    it, has the devices of tests/conftest.py as every other test here."""
    env, words = _environment_and_words(command)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(cwd)
    module, args = words[2], words[3:]
    if module == "paxlite":
        return paxlite_command(monkeypatch, capfd)(*args)
    with paxlite_main(monkeypatch, capfd) as run:
        return run(*args)


def test_transcripts_kept_in_their_own_process_are_documented():
    """A transcript edited in the docs would otherwise run in this process unnoticed."""
    documented = {command for _, command, _ in _transcripts()}
    assert not set(_OWN_PROCESS) - documented, (
        f"_OWN_PROCESS names transcripts no longer in the docs: {set(_OWN_PROCESS) - documented}")


@pytest.mark.slow
@pytest.mark.parametrize("block, command, errors", _transcripts(),
                         ids=[f"{b.where}:{c.replace('python -m paxlite.main ', '')[:60]}"
                              for b, c, _ in _transcripts()])
def test_documented_errors_are_what_the_code_prints(block: Block, command: str, errors: list[str],
                                                     tmp_path: pathlib.Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capfd: pytest.CaptureFixture):
    own_process = _why_own_process(command)
    if own_process is None:
        done = _run_in_process(command, cwd=tmp_path, monkeypatch=monkeypatch, capfd=capfd)
    else:
        done = _run(command, cwd=tmp_path)
    how = "in this process" if own_process is None else f"as its own process: {own_process}"
    output = done.stdout + done.stderr
    assert done.returncode == 2, (
        f"{block.where}: `{command}` ({how}) exits {done.returncode}, the docs show a user error "
        f"(exit 2):\n{_tail(output)}")
    for error in errors:
        assert _fragments_in_order(error, output), (
            f"{block.where}: `{command}` ({how}) does not print what the docs say.\n"
            f"documented: {error}\nprinted:\n{_tail(output)}")
