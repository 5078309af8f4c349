"""The train and eval loops: restore or initialise, step, summarise, evaluate, checkpoint.

The loop owns everything impure (time, files, host transfers); the steps stay pure. Host synchronisation is kept
off the critical path: the finiteness of step s's loss is read after step s+1 has been dispatched, except where a
value is needed at once (a summary, an evaluation, a checkpoint).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import jax
import numpy as np
from absl import logging

from paxlite.config.run import RunConfig
from paxlite.data.feed import make_feed
from paxlite.data.feeding import plan_feeding
from paxlite.eval.boolq import boolq_acc
from paxlite.eval.lambada import acc_strict
from paxlite.models.transformer import Transformer
from paxlite.parallel import mesh as mesh_lib
from paxlite.parallel import rules as rules_lib
from paxlite.train import flops as flops_lib
from paxlite.train.checkpoint import Checkpointer
from paxlite.train.metrics import MetricsWriter
from paxlite.train.optimizer import make_optimizer
from paxlite.train.schedules import make_schedule
from paxlite.train.step import CompiledSteps, TrainState, compile_steps, microbatch_size


class TrainingDivergedError(FloatingPointError):
    """A non-finite loss or gradient norm; the bad state is never checkpointed."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunContext:
    """What a run needs besides its configuration: where it writes and what it may do there."""

    job_dir: str
    enable_checkpoint_saving: bool = True
    async_checkpointing: bool = True
    training: bool = True  # False (--mode=eval): the training data is not opened


class Run:
    """One run's mesh, compiled steps, data, checkpointer and metrics writer."""

    def __init__(self, config: RunConfig, context: RunContext):
        self.config = config
        self.context = context
        self.mesh = mesh_lib.build_mesh(config.mesh)
        num_devices = self.mesh.devices.size
        self.global_batch_size = mesh_lib.global_batch_size(
            percore_batch_size=config.loop.percore_batch_size,
            num_devices=num_devices,
            batch_split=rules_lib.batch_split(self.mesh),
            fixed_global_batch_size=config.loop.global_batch_size,
        )
        # Each optimizer step's microbatches must split over data x fsdp too; say so before compiling.
        microbatch_size(global_batch_size=self.global_batch_size, grad_accum_steps=config.loop.grad_accum_steps,
                        batch_split=rules_lib.batch_split(self.mesh))
        seq_len = config.model.max_seq_len
        self.tokens_per_step = self.global_batch_size * seq_len
        # Data first: a missing dataset or vocabulary is reported before anything is compiled.
        needs_train_data = context.training or config.eval_task is None
        if needs_train_data and config.data is None:
            raise ValueError(
                f"{config.experiment} has no training data: pass --fdl.DATA_DIR=<a directory made by "
                "python -m paxlite.data.prepare> or --fdl.SYNTHETIC_DATA=true"
            )
        plan = plan_feeding(rules_lib.batch_sharding(self.mesh), global_batch_size=self.global_batch_size,
                            seq_len=seq_len)
        self.data = make_feed(config.data, plan=plan) if needs_train_data else None
        self.eval_data = (make_feed(config.eval_task, plan=plan)
                          if config.eval_task is not None else self.data)
        self.schedule = make_schedule(config.schedule)
        self.model = Transformer(config.model)
        deterministic = config.model.dropout_prob == 0 and config.model.input_dropout_prob == 0
        with jax.set_mesh(self.mesh):
            self.steps: CompiledSteps = compile_steps(
                model=self.model,
                optimizer=make_optimizer(config.optimizer, self.schedule),
                schedule=self.schedule,
                mesh=self.mesh,
                seq_len=seq_len,
                seed=config.loop.seed,
                deterministic=deterministic,
                grad_accum_steps=config.loop.grad_accum_steps,
            )
        self.peak_flops = flops_lib.peak_flops_per_device(
            jax.devices()[0].device_kind, override_tflops=config.loop.peak_tflops
        )
        self.checkpointer = Checkpointer(
            os.path.join(context.job_dir, "checkpoints"),
            save_interval_steps=config.loop.checkpoint_every_n_steps,
            max_to_keep=config.loop.checkpoint_max_to_keep,
            enable_saving=context.enable_checkpoint_saving,
            async_save=context.async_checkpointing,
        )
        self.writer = MetricsWriter(
            context.job_dir, enabled=jax.process_index() == 0, max_steps=config.loop.max_steps
        )

    def close(self) -> None:
        self.checkpointer.close()
        self.writer.close()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- state
    def restore_or_init(self) -> TrainState:
        with jax.set_mesh(self.mesh):
            restored = self.checkpointer.restore_latest(self.steps.abstract_state)
            if restored is not None:
                step, state = restored
                if self.data is not None:
                    self.data.restore(self.checkpointer.restore_data(step), step=step)
                logging.info("Resumed from checkpoint step %d in %s", step, self.context.job_dir)
                return state
            logging.info("No checkpoint in %s: initialising from seed %d",
                         self.context.job_dir, self.config.loop.seed)
            return self.steps.init()

    # ---------------------------------------------------------------- eval
    def evaluate(self, state: TrainState) -> dict[str, float]:
        sums = {"loss_sum": 0.0, "correct_tokens": 0.0, "target_tokens": 0.0}
        per_example: dict[str, list[np.ndarray]] = {"correct": [], "targets": [], "weights": [], "choice": []}
        with jax.set_mesh(self.mesh):
            for batch in self.eval_data.eval_batches(self.config.loop.eval_num_batches,
                                                     self.steps.batch_sharding):
                out = jax.device_get(self.steps.eval(state.params, batch))
                for key in sums:
                    sums[key] += float(np.sum(out[key]))
                if "example_weights" in out:
                    per_example["correct"].append(out["correct_tokens"])
                    per_example["targets"].append(out["target_tokens"])
                    per_example["weights"].append(out["example_weights"])
                if "choice_correct" in out:  # a two-way choice per example (BoolQ)
                    per_example["choice"].append(out["choice_correct"])
        if sums["target_tokens"] == 0:
            raise ValueError("the evaluation data has no weighted tokens; nothing to evaluate")
        loss = sums["loss_sum"] / sums["target_tokens"]
        metrics = {
            "loss": loss,
            "accuracy": sums["correct_tokens"] / sums["target_tokens"],
            "log_pplx": loss,
            "num_tokens": sums["target_tokens"],
        }
        if per_example["choice"]:  # Pax's boolq_acc: the right answer's logit beats the other's
            metrics[f"{self.eval_data.metric_prefix}acc"] = boolq_acc(
                choice_correct=np.concatenate(per_example["choice"]),
                example_weights=np.concatenate(per_example["weights"]),
            )
        elif per_example["weights"]:
            metrics[f"{self.eval_data.metric_prefix}acc_strict"] = acc_strict(
                correct_tokens=np.concatenate(per_example["correct"]),
                target_tokens=np.concatenate(per_example["targets"]),
                example_weights=np.concatenate(per_example["weights"]),
            )
        return metrics

    def run_eval(self) -> dict[str, float]:
        """--mode=eval: evaluate the latest checkpoint; there must be one."""
        with jax.set_mesh(self.mesh):
            restored = self.checkpointer.restore_latest(self.steps.abstract_state)
        if restored is None:
            raise FileNotFoundError(
                f"--mode=eval needs a checkpoint, and {self.checkpointer.directory} has none; "
                "train first or point --job_log_dir at a training job's directory"
            )
        step, state = restored
        metrics = self.evaluate(state)
        self.writer.write_eval(step, metrics)
        return metrics

    # ---------------------------------------------------------------- train
    def train(self) -> TrainState:
        loop = self.config.loop
        state = self.restore_or_init()
        start = int(jax.device_get(state.step))
        if start >= loop.max_steps:
            logging.info("Checkpoint step %d >= MAX_STEPS=%d: nothing to train", start, loop.max_steps)
            return state
        logging.info(
            "Training %s from step %d to %d: global batch %d x %d tokens on mesh %s",
            self.config.experiment, start, loop.max_steps, self.global_batch_size,
            self.config.model.max_seq_len, dict(self.mesh.shape),
        )
        pending: tuple[int, dict[str, jax.Array]] | None = None
        timer_start, timer_steps = time.perf_counter(), 0
        with jax.set_mesh(self.mesh):
            for index in range(start, loop.max_steps):
                step = index + 1
                batch = self.data.train_batch(index, self.steps.batch_sharding)
                state, metrics = self.steps.train(state, batch)
                if pending is not None:  # read the previous step while this one runs
                    self._check_finite(*pending)
                pending = (step, metrics)
                if step == start + 1:  # the compiling step is not timed
                    jax.block_until_ready(metrics)
                    timer_start, timer_steps = time.perf_counter(), 0
                else:
                    timer_steps += 1
                if not self._boundary(step):
                    continue
                host = self._check_finite(step, metrics)
                pending = None
                if step % loop.summary_interval_steps == 0 or step == loop.max_steps:
                    step_time = (time.perf_counter() - timer_start) / timer_steps if timer_steps else None
                    self._write_train(step, host, step_time)
                if step % loop.eval_interval_steps == 0 or step == loop.max_steps:
                    self.writer.write_eval(step, self.evaluate(state))
                if self.checkpointer.should_save(step) or step == loop.max_steps:
                    self._check_state_finite(step, state)
                    self.checkpointer.save(step, state, force=step == loop.max_steps,
                                           data_state=self.data.state())
                timer_start, timer_steps = time.perf_counter(), 0
            if pending is not None:
                self._check_finite(*pending)
        self.checkpointer.wait_until_finished()
        return state

    def _boundary(self, step: int) -> bool:
        loop = self.config.loop
        return (
            step == loop.max_steps
            or step % loop.summary_interval_steps == 0
            or step % loop.eval_interval_steps == 0
            or self.checkpointer.should_save(step)
        )

    @staticmethod
    def _host(metrics: dict[str, jax.Array]) -> dict[str, float]:
        return {k: float(v) for k, v in jax.device_get(metrics).items()}

    def _check_finite(self, step: int, metrics: dict[str, jax.Array]) -> dict[str, float]:
        host = self._host(metrics)
        bad = [k for k in ("loss", "grad_norm") if not math.isfinite(host[k])]
        if bad:
            saved = self.checkpointer.all_steps()
            raise TrainingDivergedError(
                f"{' and '.join(f'{k}={host[k]}' for k in bad)} at step {step}; stopping without saving "
                f"this state (latest checkpoint: "
                f"{'step %d' % saved[-1] if saved else 'none'} in {self.checkpointer.directory})"
            )
        return host

    def _check_state_finite(self, step: int, state: TrainState) -> None:
        if not bool(jax.device_get(self.steps.all_finite(state.params))):
            raise TrainingDivergedError(
                f"non-finite parameters after step {step}; stopping without saving this state"
            )

    def _write_train(self, step: int, host: dict[str, float], step_time: float | None) -> None:
        tokens_per_s = self.tokens_per_step / step_time if step_time else None
        mfu = None
        if tokens_per_s is not None:
            mfu = flops_lib.model_flops_utilization(
                tokens_per_s=tokens_per_s,
                flops_per_token=self.config.loop.flops_per_token,
                peak_flops_per_device=self.peak_flops,
                num_devices=self.mesh.devices.size,
            )
        self.writer.write_train(
            step,
            {
                "loss": host["loss"],
                "accuracy": host["accuracy"],
                "learning_rate": host["learning_rate"],
                "grad_norm": host["grad_norm"],
                "step_time_s": step_time,
                "tokens_per_s": tokens_per_s,
                "mfu": mfu,
            },
        )

