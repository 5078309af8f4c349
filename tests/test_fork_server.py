"""The suite's fork server (tests/fork_server.py) starts commands as a fresh interpreter would: the
same output and exit status, the same absl flags, the environment and working directory of the
command, signals passed on and the child gone with its client. Each case is checked against the
real interpreter where there is something to compare with."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from tests.fork_server import FORK_DIR_VAR, paxlite_python, served_file, start_server

pytestmark = pytest.mark.skipif(FORK_DIR_VAR not in os.environ,
                                reason="the fork server is off (PAXLITE_TEST_NO_FORK_SERVER=1)")


# A variable in the server's key (tests/fork_server.py: JAX_*, PYTHON*, LD_*) that no other test
# sets: this file's commands go to a server of their own, which no other worker forks commands from
# meanwhile, so each command is the only one its server lists since it started. Python ignores it.
ENV = {**os.environ, "PYTHONPAXLITEFORKSERVERTEST": "1"}


@pytest.fixture(scope="module")
def served():
    """The file where this file's server lists what it forked."""
    return start_server(dict(ENV))


def _forked(served: str, *args: str, env: dict[str, str] = ENV,
            **kwargs) -> subprocess.CompletedProcess:
    before = _served(served)
    result = subprocess.run([paxlite_python(), *args], capture_output=True, text=True,
                            timeout=120, check=False, env=env, **kwargs)
    assert [entry[1] for entry in _served(served)[len(before):]] == [list(args)]
    return result


def _fresh(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                          check=False, **kwargs)


def _served(served: str) -> list:
    if not os.path.exists(served):
        return []
    with open(served) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("args", [
    # absl's "Did you mean" names near flags of every module imported: the server's preloaded
    # modules must add none that the command would not have (Orbax's and Grain's flags would).
    ("-m", "paxlite.main", "--fdl_config=TinySynthetic", "--exp=1", "--job_log_dir=job"),
    ("-m", "paxlite", "show", "--fdl_config=TinySynthetc"),
    ("-m", "paxlite.nosuch"),
])
def test_output_and_exit_status_equal_a_fresh_interpreters(served, tmp_path, args):
    forked, fresh = _forked(served, *args, cwd=tmp_path), _fresh(*args, cwd=tmp_path)
    assert forked.returncode == fresh.returncode != 0
    # the interpreter names itself by the path it was started as (sys.executable): the client's
    assert (forked.stdout, forked.stderr.replace(paxlite_python(), sys.executable)) == (
        fresh.stdout, fresh.stderr)
    if args[1] == "paxlite.nosuch":
        assert forked.stderr.startswith(f"{paxlite_python()}: No module named paxlite.nosuch")


def test_the_command_has_its_own_environment_and_directory(served, tmp_path):
    # VOCAB_PATH from the environment reaches the experiment (data_settings.py), and a relative
    # --fdl_config module is found in the working directory, as `python -m` puts it on sys.path.
    (tmp_path / "my_tiny.py").write_text(
        "from paxlite.experiments.tiny import TinySynthetic\n\n\n"
        "class MyTiny(TinySynthetic):\n    NUM_LAYERS = 3\n")
    env = {**ENV, "VOCAB_PATH": str(tmp_path / "spm.model")}
    args = ("-m", "paxlite", "show", "--fdl_config=my_tiny.MyTiny", "--format=json")
    forked = _forked(served, *args, cwd=tmp_path, env=env)
    assert forked.returncode == 0, forked.stderr
    assert forked.stdout == _fresh(*args, cwd=tmp_path, env=env).stdout
    assert '"NUM_LAYERS": 3' in forked.stdout


def test_a_killed_client_takes_its_child_and_a_signal_is_passed_on(served, tmp_path):
    before = len(_served(served))
    args = ["-m", "paxlite.main", "--fdl_config=TinySynthetic", "--fdl.MAX_STEPS=100000000",
            f"--job_log_dir={tmp_path / 'job'}"]
    for number, status in ((signal.SIGKILL, -signal.SIGKILL), (signal.SIGUSR2, -signal.SIGUSR2)):
        client = subprocess.Popen([paxlite_python(), *args], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, env=ENV)
        _wait_until(lambda n=before: len(_served(served)) > n, seconds=60)
        (pid, _), = _served(served)[before:]
        before += 1
        client.send_signal(number)
        assert client.wait(timeout=60) == status
        _wait_until(lambda child=pid: not _exists(child), seconds=30)
        assert not _exists(pid), f"the forked child {pid} outlived its client"


def test_a_stopped_server_takes_the_commands_it_still_runs(tmp_path):
    """stop_servers (the session's end) sends each server SIGTERM: a command it forked and still
    runs must not go on alone. A server of its own (another key): the shared one keeps serving.
    That server is started by the command itself, the first of its environment, which waits for
    it and is forked too (not run in the real interpreter beside a server started for later
    commands)."""
    env = {**ENV, "PYTHONPAXLITEFORKSERVERSTOPTEST": "1"}
    served = served_file(env)
    assert not os.path.exists(served[: -len(".served")] + ".lock")  # no server for it yet
    client = subprocess.Popen(
        [paxlite_python(), "-m", "paxlite.main", "--fdl_config=TinySynthetic",
         "--fdl.MAX_STEPS=100000000", f"--job_log_dir={tmp_path / 'job'}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    pid = server = None
    try:
        _wait_until(lambda: bool(_served(served)), seconds=120)
        (pid, _), = _served(served)
        with open(served[: -len(".served")] + ".pid") as f:
            server = int(f.read())
        os.kill(server, signal.SIGTERM)
        client.wait(timeout=60)
        _wait_until(lambda: not (_exists(pid) or _exists(server)), seconds=30)
        assert not _exists(pid), f"the forked child {pid} outlived its stopped server"
        assert not _exists(server)
    except BaseException:  # a failure must not leave a training run going on beside the suite
        client.kill()  # (a command run by the real interpreter is the client's own process)
        for process in (pid, server):  # (after a pass both are gone: their pids may be reused)
            with contextlib.suppress(ProcessLookupError):
                if process is not None and _exists(process):
                    os.kill(process, signal.SIGKILL)
        raise


def _wait_until(done: Callable[[], bool], *, seconds: float) -> None:
    """Polls `done` every 50 ms for at most `seconds`; the caller's assertion after it says what
    was awaited, so a deadline passed fails there with its own message."""
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie the server has not reaped yet has ended
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"
