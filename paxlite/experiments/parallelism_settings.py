"""Pipeline and sequence parallelism hyperparameters -> the mesh layout and the model's settings.

Apart from base.py because the rules are their own: which form a 4-entry mesh shape has (Pax's
pipelined [pipeline, data, fsdp, tensor] when NUM_STAGES is set), how many stages and microbatches
a run has, and which combinations are refused. Every check here runs before any device work, so a
mesh that does not divide the layers, the batch or the sequence is one line naming the numbers
(docs/parallelism.md). The batch (which needs the device count) is checked at start-up in
train/loop.py through ``PipelineConfig.microbatches``.
"""

from __future__ import annotations

from typing import Any

import fiddle as fdl

from paxlite.models.parallel_config import ContextParallelStrategy, PipelineConfig
from paxlite.parallel.mesh import MeshConfig, MeshLayout

PIPELINE_SETTINGS = ("NUM_MICROBATCHES", "MICROBATCH_SIZE", "PIPELINE_REPEATS")
SEQ_SETTINGS = ("CONTEXT_PARALLEL_STRATEGY", "CONTEXT_PARALLEL_LOAD_BALANCE")


def mesh_layout(hp: Any) -> MeshLayout:
    """Pax's pipelined form when NUM_STAGES is set (Pax's pipelined experiments set it)."""
    return MeshLayout.PAX_PIPELINED if hp.NUM_STAGES is not None else MeshLayout.PAXLITE


def mesh_axis_sizes(hp: Any) -> dict[str, int]:
    """{axis: ICI x DCN size} from the shapes alone (ICI None puts every device on data, so every
    other axis is its DCN size)."""
    ici = None if hp.ICI_MESH_SHAPE is None else tuple(hp.ICI_MESH_SHAPE)
    mesh = MeshConfig(ici_mesh_shape=ici, dcn_mesh_shape=tuple(hp.DCN_MESH_SHAPE), layout=mesh_layout(hp))
    return mesh.axis_sizes(1)  # ICI None: data is the devices' (1 here); the other axes are DCN's


def num_stages(hp: Any) -> int:
    """NUM_STAGES, or the pipeline axis's size when it is None."""
    return hp.NUM_STAGES if hp.NUM_STAGES is not None else mesh_axis_sizes(hp)["pipeline"]


def pipeline_config(hp: Any) -> fdl.Config[PipelineConfig] | None:
    """The model's pipeline, or None when the run has one stage."""
    stages = num_stages(hp)
    if stages == 1 and hp.NUM_STAGES is None:
        return None
    return fdl.Config(PipelineConfig, num_stages=stages, num_microbatches=hp.NUM_MICROBATCHES,
                      microbatch_size=hp.MICROBATCH_SIZE, repeats=hp.PIPELINE_REPEATS)


def context_parallel_strategy(hp: Any) -> ContextParallelStrategy:
    return ContextParallelStrategy(hp.CONTEXT_PARALLEL_STRATEGY)


def load_balance_shards(hp: Any) -> int:
    """How many `seq` shards the rows are reordered for (1: rows stay in order)."""
    seq = mesh_axis_sizes(hp)["seq"]
    return seq if seq > 1 and hp.CONTEXT_PARALLEL_LOAD_BALANCE else 1


def parallelism_problems(hp: Any, *, scan_unit: int, uses_te: bool) -> list[str]:
    """What the pipeline / seq settings cannot run, one clause each, naming the numbers.

    ``scan_unit``: layers per scanned unit (GLaM's dense + MoE pair is 2); the pipeline's layer
    count is in units. ``uses_te``: Transformer Engine's layers (ENABLE_TE) compute the stack.
    """
    problems = []
    given = set(getattr(hp, "overridden", ()))
    sizes = mesh_axis_sizes(hp)
    pipe, seq = sizes["pipeline"], sizes["seq"]
    stages = num_stages(hp)
    if hp.NUM_STAGES is not None and stages % pipe:
        problems.append(
            f"NUM_STAGES={hp.NUM_STAGES} is not a multiple of the pipeline mesh axis "
            f"({pipe} = ICI {hp.ICI_MESH_SHAPE} x DCN {hp.DCN_MESH_SHAPE}); leave NUM_STAGES "
            f"unset for {pipe} stages")
    if stages > 1:
        units = hp.NUM_LAYERS // scan_unit
        per = stages * hp.PIPELINE_REPEATS
        if hp.NUM_LAYERS % scan_unit or units % per:
            unit_text = f" ({units} units of {scan_unit} layers)" if scan_unit > 1 else ""
            problems.append(
                f"NUM_LAYERS={hp.NUM_LAYERS}{unit_text} does not split into {stages} pipeline "
                f"stages x PIPELINE_REPEATS={hp.PIPELINE_REPEATS}: the layer count must be a "
                f"multiple of {per * scan_unit}")
        if (hp.PIPELINE_REPEATS > 1 and hp.NUM_MICROBATCHES is not None
                and hp.NUM_MICROBATCHES < stages):
            problems.append(
                f"PIPELINE_REPEATS={hp.PIPELINE_REPEATS} (the circular schedule) needs at least "
                f"as many microbatches as stages: NUM_MICROBATCHES={hp.NUM_MICROBATCHES} < "
                f"{stages} stages")
        if uses_te:
            problems.append(
                "ENABLE_TE=1 with a pipeline: Transformer Engine's layers are not pipelined here; "
                "unset ENABLE_TE or use a mesh without a pipeline axis")
    else:
        unused = sorted(given & set(PIPELINE_SETTINGS))
        if unused:
            problems.append(
                f"{', '.join(unused)} set, but the run has one pipeline stage (pipeline axis of "
                f"ICI {hp.ICI_MESH_SHAPE} x DCN {hp.DCN_MESH_SHAPE} is 1, NUM_STAGES unset): give "
                "the mesh a pipeline axis (5th entry), or drop them")
    if seq > 1:
        if getattr(hp, "ATTENTION_IMPLEMENTATION", "auto") in ("cudnn", "pallas_triton"):
            problems.append(
                f"ATTENTION_IMPLEMENTATION={hp.ATTENTION_IMPLEMENTATION!r} with a seq axis of {seq}: "
                "sequence-parallel attention runs the XLA implementation (the kernels see one "
                "shard's keys only); use 'auto' or 'xla'")
        if uses_te:
            problems.append(
                f"ENABLE_TE=1 with a seq axis of {seq}: Transformer Engine's layers mask by slot, "
                "not by each token's position; unset ENABLE_TE or drop the seq axis")
        chunks = 2 * seq if hp.CONTEXT_PARALLEL_LOAD_BALANCE else seq
        if hp.MAX_SEQ_LEN % chunks:
            why = (f"2 x seq = {chunks} equal chunks (CONTEXT_PARALLEL_LOAD_BALANCE)"
                   if hp.CONTEXT_PARALLEL_LOAD_BALANCE else f"seq = {seq} equal slices")
            problems.append(
                f"MAX_SEQ_LEN={hp.MAX_SEQ_LEN} does not split into {why}: choose a multiple of "
                f"{chunks}")
    else:
        unused = sorted(given & set(SEQ_SETTINGS))
        if unused:
            problems.append(
                f"{', '.join(unused)} set, but the mesh has no seq axis (6th entry of "
                f"ICI/DCN_MESH_SHAPE is 1): add one, or drop them")
    return problems
