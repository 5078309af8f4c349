"""Every place paxlite relies on a private API of JAX, Orbax or Grain, in one module.

A private name (a `_src` module, a leading underscore) can move or change in any release without
notice. Keeping each one here, with what it reaches and why no public API does, means an upgrade
has one file to re-check, and tests/test_compat.py fails loudly when an installed version no longer
behaves as relied on. `CHECKED_VERSIONS` are the versions each coupling was last checked against;
the test keeps them equal to the pins in constraints.txt, so bumping a pin means re-checking here.
`OLDEST_CHECKED_VERSIONS` are the same packages at the bottom of the supported range
(constraints-py311.txt, setup.cfg's floors), where tests/test_compat.py passed as well; bumping one
of those pins means running it again under that stack (docs/quickstart.md#supported-versions).

The bottom layer: the standard library at import, so that any module may use it; the packages
themselves are imported only when a coupling is used.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Final

# (distribution, version) of each package reached privately below, as pinned in constraints.txt.
CHECKED_VERSIONS: Final = (("jax", "0.12.0.1"), ("orbax-checkpoint", "0.12.8"), ("grain", "0.2.18"))
# The same, as pinned in constraints-py311.txt (Python 3.11: the oldest supported stack).
OLDEST_CHECKED_VERSIONS: Final = (
    ("jax", "0.10.2"), ("orbax-checkpoint", "0.12.4"), ("grain", "0.2.12"))


def thread_cache_min_compile_time(seconds: float) -> contextlib.AbstractContextManager[None]:
    """A context in which this thread's compiles write to JAX's persistent compilation cache only
    if they take at least `seconds` (`float("inf")`: never); other threads keep the process's
    setting.

    Reaches `jax._src.config.persistent_cache_min_compile_time_secs`, the config `State` whose call
    form sets the option for the current thread only. The public `jax.config.update` changes it for
    the whole process, which would also keep other threads' programs out of the cache for as long
    as the context lasts. Used by train/step.py to keep programs whose cached form deadlocks on
    XLA:CPU out of the cache. Checked against jax 0.12.0.1.
    """
    from jax._src import config as jax_config

    return jax_config.persistent_cache_min_compile_time_secs(seconds)


def distributed_client() -> Any:
    """The client of JAX's distributed runtime in this process (after `jax.distributed.initialize`),
    or None: its key-value store reaches every process of the run through the coordination service.

    `jax._src.distributed.global_state.client`: JAX keeps the client there and documents no public
    accessor; its `key_value_set`, `key_value_try_get` and `key_value_dir_get` are the bound
    methods of XLA's DistributedRuntimeClient. train/peer_faults.py tells every process of a run
    about one process's fault through it. Checked against jax 0.12.0.1.
    """
    from jax._src import distributed

    return distributed.global_state.client


ORBAX_STANDARD_HANDLER_TYPESTR: Final = (
    "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler")
"""The name Orbax records for its StandardCheckpointHandler in a step's `_CHECKPOINT_METADATA`
(`item_handlers`), and looks the handler up by when the step is restored.

It is the handler class's `typestr()`: its module path, which lies under Orbax's private `_src`
package. checkpointing/stream_write.py writes a checkpoint's files one array at a time, without
Orbax's save (which holds the whole tree), so it writes this metadata itself; Orbax documents
neither the file nor the string. Checked against orbax-checkpoint 0.12.8.
"""

GRAIN_SMALLEST_PROPORTION: Final = 100
"""What Grain's `MapDataset.mix` scales the smallest mixing proportion to, ints included (the
private `grain._src.python.dataset.transformations.mix._float_to_int_proportions`, its default
`scale_min_to`).

data/mixture.py passes Grain integer proportions whose smallest is already this value, so Grain's
rescaling leaves them as they are and the interleave is the one the mixture reports (and rounds
rather than truncates). Grain documents float weights only, not how it turns them into integers.
Checked against grain 0.2.18.
"""


def is_orbax_writer(thread: threading.Thread) -> bool:
    """Whether `thread` is one of the threads in which Orbax writes (and finalizes) a save in the
    background: those are instances of thread classes Orbax defines itself (the private
    `_FinalizeThread` of its CheckpointManager, `_SignalingThread` of its futures), while the idle
    workers of its thread pools are plain `threading.Thread`s.

    Orbax has no public way to wait for the writers of a save that failed: its own
    `wait_until_finished` re-raises the first failure while the other writers still run.
    checkpointing/storage_faults.py waits for these threads before it removes a refused save.
    Checked against orbax-checkpoint 0.12.8.
    """
    return type(thread).__module__.startswith("orbax.")


def save_replicas_whole_in_one_process() -> None:
    """In a run of one process, makes Orbax save each replicated array from one replica's whole
    shard rather than from a slice of every replica's ("replica-parallel" saving).

    Replica-parallel saving spreads the bytes of a replicated array over the processes that hold
    its replicas, which shortens a save when there are many hosts. With one process, that process
    writes every slice itself: the split saves nothing, and it costs one eager slice program per
    local device and array shape, compiled at a run's first save (on 8 CPU devices, a tenth of the
    CPU time of the suite's checkpointing tests: docs/performance.md). Runs of more processes keep
    Orbax's choice (its default: replica-parallel unless JAX_PLATFORMS names a GPU).

    Orbax takes the choice only as an argument of its `ArrayHandler` (in the process-wide registry
    that its StandardCheckpointHandler saves through); the handler registered by default also keeps
    per-host array metadata, whose store only the private
    `orbax.checkpoint._src.metadata.array_metadata_store.Store` makes. Checked against
    orbax-checkpoint 0.12.8.
    """
    import jax
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.metadata import array_metadata_store

    if jax.process_count() > 1:
        return
    handler = ocp.type_handlers.ArrayHandler(
        use_replica_parallel=False, array_metadata_store=array_metadata_store.Store())
    ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
