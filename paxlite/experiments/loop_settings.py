"""The training loop's hyperparameters: batch, steps, checkpoints, profiler, watchdog, seed.

Declared, mapped to `LoopConfig` and checked here. Mixins of ``LanguageModelExperiment`` (base.py),
split where `show` lists other settings between them (base.py says why the order).
"""

from __future__ import annotations

import re

import fiddle as fdl

from paxlite.config.experiment import Derived
from paxlite.models.lora import PAX_LORA_RULE
from paxlite.train.run_config import LoopConfig, SaveFailure


class BatchSettings:
    """Rows per device and how one step's batch is cut (the global batch: GlobalBatchSettings)."""

    PERCORE_BATCH_SIZE: float = 1.0
    # Microbatches per optimizer step. The global batch stays PERCORE_BATCH_SIZE x devices; each
    # step runs forward/backward on global/GRAD_ACCUM_STEPS rows at a time and applies one update.
    GRAD_ACCUM_STEPS: int = 1
    # Sequence positions per block of the chunked loss: the float32 [B, T, V] logits never exist at
    # once (a memory saving for large vocabularies; same loss and gradients). None: whole sequence.
    LOSS_CHUNK_SIZE: int | None = None

    def hparam_problems(self) -> list[str]:
        problems = super().hparam_problems()
        if self.PERCORE_BATCH_SIZE <= 0:
            problems.append(f"PERCORE_BATCH_SIZE must be > 0, got {self.PERCORE_BATCH_SIZE}")
        if self.LOSS_CHUNK_SIZE is not None and self.LOSS_CHUNK_SIZE < 1:
            problems.append(f"LOSS_CHUNK_SIZE must be None (whole sequence) or >= 1, got "
                            f"{self.LOSS_CHUNK_SIZE}")
        if self.GRAD_ACCUM_STEPS < 1:
            problems.append(
                f"GRAD_ACCUM_STEPS must be >= 1 (1: no accumulation), got {self.GRAD_ACCUM_STEPS}; "
                "the global batch must also divide into that many microbatches (checked at "
                "start-up)")
        return problems


class LoopSettings:
    """Steps, intervals, checkpoints, the profiler, the watchdog and the compilation cache."""

    MAX_STEPS: int = 100000
    CHECKPOINT_EVERY_N_STEPS: int = 5000
    CHECKPOINT_MAX_TO_KEEP: int = 10
    # A save that storage refuses (no space, quota, read-only, ...; docs/troubleshooting.md):
    # 'stop' exits with status 75 and one line, the previous checkpoint intact; 'continue' logs
    # the line, counts it (checkpoint/failed_saves in metrics.jsonl) and saves again at the next
    # interval. The last step's save must succeed either way.
    CHECKPOINT_SAVE_FAILURE: str = "stop"
    SUMMARY_INTERVAL_STEPS: int = 100
    EVAL_INTERVAL_STEPS: int = 100
    EVAL_LOOP_NUM_BATCHES: int = 10  # -1: the whole eval set, as Pax
    # Pax's profiler settings (docs/training.md, Profiling): trace steps CAPTURE_STEP onwards (from
    # 1, as metrics.jsonl counts) into DIR/summaries/profile, on process 0; None: no profile. The
    # trace covers NUM_STEPS steps, extended over further steps until MIN_DURATION_SEC have been
    # captured.
    PROFILER_CAPTURE_STEP: int | None = None
    PROFILER_NUM_STEPS: int = 2
    PROFILER_MIN_DURATION_SEC: float = 1.0
    # A step that takes this long logs every thread's stack (train/watchdog.py; AXLearn's
    # --trainer_watchdog_timeout_seconds); one that takes CRASH_ON_HANG_TIMEOUT_SECONDS ends the
    # process with exit status 124 so that the scheduler restarts it. None: never.
    WATCHDOG_TIMEOUT_SECONDS: float | None = 3600.0
    CRASH_ON_HANG_TIMEOUT_SECONDS: float | None = 7200.0
    # JAX's persistent compilation cache (a restarted job does not compile again): in
    # COMPILATION_CACHE_DIR, else $JAX_COMPILATION_CACHE_DIR, else DIR/compilation_cache.
    COMPILATION_CACHE: bool = True
    COMPILATION_CACHE_DIR: str | None = None

    def hparam_problems(self) -> list[str]:
        problems = super().hparam_problems()
        if self.CHECKPOINT_MAX_TO_KEEP <= 0:
            problems.append(f"CHECKPOINT_MAX_TO_KEEP must be positive, got "
                            f"{self.CHECKPOINT_MAX_TO_KEEP}")
        if self.MAX_STEPS < 0:
            problems.append(f"MAX_STEPS must be >= 0, got {self.MAX_STEPS}")
        choices = [policy.value for policy in SaveFailure]
        if self.CHECKPOINT_SAVE_FAILURE not in choices:
            problems.append(f"CHECKPOINT_SAVE_FAILURE must be one of {choices}, got "
                            f"{self.CHECKPOINT_SAVE_FAILURE!r}")
        for name in ("CHECKPOINT_EVERY_N_STEPS", "SUMMARY_INTERVAL_STEPS", "EVAL_INTERVAL_STEPS"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        capture = self.PROFILER_CAPTURE_STEP
        if capture is not None and not 1 <= capture <= self.MAX_STEPS:
            problems.append(
                f"PROFILER_CAPTURE_STEP must be a step from 1 to MAX_STEPS={self.MAX_STEPS} (the "
                f"first step to trace), or None (no profile), got {capture}")
        if self.PROFILER_NUM_STEPS < 1:
            problems.append(f"PROFILER_NUM_STEPS must be >= 1, got {self.PROFILER_NUM_STEPS}")
        if self.PROFILER_MIN_DURATION_SEC < 0:
            problems.append(f"PROFILER_MIN_DURATION_SEC must be >= 0, got "
                            f"{self.PROFILER_MIN_DURATION_SEC}")
        for name in ("WATCHDOG_TIMEOUT_SECONDS", "CRASH_ON_HANG_TIMEOUT_SECONDS"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                problems.append(f"{name} must be > 0 seconds or None (never), got "
                                f"{getattr(self, name)}")
        watchdog, crash = self.WATCHDOG_TIMEOUT_SECONDS, self.CRASH_ON_HANG_TIMEOUT_SECONDS
        if watchdog is not None and crash is not None and crash < watchdog:
            problems.append(f"CRASH_ON_HANG_TIMEOUT_SECONDS={crash} must be >= "
                            f"WATCHDOG_TIMEOUT_SECONDS={watchdog} (stacks are logged first)")
        if self.COMPILATION_CACHE_DIR is not None and not self.COMPILATION_CACHE:
            problems.append(f"COMPILATION_CACHE_DIR={self.COMPILATION_CACHE_DIR!r} is set but "
                            "COMPILATION_CACHE=False turns the cache off; drop one of them")
        if self.EVAL_LOOP_NUM_BATCHES < 1 and self.EVAL_LOOP_NUM_BATCHES != -1:
            problems.append(f"EVAL_LOOP_NUM_BATCHES must be >= 1 or -1 (all), got "
                            f"{self.EVAL_LOOP_NUM_BATCHES}")
        return problems

    def unread_profiler_problems(self) -> list[str]:
        unused = sorted(set(self.overridden) & {"PROFILER_NUM_STEPS", "PROFILER_MIN_DURATION_SEC"})
        if unused and self.PROFILER_CAPTURE_STEP is None:
            return [(f"{', '.join(unused)} set but PROFILER_CAPTURE_STEP is None, so nothing is "
                    "profiled: add --fdl.PROFILER_CAPTURE_STEP=<first step to trace>")]
        return []

    def loop_config(self) -> fdl.Config[LoopConfig]:
        return fdl.Config(
            LoopConfig,
            max_steps=self.MAX_STEPS,
            percore_batch_size=self.PERCORE_BATCH_SIZE,
            summary_interval_steps=self.SUMMARY_INTERVAL_STEPS,
            eval_interval_steps=self.EVAL_INTERVAL_STEPS,
            eval_num_batches=self.EVAL_LOOP_NUM_BATCHES,
            checkpoint_every_n_steps=self.CHECKPOINT_EVERY_N_STEPS,
            checkpoint_max_to_keep=self.CHECKPOINT_MAX_TO_KEEP,
            seed=self.SEED,
            flops_per_token=self.flops_per_token(),
            peak_tflops=self.PEAK_TFLOPS,
            grad_accum_steps=self.GRAD_ACCUM_STEPS,
            global_batch_size=self.GLOBAL_BATCH_SIZE,
            checkpoint_restore_path=self.CHECKPOINT_RESTORE_PATH,
            checkpoint_ignore_rules=tuple(self.CHECKPOINT_IGNORE_RULES or ()),
            profiler_capture_step=self.PROFILER_CAPTURE_STEP,
            profiler_num_steps=self.PROFILER_NUM_STEPS,
            profiler_min_duration_sec=self.PROFILER_MIN_DURATION_SEC,
            loss_chunk_size=self.LOSS_CHUNK_SIZE,
            watchdog_timeout_seconds=self.WATCHDOG_TIMEOUT_SECONDS,
            crash_on_hang_timeout_seconds=self.CRASH_ON_HANG_TIMEOUT_SECONDS,
            compilation_cache=self.COMPILATION_CACHE,
            compilation_cache_dir=self.COMPILATION_CACHE_DIR,
            seq_load_balance=self.CONTEXT_PARALLEL_LOAD_BALANCE,
            checkpoint_save_failure=SaveFailure(self.CHECKPOINT_SAVE_FAILURE),
        )


class RunSettings:
    """The run's random seed (initialisation, dropout, data order) and the device peak for MFU."""

    SEED: int = 1234
    PEAK_TFLOPS: float | None = None  # device peak for MFU; None: look the device up in a table

    def hparam_problems(self) -> list[str]:
        problems = super().hparam_problems()
        if self.PEAK_TFLOPS is not None and self.PEAK_TFLOPS <= 0:
            problems.append(f"PEAK_TFLOPS must be > 0 or None (look the device up), got "
                            f"{self.PEAK_TFLOPS}")
        return problems


class GlobalBatchSettings:
    """The global batch fixed in sequences, whatever the device count."""

    # AXLearn's train_batch_size. None: PERCORE_BATCH_SIZE x devices (Pax). Set, it wins; each
    # device holds GLOBAL / devices rows (fractional only with tensor parallelism), and it must
    # divide over data x fsdp (x expert).
    GLOBAL_BATCH_SIZE: int | None = None

    def global_batch_problems(self) -> list[str]:
        if self.GLOBAL_BATCH_SIZE is not None and self.GLOBAL_BATCH_SIZE < 1:
            return [(f"GLOBAL_BATCH_SIZE must be a positive number of sequences or None "
                    f"(PERCORE_BATCH_SIZE x devices), got {self.GLOBAL_BATCH_SIZE}")]
        return []


class CheckpointRestoreSettings:
    """Initialisation from pretrained weights (Pax CheckpointRestoreMixin)."""

    # A job directory, its checkpoints/ or one checkpoint_<STEP> directory (e.g. from python -m
    # paxlite convert). Used only when the job has no checkpoint of its own; the run starts at
    # step 0 with fresh optimizer state. docs/training.md.
    CHECKPOINT_RESTORE_PATH: str | None = None
    # Regexes of parameters NOT read from CHECKPOINT_RESTORE_PATH (they keep their fresh
    # initialisation), matched as Pax does (re.match) against the path joined with '/'
    # (layers_0/mlp/wi/kernel) and with '.'.
    CHECKPOINT_IGNORE_RULES: list[str] | None = Derived(
        lambda hp: [PAX_LORA_RULE] if hp.USE_LORA else None,
        doc="['^.*lora.*$'] if USE_LORA else None")

    def ignore_rule_problems(self) -> list[str]:
        for rule in self.CHECKPOINT_IGNORE_RULES or []:
            try:
                re.compile(rule)
            except re.error as e:
                return [f"CHECKPOINT_IGNORE_RULES: {rule!r} is not a regular expression: {e}"]
        return []

    def unread_restore_problems(self) -> list[str]:
        if ("CHECKPOINT_IGNORE_RULES" in self.overridden and self.CHECKPOINT_IGNORE_RULES
                and not self.CHECKPOINT_RESTORE_PATH):
            return [("CHECKPOINT_IGNORE_RULES set but CHECKPOINT_RESTORE_PATH is unset: nothing is "
                    "restored")]
        return []
