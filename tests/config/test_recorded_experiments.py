"""A job directory is data: the experiment its config.json names is looked up in the registry and
never imported, so reading someone else's job cannot run code from it."""

import json
import os
import subprocess

import pytest

from paxlite.config.errors import ConfigError
from paxlite.config.registry import resolve_registered_experiment
from paxlite.experiments import EXPERIMENTS
from tests.fork_server import paxlite_python
from tests.xla_test_flags import COMPILE_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_registered_names_resolve_without_imports():
    tiny = EXPERIMENTS["TinySynthetic"]
    for name in ("TinySynthetic", "paxml.contrib.gpu.scripts_gpu.configs.TinySynthetic",
                 f"{tiny.__module__}.{tiny.__qualname__}"):
        assert resolve_registered_experiment(name, EXPERIMENTS, source="x") is tiny
    with pytest.raises(ConfigError, match="never imported.*pass --fdl_config=os.path yourself"):
        resolve_registered_experiment("os.path", EXPERIMENTS, source="job/config.json")


@pytest.fixture
def planted(tmp_path):
    """A working directory holding evil.py (which would leave a marker file when imported) and a
    job directory whose config.json names it, with an (empty, committed) checkpoint step
    directory."""
    marker = tmp_path / "IMPORTED"
    (tmp_path / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from paxlite.experiments.tiny import TinySynthetic\n"
        "class Evil(TinySynthetic):\n    pass\n")
    job = tmp_path / "job"
    (job / "checkpoints" / "checkpoint_00000001" / "state").mkdir(parents=True)
    (job / "checkpoints" / "checkpoint_00000001" / "commit_success.txt").write_text("")
    (job / "config.json").write_text(json.dumps({
        "experiment": "evil.Evil", "hparams": {}, "overridden": [],
        "command_line": ["paxlite/main.py", "--fdl_config=evil.Evil"]}))
    return tmp_path, job, marker


@pytest.mark.parametrize("command", [
    ["convert", "--from=paxlite", "--to=hf"], ["export_merged"]])
def test_reading_a_job_never_imports_the_module_it_names(planted, command):
    cwd, job, marker = planted
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    env["XLA_FLAGS"] = COMPILE_FLAGS
    result = subprocess.run(
        [paxlite_python(), "-m", "paxlite", *command, f"--input={job}", f"--output={cwd / 'out'}"],
        capture_output=True, text=True, env=env, cwd=cwd, timeout=300, check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "is not a registered experiment" in result.stderr
    assert "pass --fdl_config=" in result.stderr
    assert not marker.exists(), "the module named by the job's config.json was imported"
    assert not (cwd / "out").exists()
