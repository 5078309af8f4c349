"""Model-side settings of pipeline and sequence parallelism, apart from the layers that use them.

Why a module of its own: ``TransformerConfig`` names both (models/transformer_config.py), the
attention layer reads the strategy (models/attention.py) and the pipelined stack the schedule
(models/pipeline.py); keeping the plain values here lets all of them import it without a circle.
The mesh decides the sizes (parallel/mesh.py: the ``pipeline`` and ``seq`` axes); these say how the
model uses them.
"""

from __future__ import annotations

import dataclasses
import enum


class ContextParallelStrategy(str, enum.Enum):
    """How keys and values of the other ``seq`` shards reach a shard's queries; same result."""

    ALL_GATHER = "all_gather"  # gather the whole row's k/v once (MaxText's default)
    RING = "ring"  # pass k/v blocks round the ring, online softmax (memory: one block at a time)


def scan_unit_layers(*, moe_layer_interval: int | None, pattern_period: int = 1) -> int:
    """Layers in one scanned body, the unit a pipeline splits the stack by: 1 for dense models,
    the MoE layer interval for MoE ones (GLaM's dense + MoE pair is 2; ``None``: no MoE layers),
    the period of the layers' attention pattern where they differ (Gemma 2's local + global pair
    is 2); where both are above 1 the config has the longer a multiple of the shorter (gpt-oss:
    a local + global pair, both MoE)."""
    return max(1 if moe_layer_interval is None else moe_layer_interval, pattern_period)


def bubble_fraction(*, num_stages: int, repeats: int, num_microbatches: int) -> float:
    """The share of stage-iterations that are bubble: ``(S - 1) / (R*M + S - 1)``."""
    return (num_stages - 1) / (repeats * num_microbatches + num_stages - 1)


# The counts that may be None: the number of microbatches follows from their size, or the other
# way round, or (neither set) from the number of stages.
_OPTIONAL_COUNTS = ("num_microbatches", "microbatch_size")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """The layer stack run as ``num_stages`` pipeline stages over microbatches of each batch.

    ``repeats`` 1 is GPipe; more is the circular schedule (each stage holds ``repeats``
    non-adjacent groups of layers), which shrinks the bubble to (S - 1) / (R*M + S - 1).
    ``num_stages`` is a multiple of the ``pipeline`` mesh axis's size (experiments check it); on a
    mesh without that axis (one device) the same schedule runs unsharded, which is what tests
    compare against.

    The number of microbatches M of a batch of B rows: ``num_microbatches`` (NUM_MICROBATCHES), or
    B / ``microbatch_size`` (Pax's MICROBATCH_SIZE), or, when neither is set, ``num_stages`` (the
    fewest that keep every stage busy at once). ``microbatches(B)`` resolves it.
    """

    num_stages: int
    num_microbatches: int | None = None
    microbatch_size: int | None = None
    repeats: int = 1

    def __post_init__(self) -> None:
        problems = self.count_problems(**{f.name: getattr(self, f.name)
                                          for f in dataclasses.fields(self)})
        if problems:
            raise ValueError("PipelineConfig: " + "; ".join(problems))

    @staticmethod
    def count_problems(**counts: object) -> list[str]:
        """What the counts given (this config's fields, by name) cannot be, one clause each in the
        fields' names: the rules a config is refused by when it is made, which an experiment
        reports for its settings before it builds one (without ``num_stages`` while the mesh has
        yet to say it)."""
        problems = []
        for name, value in counts.items():
            optional = name in _OPTIONAL_COUNTS
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name}={value!r} must be a positive integer"
                                + (" or None" if optional else ""))
        size, number = counts.get("microbatch_size"), counts.get("num_microbatches")
        if number is not None and size is not None:
            problems.append(f"num_microbatches={number} and microbatch_size={size} both set: "
                            "give one (the other follows from the batch)")
        return problems

    def problems(self, *, num_layers: int | None = None, layers_per_unit: int = 1) -> list[str]:
        """What this pipeline cannot run, one clause each in this config's field names
        (``num_layers``: the model's, when known; ``layers_per_unit``: ``scan_unit_layers``).

        The one home of these rules: the experiments report them under their hyperparameters'
        names before anything is built (parallelism_settings.py), ``__post_init__`` raises the
        counts' own (``count_problems``), ``microbatches`` raises the microbatch rule for the
        count a batch resolves to, and the layer rule is the model's.
        """
        problems = []
        if num_layers is not None:
            units = num_layers // layers_per_unit
            per = self.num_stages * self.repeats
            if num_layers % layers_per_unit or units % per:
                unit_text = (f" ({units} units of {layers_per_unit} layers)"
                             if layers_per_unit > 1 else "")
                problems.append(
                    f"num_layers={num_layers}{unit_text} does not split into {self.num_stages} "
                    f"pipeline stages x repeats={self.repeats}: the layer count must be a "
                    f"multiple of {per * layers_per_unit}")
        if self.num_microbatches is not None:
            problems += self._circular_problems(self.num_microbatches,
                                                f"num_microbatches={self.num_microbatches}")
        return problems

    def _circular_problems(self, num_microbatches: int, given: str) -> list[str]:
        """The circular schedule re-enters stage 0 with item (r, m) at iteration r*M + m, so M must
        be at least S (models/pipeline.py)."""
        if self.repeats > 1 and num_microbatches < self.num_stages:
            return [(f"repeats={self.repeats} (the circular schedule) needs at least as many "
                    f"microbatches as stages: {given} < {self.num_stages} stages")]
        return []

    def microbatches(self, batch_rows: int) -> int:
        """M for a batch of ``batch_rows`` rows; a ValueError naming the numbers if it does not
        split."""
        if self.microbatch_size is not None:
            if batch_rows % self.microbatch_size:
                raise ValueError(
                    f"a batch of {batch_rows} rows does not split into microbatches of "
                    f"MICROBATCH_SIZE={self.microbatch_size} rows")
            m = batch_rows // self.microbatch_size
        else:
            m = self.num_microbatches or self.num_stages
            if batch_rows % m:
                raise ValueError(
                    f"a batch of {batch_rows} rows does not split into {m} pipeline microbatches "
                    f"(NUM_MICROBATCHES, default NUM_STAGES): choose a divisor of {batch_rows}")
        problems = self._circular_problems(m, f"{m} microbatches")
        if problems:
            raise ValueError(problems[0])
        return m

    def schedule(self, batch_rows: int) -> dict[str, object]:
        """What a pass over ``batch_rows`` rows runs: stages, repeats, the schedule's name, the
        microbatches, their rows, the scan's iterations and the bubble (what `show` and `plan`
        print)."""
        micro = self.microbatches(batch_rows)
        return {
            "num_stages": self.num_stages,
            "repeats": self.repeats,
            "schedule": "circular" if self.repeats > 1 else "gpipe",
            "num_microbatches": micro,
            "microbatch_rows": batch_rows // micro,
            "iterations": self.repeats * micro + self.num_stages - 1,
            "bubble_fraction": self.bubble_fraction(micro),
        }

    def bubble_fraction(self, num_microbatches: int) -> float:
        """The share of stage-iterations that are bubble: (S - 1) / (R*M + S - 1)."""
        return bubble_fraction(num_stages=self.num_stages, repeats=self.repeats,
                               num_microbatches=num_microbatches)

SEQ_AXIS = "seq"  # the mesh axis sequence parallelism shards tokens over (parallel/mesh.py)
PIPELINE_AXIS = "pipeline"  # the mesh axis pipeline stages are spread over


def mesh_axis_size(name: str) -> int:
    """The size of mesh axis ``name`` in the mesh of ``jax.set_mesh`` (1: no mesh, or no such axis).

    Read while tracing, so a model switches to its sharded form only where the mesh asks for it.
    """
    import jax

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or name not in mesh.axis_names:
        return 1
    return int(mesh.shape[name])
