"""The train and eval loops: restore or initialise, step, summarise, evaluate, checkpoint.

The loop owns everything impure (time, files, host transfers); the steps stay pure. Host work is
kept off the critical path: batches are built and put on the devices by a producer thread ahead of
the step (data/prefetch.py), and each step's metrics stay on the device until a summary, evaluation
or checkpoint boundary, where they are read in one transfer with a finiteness flag per step
(train/device_metrics.py); between boundaries the host waits for nothing but a bound on how far it
runs ahead. The evaluation loop itself is train/eval_loop.py; how a run is built, phase by phase,
train/run_build.py; how its steps are timed, train/step_timer.py.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from typing import Self

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from paxlite.checkpointing.checkpoint import CheckpointSaveError
from paxlite.checkpointing.storage_faults import close_keeping, reading_inputs
from paxlite.data.chat_pipeline import chat_train_summaries
from paxlite.data.dpo_pipeline import dpo_train_summaries
from paxlite.data.feed import close_feeds, mixture_summaries, prefetch_train_batches
from paxlite.errors import NotFoundError, RunStoppedError, UserError
from paxlite.train import device_metrics, run_build
from paxlite.train.eval_loop import Evaluator
from paxlite.train.peer_faults import PeerFaults
from paxlite.train.peer_liveness import Activity, RunProgress
from paxlite.train.preemption import Preemption
from paxlite.train.profiling import StepProfiler
from paxlite.train.run_build import RunContext
from paxlite.train.run_config import RunConfig, SaveFailure
from paxlite.train.step import CompiledSteps, TrainState
from paxlite.train.watchdog import Watchdog

# Steps (and evaluation batches) the host may dispatch beyond the newest one known to be computed:
# enough to keep the device busy, few enough that the batches waiting on it stay few.
_STEPS_AHEAD = 2
# After a stop signal, the most steps a run trains beyond the one in flight (train/preemption.py).
MAX_STEPS_AFTER_SIGNAL = _STEPS_AHEAD + 1


def stop_signals(*, voting: bool | None = None) -> Preemption:
    """SIGTERM/SIGINT handlers for a training loop (a context manager; train/preemption.py).
    `voting`: default, when there are several processes."""
    return Preemption(lag=_STEPS_AHEAD, voting=voting)


class TrainingDivergedError(RunStoppedError, FloatingPointError):
    """A non-finite loss or gradient norm; the bad state is never checkpointed."""


class Run:
    """One run's mesh, compiled steps, data, checkpointer and metrics writer (built in the phases
    of train/run_build.py, in the order they report mistakes)."""

    def __init__(self, config: RunConfig, context: RunContext):
        self.config = config
        self.context = context
        layout = run_build.batch_layout(config)
        self.mesh = layout.mesh
        self.global_batch_size = layout.global_batch_size
        self.tokens_per_step = layout.tokens_per_step
        # Data first: a missing dataset or vocabulary is reported before anything is compiled.
        self.data, self.eval_data = run_build.open_feeds(config, layout=layout,
                                                         training=context.training)
        self.lm_eval = run_build.lm_eval_scorer(config, layout=layout)
        self.checkpointer = run_build.open_checkpointer(config, context=context)
        with contextlib.ExitStack() as on_error:
            on_error.callback(self.checkpointer.close)
            # metrics.jsonl, and the W&B run WANDB_PROJECT asks for, before anything compiles
            self.writer = on_error.enter_context(run_build.metrics_writer(config, context=context))
            run_build.check_data_position(self.checkpointer, data=self.data)
            self.steps: CompiledSteps = run_build.compile_run_steps(config, mesh=self.mesh)
            on_error.pop_all()
        self._timer = run_build.make_step_timer(config, layout=layout)
        # The step a SIGTERM/SIGINT stopped training at (None: not stopped), and whether its
        # checkpoint was written and committed (not with --enable_checkpoint_saving=false).
        self.preempted_at: int | None = None
        self.preempted_saved = False
        self._progress = RunProgress()  # where the loop is; train() shares its peers' record
        # checkpoint/save_s (the loop's seconds in saves since the last train line; None: no save)
        # and checkpoint/failed_saves (refused saves so far, CHECKPOINT_SAVE_FAILURE='continue').
        self._save_seconds: float | None = None
        self._failed_saves = 0
        # Knows whether the eval step has compiled: the first batch compiles (not timed by the
        # watchdog).
        self._evaluator = Evaluator(self.steps, self.mesh, num_batches=config.loop.eval_num_batches,
                                    steps_ahead=_STEPS_AHEAD)
        self._pretrained_plan: run_build.PretrainedPlan | None = None
        try:  # checked now, before any state is built
            if (config.loop.checkpoint_restore_path is not None
                    and not self.checkpointer.all_steps()):
                self._pretrained_plan = self._plan_pretrained()
            if self.steps.abstract_reference and config.dpo.reference_path is not None:
                run_build.reference_plan(config, abstract_params=self.steps.abstract_reference[0])
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        self.checkpointer.close()
        self.writer.close()
        close_feeds(self.data, self.eval_data)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        close_keeping(self.close, ending=kind)  # the error in flight keeps its one line

    # ---------------------------------------------------------------- state
    def restore_or_init(self) -> TrainState:
        """Pax's order: (1) the latest checkpoint of this job (resume), else (2) a fresh
        initialisation, overwritten from CHECKPOINT_RESTORE_PATH where one is set (step 0, fresh
        optimizer state)."""
        restore_path = self.config.loop.checkpoint_restore_path
        with jax.set_mesh(self.mesh):
            # The data record comes from the step the state came from (one walk-back for both).
            restored = self.checkpointer.restore_latest_with_data(self.steps.abstract_state)
            if restored is not None:
                step, state, data_record = restored
                if self.data is not None:
                    run_build.restore_data_position(self.data, data_record, step=step)
                logging.info("Resumed from checkpoint step %d in %s", step, self.context.job_dir)
                if restore_path is not None:
                    logging.info("CHECKPOINT_RESTORE_PATH=%s is ignored: it only initialises a run "
                                 "that has no checkpoint of its own", restore_path)
                return state
            logging.info("No checkpoint in %s: initialising from seed %d",
                         self.context.job_dir, self.config.loop.seed)
            return self._init_state()

    def _init_state(self) -> TrainState:
        """A fresh state, its parameters overwritten from CHECKPOINT_RESTORE_PATH where one is set
        (read first, so a bad path or shape is reported before anything compiles)."""
        if self.config.loop.checkpoint_restore_path is None:
            return self.steps.init()
        # Checked when the run was built; again only if this run had checkpoints of its own then.
        plan = self._pretrained_plan or self._plan_pretrained()
        # The restored parameters are never sampled first (init_with: only the rest is).
        state = self.steps.init_with(run_build.read_pretrained(self.config, plan=plan))
        if jax.tree.leaves(state.fp8):  # a restore path holds parameters only (pretrained.py)
            logging.info("FP8 scaling state (%d arrays) starts fresh: CHECKPOINT_RESTORE_PATH "
                         "provides parameters only", len(jax.tree.leaves(state.fp8)))
        return state

    def _bind_reference(self, state: TrainState) -> None:
        self.steps = self._with_reference(state)
        self._evaluator = Evaluator(self.steps, self.mesh,
                                    num_batches=self.config.loop.eval_num_batches,
                                    steps_ahead=_STEPS_AHEAD)

    def _with_reference(self, state: TrainState) -> CompiledSteps:
        """The compiled steps with the DPO reference bound (train/dpo.py): DPO_REFERENCE_PATH's
        parameters, else those training starts from (CHECKPOINT_RESTORE_PATH's over a fresh
        initialisation, as at step 0 of this job): `state`'s own at step 0 (copied, since the
        train step donates the state), built again on a resume. A LoRA run without
        DPO_REFERENCE_PATH has no reference of its own (the adapters off)."""
        if not self.steps.abstract_reference:
            return self.steps
        with jax.set_mesh(self.mesh):
            if self.config.dpo.reference_path is not None:
                return self.steps.with_reference(run_build.read_reference(
                    self.config, abstract_params=self.steps.abstract_reference[0]))
            if int(jax.device_get(state.step)) == 0:
                reference = jax.jit(functools.partial(jax.tree.map, jnp.copy),
                                    out_shardings=self.steps.state_shardings.params)(state.params)
            else:
                reference = self._init_state().params
        logging.info("DPO reference: the parameters this job started from (%s)",
                     self.config.loop.checkpoint_restore_path
                     or f"initialised from seed {self.config.loop.seed}")
        return self.steps.with_reference(reference)

    def _plan_pretrained(self) -> run_build.PretrainedPlan:
        return run_build.pretrained_plan(self.config,
                                         abstract_params=self.steps.abstract_state.params)

    # ---------------------------------------------------------------- eval
    def evaluate(self, state: TrainState, *, watchdog: Watchdog | None = None) -> dict[str, float]:
        """Eval metrics over EVAL_LOOP_NUM_BATCHES batches of the eval data (train/eval_loop.py);
        `watchdog` is told of each batch computed: a long evaluation is progress, not a hang."""
        return self._evaluator.evaluate(state, self.eval_data, watchdog=watchdog)

    def run_eval(self) -> dict[str, float]:
        """--mode=eval: evaluate the latest checkpoint of the job; without one, the parameters
        CHECKPOINT_RESTORE_PATH gives (at step 0, as Pax's EVAL_ONLY runs of run_llama_boolq.sh)."""
        restore_path = self.config.loop.checkpoint_restore_path
        with jax.set_mesh(self.mesh):
            restored = self.checkpointer.restore_latest(self.steps.abstract_state)
            latest = self.checkpointer.all_steps()
            if restored is not None and latest and restored[0] != latest[-1]:
                logging.warning(
                    "--mode=eval evaluates step %d: the newer checkpoints %s are damaged and were "
                    "left in place (eval never changes %s)", restored[0],
                    [s for s in latest if s > restored[0]], self.checkpointer.directory)
            if restored is None and restore_path is not None:
                restored = 0, self._init_state()
        if restored is None:
            raise NotFoundError(
                f"--mode=eval needs a checkpoint, and {self.checkpointer.directory} has none; "
                "train first, point --job_log_dir at a training job's directory, or give "
                "--fdl.CHECKPOINT_RESTORE_PATH"
            )
        step, state = restored
        self._bind_reference(state)
        logging.info("Evaluating step %d", step)
        metrics = self.evaluate(state)
        self.writer.write_eval(step, metrics)
        if self.lm_eval is not None:
            scores = self.lm_eval.score(state.params)
            self.writer.write_lm_eval(step, scores)
            metrics = {**metrics, **scores}
        return metrics

    # ---------------------------------------------------------------- train
    def train(self, *, preemption: Preemption | None = None, watchdog: Watchdog | None = None,
              peers: PeerFaults | None = None) -> TrainState:
        """Train to MAX_STEPS, or until SIGTERM/SIGINT (then `preempted_at` is the step it stopped
        after, and `preempted_saved` whether that step's checkpoint was committed).

        `preemption`: handlers the caller installed earlier (job.py does, before the run is built
        and compiled, from `stop_signals()`); else they are installed here. `watchdog`: a hang
        watchdog not yet started; by default one with WATCHDOG_TIMEOUT_SECONDS /
        CRASH_ON_HANG_TIMEOUT_SECONDS. `peers`: the watcher of a run of several processes that
        the caller started (job.py does, before the run is built); else one is started here."""
        loop = self.config.loop
        # From here a stop signal waits for a step and its checkpoint, and a hang is reported.
        with contextlib.ExitStack() as stack:
            if preemption is None:
                preemption = stack.enter_context(stop_signals())
            if watchdog is None:
                watchdog = Watchdog(timeout_s=loop.watchdog_timeout_seconds,
                                    crash_timeout_s=loop.crash_on_hang_timeout_seconds)
            stack.enter_context(watchdog)
            # Several processes: a fault on one stops them all with its line (peer_faults.py).
            if peers is None:
                peers = stack.enter_context(PeerFaults())
            if peers.active:
                self.checkpointer.on_refused_save(peers.publish)
            self._progress = peers.progress
            try:
                state = self._train(preemption, watchdog)
            except (UserError, RunStoppedError) as error:
                peers.stop_every_process(error)
                raise
        if self.preempted_at is not None and self.preempted_saved:
            logging.warning("%s: stopped after step %d with its checkpoint committed in %s; run "
                            "the same command again to resume", preemption.signal_name,
                            self.preempted_at, self.checkpointer.directory)
        elif self.preempted_at is not None:
            saved = self.checkpointer.all_steps()
            logging.warning("%s: stopped after step %d WITHOUT a checkpoint: saving is off "
                            "(--enable_checkpoint_saving=false), so this run's training is lost; "
                            "the same command would start again from %s", preemption.signal_name,
                            self.preempted_at,
                            f"step {saved[-1]} in {self.checkpointer.directory}" if saved
                            else "the beginning (there is no checkpoint)")
        return state

    def _train(self, preemption: Preemption, watchdog: Watchdog) -> TrainState:
        loop = self.config.loop
        state = self.restore_or_init()
        self._bind_reference(state)
        start = int(jax.device_get(state.step))
        if start >= loop.max_steps:
            logging.info("Checkpoint step %d >= MAX_STEPS=%d: nothing to train", start,
                         loop.max_steps)
            return state
        logging.info(
            "Training %s from step %d to %d: global batch %d x %d tokens on mesh %s",
            self.config.experiment, start, loop.max_steps, self.global_batch_size,
            self.config.model.max_seq_len, dict(self.mesh.shape),
        )
        kept = device_metrics.StepMetrics()  # this window's metrics, still on the device
        position = self.data.position()  # where the consumed batches end (saved with the state)
        timer = self._timer
        timer.restart()
        profiler = StepProfiler(
            log_dir=os.path.join(self.context.job_dir, "summaries", "profile"),
            capture_step=loop.profiler_capture_step, num_steps=loop.profiler_num_steps,
            min_duration_sec=loop.profiler_min_duration_sec, first_step=start + 1,
            last_step=loop.max_steps)
        batches = prefetch_train_batches(
            self.data, start=start, stop=loop.max_steps, sharding=self.steps.batch_sharding,
            balance_seq_shards=self.mesh.shape["seq"] if loop.seq_load_balance else 1)
        with jax.set_mesh(self.mesh), contextlib.closing(profiler), contextlib.closing(batches):
            progress = self._progress
            for index in range(start, loop.max_steps):
                step = index + 1
                progress.step, progress.activity = step, Activity.TRAINING
                with profiler.step(step):
                    with self._reading_inputs(step):  # the batch only, not the step's dispatch
                        batch, position = timer.next_batch(batches)
                    if preemption.voting:  # the processes' stop flags reduced inside the step
                        state, metrics, vote = self.steps.train_voting(
                            state, batch, preemption.votes(self.steps.vote_sharding))
                    else:
                        (state, metrics), vote = self.steps.train(state, batch), None
                # Writing the trace takes a while: kept out of step_time_s.
                timer.exclude(profiler.after_step(step, (state, metrics)))
                kept.add(step, metrics)
                if step == start + 1:  # the compiling step is not timed
                    jax.block_until_ready(metrics)
                    timer.restart()
                else:
                    timer.count_step()
                try:  # the last save's fault as soon as it ended, not at the next save
                    self.checkpointer.raise_if_refused()
                except CheckpointSaveError as error:
                    self._go_on_after(error)
                boundary = self._boundary(step)
                # The same answer on every process; on the vote of this step where the loop waits
                # for it anyway (the first step, a boundary), else of the step _STEPS_AHEAD back.
                stop = preemption.should_stop(step, vote=vote, synced=boundary or step == start + 1)
                if not stop and not boundary:
                    kept.wait_for(_STEPS_AHEAD)
                    watchdog.beat()
                    continue
                host = self._read_checked(kept)
                if step % loop.summary_interval_steps == 0 or step == loop.max_steps:
                    # a mixture's data/mixture/<source>: its token share of the consumed batches;
                    # TRAIN_TASK=chat's data/chat/ counts
                    self._write_train(step, host, timing=timer.summary(),
                                      extra={**mixture_summaries(self.data, position),
                                             **chat_train_summaries(self.data),
                                             **dpo_train_summaries(self.data)})
                if self.eval_data is not None and (
                        step % loop.eval_interval_steps == 0 or step == loop.max_steps):
                    progress.activity = Activity.EVALUATING
                    with self._reading_inputs(step):
                        evaluated = self.evaluate(state, watchdog=watchdog)
                    self.writer.write_eval(step, evaluated)
                if self.lm_eval is not None and self.lm_eval.due(step):
                    with watchdog.compiling():  # scoring compiles programs of its own: not a step
                        self.writer.write_lm_eval(step, self.lm_eval.score(state.params))
                last = step == loop.max_steps or stop
                saved = False
                if self.checkpointer.should_save(step) or last:
                    self._check_state_finite(step, state)
                    progress.activity = Activity.SAVING
                    with watchdog.committing():  # it may wait for the previous save's commit
                        saved = self._save(step, state, force=last,
                                           data_state=self.data.state(position))
                watchdog.beat()
                if stop:
                    self.preempted_at, self.preempted_saved = step, saved
                    break
                timer.restart()
            if len(kept):
                self._read_checked(kept)
        progress.activity = Activity.FINISHING
        with watchdog.committing():
            self.checkpointer.wait_until_finished()
        return state

    def _reading_inputs(self, step: int):
        """An input file that vanished while `step`'s batch or evaluation was read: one line naming
        it and the step, exit status 75; the same command resumes once it is back."""
        return reading_inputs(step=step, complete=self.checkpointer.newest_complete_step)

    def _save(self, step: int, state: TrainState, *, force: bool, data_state) -> bool:
        """Starts `step`'s checkpoint save, its seconds counted into checkpoint/save_s. A save that
        storage refused (this one, or the previous one it first waits for) stops the run, or with
        CHECKPOINT_SAVE_FAILURE='continue' is logged in one line and counted, and training goes
        on: the next interval saves again (the wait for the last save stops the run either way).
        """
        started = time.perf_counter()
        try:
            while True:
                try:
                    return self.checkpointer.save(step, state, force=force, data_state=data_state)
                except CheckpointSaveError as error:
                    self._go_on_after(error)
                    if error.step == step:
                        return False
                    # the previous save's fault: this step's save is still to be started
        finally:
            self._save_seconds = (self._save_seconds or 0.0) + time.perf_counter() - started

    def _go_on_after(self, error: CheckpointSaveError) -> None:
        """A refused save stops the run, or with CHECKPOINT_SAVE_FAILURE='continue' is logged in
        one line and counted."""
        if self.config.loop.checkpoint_save_failure is SaveFailure.STOP:
            raise error
        self._failed_saves += 1
        logging.warning("%s; training goes on (CHECKPOINT_SAVE_FAILURE='continue') and saves "
                        "again at the next interval", error.failure)

    def _checkpoint_summaries(self) -> dict[str, float]:
        """checkpoint/save_s since the previous train line (if a save was started since) and
        checkpoint/failed_saves (once one failed)."""
        summaries: dict[str, float] = {}
        if self._save_seconds is not None:
            summaries["checkpoint/save_s"], self._save_seconds = self._save_seconds, None
        if self._failed_saves:
            summaries["checkpoint/failed_saves"] = self._failed_saves
        return summaries

    def _boundary(self, step: int) -> bool:
        loop = self.config.loop
        return (
            step == loop.max_steps
            or step % loop.summary_interval_steps == 0
            or step % loop.eval_interval_steps == 0
            or self.checkpointer.should_save(step)
        )

    def _read_checked(self, kept: device_metrics.StepMetrics) -> dict[str, float]:
        """The kept steps' metrics in one transfer; TrainingDivergedError naming the first step
        whose loss or gradient norm is not finite (its flag computed on the device). Returns the
        newest step's metrics."""
        steps, values, finite = kept.read()
        if not finite.all():
            first = int(np.argmin(finite))
            host = {key: float(v[first]) for key, v in values.items()}
            bad = [k for k in device_metrics.FINITE_KEYS if not math.isfinite(host[k])]
            saved = self.checkpointer.all_steps()
            raise TrainingDivergedError(
                f"{' and '.join(f'{k}={host[k]}' for k in bad)} at step {steps[first]}; stopping "
                f"without saving this state (latest checkpoint: "
                f"{f'step {saved[-1]}' if saved else 'none'} in {self.checkpointer.directory})"
            )
        return {key: float(v[-1]) for key, v in values.items()}

    def _check_state_finite(self, step: int, state: TrainState) -> None:
        if not bool(jax.device_get(self.steps.all_finite(state.params))):
            raise TrainingDivergedError(
                f"non-finite parameters after step {step}; stopping without saving this state"
            )

    def _write_train(self, step: int, host: dict[str, float], *, timing: dict[str, float | None],
                     extra: dict[str, float]) -> None:
        self.writer.write_train(
            step,
            {
                "loss": host["loss"],
                "accuracy": host["accuracy"],
                "learning_rate": host["learning_rate"],
                "grad_norm": host["grad_norm"],
                **timing,  # step_time_s, tokens_per_s, mfu, input_wait_fraction (step_timer.py)
                # what the model summarised (MoE: moe/aux_loss, moe/dropped_fraction, ...)
                **{k: v for k, v in host.items() if "/" in k},
                **extra,
                **self._checkpoint_summaries(),
            },
        )
