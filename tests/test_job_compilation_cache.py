"""The compilation cache a run switches on is switched back off after it: a process that runs
several jobs (tests, notebooks) gets its own JAX cache settings back, also when the run fails."""

import types

import jax
import pytest

from paxlite.cli.job import compilation_cache

NAMES = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
         "jax_persistent_cache_min_entry_size_bytes")


def _run_config(*, on: bool, directory: str | None):
    loop = types.SimpleNamespace(compilation_cache=on, compilation_cache_dir=directory)
    return types.SimpleNamespace(loop=loop)


@pytest.fixture
def settings(monkeypatch):
    # The suite shares one cache through JAX's own variable (conftest.py); these tests check the
    # fallback to the job's directory, which applies when the variable is not set.
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    before = {name: getattr(jax.config, name) for name in NAMES}
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 7.5)  # not JAX's default
    mine = {name: getattr(jax.config, name) for name in NAMES}
    yield mine
    for name, value in before.items():
        jax.config.update(name, value)


def test_settings_come_back_after_a_run_and_after_a_failed_one(settings, tmp_path):
    with compilation_cache(_run_config(on=True, directory=str(tmp_path / "cache")),
                           job_dir=str(tmp_path)) as directory:
        assert directory == str(tmp_path / "cache")
        assert jax.config.jax_compilation_cache_dir == directory
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
        assert jax.config.jax_persistent_cache_min_entry_size_bytes == 0
    assert {name: getattr(jax.config, name) for name in NAMES} == settings
    with (pytest.raises(RuntimeError, match="the run failed"),
          compilation_cache(_run_config(on=True, directory=None), job_dir=str(tmp_path)) as d):
        assert d == str(tmp_path / "compilation_cache")
        raise RuntimeError("the run failed")
    assert {name: getattr(jax.config, name) for name in NAMES} == settings


def test_off_changes_nothing(settings, tmp_path):
    with compilation_cache(_run_config(on=False, directory=None), job_dir=str(tmp_path)) as d:
        assert d is None
        assert {name: getattr(jax.config, name) for name in NAMES} == settings
