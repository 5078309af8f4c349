"""Pax-style experiments: UPPERCASE class attributes are hyperparameters, resolved after overrides.

Users write experiments the Pax way - a subclass that changes a few constants - but two Pax pitfalls
are removed. Values computed from other values are declared as `Derived` and computed *after*
command-line overrides (Pax evaluated `LR_COS_DECAY_START = LR_COS_WARMUP + 1` once, at class
definition, so overriding the warm-up left it stale). And every name and value is checked against
the annotations, so a misspelled override or `NUM_LAYERS=4.0` is an error instead of a silently
created attribute.
"""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

from paxlite.config.errors import ConfigError, did_you_mean
from paxlite.config.values import HParamSpec, check_value, to_json_friendly, type_name

_HPARAM_NAME = re.compile(r"[A-Z][A-Z0-9_]*")


def is_hparam_name(name: str) -> bool:
    """Whether `name` is spelled like a hyperparameter (UPPERCASE, digits and underscores)."""
    return _HPARAM_NAME.fullmatch(name) is not None


class Derived:
    """A hyperparameter computed from others after overrides are applied.

    `fn` receives a read-only view whose attributes are the resolved hyperparameters, e.g.
    `HIDDEN_DIMS: int = Derived(lambda hp: 4 * hp.MODEL_DIMS, doc="4 * MODEL_DIMS")`. Setting the
    name explicitly (subclass value or --fdl.X) replaces the computation.
    """

    def __init__(self, fn: Callable[[Any], Any], doc: str = "") -> None:
        if not callable(fn):
            raise ConfigError(f"Derived needs a function of the hyperparameters, got {fn!r}")
        self.fn = fn
        self.doc = doc

    def __repr__(self) -> str:
        return f"Derived({self.doc!r})" if self.doc else "Derived(<function>)"


# ------------------------------------------------------------------------------------------------
# Derived values


class _View:
    """What a Derived function sees: attribute access to hyperparameters, resolved on demand."""

    def __init__(self, resolver: _Resolver, reads: dict[str, Any]) -> None:
        object.__setattr__(self, "_resolver", resolver)
        object.__setattr__(self, "_reads", reads)

    def __getattr__(self, name: str) -> Any:
        value = self._resolver.get(name)
        self._reads[name] = value
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        raise ConfigError(f"a Derived function may not set {name}; return the value instead")


class _Resolver:
    """Computes Derived values depth-first, so dependency order falls out and cycles are caught."""

    def __init__(self, specs: Mapping[str, HParamSpec], values: dict[str, Any],
                 pending: dict[str, Derived]) -> None:
        self.specs = specs
        self.values = values
        self.pending = pending
        self.stack: list[str] = []

    def get(self, name: str) -> Any:
        if name in self.values:
            return self.values[name]
        if name not in self.pending:
            raise ConfigError(
                f"a Derived value{self._context()} reads {name}, which is not a hyperparameter"
                + did_you_mean(name, self.specs)
            )
        if name in self.stack:
            cycle = self.stack[self.stack.index(name):] + [name]
            raise ConfigError("derived hyperparameters form a cycle: " + " -> ".join(cycle))
        self.stack.append(name)
        derived = self.pending[name]
        reads: dict[str, Any] = {}
        try:
            result = derived.fn(_View(self, reads))
        except ConfigError:
            raise
        except Exception as err:  # a user function failing on odd values, e.g. x // 0
            inputs = ", ".join(f"{k}={v!r}" for k, v in reads.items()) or "no values"
            raise ConfigError(
                f"computing derived {name} ({derived.doc or 'no description'}) from {inputs} "
                f"failed: {type(err).__name__}: {err}"
            ) from err
        finally:
            self.stack.pop()
        desc = f" = {derived.doc}" if derived.doc else ""
        value = check_value(self.specs[name], result, label=f"derived {name}{desc} = {result!r}")
        self.values[name] = value
        del self.pending[name]
        return value

    def _context(self) -> str:
        return f" (computing {self.stack[-1]})" if self.stack else ""


# ------------------------------------------------------------------------------------------------
# The experiment base class


class Experiment:
    """Base of every experiment: hyperparameters with Pax TransformerLmSpmdAdam defaults.

    Subclass and assign to change a default; annotate to add a hyperparameter. Construct with
    `Exp.resolve({"NUM_LAYERS": 4})` (or `Exp(...)`, the same) to get an instance whose attributes
    are the checked, resolved values.
    """

    NUM_LAYERS: int = 32
    NUM_HEADS: int = 16
    MODEL_DIMS: int = 1024
    HIDDEN_DIMS: int = Derived(lambda hp: 4 * hp.MODEL_DIMS, doc="4 * MODEL_DIMS")
    DIMS_PER_HEAD: int = Derived(lambda hp: hp.MODEL_DIMS // hp.NUM_HEADS,
                                 doc="MODEL_DIMS // NUM_HEADS")
    VOCAB_SIZE: int = 32000
    MAX_SEQ_LEN: int = 1024
    PERCORE_BATCH_SIZE: float = 1.0
    # Microbatches per optimizer step. The global batch stays PERCORE_BATCH_SIZE x devices; each step
    # runs forward/backward on global/GRAD_ACCUM_STEPS rows at a time and applies one update.
    GRAD_ACCUM_STEPS: int = 1
    # Sequence positions per block of the chunked loss: the float32 [B, T, V] logits never exist at
    # once (a memory saving for large vocabularies; same loss and gradients). None: whole sequence.
    LOSS_CHUNK_SIZE: int | None = None
    # [data, fsdp, tensor(, expert(, pipeline(, seq)))] within a node / across nodes; None: all on
    # data. With NUM_STAGES set, a 4-entry shape is Pax's pipelined [pipeline, data, fsdp, tensor].
    ICI_MESH_SHAPE: list[int] | None = None
    DCN_MESH_SHAPE: list[int] = [1, 1, 1]
    # Pipeline parallelism (docs/parallelism.md): the layers run as stages over the `pipeline` mesh
    # axis, on microbatches of each batch. NUM_STAGES (Pax's): None means the pipeline axis's size;
    # set, it must be a multiple of it. Microbatches: NUM_MICROBATCHES, or (Pax) rows / MICROBATCH_SIZE,
    # else NUM_STAGES. PIPELINE_REPEATS > 1: the circular schedule.
    NUM_STAGES: int | None = None
    NUM_MICROBATCHES: int | None = None
    MICROBATCH_SIZE: int | None = None
    PIPELINE_REPEATS: int = 1
    # Sequence parallelism over the `seq` mesh axis: how attention reaches other shards' keys, and
    # whether rows are reordered (MaxText's dual_chunk_swap) so every shard has equal causal work.
    CONTEXT_PARALLEL_STRATEGY: Literal["all_gather", "ring"] = "all_gather"
    CONTEXT_PARALLEL_LOAD_BALANCE: bool = True
    FPROP_DTYPE: Literal["float32", "bfloat16"] = "float32"
    LEARNING_RATE: float = 1e-3
    LR_SCHEDULE: Literal[
        "linear_rampup_exponential_decay", "linear_rampup_cosine_decay", "constant"
    ] = "linear_rampup_exponential_decay"
    LR_LRED_WARMUP: int = 4000
    LR_LRED_DECAY_START: int = Derived(lambda hp: hp.LR_LRED_WARMUP + 1, doc="LR_LRED_WARMUP + 1")
    LR_LRED_DECAY_END: int = 300000
    LR_LRED_MIN_RATIO: float = 0.1
    LR_LRED_MAX: float = 1.0
    LR_COS_WARMUP: int = 4000
    LR_COS_DECAY_START: int = Derived(lambda hp: hp.LR_COS_WARMUP + 1, doc="LR_COS_WARMUP + 1")
    LR_COS_DECAY_END: int = 300000
    LR_COS_MIN_RATIO: float = 0.1
    LR_COS_MAX: float = 1.0
    ADAM_BETA1: float = 0.9
    ADAM_BETA2: float = 0.99
    ADAM_EPSILON: float = 1e-6
    ADAM_EPSILON_ROOT: float = 0.0
    ADAM_CLIP_THRESHOLD: float = 1.0
    WEIGHT_DECAY: float = 1e-3
    CLIP_GRADIENT_NORM_TO_VALUE: float = 5.0
    MAX_STEPS: int = 100000
    CHECKPOINT_EVERY_N_STEPS: int = 5000
    CHECKPOINT_MAX_TO_KEEP: int = 10
    SUMMARY_INTERVAL_STEPS: int = 100
    EVAL_INTERVAL_STEPS: int = 100
    EVAL_LOOP_NUM_BATCHES: int = 10  # -1: the whole eval set, as Pax
    # Pax's profiler settings (docs/training.md, Profiling): trace steps CAPTURE_STEP onwards (from 1,
    # as metrics.jsonl counts) into DIR/summaries/profile, on process 0; None: no profile. The trace
    # covers NUM_STEPS steps, extended over further steps until MIN_DURATION_SEC have been captured.
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
    USE_REPEATED_LAYER: bool = False
    # Pax remat policy of the repeated (scanned) stack; docs/training.md says what each saves.
    CHECKPOINT_POLICY: Literal[
        "SAVE_NOTHING", "SAVE_EVERYTHING", "SAVE_DOT_ONLY", "SAVE_DOT_WITH_NO_BATCH_DIM",
        "SAVE_DOT_FOR_MLPERF_200B", "SAVE_ITERATION_INPUT", "SAVE_QKV_OUT_PROJ", "SAVE_OUT_PROJ",
        "SAVE_CONTEXT", "SAVE_CONTEXT_AND_OUT_PROJ",
    ] = "SAVE_NOTHING"
    DROPOUT_PROB: float = 0.0
    INPUT_DROPOUT_PROB: float = 0.0
    INIT_STD: float = 0.02
    SOFTMAX_INIT_STD: float = Derived(lambda hp: hp.INIT_STD, doc="INIT_STD")
    LAYERNORM_EPSILON: float = 1e-5
    SEED: int = 1234
    PEAK_TFLOPS: float | None = None  # device peak for MFU; None: look the device up in a table
    SYNTHETIC_DATA: bool = False  # train on synthetic tokens of the same shapes
    PACKED_INPUT: bool = True

    overridden: frozenset[str]

    def __init__(self, overrides: Mapping[str, Any] | None = None) -> None:
        cls = type(self)
        specs = cls.hparam_specs()
        overrides = dict(overrides) if overrides is not None else {}
        cls.check_names(overrides)
        values: dict[str, Any] = {}
        pending: dict[str, Derived] = {}
        for name, spec in specs.items():
            if name in overrides:
                values[name] = check_value(spec, overrides[name])
            elif isinstance(spec.default, Derived):
                pending[name] = spec.default
            else:
                label = f"{cls.__name__}.{name} = {spec.default!r}"
                values[name] = check_value(spec, spec.default, label=label)
        resolver = _Resolver(specs, values, pending)
        for name in list(pending):
            if name in pending:  # may have been computed already as another one's dependency
                resolver.get(name)
        for name in specs:
            object.__setattr__(self, name, values[name])
        object.__setattr__(self, "overridden", frozenset(overrides))
        self.validate()

    def __setattr__(self, name: str, value: Any) -> None:
        if is_hparam_name(name):
            raise ConfigError(
                f"cannot set {name} on a resolved experiment: derived values would go stale; "
                f"pass it to {type(self).__name__}.resolve({{{name!r}: ...}}) instead"
            )
        object.__setattr__(self, name, value)

    @classmethod
    def hparam_specs(cls) -> dict[str, HParamSpec]:
        """Every UPPERCASE annotated name over the MRO, base classes' names first."""
        annotations = [_hparam_annotations(klass) for klass in reversed(cls.__mro__)]
        order: list[str] = []
        for ann in annotations:
            order.extend(n for n in ann if is_hparam_name(n) and n not in order)
        specs: dict[str, HParamSpec] = {}
        for name in order:
            annotation = next(ann[name] for ann in reversed(annotations) if name in ann)
            if not hasattr(cls, name):
                raise ConfigError(
                    f"{cls.__name__}.{name} is annotated but has no value; give it a default "
                    f"(None, typed '{type_name(annotation)} | None', if --fdl.{name} must set it)"
                )
            specs[name] = HParamSpec(name=name, annotation=annotation, default=getattr(cls, name))
        _check_unannotated(cls, specs)
        return specs

    @classmethod
    def check_names(cls, names: Iterable[str]) -> None:
        """Raises one ConfigError listing every name that is not a hyperparameter of `cls`."""
        specs = cls.hparam_specs()
        unknown = [n for n in names if n not in specs]
        if unknown:
            parts = [f"--fdl.{n}{did_you_mean(n, specs)}" for n in unknown]
            raise ConfigError(
                f"unknown hyperparameter(s) for {cls.__name__}: " + ", ".join(parts)
                + f"; `python -m paxlite show --fdl_config={cls.__name__}` lists them all"
            )

    @classmethod
    def resolve(cls, overrides: Mapping[str, Any] | None = None) -> Experiment:
        """Checks and applies `overrides`, computes the Derived values, validates; see class doc."""
        return cls(overrides)

    def validate(self) -> None:
        """Cross-field checks; subclasses extend it (call super) and raise ConfigError."""
        problems = list(_base_problems(self))
        if problems:
            raise ConfigError(f"invalid {self.name} hyperparameters: " + "; ".join(problems))

    def hparams(self) -> dict[str, Any]:
        """Every resolved hyperparameter, JSON-friendly (lists, plain enum values), in order."""
        return {name: to_json_friendly(getattr(self, name)) for name in self.hparam_specs()}

    @property
    def name(self) -> str:
        return type(self).__name__

    def __repr__(self) -> str:
        changed = ", ".join(f"{n}={getattr(self, n)!r}" for n in sorted(self.overridden))
        return f"{self.name}({changed})"


def _hparam_annotations(klass: type) -> dict[str, Any]:
    """The UPPERCASE annotations a class itself declares, string annotations evaluated.

    Only UPPERCASE ones are evaluated, so an unrelated annotation naming a TYPE_CHECKING-only import
    (under `from __future__ import annotations`) cannot break resolution.
    """
    out: dict[str, Any] = {}
    for name, annotation in inspect.get_annotations(klass).items():
        if not is_hparam_name(name):
            continue
        if isinstance(annotation, str):
            module = sys.modules.get(klass.__module__)
            namespace = dict(vars(module)) if module is not None else {}
            try:
                annotation = eval(annotation, namespace, dict(vars(klass)))
            except Exception as err:
                raise ConfigError(
                    f"{klass.__name__}.{name}: cannot evaluate annotation {annotation!r}: "
                    f"{type(err).__name__}: {err}"
                ) from err
        out[name] = annotation
    return out


def _check_unannotated(cls: type, specs: Mapping[str, HParamSpec]) -> None:
    """An UPPERCASE class value no class annotates is a typo (Pax's FRPOP_DTYPE), not a knob."""
    for klass in cls.__mro__:
        for name, value in vars(klass).items():
            if not is_hparam_name(name) or name in specs:
                continue
            if callable(value) or isinstance(value, (classmethod, staticmethod, property)):
                continue
            raise ConfigError(
                f"{klass.__name__}.{name} is not a hyperparameter{did_you_mean(name, specs)}; "
                f"annotate it ({name}: <type> = ...) to add a new one"
            )


def _base_problems(hp: Experiment) -> Iterable[str]:
    for name in ("NUM_LAYERS", "NUM_HEADS", "MODEL_DIMS", "HIDDEN_DIMS", "DIMS_PER_HEAD",
                 "VOCAB_SIZE", "MAX_SEQ_LEN", "CHECKPOINT_MAX_TO_KEEP"):
        if getattr(hp, name) <= 0:
            yield f"{name} must be positive, got {getattr(hp, name)}"
    if hp.MAX_STEPS < 0:
        yield f"MAX_STEPS must be >= 0, got {hp.MAX_STEPS}"
    for name in ("CHECKPOINT_EVERY_N_STEPS", "SUMMARY_INTERVAL_STEPS", "EVAL_INTERVAL_STEPS"):
        if getattr(hp, name) < 1:
            yield f"{name} must be >= 1, got {getattr(hp, name)}"
    if hp.PROFILER_CAPTURE_STEP is not None and not 1 <= hp.PROFILER_CAPTURE_STEP <= hp.MAX_STEPS:
        yield (f"PROFILER_CAPTURE_STEP must be a step from 1 to MAX_STEPS={hp.MAX_STEPS} (the first "
               f"step to trace), or None (no profile), got {hp.PROFILER_CAPTURE_STEP}")
    if hp.PROFILER_NUM_STEPS < 1:
        yield f"PROFILER_NUM_STEPS must be >= 1, got {hp.PROFILER_NUM_STEPS}"
    if hp.PROFILER_MIN_DURATION_SEC < 0:
        yield f"PROFILER_MIN_DURATION_SEC must be >= 0, got {hp.PROFILER_MIN_DURATION_SEC}"
    for name in ("WATCHDOG_TIMEOUT_SECONDS", "CRASH_ON_HANG_TIMEOUT_SECONDS"):
        if getattr(hp, name) is not None and getattr(hp, name) <= 0:
            yield f"{name} must be > 0 seconds or None (never), got {getattr(hp, name)}"
    if (hp.WATCHDOG_TIMEOUT_SECONDS is not None and hp.CRASH_ON_HANG_TIMEOUT_SECONDS is not None
            and hp.CRASH_ON_HANG_TIMEOUT_SECONDS < hp.WATCHDOG_TIMEOUT_SECONDS):
        yield (f"CRASH_ON_HANG_TIMEOUT_SECONDS={hp.CRASH_ON_HANG_TIMEOUT_SECONDS} must be >= "
               f"WATCHDOG_TIMEOUT_SECONDS={hp.WATCHDOG_TIMEOUT_SECONDS} (stacks are logged first)")
    if hp.COMPILATION_CACHE_DIR is not None and not hp.COMPILATION_CACHE:
        yield (f"COMPILATION_CACHE_DIR={hp.COMPILATION_CACHE_DIR!r} is set but COMPILATION_CACHE=False "
               "turns the cache off; drop one of them")
    if hp.EVAL_LOOP_NUM_BATCHES < 1 and hp.EVAL_LOOP_NUM_BATCHES != -1:
        yield f"EVAL_LOOP_NUM_BATCHES must be >= 1 or -1 (all), got {hp.EVAL_LOOP_NUM_BATCHES}"
    for name in ("ICI_MESH_SHAPE", "DCN_MESH_SHAPE"):
        shape = getattr(hp, name)
        if shape is not None and (len(shape) not in range(3, 7) or any(d <= 0 for d in shape)):
            yield (f"{name} must be 3 to 6 positive sizes [data, fsdp, tensor, expert, pipeline, "
                   f"seq] (entries after tensor optional; with NUM_STAGES set, 4 entries are Pax's "
                   f"[pipeline, data, fsdp, tensor]), got {shape}")
    for name in ("NUM_STAGES", "NUM_MICROBATCHES", "MICROBATCH_SIZE"):
        value = getattr(hp, name)
        if value is not None and value < 1:
            yield f"{name} must be a positive integer or None, got {value}"
    if hp.PIPELINE_REPEATS < 1:
        yield f"PIPELINE_REPEATS must be >= 1 (1: GPipe), got {hp.PIPELINE_REPEATS}"
    if hp.NUM_MICROBATCHES is not None and hp.MICROBATCH_SIZE is not None:
        yield (f"NUM_MICROBATCHES={hp.NUM_MICROBATCHES} and MICROBATCH_SIZE={hp.MICROBATCH_SIZE} "
               "both set: give one (the other follows from the batch)")
    if hp.PERCORE_BATCH_SIZE <= 0:
        yield f"PERCORE_BATCH_SIZE must be > 0, got {hp.PERCORE_BATCH_SIZE}"
    if hp.LOSS_CHUNK_SIZE is not None and hp.LOSS_CHUNK_SIZE < 1:
        yield f"LOSS_CHUNK_SIZE must be None (whole sequence) or >= 1, got {hp.LOSS_CHUNK_SIZE}"
    if hp.GRAD_ACCUM_STEPS < 1:
        yield (f"GRAD_ACCUM_STEPS must be >= 1 (1: no accumulation), got {hp.GRAD_ACCUM_STEPS}; "
               "the global batch must also divide into that many microbatches (checked at start-up)")
    for prefix in ("LR_LRED", "LR_COS"):
        warmup, start, end = (getattr(hp, f"{prefix}_{s}") for s in
                              ("WARMUP", "DECAY_START", "DECAY_END"))
        if warmup < 0:
            yield f"{prefix}_WARMUP must be >= 0, got {warmup}"
        if start < warmup:
            yield f"{prefix}_DECAY_START ({start}) must be >= {prefix}_WARMUP ({warmup})"
        if end < start:
            yield f"{prefix}_DECAY_END ({end}) must be >= {prefix}_DECAY_START ({start})"
        if getattr(hp, f"{prefix}_MAX") <= 0:
            yield f"{prefix}_MAX must be > 0, got {getattr(hp, f'{prefix}_MAX')}"
    for name in ("DROPOUT_PROB", "INPUT_DROPOUT_PROB"):
        if not 0.0 <= getattr(hp, name) < 1.0:
            yield f"{name} must be in [0, 1), got {getattr(hp, name)}"
    for name in ("ADAM_BETA1", "ADAM_BETA2"):
        if not 0.0 <= getattr(hp, name) < 1.0:
            yield f"{name} must be in [0, 1), got {getattr(hp, name)}"
    if hp.NUM_HEADS * hp.DIMS_PER_HEAD <= 0:
        yield f"NUM_HEADS * DIMS_PER_HEAD must be > 0, got {hp.NUM_HEADS} * {hp.DIMS_PER_HEAD}"
    if hp.PEAK_TFLOPS is not None and hp.PEAK_TFLOPS <= 0:
        yield f"PEAK_TFLOPS must be > 0 or None (look the device up), got {hp.PEAK_TFLOPS}"
