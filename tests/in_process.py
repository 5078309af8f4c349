"""paxlite's command-line entry points called in the test process, as `python -m ...` runs them.

`python -m paxlite.main FLAGS...` and `python -m paxlite COMMAND ...` cost an interpreter and a JAX
start-up each (about two seconds on 2 cores); the checks that stop before any work (a user's
mistake: one line and exit 2) can call the same entry points here instead, with the same argv,
and get the same exit status and output.

What differs from a fresh process, and what a caller must see to itself:
- this process has the eight fake CPU devices of tests/conftest.py, not one: a message that counts
  devices (a mesh that does not fit, PERCORE_BATCH_SIZE x devices) needs a process of its own;
- absl's "Did you mean" for an unknown flag names near flags of every module imported so far
  (orbax's, after other tests), not only paxlite.main's;
- the working directory and the environment are the test's (monkeypatch.chdir / setenv them).

absl keeps its state in globals: the parsed FLAGS, app.run's run-once markers, the absl log handler
on the root logger and the levels it sets. paxlite_main() resets all of it before each call and
restores it when its `with` block ends, with pytest's monkeypatch undoing the rest when the test
ends, so nothing leaks into the other tests of this process. It uses private absl names
(app._run_init, app._register_and_parse_flags_with_usage,
absl.logging._attempted_to_remove_stderr_stream_handlers), checked against absl-py 2.5.1.

train_in_this_process() is the other kind: the training run itself, without the command line
around it, for a run whose work is the point (a reference to compare with, a job to resume from).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import pytest


class Result(NamedTuple):
    """What a finished `python -m ...` leaves: its exit status and what it printed."""

    returncode: int
    stdout: str
    stderr: str


Runner = Callable[..., Result]  # run(*args): the command's arguments after `python -m MODULE`


def exit_status(code) -> int:
    """The status a process exits with for sys.exit(code)."""
    return 0 if code is None else code if isinstance(code, int) else 1


@contextlib.contextmanager
def paxlite_main(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture) -> Iterator[Runner]:
    """`python -m paxlite.main FLAGS...` in this process: the same entry point (run_main: absl's
    app.run with paxlite's flags parser), its exit status and output (module docstring: what
    differs from a fresh process, and what is reset and restored)."""
    from absl import app, flags
    from absl import logging as absl_logging

    from paxlite import main as paxlite_main_module

    flags_ = flags.FLAGS
    root, absl_logger = logging.getLogger(), absl_logging.get_absl_logger()
    absl_handler = absl_logging.get_absl_handler()
    had_absl_handler = absl_handler in root.handlers
    levels = root.level, absl_logger.level
    filters = list(absl_handler.filters)  # main() adds its library-log filter on every run
    # Process-wide effects of app.run that mean nothing here: prevented rather than undone.
    monkeypatch.setattr(app, "faulthandler", None)  # would write crashes into this test's capture
    monkeypatch.setattr(app.command_name, "make_process_name_useful", lambda: None)
    monkeypatch.setattr(absl_logging, "_attempted_to_remove_stderr_stream_handlers", True)
    monkeypatch.setattr(app._run_init, "done", False)
    monkeypatch.setattr(app._register_and_parse_flags_with_usage, "done", False)

    def run(*args: str) -> Result:
        flags_.unparse_flags()
        app._run_init.done = app._register_and_parse_flags_with_usage.done = False
        monkeypatch.setattr(sys, "argv", [paxlite_main_module.__file__, *args])
        # absl's handler keeps the stderr of the moment it was made (pytest's capture, closed by
        # now); a process's log lines go to its stderr.
        monkeypatch.setattr(absl_handler.python_handler, "stream", sys.stderr)
        capfd.readouterr()
        with pytest.raises(SystemExit) as exited:
            paxlite_main_module.run_main()
        out, err = capfd.readouterr()
        return Result(exit_status(exited.value.code), out, err)

    flags_.unparse_flags()
    try:
        yield run
    finally:
        flags_.unparse_flags()
        if not had_absl_handler:
            root.removeHandler(absl_handler)
        root.setLevel(levels[0])
        absl_logger.setLevel(levels[1])
        absl_handler.filters[:] = filters


def paxlite_command(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture) -> Runner:
    """`python -m paxlite COMMAND ...` in this process: paxlite.__main__.run(), as the module runs
    it (`sys.exit(run())`), with its exit status and output. No absl state is involved; sys.argv
    is restored by monkeypatch when the test ends."""
    from paxlite import __main__ as paxlite_cli

    def run(*args: str) -> Result:
        monkeypatch.setattr(sys, "argv", [paxlite_cli.__file__, *args])
        capfd.readouterr()
        try:
            code = paxlite_cli.run()
        except SystemExit as e:  # argparse's usage errors
            code = e.code
        out, err = capfd.readouterr()
        return Result(exit_status(code), out, err)

    return run


def train_in_this_process(
    job: Path,
    flags: Sequence[str],
    *,
    save_checkpoints: bool = True,
    caplog: pytest.LogCaptureFixture | None = None,
) -> str | None:
    """The training run of `python -m paxlite.main --job_log_dir=JOB FLAGS...` in this process
    (only --fdl_config and --fdl.* are read; a later --fdl.NAME wins, as on the command line).

    For a run whose result a test needs but whose process it does not look at: a one-process
    reference to compare started processes with, or a job for a started process to resume. It
    saves one more process's interpreter, JAX start-up and compiles. It runs on this process's eight
    CPU devices with the session's compile flags (tests/conftest.py), which the started processes
    share, so its arithmetic is theirs. `save_checkpoints` is --enable_checkpoint_saving (off for a
    reference that nothing resumes from). With `caplog`, the run's log at INFO is returned (mesh
    layouts, resumes); without, None.
    """
    from paxlite.experiments.build import build_run_config
    from paxlite.train.loop import Run, RunContext

    name = [f.split("=", 1)[1] for f in flags if f.startswith("--fdl_config=")][-1]
    _, config = build_run_config(name, [f.removeprefix("--fdl.") for f in flags
                                        if f.startswith("--fdl.")])
    context = RunContext(job_dir=str(job), enable_checkpoint_saving=save_checkpoints)
    with contextlib.ExitStack() as stack:
        if caplog is not None:
            caplog.clear()
            stack.enter_context(caplog.at_level(logging.INFO))
        with Run(config, context) as run:
            run.train()
    return None if caplog is None else caplog.text
