"""A run's parts, built in phases: the mesh and its batch, the data, the checkpointer, the metrics
writer (and a W&B run), the compiled steps, the step timer, the parameters a restore path gives.

`Run` (train/loop.py) builds them in this order, which is the order mistakes are reported in: a
batch that does not split over the mesh, a missing dataset, vocabulary or evaluation split, a saved
input position that does not fit this run's data settings, all before anything is compiled; a bad
restore path before any state is built.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from absl import logging
from flax import traverse_util

from paxlite.checkpointing import pretrained
from paxlite.checkpointing.checkpoint import Checkpointer
from paxlite.checkpointing.pretrained import PretrainedCheckpointError
from paxlite.checkpointing.storage_faults import reading_inputs
from paxlite.data.context_order import check_seq_divides
from paxlite.data.dpo_pipeline import DpoEvalConfig, DpoTrainConfig
from paxlite.data.errors import DatasetError
from paxlite.data.feed import Feed, make_feed
from paxlite.data.feeding import plan_feeding
from paxlite.errors import SettingError
from paxlite.models.lora import is_lora_path
from paxlite.models.moe_router_deepseek import trainable_paths
from paxlite.models.te_layer import logical_axis_rules as te_logical_axis_rules
from paxlite.models.transformer import Transformer
from paxlite.parallel import mesh as mesh_lib
from paxlite.parallel import rules as rules_lib
from paxlite.train import flops as flops_lib
from paxlite.train.dpo import DpoSteps
from paxlite.train.grad_accum import microbatch_size, pipeline_microbatches
from paxlite.train.lm_eval_hook import LmEvalScorer
from paxlite.train.metrics import MetricsWriter
from paxlite.train.optimizer import make_optimizer
from paxlite.train.run_config import RunConfig
from paxlite.train.schedules import make_schedule
from paxlite.train.step import CompiledSteps, compile_steps
from paxlite.train.step_timer import StepTimer


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunContext:
    """What a run needs besides its configuration: where it writes and what it may do there."""

    job_dir: str
    enable_checkpoint_saving: bool = True
    async_checkpointing: bool = True
    # False (--mode=eval): the training data is not opened, and the job's checkpoints/ is only
    # read: nothing there is written, renamed or moved (a damaged step stays where it is).
    training: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchLayout:
    """The mesh, and the global batch it trains on: checked to split over every axis it meets."""

    mesh: jax.sharding.Mesh
    global_batch_size: int
    tokens_per_step: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class PretrainedPlan:
    """What CHECKPOINT_RESTORE_PATH initialises, worked out before any state is built."""

    wanted: dict  # '/'-joined path -> abstract array of each parameter to read
    ignored: list[str]  # model parameters left at their initialisation (CHECKPOINT_IGNORE_RULES)
    unread: list[str]  # checkpoint parameters the model lacks (an ignore rule matches each)


def batch_layout(config: RunConfig) -> BatchLayout:
    """The mesh and global batch; a batch that its microbatches, the pipeline's microbatches or
    the sequence shards cannot split is said here, before compiling."""
    mesh = mesh_lib.build_mesh(config.mesh)
    check_fp8_platform(fp8=config.model.fp8 is not None, device=mesh.devices.flat[0])
    loop = config.loop
    batch_split = rules_lib.batch_split(mesh)
    global_batch_size = mesh_lib.global_batch_size(
        percore_batch_size=loop.percore_batch_size, num_devices=mesh.devices.size,
        batch_split=batch_split, fixed_global_batch_size=loop.global_batch_size)
    # Each optimizer step's microbatches split over data x fsdp x expert too
    microbatch_size(global_batch_size=global_batch_size, grad_accum_steps=loop.grad_accum_steps,
                    batch_split=batch_split)
    if config.model.pipeline is not None:  # and the pipeline's microbatches of each of them
        pipeline_microbatches(config.model.pipeline, global_batch_size=global_batch_size,
                              grad_accum_steps=loop.grad_accum_steps, batch_split=batch_split)
    seq_len = config.model.max_seq_len
    # and the sequence over the seq axis (in 2 x seq chunks with load balancing)
    check_seq_divides(seq_len=seq_len, seq_shards=mesh.shape["seq"],
                      load_balance=loop.seq_load_balance)
    return BatchLayout(mesh=mesh, global_batch_size=global_batch_size,
                       tokens_per_step=global_batch_size * seq_len)


def check_fp8_platform(*, fp8: bool, device) -> None:
    """USE_FP8 on a TPU is one SettingError: TPUs v4, v5e, v5p and v6e have no FP8 matmul units,
    so XLA would run each FP8 matmul as a bfloat16 one with casts around it (a slower bfloat16
    run that the user believes is FP8; measured on a v5e: "fp8" operands ran at the bf16 rate)."""
    if fp8 and device.platform == "tpu":
        raise SettingError(
            f"USE_FP8=true cannot run on a {device.device_kind}: TPUs have no FP8 matmul units "
            "(its FP8 matmuls would be bfloat16 ones with casts around them); drop USE_FP8, "
            "and train in bfloat16 (FPROP_DTYPE='bfloat16')")


def open_feeds(config: RunConfig, *, layout: BatchLayout,
               training: bool) -> tuple[Feed | None, Feed | None]:
    """(training data, evaluation data), each None where the run has none. Opened before anything
    compiles, so that a missing dataset or vocabulary is reported first."""
    needs_train_data = training or config.eval_task is None
    if needs_train_data and config.data is None:
        raise DatasetError(
            f"{config.experiment} has no training data: pass --fdl.DATA_DIR=<a directory made by "
            "python -m paxlite.data.prepare> or --fdl.SYNTHETIC_DATA=true"
        )
    plan = plan_feeding(rules_lib.batch_sharding(layout.mesh),
                        global_batch_size=layout.global_batch_size,
                        seq_len=config.model.max_seq_len)
    data = make_feed(config.data, plan=plan) if needs_train_data else None
    eval_data = make_feed(config.eval_task, plan=plan) if config.eval_task is not None else data
    if eval_data is not None and not eval_data.has_eval_data:
        if not training:
            raise DatasetError(
                f"--mode=eval: {config.experiment}'s training data has no validation split to "
                "evaluate on; prepare it with --validation_fraction > 0, or pick a task with "
                "--fdl.EVAL_TASK=lambada|boolq|chat")
        logging.warning("The training data has no validation split (prepare "
                        "--validation_fraction 0? TRAIN_TASK=chat without EVAL_TASK=chat?): "
                        "training without evaluation")
        eval_data = None
    return data, eval_data


def lm_eval_scorer(config: RunConfig, *, layout: BatchLayout) -> LmEvalScorer | None:
    """LM_EVAL_TASKS' scorer (None: none asked for); the eval extra, the tokenizer and every task
    name are checked now."""
    if config.lm_eval is None:
        return None
    return LmEvalScorer(config.lm_eval, model_config=config.model, mesh=layout.mesh,
                        batch_size=layout.global_batch_size, max_steps=config.loop.max_steps)


def open_checkpointer(config: RunConfig, *, context: RunContext) -> Checkpointer:
    """The job's checkpoints/; written only by a training run with saving enabled."""
    loop = config.loop
    return Checkpointer(
        os.path.join(context.job_dir, "checkpoints"),
        save_interval_steps=loop.checkpoint_every_n_steps,
        max_to_keep=loop.checkpoint_max_to_keep,
        enable_saving=context.enable_checkpoint_saving and context.training,
        async_save=context.async_checkpointing,
    )


def check_data_position(checkpointer: Checkpointer, *, data: Feed | None) -> None:
    """A resume whose saved input position cannot fit this run's data settings (another batch
    size or process count) fails here, before anything is compiled. The position the run
    continues from is restored later with the state, from the step the state comes from. A newest
    step whose state the restore will walk past is not looked at: a fault found here would name
    it as the step to resume from."""
    steps = checkpointer.all_steps()
    if data is None or not steps or not checkpointer.passes_first_look(steps[-1]):
        return
    try:
        record = checkpointer.restore_data(steps[-1])
    except Exception:  # noqa: BLE001  damage is judged, reported and walked back by the restore
        return
    if record is not None:
        restore_data_position(data, record, step=steps[-1])


def restore_data_position(data: Feed, record, *, step: int) -> None:
    """Put the input pipeline where a resume from `step` continues. This reads the next batch's
    records, so a file that vanished meanwhile stops the run here with one line (exit 75) naming
    it, step + 1 and the checkpoint to resume from. Both restores of a resume come here: the check
    above, and the one with the state (from an older step where the newest was damaged)."""
    with reading_inputs(step=step + 1, complete=lambda: step):
        data.restore(record, step=step)


def dpo_steps(config: RunConfig) -> DpoSteps | None:
    """What the steps need of DPO (train/dpo.py): which read preference pairs, and whether the
    reference has parameters of its own (not LoRA's base with the adapters off)."""
    if config.dpo is None:
        return None
    return DpoSteps.of(beta=config.dpo.beta, reference_path=config.dpo.reference_path,
                       train=isinstance(config.data, DpoTrainConfig),
                       eval=isinstance(config.eval_task, DpoEvalConfig),
                       lora=config.model.lora_rank is not None)


def compile_run_steps(config: RunConfig, *, mesh: jax.sharding.Mesh) -> CompiledSteps:
    """The run's train and eval steps, jitted with its shardings (train/step.py).

    The steps of one configuration are built once per process: a second run of it (a resume in
    the same process, a notebook cell run again, the tests' runs of one model) reuses the jitted
    functions, and so their traced and lowered programs, instead of tracing the model again (a
    second or more for a tiny model, minutes for a large one). Everything the steps depend on is
    in the key, the optimizer's builder included (a test may replace it); a few configurations
    are kept."""
    loop = config.loop
    return _cached_steps(config.model, config.optimizer, config.schedule, mesh=mesh,
                         make_optimizer=make_optimizer,
                         seed=loop.seed, grad_accum_steps=loop.grad_accum_steps,
                         z_loss_weight=loop.z_loss_weight, loss_chunk_size=loop.loss_chunk_size,
                         dpo=dpo_steps(config))


def clear_compiled_steps() -> None:
    """Forget the steps `compile_run_steps` kept: the next run traces its own (for a caller that
    observes tracing, or frees the programs)."""
    _cached_steps.cache_clear()


@functools.lru_cache(maxsize=4)
def _cached_steps(model_config, optimizer_config, schedule_config, *, mesh: jax.sharding.Mesh,
                  make_optimizer, seed: int, grad_accum_steps: int, z_loss_weight: float,
                  loss_chunk_size: int | None, dpo: DpoSteps | None) -> CompiledSteps:
    schedule = make_schedule(schedule_config)
    deterministic = model_config.dropout_prob == 0 and model_config.input_dropout_prob == 0
    with jax.set_mesh(mesh):
        return compile_steps(
            model=Transformer(model_config),
            optimizer=make_optimizer(optimizer_config, schedule),
            schedule=schedule,
            mesh=mesh,
            seq_len=model_config.max_seq_len,
            seed=seed,
            deterministic=deterministic,
            grad_accum_steps=grad_accum_steps,
            z_loss_weight=z_loss_weight,
            loss_chunk_size=loss_chunk_size,
            # LoRA trains only the adapters (Pax bprop_variable_inclusion=[r"^.*lora.*$"]).
            # DeepSeek-V3's router bias is state, never trained (models/moe_router_deepseek.py).
            trainable=trainable_paths(model_config),
            # TE layers (ENABLE_TE) name their parameters TE's way: the table gains them
            logical_rules=te_logical_axis_rules(model_config, rules_lib.DEFAULT_RULES),
            dpo=dpo,
        )


def make_step_timer(config: RunConfig, *, layout: BatchLayout) -> StepTimer:
    """The summaries' clock, with what it needs for tokens/s and MFU."""
    peak_flops = flops_lib.peak_flops_per_device(
        jax.devices()[0].device_kind, override_tflops=config.loop.peak_tflops,
        fp8=config.model.fp8 is not None,  # MFU of an FP8 run against the FP8 peak
    )
    return StepTimer(tokens_per_step=layout.tokens_per_step,
                     flops_per_token=config.loop.flops_per_token,
                     peak_flops_per_device=peak_flops, num_devices=layout.mesh.devices.size)


def metrics_writer(config: RunConfig, *, context: RunContext) -> MetricsWriter:
    """metrics.jsonl and the summaries, written by the first process only, which also starts the
    W&B run (WANDB_PROJECT): before anything compiles, so a missing package is said first."""
    first = jax.process_index() == 0
    sinks = []
    if first and config.wandb is not None:
        from paxlite.train.wandb_sink import WandbSink

        sinks.append(WandbSink(config.wandb, job_dir=context.job_dir))
    return MetricsWriter(context.job_dir, enabled=first, max_steps=config.loop.max_steps,
                         sinks=sinks)


def pretrained_plan(config: RunConfig, *, abstract_params) -> PretrainedPlan:
    """A missing or unfinished CHECKPOINT_RESTORE_PATH, rules that exclude everything, checkpoint
    parameters the model lacks: said before any state is built."""
    path, rules = config.loop.checkpoint_restore_path, config.loop.checkpoint_ignore_rules
    pretrained.find_checkpoint(path)
    wanted, ignored = pretrained.restore_plan(abstract_params, rules=rules, path=path)
    unread = pretrained.unread_checkpoint_params(abstract_params, rules=rules, path=path)
    return PretrainedPlan(wanted=wanted, ignored=ignored, unread=unread)


def reference_plan(config: RunConfig, *, abstract_params) -> dict:
    """The parameters to read from DPO_REFERENCE_PATH ('/'-joined path -> abstract array): every
    model parameter but LoRA's adapters, which the reference has off (zero). A path that is not a
    complete checkpoint is said before any state is built."""
    path = config.dpo.reference_path
    try:
        pretrained.find_checkpoint(path)
    except PretrainedCheckpointError as e:
        raise PretrainedCheckpointError(f"DPO_REFERENCE_PATH: {e}") from None
    flat = traverse_util.flatten_dict(abstract_params, sep="/")
    return {name: leaf for name, leaf in flat.items() if not is_lora_path(name)}


def _zeros(leaf: jax.ShapeDtypeStruct) -> jax.Array:
    return jax.jit(functools.partial(jnp.zeros, leaf.shape, leaf.dtype),
                   out_shardings=leaf.sharding)()


def read_reference(config: RunConfig, *, abstract_params) -> dict:
    """The DPO reference's parameters from DPO_REFERENCE_PATH, sharded as the parameters; LoRA's
    adapters zero (a reference with trained adapters: merge them first, export_merged)."""
    wanted = reference_plan(config, abstract_params=abstract_params)
    step, loaded = pretrained.restore_params(config.dpo.reference_path,
                                             traverse_util.unflatten_dict(wanted, sep="/"))
    logging.info("DPO reference: %d parameters from DPO_REFERENCE_PATH=%s (its step %d)",
                 len(wanted), config.dpo.reference_path, step)
    flat = traverse_util.flatten_dict(abstract_params, sep="/")
    adapters = {name: _zeros(leaf) for name, leaf in flat.items() if name not in wanted}
    return traverse_util.unflatten_dict(
        {**traverse_util.flatten_dict(loaded, sep="/"), **adapters}, sep="/")


def read_pretrained(config: RunConfig, *, plan: PretrainedPlan) -> dict:
    """Every parameter of `plan` read from CHECKPOINT_RESTORE_PATH with its sharding (a subset of
    the params tree); what is left out is logged as a warning."""
    path = config.loop.checkpoint_restore_path
    wanted, ignored, unread = plan.wanted, plan.ignored, plan.unread
    abstract = traverse_util.unflatten_dict(wanted, sep="/")
    step, loaded = pretrained.restore_params(path, abstract)
    logging.info(
        "Initialised %d of %d parameters from CHECKPOINT_RESTORE_PATH=%s (its step %d); this "
        "run starts at step 0 with fresh optimizer state",
        len(wanted), len(wanted) + len(ignored), path, step)
    rules = list(config.loop.checkpoint_ignore_rules)
    if ignored:
        logging.warning("CHECKPOINT_IGNORE_RULES=%s: %d of %d model parameters are NOT read from "
                        "the checkpoint and keep their fresh initialisation: %s", rules,
                        len(ignored), len(wanted) + len(ignored), ", ".join(ignored))
    if unread:
        logging.warning("CHECKPOINT_IGNORE_RULES=%s: %d parameters of the checkpoint are not in "
                        "this model and were NOT read: %s", rules, len(unread), ", ".join(unread))
    return loaded
