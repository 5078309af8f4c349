"""Chunked loss (LOSS_CHUNK_SIZE): the same loss, accuracy, z-loss and gradients as the unchunked
step, without the float32 [B, T, V] logits in memory.

The reference is today's path (loss_chunk_size=None): the model's full logits, then
`per_example_scores` and `z_loss_sum`. A chunk of 3 positions does not divide the 8 of a row, so
the padded last block is exercised, and rows carry different numbers of weighted tokens (two none).
"""

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

from paxlite.config.errors import ConfigError
from paxlite.errors import SettingError
from paxlite.experiments.build import build_run_config, load_experiment
from paxlite.models.moe_config import MoeConfig, MoeRouting
from paxlite.models.transformer import (
    LLAMA_ARCHITECTURE,
    Transformer,
    TransformerConfig,
    abstract_variables,
)
from paxlite.parallel.mesh import MeshConfig, build_mesh
from paxlite.train.loop import Run, RunContext
from paxlite.train.step import TrainState, compile_steps, eval_step

SEQ, ROWS, CHUNK = 8, 8, 3
GPT = TransformerConfig(vocab_size=64, num_layers=2, model_dims=16, num_heads=2, dims_per_head=8,
                        hidden_dims=32, max_seq_len=SEQ)  # tied embeddings, biases, LayerNorm
LLAMA = dataclasses.replace(GPT, **LLAMA_ARCHITECTURE, tie_embeddings=False, num_kv_heads=1)
# MoE: the sown load-balancing loss and summaries pass through the chunked step too.
MOE = dataclasses.replace(GPT, moe=MoeConfig(num_experts=4, routing=MoeRouting.DROPLESS_TOPK,
                                             moe_layer_interval=2, load_balancing_weight=0.01))
CONFIGS = {"tied_gpt": GPT, "untied_llama": LLAMA, "moe_gpt": MOE}
Z_LOSS = 0.1


@functools.cache
def _batch_cached(name: str) -> dict[str, np.ndarray]:  # name: a key of CONFIGS
    """Random tokens; every other target is the model's own greedy guess, so accuracy is neither
    0 nor 1 and the accuracy comparison means something."""
    config = CONFIGS[name]
    rng = np.random.default_rng(0)
    lengths = (3 * np.arange(ROWS)) % SEQ + 1
    lengths[[1, ROWS - 2]] = 0
    inputs = rng.integers(0, config.vocab_size, (ROWS, SEQ), dtype=np.int32)
    targets = rng.integers(0, config.vocab_size, (ROWS, SEQ), dtype=np.int32)
    logits = jax.jit(Transformer(config).apply)({"params": _params0(name)}, inputs)
    targets[:, ::2] = np.asarray(jnp.argmax(logits, axis=-1))[:, ::2]
    weights = (np.arange(SEQ)[None, :] < lengths[:, None]).astype(np.float32)
    return {"inputs": inputs, "targets": targets, "weights": weights}


def _batch(name: str) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in _batch_cached(name).items()}


@functools.cache
def _params0(name: str):
    """Random float32 params large enough that the logits are far from uniform."""
    rng = np.random.default_rng(7)

    def leaf(path, shape):
        noise = rng.normal(size=shape.shape)
        return (1.0 + 0.1 * noise if path[-1].key == "scale" else 0.3 * noise).astype(np.float32)

    return jax.tree_util.tree_map_with_path(
        leaf, nn.meta.unbox(abstract_variables(CONFIGS[name]))["params"])


def _mesh():
    return build_mesh(MeshConfig(ici_mesh_shape=(1, 1, 1)), devices=jax.devices()[:1])


def _one_step(name: str, *, loss_chunk_size):
    """(initial params, params after one SGD step with LR 1, metrics): update = -gradient."""
    schedule = optax.constant_schedule(1.0)
    optimizer = optax.sgd(schedule)
    mesh = _mesh()
    with jax.set_mesh(mesh):
        steps = compile_steps(model=Transformer(CONFIGS[name]), optimizer=optimizer,
                              schedule=schedule,
                              mesh=mesh, seq_len=SEQ, seed=3, deterministic=True,
                              grad_accum_steps=2, z_loss_weight=Z_LOSS,
                              loss_chunk_size=loss_chunk_size)
        params0 = _params0(name)
        state = TrainState(step=jnp.zeros((), jnp.int32), params=params0,
                           opt_state=optimizer.init(params0))
        state, metrics = steps.train(jax.device_put(state, steps.state_shardings),
                                     _batch(name))
        return params0, jax.device_get(state.params), jax.device_get(metrics)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def both_steps(request):
    return (_one_step(request.param, loss_chunk_size=None),
            _one_step(request.param, loss_chunk_size=CHUNK))


def test_metrics_equal_unchunked(both_steps):
    (_, _, ref), (_, _, got) = both_steps
    assert sorted(got) == sorted(ref)
    assert {"loss", "accuracy", "moe/z_loss", "grad_norm"} <= set(ref)
    for name in ref:
        assert abs(got[name] - ref[name]) <= 1e-6 * abs(ref[name]), (name, got[name], ref[name])
    assert ref["loss"] > 1.0 and 0.0 < ref["moe/z_loss"] and 0.2 < ref["accuracy"] < 0.8


def test_every_gradient_leaf_equals_unchunked(both_steps):
    (params0, ref, _), (_, got, _) = both_steps
    grads_ref = jax.tree.map(lambda p, q: np.asarray(p, np.float64) - q, params0, ref)
    grads_got = jax.tree.map(lambda p, q: np.asarray(p, np.float64) - q, params0, got)
    flat_ref = jax.tree_util.tree_leaves_with_path(grads_ref)
    flat_got = jax.tree.leaves(grads_got)
    assert len(flat_got) == len(flat_ref) >= 15
    total = np.sqrt(sum(np.sum(g ** 2) for _, g in flat_ref))
    for (path, r), g in zip(flat_ref, flat_got):
        name = jax.tree_util.keystr(path)
        # Relative to the leaf; a leaf whose exact gradient is zero (GPT's key bias) is judged
        # against the whole gradient instead. 1e-5: the updates are read back as differences of
        # float32 parameters, and a norm scale near 1.0 resolves its ~0.03 update only to ~6e-8 per
        # element (~2e-6 of it; jax 0.12 measured 1.35e-6); a wrong chunk is off by far more.
        assert np.linalg.norm(g - r) <= 1e-5 * max(np.linalg.norm(r), 1e-3 * total), name


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_eval_scores_equal_unchunked(name):
    batch = _batch(name)
    batch["yn_tokens"] = np.tile(np.array([[5, 9]], np.int32), (ROWS, 1))
    batch["targets"][:, ::2] = 5  # some positions hold an answer token, so choices are scored
    params = _params0(name)
    model = Transformer(CONFIGS[name])
    ref = jax.jit(functools.partial(eval_step, model=model))(params, batch)
    got = jax.jit(functools.partial(eval_step, model=model, loss_chunk_size=CHUNK))(params, batch)
    assert sorted(got) == sorted(ref) == ["choice_correct", "correct_tokens", "loss_sum",
                                          "target_tokens"]
    for key in ref:
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-6, atol=1e-6, err_msg=key)


def test_chunking_saves_the_logits_memory():
    """A 32k vocabulary at T=512, B=4: the unchunked step's float32 logits alone are 256 MiB; with
    blocks of 64 positions the step's temporaries shrink by at least that minus one block."""
    batch_rows, seq, vocab, chunk = 4, 512, 32768, 64
    config = TransformerConfig(vocab_size=vocab, num_layers=1, model_dims=16, num_heads=2,
                               dims_per_head=8, hidden_dims=32, max_seq_len=seq)
    mesh = _mesh()

    def temp_bytes(loss_chunk_size):
        schedule = optax.constant_schedule(1.0)
        with jax.set_mesh(mesh):
            steps = compile_steps(model=Transformer(config), optimizer=optax.sgd(schedule),
                                  schedule=schedule, mesh=mesh, seq_len=seq, seed=0,
                                  deterministic=True, loss_chunk_size=loss_chunk_size)
            batch = {k: jax.ShapeDtypeStruct((batch_rows, seq), dtype,
                                             sharding=steps.batch_sharding)
                     for k, dtype in (("inputs", jnp.int32), ("targets", jnp.int32),
                                      ("weights", jnp.float32))}
            compiled = steps.train.lower(steps.abstract_state, batch).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    logits_bytes = batch_rows * seq * vocab * 4
    block_bytes = batch_rows * chunk * vocab * 4
    full, chunked = temp_bytes(None), temp_bytes(chunk)
    assert full >= logits_bytes  # the reference really holds the logits
    assert full - chunked >= logits_bytes - block_bytes, (full, chunked)


def _first_loss(tmp_path, *overrides) -> tuple[float, bool]:
    """(first logged loss, whether the compiled train step has a loop)."""
    # one layer: the loss blocks are after the stack, and each run compiles a third less
    overrides = ("NUM_LAYERS=1", "MAX_STEPS=1", "SUMMARY_INTERVAL_STEPS=1",
                 "EVAL_INTERVAL_STEPS=1000", "EVAL_LOOP_NUM_BATCHES=1",
                 "CHECKPOINT_EVERY_N_STEPS=1000", *overrides)
    _, config = build_run_config("TinySynthetic", list(overrides))
    with Run(config, RunContext(job_dir=str(tmp_path), enable_checkpoint_saving=False)) as run:
        run.train()
        with jax.set_mesh(run.mesh):
            batch = run.data.train_batch(0, run.steps.batch_sharding)
            text = run.steps.train.lower(run.steps.abstract_state, batch).as_text()
    with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
        loss = next(line["loss"] for line in map(json.loads, f) if "loss" in line)
    return loss, "while" in text


def test_the_run_trains_with_a_chunked_loss(tmp_path):
    """LOSS_CHUNK_SIZE reaches the compiled steps of a real run (TinySynthetic: T = 64, layers
    unrolled, no accumulation, so the only loop in its step is the scan over loss blocks)."""
    ref, ref_loops = _first_loss(tmp_path / "ref")
    got, got_loops = _first_loss(tmp_path / "chunked", "LOSS_CHUNK_SIZE=24")
    assert got_loops and not ref_loops
    assert abs(got - ref) <= 1e-6 * abs(ref), (got, ref)


def test_hyperparameter_reaches_the_loop_and_bad_values_are_refused():
    _, config = build_run_config("TinySynthetic", ["LOSS_CHUNK_SIZE=16"])
    assert config.loop.loss_chunk_size == 16
    assert build_run_config("TinySynthetic", [])[1].loop.loss_chunk_size is None
    with pytest.raises(ConfigError, match="LOSS_CHUNK_SIZE must be None .* got 0"):
        load_experiment("TinySynthetic", ["LOSS_CHUNK_SIZE=0"])
    with pytest.raises(SettingError, match=r"LOSS_CHUNK_SIZE must be None .*got 0"):
        compile_steps(model=Transformer(GPT), optimizer=optax.sgd(1.0),
                      schedule=optax.constant_schedule(1.0), mesh=_mesh(), seq_len=SEQ, seed=0,
                      deterministic=True, loss_chunk_size=0)


def test_the_planner_compiles_the_chunked_step():
    """`python -m paxlite plan ... --fdl.LOSS_CHUNK_SIZE=c` plans the step that would run: with a
    vocabulary of 16384 the float32 logits (16 MiB per row of 256) leave the peak."""
    from paxlite.planner import plan as plan_lib

    def peak(*overrides):
        experiment = load_experiment("TinySynthetic", (
            "NUM_LAYERS=1", "MAX_SEQ_LEN=256", "VOCAB_SIZE=16384", "PERCORE_BATCH_SIZE=1",
            "ICI_MESH_SHAPE=[1,1,1]", *overrides))
        plan = plan_lib.plan_experiment(experiment, num_devices=1, device_memory_gib=1000.0)
        return plan.memory_per_device.peak_bytes

    logits_bytes = 256 * 16384 * 4
    assert peak() - peak("LOSS_CHUNK_SIZE=32") >= logits_bytes // 2
