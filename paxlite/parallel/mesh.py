"""Device meshes from Pax's ICI_MESH_SHAPE x DCN_MESH_SHAPE.

Pax users describe parallelism as two [data, fsdp, tensor] shapes: one within a node (ICI) and one
across nodes (DCN). Later entries extend that form without changing what earlier ones mean: a 4th is
the expert axis (Pax's USE_EXPERT_PARALLEL), a 5th the pipeline axis, a 6th the sequence axis:
[data, fsdp, tensor, expert, pipeline, seq] (``SHAPE_AXES``); missing trailing entries are 1. Pax's
own pipelined meshes are 4-D [pp, dp, fsdp, tp]; that form is read when the layout says so
(``MeshLayout.PAX_PIPELINED``, which experiments choose when NUM_STAGES is set), because a plain
4-entry shape already means [data, fsdp, tensor, expert].

The device mesh is their element-wise product and always has all six axes, in the order
``MESH_AXES`` = (pipeline, data, fsdp, seq, tensor, expert): outermost the axis that moves least
data (pipeline stages pass one activation per microbatch; AXLearn and MaxText put it first too),
innermost the ones that talk every layer. Adding size-1 axes leaves the device order of every older
mesh as it was. Model code names any axis whatever the user gave. Within one process the devices
are laid out with `mesh_utils.create_device_mesh` (which knows the physical topology on GPUs);
across processes with `create_hybrid_device_mesh`, so that the slow-interconnect axes span nodes.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from absl import logging
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from paxlite.errors import UserError

# The order of ICI_MESH_SHAPE / DCN_MESH_SHAPE entries (paxlite's layout); 3 to 6 entries.
SHAPE_AXES: tuple[str, ...] = ("data", "fsdp", "tensor", "expert", "pipeline", "seq")
# Pax's pipelined 4-D form (its GPU CI's [pp, dp, fsdp, tp]).
PAX_PIPELINED_AXES: tuple[str, ...] = ("pipeline", "data", "fsdp", "tensor")
# The device mesh's axes, in device order (outermost first).
MESH_AXES: tuple[str, ...] = ("pipeline", "data", "fsdp", "seq", "tensor", "expert")
# A shape has at least [data, fsdp, tensor] (every mesh written before the expert axis).
_SHORT_LEN = 3
# Axes a global batch is split over; never over `tensor` (Pax: inputs split over replica and data,
# never mdl), `seq` (it splits each row's tokens) or `pipeline` (every stage sees every
# microbatch). Outside the MoE layers the expert axis is one more data axis, as in MaxText and Pax.
BATCH_AXES: tuple[str, ...] = ("data", "fsdp", "expert")


class MeshLayout(str, enum.Enum):
    """What the entries of ICI_MESH_SHAPE / DCN_MESH_SHAPE mean."""

    PAXLITE = "paxlite"  # [data, fsdp, tensor(, expert(, pipeline(, seq)))]
    # 4 entries are Pax's [pipeline, data, fsdp, tensor]; others as ever
    PAX_PIPELINED = "pax_pipelined"

    def axes_for(self, length: int) -> tuple[str, ...]:
        """The axis of each of `length` entries."""
        if self is MeshLayout.PAX_PIPELINED and length == len(PAX_PIPELINED_AXES):
            return PAX_PIPELINED_AXES
        return SHAPE_AXES[:length]

    def lengths(self) -> tuple[int, ...]:
        return tuple(range(_SHORT_LEN, len(SHAPE_AXES) + 1))

    def describe(self) -> str:
        text = (f"{_SHORT_LEN} to {len(SHAPE_AXES)} positive integers "
                f"[{', '.join(SHAPE_AXES)}] (entries after tensor are optional, 1 when left out)")
        if self is MeshLayout.PAX_PIPELINED:
            text += ("; 4 entries are Pax's pipelined [pipeline, data, fsdp, tensor] (NUM_STAGES "
                     "is set)")
        return text


class MeshError(UserError, ValueError):
    """A mesh that cannot be built on the devices at hand."""


def named_sizes(
    shape: Sequence[int] | None, layout: MeshLayout = MeshLayout.PAXLITE
) -> dict[str, int]:
    """{axis: size} for every MESH_AXES axis of one ICI or DCN shape as the user wrote it (None: all
    1)."""
    sizes = dict.fromkeys(MESH_AXES, 1)
    if shape is not None:
        sizes.update(zip(MeshLayout(layout).axes_for(len(shape)), shape))
    return sizes


def in_mesh_order(sizes: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(sizes[axis] for axis in MESH_AXES)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """ICI (within a node) and DCN (across nodes) shapes, in the entry order of ``layout``.

    ici=None puts every local device on data. The shapes are kept as given (config.txt shows what
    the user wrote); ici and dcn may differ in length, and `resolved_ici`/`resolved_dcn` give both
    in MESH_AXES order with all six axes.
    """

    ici_mesh_shape: tuple[int, ...] | None = None
    dcn_mesh_shape: tuple[int, ...] = (1, 1, 1)
    layout: MeshLayout = MeshLayout.PAXLITE

    def __post_init__(self):
        object.__setattr__(self, "layout", MeshLayout(self.layout))
        for field in ("ici_mesh_shape", "dcn_mesh_shape"):
            if getattr(self, field) is not None:
                object.__setattr__(self, field, tuple(getattr(self, field)))
        problems = mesh_shape_problems(ici_mesh_shape=self.ici_mesh_shape,
                                       dcn_mesh_shape=self.dcn_mesh_shape, layout=self.layout)
        if problems:
            raise MeshError("; ".join(problems))

    def resolved_ici(self, num_local_devices: int) -> tuple[int, ...]:
        """The ICI shape in MESH_AXES order; None: every local device on data."""
        if self.ici_mesh_shape is None:
            return in_mesh_order(named_sizes((num_local_devices,)))
        return in_mesh_order(named_sizes(self.ici_mesh_shape, self.layout))

    def resolved_dcn(self) -> tuple[int, ...]:
        """The DCN shape in MESH_AXES order."""
        return in_mesh_order(named_sizes(self.dcn_mesh_shape, self.layout))

    def shape(self, num_local_devices: int) -> tuple[int, ...]:
        """The device mesh shape: ICI x DCN element-wise, one size per MESH_AXES entry."""
        ici = self.resolved_ici(num_local_devices)
        return tuple(i * d for i, d in zip(ici, self.resolved_dcn(), strict=True))

    def axis_sizes(self, num_local_devices: int) -> dict[str, int]:
        return dict(zip(MESH_AXES, self.shape(num_local_devices), strict=True))


def mesh_shape_problems(*, ici_mesh_shape: Sequence[int] | None,
                        dcn_mesh_shape: Sequence[int] | None,
                        layout: MeshLayout = MeshLayout.PAXLITE) -> list[str]:
    """What the shapes cannot be, one clause each in MeshConfig's field names: the rule the config
    is refused by when it is made, which an experiment reports for its settings before it builds
    one (None: every local device on data, always valid)."""
    layout = MeshLayout(layout)
    problems = []
    for field, shape in (("ici_mesh_shape", ici_mesh_shape), ("dcn_mesh_shape", dcn_mesh_shape)):
        if shape is None:
            continue
        if len(shape) not in layout.lengths() or any(
            not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in shape
        ):
            problems.append(f"{field}={list(shape)}: expected {layout.describe()}")
    return problems


def full_shape(shape: Sequence[int], layout: MeshLayout = MeshLayout.PAXLITE) -> tuple[int, ...]:
    """`shape` (as the user wrote it) as one size per MESH_AXES entry, missing axes 1."""
    return in_mesh_order(named_sizes(shape, layout))


def check_mesh_fits(config: MeshConfig, *, num_devices: int, num_processes: int) -> None:
    """Raise MeshError naming the numbers when the mesh does not cover exactly the devices.

    With several processes the split is exact: ICI_MESH_SHAPE covers the devices of one process and
    DCN_MESH_SHAPE the processes. One process may stand in for several (DCN > 1 on one host, as in
    tests): then only the product must match the device count.
    """
    processes = max(num_processes, 1)
    if num_devices % processes:
        raise MeshError(
            f"{num_devices} devices over {processes} processes is uneven; every process must "
            "have the same number of devices"
        )
    local = num_devices // processes
    # Messages show the shapes as the user gave them (ICI=None as the data-parallel default).
    ici = config.ici_mesh_shape or (local, 1, 1)
    dcn = config.dcn_mesh_shape
    if processes > 1:
        problems = []
        if math.prod(ici) != local:
            problems.append(
                f"ICI_MESH_SHAPE={list(ici)} covers {math.prod(ici)} devices "
                f"but each process has {local}"
            )
        if math.prod(dcn) != processes:
            problems.append(
                f"DCN_MESH_SHAPE={list(dcn)} covers {math.prod(dcn)} processes "
                f"but there are {processes}"
            )
        if problems:
            raise MeshError(
                "; ".join(problems) + f" (for data parallelism across processes: "
                f"--fdl.ICI_MESH_SHAPE=[{local},1,1] --fdl.DCN_MESH_SHAPE=[{processes},1,1])"
            )
    total = math.prod(ici) * math.prod(dcn)
    if total != num_devices:
        hint = (
            f"for one node with {num_devices} device(s) pass "
            f"--fdl.ICI_MESH_SHAPE=[{num_devices},1,1] "
            "--fdl.DCN_MESH_SHAPE=[1,1,1]"
            + (f" (data parallel; [1,{num_devices},1] for FSDP)" if num_devices > 1 else "")
        )
        raise MeshError(
            f"ICI_MESH_SHAPE={list(ici)} x DCN_MESH_SHAPE={list(dcn)} needs {total} devices, "
            f"but this job has {num_devices} ({processes} process(es)); {hint}"
        )


def _granule_layout(ici: Sequence[int], devices: Sequence[jax.Device]) -> np.ndarray:
    """The ICI-shaped array of one granule's devices; topology-aware where JAX knows it."""
    try:
        return mesh_utils.create_device_mesh(ici, devices=devices)
    except (ValueError, NotImplementedError, AssertionError):
        return np.asarray(devices, dtype=object).reshape(ici)


def hybrid_layout(
    ici: Sequence[int], dcn: Sequence[int], granules: Sequence[Sequence[jax.Device]]
) -> np.ndarray:
    """Granule g (of prod(dcn)) at DCN position unravel(g, dcn); inside it, the ICI layout.

    The rule of `mesh_utils.create_hybrid_device_mesh`: along each axis the DCN index is the outer
    one, so mesh index = dcn_index x ici_size + ici_index. Used to lay out one process as if it were
    several.
    """
    blocks = np.stack([_granule_layout(ici, granule) for granule in granules])
    blocks = blocks.reshape(*dcn, *ici)  # [dcn_0, ..., dcn_{n-1}, ici_0, ..., ici_{n-1}]
    n = len(ici)
    interleaved = blocks.transpose([a for i in range(n) for a in (i, n + i)])
    return interleaved.reshape([d * i for d, i in zip(dcn, ici, strict=True)])


def build_mesh(config: MeshConfig, *, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The MESH_AXES mesh over `devices` (default: all devices of the job).

    Several processes: `create_hybrid_device_mesh` with one granule per process, so the DCN axes
    span processes (nodes) and the ICI axes stay within one. One process with DCN > 1 is laid out by
    the same rule over consecutive blocks of devices, so single-process tests see the multi-process
    layout.
    """
    devices = list(jax.devices() if devices is None else devices)
    num_processes = len({d.process_index for d in devices})
    check_mesh_fits(config, num_devices=len(devices), num_processes=num_processes)
    ici = config.resolved_ici(len(devices) // num_processes)
    dcn = config.resolved_dcn()
    if num_processes > 1:
        device_array = mesh_utils.create_hybrid_device_mesh(
            ici, dcn, devices=devices, process_is_granule=True
        )
    elif math.prod(dcn) > 1:
        ordered = sorted(devices, key=lambda d: d.id)
        size = len(ordered) // math.prod(dcn)
        device_array = hybrid_layout(
            ici, dcn, [ordered[g * size : (g + 1) * size] for g in range(math.prod(dcn))]
        )
    else:
        device_array = _granule_layout(ici, devices)
    logging.info(
        "Mesh %s (ICI %s x DCN %s) over device ids %s",
        dict(zip(MESH_AXES, device_array.shape, strict=True)),
        list(ici),
        list(dcn),
        np.vectorize(lambda d: d.id, otypes=[int])(device_array).tolist(),
    )
    return Mesh(device_array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def global_batch_size(*, percore_batch_size: float, num_devices: int, batch_split: int,
                      fixed_global_batch_size: int | None = None) -> int:
    """Pax semantics: PERCORE_BATCH_SIZE x devices, whatever the parallelism.

    It must be a whole number that divides evenly over the data x fsdp x expert axes (with tensor
    parallelism PERCORE_BATCH_SIZE may be fractional). `fixed_global_batch_size` (GLOBAL_BATCH_SIZE,
    as AXLearn fixes it) replaces the product; each device then holds GLOBAL / devices rows, and
    the same split rule applies.
    """
    if fixed_global_batch_size is not None:
        fixed = fixed_global_batch_size
        if fixed < 1 or fixed % batch_split:
            per_device = fixed / num_devices
            raise MeshError(
                f"GLOBAL_BATCH_SIZE={fixed} does not divide over data x fsdp x expert = "
                f"{batch_split} ways "
                f"({num_devices} devices, {per_device:g} rows per device); choose a multiple of "
                f"{batch_split} or a mesh whose data x fsdp x expert divides {fixed}"
            )
        return fixed
    total = percore_batch_size * num_devices
    rounded = round(total)
    if rounded < 1 or abs(total - rounded) > 1e-6:
        raise MeshError(
            f"PERCORE_BATCH_SIZE={percore_batch_size} x {num_devices} devices = {total:g} is not a "
            "positive whole global batch; choose PERCORE_BATCH_SIZE so the product is an integer"
        )
    if rounded % batch_split:
        raise MeshError(
            f"global batch {rounded} (PERCORE_BATCH_SIZE={percore_batch_size} x "
            f"{num_devices} devices) "
            f"does not divide over data x fsdp x expert = {batch_split} ways"
        )
    return rounded
