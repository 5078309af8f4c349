"""What the planner measures and decides, as typed records: one compile of a train step
(`StepMeasurement`), and the plan made of it (`Plan`: the memory and its verdict, the mesh and the
batch, attention, the pipeline, seq and MoE breakdowns, FLOPs, the levers, the longest sequence).

Built once where they are computed and read by attribute; their JSON
(paxlite/planner/json_records.py) is `python -m paxlite plan --format=json`'s, key for key, so
scripts that read it are unaffected.
Importing this module starts no JAX: `plan` reads it before it sets up JAX's devices.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Self

from paxlite.parallel.compile_targets import CompileTarget
from paxlite.planner.json_records import JsonRecord, flattened, json_key, optional

GIB = 2**30
PEAK_FORMULA = "argument + output - alias + temp + generated_code"
# On a TPU target the plan's peak is the TPU compiler's own figure: within 0.6% of the peak the
# runtime measured on a v5e chip for a 507M GPT, where the sum above was 20% over
# (docs/performance.md); for a program it refuses, the need its refusal states (the same quantity:
# 16.16 GiB refused on v5e, 16.15 GiB compiled for v6e).
TPU_PEAK_FORMULA = "the TPU compiler's peak_memory_in_bytes (or the need its refusal states)"
BUBBLE_FORMULA = "(S - 1) / (R*M + S - 1)"

_record = dataclasses.dataclass(frozen=True, kw_only=True)


# ------------------------------------------------------------------------------------------------
# One compile


@_record
class MeshSizes(JsonRecord):
    """The size of each mesh axis, in parallel/mesh.py's MESH_AXES order (the JSON's order)."""

    pipeline: int
    data: int
    fsdp: int
    seq: int
    tensor: int
    expert: int

    @classmethod
    def from_shape(cls, shape: dict[str, int]) -> Self:
        """From a jax Mesh's `shape` ({axis: size} over every MESH_AXES axis)."""
        from paxlite.parallel.mesh import MESH_AXES

        if tuple(shape) != MESH_AXES or tuple(f.name for f in dataclasses.fields(cls)) != MESH_AXES:
            raise RuntimeError(f"mesh axes {tuple(shape)} are not MESH_AXES {MESH_AXES}")
        return cls(**{axis: int(size) for axis, size in shape.items()})

    @property
    def batch_ways(self) -> int:
        """How many ways the batch's rows split: data x fsdp x expert (mesh.py's BATCH_AXES)."""
        return self.data * self.fsdp * self.expert


@_record
class DeviceMemory(JsonRecord):
    """One device's bytes: the state's exact shards, and XLA's memory analysis of the program."""

    parameter_bytes: int
    optimizer_state_bytes: int
    gradient_bytes: int  # the parameters' dtype and sharding
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int
    # Donated state: outputs reuse argument buffers, counted once (PEAK_FORMULA).
    peak_bytes: int
    # TRAIN_TASK=dpo: the reference model's parameters, an argument of the step beside the state
    # (None: no DPO, or LoRA's base with the adapters off, which needs no copy)
    reference_bytes: int | None = optional()

    @property
    def state_bytes(self) -> int:
        """Parameter + optimizer-state + gradient bytes: what more fsdp or stages divide."""
        return self.parameter_bytes + self.optimizer_state_bytes + self.gradient_bytes


@_record
class CompiledProgram(JsonRecord):
    """What a program compiled for a GPU or TPU target launches, and the options it was compiled
    with."""

    # custom call -> call sites (a scanned stack's body once); None: the TPU compiler refused it
    kernels: dict[str, int] | None
    fp8_gemms: dict[str, int] | None  # parallel/compiled_kernels.py fp8_gemms; GPU targets only
    xla_preset: str | None  # None: no preset applies to the target (every preset is a GPU one)
    compiler_options: dict[str, str]


@_record
class HbmRefusal(JsonRecord):
    """The TPU compiler's refusal of a program that does not fit the chip's HBM: how much the
    program needs and how much the chip has, as its message states them (to 0.01 GiB)."""

    needed_bytes: int
    available_bytes: int
    message: str


@_record
class StepMeasurement(JsonRecord):
    """One compile of a run's train step for N devices of a target, read for one device."""

    compiled_for: CompileTarget
    # the compile-only devices' layout: a TPU slice's ("v5e:2x4") or the GPUs' ("1x2x8"); None: cpu
    topology: str | None = optional()
    mesh: MeshSizes
    ici_mesh_shape: tuple[int, ...]
    dcn_mesh_shape: tuple[int, ...]
    global_batch_size: int
    seq_len: int
    memory: DeviceMemory
    # This device's share of the parameters split over the pipeline axis (its stage's layers).
    pipeline_split_parameter_bytes: int
    compiler_flops_per_device: float | None  # None: the compiler gave no cost analysis
    compile_s: float
    attention_note: str | None = optional()  # a fused kernel compiled as XLA's attention
    program: CompiledProgram | None = optional(flatten=True)  # None for cpu
    refused: HbmRefusal | None = optional()  # a TPU program too big for the chip

    @property
    def gpu_program(self) -> CompiledProgram | None:
        """`program` of a GPU target (None for cpu and TPU targets)."""
        return self.program if self.compiled_for.is_gpu else None

    def layout(self) -> dict[str, Any]:
        """The fields a `Plan` reports as the compile found them: the target, the mesh and the
        batch's shape."""
        return {name: getattr(self, name) for name in (
            "compiled_for", "topology", "mesh", "ici_mesh_shape", "dcn_mesh_shape",
            "global_batch_size", "seq_len")}


@_record
class Verdict(JsonRecord):
    fits: bool
    margin_bytes: int  # negative: short by that much
    margin_gib: float

    @classmethod
    def of(cls, *, peak_bytes: int, device_bytes: int) -> Self:
        return cls(fits=peak_bytes <= device_bytes, margin_bytes=device_bytes - peak_bytes,
                   margin_gib=round((device_bytes - peak_bytes) / GIB, 3))


# ------------------------------------------------------------------------------------------------
# What a plan says about the run's parallelism


@_record
class PipelinePlan(JsonRecord):
    """A pipelined run's schedule (models/parallel_config.py PipelineConfig.schedule) and what one
    stage holds."""

    num_stages: int
    repeats: int
    schedule: str  # "gpipe" or "circular"
    num_microbatches: int
    microbatch_rows: int
    iterations: int
    bubble_fraction: float
    pipeline_axis: int
    stages_per_device: int
    microbatch_rows_per_device: int  # each microbatch's rows over data x fsdp x expert
    bubble_formula: str = BUBBLE_FORMULA
    layers_per_stage: int
    # Per device: its stage's share of the layer stack; the rest (embedding, final norm, and an
    # unscanned stack's layers, which have no [L] axis to split) is held by every stage.
    stage_layer_parameter_bytes: int
    parameter_bytes_on_every_stage: int
    layers_split_over_stages: bool
    memory_is_per_stage: bool


@_record
class SeqPlan(JsonRecord):
    """The seq axis: how many shards a row's tokens are split into and what one device holds."""

    seq: int
    strategy: str
    load_balance: bool
    tokens_per_shard: int
    rows_per_device: int
    tokens_per_device: int


@_record
class GShardRouting(JsonRecord):
    """GShard's dispatch and combine tensors [G, S, E, C] of one MoE layer on one device."""

    groups: int
    group_size: int
    capacity: int
    dispatch_combine_elements_per_device: int
    dispatch_combine_bytes_per_device: int


@_record
class DroplessRouting(JsonRecord):
    """Dropless routing's sorted expert rows of one MoE layer on one device."""

    sorted_rows_per_device: int
    sorted_rows_bytes_per_device: int
    ragged_dot_dense_expansion_bytes_per_device: int


@_record
class MoePlan(JsonRecord):
    """Experts per device and the routing tensors of one MoE layer per device
    (models/moe_params.py routing_memory: one of `gshard`, `dropless`)."""

    num_experts: int
    experts_per_token: int
    moe_layers: int
    expert_axis: int
    experts_per_device: int
    routing: str
    gshard: GShardRouting | None = optional(flatten=True)
    dropless: DroplessRouting | None = optional(flatten=True)
    formula: str

    @classmethod
    def of(cls, *, routing_memory: dict[str, Any], **experts: int) -> Self:
        """From routing_memory's dict (one routing's keys, plus "routing" and "formula")."""
        sizes = {key: value for key, value in routing_memory.items()
                 if key not in ("routing", "formula")}
        gshard = "groups" in sizes
        return cls(**experts, routing=routing_memory["routing"],
                   formula=routing_memory["formula"],
                   gshard=GShardRouting(**sizes) if gshard else None,
                   dropless=None if gshard else DroplessRouting(**sizes))


@_record
class FlopsPerStep(JsonRecord):
    analytic: float
    analytic_per_token: float
    compiler_per_device: float | None
    compiler_total: float | None
    compiler_note: str | None  # why there is no compiler count
    # XLA's cost analysis counts a while loop's body once: with a scanned layer stack (or a
    # pipeline's loop) the compiler figure is about one iteration's work plus the rest.
    compiler_counts_scanned_layers_once: bool


# ------------------------------------------------------------------------------------------------
# Re-plans: levers and the longest sequence


@_record
class Lever(JsonRecord):
    """One way to make the run fit: measured (`peak_bytes` and its verdict), refused by the
    configuration (`applicable` False and the `reason`), or left uncompiled (`skipped`)."""

    lever: str  # what changes, as the user would say it
    method: str | None = optional()  # "compiled", "not compiled" or the analytic formula
    overrides: dict[str, Any] | None = optional()  # the hyperparameters a compiled lever sets
    applicable: bool | None = optional()  # False when refused; the JSON has no key otherwise
    reason: str | None = optional()
    skipped: str | None = optional()
    peak_bytes: int | None = optional()
    verdict: Verdict | None = optional(flatten=True)

    @property
    def refused(self) -> bool:
        return self.applicable is False

    @property
    def fits(self) -> bool:
        return self.verdict is not None and self.verdict.fits

    def refuse(self, reason: str) -> Self:
        return dataclasses.replace(self, applicable=False, reason=reason)

    def measured(self, *, peak_bytes: int, device_bytes: int) -> Self:
        return dataclasses.replace(self, peak_bytes=peak_bytes, verdict=Verdict.of(
            peak_bytes=peak_bytes, device_bytes=device_bytes))


@_record
class SeqFit(JsonRecord):
    """peak(T) = a + b*T + c*T^2, fitted through the compiles at `through`."""

    a: float
    b: float
    c: float
    through: tuple[int, ...]

    def rising_root(self, device_bytes: int) -> float | None:
        """The smallest T > 0 where the fit reaches `device_bytes` from below (None: never)."""
        import numpy as np

        c, b, a = self.c, self.b, self.a
        roots = np.roots([c, b, a - device_bytes] if c else [b, a - device_bytes])
        rising = sorted(float(r.real) for r in roots if abs(r.imag) < 1e-9 and r.real > 0
                        and 2 * c * r.real + b > 0)
        return rising[0] if rising else None


@_record
class CompiledLength(JsonRecord):
    """One length the search compiled: its peak and whether it fits, or why it was refused."""

    seq_len: int
    peak_bytes: int | None
    fits: bool | None = optional()
    refused: str | None = optional()


@_record
class LongestSeqFound(JsonRecord):
    """The longest MAX_SEQ_LEN that fits (`pinned`: it fits and one step more does not, both
    compiled), or the bracket the search reached."""

    seq_len: int | None
    tokens_per_shard: int | None
    seq: int
    rows_per_device: int
    step: int
    pinned: bool
    bracket: tuple[int | None, ...]  # (longest fitting, shortest failing) compiled
    peak_bytes: int | None
    next_peak_bytes: int | None
    method: str
    fit: SeqFit | None
    compiled: tuple[CompiledLength, ...]
    compiles: int


# ------------------------------------------------------------------------------------------------
# The plan


@_record
class Plan(JsonRecord):
    """Will the run fit? Its compiled step's memory per device against the device's, and the
    rest a person (`report.format_text`) or a script (`to_json`) needs to decide."""

    experiment: str
    experiment_class: str = json_key("class")  # module.qualname
    overrides: dict[str, Any]  # the hyperparameters the experiment overrides
    num_devices: int
    compiled_for: CompileTarget
    topology: str | None = optional()  # StepMeasurement.topology
    memory_note: str  # which compiler measured, and how exact that is
    mesh: MeshSizes
    ici_mesh_shape: tuple[int, ...]
    dcn_mesh_shape: tuple[int, ...]
    global_batch_size: int
    seq_len: int
    tokens_per_step: int
    num_params: int
    # The remat each layer of the step really has (the experiment's remat_description): a policy
    # name and where it applies, or "none (...)" where unrolled layers keep every activation.
    remat: str
    memory_per_device: DeviceMemory
    peak_formula: str = PEAK_FORMULA
    device_memory_bytes: int
    verdict: Verdict = flattened()
    attention_kernel: str  # "xla" or the fused kernel's implementation
    # a fused kernel (cuDNN, Pallas-Triton) holds no [B, N, T, S] logits: None
    attention_logits_bytes_per_layer: int | None
    pipeline: PipelinePlan | None
    sequence_parallel: SeqPlan | None
    moe: MoePlan | None
    # A cuDNN / Pallas-Triton run is compiled for cpu with XLA's attention, and says so.
    attention_note: str | None
    program: CompiledProgram | None = flattened()  # GPU and TPU targets; each key null for cpu
    refused: HbmRefusal | None = optional()  # the TPU compiler's refusal: it does not fit
    flops_per_step: FlopsPerStep
    peak_tflops_per_device: float
    step_time_at_100pct_mfu_s: float
    tokens_per_s_at_100pct_mfu: float
    levers: tuple[Lever, ...] = ()  # when the run does not fit
    compile_s: float
    longest_seq: LongestSeqFound | None = None
    plan_s: float | None = None  # the whole plan's seconds, set when it is complete

    @property
    def gpu_program(self) -> CompiledProgram | None:
        """`program` of a GPU target (None for cpu and TPU targets)."""
        return self.program if self.compiled_for.is_gpu else None
