"""lm_eval's task index (paxlite/eval/harness_lm.py): built once per process and include path, not
at every scoring of a run with an lm_eval interval. The index is restricted to the repository's
three local tasks here (include_defaults=False), so that no test pays for lm_eval's thousands."""

import pathlib

import pytest

from paxlite.errors import SettingError

TASKS_DIR = pathlib.Path(__file__).resolve().parents[1] / "testdata" / "lm_eval"


def test_the_full_index_is_built_once_and_still_names_the_missing_task(monkeypatch):
    pytest.importorskip("lm_eval")
    import lm_eval.tasks

    from paxlite.eval import harness_lm

    built = []

    class LocalOnly(lm_eval.tasks.TaskManager):
        def __init__(self, include_path=None, include_defaults=True, **kwargs):
            built.append(include_defaults)
            super().__init__(include_path=include_path, include_defaults=False, **kwargs)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", LocalOnly)
    harness_lm._full_index.cache_clear()
    try:
        for _ in range(2):
            with pytest.raises(SettingError, match=r"'paxlite_mcq' is not a task .*did you mean "
                                                   r"paxlite_mc"):
                harness_lm.task_manager(str(TASKS_DIR), ["paxlite_mc", "paxlite_mcq"])
        # each call tries the include path alone (cheap), the full index once
        assert built == [False, True, False]
        manager = harness_lm.task_manager(str(TASKS_DIR), ["paxlite_mc"])
        assert manager.match_tasks(["paxlite_mc"]) == ["paxlite_mc"]
    finally:
        harness_lm._full_index.cache_clear()
