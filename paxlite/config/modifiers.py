"""Configuring in Python: named-axis mesh shapes, a hybrid (ICI x DCN) shape, and composable
modifiers.

The command line sets hyperparameters one flag at a time; code that builds many variants (sweeps,
per-cluster launch scripts) wants to say "this mesh, four microbatches" as values it can name,
combine and reuse. This mirrors AXLearn's seed (`mesh_shape_from_axes`, `HybridMeshShape`,
`GradientAccumulationModifier`, `MeshShapeModifier`, `ChainConfigModifier`) on paxlite's
hyperparameters: a modifier turns one set of overrides into another, and
`paxlite.experiments.build.configure` resolves an experiment with them, through exactly the checks
`--fdl.X=V` goes through.

    from paxlite.config.modifiers import (ChainConfigModifier, GradientAccumulationModifier,
                                          HybridMeshShape, MeshShapeModifier, mesh_shape_from_axes)
    from paxlite.experiments.build import configure
    experiment = configure("Pile5B", ChainConfigModifier([
        MeshShapeModifier(HybridMeshShape(ici=mesh_shape_from_axes(fsdp=8),
                                          dcn=mesh_shape_from_axes(data=16))),
        GradientAccumulationModifier(4),
    ]), MAX_STEPS=1000)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from paxlite.config.errors import ConfigError

# The entries of ICI_MESH_SHAPE / DCN_MESH_SHAPE, in order (parallel/mesh.py SHAPE_AXES).
MESH_AXES = ("data", "fsdp", "tensor", "expert", "pipeline", "seq")
_MIN_ENTRIES = 3


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Sizes of paxlite's mesh axes; at most one may be -1 ("all that is left")."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    expert: int = 1
    pipeline: int = 1
    seq: int = 1

    def __post_init__(self):
        sizes = self._all()
        if any(not isinstance(s, int) or isinstance(s, bool) or (s < 1 and s != -1) for s in sizes):
            raise ConfigError(
                f"mesh axis sizes must be positive integers or -1, got {self.named()}"
            )
        if sizes.count(-1) > 1:
            raise ConfigError(f"at most one mesh axis may be -1, got {self.named()}")

    def _all(self) -> list[int]:
        return [getattr(self, axis) for axis in MESH_AXES]

    def named(self) -> dict[str, int]:
        return dict(zip(MESH_AXES, self._all()))

    def as_list(self) -> list[int]:
        """[data, fsdp, tensor], then expert, pipeline and seq only as far as the last one that is
        not 1: a dense mesh is recorded as it always was, and each longer form keeps the meaning of
        the shorter ones."""
        sizes = self._all()
        length = max([_MIN_ENTRIES] + [i + 1 for i, s in enumerate(sizes) if s != 1])
        return sizes[:length]

    def resolve(self, num_devices: int) -> list[int]:
        """The sizes with a -1 replaced so that the product is `num_devices` (an error if it cannot
        be)."""
        sizes = self.as_list()
        named = dict(zip(MESH_AXES, sizes))
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % known:
                raise ConfigError(
                    f"mesh {named}: the fixed axes ({known}) do not divide {num_devices} devices"
                )
            sizes[sizes.index(-1)] = num_devices // known
        elif known != num_devices:
            raise ConfigError(
                f"mesh {named} covers {known} devices, not {num_devices}; use -1 on one axis "
                "to take the rest"
            )
        return sizes


def mesh_shape_from_axes(
    *, data: int = 1, fsdp: int = 1, tensor: int = 1, model: int | None = None, pipeline: int = 1,
    expert: int = 1, seq: int = 1,
) -> MeshShape:
    """A mesh shape by axis name, as AXLearn spells it (`model` is AXLearn's name for `tensor`).

    `expert` is the 4th entry of ICI/DCN_MESH_SHAPE, `pipeline` the 5th (the layer stack split
    into stages, docs/parallelism.md) and `seq` the 6th (each row's tokens split over devices).
    """
    if model is not None:
        if tensor != 1:
            raise ConfigError(f"give tensor={tensor} or model={model}, not both (model is "
                              "AXLearn's name for tensor)")
        tensor = model
    return MeshShape(data=data, fsdp=fsdp, tensor=tensor, expert=expert, pipeline=pipeline, seq=seq)


@dataclasses.dataclass(frozen=True)
class HybridMeshShape:
    """ICI (within a node, fast links) and DCN (across nodes) shapes; the device mesh is their
    product."""

    ici: MeshShape
    dcn: MeshShape = MeshShape()


class ConfigModifier(Protocol):
    """Takes the overrides so far and returns new ones; never mutates its input."""

    def __call__(self, overrides: Mapping[str, Any]) -> dict[str, Any]: ...


@dataclasses.dataclass(frozen=True)
class GradientAccumulationModifier:
    """K microbatches per optimizer step; the global batch (PERCORE_BATCH_SIZE x devices) is
    unchanged."""

    grad_acc_steps: int

    def __post_init__(self):
        if not isinstance(self.grad_acc_steps, int) or self.grad_acc_steps < 1:
            raise ConfigError(
                f"grad_acc_steps must be an integer >= 1, got {self.grad_acc_steps!r}"
            )

    def __call__(self, overrides: Mapping[str, Any]) -> dict[str, Any]:
        return {**overrides, "GRAD_ACCUM_STEPS": self.grad_acc_steps}


@dataclasses.dataclass(frozen=True)
class MeshShapeModifier:
    """Sets ICI_MESH_SHAPE / DCN_MESH_SHAPE; a plain MeshShape is ICI with DCN all 1s.

    A -1 is resolved when the modifier is applied: against `num_local_devices` for ICI and
    `num_processes` for DCN, which default to this process's `jax.local_device_count()` and
    `jax.process_count()`.
    """

    mesh_shape: MeshShape | HybridMeshShape
    num_local_devices: int | None = None
    num_processes: int | None = None

    def __call__(self, overrides: Mapping[str, Any]) -> dict[str, Any]:
        shape = self.mesh_shape
        hybrid = shape if isinstance(shape, HybridMeshShape) else HybridMeshShape(ici=shape)
        ici, dcn = hybrid.ici.as_list(), hybrid.dcn.as_list()
        if -1 in ici:
            ici = hybrid.ici.resolve(self._local_devices())
        if -1 in dcn:
            dcn = hybrid.dcn.resolve(self._processes())
        return {**overrides, "ICI_MESH_SHAPE": ici, "DCN_MESH_SHAPE": dcn}

    def _local_devices(self) -> int:
        if self.num_local_devices is not None:
            return self.num_local_devices
        import jax

        return jax.local_device_count()

    def _processes(self) -> int:
        if self.num_processes is not None:
            return self.num_processes
        import jax

        return jax.process_count()


def split_over_processes(sizes: Sequence[int], num_processes: int) -> tuple[list[int], list[int]]:
    """(ICI, DCN) of a whole-job mesh: the processes go on DCN from the first axes, as AXLearn
    splits a plain mesh shape over granules (its first axis larger than 1 takes them).

    E.g. [2, 8, 1] on 2 processes (two 8-GPU nodes, data 2 x fsdp 8) -> ICI [1, 8, 1], DCN [2, 1,
    1]. A pipeline axis (5th entry) takes processes before the others: [1, 8, 1, 1, 2] on 2
    processes puts one stage per node (DCN [1, 1, 1, 1, 2]).
    Where that axis is not a multiple of the process count, AXLearn's hybrid mesh fails (its PR #80
    falls back to a plain mesh); here each axis in turn takes the largest common factor of its size
    and the processes still to place ([8, 64, 1] on 64 processes -> DCN [8, 8, 1], ICI [1, 8, 1]:
    fsdp 8 within each node), and only a mesh that cannot hold the processes at all is an error.
    """
    ici, dcn = list(sizes), [1] * len(sizes)
    left = num_processes
    # The pipeline axis goes over DCN first where it can: stages pass one activation per
    # microbatch, the least data of any axis (why one pipelines across nodes at all).
    order = ([4] if len(sizes) > 4 else []) + [i for i in range(len(sizes)) if i != 4]
    for i in order:
        size = sizes[i]
        dcn[i] = math.gcd(size, left)
        ici[i] = size // dcn[i]
        left //= dcn[i]
    if left != 1:
        named = dict(zip(MESH_AXES, sizes))
        raise ConfigError(
            f"mesh {named} cannot be split over {num_processes} processes (each process must hold "
            "the same block of every axis); give a HybridMeshShape instead")
    return ici, dcn


@dataclasses.dataclass(frozen=True)
class GlobalMeshShapeModifier:
    """A mesh over every device of the job, as AXLearn's `mesh_shape` is (MeshShapeModifier's plain
    shape is one process's ICI mesh instead).

    A -1 takes what is left of all `num_devices`; the result is then split into ICI x DCN by
    `split_over_processes`. The counts default to `jax.device_count()` and `jax.process_count()`,
    so apply it after the multi-process runtime is joined, or pass them.
    """

    mesh_shape: MeshShape
    num_devices: int | None = None
    num_processes: int | None = None

    def __call__(self, overrides: Mapping[str, Any]) -> dict[str, Any]:
        if self.num_devices is None or self.num_processes is None:
            import jax

        num_devices = jax.device_count() if self.num_devices is None else self.num_devices
        num_processes = jax.process_count() if self.num_processes is None else self.num_processes
        ici, dcn = split_over_processes(self.mesh_shape.resolve(num_devices), num_processes)
        return {**overrides, "ICI_MESH_SHAPE": ici, "DCN_MESH_SHAPE": dcn}


@dataclasses.dataclass(frozen=True)
class RematPolicyModifier:
    """Scans the layer stack (USE_REPEATED_LAYER) and rematerialises it with one of Pax's
    CHECKPOINT_POLICY names."""

    policy: str

    def __call__(self, overrides: Mapping[str, Any]) -> dict[str, Any]:
        return {**overrides, "USE_REPEATED_LAYER": True, "CHECKPOINT_POLICY": self.policy}


@dataclasses.dataclass(frozen=True)
class OverridesModifier:
    """Any hyperparameters by name, as --fdl.NAME=VALUE would set them."""

    values: Mapping[str, Any]

    def __call__(self, overrides: Mapping[str, Any]) -> dict[str, Any]:
        return {**overrides, **self.values}


@dataclasses.dataclass(frozen=True)
class ChainConfigModifier:
    """Applies modifiers in order; a later one wins where two set the same hyperparameter."""

    config_modifiers: Sequence[ConfigModifier]

    def __call__(self, overrides: Mapping[str, Any]) -> dict[str, Any]:
        result = dict(overrides)
        for modifier in self.config_modifiers:
            result = modifier(result)
        return result
