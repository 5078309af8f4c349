"""The accelerators paxlite knows by their published facts: one table of peaks for MFU and the
planner, the GPU models XLA's GPU compiler is described for, and the TPU generations libtpu
compiles for.

One source of truth: `paxlite/train/flops.py` reads its peaks from `PEAKS`, and the compile targets
(paxlite/parallel/compile_targets/target.py) read a GPU's or TPU chip's peak from the same table by
its `device_kind`, so no number is written twice. Nothing here imports JAX.

Peaks are dense (no sparsity) per JAX device. Where a part has no FP8 matmul units (A100, TPU v4,
v5e, v5p) its FP8 peak is None: an FP8 run there is a bf16 run with casts and has no FP8 rate to
be measured against; so is v6e's, for which no FP8 rate is published. Int8 peaks are recorded
where they are published for the low-precision path (TPU v5e, v5p, v6e: AQT-style int8); elsewhere
None.
"""

from __future__ import annotations

import dataclasses
import enum

GIB = 2**30


@dataclasses.dataclass(frozen=True, kw_only=True)
class Peaks:
    """One part's dense peaks per JAX device, and how its `device_kind` names it."""

    name: str
    # GPUs: a case-insensitive substring of the CUDA name ("h100" in "NVIDIA H100 80GB HBM3");
    # TPUs: JAX's whole device_kind, case-insensitively ("TPU v5" must not take "TPU v5 lite").
    kind_substring: str | None = None
    kind_exact: tuple[str, ...] = ()
    bf16_tflops: float
    fp8_tflops: float | None = None  # None: no FP8 matmul units (or none published: v6e)
    int8_tops: float | None = None  # None: not recorded

    def matches(self, device_kind: str) -> bool:
        kind = device_kind.strip().lower()
        if self.kind_exact:
            return kind in self.kind_exact
        return self.kind_substring is not None and self.kind_substring in kind


# Ordered most specific first (substrings: "h100 pcie" before "h100"). TPU device kinds as libtpu's
# topology devices report them (checked with libtpu 0.0.50.1): v4 "TPU v4", v5e "TPU v5 lite",
# v5p "TPU v5", v6e "TPU v6 lite"; JAX also knows the spellings "TPU v5e", "TPU v5p", "TPU v6e".
PEAKS: tuple[Peaks, ...] = (
    Peaks(name="H100 PCIe", kind_substring="h100 pcie", bf16_tflops=756.0, fp8_tflops=1513.0),
    Peaks(name="H100 SXM", kind_substring="h100", bf16_tflops=989.0, fp8_tflops=1979.0),
    Peaks(name="H200", kind_substring="h200", bf16_tflops=989.0, fp8_tflops=1979.0),
    Peaks(name="A100", kind_substring="a100", bf16_tflops=312.0),
    Peaks(name="TPU v4", kind_exact=("tpu v4",), bf16_tflops=275.0),
    Peaks(name="TPU v5e", kind_exact=("tpu v5 lite", "tpu v5e"), bf16_tflops=197.0,
          int8_tops=394.0),
    Peaks(name="TPU v5p", kind_exact=("tpu v5", "tpu v5p"), bf16_tflops=459.0, int8_tops=918.0),
    Peaks(name="TPU v6e", kind_exact=("tpu v6 lite", "tpu v6e"), bf16_tflops=918.0,
          int8_tops=1836.0),
)


def peaks_for_device_kind(device_kind: str) -> Peaks | None:
    """The first entry of PEAKS that names `device_kind` (JAX's Device.device_kind), or None."""
    return next((peaks for peaks in PEAKS if peaks.matches(device_kind)), None)


def _peaks(device_kind: str) -> Peaks:
    peaks = peaks_for_device_kind(device_kind)
    if peaks is None:  # a description below without its row in PEAKS: a bug here
        raise LookupError(f"no peaks for device kind {device_kind!r}")
    return peaks


# ------------------------------------------------------------------------------------------------
# GPU models: the fields XLA's GPU compiler plans with (its GpuTargetConfigProto)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """One GPU model's description, as XLA's GPU compiler plans with it."""

    device_kind: str  # what the CUDA driver calls it (jax's Device.device_kind)
    compute_capability: tuple[int, int]
    sm_count: int
    fp32_units_per_sm: int
    memory_bytes: int  # what the driver reports as total memory
    memory_bandwidth_bytes_per_s: int
    memory_clock_ghz: float
    l2_cache_bytes: int
    shared_memory_per_sm: int
    shared_memory_per_block_optin: int
    sm_clock_ghz: float

    @property
    def dense_bf16_tflops(self) -> float:
        """The part's datasheet peak (dense, no sparsity), from PEAKS."""
        return _peaks(self.device_kind).bf16_tflops

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB

    @property
    def compute_capability_text(self) -> str:
        return f"{self.compute_capability[0]}.{self.compute_capability[1]}"


_H100_SXM = GpuSpec(  # H100 SXM5 80 GB
    device_kind="NVIDIA H100 80GB HBM3", compute_capability=(9, 0), sm_count=132,
    fp32_units_per_sm=128, memory_bytes=84_942_979_072,
    memory_bandwidth_bytes_per_s=3_352_320_000_000, memory_clock_ghz=2.619,
    l2_cache_bytes=50 * 2**20, shared_memory_per_sm=228 * 1024,
    shared_memory_per_block_optin=227 * 1024, sm_clock_ghz=1.98)

# By the name `--target` gives each model.
GPU_MODELS: dict[str, GpuSpec] = {
    "h100": _H100_SXM,
    # H200 SXM 141 GB: H100's die (the same SMs, caches and clocks), more and faster HBM3e
    "h200": dataclasses.replace(
        _H100_SXM, device_kind="NVIDIA H200", memory_bytes=151_397_597_184,
        memory_bandwidth_bytes_per_s=4_800_000_000_000, memory_clock_ghz=3.75),
    "a100": GpuSpec(  # A100 SXM4 80 GB
        device_kind="NVIDIA A100-SXM4-80GB", compute_capability=(8, 0), sm_count=108,
        fp32_units_per_sm=64, memory_bytes=85_100_068_864,
        memory_bandwidth_bytes_per_s=2_039_040_000_000, memory_clock_ghz=1.593,
        l2_cache_bytes=40 * 2**20, shared_memory_per_sm=164 * 1024,
        shared_memory_per_block_optin=163 * 1024, sm_clock_ghz=1.41),
}


# ------------------------------------------------------------------------------------------------
# TPU generations


class TpuGeneration(str, enum.Enum):
    V4 = "v4"
    V5E = "v5e"
    V5P = "v5p"
    V6E = "v6e"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TpuChip:
    """One TPU generation: what JAX calls its chip, its memory, and how its slices are named.

    A megacore chip (v4, v5p) is two TensorCores that JAX drives as one device; GCP's and
    AXLearn's slice names count TensorCores there (v5p-8 is 4 chips), and chips elsewhere
    (v5e-8 is 8 chips)."""

    generation: TpuGeneration
    device_kind: str  # jax's Device.device_kind of a chip (libtpu's topology devices)
    published_hbm_gib: int  # the datasheet's HBM per chip
    # The HBM a program may use, as the TPU compiler states it when a program does not fit
    # ("exceeds available HBM (15.75G)", libtpu 0.0.50.1, to 0.01 GiB; for v5e also the
    # `memory_stats()['bytes_limit']` of the chip lent to this project). The plan's verdict uses it.
    usable_hbm_bytes: int
    tensorcores_per_chip: int
    topology_dims: int  # 2: a 2D torus (v5e, v6e); 3: a 3D one (v4, v5p)
    # The slice shapes GCP offers by default, by chip count: `<generation>-N` picks one.
    slice_shapes: tuple[tuple[int, ...], ...]
    gcp_accelerator: str  # GCP's and AXLearn's prefix of an instance type: "tpu-v5litepod"

    @property
    def peaks(self) -> Peaks:
        return _peaks(self.device_kind)

    @property
    def megacore(self) -> bool:
        return self.tensorcores_per_chip > 1


_SQUARE_SLICES = ((1, 1), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16))
_CUBE_SLICES = ((2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4), (4, 4, 4), (4, 4, 8), (4, 8, 8),
                (8, 8, 8), (8, 8, 16), (8, 16, 16))

TPU_CHIPS: dict[TpuGeneration, TpuChip] = {
    TpuGeneration.V4: TpuChip(
        generation=TpuGeneration.V4, device_kind="TPU v4", published_hbm_gib=32,
        usable_hbm_bytes=int(30.75 * GIB), tensorcores_per_chip=2, topology_dims=3,
        slice_shapes=_CUBE_SLICES, gcp_accelerator="tpu-v4"),
    TpuGeneration.V5E: TpuChip(
        generation=TpuGeneration.V5E, device_kind="TPU v5 lite", published_hbm_gib=16,
        usable_hbm_bytes=int(15.75 * GIB), tensorcores_per_chip=1, topology_dims=2,
        slice_shapes=_SQUARE_SLICES, gcp_accelerator="tpu-v5litepod"),
    TpuGeneration.V5P: TpuChip(
        generation=TpuGeneration.V5P, device_kind="TPU v5", published_hbm_gib=95,
        usable_hbm_bytes=int(95.73 * GIB), tensorcores_per_chip=2, topology_dims=3,
        slice_shapes=(*_CUBE_SLICES, (16, 16, 16)), gcp_accelerator="tpu-v5p"),
    TpuGeneration.V6E: TpuChip(
        generation=TpuGeneration.V6E, device_kind="TPU v6 lite", published_hbm_gib=32,
        usable_hbm_bytes=int(31.24 * GIB), tensorcores_per_chip=1, topology_dims=2,
        slice_shapes=_SQUARE_SLICES, gcp_accelerator="tpu-v6e"),
}
