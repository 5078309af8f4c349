"""The compilation cache a run switches on is switched back off after it: a process that runs
several jobs (tests, notebooks) gets its own JAX cache settings back, also when the run fails."""

import types

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache as jax_cache

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
    jax_cache.reset_cache()  # a test's compile bound JAX's cache to its directory


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


def test_off_is_off_even_under_jaxs_own_variable_and_comes_back_on(settings, tmp_path):
    """JAX_COMPILATION_CACHE_DIR alone would have JAX read and write its directory (for compiles
    over its own threshold, here 0 s): COMPILATION_CACHE=False writes no entry there."""
    cache = tmp_path / "jax_own"
    jax.config.update("jax_compilation_cache_dir", str(cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    mine = {name: getattr(jax.config, name) for name in NAMES}

    def compile_once(scale: float) -> None:  # a program no other test compiles
        jax.jit(lambda x: x * scale + 0.8125).lower(jax.numpy.ones((3, 7))).compile()

    with compilation_cache(_run_config(on=False, directory=None), job_dir=str(tmp_path)) as d:
        assert d is None
        compile_once(1.0625)
        assert {name: getattr(jax.config, name) for name in NAMES} == mine
    assert not cache.exists() or not any(cache.iterdir())
    assert jax.config.jax_enable_compilation_cache
    compile_once(1.1875)  # the process's own cache is back: the entry is written
    assert any(cache.iterdir())
