"""The mesh, pipeline and sequence-parallelism hyperparameters -> the mesh and the model's settings.

The rules are their own: which form a 4-entry mesh shape has (Pax's pipelined [pipeline, data, fsdp,
tensor] when NUM_STAGES is set), how many stages and microbatches a run has, and which combinations
are refused. Every check here runs before any device work, so a mesh that does not divide the
layers, the batch or the sequence is one line naming the numbers (docs/parallelism.md). The rules
themselves belong to the configs that run them (``PipelineConfig.problems``, data/context_order.py's
``check_seq_divides``); here they are asked and answered in hyperparameter names. The batch (which
needs the device count) is checked at start-up in train/loop.py through
``PipelineConfig.microbatches``. A mixin of ``LanguageModelExperiment`` (base.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import fiddle as fdl

from paxlite.data.context_order import check_seq_divides
from paxlite.errors import SettingError
from paxlite.experiments.field_names import in_hparam_names
from paxlite.experiments.transformer_engine_settings import env_flag
from paxlite.models.parallel_config import (
    ContextParallelStrategy,
    PipelineConfig,
    scan_unit_layers,
)
from paxlite.parallel.mesh import MeshConfig, MeshLayout, mesh_shape_problems

PIPELINE_SETTINGS = ("NUM_MICROBATCHES", "MICROBATCH_SIZE", "PIPELINE_REPEATS")
SEQ_SETTINGS = ("CONTEXT_PARALLEL_STRATEGY", "CONTEXT_PARALLEL_LOAD_BALANCE")
# The one table from PipelineConfig's words (its fields, and the model's num_layers) to the
# hyperparameters that set them: its problems() are reported in these names.
PIPELINE_FIELD_NAMES = {
    "num_layers": "NUM_LAYERS",
    "num_stages": "NUM_STAGES",
    "num_microbatches": "NUM_MICROBATCHES",
    "microbatch_size": "MICROBATCH_SIZE",
    "repeats": "PIPELINE_REPEATS",
}
# The same for MeshConfig's shapes (its layout follows NUM_STAGES: mesh_layout).
MESH_FIELD_NAMES = {"ici_mesh_shape": "ICI_MESH_SHAPE", "dcn_mesh_shape": "DCN_MESH_SHAPE"}


def pipeline_counts(hp: Any) -> dict[str, int | None]:
    """PipelineConfig's fields, each the value of the hyperparameter the table names for it."""
    return {field.name: getattr(hp, PIPELINE_FIELD_NAMES[field.name])
            for field in dataclasses.fields(PipelineConfig)}


def mesh_layout(hp: Any) -> MeshLayout:
    """Pax's pipelined form when NUM_STAGES is set (Pax's pipelined experiments set it)."""
    return MeshLayout.PAX_PIPELINED if hp.NUM_STAGES is not None else MeshLayout.PAXLITE


def mesh_fields(hp: Any) -> dict[str, Any]:
    """MeshConfig's fields, the shapes from the hyperparameters MESH_FIELD_NAMES names."""
    shapes = {field: None if getattr(hp, name) is None else tuple(getattr(hp, name))
              for field, name in MESH_FIELD_NAMES.items()}
    return {**shapes, "layout": mesh_layout(hp)}


def mesh_axis_sizes(hp: Any) -> dict[str, int]:
    """{axis: ICI x DCN size} from the shapes alone (ICI None puts every device on data, so every
    other axis is its DCN size)."""
    # ICI None: data is the devices' (1 here); the others are DCN's
    return MeshConfig(**mesh_fields(hp)).axis_sizes(1)


def num_stages(hp: Any) -> int:
    """NUM_STAGES, or the pipeline axis's size when it is None."""
    return hp.NUM_STAGES if hp.NUM_STAGES is not None else mesh_axis_sizes(hp)["pipeline"]


class ParallelismSettings:
    """The device mesh, pipeline stages and sequence parallelism of a run."""

    # [data, fsdp, tensor(, expert(, pipeline(, seq)))] within a node / across nodes; None: all on
    # data. With NUM_STAGES set, a 4-entry shape is Pax's pipelined [pipeline, data, fsdp, tensor].
    ICI_MESH_SHAPE: list[int] | None = None
    DCN_MESH_SHAPE: list[int] = [1, 1, 1]
    # Pipeline parallelism (docs/parallelism.md): the layers run as stages over the `pipeline` mesh
    # axis, on microbatches of each batch. NUM_STAGES (Pax's): None means the pipeline axis's size;
    # set, it must be a multiple of it. Microbatches: NUM_MICROBATCHES, or (Pax) rows /
    # MICROBATCH_SIZE, else NUM_STAGES. PIPELINE_REPEATS > 1: the circular schedule.
    NUM_STAGES: int | None = None
    NUM_MICROBATCHES: int | None = None
    MICROBATCH_SIZE: int | None = None
    PIPELINE_REPEATS: int = 1
    # Sequence parallelism over the `seq` mesh axis: how attention reaches other shards' keys, and
    # whether rows are reordered (MaxText's dual_chunk_swap) so every shard has equal causal work.
    CONTEXT_PARALLEL_STRATEGY: Literal["all_gather", "ring"] = "all_gather"
    CONTEXT_PARALLEL_LOAD_BALANCE: bool = True

    def hparam_problems(self) -> list[str]:
        """The settings' own ranges (what they do together: parallelism_problems)."""
        problems = super().hparam_problems()
        problems += in_hparam_names(mesh_shape_problems(**mesh_fields(self)),
                                    names=MESH_FIELD_NAMES)
        counts = pipeline_counts(self)
        if self.NUM_STAGES is None:  # the pipeline axis's size: the shapes' rule above covers it
            del counts["num_stages"]
        problems += in_hparam_names(PipelineConfig.count_problems(**counts),
                                    names=PIPELINE_FIELD_NAMES)
        return problems

    def mesh_config(self) -> fdl.Config[MeshConfig]:
        return fdl.Config(MeshConfig, **mesh_fields(self))

    def pipeline_config(self) -> fdl.Config[PipelineConfig] | None:
        """The model's pipeline, or None when the run has one stage."""
        stages = num_stages(self)
        if stages == 1 and self.NUM_STAGES is None:
            return None
        return fdl.Config(PipelineConfig, **{**pipeline_counts(self), "num_stages": stages})

    def context_parallel_strategy(self) -> ContextParallelStrategy:
        return ContextParallelStrategy(self.CONTEXT_PARALLEL_STRATEGY)

    def layers_per_scan_unit(self) -> int:
        """What the model scans (and a pipeline splits) as one unit of layers."""
        interval = self.moe_layer_interval if self.is_moe() else None
        return scan_unit_layers(moe_layer_interval=interval)

    def parallelism_problems(self) -> list[str]:
        """What the pipeline / seq settings cannot run, one clause each, naming the numbers."""
        problems = []
        given = set(self.overridden)
        sizes = mesh_axis_sizes(self)
        pipe, seq = sizes["pipeline"], sizes["seq"]
        stages = num_stages(self)
        uses_te = env_flag("ENABLE_TE")  # Transformer Engine's layers compute the stack
        if self.NUM_STAGES is not None and stages % pipe:
            problems.append(
                f"NUM_STAGES={self.NUM_STAGES} is not a multiple of the pipeline mesh axis "
                f"({pipe} = ICI {self.ICI_MESH_SHAPE} x DCN {self.DCN_MESH_SHAPE}); leave "
                f"NUM_STAGES unset for {pipe} stages")
        if stages > 1:
            pipeline = fdl.build(self.pipeline_config())
            problems += in_hparam_names(pipeline.problems(
                num_layers=self.NUM_LAYERS, layers_per_unit=self.layers_per_scan_unit()),
                names=PIPELINE_FIELD_NAMES)
            if uses_te:
                problems.append(
                    "ENABLE_TE=1 with a pipeline: Transformer Engine's layers are not pipelined "
                    "here; unset ENABLE_TE or use a mesh without a pipeline axis")
        else:
            unused = sorted(given & set(PIPELINE_SETTINGS))
            if unused:
                problems.append(
                    f"{', '.join(unused)} set, but the run has one pipeline stage (pipeline axis "
                    f"of ICI {self.ICI_MESH_SHAPE} x DCN {self.DCN_MESH_SHAPE} is 1, NUM_STAGES "
                    "unset): give the mesh a pipeline axis (5th entry), or drop them")
        if seq > 1:
            if self.ATTENTION_IMPLEMENTATION in ("cudnn", "pallas_triton", "splash"):
                problems.append(
                    f"ATTENTION_IMPLEMENTATION={self.ATTENTION_IMPLEMENTATION!r} with a seq axis "
                    f"of {seq}: sequence-parallel attention runs the XLA implementation (the "
                    "kernels see one shard's keys only); use 'auto' or 'xla'")
            if uses_te:
                problems.append(
                    f"ENABLE_TE=1 with a seq axis of {seq}: Transformer Engine's layers mask by "
                    "slot, not by each token's position; unset ENABLE_TE or drop the seq axis")
            try:
                check_seq_divides(seq_len=self.MAX_SEQ_LEN, seq_shards=seq,
                                  load_balance=self.CONTEXT_PARALLEL_LOAD_BALANCE)
            except SettingError as e:
                problems.append(f"MAX_SEQ_LEN={self.MAX_SEQ_LEN} (CONTEXT_PARALLEL_LOAD_BALANCE="
                                f"{self.CONTEXT_PARALLEL_LOAD_BALANCE}): {e}")
        else:
            unused = sorted(given & set(SEQ_SETTINGS))
            if unused:
                problems.append(
                    f"{', '.join(unused)} set, but the mesh has no seq axis (6th entry of "
                    f"ICI/DCN_MESH_SHAPE is 1): add one, or drop them")
        return problems
