"""What the planner compiles for, parsed once from `--target`: this process's CPU devices, a GPU
model (XLA's GPU compiler, JAX's CUDA plugin) or a TPU slice (the TPU compiler, libtpu).

A `CompileTarget` is its canonical name (a `str`: "cpu", "h100", "v5e-8"; what `compiled_for`
holds in a plan's JSON, and what `parse` reads back), carrying what it names: its kind, the GPU's
description or the TPU slice (generation, chips, topology). Parse it where the string comes in
(the command line, `PlanRequest`) and pass the object on; `parse` returns a target unchanged.

TPU slices are named as GCP and AXLearn name them: `v5e-N` and `v6e-N` count chips (v5e-8 is a
2x4 slice of 8 chips), `v4-N` and `v5p-N` count TensorCores, two to a chip (v5p-8 is a 2x2x1
slice of 4 chips: JAX sees one device per chip). A topology names the shape itself (`v5e:2x4`,
`v5p:4x4x12`); `tpu-v5litepod-256` (an AXLearn mesh selector) and `v5litepod-256` (GCP's v5e
accelerator type) are read as `v5e-256`.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import re
from typing import Any, ClassVar, Self

from paxlite.errors import UserError
from paxlite.parallel.compile_targets.chips import (
    GPU_MODELS,
    TPU_CHIPS,
    GpuSpec,
    TpuChip,
    TpuGeneration,
)


class CompileUnavailableError(UserError):
    """A GPU or TPU compiler cannot run in this process; the message says what to install."""


class TargetKind(str, enum.Enum):
    """Which compiler: XLA's CPU compiler, its GPU compiler, or the TPU compiler."""

    CPU = "cpu"
    GPU = "gpu"
    TPU = "tpu"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TpuSlice:
    """`chips` TPU chips of one generation in a `shape` (the slice's torus, 2 or 3 numbers)."""

    chip: TpuChip
    shape: tuple[int, ...]

    @property
    def generation(self) -> TpuGeneration:
        return self.chip.generation

    @property
    def chips(self) -> int:
        return math.prod(self.shape)

    @property
    def topology(self) -> str:
        """libtpu's topology name: 'v5e:2x4'."""
        return f"{self.generation.value}:{'x'.join(map(str, self.shape))}"

    @property
    def name(self) -> str:
        """GCP's and AXLearn's size name: 'v5e-8' (chips), 'v5p-8' (TensorCores: 4 chips)."""
        return f"{self.generation.value}-{self.chips * self.chip.tensorcores_per_chip}"

    @property
    def is_default_shape(self) -> bool:
        """The shape `name` stands for (GCP's default slice of that many chips)."""
        return _default_shape(self.chip, self.chips) == self.shape

    @property
    def instance_type(self) -> str:
        """AXLearn's mesh selector for this slice ('tpu-v5litepod-256', fuji_mesh's rules)."""
        return f"{self.chip.gcp_accelerator}-{self.chips * self.chip.tensorcores_per_chip}"


def _default_shape(chip: TpuChip, chips: int) -> tuple[int, ...] | None:
    return next((shape for shape in chip.slice_shapes if math.prod(shape) == chips), None)


class _NamedTargets(type):
    def __iter__(cls):
        """The targets with a fixed name: cpu and the GPU models (a TPU target names a slice)."""
        return iter(cls._named.values())


class CompileTarget(str, metaclass=_NamedTargets):
    """A compile target: its canonical name, with its kind and the device it describes."""

    _named: ClassVar[dict[str, CompileTarget]]
    CPU: ClassVar[CompileTarget]
    H100: ClassVar[CompileTarget]
    H200: ClassVar[CompileTarget]
    A100: ClassVar[CompileTarget]

    kind: TargetKind
    gpu: GpuSpec | None
    tpu: TpuSlice | None

    def __new__(cls, name: str, *, kind: TargetKind, gpu: GpuSpec | None = None,
                tpu: TpuSlice | None = None) -> Self:
        self = super().__new__(cls, name)
        for field, value in (("kind", kind), ("gpu", gpu), ("tpu", tpu)):
            object.__setattr__(self, field, value)
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a CompileTarget is immutable ({name!r})")

    def __reduce__(self):
        return (CompileTarget.parse, (str(self),))

    def __repr__(self) -> str:
        return f"CompileTarget({str(self)!r})"

    @property
    def value(self) -> str:
        """The canonical name (as an enum's value: `--target=<value>` gives this target)."""
        return str(self)

    @property
    def is_gpu(self) -> bool:
        return self.kind is TargetKind.GPU

    @property
    def is_tpu(self) -> bool:
        return self.kind is TargetKind.TPU

    @property
    def compile_only(self) -> bool:
        """Devices that are descriptions (a GPU or TPU target): they hold no arrays."""
        return self.kind is not TargetKind.CPU

    @property
    def platform(self) -> str:
        """JAX's platform name of the target's devices ('cpu', 'gpu', 'tpu')."""
        return self.kind.value

    @property
    def spec(self) -> GpuSpec:
        if self.gpu is None:
            raise ValueError(f"the {self} target has no GPU description")
        return self.gpu

    @property
    def device_kind(self) -> str | None:
        """JAX's device_kind of one device of the target (None for cpu)."""
        if self.gpu is not None:
            return self.gpu.device_kind
        return self.tpu.chip.device_kind if self.tpu is not None else None

    @property
    def memory_bytes(self) -> int | None:
        """One device's memory the verdict compares with: a GPU's total memory, a TPU chip's HBM
        as the TPU compiler allows a program (chips.TpuChip.usable_hbm_bytes); None for cpu."""
        if self.gpu is not None:
            return self.gpu.memory_bytes
        return self.tpu.chip.usable_hbm_bytes if self.tpu is not None else None

    @property
    def peak_tflops(self) -> float | None:
        """Dense BF16 TFLOP/s of one device (chips.PEAKS); None for cpu."""
        if self.gpu is not None:
            return self.gpu.dense_bf16_tflops
        return self.tpu.chip.peaks.bf16_tflops if self.tpu is not None else None

    @property
    def num_devices(self) -> int | None:
        """The devices the target has: a TPU slice's chips; None where `--devices` says (cpu,
        a GPU cluster of any size)."""
        return self.tpu.chips if self.tpu is not None else None

    def describe(self) -> str:
        """One phrase for messages: 'v5e-8 (topology v5e:2x4, 8 chips of TPU v5 lite)'."""
        if self.tpu is not None:
            return (f"{self} (topology {self.tpu.topology}, {self.tpu.chips} chip"
                    f"{'s' if self.tpu.chips > 1 else ''} of {self.tpu.chip.device_kind})")
        return str(self) if self.gpu is None else f"{self} ({self.gpu.device_kind})"

    @classmethod
    def tpu_slice(cls, tpu: TpuSlice) -> CompileTarget:
        """The target of a slice, named by its size where its shape is the default one."""
        return cls(tpu.name if tpu.is_default_shape else tpu.topology, kind=TargetKind.TPU,
                   tpu=tpu)

    @classmethod
    def parse(cls, value: str | CompileTarget) -> CompileTarget:
        """`value` as a target (a target is returned as it is); UserError naming the valid forms."""
        if isinstance(value, CompileTarget):
            return value
        text = str(value).strip().lower()
        if text in cls._named:
            return cls._named[text]
        tpu = _parse_tpu(text, given=value)
        if tpu is None:
            raise UserError(_bad_target(value))
        return cls.tpu_slice(tpu)

    @classmethod
    def from_json(cls, value: str) -> CompileTarget:
        return cls.parse(value)


CompileTarget.CPU = CompileTarget("cpu", kind=TargetKind.CPU)
CompileTarget.H100, CompileTarget.H200, CompileTarget.A100 = (
    CompileTarget(name, kind=TargetKind.GPU, gpu=GPU_MODELS[name]) for name in ("h100", "h200",
                                                                                 "a100"))
CompileTarget._named = {str(t): t for t in (CompileTarget.CPU, CompileTarget.H100,
                                            CompileTarget.H200, CompileTarget.A100)}

# Each GPU model's description, by its target (GPU_MODELS by name).
GPU_SPECS: dict[CompileTarget, GpuSpec] = {target: target.spec for target in CompileTarget
                                           if target.is_gpu}

# ------------------------------------------------------------------------------------------------
# Parsing a TPU slice

_ALIASES = {"v5litepod": TpuGeneration.V5E}
_SIZE = re.compile(r"(?:tpu-)?(v4|v5e|v5p|v6e|v5litepod)-(\d+)")
_TOPOLOGY = re.compile(r"(v4|v5e|v5p|v6e):(\d+(?:x\d+)+)")


def _generation(name: str) -> TpuGeneration:
    return _ALIASES.get(name) or TpuGeneration(name)


def _parse_tpu(text: str, *, given: object) -> TpuSlice | None:
    """A TPU slice from 'v5e-8' or 'v5e:2x4' (None: neither form); UserError for a form whose
    numbers are not a slice of that generation."""
    if match := _SIZE.fullmatch(text):
        chip = TPU_CHIPS[_generation(match.group(1))]
        count = int(match.group(2))
        chips, uneven = divmod(count, chip.tensorcores_per_chip)
        shape = None if uneven else _default_shape(chip, chips)
        if shape is None:
            raise UserError(_bad_size(given, chip, count))
        return TpuSlice(chip=chip, shape=shape)
    if match := _TOPOLOGY.fullmatch(text):
        chip = TPU_CHIPS[_generation(match.group(1))]
        shape = tuple(int(n) for n in match.group(2).split("x"))
        if len(shape) != chip.topology_dims or min(shape) < 1:
            raise UserError(
                f"--target={given!r}: a {chip.generation.value} topology has "
                f"{chip.topology_dims} sizes ({_shape_text(chip.slice_shapes[1])}), each >= 1")
        if chip.topology_dims == 2 and shape not in chip.slice_shapes:
            # 2D slices come in GCP's shapes only; 3D ones are any whole torus libtpu accepts
            raise UserError(
                f"--target={given!r}: {chip.generation.value} slices are "
                f"{', '.join(_shape_text(s) for s in chip.slice_shapes)}; did you mean "
                f"'{chip.generation.value}:{_shape_text(_nearest_shape(chip, math.prod(shape)))}'?")
        return TpuSlice(chip=chip, shape=shape)
    return None


def _shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def _sizes(chip: TpuChip) -> list[int]:
    return [math.prod(shape) * chip.tensorcores_per_chip for shape in chip.slice_shapes]


def _bad_size(given: object, chip: TpuChip, count: int) -> str:
    generation = chip.generation.value
    counts = ("TensorCores, 2 to a chip" if chip.megacore else "chips")
    sizes = ", ".join(map(str, _sizes(chip)))
    nearest = min(_sizes(chip), key=lambda n: (abs(n - count), -n))
    return (f"--target={given!r}: {generation}-N counts {counts}; N is one of {sizes} (or give "
            f"a topology, e.g. {generation}:{_shape_text(chip.slice_shapes[-1])}); did you mean "
            f"'{generation}-{nearest}'?")


def _nearest_shape(chip: TpuChip, chips: int) -> tuple[int, ...]:
    return min(chip.slice_shapes, key=lambda shape: (abs(math.prod(shape) - chips),
                                                     -math.prod(shape)))


def valid_forms() -> str:
    """The forms `--target` takes, for messages and help."""
    named = ", ".join(t.value for t in CompileTarget)
    return (f"{named}, or a TPU slice {', '.join(f'{g.value}-N' for g in TpuGeneration)} "
            "(e.g. v5e-8) or topology (e.g. v5e:2x4)")


def _bad_target(given: object) -> str:
    """The one line for a value that is none of the forms, with the closest valid name."""
    text = str(given).strip().lower()
    bare = {"tpu": "v5e", **{g.value: g.value for g in TpuGeneration}, "v5litepod": "v5e"}
    if text in bare:  # a TPU without its size: every generation has an 8 (v5p-8 is 4 chips)
        close = [f"{bare[text]}-8"]
    else:
        candidates = [t.value for t in CompileTarget] + [
            f"{chip.generation.value}-{n}" for chip in TPU_CHIPS.values() for n in _sizes(chip)]
        close = difflib.get_close_matches(text, candidates, n=1, cutoff=0.6)
    return (f"--target={given!r}: expected one of {valid_forms()}"
            + (f"; did you mean {close[0]!r}?" if close else ""))
