"""Per-step overhead of paxlite's training loop against a bare-JAX step of the same model.

Why: a training framework should cost (almost) nothing on top of the compiled step. This benchmark
times paxlite's real product path (`build_run_config` -> `Run.train()`, including its synthetic
data generation, host finiteness checks and bookkeeping) and a hand-written jax.numpy + optax step
of the same GPT model (same shapes, dtypes, init scale and optimizer) in one process, alternating
rounds, and prints the ratio of the medians. Goal: paxlite <= 1.05x the bare step.

Before timing it checks that both sides train the same model: equal parameter counts, initial
losses near ln(vocab), and the bare forward pass run on paxlite's own initial parameters giving
paxlite's loss on the same batch.

    .venv/bin/python benchmarks/cpu_step.py --steps 10 --rounds 3

Runs on the default device (one device; CPU here, a single GPU works the same way).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from paxlite.experiments.build import build_run_config
from paxlite.models.transformer import num_params
from paxlite.train.loop import Run, RunContext
from paxlite.train.run_config import RunConfig

PyTree = Any
EXPERIMENT = "TinySynthetic"
# A model for which one step is compute-dominated but still short on a small CPU host.
MODEL_OVERRIDES: tuple[str, ...] = (
    "NUM_LAYERS=4",
    "MODEL_DIMS=256",
    "NUM_HEADS=8",
    "DIMS_PER_HEAD=32",
    "HIDDEN_DIMS=1024",
    "VOCAB_SIZE=2048",
    "MAX_SEQ_LEN=128",
    "PERCORE_BATCH_SIZE=16",
    "ICI_MESH_SHAPE=[1,1,1]",
    "DCN_MESH_SHAPE=[1,1,1]",
    "EVAL_LOOP_NUM_BATCHES=1",
)
INITIAL_LOSS_TOLERANCE = 0.25  # |initial loss - ln(vocab)| allowed for each side (nats)
PARITY_TOLERANCE = 1e-4  # relative: bare forward on paxlite's params vs paxlite's own loss


# ------------------------------------------------------------------------- bare JAX reference
@dataclasses.dataclass(frozen=True, kw_only=True)
class BareModel:
    """Sizes of the GPT decoder the bare step trains (plain numbers, no paxlite types)."""

    num_layers: int
    model_dims: int
    num_heads: int
    dims_per_head: int
    hidden_dims: int
    vocab_size: int
    max_seq_len: int
    init_std: float
    norm_epsilon: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class BareOptimizer:
    """Pax-style Adam: global-norm clip, Adam, decoupled weight decay, warm-up + cosine decay."""

    learning_rate: float
    warmup_steps: int
    decay_steps: int
    min_ratio: float
    beta1: float
    beta2: float
    epsilon: float
    weight_decay: float
    clip_norm: float


def bare_init(key: jax.Array, model: BareModel) -> dict[str, Any]:
    """normal(0, init_std) for every matmul weight and both tables; zero biases; unit LN scales."""
    d, n, h, f = model.model_dims, model.num_heads, model.dims_per_head, model.hidden_dims
    keys = iter(jax.random.split(key, 2 + 4 * model.num_layers))

    def normal(shape: tuple[int, ...]) -> jax.Array:
        return model.init_std * jax.random.normal(next(keys), shape, jnp.float32)

    def norm() -> dict[str, jax.Array]:
        return {"scale": jnp.ones((d,), jnp.float32), "bias": jnp.zeros((d,), jnp.float32)}

    layers = [
        {
            "ln1": norm(),
            "qkv_w": normal((d, 3, n, h)),
            "qkv_b": jnp.zeros((3, n, h), jnp.float32),
            "out_w": normal((n, h, d)),
            "out_b": jnp.zeros((d,), jnp.float32),
            "ln2": norm(),
            "wi": normal((d, f)),
            "bi": jnp.zeros((f,), jnp.float32),
            "wo": normal((f, d)),
            "bo": jnp.zeros((d,), jnp.float32),
        }
        for _ in range(model.num_layers)
    ]
    return {
        "embedding": normal((model.vocab_size, d)),
        "position": normal((model.max_seq_len, d)),
        "layers": layers,
        "final_ln": norm(),
    }


def _layer_norm(x: jax.Array, p: dict[str, jax.Array], eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]).astype(x.dtype)


def bare_logits(params: dict[str, Any], tokens: jax.Array, model: BareModel) -> jax.Array:
    """tokens int32 [B, T] -> float32 logits [B, T, V]; pre-LN GPT with a tied softmax."""
    _, t = tokens.shape
    x = params["embedding"][tokens] + params["position"][:t][None]  # [B, T, D]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))  # [T, S]
    scale = model.dims_per_head**-0.5
    for p in params["layers"]:
        y = _layer_norm(x, p["ln1"], model.norm_epsilon)
        qkv = jnp.einsum("btd,dknh->btknh", y, p["qkv_w"]) + p["qkv_b"]  # [B, T, 3, N, H]
        q, k, v = qkv[:, :, 0] * scale, qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("btnh,bsnh->bnts", q, k)  # [B, N, T, S]
        scores = jnp.where(causal, scores, -1e30)
        probs = jax.nn.softmax(scores, axis=-1)
        attn = jnp.einsum("bnts,bsnh->btnh", probs, v)
        # Residual adds take the finished sublayer output: `x + dot + bias` associates as
        # `(x + dot) + bias`, and XLA:CPU then re-fuses the residual chain into many consumers.
        x = x + (jnp.einsum("btnh,nhd->btd", attn, p["out_w"]) + p["out_b"])
        y = _layer_norm(x, p["ln2"], model.norm_epsilon)
        hidden = jax.nn.gelu(y @ p["wi"] + p["bi"], approximate=True)  # [B, T, F]
        x = x + (hidden @ p["wo"] + p["bo"])
    x = _layer_norm(x, params["final_ln"], model.norm_epsilon)
    return jnp.einsum("btd,vd->btv", x, params["embedding"])


def bare_loss(
    params: dict[str, Any], inputs: jax.Array, targets: jax.Array, model: BareModel
) -> jax.Array:
    """Mean token cross entropy."""
    logits = bare_logits(params, inputs, model)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(log_z - target_logit)


def bare_optimizer(opt: BareOptimizer) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=opt.learning_rate,
        warmup_steps=opt.warmup_steps,
        decay_steps=opt.decay_steps,
        end_value=opt.learning_rate * opt.min_ratio,
    )
    return optax.chain(
        optax.clip_by_global_norm(opt.clip_norm),
        optax.scale_by_adam(b1=opt.beta1, b2=opt.beta2, eps=opt.epsilon),
        optax.add_decayed_weights(opt.weight_decay),
        optax.scale_by_learning_rate(schedule),
    )


def bare_train_step(
    model: BareModel, optimizer: optax.GradientTransformation
) -> Callable[[PyTree, PyTree, jax.Array, jax.Array], tuple[PyTree, PyTree, jax.Array]]:
    """The jitted step, parameters and optimizer state donated as a hand-written loop would."""

    def step(
        params: PyTree, opt_state: PyTree, inputs: jax.Array, targets: jax.Array
    ) -> tuple[PyTree, PyTree, jax.Array]:
        loss, grads = jax.value_and_grad(bare_loss)(params, inputs, targets, model)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


# ------------------------------------------------------------------------- harness
def paxlite_overrides(steps: int) -> list[str]:
    """One untimed (compiling) step, then `steps` timed ones summarised in one window at the end;
    the last-step evaluation runs after that window is closed, and nothing is checkpointed."""
    total = steps + 1
    return [
        *MODEL_OVERRIDES,
        f"MAX_STEPS={total}",
        f"SUMMARY_INTERVAL_STEPS={total}",
        f"EVAL_INTERVAL_STEPS={total + 1}",
        f"CHECKPOINT_EVERY_N_STEPS={total + 1}",
        f"LR_COS_DECAY_END={max(total, 100)}",
    ]


def bare_specs(config: RunConfig) -> tuple[BareModel, BareOptimizer]:
    """Copy paxlite's numbers into the bare side, refusing settings the bare model does not have."""
    m, o, s = config.model, config.optimizer, config.schedule
    unsupported = {
        "dtype": (m.dtype, "float32"),
        "param_dtype": (m.param_dtype, "float32"),
        "norm": (m.norm.value, "layer_norm"),
        "activation": (m.activation.value, "gelu_tanh"),
        "use_bias": (m.use_bias, True),
        "tie_embeddings": (m.tie_embeddings, True),
        "learned_position_embedding": (m.learned_position_embedding, True),
        "scan_layers": (m.scan_layers, False),
        "dropout_prob": (m.dropout_prob, 0.0),
        "input_dropout_prob": (m.input_dropout_prob, 0.0),
        "epsilon_root": (o.epsilon_root, 0.0),
        "schedule": (s.kind.value, "linear_rampup_cosine_decay"),
    }
    for name, (value, wanted) in unsupported.items():
        if value != wanted:
            raise ValueError(f"the bare reference only models {name}={wanted!r}, got {value!r}")
    if o.clip_threshold > 0 or o.clip_gradient_norm_to_value <= 0:
        raise ValueError(
            f"the bare reference needs clip_threshold <= 0 and clip_gradient_norm_to_value > 0, "
            f"got {o.clip_threshold} and {o.clip_gradient_norm_to_value}"
        )
    model = BareModel(
        num_layers=m.num_layers, model_dims=m.model_dims, num_heads=m.num_heads,
        dims_per_head=m.dims_per_head, hidden_dims=m.hidden_dims, vocab_size=m.vocab_size,
        max_seq_len=m.max_seq_len, init_std=m.init_std, norm_epsilon=m.norm_epsilon,
    )
    if m.embedding_init_std != m.init_std:
        raise ValueError(f"the bare reference uses one init std, got {m.init_std} and "
                         f"{m.embedding_init_std} for the embedding")
    opt = BareOptimizer(
        learning_rate=s.learning_rate, warmup_steps=s.warmup_steps, decay_steps=s.decay_end,
        min_ratio=s.min_ratio, beta1=o.beta1, beta2=o.beta2, epsilon=o.epsilon,
        weight_decay=o.weight_decay, clip_norm=o.clip_gradient_norm_to_value,
    )
    return model, opt


def bare_params_from_paxlite(params: PyTree, num_layers: int) -> dict[str, Any]:
    """Rename paxlite's parameter tree into the bare layout (same arrays, no copies of values)."""

    def norm(p: PyTree) -> dict[str, jax.Array]:
        return {"scale": p["scale"], "bias": p["bias"]}

    layers = []
    for i in range(num_layers):
        p = params[f"layers_{i}"]
        attn, mlp = p["attention"], p["mlp"]
        layers.append({
            "ln1": norm(p["pre_attention_norm"]),
            "qkv_w": attn["qkv"]["kernel"], "qkv_b": attn["qkv"]["bias"],
            "out_w": attn["out"]["kernel"], "out_b": attn["out"]["bias"],
            "ln2": norm(p["pre_mlp_norm"]),
            "wi": mlp["wi"]["kernel"], "bi": mlp["wi"]["bias"],
            "wo": mlp["wo"]["kernel"], "bo": mlp["wo"]["bias"],
        })
    return {
        "embedding": params["embedding"]["embedding"],
        "position": params["position_embedding"]["embedding"],
        "layers": layers,
        "final_ln": norm(params["final_norm"]),
    }


def count(tree: PyTree) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


def _require(condition: bool, message: str) -> None:
    """Like `assert`, but kept under `python -O`: a benchmark of two different models is void."""
    if not condition:
        raise AssertionError(message)


def check_same_model(
    run: Run, bare_params: PyTree, model: BareModel, batch: tuple[jax.Array, jax.Array]
) -> dict[str, float]:
    """Raise AssertionError unless both sides are the same model; returns the numbers checked."""
    pax_count, bare_count = num_params(run.config.model), count(bare_params)
    _require(pax_count == bare_count,
             f"parameter counts differ: paxlite {pax_count}, bare {bare_count}")

    state = run.restore_or_init()
    pax_loss = run.evaluate(state)["loss"]
    eval_batch = next(iter(run.data.eval_batches(1, run.steps.batch_sharding)))
    eval_inputs, eval_targets = (np.asarray(eval_batch[k]) for k in ("inputs", "targets"))
    converted = bare_params_from_paxlite(jax.device_get(state.params), model.num_layers)
    shapes = jax.tree.map(lambda a, b: a.shape == b.shape, converted, bare_params)
    _require(all(jax.tree.leaves(shapes)), f"parameter shapes differ: {shapes}")
    loss_fn = jax.jit(bare_loss, static_argnums=3)
    parity_loss = float(loss_fn(converted, eval_inputs, eval_targets, model))
    bare_init_loss = float(loss_fn(bare_params, *batch, model))
    ln_vocab = math.log(model.vocab_size)
    for name, loss in (("paxlite", pax_loss), ("bare", bare_init_loss)):
        _require(abs(loss - ln_vocab) < INITIAL_LOSS_TOLERANCE,
                 f"{name} initial loss {loss:.4f} is not near ln(vocab) = {ln_vocab:.4f}")
    _require(abs(parity_loss - pax_loss) <= PARITY_TOLERANCE * pax_loss,
             f"bare forward on paxlite's params gives {parity_loss:.6f}, paxlite {pax_loss:.6f}")
    del state
    return {"num_params": pax_count, "ln_vocab": ln_vocab, "paxlite_init_loss": pax_loss,
            "bare_init_loss": bare_init_loss, "bare_on_paxlite_params_loss": parity_loss}


def paxlite_round(run: Run, *, max_steps: int) -> float:
    """One `Run.train()`; returns its step_time_s for the window ending at the last step."""
    run.train()
    path = os.path.join(run.context.job_dir, "metrics.jsonl")
    with open(path, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    summaries = [x for x in lines if x.get("step") == max_steps and "step_time_s" in x]
    if not summaries or summaries[-1]["step_time_s"] is None:
        raise RuntimeError(f"no timed summary line for step {max_steps} in {path}")
    return float(summaries[-1]["step_time_s"])


BareStep = Callable[[PyTree, PyTree, jax.Array, jax.Array], tuple[PyTree, PyTree, jax.Array]]


def bare_round(
    step_fn: BareStep, state: list[PyTree], batches: Sequence[tuple[jax.Array, jax.Array]]
) -> float:
    """One untimed step, then len(batches) timed ones ending in block_until_ready."""
    params, opt_state, loss = step_fn(state[0], state[1], *batches[0])
    jax.block_until_ready(loss)
    start = time.perf_counter()
    for inputs, targets in batches:
        params, opt_state, loss = step_fn(params, opt_state, inputs, targets)
    jax.block_until_ready((params, opt_state, loss))
    elapsed = time.perf_counter() - start
    state[:] = [params, opt_state]
    return elapsed / len(batches)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round and side")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per side")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1:
        parser.error(f"--steps and --rounds must be >= 1, got {args.steps} and {args.rounds}")
    if jax.device_count() != 1:
        raise SystemExit(
            f"this benchmark runs on one device and JAX sees {jax.device_count()}; "
            "restrict it, e.g. CUDA_VISIBLE_DEVICES=0"
        )

    _, config = build_run_config(EXPERIMENT, paxlite_overrides(args.steps))
    model, opt = bare_specs(config)
    batch_size = int(config.loop.percore_batch_size)  # one device
    seq_len = config.data.seq_len
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(args.steps):
        tokens = rng.integers(0, model.vocab_size, size=(batch_size, seq_len + 1), dtype=np.int32)
        batches.append((jax.device_put(tokens[:, :-1]), jax.device_put(tokens[:, 1:])))
    optimizer = bare_optimizer(opt)
    bare_params = bare_init(jax.random.key(0), model)
    bare_state = [bare_params, optimizer.init(bare_params)]
    step_fn = bare_train_step(model, optimizer)

    pax_times: list[float] = []
    bare_times: list[float] = []
    with (tempfile.TemporaryDirectory() as job_dir,
          Run(config, RunContext(job_dir=job_dir, enable_checkpoint_saving=False)) as run):
        checks = check_same_model(run, bare_params, model, batches[0])
        del bare_params  # donated by the first step
        for index in range(args.rounds):
            # Alternate which side goes first so slow drift on a shared host hits both.
            order = ("paxlite", "bare") if index % 2 == 0 else ("bare", "paxlite")
            for side in order:
                if side == "paxlite":
                    pax_times.append(paxlite_round(run, max_steps=args.steps + 1))
                else:
                    bare_times.append(bare_round(step_fn, bare_state, batches))
            print(f"round {index + 1}: paxlite {1e3 * pax_times[-1]:.2f} ms/step, "
                  f"bare JAX {1e3 * bare_times[-1]:.2f} ms/step", flush=True)

    pax_ms = 1e3 * statistics.median(pax_times)
    bare_ms = 1e3 * statistics.median(bare_times)
    device = jax.devices()[0]
    result = {
        **checks,
        "steps": args.steps,
        "rounds": args.rounds,
        "global_batch": batch_size,
        "seq_len": seq_len,
        "paxlite_ms": [round(1e3 * t, 3) for t in pax_times],
        "bare_ms": [round(1e3 * t, 3) for t in bare_times],
        "paxlite_median_ms": pax_ms,
        "bare_median_ms": bare_ms,
        "ratio": pax_ms / bare_ms,
        "jax": jax.__version__,
        "device": f"{device.platform} ({device.device_kind})",
    }
    print(json.dumps(result))
    print(f"jax {jax.__version__} on {result['device']}, {platform.node() or 'host'}, "
          f"{os.cpu_count()} CPUs; {config.model.num_layers} layers, d_model "
          f"{config.model.model_dims}, batch {batch_size} x {seq_len}, {checks['num_params']:,} "
          f"params; {args.steps} steps x {args.rounds} rounds")
    print(f"paxlite {pax_ms:.2f} ms/step, bare JAX {bare_ms:.2f} ms/step, "
          f"ratio {pax_ms / bare_ms:.3f} (goal <= 1.05)")
    return result


if __name__ == "__main__":
    main()
