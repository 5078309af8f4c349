"""Orbax checkpoints in Pax's layout, careful with the user's files.

Layout: `directory/checkpoint_00000100/state/...` (Pax's `checkpoint_%08d`), written by an Orbax
`CheckpointManager` with asynchronous saves. The train state is one named item, "state", so other
items (the data iterator's position) can be added beside it without changing the layout.

Robustness rules, because a checkpoint directory holds days of compute:
- Orbax writes to `<name>.orbax-checkpoint-tmp` and renames on success; such leftovers from a
  killed save are not steps and are ignored. A leftover for a step about to be saved is moved
  aside (Orbax would delete it) rather than lost.
- Restoring walks back from the latest step. A checkpoint that fails to restore (missing or
  truncated data file, garbled metadata) is reported with a warning; once an older one restores,
  the failed ones are moved to `<directory>_corrupted/<name>` - never deleted - so a later save of
  the same step cannot collide with them. If none restores, nothing is moved and the error lists
  every checkpoint: silently starting from scratch would discard a run.
- A save never overwrites: an existing step directory is an error.
"""

from __future__ import annotations

import os
import types
from typing import Any, Self

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from paxlite.errors import UserError

PyTree = Any

_STEP_PREFIX = "checkpoint"
_STEP_DIGITS = 8
_ITEM = "state"
_DATA_ITEM = "data"  # the input iterators' positions, one JSON object per process
_TMP_SUFFIX = ".orbax-checkpoint-tmp"


class CheckpointExistsError(UserError, FileExistsError):
    """A save would overwrite an existing checkpoint."""


class NoRestorableCheckpointError(UserError, RuntimeError):
    """Checkpoints exist but none of them can be restored."""


def _short(error: BaseException) -> str:
    """First line of an error, capped: TensorStore errors embed a page-long spec."""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = f"{type(error).__name__}: {first_line}"
    return text if len(text) <= 400 else text[:400] + "..."


def _all_processes_agree(ok: bool) -> bool:
    """True only if `ok` holds on every process, so all processes restore the same step."""
    if jax.process_count() == 1:
        return ok
    flags = multihost_utils.process_allgather(np.array(ok, dtype=np.int32))
    return bool(np.all(flags))


class Checkpointer:
    """Saves and restores the train state under `directory`.

    Args:
        directory: Checkpoint root, e.g. `job_log_dir/checkpoints`.
        save_interval_steps: `should_save(step)` is true every this many steps (>= 1).
        max_to_keep: Newest checkpoints kept; older ones are deleted by Orbax. None keeps all.
        enable_saving: False makes `save` a no-op (Pax --enable_checkpoint_saving=false);
            restoring still works and nothing on disk is changed, not even moved aside.
        async_save: Let `save` return once the arrays are copied off the devices.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        save_interval_steps: int,
        max_to_keep: int | None,
        enable_saving: bool = True,
        async_save: bool = True,
    ) -> None:
        if isinstance(save_interval_steps, bool) or save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be >= 1, got {save_interval_steps!r}.")
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None (keep all), got {max_to_keep!r}.")
        # Orbax's async save refuses relative paths, and only reports it after training went on.
        self._directory = epath.Path(os.path.abspath(directory))
        self._interval = save_interval_steps
        self._enable_saving = enable_saving
        if enable_saving:
            options = ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                step_prefix=_STEP_PREFIX,
                step_format_fixed_length=_STEP_DIGITS,
                enable_async_checkpointing=async_save,
                create=True,
                cleanup_tmp_directories=False,
            )
        else:
            # read_only: Orbax then neither saves nor garbage-collects old steps.
            options = ocp.CheckpointManagerOptions(
                step_prefix=_STEP_PREFIX,
                step_format_fixed_length=_STEP_DIGITS,
                create=False,
                read_only=True,
                save_interval_steps=0,
                cleanup_tmp_directories=False,
            )
        self._manager = ocp.CheckpointManager(
            self._directory, options=options, item_names=(_ITEM, _DATA_ITEM)
        )

    @property
    def directory(self) -> epath.Path:
        return self._directory

    def step_path(self, step: int) -> epath.Path:
        """Directory of `step`'s checkpoint, e.g. `directory/checkpoint_00000100`."""
        return self._directory / f"{_STEP_PREFIX}_{step:0{_STEP_DIGITS}d}"

    def should_save(self, step: int) -> bool:
        """Whether `step` is on the save interval (always False with saving disabled)."""
        return self._enable_saving and step % self._interval == 0

    def save(
        self, step: int, state: PyTree, *, force: bool = False, data_state: Any = None
    ) -> bool:
        """Starts saving `state` as `step`; returns whether a save was started.

        `force` saves off the interval (e.g. the final step) but never when saving is disabled.
        `data_state`, when given, is a JSON-serialisable record of where the input pipelines stand
        (already gathered from every process), saved beside the state and restored by `restore_data`.
        Raises CheckpointExistsError if the step is already saved (or being saved).
        """
        if not self._enable_saving or not (force or self.should_save(step)):
            return False
        path = self.step_path(step)
        if step in self._manager.all_steps() or path.exists():
            raise CheckpointExistsError(
                f"Checkpoint for step {step} already exists at {path}; refusing to overwrite it. "
                "Move it away or resume from it."
            )
        leftover = path.parent / (path.name + _TMP_SUFFIX)
        if jax.process_index() == 0 and leftover.exists():
            moved = self._move_aside(leftover)
            logging.warning(
                "Moved the unfinished save %s out of the way to %s before saving step %d.",
                leftover,
                moved,
                step,
            )
        # force=True: the interval is ours; Orbax's own should_save also refuses steps <= latest.
        items = {_ITEM: ocp.args.StandardSave(state)}
        if data_state is not None:
            items[_DATA_ITEM] = ocp.args.JsonSave(data_state)
        return bool(self._manager.save(step, args=ocp.args.Composite(**items), force=True))

    def restore_data(self, step: int) -> Any:
        """The data record saved with `step`, or None if that checkpoint has none."""
        if not (self.step_path(step) / _DATA_ITEM).exists():
            return None
        restored = self._manager.restore(
            step, args=ocp.args.Composite(**{_DATA_ITEM: ocp.args.JsonRestore()})
        )
        return restored[_DATA_ITEM]

    def restore_latest(self, abstract_state: PyTree) -> tuple[int, PyTree] | None:
        """Restores the newest readable checkpoint, or returns None when there is none.

        Args:
            abstract_state: Pytree of `jax.ShapeDtypeStruct` with shardings (or arrays); the
                restored arrays are placed with those shardings.

        Returns:
            (step, state), or None if the directory holds no checkpoint.

        Raises:
            NoRestorableCheckpointError: checkpoints exist but none can be restored.
        """
        self.wait_until_finished()
        self._manager.reload()
        steps = sorted(self._manager.all_steps(), reverse=True)
        if not steps:
            return None
        failures: list[tuple[int, str]] = []
        for step in steps:
            restored = None
            try:
                restored = self._manager.restore(
                    step,
                    args=ocp.args.Composite(**{_ITEM: ocp.args.StandardRestore(abstract_state)}),
                )
            except Exception as error:  # noqa: BLE001 - TensorStore raises bare Exception.
                logging.warning(
                    "Checkpoint %s could not be restored (%s); trying the previous one.",
                    self.step_path(step),
                    _short(error),
                )
                failures.append((step, _short(error)))
            if not _all_processes_agree(restored is not None):
                if restored is not None:
                    failures.append((step, "failed to restore on another process"))
                continue
            self._set_aside_failures([s for s, _ in failures])
            return step, restored[_ITEM]
        listing = "\n".join(f"  {self.step_path(s)}: {reason}" for s, reason in failures)
        raise NoRestorableCheckpointError(
            f"None of the {len(steps)} checkpoints under {self._directory} can be restored; "
            f"nothing was moved or deleted. Fix or move them to start from scratch:\n{listing}"
        )

    def all_steps(self) -> list[int]:
        """Saved (and in-progress) steps, ascending."""
        return sorted(self._manager.all_steps())

    def wait_until_finished(self) -> None:
        """Blocks until an asynchronous save has been committed; raises its error if it failed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: types.TracebackType | None,
    ) -> None:
        self.close()

    def _set_aside_failures(self, steps: list[int]) -> None:
        """Moves unreadable checkpoints newer than the restored one out of the step listing."""
        if not steps:
            return
        if self._enable_saving and jax.process_index() == 0:
            for step in steps:
                path = self.step_path(step)
                if path.exists():
                    moved = self._move_aside(path)
                    logging.warning("Moved the unreadable checkpoint %s to %s.", path, moved)
        elif not self._enable_saving:
            logging.warning(
                "Saving is disabled, so the unreadable checkpoints %s stay where they are.",
                [str(self.step_path(s)) for s in steps],
            )
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("paxlite_checkpoint_set_aside")
        self._manager.reload()

    def _move_aside(self, path: epath.Path) -> epath.Path:
        """Renames `path` into `<directory>_corrupted/`, adding .1, .2, ... on a name clash."""
        target_dir = self._directory.parent / f"{self._directory.name}_corrupted"
        target_dir.mkdir(parents=True, exist_ok=True)
        target = target_dir / path.name
        suffix = 0
        while target.exists():
            suffix += 1
            target = target_dir / f"{path.name}.{suffix}"
        path.rename(target)
        return target
