"""The planner's levers: the ways that could make a run fit, each measured.

A search over variants of the run being planned (the same experiment with a few hyperparameters
changed), each variant measured by compiling it (paxlite/planner/search.py) or, where the change is
exact arithmetic, computed. A variant the run itself would refuse (a batch that no longer divides,
microbatches that do not split) is found before compiling and costs no compile; at most
_MAX_COMPILED_LEVERS lever variants are compiled per plan. The other re-plan, the longest sequence
that fits, is paxlite/planner/longest_seq.py.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from paxlite.parallel.compile_targets import CompileTarget
from paxlite.planner.base_plan import moe_plan
from paxlite.planner.results import Lever, StepMeasurement
from paxlite.planner.search import check_runs, compile_variants, variant

_MAX_COMPILED_LEVERS = 4  # re-plans per verdict: each is one more compile of the whole step
# The pipeline lever takes at most this many stages (each doubling halves a stage's layers and
# adds a stage to the bubble).
_MAX_LEVER_STAGES = 16
# Where the pipeline lever takes its stages from, first to last: DCN before ICI (stages pass one
# activation per microbatch, so the pipeline tolerates the slow links), data before fsdp (data's
# devices hold whole copies of the state, fsdp's already share it).
_PIPELINE_SOURCES = (("DCN", "data"), ("ICI", "data"), ("DCN", "fsdp"), ("ICI", "fsdp"))
# Levers that leave the training computation unchanged (same global batch, same math); halving the
# batch is left out of the combination because it changes the run being planned.
_SAME_TRAINING_KEYS = frozenset({"ICI_MESH_SHAPE", "DCN_MESH_SHAPE", "USE_REPEATED_LAYER",
                                 "CHECKPOINT_POLICY", "GRAD_ACCUM_STEPS"})


# ------------------------------------------------------------------------------------------------
# Mesh shapes in the user's own form


def _named(base: StepMeasurement, layout) -> dict[str, dict[str, int]]:
    """{"ICI": {axis: size}, "DCN": {axis: size}} of the planned run."""
    from paxlite.parallel.mesh import named_sizes

    return {"ICI": named_sizes(base.ici_mesh_shape, layout),
            "DCN": named_sizes(base.dcn_mesh_shape, layout)}


def _shape(sizes: dict[str, int], layout, *, like: tuple[int, ...]) -> list[int] | None:
    """`sizes` written in `layout`'s entry order, at least as long as `like` (what the user wrote),
    longer only where an axis needs it (Pax's 4-entry [pipeline, data, fsdp, tensor] becomes
    paxlite's 5 or 6 entries when an expert or seq axis is added); None when no length names every
    axis that is > 1."""
    from paxlite.parallel.mesh import MESH_AXES

    for length in sorted(layout.lengths()):
        if length < len(like):
            continue
        axes = layout.axes_for(length)
        if all(sizes[axis] == 1 for axis in MESH_AXES if axis not in axes):
            return [sizes[axis] for axis in axes]
    return None


def _mesh_changes(named: dict[str, dict[str, int]], base: StepMeasurement,
                  layout) -> dict[str, list[int]] | None:
    ici = _shape(named["ICI"], layout, like=base.ici_mesh_shape)
    dcn = _shape(named["DCN"], layout, like=base.dcn_mesh_shape)
    return None if ici is None or dcn is None else {"ICI_MESH_SHAPE": ici, "DCN_MESH_SHAPE": dcn}


def _moved(named: dict[str, dict[str, int]], moves: list[tuple[str, str, str, int]]):
    """A copy of `named` with each (ICI|DCN, from axis, to axis, factor) applied."""
    out = {level: dict(sizes) for level, sizes in named.items()}
    for level, source, target, factor in moves:
        out[level][source] //= factor
        out[level][target] *= factor
    return out


# ------------------------------------------------------------------------------------------------
# Levers


def refusal_reason(error: Exception) -> str:
    """The one-line reason of a lever refused while its model is built: Fiddle appends its build
    context (every argument of the config it failed on) after a blank line."""
    return str(error).split("\n\n", 1)[0].strip()


def levers(experiment, base: StepMeasurement, *, num_devices: int, device_bytes: int,
           target: CompileTarget = CompileTarget.CPU) -> list[Lever]:
    """Ways to make the run fit, each measured: analytic where the change is exact arithmetic,
    compiled (at most _MAX_COMPILED_LEVERS compiles) where the compiler decides. Candidates come in
    order of preference; one the run would refuse is reported with the refusal, not compiled."""
    from paxlite.config.errors import ConfigError
    from paxlite.experiments.parallelism_settings import mesh_layout
    from paxlite.parallel.mesh import MeshError

    layout = mesh_layout(experiment)
    named = _named(base, layout)
    memory = base.memory
    data, fsdp = base.mesh.data, base.mesh.fsdp
    state = memory.state_bytes
    out: list[Lever] = []
    # (description, overrides) in order of preference; or a finished lever (refused)
    candidates: list[tuple[str, dict[str, Any]] | Lever] = []
    candidates += _expert_candidates(experiment, base, named, layout)
    # FSDP alone: all of data moved to fsdp shrinks the sharded state by data's size, no more.
    fsdp_alone = memory.peak_bytes - state + math.ceil(state / data)
    if fsdp_alone > device_bytes:
        candidates.append(_pipeline_candidate(experiment, base, named, layout, state=state,
                                              device_bytes=device_bytes))
    if data > 1:
        # Intermediate fsdp sizes: only the sharded state changes (exactly 1/fsdp); the batch split
        # data x fsdp x expert, and so the activations, stay as they are.
        factor = 2
        while data % factor == 0 and factor < data:
            new_fsdp = fsdp * factor
            peak = memory.peak_bytes - state + math.ceil(state * fsdp / new_fsdp)
            out.append(Lever(lever=f"fsdp {fsdp} -> {new_fsdp} (data {data} -> {data // factor})",
                             method="analytic: parameter + optimizer + gradient bytes x "
                                    f"{fsdp}/{new_fsdp}, the rest as compiled",
                             ).measured(peak_bytes=peak, device_bytes=device_bytes))
            factor *= 2
        moved = _moved(named, [(level, "data", "fsdp", named[level]["data"])
                               for level in ("ICI", "DCN")])
        candidates.append((f"fsdp {fsdp} -> {fsdp * data} (all of data moved to fsdp)",
                           _mesh_changes(moved, base, layout)))
    else:
        out.append(Lever(lever="more fsdp").refuse(
            "the data axis is 1: no data-parallel devices are left to move to fsdp"))
    # RematPolicy.SAVE_NOTHING, by value: the planner's command line imports no JAX before it runs
    if experiment.remat_policy().value == "save_nothing":
        out.append(Lever(lever="CHECKPOINT_POLICY=SAVE_NOTHING").refuse("already SAVE_NOTHING"))
    elif experiment.USE_REPEATED_LAYER:
        candidates.append(("CHECKPOINT_POLICY=SAVE_NOTHING (recompute each layer)",
                           {"CHECKPOINT_POLICY": "SAVE_NOTHING"}))
    else:
        # Unrolled layers keep every activation unless a policy is set explicitly, which then
        # wraps each layer (ModelLayerSettings.remat_policy): the parameters stay unstacked, so
        # the run's checkpoints keep their layout (scanning would stack them, and models with
        # dense first layers cannot scan at all).
        candidates.append(("CHECKPOINT_POLICY=SAVE_NOTHING (recompute each unrolled layer)",
                           {"CHECKPOINT_POLICY": "SAVE_NOTHING"}))
    accum = experiment.GRAD_ACCUM_STEPS
    candidates.append(((f"GRAD_ACCUM_STEPS {accum} -> {2 * accum} (same global batch, same "
                        "training)"), {"GRAD_ACCUM_STEPS": 2 * accum}))
    if memory.temp_bytes > memory.parameter_bytes + memory.optimizer_state_bytes:
        candidates.append(_seq_candidate(experiment, base, named, layout,
                                         device_bytes=device_bytes))
    if getattr(experiment, "GLOBAL_BATCH_SIZE", None) is not None:  # a fixed batch wins
        candidates.append(((f"GLOBAL_BATCH_SIZE {experiment.GLOBAL_BATCH_SIZE} -> "
                           f"{experiment.GLOBAL_BATCH_SIZE // 2}"),
                           {"GLOBAL_BATCH_SIZE": experiment.GLOBAL_BATCH_SIZE // 2}))
    else:
        candidates.append(((f"PERCORE_BATCH_SIZE {experiment.PERCORE_BATCH_SIZE:g} -> "
                           f"{experiment.PERCORE_BATCH_SIZE / 2:g}"),
                           {"PERCORE_BATCH_SIZE": experiment.PERCORE_BATCH_SIZE / 2}))
    to_compile: list[int] = []  # where in `out` each lever to compile sits
    for candidate in candidates:
        if isinstance(candidate, Lever):  # refused while being built
            out.append(candidate)
            continue
        description, changes = candidate
        lever = Lever(lever=description, method="compiled", overrides=changes)
        try:
            check_runs(variant(experiment, changes), num_devices=num_devices, target=target)
        except (ConfigError, MeshError, ValueError) as e:  # e.g. a batch that no longer divides
            out.append(lever.refuse(refusal_reason(e)))
            continue
        if len(to_compile) == _MAX_COMPILED_LEVERS:
            out.append(dataclasses.replace(lever, method="not compiled", skipped=(
                f"the planner compiles at most {_MAX_COMPILED_LEVERS} levers per plan")))
            continue
        to_compile.append(len(out))
        out.append(lever)
    measured = compile_variants(experiment, [out[index].overrides for index in to_compile],
                                num_devices=num_devices, target=target)
    for index, result in zip(to_compile, measured):
        if isinstance(result, Exception):  # refused only while compiling
            out[index] = out[index].refuse(str(result))
        else:
            out[index] = out[index].measured(peak_bytes=result.memory.peak_bytes,
                                             device_bytes=device_bytes)
    combined = _combined_lever(experiment, out, num_devices=num_devices, device_bytes=device_bytes,
                               target=target)
    return out + ([combined] if combined else [])


def _pipeline_candidate(experiment, base: StepMeasurement, named, layout, *, state: int,
                        device_bytes: int) -> tuple[str, dict[str, Any]] | Lever:
    """Pipeline stages taken from data / fsdp (_PIPELINE_SOURCES), where FSDP alone does not fit.

    Stages: the fewest (a power of two dividing the layer stack's scan units) whose state estimate
    fits (parameter + optimizer + gradient bytes / stages, x the fsdp that stages take away);
    else the most available, up to _MAX_LEVER_STAGES. Microbatches: 4, 2 or 1 per stage, the
    most that divide each device's rows (the bubble (S - 1) / (M + S - 1) shrinks with M).
    """
    import fiddle as fdl

    name = "pipeline (stages from data/fsdp)"
    if base.mesh.pipeline > 1 or experiment.NUM_STAGES is not None:
        return Lever(lever=name).refuse("the run is already pipelined")
    model = fdl.build(experiment.model_config())
    units = model.num_layers // model.layers_per_scan_unit
    options = []
    stages = 2
    while stages <= _MAX_LEVER_STAGES and units % stages == 0:
        moves, left = [], stages
        for level, axis in _PIPELINE_SOURCES:
            take = math.gcd(left, named[level][axis])
            if take > 1:
                moves.append((level, axis, "pipeline", take))
                left //= take
        if left > 1:
            break
        moved = _moved(named, moves)
        fsdp_after = moved["ICI"]["fsdp"] * moved["DCN"]["fsdp"]
        estimate = base.memory.peak_bytes - state + math.ceil(
            state * base.mesh.fsdp / fsdp_after / stages)
        options.append((stages, moves, moved, estimate))
        if estimate <= device_bytes:
            break
        stages *= 2
    if not options:
        return Lever(lever=name).refuse(
            f"NUM_LAYERS={model.num_layers} ({units} scan units) and data x fsdp "
            f"{base.mesh.data} x {base.mesh.fsdp} have no common factor of 2 to make stages of")
    stages, moves, moved, _ = options[-1]
    batch_ways = math.prod(moved[level][axis] for level in moved
                           for axis in ("data", "fsdp", "expert"))
    rows_per_device = base.global_batch_size // experiment.GRAD_ACCUM_STEPS // max(batch_ways, 1)
    micro = next((k * stages for k in (4, 2, 1) if rows_per_device % (k * stages) == 0), None)
    if micro is None:
        return Lever(lever=name).refuse(
            f"{stages} stages need at least {stages} microbatches, but each device would hold "
            f"{rows_per_device} row(s) per step (global batch {base.global_batch_size} over "
            f"data x fsdp x expert = {batch_ways})")
    changes: dict[str, Any] = {**(_mesh_changes(moved, base, layout) or {}),
                               "NUM_MICROBATCHES": micro}
    scanned = ""
    if not experiment.USE_REPEATED_LAYER:  # only the scanned [L, ...] stack splits over stages
        changes["USE_REPEATED_LAYER"] = True
        scanned = " + USE_REPEATED_LAYER=true (so each stage holds only its layers)"
    sources = ", ".join(f"{factor} from {axis} in {level}" for level, axis, _, factor in moves)
    bubble = (stages - 1) / (micro + stages - 1)
    return ((f"pipeline 1 -> {stages} stages ({sources}), NUM_MICROBATCHES={micro}{scanned}: "
             f"each device holds 1/{stages} of the layers; bubble {bubble:.1%}"), changes)


def _seq_candidate(experiment, base: StepMeasurement, named, layout, *,
                   device_bytes: int) -> tuple[str, dict[str, Any]] | Lever:
    """A seq axis taken from data within nodes, where activations dominate, with GRAD_ACCUM_STEPS x
    seq: the same global batch and the same training, each device holding 1/seq of its rows'
    tokens per microbatch (a seq axis alone, at the same batch, gives each device seq x the rows at
    1/seq of the tokens: no fewer activations). It is what still splits activations when a
    microbatch is down to one row per device, where more accumulation alone is refused.

    Size: the smallest power of two whose estimate (temporaries / seq, the rest as compiled) fits,
    else the most that data and MAX_SEQ_LEN allow."""
    name = "seq (from data in ICI)"
    seq_now, memory = base.mesh.seq, base.memory
    balance = 2 if experiment.CONTEXT_PARALLEL_LOAD_BALANCE else 1
    data = named["ICI"]["data"]
    factor, chosen = 2, None
    while data % factor == 0 and base.seq_len % (balance * seq_now * factor) == 0:
        chosen = factor
        estimate = memory.peak_bytes - memory.temp_bytes + math.ceil(memory.temp_bytes / factor)
        if estimate <= device_bytes:
            break
        factor *= 2
    if chosen is None:
        return Lever(lever=name).refuse(
            f"ICI data {data} and MAX_SEQ_LEN={base.seq_len} (in {balance} x seq chunks) leave "
            "no factor of 2 for a seq axis")
    changes = _mesh_changes(_moved(named, [("ICI", "data", "seq", chosen)]), base, layout)
    if changes is None:
        return Lever(lever=name).refuse(
            f"the {layout.value} form of ICI/DCN_MESH_SHAPE cannot name a seq axis")
    accum = experiment.GRAD_ACCUM_STEPS
    changes["GRAD_ACCUM_STEPS"] = accum * chosen
    return ((f"seq {seq_now} -> {seq_now * chosen} (from data in ICI) + GRAD_ACCUM_STEPS "
             f"{accum} -> {accum * chosen} (same global batch, same training; each device holds "
             f"1/{chosen} of each row's tokens per microbatch)"), changes)


def _expert_candidates(experiment, base: StepMeasurement, named,
                       layout) -> list[tuple[str, dict[str, Any]]]:
    """MoE levers: shard the experts over an expert axis taken from data (same training: the batch
    still splits data x fsdp x expert ways), and for GShard more, smaller routing groups."""
    if getattr(experiment, "NUM_EXPERTS", None) is None:
        return []
    out = []
    unsharded = experiment.NUM_EXPERTS // base.mesh.expert
    # Data first (the experts' weights were replicated over it), then fsdp (each device then
    # gathers only its own experts' weights, not every expert's), within nodes first. At most 8x:
    # what fsdp gives up stops sharding the dense weights, and the exchange stays within 8 ranks.
    for source, level in (("data", "ICI"), ("data", "DCN"), ("fsdp", "ICI"), ("fsdp", "DCN")):
        factor = math.gcd(named[level][source], unsharded, 8)
        if factor > 1:
            moved = _moved(named, [(level, source, "expert", factor)])
            changes = _mesh_changes(moved, base, layout)
            if changes is None:
                break
            out.append(((f"expert {base.mesh.expert} -> {base.mesh.expert * factor} "
                        f"(from {source} in {level}; each device holds and gathers {factor}x "
                        "fewer experts)"), changes))
            break
    if getattr(experiment, "MOE_ROUTING", None) == "gshard_top2":
        moe = moe_plan(experiment, base)
        groups = experiment.NUM_GROUPS or (moe.gshard.groups if moe and moe.gshard else None)
        if groups:
            out.append(((f"NUM_GROUPS {groups} -> {2 * groups} (groups of half the tokens: "
                        "dispatch/combine halve; routing changes)"), {"NUM_GROUPS": 2 * groups}))
    return out


def _combined_lever(experiment, levers: list[Lever], *, num_devices: int,
                    device_bytes: int, target: CompileTarget) -> Lever | None:
    """When no single lever fits, the applicable same-training levers at once, compiled.

    Large models often need several (LLaMA70B on 16 devices: the scanned stack with SAVE_NOTHING and
    gradient accumulation together); the user should not have to find the combination by hand. Two
    levers that set the same hyperparameter (two meshes) do not combine: the earlier one is taken.
    """
    if any(lever.fits for lever in levers):
        return None
    parts, taken = [], set()
    for lever in levers:
        keys = set(lever.overrides or ())
        if lever.peak_bytes is not None and lever.method == "compiled" \
                and keys <= _SAME_TRAINING_KEYS and not keys & taken:
            parts.append(lever)
            taken |= keys
    if len(parts) < 2:
        return None
    changes: dict[str, Any] = {}
    for lever in parts:
        changes.update(lever.overrides)
    together = Lever(lever="together: " + " + ".join(part.lever for part in parts),
                     method="compiled", overrides=changes)
    [measured] = compile_variants(experiment, [changes], num_devices=num_devices, target=target)
    if isinstance(measured, Exception):
        return together.refuse(str(measured))
    return together.measured(peak_bytes=measured.memory.peak_bytes, device_bytes=device_bytes)
