"""Jitted steps kept out of JAX's persistent compilation cache where reading them back is unsafe
(train/step.py wraps its steps with ``cache_safe``)."""

from __future__ import annotations

from jax.sharding import Mesh

from paxlite.compat import thread_cache_min_compile_time


class NotPersistentlyCached:
    """A jitted step (or its lowered form) whose compiled program stays out of JAX's persistent
    compilation cache.

    Why: on XLA:CPU a program with a pipeline's collective-permutes inside its loop, read back from
    that cache, intermittently deadlocks in its collectives (jax 0.12.0.1, 8 host devices: "Expected
    8 threads to join the rendezvous, but only 4 of them arrived"; 5 of 7 runs with the cache, 0 of
    4 without, 2026-12-03). Raising the cache's minimum compile time for this thread's compiles
    means such programs are never written, so never read; other programs keep the cache. `lower`
    and the rest are the jitted function's own.
    """

    def __init__(self, fn):
        self._fn = fn

    def __call__(self, *args, **kwargs):
        with thread_cache_min_compile_time(float("inf")):
            return self._fn(*args, **kwargs)

    def lower(self, *args, **kwargs):
        """The jitted function's `lower`, whose `compile` (the planner's) stays out of the cache
        too: a CPU run of the same step would read the planned program back."""
        return NotPersistentlyCached(self._fn.lower(*args, **kwargs))

    def compile(self, *args, **kwargs):
        with thread_cache_min_compile_time(float("inf")):
            return self._fn.compile(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._fn, name)


def cache_safe(fn, mesh: Mesh):
    """`fn` as is, or kept out of the persistent cache on a CPU mesh with a pipeline or seq axis
    (their loops of collective-permutes: `NotPersistentlyCached`)."""
    loops_of_permutes = any(mesh.shape.get(axis, 1) > 1 for axis in ("pipeline", "seq"))
    if loops_of_permutes and mesh.devices.flat[0].platform == "cpu":
        return NotPersistentlyCached(fn)
    return fn
