"""The planner's search: compile a run's train step for N fake CPU devices, read what XLA decided
(memory per device, FLOPs), and when it does not fit, re-plan the levers that could make it fit.

Nothing is allocated: the state and the batch are ShapeDtypeStructs carrying their shardings, and
`jit(...).lower(...).compile()` runs XLA's SPMD partitioner and buffer assignment for one device's
program. The numbers are those of the *CPU* compiler: GPU fusion and buffer assignment differ (cuDNN
attention, different fusions), so temporaries are an estimate; parameter, optimizer-state and
gradient bytes are exact (they follow from shapes and shardings alone). paxlite/plan.py finds the
devices (this process or a fresh one) and paxlite/plan_report.py prints the result.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any

DEFAULT_DEVICE_MEMORY_GIB = 80.0  # H100 80GB
DEFAULT_PEAK_TFLOPS = 989.0  # H100/H200 dense BF16 (docs/performance.md)
GIB = 2**30
_MAX_COMPILED_LEVERS = 4  # re-plans per verdict: each is one more compile of the whole step


class PlanError(RuntimeError):
    """The planner could not run (not a bad configuration: those raise ConfigError / MeshError)."""


def _resolved_mesh_shapes(experiment, num_devices: int) -> tuple[list[int], list[int]]:
    """ICI and DCN shapes for `num_devices`, as given ([data, fsdp, tensor] or with a 4th, expert,
    entry); ICI=None puts each node's devices (num_devices / DCN) on data, as a real multi-node run
    does."""
    from paxlite.parallel.mesh import MeshError

    dcn = list(experiment.DCN_MESH_SHAPE)
    nodes = math.prod(dcn)
    if experiment.ICI_MESH_SHAPE is None:
        if num_devices % nodes:
            raise MeshError(
                f"ICI_MESH_SHAPE=None x DCN_MESH_SHAPE={dcn}: {nodes} node(s) do not divide "
                f"--devices={num_devices}"
            )
        return [num_devices // nodes, 1, 1], dcn
    ici = list(experiment.ICI_MESH_SHAPE)
    if math.prod(ici) * nodes != num_devices:
        raise MeshError(
            f"ICI_MESH_SHAPE={ici} x DCN_MESH_SHAPE={dcn} needs {math.prod(ici) * nodes} devices, "
            f"but the plan is for --devices={num_devices}; pass --devices={math.prod(ici) * nodes} "
            f"or change the mesh with --fdl.ICI_MESH_SHAPE / --fdl.DCN_MESH_SHAPE"
        )
    return ici, dcn


def _shard_bytes(abstract_tree) -> int:
    """Bytes of one device's shard of every leaf (the largest shard, for uneven splits)."""
    import jax

    total = 0
    for leaf in jax.tree.leaves(abstract_tree):
        total += math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
    return total


def _flops_of(compiled) -> float | None:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    return None if not cost or "flops" not in cost else float(cost["flops"])


def compile_train_step(experiment, *, num_devices: int) -> dict[str, Any]:
    """Compile the experiment's train step for `num_devices` CPU devices and measure one device."""
    import fiddle as fdl
    import jax
    import jax.numpy as jnp

    from paxlite.models.attention_kernels import AttentionImplementation
    from paxlite.models.transformer import Transformer
    from paxlite.parallel import mesh as mesh_lib
    from paxlite.parallel import rules as rules_lib
    from paxlite.train.grad_accum import microbatch_size
    from paxlite.train.optimizer import make_optimizer
    from paxlite.train.schedules import make_schedule
    from paxlite.train.step import compile_steps

    devices = jax.devices()
    if devices[0].platform != "cpu" or len(devices) < num_devices:
        raise PlanError(
            f"planning for {num_devices} devices needs that many CPU devices in this process, "
            "which "
            f"has {len(devices)} {devices[0].platform} device(s); use paxlite.plan.plan(), which "
            "starts a subprocess when needed"
        )
    ici, dcn = _resolved_mesh_shapes(experiment, num_devices)
    mesh_config = mesh_lib.MeshConfig(ici_mesh_shape=tuple(ici), dcn_mesh_shape=tuple(dcn))
    mesh = mesh_lib.build_mesh(mesh_config, devices=devices[:num_devices])
    global_batch = mesh_lib.global_batch_size(
        percore_batch_size=experiment.PERCORE_BATCH_SIZE, num_devices=num_devices,
        batch_split=rules_lib.batch_split(mesh),
        fixed_global_batch_size=getattr(experiment, "GLOBAL_BATCH_SIZE", None),
    )
    model_config = fdl.build(experiment.model_config())
    attention_note = None
    if model_config.attention_implementation in (AttentionImplementation.CUDNN,
                                                 AttentionImplementation.PALLAS_TRITON):
        # The CPU compiler has no cuDNN or Triton kernels: plan the same function with XLA's
        # attention (its [B, N, T, S] logits make the temporaries an over-estimate) and say so.
        attention_note = (
            f"attention planned with 'xla': the CPU compiler cannot compile "
            f"{model_config.attention_implementation.value!r}, which holds no [B, N, T, S] logits, "
            "so the temporaries are an over-estimate")
        model_config = dataclasses.replace(model_config,
                                           attention_implementation=AttentionImplementation.XLA)
    schedule = make_schedule(fdl.build(experiment.schedule_config()))
    seq_len = model_config.max_seq_len
    loop = fdl.build(experiment.loop_config())
    # Gradient accumulation: activations scale with the microbatch, as in the real run, which
    # refuses microbatches that do not split over data x fsdp x expert; so does the plan.
    microbatch_size(global_batch_size=global_batch, grad_accum_steps=loop.grad_accum_steps,
                    batch_split=rules_lib.batch_split(mesh))
    accum = {"grad_accum_steps": loop.grad_accum_steps,
             "loss_chunk_size": loop.loss_chunk_size}  # LOSS_CHUNK_SIZE: logits memory
    started = time.perf_counter()
    with jax.set_mesh(mesh):
        steps = compile_steps(
            model=Transformer(model_config),
            optimizer=make_optimizer(fdl.build(experiment.optimizer_config()), schedule),
            schedule=schedule,
            mesh=mesh,
            seq_len=seq_len,
            seed=experiment.SEED,
            deterministic=model_config.dropout_prob == 0 and model_config.input_dropout_prob == 0,
            **accum,
        )
        # A packed text batch, the largest the feed produces; synthetic data has the first three.
        dtypes = {"inputs": jnp.int32, "targets": jnp.int32, "weights": jnp.float32,
                  "positions": jnp.int32, "segment_ids": jnp.int32}
        batch = {key: jax.ShapeDtypeStruct((global_batch, seq_len), dtype,
                                           sharding=steps.batch_sharding)
                 for key, dtype in dtypes.items()}
        compiled = steps.train.lower(steps.abstract_state, batch).compile()
    compile_s = time.perf_counter() - started
    stats = compiled.memory_analysis()
    memory = {
        "parameter_bytes": _shard_bytes(steps.abstract_state.params),
        "optimizer_state_bytes": _shard_bytes(steps.abstract_state.opt_state),
        "gradient_bytes": _shard_bytes(steps.abstract_state.params),  # grads: the params' dtype
        "argument_bytes": int(stats.argument_size_in_bytes),
        "output_bytes": int(stats.output_size_in_bytes),
        "alias_bytes": int(stats.alias_size_in_bytes),
        "temp_bytes": int(stats.temp_size_in_bytes),
        "generated_code_bytes": int(stats.generated_code_size_in_bytes),
    }
    # Donated state: outputs reuse argument buffers, counted once. Temporaries (activations kept
    # for the backward pass, gradients, gathered FSDP weights) are the peak of the scratch space.
    memory["peak_bytes"] = (memory["argument_bytes"] + memory["output_bytes"]
                            - memory["alias_bytes"] + memory["temp_bytes"]
                            + memory["generated_code_bytes"])
    compiler_flops = _flops_of(compiled)
    return {
        "mesh": dict(mesh.shape),
        "ici_mesh_shape": ici,
        "dcn_mesh_shape": dcn,
        "global_batch_size": global_batch,
        "seq_len": seq_len,
        "memory": memory,
        "compiler_flops_per_device": compiler_flops,
        "compile_s": round(compile_s, 2),
        **({"attention_note": attention_note} if attention_note else {}),
    }


# ------------------------------------------------------------------------------------------------
# The plan: one compile, a verdict, and levers when it does not fit


def _variant(experiment, changes: dict[str, Any]):
    overrides = {name: getattr(experiment, name) for name in experiment.overridden}
    return type(experiment).resolve({**overrides, **changes})


def _verdict(peak_bytes: int, device_bytes: int) -> dict[str, Any]:
    return {"fits": peak_bytes <= device_bytes, "margin_bytes": device_bytes - peak_bytes,
            "margin_gib": round((device_bytes - peak_bytes) / GIB, 3)}


def _levers(experiment, base: dict[str, Any], *, num_devices: int,
            device_bytes: int) -> list[dict[str, Any]]:
    """Ways to make the run fit, each measured: analytic where the change is exact arithmetic,
    compiled (at most _MAX_COMPILED_LEVERS compiles) where the compiler decides."""
    from paxlite.config.errors import ConfigError
    from paxlite.parallel.mesh import MeshError

    levers: list[dict[str, Any]] = []
    ici, dcn = base["ici_mesh_shape"], base["dcn_mesh_shape"]
    data, fsdp = base["mesh"]["data"], base["mesh"]["fsdp"]
    state = base["memory"]["parameter_bytes"] + base["memory"]["optimizer_state_bytes"]
    state += base["memory"]["gradient_bytes"]
    candidates: list[tuple[str, str, dict[str, Any]]] = _expert_candidates(experiment, base)
    if data > 1:
        # Intermediate fsdp sizes: only the sharded state changes (exactly 1/fsdp); the batch split
        # data x fsdp x expert, and so the activations, stay as they are.
        factor = 2
        while data % factor == 0 and factor < data:
            new_fsdp = fsdp * factor
            peak = base["memory"]["peak_bytes"] - state + math.ceil(state * fsdp / new_fsdp)
            levers.append({"lever": f"fsdp {fsdp} -> {new_fsdp} (data {data} -> {data // factor})",
                           "method": "analytic: parameter + optimizer + gradient bytes x "
                                     f"{fsdp}/{new_fsdp}, the rest as compiled",
                           "peak_bytes": peak, **_verdict(peak, device_bytes)})
            factor *= 2
        candidates.append((f"fsdp {fsdp} -> {fsdp * data} (all of data moved to fsdp)",
                           "compiled", {"ICI_MESH_SHAPE": [1, ici[0] * ici[1], *ici[2:]],
                                        "DCN_MESH_SHAPE": [1, dcn[0] * dcn[1], *dcn[2:]]}))
    else:
        levers.append({"lever": "more fsdp", "applicable": False,
                       "reason": "the data axis is 1: no data-parallel devices are left to "
                                 "move to fsdp"})
    if not experiment.USE_REPEATED_LAYER:
        # Unrolled layers keep every activation for the backward pass (Pax applies the policy to
        # the repeated stack only), so the remat lever is the scanned stack with SAVE_NOTHING.
        candidates.append((("USE_REPEATED_LAYER=true + CHECKPOINT_POLICY=SAVE_NOTHING (recompute each "
                            "layer)"), "compiled",
                           {"USE_REPEATED_LAYER": True, "CHECKPOINT_POLICY": "SAVE_NOTHING"}))
    elif experiment.CHECKPOINT_POLICY != "SAVE_NOTHING":
        candidates.append(("CHECKPOINT_POLICY=SAVE_NOTHING (recompute each layer)", "compiled",
                           {"CHECKPOINT_POLICY": "SAVE_NOTHING"}))
    else:
        levers.append({"lever": "CHECKPOINT_POLICY=SAVE_NOTHING", "applicable": False,
                       "reason": "already SAVE_NOTHING"})
    accum = experiment.GRAD_ACCUM_STEPS
    candidates.append((f"GRAD_ACCUM_STEPS {accum} -> {2 * accum} (same global batch, same training)",
                       "compiled", {"GRAD_ACCUM_STEPS": 2 * accum}))
    if getattr(experiment, "GLOBAL_BATCH_SIZE", None) is not None:  # a fixed batch wins
        candidates.append(((f"GLOBAL_BATCH_SIZE {experiment.GLOBAL_BATCH_SIZE} -> "
                            f"{experiment.GLOBAL_BATCH_SIZE // 2}"), "compiled",
                           {"GLOBAL_BATCH_SIZE": experiment.GLOBAL_BATCH_SIZE // 2}))
    else:
        candidates.append(((f"PERCORE_BATCH_SIZE {experiment.PERCORE_BATCH_SIZE:g} -> "
                            f"{experiment.PERCORE_BATCH_SIZE / 2:g}"), "compiled",
                           {"PERCORE_BATCH_SIZE": experiment.PERCORE_BATCH_SIZE / 2}))
    chosen = candidates[:_MAX_COMPILED_LEVERS]
    measured = _compile_variants(experiment, [changes for _, _, changes in chosen], num_devices=num_devices)
    for (description, method, changes), result in zip(chosen, measured):
        lever = {"lever": description, "method": method, "overrides": changes}
        if isinstance(result, (ConfigError, MeshError, ValueError)):  # e.g. a batch that no longer divides
            levers.append({**lever, "applicable": False, "reason": str(result)})
            continue
        peak = result["memory"]["peak_bytes"]
        levers.append({**lever, "peak_bytes": peak, **_verdict(peak, device_bytes)})
    combined = _combined_lever(experiment, levers, num_devices=num_devices, device_bytes=device_bytes)
    return levers + ([combined] if combined else [])


def _compile_variants(experiment, variants: list[dict[str, Any]], *,
                      num_devices: int) -> list[dict[str, Any] | Exception]:
    """compile_train_step of each variant (in order), several at once: XLA's compile of one program
    runs its passes on one core, and the levers are independent, so with N cores N levers compile in
    about the time of one (LLaMA70B on 16 devices: three of its four levers are the 80-layer step).
    A variant the configuration refuses gives its ConfigError / MeshError / ValueError instead."""
    from concurrent.futures import ThreadPoolExecutor

    from paxlite.config.errors import ConfigError
    from paxlite.parallel.mesh import MeshError

    def measure(changes: dict[str, Any]) -> dict[str, Any] | Exception:
        try:
            return compile_train_step(_variant(experiment, changes), num_devices=num_devices)
        except (ConfigError, MeshError, ValueError) as e:
            return e

    if len(variants) <= 1:
        return [measure(changes) for changes in variants]
    with ThreadPoolExecutor(max_workers=min(len(variants), os.cpu_count() or 1)) as pool:
        return list(pool.map(measure, variants))


def _expert_candidates(experiment, base: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """MoE levers: shard the experts over an expert axis taken from data (same training: the batch
    still splits data x fsdp x expert ways), and for GShard more, smaller routing groups."""
    moe = getattr(experiment, "NUM_EXPERTS", None)
    if moe is None:
        return []
    out = []
    shapes = {"ICI_MESH_SHAPE": list(base["ici_mesh_shape"]),
              "DCN_MESH_SHAPE": list(base["dcn_mesh_shape"])}
    for shape in shapes.values():
        shape += [1] * (4 - len(shape))
    unsharded = experiment.NUM_EXPERTS // base["mesh"]["expert"]
    # Data first (the experts' weights were replicated over it), then fsdp (each device then
    # gathers only its own experts' weights, not every expert's), within nodes first. At most 8x:
    # what fsdp gives up stops sharding the dense weights, and the exchange stays within 8 ranks.
    for axis, name in ((0, "ICI_MESH_SHAPE"), (0, "DCN_MESH_SHAPE"), (1, "ICI_MESH_SHAPE"),
                       (1, "DCN_MESH_SHAPE")):
        factor = math.gcd(shapes[name][axis], unsharded, 8)
        if factor > 1:
            changed = {key: list(value) for key, value in shapes.items()}
            changed[name][axis] //= factor
            changed[name][3] *= factor
            source = ("data", "fsdp")[axis]
            out.append(((f"expert {base['mesh']['expert']} -> {base['mesh']['expert'] * factor} "
                         f"(from {source} in {name.split('_')[0]}; each device holds and gathers "
                         f"{factor}x fewer experts)"), "compiled", changed))
            break
    if getattr(experiment, "MOE_ROUTING", None) == "gshard_top2":
        groups = experiment.NUM_GROUPS or (_moe_plan(experiment, base) or {}).get("groups")
        if groups:
            out.append(((f"NUM_GROUPS {groups} -> {2 * groups} (groups of half the tokens: "
                        "dispatch/combine halve; routing changes)"), "compiled",
                        {"NUM_GROUPS": 2 * groups}))
    return out


# Levers that leave the training computation unchanged (same global batch, same math); halving the
# batch is left out of the combination because it changes the run being planned.
_SAME_TRAINING_KEYS = frozenset({"ICI_MESH_SHAPE", "DCN_MESH_SHAPE", "USE_REPEATED_LAYER",
                                 "CHECKPOINT_POLICY", "GRAD_ACCUM_STEPS"})


def _combined_lever(experiment, levers: list[dict[str, Any]], *, num_devices: int,
                    device_bytes: int) -> dict[str, Any] | None:
    """When no single lever fits, every applicable same-training lever at once, compiled.

    Large models often need several (LLaMA70B on 16 devices: the scanned stack with SAVE_NOTHING and
    gradient accumulation together); the user should not have to find the combination by hand.
    """
    from paxlite.config.errors import ConfigError
    from paxlite.parallel.mesh import MeshError

    if any(lever.get("fits") for lever in levers):
        return None
    parts = [lever for lever in levers if lever.get("method") == "compiled" and "peak_bytes" in lever
             and set(lever["overrides"]) <= _SAME_TRAINING_KEYS]
    if len(parts) < 2:
        return None
    changes: dict[str, Any] = {}
    for lever in parts:
        changes.update(lever["overrides"])
    lever = {"lever": "together: " + " + ".join(p["lever"] for p in parts), "method": "compiled",
             "overrides": changes}
    try:
        measured = compile_train_step(_variant(experiment, changes), num_devices=num_devices)
    except (ConfigError, MeshError, ValueError) as e:
        return {**lever, "applicable": False, "reason": str(e)}
    peak = measured["memory"]["peak_bytes"]
    return {**lever, "peak_bytes": peak, **_verdict(peak, device_bytes)}


def plan_experiment(experiment, *, num_devices: int,
                    device_memory_gib: float = DEFAULT_DEVICE_MEMORY_GIB,
                    peak_tflops: float = DEFAULT_PEAK_TFLOPS) -> dict[str, Any]:
    """The plan (a JSON-friendly dict) of `experiment` on `num_devices` devices of this process."""
    import fiddle as fdl

    from paxlite.models.transformer import num_params
    from paxlite.parallel.mesh import BATCH_AXES

    started = time.perf_counter()
    base = compile_train_step(experiment, num_devices=num_devices)
    device_bytes = int(device_memory_gib * GIB)
    tokens = base["global_batch_size"] * base["seq_len"]
    analytic = experiment.flops_per_token() * tokens
    compiler = base["compiler_flops_per_device"]
    ideal_step_s = analytic / (num_devices * peak_tflops * 1e12)
    verdict = _verdict(base["memory"]["peak_bytes"], device_bytes)
    batch_ways = math.prod(base["mesh"][axis] for axis in BATCH_AXES)
    result = {
        "experiment": experiment.name,
        "class": f"{type(experiment).__module__}.{type(experiment).__qualname__}",
        "overrides": {name: experiment.hparams()[name] for name in sorted(experiment.overridden)},
        "num_devices": num_devices,
        "compiled_for": "cpu",
        **{key: base[key] for key in ("mesh", "ici_mesh_shape", "dcn_mesh_shape",
                                      "global_batch_size", "seq_len")},
        "tokens_per_step": tokens,
        "num_params": num_params(fdl.build(experiment.model_config())),
        "memory_per_device": base["memory"],
        "peak_formula": "argument + output - alias + temp + generated_code",
        "device_memory_bytes": device_bytes,
        **verdict,
        # The attention logits and probabilities [B, N, T, S] per layer: the model materialises
        # them in float32, and under remat they are rebuilt layer by layer.
        "attention_logits_bytes_per_layer": 4 * base["global_batch_size"] // batch_ways
        * experiment.NUM_HEADS // base["mesh"]["tensor"] * base["seq_len"] ** 2,
        "moe": _moe_plan(experiment, base),
        # A cuDNN / Pallas-Triton run is compiled here with XLA's attention (see compile_train_step).
        "attention_note": base.get("attention_note"),
        "flops_per_step": {
            "analytic": analytic,
            "analytic_per_token": experiment.flops_per_token(),
            "compiler_per_device": compiler,
            "compiler_total": None if compiler is None else compiler * num_devices,
            # XLA's cost analysis counts a while loop's body once: with a scanned layer stack the
            # compiler figure is about one layer's work plus the embedding and the loss.
            "compiler_counts_scanned_layers_once": bool(experiment.USE_REPEATED_LAYER),
        },
        "peak_tflops_per_device": peak_tflops,
        "step_time_at_100pct_mfu_s": ideal_step_s,
        "tokens_per_s_at_100pct_mfu": tokens / ideal_step_s,
        "levers": [] if verdict["fits"] else _levers(experiment, base, num_devices=num_devices,
                                                     device_bytes=device_bytes),
        "compile_s": base["compile_s"],
    }
    result["plan_s"] = round(time.perf_counter() - started, 2)
    return result


def _moe_plan(experiment, base: dict[str, Any]) -> dict[str, Any] | None:
    """Experts per device and the routing tensors of one MoE layer per device; None when dense."""
    import fiddle as fdl

    from paxlite.models.moe_params import num_moe_layers, routing_memory

    model = fdl.build(experiment.model_config())
    if model.moe is None:
        return None
    memory = routing_memory(model, global_tokens=base["global_batch_size"] * base["seq_len"],
                            mesh=base["mesh"])
    return {"num_experts": model.moe.num_experts, "experts_per_token": model.moe.experts_per_token,
            "moe_layers": num_moe_layers(model), "expert_axis": base["mesh"]["expert"],
            "experts_per_device": model.moe.num_experts // base["mesh"]["expert"], **memory}
