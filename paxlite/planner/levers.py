"""The planner's re-plans: the levers that could make a run fit, and the longest sequence that fits.

Both are searches over variants of the run being planned (the same experiment with a few
hyperparameters changed), each variant measured by compiling it (paxlite/planner/search.py) or, where
the change is exact arithmetic, computed. A variant the run itself would refuse (a batch that no
longer divides, microbatches that do not split) is found before compiling and costs no compile;
at most _MAX_COMPILED_LEVERS lever variants are compiled per plan, and the sequence search stops
after MAX_SEQ_SEARCH_COMPILES compiles, saying where it stopped.
"""

from __future__ import annotations

import math
from typing import Any

from paxlite.parallel.gpu_target import CompileTarget
from paxlite.planner.search import (
    check_runs,
    compile_variants,
    moe_plan,
    variant,
    verdict,
)

_MAX_COMPILED_LEVERS = 4  # re-plans per verdict: each is one more compile of the whole step
# The longest-sequence search: lengths are multiples of this (and of what the seq axis needs), and
# it stops after this many compiles beyond the plan's own, reporting the bracket it reached.
DEFAULT_SEQ_STEP = 128
MAX_SEQ_SEARCH_COMPILES = 8
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


def _named(base: dict[str, Any], layout) -> dict[str, dict[str, int]]:
    """{"ICI": {axis: size}, "DCN": {axis: size}} of the planned run."""
    from paxlite.parallel.mesh import named_sizes

    return {"ICI": named_sizes(base["ici_mesh_shape"], layout),
            "DCN": named_sizes(base["dcn_mesh_shape"], layout)}


def _shape(sizes: dict[str, int], layout, *, like: list[int]) -> list[int] | None:
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


def _mesh_changes(named: dict[str, dict[str, int]], base: dict[str, Any],
                  layout) -> dict[str, list[int]] | None:
    ici = _shape(named["ICI"], layout, like=base["ici_mesh_shape"])
    dcn = _shape(named["DCN"], layout, like=base["dcn_mesh_shape"])
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


def levers(experiment, base: dict[str, Any], *, num_devices: int, device_bytes: int,
           target: CompileTarget | str = CompileTarget.CPU) -> list[dict[str, Any]]:
    """Ways to make the run fit, each measured: analytic where the change is exact arithmetic,
    compiled (at most _MAX_COMPILED_LEVERS compiles) where the compiler decides. Candidates come in
    order of preference; one the run would refuse is reported with the refusal, not compiled."""
    from paxlite.config.errors import ConfigError
    from paxlite.experiments.parallelism_settings import mesh_layout
    from paxlite.parallel.mesh import MeshError

    layout = mesh_layout(experiment)
    named = _named(base, layout)
    memory = base["memory"]
    data, fsdp = base["mesh"]["data"], base["mesh"]["fsdp"]
    state = memory["parameter_bytes"] + memory["optimizer_state_bytes"] + memory["gradient_bytes"]
    out: list[dict[str, Any]] = []
    # (description, overrides) in order of preference; or a finished entry (analytic, refused)
    candidates: list[tuple[str, dict[str, Any]] | dict[str, Any]] = []
    candidates += _expert_candidates(experiment, base, named, layout)
    # FSDP alone: all of data moved to fsdp shrinks the sharded state by data's size, no more.
    fsdp_alone = memory["peak_bytes"] - state + math.ceil(state / data)
    if fsdp_alone > device_bytes:
        candidates.append(_pipeline_candidate(experiment, base, named, layout, state=state,
                                              device_bytes=device_bytes))
    if data > 1:
        # Intermediate fsdp sizes: only the sharded state changes (exactly 1/fsdp); the batch split
        # data x fsdp x expert, and so the activations, stay as they are.
        factor = 2
        while data % factor == 0 and factor < data:
            new_fsdp = fsdp * factor
            peak = memory["peak_bytes"] - state + math.ceil(state * fsdp / new_fsdp)
            out.append({"lever": f"fsdp {fsdp} -> {new_fsdp} (data {data} -> {data // factor})",
                        "method": "analytic: parameter + optimizer + gradient bytes x "
                                  f"{fsdp}/{new_fsdp}, the rest as compiled",
                        "peak_bytes": peak, **verdict(peak, device_bytes)})
            factor *= 2
        moved = _moved(named, [(level, "data", "fsdp", named[level]["data"])
                               for level in ("ICI", "DCN")])
        candidates.append((f"fsdp {fsdp} -> {fsdp * data} (all of data moved to fsdp)",
                           _mesh_changes(moved, base, layout)))
    else:
        out.append({"lever": "more fsdp", "applicable": False,
                    "reason": "the data axis is 1: no data-parallel devices are left to move to fsdp"})
    if not experiment.USE_REPEATED_LAYER:
        # Unrolled layers keep every activation for the backward pass (Pax applies the policy to
        # the repeated stack only), so the remat lever is the scanned stack with SAVE_NOTHING.
        candidates.append((("USE_REPEATED_LAYER=true + CHECKPOINT_POLICY=SAVE_NOTHING (recompute each "
                           "layer)"), {"USE_REPEATED_LAYER": True, "CHECKPOINT_POLICY": "SAVE_NOTHING"}))
    elif experiment.CHECKPOINT_POLICY != "SAVE_NOTHING":
        candidates.append(("CHECKPOINT_POLICY=SAVE_NOTHING (recompute each layer)",
                           {"CHECKPOINT_POLICY": "SAVE_NOTHING"}))
    else:
        out.append({"lever": "CHECKPOINT_POLICY=SAVE_NOTHING", "applicable": False,
                    "reason": "already SAVE_NOTHING"})
    accum = experiment.GRAD_ACCUM_STEPS
    candidates.append((f"GRAD_ACCUM_STEPS {accum} -> {2 * accum} (same global batch, same training)",
                       {"GRAD_ACCUM_STEPS": 2 * accum}))
    if memory["temp_bytes"] > memory["parameter_bytes"] + memory["optimizer_state_bytes"]:
        candidates.append(_seq_candidate(experiment, base, named, layout, device_bytes=device_bytes))
    if getattr(experiment, "GLOBAL_BATCH_SIZE", None) is not None:  # a fixed batch wins
        candidates.append(((f"GLOBAL_BATCH_SIZE {experiment.GLOBAL_BATCH_SIZE} -> "
                           f"{experiment.GLOBAL_BATCH_SIZE // 2}"),
                           {"GLOBAL_BATCH_SIZE": experiment.GLOBAL_BATCH_SIZE // 2}))
    else:
        candidates.append(((f"PERCORE_BATCH_SIZE {experiment.PERCORE_BATCH_SIZE:g} -> "
                           f"{experiment.PERCORE_BATCH_SIZE / 2:g}"),
                           {"PERCORE_BATCH_SIZE": experiment.PERCORE_BATCH_SIZE / 2}))
    to_compile: list[dict[str, Any]] = []
    for candidate in candidates:
        if isinstance(candidate, dict):  # refused while being built
            out.append(candidate)
            continue
        description, changes = candidate
        lever = {"lever": description, "method": "compiled", "overrides": changes}
        try:
            check_runs(variant(experiment, changes), num_devices=num_devices, target=target)
        except (ConfigError, MeshError, ValueError) as e:  # e.g. a batch that no longer divides
            out.append({**lever, "applicable": False, "reason": str(e)})
            continue
        if len(to_compile) == _MAX_COMPILED_LEVERS:
            out.append({**lever, "method": "not compiled", "skipped": (
                f"the planner compiles at most {_MAX_COMPILED_LEVERS} levers per plan")})
            continue
        to_compile.append(lever)
        out.append(lever)
    measured = compile_variants(experiment, [lever["overrides"] for lever in to_compile],
                                num_devices=num_devices, target=target)
    for lever, result in zip(to_compile, measured):
        if isinstance(result, Exception):  # refused only while compiling
            lever.update(applicable=False, reason=str(result))
        else:
            peak = result["memory"]["peak_bytes"]
            lever.update(peak_bytes=peak, **verdict(peak, device_bytes))
    combined = _combined_lever(experiment, out, num_devices=num_devices, device_bytes=device_bytes,
                               target=target)
    return out + ([combined] if combined else [])


def _pipeline_candidate(experiment, base, named, layout, *, state: int,
                        device_bytes: int) -> tuple[str, dict[str, Any]] | dict[str, Any]:
    """Pipeline stages taken from data / fsdp (_PIPELINE_SOURCES), where FSDP alone does not fit.

    Stages: the fewest (a power of two dividing the layer stack's scan units) whose state estimate
    fits (parameter + optimizer + gradient bytes / stages, x the fsdp that stages take away);
    else the most available, up to _MAX_LEVER_STAGES. Microbatches: 4, 2 or 1 per stage, the
    most that divide each device's rows (the bubble (S - 1) / (M + S - 1) shrinks with M).
    """
    import fiddle as fdl

    name = "pipeline (stages from data/fsdp)"
    if base["mesh"]["pipeline"] > 1 or experiment.NUM_STAGES is not None:
        return {"lever": name, "applicable": False, "reason": "the run is already pipelined"}
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
        estimate = base["memory"]["peak_bytes"] - state + math.ceil(
            state * base["mesh"]["fsdp"] / fsdp_after / stages)
        options.append((stages, moves, moved, estimate))
        if estimate <= device_bytes:
            break
        stages *= 2
    if not options:
        return {"lever": name, "applicable": False, "reason": (
            f"NUM_LAYERS={model.num_layers} ({units} scan units) and data x fsdp "
            f"{base['mesh']['data']} x {base['mesh']['fsdp']} have no common factor of 2 to make "
            "stages of")}
    stages, moves, moved, _ = options[-1]
    batch_ways = math.prod(moved[level][axis] for level in moved for axis in ("data", "fsdp", "expert"))
    rows_per_device = base["global_batch_size"] // experiment.GRAD_ACCUM_STEPS // max(batch_ways, 1)
    micro = next((k * stages for k in (4, 2, 1) if rows_per_device % (k * stages) == 0), None)
    if micro is None:
        return {"lever": name, "applicable": False, "reason": (
            f"{stages} stages need at least {stages} microbatches, but each device would hold "
            f"{rows_per_device} row(s) per step (global batch {base['global_batch_size']} over "
            f"data x fsdp x expert = {batch_ways})")}
    changes: dict[str, Any] = {**(_mesh_changes(moved, base, layout) or {}),
                               "NUM_MICROBATCHES": micro}
    scanned = ""
    if not experiment.USE_REPEATED_LAYER:  # only the scanned [L, ...] stack splits over stages
        changes["USE_REPEATED_LAYER"] = True
        scanned = " + USE_REPEATED_LAYER=true (so each stage holds only its layers)"
    sources = ", ".join(f"{factor} from {axis} in {level}" for level, axis, _, factor in moves)
    bubble = (stages - 1) / (micro + stages - 1)
    return ((f"pipeline 1 -> {stages} stages ({sources}), NUM_MICROBATCHES={micro}{scanned}: each "
            f"device holds 1/{stages} of the layers; bubble {bubble:.1%}"), changes)


def _seq_candidate(experiment, base, named, layout, *,
                   device_bytes: int) -> tuple[str, dict[str, Any]] | dict[str, Any]:
    """A seq axis taken from data within nodes, where activations dominate, with GRAD_ACCUM_STEPS x
    seq: the same global batch and the same training, each device holding 1/seq of its rows'
    tokens per microbatch (a seq axis alone, at the same batch, gives each device seq x the rows at
    1/seq of the tokens: no fewer activations). It is what still splits activations when a
    microbatch is down to one row per device, where more accumulation alone is refused.

    Size: the smallest power of two whose estimate (temporaries / seq, the rest as compiled) fits,
    else the most that data and MAX_SEQ_LEN allow."""
    name = "seq (from data in ICI)"
    seq_now, memory = base["mesh"]["seq"], base["memory"]
    balance = 2 if experiment.CONTEXT_PARALLEL_LOAD_BALANCE else 1
    data = named["ICI"]["data"]
    factor, chosen = 2, None
    while data % factor == 0 and base["seq_len"] % (balance * seq_now * factor) == 0:
        chosen = factor
        estimate = memory["peak_bytes"] - memory["temp_bytes"] + math.ceil(memory["temp_bytes"] / factor)
        if estimate <= device_bytes:
            break
        factor *= 2
    if chosen is None:
        return {"lever": name, "applicable": False, "reason": (
            f"ICI data {data} and MAX_SEQ_LEN={base['seq_len']} (in {balance} x seq chunks) leave no "
            "factor of 2 for a seq axis")}
    changes = _mesh_changes(_moved(named, [("ICI", "data", "seq", chosen)]), base, layout)
    if changes is None:
        return {"lever": name, "applicable": False, "reason": (
            f"the {layout.value} form of ICI/DCN_MESH_SHAPE cannot name a seq axis")}
    accum = experiment.GRAD_ACCUM_STEPS
    changes["GRAD_ACCUM_STEPS"] = accum * chosen
    return ((f"seq {seq_now} -> {seq_now * chosen} (from data in ICI) + GRAD_ACCUM_STEPS {accum} -> "
            f"{accum * chosen} (same global batch, same training; each device holds 1/{chosen} of "
            "each row's tokens per microbatch)"), changes)


def _expert_candidates(experiment, base, named, layout) -> list[tuple[str, dict[str, Any]]]:
    """MoE levers: shard the experts over an expert axis taken from data (same training: the batch
    still splits data x fsdp x expert ways), and for GShard more, smaller routing groups."""
    if getattr(experiment, "NUM_EXPERTS", None) is None:
        return []
    out = []
    unsharded = experiment.NUM_EXPERTS // base["mesh"]["expert"]
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
            out.append(((f"expert {base['mesh']['expert']} -> {base['mesh']['expert'] * factor} "
                        f"(from {source} in {level}; each device holds and gathers {factor}x fewer "
                        "experts)"), changes))
            break
    if getattr(experiment, "MOE_ROUTING", None) == "gshard_top2":
        groups = experiment.NUM_GROUPS or (moe_plan(experiment, base) or {}).get("groups")
        if groups:
            out.append(((f"NUM_GROUPS {groups} -> {2 * groups} (groups of half the tokens: "
                        "dispatch/combine halve; routing changes)"), {"NUM_GROUPS": 2 * groups}))
    return out


def _combined_lever(experiment, levers: list[dict[str, Any]], *, num_devices: int,
                    device_bytes: int, target: CompileTarget | str) -> dict[str, Any] | None:
    """When no single lever fits, the applicable same-training levers at once, compiled.

    Large models often need several (LLaMA70B on 16 devices: the scanned stack with SAVE_NOTHING and
    gradient accumulation together); the user should not have to find the combination by hand. Two
    levers that set the same hyperparameter (two meshes) do not combine: the earlier one is taken.
    """
    if any(lever.get("fits") for lever in levers):
        return None
    parts, taken = [], set()
    for lever in levers:
        keys = set(lever.get("overrides", ()))
        if "peak_bytes" in lever and lever["method"] == "compiled" and keys <= _SAME_TRAINING_KEYS \
                and not keys & taken:
            parts.append(lever)
            taken |= keys
    if len(parts) < 2:
        return None
    changes: dict[str, Any] = {}
    for lever in parts:
        changes.update(lever["overrides"])
    lever = {"lever": "together: " + " + ".join(p["lever"] for p in parts), "method": "compiled",
             "overrides": changes}
    [measured] = compile_variants(experiment, [changes], num_devices=num_devices, target=target)
    if isinstance(measured, Exception):
        return {**lever, "applicable": False, "reason": str(measured)}
    peak = measured["memory"]["peak_bytes"]
    return {**lever, "peak_bytes": peak, **verdict(peak, device_bytes)}


# ------------------------------------------------------------------------------------------------
# The longest sequence that fits


def find_longest_seq(experiment, base: dict[str, Any], *, num_devices: int, device_bytes: int,
                step: int = DEFAULT_SEQ_STEP, max_compiles: int = MAX_SEQ_SEARCH_COMPILES,
                target: CompileTarget | str = CompileTarget.CPU) -> dict[str, Any]:
    """The longest MAX_SEQ_LEN, a multiple of `step`, whose train step fits `device_bytes` per
    device, at the run's mesh and rows per device.

    The method, named in the result: the peak per device is fitted as a + b*T + c*T^2 (activations
    grow with T, attention logits with T^2) through three compiles, at the planned T and at two
    lengths towards the answer (2T and 4T if T fits, else T/2 and T/4); the fit's root, rounded down
    to a multiple of `step`, is compiled with the next multiple up, and the fit is redone through
    the three compiles nearest the root until a compiled T fits and T + step does not. The answer
    is exact by that definition (both ends compiled); memory is not always monotone in T under
    XLA's buffer assignment, so a longer T beyond a failing one is not looked for. After
    `max_compiles` compiles the search stops and reports the bracket it reached.
    """
    seq = base["mesh"]["seq"]
    chunks = seq * (2 if seq > 1 and experiment.CONTEXT_PARALLEL_LOAD_BALANCE else 1)
    step = math.lcm(step, chunks)
    peaks: dict[int, int | str] = {base["seq_len"]: base["memory"]["peak_bytes"]}
    # cpu is compile_variants' default (and a stand-in compiler taking no target stays usable)
    on_target = {"target": target} if CompileTarget.parse(target).is_gpu else {}
    first: list[int] = []
    compiles = 0

    def fits(t: int) -> bool:
        return isinstance(peaks[t], int) and peaks[t] <= device_bytes

    def probe(lengths: list[int]) -> int:
        """Compile the lengths not compiled yet (within the budget); how many that was."""
        nonlocal compiles
        todo = sorted({t for t in lengths if t >= step and t not in peaks})[:max_compiles - compiles]
        results = compile_variants(experiment, [{"MAX_SEQ_LEN": t} for t in todo],
                                   num_devices=num_devices, **on_target)
        compiles += len(todo)
        for t, result in zip(todo, results):
            peaks[t] = (f"refused: {result}" if isinstance(result, Exception)
                        else result["memory"]["peak_bytes"])
        return len(todo)

    start = max(step, base["seq_len"] // step * step)
    first = [2 * start, 4 * start] if fits(base["seq_len"]) else [
        max(step, start // 2 // step * step), max(step, start // 4 // step * step)]
    if start != base["seq_len"]:
        first.append(start)
    probe(first)
    fit = None
    while True:
        on_grid = sorted(t for t in peaks if t % step == 0)
        hi = next((t for t in on_grid if not fits(t)), None)
        lo = max((t for t in on_grid if fits(t) and (hi is None or t < hi)), default=None)
        if lo is not None and hi is not None and hi - lo == step:
            break
        if lo is None and step in peaks:  # not even the shortest step fits
            break
        if compiles >= max_compiles:
            break
        numeric = [t for t in peaks if isinstance(peaks[t], int)]
        target = fit["root"] if fit and fit["root"] else (lo or hi or start)
        nearest = sorted(numeric, key=lambda t: abs(t - target))[:3]
        fit = _fit(nearest, [peaks[t] for t in nearest], device_bytes=device_bytes)
        if not probe(_next_lengths(fit["root"], lo=lo, hi=hi, step=step, known=peaks)):
            break
    pinned = lo is not None and hi is not None and hi - lo == step
    rows = base["global_batch_size"] // math.prod(
        base["mesh"][axis] for axis in ("data", "fsdp", "expert"))
    return {
        "seq_len": lo if pinned else None,
        "tokens_per_shard": lo // seq if pinned else None,
        "seq": seq,
        "rows_per_device": rows,
        "step": step,
        "pinned": pinned,
        "bracket": [lo, hi],
        "peak_bytes": peaks[lo] if lo is not None else None,
        "next_peak_bytes": peaks[lo + step] if pinned else None,
        "method": (f"peak(T) = a + b*T + c*T^2 fitted to compiles at T = "
                   f"{', '.join(str(t) for t in sorted({base['seq_len'], *first}))}, then the "
                   f"fit's root compiled until T fits and T + {step} does not"),
        "fit": None if fit is None else {key: fit[key] for key in ("a", "b", "c", "through")},
        "compiled": [{"seq_len": t, "peak_bytes": p if isinstance(p, int) else None,
                      **({"fits": fits(t)} if isinstance(p, int) else {"refused": p})}
                     for t, p in sorted(peaks.items())],
        "compiles": compiles,
    }


def _next_lengths(root: float | None, *, lo: int | None, hi: int | None, step: int,
                  known: dict[int, Any]) -> list[int]:
    """What to compile next: the fit's root rounded down to the grid and the next step up, kept
    inside the bracket (lo, hi); without a usable root, or when those are compiled already, the
    bracket's midpoint (or twice the longest fitting length, half the shortest failing one)."""
    low = (lo or 0) + step
    if root is not None:
        guess = max(low, int(root) // step * step)
        if hi is not None:
            guess = min(guess, hi - step)
        pair = [t for t in (guess, guess + step) if hi is None or t < hi]
        if any(t not in known for t in pair):
            return pair
    if lo is not None and hi is not None:
        middle = (lo + hi) // 2 // step * step
        return [middle] if lo < middle < hi else []
    if hi is None:
        return [2 * (lo or step)]
    return [max(step, hi // 2 // step * step)]


def _fit(lengths: list[int], peaks: list[int], *, device_bytes: int) -> dict[str, Any]:
    """a + b*T + c*T^2 through the points (a line through two), and its smallest T > 0 where the
    peak reaches `device_bytes` from below (None when it never does)."""
    import numpy as np

    degree = min(2, len(lengths) - 1)
    coefficients = np.polyfit(np.asarray(lengths, float), np.asarray(peaks, float), degree)
    c, b, a = ([0.0] * (2 - degree) + list(coefficients))
    roots = np.roots([c, b, a - device_bytes] if c else [b, a - device_bytes])
    rising = sorted(float(r.real) for r in roots if abs(r.imag) < 1e-9 and r.real > 0
                    and 2 * c * r.real + b > 0)
    return {"a": a, "b": b, "c": c, "through": sorted(lengths), "root": rising[0] if rising else None}
