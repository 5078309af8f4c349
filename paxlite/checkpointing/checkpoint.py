"""Orbax checkpoints in Pax's layout, careful with the user's files.

Layout: `directory/checkpoint_00000100/state/...` (Pax's `checkpoint_%08d`), written by an Orbax
`CheckpointManager` with asynchronous saves. The train state is one named item, "state", so other
items (the data iterator's position) can be added beside it without changing the layout.

Robustness rules, because a checkpoint directory holds days of compute:
- Orbax writes to `<name>.orbax-checkpoint-tmp` and renames on success; a killed save's leftover
  is no step and is ignored, or moved aside (not deleted, as Orbax would) when that step is saved.
- Restoring walks back from the latest step, but only past checkpoints that are *damaged*: no
  commit marker, missing or garbled metadata, missing or truncated array files, failed integrity
  checks (`is_damage`, checkpoint_damage.py). Those are reported with a warning; once an
  older one restores, they are moved to `<directory>_corrupted/<name>` - never deleted - so a later
  save of the same step cannot collide with them. Any other failure (a permission or transient I/O
  error) stops with `CheckpointReadError` and moves nothing: an older checkpoint would silently
  discard progress. An intact checkpoint of another train state (another model shape) stops with
  `CheckpointMismatchError`, naming the entries (checkpoint_match.py), except optimizer state of
  the optax chain's earlier layout, read into the current one (`opt_state_layout.py`). If none
  restores, nothing moves and the error lists every checkpoint (starting afresh would lose a run).
- The data record of a step is restored together with its state, so both come from one step.
- A save never overwrites: an existing step directory is an error.
- A save that storage refuses (storage_faults.py) raises CheckpointSaveError naming its step, also
  when found after it (`raise_if_refused`, the next save or wait); its temporary directory is
  removed (one process) and Orbax's echoes are kept out of the log.
- Every process acts on process 0's answer about the directory (which steps exist, whether one is
  finished, holds a data record, or is about to be saved over: `multihost.decided_by_process_0`):
  hosts listing for themselves could see different steps (NFS caching, a rename in flight), then
  make different collectives (a hang) or restore different steps. A process that fails to read a
  step still counts: the worst result over processes decides. One whose Orbax bookkeeping lists a
  step process 0 found absent stops every process before the save (CheckpointViewsDifferError).
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable
from typing import Any, Self

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from paxlite import compat
from paxlite.checkpointing import opt_state_layout as layout
from paxlite.checkpointing.checkpoint_damage import (
    FORMAT_KEY,
    FORMAT_VERSION,
    CheckpointDamagedError,
    CheckpointFormatError,
    Outcome,
    incomplete,
    is_damage,
    move_aside,
    newer_format,
    passes_first_look,
    short_error,
    worst_over_processes,
)
from paxlite.checkpointing.checkpoint_match import (
    earlier_optimizer_layout,
    mismatches,
    without_absent_empty_fields,
)
from paxlite.checkpointing.chunking import layer_chunked_save_args
from paxlite.checkpointing.storage_faults import (
    CheckpointSaveError,
    QuietStorageFaults,
    StorageFault,
    newest_complete,
    refused_save,
    remove_refused_save,
    storage_fault,
    vanished,
)
from paxlite.errors import RunStoppedError, UserError
from paxlite.parallel import multihost

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


class CheckpointReadError(RunStoppedError, RuntimeError):
    """A checkpoint could not be read for a reason other than damage; nothing was moved."""


class CheckpointMismatchError(UserError, ValueError):
    """An intact checkpoint holds another train state than the run expects (a user's setting)."""


class CheckpointViewsDifferError(RunStoppedError, RuntimeError):
    """Some process still lists a step that process 0 found absent; nothing was saved."""


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
            compat.save_replicas_whole_in_one_process()
            options = ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                step_prefix=_STEP_PREFIX,
                step_format_fixed_length=_STEP_DIGITS,
                enable_async_checkpointing=async_save,
                # the step's directories made by save(): a refused one made in the background
                # left Orbax's writers waiting for it, holding the process 300 s at exit
                async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
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
        # For the manager's lifetime: its background threads report a fault until close.
        self._quiet = QuietStorageFaults().__enter__()
        # The step of the save started last and not yet known to be committed; the unfinished
        # directories of refused saves, removed again at close (Orbax may still write in them).
        self._in_flight: int | None = None
        self._last_started: int | None = None  # set before `save`: a write may fail within it
        self._refused: list[epath.Path] = []

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
        (already gathered from every process), saved beside the state and restored by
        `restore_data`. Raises CheckpointExistsError if the step is already saved (or being saved),
        as process 0 sees it; CheckpointViewsDifferError (on every process) if another process still
        lists it; CheckpointSaveError if storage refused this save or the previous one (which is
        waited for first: Orbax never runs two saves at once).
        """
        if not self._enable_saving or not (force or self.should_save(step)):
            return False
        self.wait_until_finished()
        if not self._directory.is_dir():  # Orbax would make it again, and the job's files with it
            raise self._save_failed(step, vanished(self._directory))
        path = self.step_path(step)
        if self._decided(functools.partial(self._prepare_save, step),
                         what=f"check that {path} is not saved yet"):
            raise CheckpointExistsError(
                f"Checkpoint for step {step} already exists at {path}; refusing to overwrite it. "
                "Move it away or resume from it."
            )
        stale = self._processes_still_listing(step)
        if stale:
            raise CheckpointViewsDifferError(
                f"Process {stale[0]} still lists {path}, which process 0 does not see (a stale "
                "network file system cache, or a rename in flight), so Orbax would refuse the save "
                "there alone; nothing was saved. Rerun once the storage agrees.")
        # force=True: the interval is ours; Orbax's own should_save also refuses steps <= latest.
        items = {_ITEM: ocp.args.StandardSave(state, save_args=layer_chunked_save_args(state))}
        if data_state is not None:
            items[_DATA_ITEM] = ocp.args.JsonSave(data_state)
        self._last_started = step
        try:
            started = bool(self._manager.save(step, args=ocp.args.Composite(**items), force=True,
                                              custom_metadata={FORMAT_KEY: FORMAT_VERSION}))
        except Exception as error:  # TensorStore raises a bare ValueError; re-raised if not storage
            if (fault := storage_fault(error)) is None:
                raise
            raise self._save_failed(step, fault) from error
        self._in_flight = step if started else None
        return started

    def on_refused_save(self, report: Callable[[CheckpointSaveError], None]) -> None:
        """`report` gets the error of the save in flight as soon as one of Orbax's background
        threads meets a storage fault: with several processes the main thread may be waiting at
        an Orbax barrier the other processes never reach (train/peer_faults.py)."""
        self._quiet.report_refusals(report, step=lambda: self._last_started,
                                    directory=str(self._directory),
                                    complete=self.newest_complete_step)

    def _save_failed(self, step: int, fault: StorageFault) -> CheckpointSaveError:
        """The error for `step`'s refused save, once its unfinished directory is removed."""
        self._quiet.note(fault)
        if jax.process_count() == 1:  # with several, others may still write in it
            leftover = self.step_path(step).parent / (self.step_path(step).name + _TMP_SUFFIX)
            remove_refused_save(leftover)
            self._refused.append(leftover)  # removed again at the end of the run
        return refused_save(step=step, directory=str(self._directory), fault=fault,
                            complete=self.newest_complete_step())

    def newest_complete_step(self) -> int | None:
        """The newest committed step on disk, as this process finds it (no collective)."""
        return newest_complete(self._manager)

    def _prepare_save(self, step: int) -> bool:
        """On process 0 only: whether `step` is saved (or being saved); if not, a killed save's
        leftover of it is moved aside, before any process starts writing (Orbax would delete it)."""
        path = self.step_path(step)
        if step in self._manager.all_steps() or path.exists():
            return True
        leftover = path.parent / (path.name + _TMP_SUFFIX)
        if leftover.exists():
            moved = move_aside(leftover, directory=self._directory)
            logging.warning("Moved the unfinished save %s out of the way to %s before saving "
                            "step %d.", leftover, moved, step)
        return False

    def _processes_still_listing(self, step: int) -> list[int]:
        """The processes whose Orbax bookkeeping lists `step` (re-read once) after process 0 found
        it absent. Orbax checks its own list before a save, on each process: one stale view would
        refuse there alone while the others wait in the save's collectives."""
        listed = step in self._manager.all_steps()
        if listed:
            try:
                self._manager.reload()
                listed = step in self._manager.all_steps()
            except OSError as error:  # the list it had stands: a step still listed stops the save
                logging.warning("Could not re-read the checkpoints in %s (%s); keeping the list "
                                "read before", self._directory, error)
        return multihost.processes_where(listed)

    def _decided(self, decide: Callable[[], Any], *, what: str) -> Any:
        """`multihost.decided_by_process_0`, a failure raised as CheckpointReadError everywhere."""
        try:
            return multihost.decided_by_process_0(decide, what=what)
        except multihost.ProcessZeroError as error:
            raise CheckpointReadError(f"{error}; nothing was moved.") from error
        except OSError as error:
            if isinstance(error, UserError):
                raise
            raise CheckpointReadError(
                f"Could not {what} ({short_error(error)}). This is not a sign of damage, so "
                "nothing was moved; fix the cause (permissions, storage) and rerun.") from error

    def restore_data(self, step: int) -> Any:
        """The data record saved with `step`, or None if that checkpoint has none. A collective
        (every process calls it): process 0 decides whether the record is there."""
        if not self._decided((self.step_path(step) / _DATA_ITEM).exists,
                             what=f"look for the data record of {self.step_path(step)}"):
            return None
        args = ocp.args.Composite(**{_DATA_ITEM: ocp.args.JsonRestore()})
        return self._manager.restore(step, args=args)[_DATA_ITEM]

    def passes_first_look(self, step: int) -> bool:
        """checkpoint_damage.passes_first_look of `step`, process 0's answer (a collective)."""
        look = functools.partial(passes_first_look, self.step_path(step), item=_ITEM)
        return self._decided(look, what=f"look at {self.step_path(step)}")

    def restore_latest(self, abstract_state: PyTree) -> tuple[int, PyTree] | None:
        """(step, state) of the newest restorable checkpoint; see `restore_latest_with_data`."""
        restored = self.restore_latest_with_data(abstract_state)
        return None if restored is None else (restored[0], restored[1])

    def restore_latest_with_data(self, abstract_state: PyTree) -> tuple[int, PyTree, Any] | None:
        """Restores the newest intact checkpoint's state and data record, or returns None.

        Args:
            abstract_state: `jax.ShapeDtypeStruct`s with shardings (or arrays): where it goes.

        Returns:
            (step, state, data record or None) of one step; None if there is no checkpoint.

        Raises:
            NoRestorableCheckpointError: checkpoints exist but every one is damaged.
            CheckpointMismatchError: the newest intact checkpoint holds another train state.
            CheckpointReadError: a checkpoint could not be read for a reason other than damage.
        """
        self.wait_until_finished()
        steps = sorted(self._decided(self._reloaded_steps,
                                     what=f"list the checkpoints in {self._directory}"),
                       reverse=True)
        if not steps:
            return None
        failures: list[tuple[int, str]] = []
        for step in steps:
            check = self._decided(functools.partial(self._check_step, step),
                                  what=f"check that {self.step_path(step)} is finished")
            if check["newer"] is not None:  # every process: process 0's answer
                raise CheckpointFormatError(check["newer"])
            outcome, restored, error = self._try_restore(
                step, abstract_state, problem=check["problem"], has_data=check["data"])
            worst = worst_over_processes(outcome)
            if worst is Outcome.RESTORED:
                self._set_aside_failures([s for s, _ in failures])
                state, data = restored
                return step, state, data
            if worst is Outcome.FATAL:
                if error is None:
                    raise CheckpointReadError(
                        f"Checkpoint {self.step_path(step)} could not be read on another process "
                        "(see its log); nothing was moved.")
                raise error
            reason = short_error(error) if error is not None else "damaged on another process"
            logging.warning(
                "Checkpoint %s is damaged (%s); trying the previous one.",
                self.step_path(step), reason,
            )
            failures.append((step, reason))
        listing = "\n".join(f"  {self.step_path(s)}: {reason}" for s, reason in failures)
        raise NoRestorableCheckpointError(
            f"None of the {len(steps)} checkpoints under {self._directory} can be restored; "
            f"nothing was moved or deleted. Fix or move them to start from scratch:\n{listing}"
        )

    def _reloaded_steps(self) -> list[int]:
        """On process 0 only: the steps in the directory now, ascending."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def _check_step(self, step: int) -> dict[str, Any]:
        """On process 0: why `step` is not finished (or None), whether it holds a data record."""
        path = self.step_path(step)
        problem = incomplete(path)
        return {"problem": problem, "data": problem is None and (path / _DATA_ITEM).exists(),
                "newer": newer_format(path)}

    def _try_restore(
        self, step: int, abstract_state: PyTree, *, problem: str | None, has_data: bool
    ) -> tuple[Outcome, tuple[PyTree, Any] | None, BaseException | None]:
        """Restores one step's state and data record on this process, classifying any failure.

        `problem` (why the step is not finished) and `has_data` are process 0's answers, the same
        on every process.
        """
        path = self.step_path(step)
        try:
            if problem is not None:
                raise CheckpointDamagedError(problem)
            handler = ocp.StandardCheckpointHandler()
            try:
                saved = handler.metadata(path / _ITEM)
            finally:
                handler.close()
            saved_tree = getattr(saved, "tree", saved)
            problems = mismatches(saved_tree, abstract_state)
            earlier = earlier_optimizer_layout(saved_tree, abstract_state) if problems else None
            if problems and earlier is None:
                return Outcome.FATAL, None, CheckpointMismatchError(
                    f"Checkpoint {path} is intact but does not match this run's train state "
                    f"({len(problems)} entries):\n" + "\n".join(problems[:20])
                    + ("\n  ..." if len(problems) > 20 else "")
                    + "\nNothing was moved. Resume it with the model settings it was saved with "
                    "(the job's config.json / config.previous-N.json), use a new --job_log_dir, "
                    "or start a new job from its parameters with "
                    f"--fdl.CHECKPOINT_RESTORE_PATH={path} (fresh optimizer state).")
            target = abstract_state if earlier is None else layout.with_opt_state(
                abstract_state, earlier.restore_target(layout.opt_state_of(abstract_state)))
            target, rebuild = without_absent_empty_fields(saved_tree, target)
            items = {_ITEM: ocp.args.StandardRestore(target)}
            if has_data:
                items[_DATA_ITEM] = ocp.args.JsonRestore()
            restored = self._manager.restore(step, args=ocp.args.Composite(**items))
            data = restored[_DATA_ITEM] if _DATA_ITEM in items else None
            state = restored[_ITEM]
            if rebuild is not None:
                state = rebuild(dict(state))
            if earlier is not None:
                current = layout.opt_state_of(abstract_state)
                state = layout.with_opt_state(
                    state, earlier.to_current(layout.opt_state_of(state), current))
                logging.warning(
                    "Checkpoint %s holds the optimizer state of the earlier layout (%d stages, "
                    "disabled ones left out); its Adam state and schedule count were mapped "
                    "into the current %d-stage layout.", path, earlier.length, len(current))
            return Outcome.RESTORED, (state, data), None
        except Exception as error:  # noqa: BLE001 - TensorStore raises bare Exception.
            if is_damage(error):
                return Outcome.DAMAGED, None, error
            read_error = CheckpointReadError(
                f"Checkpoint {path} could not be read ({short_error(error)}). This is not a sign "
                "of damage, so nothing was moved and no older checkpoint was used; fix the cause "
                "(permissions, storage) and rerun.")
            read_error.__cause__ = error
            return Outcome.FATAL, None, read_error

    def all_steps(self) -> list[int]:
        """Saved (and in-progress) steps, ascending, as process 0 knows them.

        A collective (every process calls it), so that every process acts on the same list.
        """
        return self._decided(lambda: sorted(self._manager.all_steps()),
                             what=f"list the checkpoints in {self._directory}")

    def wait_until_finished(self) -> None:
        """Blocks until an asynchronous save has been committed; raises its error if it failed
        (CheckpointSaveError naming its step if storage refused it)."""
        step, self._in_flight = self._in_flight, None
        try:
            self._manager.wait_until_finished()
        except Exception as error:  # TensorStore raises a bare ValueError; re-raised if not storage
            fault = storage_fault(error)
            if fault is None or step is None:
                raise
            raise self._save_failed(step, fault) from error

    def raise_if_refused(self) -> None:
        """CheckpointSaveError once the save in flight ended refused, not an interval later at the
        next save. One process only: several would find it at different steps."""
        if self._in_flight is not None and jax.process_count() == 1 and not self.saving():
            self.wait_until_finished()

    def saving(self) -> bool:
        """Whether a save is still being written (not blocking)."""
        return self._manager.is_saving_in_progress()

    def close(self) -> None:
        try:
            self.wait_until_finished()
        finally:
            try:
                self._manager.close()
            finally:
                self._quiet.__exit__()
                for leftover in self._refused:
                    shutil.rmtree(leftover, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _set_aside_failures(self, steps: list[int]) -> None:
        """Moves unreadable checkpoints newer than the restored one out of the step listing."""
        if not steps:
            return
        if self._enable_saving and jax.process_index() == 0:
            for step in steps:
                path = self.step_path(step)
                if path.exists():
                    moved = move_aside(path, directory=self._directory)
                    logging.warning("Moved the damaged checkpoint %s to %s.", path, moved)
        elif not self._enable_saving:
            logging.warning(
                "Read-only (saving disabled or --mode=eval), so the damaged checkpoints %s stay "
                "where they are.",
                [str(self.step_path(s)) for s in steps],
            )
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("paxlite_checkpoint_set_aside")
        self._manager.reload()
