"""CPU step time of tiny MoE models against dense models with the same active parameters.

Why: a mixture of experts is worth its routing only if a step costs about what the dense model
with the same per-token compute costs. This benchmark builds, in one process, three pairs:

- ``glam``: 8 experts, GShard top-2 (capacity factor 2.0, Pax's default of one group per batch
  shard, here one group of all B*T tokens), every 2nd layer MoE, non-gated ReLU experts;
- ``glam_g<B>``: the same model with ``num_groups=B`` (one group per sequence, S = T tokens);
- ``mixtral``: 8 experts, dropless top-2 (``jax.lax.ragged_dot``), every layer MoE, SwiGLU,

each beside its *active-matched* dense model, and times the full jitted train step
(``compile_steps``: forward, backward, Adam, on a 1-device mesh) in interleaved rounds
(A/B, B/A, ...), reporting median ms/step and the ratio MoE / dense. Goal (issue 12): GShard
<= 1.5x its dense model.

"Active-matched" means: same attention, embeddings, norms and vocabulary, and a dense hidden size
H_d such that the MLP weights a token passes through, summed over all layers, are equal:
``L * H_d * m = n_moe * k * F_e * m + n_dense * H * m`` (m = 2 matmuls plain, 3 gated), so the
dense model's matmul FLOPs per token equal the MoE model's top-k expert FLOPs. The routers (D x E
per MoE layer) are the MoE models' only extra active weights; the benchmark checks the equality
and prints the router count. With capacity factor 2.0 GShard's experts also compute exactly k*S
slots per group (C = cf*S/E), so capacity does not change the expert FLOPs.

On CPU, ``ragged_dot`` is lowered as a masked dense matmul over all experts, so the dropless
experts cost E times the top-k FLOPs; the benchmark prints the step-FLOP ratio that expansion
implies, beside XLA's own FLOP count of each compiled step (``cost_analysis``).

With ``--profile`` it also times one GShard MoE layer alone (forward + backward) against the
dense MLP of hidden k*F, and the dispatch / combine einsums alone, for both group sizes.

    .venv/bin/python benchmarks/moe_step.py --steps 5 --rounds 3 --profile
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import traverse_util

from paxlite.models.activations import Activation, activation_fn
from paxlite.models.mlp import Mlp
from paxlite.models.moe import MoeMlp
from paxlite.models.moe_config import MoeConfig, MoeRouting
from paxlite.models.moe_gating import expert_capacity
from paxlite.models.transformer import (
    PositionEmbedding,
    Transformer,
    TransformerConfig,
    abstract_variables,
)
from paxlite.parallel.mesh import MeshConfig, build_mesh
from paxlite.train.optimizer import OptimizerConfig, make_optimizer
from paxlite.train.step import compile_steps

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_step import (  # a sibling script, not a package
    INITIAL_LOSS_TOLERANCE,
    _require,
    bare_round,
    count,
)

PyTree = Any
NUM_EXPERTS = 8
TOP_K = 2
GOAL = 1.5  # GShard step / active-matched dense step


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sizes:
    """The shapes shared by every model of one run."""

    num_layers: int
    model_dims: int
    hidden_dims: int  # GLaM: dense layers' hidden and each expert's; Mixtral: 2x each expert's
    batch: int
    seq_len: int
    vocab_size: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pair:
    """An MoE model and its active-matched dense model (see the module docstring)."""

    name: str
    moe: TransformerConfig
    dense: TransformerConfig


def _base(sizes: Sizes, **kwargs: Any) -> TransformerConfig:
    """Attention, embeddings and norms every model shares (no biases: MoE layers have none)."""
    return TransformerConfig(
        vocab_size=sizes.vocab_size, num_layers=sizes.num_layers, model_dims=sizes.model_dims,
        num_heads=8, dims_per_head=sizes.model_dims // 8, max_seq_len=sizes.seq_len,
        use_bias=False, **kwargs)


def matched_hidden(config: TransformerConfig) -> int:
    """H_d with L * H_d = sum over layers of the hidden units a token passes through."""
    moe = config.moe
    n_moe = moe.num_moe_layers(config.num_layers)
    expert = moe.expert_hidden_dims or config.hidden_dims
    total = (
        n_moe * moe.experts_per_token * expert + (config.num_layers - n_moe) * config.hidden_dims
    )
    _require(total % config.num_layers == 0, f"no integer dense hidden size matches {config}")
    return total // config.num_layers


def make_pairs(sizes: Sizes) -> list[Pair]:
    h = sizes.hidden_dims
    glam_moe = MoeConfig(
        num_experts=NUM_EXPERTS, routing=MoeRouting.GSHARD_TOP2, capacity_factor=2.0,
        moe_layer_interval=2, expert_hidden_dims=h, gated_experts=False,
        expert_activation=Activation.RELU)
    glam = _base(sizes, hidden_dims=h, activation=Activation.RELU, moe=glam_moe)
    glam_grouped = dataclasses.replace(
        glam, moe=dataclasses.replace(glam_moe, num_groups=sizes.batch))
    mixtral = _base(
        sizes, hidden_dims=h // TOP_K, activation=Activation.SILU, gated_mlp=True,
        moe=MoeConfig(num_experts=NUM_EXPERTS, experts_per_token=TOP_K,
                      routing=MoeRouting.DROPLESS_TOPK, moe_layer_interval=1,
                      expert_hidden_dims=h // TOP_K, gated_experts=True,
                      expert_activation=Activation.SILU))
    pairs = []
    for name, cfg in (("glam", glam), (f"glam_g{sizes.batch}", glam_grouped),
                      ("mixtral", mixtral)):
        dense = dataclasses.replace(cfg, moe=None, hidden_dims=matched_hidden(cfg))
        pairs.append(Pair(name=name, moe=cfg, dense=dense))
    return pairs


def param_counts(config: TransformerConfig) -> dict[str, int]:
    """total, active (per token: experts scaled by k/E) and router parameters."""
    flat = traverse_util.flatten_dict(nn.meta.unbox(abstract_variables(config))["params"])
    total = active = router = 0
    for path, leaf in flat.items():
        n = count(leaf)
        total += n
        if "moe" in path and "router" in path:
            router += n
            active += n
        elif "moe" in path:
            active += n * config.moe.experts_per_token // config.moe.num_experts
        else:
            active += n
    return {"total": total, "active": active, "router": router}


def analytic_flops(config: TransformerConfig, *, tokens: int, expert_multiplier: int) -> float:
    """Train-step matmul FLOPs: 6 per active weight per token (forward + two backward matmuls),
    plus attention scores and values (4 T D per token and layer forward, x3); the experts'
    weights count ``expert_multiplier`` times (E for ragged_dot's dense expansion, else 1)."""
    mlp_expert = 0  # weights a token passes through in the experts, all MoE layers
    if config.moe is not None:
        moe = config.moe
        m = 3 if moe.gated_experts else 2
        f = moe.expert_hidden_dims or config.hidden_dims
        mlp_expert = (moe.num_moe_layers(config.num_layers) * moe.experts_per_token * m
                      * config.model_dims * f)
    weights = param_counts(config)["active"] + (expert_multiplier - 1) * mlp_expert
    if not config.tie_embeddings:
        weights -= config.vocab_size * config.model_dims  # the input table is a gather
    if config.position_kind is PositionEmbedding.LEARNED:
        weights -= config.max_seq_len * config.model_dims  # an add, not a matmul
    attention = 4 * config.max_seq_len * config.model_dims * config.num_layers
    flops = 6.0 * tokens * weights + 3.0 * tokens * attention
    if config.moe is not None and config.moe.routing is MoeRouting.GSHARD_TOP2:
        flops += gshard_einsum_flops(config, tokens=tokens)
    return flops


def gshard_shape(config: TransformerConfig, *, tokens: int) -> tuple[int, int, int]:
    """(G, S, C) of the GShard dispatch on one device (num_groups None: one group)."""
    moe = config.moe
    groups = moe.num_groups or 1
    s = tokens // groups
    c = expert_capacity(group_size=s, num_experts=moe.num_experts,
                        capacity_factor=moe.capacity_factor, expert_capacity_dim=None)
    return groups, s, c


def gshard_einsum_flops(config: TransformerConfig, *, tokens: int) -> float:
    """Dispatch and combine einsums of a train step: each is G*S*E*C*D multiply-adds; forward 2,
    backward 3 (combine: d(expert outputs) and d(combine weights); dispatch: d(tokens))."""
    g, s, c = gshard_shape(config, tokens=tokens)
    macs = g * s * config.moe.num_experts * c * config.model_dims
    return 2.0 * 5 * macs * config.moe.num_moe_layers(config.num_layers)


# ------------------------------------------------------------------------- the timed step
@dataclasses.dataclass
class Side:
    """One compiled model: its step in cpu_step's `bare_round` signature and its state."""

    name: str
    config: TransformerConfig
    step: Callable[..., tuple[PyTree, None, jax.Array]]
    state: list[PyTree]
    xla_flops: float | None
    init_loss: float
    times: list[float] = dataclasses.field(default_factory=list)


def build_side(name: str, config: TransformerConfig, *, sizes: Sizes, mesh,
               weights: jax.Array) -> Side:
    schedule = optax.constant_schedule(1e-4)
    optimizer = make_optimizer(OptimizerConfig(clip_gradient_norm_to_value=1.0), schedule)
    steps = compile_steps(model=Transformer(config), optimizer=optimizer, schedule=schedule,
                          mesh=mesh, seq_len=sizes.seq_len, seed=0, deterministic=True)
    state = steps.init()
    batch = {"inputs": jnp.zeros((sizes.batch, sizes.seq_len), jnp.int32),
             "targets": jnp.zeros((sizes.batch, sizes.seq_len), jnp.int32), "weights": weights}
    cost = steps.train.lower(state, batch).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    flops = float(cost["flops"]) if cost and "flops" in cost else None

    def step(train_state, _unused, inputs, targets):
        new_state, metrics = steps.train(
            train_state, {"inputs": inputs, "targets": targets, "weights": weights})
        return new_state, None, metrics["loss"]

    return Side(name=name, config=config, step=step, state=[state, None], xla_flops=flops,
                init_loss=float("nan"))


def compare(pairs: list[Pair], *, sizes: Sizes, steps: int, rounds: int) -> list[dict[str, Any]]:
    mesh = build_mesh(MeshConfig(ici_mesh_shape=(1, 1, 1)), devices=jax.devices()[:1])
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(steps):
        tokens = rng.integers(0, sizes.vocab_size, (sizes.batch, sizes.seq_len + 1), np.int32)
        batches.append((jax.device_put(tokens[:, :-1]), jax.device_put(tokens[:, 1:])))
    weights = jnp.ones((sizes.batch, sizes.seq_len), jnp.float32)
    results = []
    with jax.set_mesh(mesh):
        for pair in pairs:
            moe_counts, dense_counts = param_counts(pair.moe), param_counts(pair.dense)
            _require(moe_counts["active"] - moe_counts["router"] == dense_counts["active"],
                     f"{pair.name}: active parameters differ beyond the routers: "
                     f"{moe_counts} vs {dense_counts}")
            sides = [build_side(n, c, sizes=sizes, mesh=mesh, weights=weights)
                     for n, c in (("moe", pair.moe), ("dense", pair.dense))]
            for side in sides:  # the first step's loss: both models start near ln(vocab)
                side.state[0], _, loss = side.step(side.state[0], None, *batches[0])
                side.init_loss = float(loss)
                _require(abs(side.init_loss - math.log(sizes.vocab_size)) < INITIAL_LOSS_TOLERANCE,
                         f"{pair.name} {side.name}: first loss {side.init_loss:.4f} is not near "
                         f"ln(vocab) = {math.log(sizes.vocab_size):.4f}")
            for index in range(rounds):
                for side in sides if index % 2 == 0 else sides[::-1]:
                    side.times.append(bare_round(side.step, side.state, batches))
                print(f"{pair.name} round {index + 1}: MoE {1e3 * sides[0].times[-1]:.1f} ms, "
                      f"dense {1e3 * sides[1].times[-1]:.1f} ms, "
                      f"ratio {sides[0].times[-1] / sides[1].times[-1]:.3f}", flush=True)
            results.append(summarise(pair, sides, sizes=sizes))
            for side in sides:
                side.state.clear()
    return results


def summarise(pair: Pair, sides: list[Side], *, sizes: Sizes) -> dict[str, Any]:
    moe, dense = sides
    moe_ms, dense_ms = (1e3 * statistics.median(s.times) for s in sides)
    cfg = pair.moe.moe
    tokens = sizes.batch * sizes.seq_len
    expansion = cfg.num_experts if cfg.routing is MoeRouting.DROPLESS_TOPK else 1
    out = {
        "pair": pair.name,
        "routing": cfg.routing.value,
        "moe_layers": cfg.num_moe_layers(pair.moe.num_layers),
        "expert_hidden": cfg.expert_hidden_dims,
        "dense_hidden": pair.dense.hidden_dims,
        "moe_params": param_counts(pair.moe),
        "dense_params": param_counts(pair.dense),
        "moe_ms": [round(1e3 * t, 1) for t in moe.times],
        "dense_ms": [round(1e3 * t, 1) for t in dense.times],
        "moe_median_ms": round(moe_ms, 1),
        "dense_median_ms": round(dense_ms, 1),
        "ratio": round(moe_ms / dense_ms, 3),
        "round_ratios": [round(a / b, 3) for a, b in zip(moe.times, dense.times, strict=True)],
        "median_round_ratio": round(statistics.median(
            a / b for a, b in zip(moe.times, dense.times, strict=True)), 3),
        "init_loss": [round(moe.init_loss, 4), round(dense.init_loss, 4)],
        "expected_flop_ratio": round(
            analytic_flops(pair.moe, tokens=tokens, expert_multiplier=expansion)
            / analytic_flops(pair.dense, tokens=tokens, expert_multiplier=1), 3),
    }
    if cfg.routing is MoeRouting.GSHARD_TOP2:
        g, s, c = gshard_shape(pair.moe, tokens=tokens)
        out["gshard"] = {"G": g, "S": s, "E": cfg.num_experts, "C": c,
                         "GSEC": g * s * cfg.num_experts * c,
                         "dispatch_over_expert_matmul": round(s / cfg.expert_hidden_dims, 3)}
    if moe.xla_flops and dense.xla_flops:
        out["xla_gflops"] = [round(moe.xla_flops / 1e9, 2), round(dense.xla_flops / 1e9, 2)]
        out["xla_flop_ratio"] = round(moe.xla_flops / dense.xla_flops, 3)
    return out


# ------------------------------------------------------------------------- layer profile
_dispatch = jax.jit(lambda m, v: jnp.einsum("GSEC,GSD->EGCD", m, v))
_combine = jax.jit(lambda y, m: jnp.einsum("EGCD,GSEC->GSD", y, m))
_expert_wi = jax.jit(lambda v, k: jnp.einsum("EGCD,EDF->EGCF", v, k))


def _median_ms(fn: Callable[..., Any], *args: Any, repeats: int) -> float:
    """Median wall time of fn(*args) after one warm-up (compiling) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _fwd_bwd_ms(module: nn.Module, x: jax.Array, *, repeats: int) -> float:
    params = module.init(jax.random.key(0), x)["params"]

    def loss(p, x_):
        y = module.apply({"params": p}, x_, mutable=["aux_loss", "summaries"])[0]
        return jnp.sum(y * y)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    return _median_ms(grad, params, x, repeats=repeats)


def profile_layer(sizes: Sizes, *, repeats: int) -> list[dict[str, Any]]:
    """One GShard layer (fwd+bwd, no mesh) vs the dense MLP of hidden 2F, and its einsums."""
    d, f, tokens = sizes.model_dims, sizes.hidden_dims, sizes.batch * sizes.seq_len
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(sizes.batch, sizes.seq_len, d)), jnp.float32)
    dense_ms = _fwd_bwd_ms(Mlp(hidden_dims=TOP_K * f, activation=activation_fn(Activation.RELU),
                               use_bias=False), x, repeats=repeats)
    rows = []
    for groups in (1, sizes.batch):
        cfg = MoeConfig(num_experts=NUM_EXPERTS, routing=MoeRouting.GSHARD_TOP2,
                        capacity_factor=2.0, num_groups=groups, expert_hidden_dims=f)
        s = tokens // groups
        c = expert_capacity(group_size=s, num_experts=NUM_EXPERTS, capacity_factor=2.0,
                            expert_capacity_dim=None)
        layer_ms = _fwd_bwd_ms(MoeMlp(config=cfg, hidden_dims=f), x, repeats=repeats)
        mask = jnp.asarray(rng.random((groups, s, NUM_EXPERTS, c)) < 1.0 / c, jnp.float32)
        xg = x.reshape(groups, s, d)
        xe = jnp.einsum("GSEC,GSD->EGCD", mask, xg)
        w = jnp.asarray(rng.normal(size=(NUM_EXPERTS, d, f)), jnp.float32)
        rows.append({
            "G": groups, "S": s, "C": c, "GSEC": groups * s * NUM_EXPERTS * c,
            "einsum_gmacs": {"dispatch": groups * s * NUM_EXPERTS * c * d / 1e9,
                             "combine": groups * s * NUM_EXPERTS * c * d / 1e9,
                             "expert_wi": NUM_EXPERTS * groups * c * d * f / 1e9},
            "moe_layer_fwd_bwd_ms": round(layer_ms, 2),
            "dense_mlp_fwd_bwd_ms": round(dense_ms, 2),
            "layer_ratio": round(layer_ms / dense_ms, 3),
            "dispatch_fwd_ms": round(_median_ms(_dispatch, mask, xg, repeats=repeats), 2),
            "combine_fwd_ms": round(_median_ms(_combine, xe, mask, repeats=repeats), 2),
            "expert_wi_fwd_ms": round(_median_ms(_expert_wi, xe, w, repeats=repeats), 2),
        })
        print(f"profile G={groups}: {json.dumps(rows[-1])}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round and side")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per pair")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--model_dims", type=int, default=256)
    parser.add_argument("--hidden_dims", type=int, default=1024,
                        help="GLaM dense and expert hidden; Mixtral experts get half")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--pairs", default="glam,glam_g,mixtral",
                        help="comma-separated subset of glam, glam_g, mixtral")
    parser.add_argument("--profile", action="store_true", help="also time one GShard layer alone")
    args = parser.parse_args(argv)
    for name in ("steps", "rounds", "layers", "model_dims", "hidden_dims", "batch", "seq_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.layers % 2 or args.model_dims % 8 or args.hidden_dims % 2:
        parser.error(f"--layers={args.layers}, --hidden_dims={args.hidden_dims}, --model_dims="
                     f"{args.model_dims}: layers and hidden_dims must be even (GLaM's MoE every "
                     "2nd layer, Mixtral's experts half the hidden) and model_dims a multiple of 8")
    sizes = Sizes(num_layers=args.layers, model_dims=args.model_dims,
                  hidden_dims=args.hidden_dims, batch=args.batch, seq_len=args.seq_len,
                  vocab_size=2048)
    wanted = {p.strip() for p in args.pairs.split(",") if p.strip()}
    pairs = [p for p in make_pairs(sizes) if p.name.rstrip("0123456789") in wanted]
    if not pairs or wanted - {"glam", "glam_g", "mixtral"}:
        parser.error(f"--pairs={args.pairs!r}: choose from glam, glam_g, mixtral")

    results = compare(pairs, sizes=sizes, steps=args.steps, rounds=args.rounds)
    profile = profile_layer(sizes, repeats=max(3, args.steps)) if args.profile else None
    device = jax.devices()[0]
    report = {"sizes": dataclasses.asdict(sizes), "steps": args.steps, "rounds": args.rounds,
              "pairs": results, "profile": profile, "jax": jax.__version__,
              "device": f"{device.platform} ({device.device_kind})"}
    print(json.dumps(report))
    print(f"jax {jax.__version__} on {report['device']}, {platform.node() or 'host'}, "
          f"{os.cpu_count()} CPUs; {sizes.num_layers} layers, d_model {sizes.model_dims}, "
          f"batch {sizes.batch} x {sizes.seq_len}; {args.steps} steps x {args.rounds} rounds")
    for r in results:
        goal = f" (goal <= {GOAL})" if r["routing"] == MoeRouting.GSHARD_TOP2.value else ""
        print(f"{r['pair']:>9} [{r['routing']}]: MoE {r['moe_median_ms']:.1f} ms/step, "
              f"dense(H={r['dense_hidden']}) {r['dense_median_ms']:.1f} ms/step, "
              f"ratio {r['ratio']:.3f}{goal} (median of per-round ratios "
              f"{r['median_round_ratio']:.3f}); expected FLOP ratio {r['expected_flop_ratio']}, "
              f"XLA FLOP ratio {r.get('xla_flop_ratio')}")
    return report


if __name__ == "__main__":
    main()
