"""The launcher's --num_processes / --process_id (and NUM_PROCESSES / PROCESS_ID) must agree.

A one-process launch (--num_processes=1, no coordinator) with a process id other than 0 is refused:
one line naming the value and the valid range, exit status 2, before JAX starts. Pure parse, in
this process (paxlite.cli.launch_plan.parse_launch, reported by paxlite.errors.report_errors, as
launch_trainer_main.main does).
"""

import pytest

from paxlite.cli.launch_plan import LaunchFlags, parse_launch
from paxlite.errors import report_errors
from paxlite.parallel.distributed import DistributedError, Launch, LaunchSource, explicit_launch

BASE = dict(module="text.gpt.c4_trainer", config="fuji-test-v1", data_dir="FAKE",
            jax_backend="cpu", trainer_dir="/tmp/never-made")


def _plan(env: dict[str, str], **flags):
    return parse_launch(LaunchFlags.of(**{**BASE, **flags}), env)


@pytest.mark.parametrize(
    ("env", "flags", "message"),
    [
        ({}, dict(num_processes=1, process_id=3),
         "--process_id=3 is outside 0..0 for --num_processes=1 process (process ids count from 0)"),
        ({"NUM_PROCESSES": "1", "PROCESS_ID": "1"}, {},
         "PROCESS_ID=1 is outside 0..0 for NUM_PROCESSES=1 process (process ids count from 0)"),
        ({"NUM_PROCESSES": "1"}, dict(process_id=2),
         "--process_id=2 is outside 0..0 for NUM_PROCESSES=1 process (process ids count from 0)"),
    ],
    ids=["flags", "environment", "mixed"],
)
def test_one_process_with_another_id_is_refused(capsys, env, flags, message) -> None:
    with pytest.raises(DistributedError) as info:
        _plan(env, **flags)
    assert str(info.value) == message

    def launch() -> int:  # launch_trainer_main.main's order: parse (and refuse), then run
        _plan(env, **flags)
        return 0

    assert report_errors(launch) == 2  # what the launcher prints: one line, exit status 2
    assert capsys.readouterr().err == f"paxlite: error: {message}\n"


def test_one_process_with_id_0_is_a_single_process() -> None:
    assert _plan({}, num_processes=1, process_id=0).launch == Launch(source=LaunchSource.SINGLE)
    assert _plan({"NUM_PROCESSES": "1", "PROCESS_ID": "0"}).launch.is_distributed is False


def test_explicit_launch_without_a_coordinator() -> None:
    names = ("--distributed_coordinator", "--num_processes", "--process_id")
    assert explicit_launch(coordinator_address=None, num_processes=1, process_id=0,
                           names=names) == Launch(source=LaunchSource.SINGLE)
    with pytest.raises(DistributedError, match=r"^--process_id=-1 must be at least 0$"):
        explicit_launch(coordinator_address=None, num_processes=1, process_id=-1, names=names)
    with pytest.raises(DistributedError,
                       match="^--num_processes=2 needs --distributed_coordinator=HOST:PORT"):
        explicit_launch(coordinator_address=None, num_processes=2, process_id=0, names=names)
    with pytest.raises(DistributedError, match=r"--process_id=4 is outside 0\.\.3 for "
                                               r"--num_processes=4 processes"):
        explicit_launch(coordinator_address="h:1", num_processes=4, process_id=4, names=names)
