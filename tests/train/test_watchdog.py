"""The hang watchdog on its own: stacks after the first timeout, the exit after the second, quiet
while steps go."""

from __future__ import annotations

import logging
import threading
import time

from paxlite.train.watchdog import HANG_EXIT_CODE, Watchdog, thread_stacks


def _stuck_in_a_named_place(seconds: float) -> None:
    time.sleep(seconds)


def test_stacks_are_logged_then_the_process_is_ended(caplog):
    exits: list[int] = []
    done = threading.Event()

    def exit_process(code: int) -> None:
        exits.append(code)
        done.set()

    caplog.set_level(logging.INFO)
    with Watchdog(timeout_s=0.2, crash_timeout_s=0.8, exit_process=exit_process) as watchdog:
        watchdog.beat()  # one step completed; then nothing
        _stuck_in_a_named_place(0.5)
        assert not exits  # past the first timeout only
        warnings = [
            r.getMessage()
            for r in caplog.records
            if "WATCHDOG_TIMEOUT_SECONDS=0.2" in r.getMessage()
        ]
        assert len(warnings) == 1  # once per stall, not once per poll
        assert "_stuck_in_a_named_place" in warnings[0] and 'Thread "MainThread"' in warnings[0]
        assert done.wait(5)
    assert exits == [HANG_EXIT_CODE]


def test_no_report_while_steps_complete_nor_before_the_first_one(caplog):
    exits: list[int] = []
    caplog.set_level(logging.INFO)
    with Watchdog(timeout_s=0.2, crash_timeout_s=0.4, exit_process=exits.append) as watchdog:
        time.sleep(0.6)  # the first step (it compiles): not timed
        for _ in range(12):
            watchdog.beat()
            time.sleep(0.05)
    assert exits == [] and watchdog.beats == 12
    assert not [r for r in caplog.records if "No training step completed" in r.getMessage()]


def test_thread_stacks_names_every_thread():
    release = threading.Event()
    worker = threading.Thread(target=release.wait, name="input-producer")
    worker.start()
    try:
        stacks = thread_stacks()
    finally:
        release.set()
        worker.join()
    assert 'Thread "input-producer"' in stacks and 'Thread "MainThread"' in stacks
    assert "test_thread_stacks_names_every_thread" in stacks


def test_a_commit_is_reported_but_never_ended_and_the_clock_restarts_after_it(caplog):
    exits: list[int] = []
    caplog.set_level(logging.INFO)
    with Watchdog(timeout_s=0.2, crash_timeout_s=0.4, exit_process=exits.append) as watchdog:
        watchdog.beat()
        with watchdog.committing():
            _stuck_in_a_named_place(1.0)  # well past the crash timeout
        assert exits == []
        commits = [
            r.getMessage() for r in caplog.records if "while a checkpoint commits" in r.getMessage()
        ]
        assert len(commits) == 1 and "_stuck_in_a_named_place" in commits[0]
        time.sleep(0.25)  # the commit's end counts as progress: past the first timeout only, again
        assert exits == []
        deadline = time.monotonic() + 5
        while not exits and time.monotonic() < deadline:  # a stall after the commit still ends it
            time.sleep(0.05)
    assert exits == [HANG_EXIT_CODE]


def test_nothing_is_timed_while_compiling(caplog):
    exits: list[int] = []
    caplog.set_level(logging.INFO)
    with Watchdog(timeout_s=0.1, crash_timeout_s=0.2, exit_process=exits.append) as watchdog:
        watchdog.beat()
        with watchdog.compiling():
            time.sleep(0.6)
        time.sleep(0.05)
    assert exits == [] and watchdog.beats == 2  # the compile's end is a beat
    assert not [r for r in caplog.records if "No training step completed" in r.getMessage()]
