"""A process of a two-process run killed (SIGKILL) or frozen (SIGSTOP) while the run trains, saves
or evaluates: the survivor stops by itself within the heartbeat timeout, with one line naming the
lost process, what the run was doing and the last complete checkpoint, and exit status 75; the
next start resumes from that checkpoint and recomputes the steps after it bit for bit
(train/peer_liveness.py).

One job goes through the moments in turn: each run after the first resumes the job the previous
loss left, so that every resume is checked and no pair of processes starts only to be checked.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.fork_server import DISABLE_VAR, FORK_DIR_VAR, served_file
from tests.parallel.test_multiprocess import EXPERIMENT, _env, _finish, _free_port, _start

HEARTBEAT_S = 3
ENV = {"PAXLITE_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_S)}
# the line, the SEEN marks and a loaded machine's slack, past the heartbeat timeout
STOP_WITHIN_S = HEARTBEAT_S + 20
EVERY = 5  # checkpoint interval
EVAL_EVERY = 4
MESH = ("--fdl.ICI_MESH_SHAPE=", "--fdl.DCN_MESH_SHAPE=", "--fdl.CHECKPOINT_EVERY_N_STEPS=")
FLAGS = [*(f for f in EXPERIMENT if not f.startswith(MESH)), "--fdl.ICI_MESH_SHAPE=[1,2,1]",
         "--fdl.DCN_MESH_SHAPE=[2,1,1]", f"--fdl.CHECKPOINT_EVERY_N_STEPS={EVERY}"]
NEVER_ENDS = "--fdl.MAX_STEPS=100000"
# an evaluation of ~1 s every EVAL_EVERY steps, for the runs that lose a process while evaluating
EVALUATES = (f"--fdl.EVAL_INTERVAL_STEPS={EVAL_EVERY}", "--fdl.EVAL_LOOP_NUM_BATCHES=50")


def _records(job: Path) -> list[dict]:
    path = job / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _committed(job: Path) -> list[int]:
    directory = job / "checkpoints"
    names = [p.name for p in directory.iterdir()] if directory.exists() else []
    return sorted(int(m.group(1)) for n in names if (m := re.fullmatch(r"checkpoint_(\d+)", n)))


def _paxlite_pid(proc: subprocess.Popen, port: int, *, host_idx: int) -> int:
    """The process that runs the pair member on `port`: the one the fork server forked for it
    (tests/fork_server.py), or `proc` itself where no server runs."""
    if FORK_DIR_VAR not in os.environ or os.environ.get(DISABLE_VAR) == "1":
        return proc.pid
    for line in Path(served_file({**_env(2), **ENV})).read_text().splitlines():
        child, args = json.loads(line)
        if f"--server_addr=127.0.0.1:{port}" in args and f"--host_idx={host_idx}" in args:
            return child
    pytest.fail(f"the fork server lists no process for the pair on port {port}")


class Chain:
    """The job and what its runs have logged so far."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.job = tmp_path / "job"
        self.logs = [tmp_path / "process0.log", tmp_path / "process1.log"]
        self.losses: dict[int, float] = {}  # step -> loss, as first logged
        self.runs = 0

    def _new_records(self, before: int) -> list[dict]:
        return _records(self.job)[before:]

    def _check_resume(self, records: list[dict], resumed_from: int | None) -> None:
        """This run resumed from `resumed_from` and recomputed the steps after it bit for bit."""
        texts = [log.read_text() for log in self.logs]
        if resumed_from is not None:
            assert all(f"Resumed from checkpoint step {resumed_from}" in t.rsplit(
                "Joining 2-process job", 1)[-1] for t in texts), texts[0][-3000:]
        steps = {r["step"]: r["loss"] for r in records if "loss" in r}
        again = sorted(set(steps) & set(self.losses))
        # the steps past the checkpoint that the interrupted run had logged are computed again
        logged = [s for s in self.losses if resumed_from is not None and s > resumed_from]
        assert not steps or not logged or again, (resumed_from, logged, steps)
        assert all(steps[s] == self.losses[s] for s in again), [
            (s, steps[s], self.losses[s]) for s in again]
        for step, loss in steps.items():
            self.losses.setdefault(step, loss)
        return again

    def lose(self, sig: signal.Signals, *, moment: Callable[[list[dict]], bool],
             flags: tuple[str, ...] = (), resumed_from: int | None) -> tuple[str, list[dict]]:
        """Start the pair, wait for `moment` (given this run's metrics records), send `sig` to
        process 1; the survivor's one line, after its checks (status, time, no traceback)."""
        for log in self.logs:
            log.write_text("")
        before = len(_records(self.job))
        port = _free_port()
        procs = [_start(self.job, [*FLAGS, *flags, "--multiprocess_gpu",
                                   f"--server_addr=127.0.0.1:{port}", "--num_hosts=2",
                                   f"--host_idx={i}"],
                        log=self.logs[i], num_cpu_devices=2, env=ENV) for i in range(2)]
        try:
            deadline = time.monotonic() + 240
            while not moment(self._new_records(before)):
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs), (
                    "\n".join(log.read_text()[-3000:] for log in self.logs))
                time.sleep(0.005)
            if sig is signal.SIGSTOP:  # the fork server's client cannot pass it on: the child
                os.kill(_paxlite_pid(procs[1], port, host_idx=1), sig)
            else:  # the client passes SIGKILL on: its child dies with it (tests/fork_server.py)
                procs[1].send_signal(sig)
            lost_at = time.monotonic()
            code = procs[0].wait(timeout=STOP_WITHIN_S + 30)
            elapsed = time.monotonic() - lost_at
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        text = self.logs[0].read_text()
        lines = [line for line in text.splitlines() if line.startswith("paxlite: error: ")]
        assert code == 75 and len(lines) == 1, text[-4000:]
        for noise in ("Traceback", "Fatal Python error", "Check failure stack trace"):
            assert noise not in text, text[-4000:]
        assert elapsed < STOP_WITHIN_S, (elapsed, text[-3000:])
        records = self._new_records(before)
        self._check_resume(records, resumed_from)
        return lines[0], records


def _expect(line: str, *, doing: str, checkpoint: int, job: Path) -> None:
    assert re.fullmatch(
        r"paxlite: error: process 1 \([^()]+\) of 2 gave no sign of life for \d+ s "
        r"\(PAXLITE_HEARTBEAT_TIMEOUT_S\): killed, out of memory, preempted or frozen, while "
        rf"this run was {re.escape(doing)}; the last complete checkpoint is step {checkpoint} in "
        rf"{re.escape(str(job / 'checkpoints'))}: run the same command again to resume from it",
        line), line


def _trained(records: list[dict]) -> list[int]:
    return [r["step"] for r in records if "loss" in r]


def _step_of(line: str) -> int:
    return int(re.search(r"\(step (\d+)\);", line).group(1))


@pytest.mark.slow  # seven pairs lose a process, an eighth finishes (~2 minutes on 2 cores)
@pytest.mark.multiprocess
def test_a_killed_or_frozen_process_stops_the_survivor_with_its_line_and_the_job_resumes(
        tmp_path):
    chain = Chain(tmp_path)
    job = chain.job
    resumed = None
    for sig in (signal.SIGKILL, signal.SIGSTOP):
        # while training: once a checkpoint is committed and two more steps were trained
        start = resumed or 0
        line, records = chain.lose(
            sig, resumed_from=resumed, flags=(NEVER_ENDS,),
            moment=lambda r, start=start: _committed(job)[-1:] > [start]
            and max(_trained(r), default=0) > _committed(job)[-1])
        kept = _committed(job)
        _expect(line, doing=f"training (step {_step_of(line)})", checkpoint=kept[-1], job=job)
        assert kept[-1] < _step_of(line)

        # while a save is in flight: its unfinished directory appeared
        resumed, saved = kept[-1], kept[-1] + EVERY

        def saving(records: list[dict], saved=saved) -> bool:
            return any(p.name.startswith(f"checkpoint_{saved:08d}.orbax-checkpoint-tmp")
                       for p in (job / "checkpoints").iterdir())

        line, _ = chain.lose(sig, resumed_from=resumed, flags=(NEVER_ENDS,), moment=saving)
        assert _committed(job) == kept, f"{sig.name}: the save of step {saved} was committed"
        doing = re.search(r"was (.*?\(step \d+\));", line).group(1)
        assert doing.endswith(f"(step {saved})") or doing.startswith("training"), line
        _expect(line, doing=doing, checkpoint=kept[-1], job=job)

        # while it evaluates: after the train summary of an evaluating step, before its eval
        def evaluating(records: list[dict], start=kept[-1]) -> bool:
            steps = _trained(records)
            return (bool(steps) and steps[-1] % EVAL_EVERY == 0 and steps[-1] > start
                    and not any("eval/loss" in str(r) and r["step"] == steps[-1]
                                for r in records))

        line, records = chain.lose(sig, resumed_from=kept[-1], flags=(NEVER_ENDS, *EVALUATES),
                                   moment=evaluating)
        resumed = _committed(job)[-1]
        _expect(line, doing=f"evaluating (step {max(_trained(records))})", checkpoint=resumed,
                job=job)

    # --mode=eval: killed while it evaluates the last checkpoint
    line, _ = chain.lose(signal.SIGKILL, resumed_from=None, flags=("--mode=eval", *EVALUATES),
                         moment=lambda r: "Evaluating step" in chain.logs[0].read_text())
    _expect(line, doing="evaluating", checkpoint=resumed, job=job)

    # a smaller allocation after the loss: one process of 2 devices resumes onto its own mesh, and
    # says what changed
    log = tmp_path / "alone.log"
    single = [f.replace("--fdl.DCN_MESH_SHAPE=[2,1,1]", "--fdl.DCN_MESH_SHAPE=[1,1,1]")
              for f in FLAGS]
    _finish([_start(job, [*single, f"--fdl.MAX_STEPS={resumed + 2}"], log=log,
                    num_cpu_devices=2)], [log], timeout=240)
    text = log.read_text()
    assert f"Resumed from checkpoint step {resumed}" in text, text[-3000:]
    assert re.search(r"This job last ran on 2 processes and 4 devices \(mesh .*global batch 8\); "
                     r"it now runs on 1 process and 2 devices \(mesh .*global batch 4\): its "
                     r"latest checkpoint is restored onto the new mesh", text), text[-3000:]
    assert _trained(_records(job))[-2:] == [resumed + 1, resumed + 2]
