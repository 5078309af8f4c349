"""LLaMA-2 experiments: Pax's values, exact published parameter counts, FLOPs, `show`, and a tiny
LLaMA-shaped model whose loss and gradients on sharded meshes equal one device."""

import functools
import json
import os
import subprocess

import fiddle as fdl
import flax.linen as nn
import jax
import numpy as np
import pytest

from paxlite.config.errors import ConfigError
from paxlite.data.synthetic import SyntheticData
from paxlite.experiments import EXPERIMENTS
from paxlite.experiments.build import load_experiment
from paxlite.models.transformer import PositionEmbedding, Transformer
from paxlite.parallel import rules as rules_lib
from paxlite.parallel.mesh import MeshConfig, build_mesh
from paxlite.train.losses import loss_fn
from tests.experiments.traced import traced_num_params, traced_variables
from tests.fork_server import paxlite_python

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# name: (D, F, L, H, KV, parameter count), as docs/migrating_from_pax.md's LLaMA table has them
SIZES = {
    "LLaMA7B": (4096, 11008, 32, 32, 32, 6_738_415_616),
    "LLaMA13B": (5120, 13824, 40, 40, 40, 13_015_864_320),
    "LLaMA70B": (8192, 28672, 80, 64, 8, 68_976_648_192),
}


def _formula(
    d: int, f: int, layers: int, heads: int, kv: int, *, v: int = 32000, h: int = 128
) -> int:
    return 2 * v * d + layers * (2 * d * heads * h + 2 * d * kv * h + 3 * d * f + 2 * d) + d


@pytest.mark.parametrize("name", sorted(SIZES))
def test_exact_parameter_counts(name: str) -> None:
    d, f, layers, heads, kv, published = SIZES[name]
    assert _formula(d, f, layers, heads, kv) == published
    model = fdl.build(EXPERIMENTS[name].resolve({}).model_config())  # abstract: nothing allocated
    assert traced_num_params(model) == published


def test_pax_llama_hyperparameters() -> None:
    """Pax's LLaMA settings (docs/migrating_from_pax.md), written out by hand."""
    table = {"LLaMA7B": (32, 32, 4096, 11008, 32, 16, [1, 8, 1], [1, 1, 1]),
             "LLaMA13B": (40, 40, 5120, 13824, 40, 8, [1, 8, 1], [1, 1, 1]),
             "LLaMA70B": (80, 64, 8192, 28672, 8, 4, [1, 8, 1], [1, 2, 1])}
    for name, want in table.items():
        e = EXPERIMENTS[name].resolve({})
        assert (e.NUM_LAYERS, e.NUM_HEADS, e.MODEL_DIMS, e.HIDDEN_DIMS, e.NUM_KV_HEADS,
                e.PERCORE_BATCH_SIZE, e.ICI_MESH_SHAPE, e.DCN_MESH_SHAPE) == want, name
        assert (e.DIMS_PER_HEAD, e.VOCAB_SIZE, e.MAX_SEQ_LEN, e.LAYERNORM_EPSILON) == (
            128,
            32000,
            4096,
            1e-5,
        )
        assert (e.FPROP_DTYPE, e.MAX_STEPS, e.USE_REPEATED_LAYER, e.PACKED_INPUT) == (
            "bfloat16",
            0,
            False,
            False,
        )
        model = fdl.build(e.model_config())
        assert (model.norm.value, model.activation.value, model.gated_mlp, model.use_bias,
                model.tie_embeddings, model.position_kind, model.rope_theta) == (
            "rms_norm", "silu", True, False, False, PositionEmbedding.ROTARY, 10000.0)
        assert (model.param_dtype, model.dtype) == ("float32", "bfloat16")


def test_70b_layout_and_logical_axes() -> None:
    variables = traced_variables(fdl.build(EXPERIMENTS["LLaMA70B"].resolve({}).model_config()))
    params, specs = nn.meta.unbox(variables)["params"], nn.get_partition_spec(variables)["params"]
    attention = params["layers_0"]["attention"]
    assert {k: v["kernel"].shape for k, v in attention.items()} == {
        "query": (8192, 64, 128),
        "key": (8192, 8, 128),
        "value": (8192, 8, 128),
        "out": (64, 128, 8192),
    }
    assert tuple(specs["layers_0"]["attention"]["key"]["kernel"]) == ("embed", "kv_heads", "kv")
    assert params["output"]["kernel"].shape == (8192, 32000)
    assert tuple(specs["output"]["kernel"]) == ("embed", "vocab")
    assert tuple(specs["embedding"]["embedding"]) == ("vocab", "embed")


@pytest.mark.parametrize("name", sorted(SIZES))
def test_flops_per_token_is_maxtext_formula_with_gqa_and_gated_mlp(name: str) -> None:
    d, f, layers, heads, kv, _ = SIZES[name]
    h, v, s = 128, 32000, 4096
    matmul_params = layers * (d * heads * h + 2 * d * kv * h + heads * h * d + 3 * d * f) + d * v
    # causal attention: half of 12 * L * S * H * h
    want = 6 * matmul_params + 6 * layers * s * heads * h
    assert EXPERIMENTS[name].resolve({}).flops_per_token() == want


def test_show_reports_the_exact_count() -> None:
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [paxlite_python(), "-m", "paxlite", "show", "--fdl_config=LLaMA70B", "--format=json"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=120, check=True,
    ).stdout
    info = json.loads(out)
    assert info["num_params"] == 68_976_648_192
    assert info["hparams"]["NUM_KV_HEADS"] == 8
    assert info["flops_per_token"] == EXPERIMENTS["LLaMA70B"].resolve({}).flops_per_token()


def test_bad_kv_heads_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="NUM_KV_HEADS=5 must be a positive divisor of "
                                          "NUM_HEADS=32"):
        load_experiment("LLaMA7B", ["NUM_KV_HEADS=5"])


def test_text_experiment_runs_on_synthetic_tokens() -> None:
    run = fdl.build(
        load_experiment("LLaMA7B", ["SYNTHETIC_DATA=true", "MAX_STEPS=10"]).run_config()
    )
    assert (run.data.vocab_size, run.data.seq_len, run.loop.max_steps) == (32000, 4096, 10)


# --------------------------------------------------------------- sharded equivalence on a tiny
# LLaMA
TINY = [
    "SYNTHETIC_DATA=true",
    "NUM_LAYERS=2",
    "NUM_HEADS=4",
    "NUM_KV_HEADS=2",
    "DIMS_PER_HEAD=8",
    "MODEL_DIMS=32",
    "HIDDEN_DIMS=64",
    "VOCAB_SIZE=128",
    "MAX_SEQ_LEN=16",
    "FPROP_DTYPE=float32",
    "ICI_MESH_SHAPE=None",
    "DCN_MESH_SHAPE=[1,1,1]",
    "PERCORE_BATCH_SIZE=1",
    "MAX_STEPS=2",
]
GLOBAL_BATCH = 8


def _loss_and_grads(run, mesh):
    """Loss and gradients of the train step's loss_fn at fixed random parameters, with parameters
    and batch sharded by the rules table (mirrors tests/train/test_sharded_equivalence.py, which
    also covers the optimizer update). Parameters come from NumPy rather than the model's init,
    whose random sampler is slow to compile on CPU."""
    model = Transformer(run.model)
    abstract = traced_variables(run.model)["params"]
    rng = np.random.default_rng(0)
    host_params = jax.tree_util.tree_map_with_path(
        lambda path, leaf: (1.0 + 0.1 * rng.normal(size=leaf.shape) if path[-1].key == "scale"
                            else 0.1 * rng.normal(size=leaf.shape)).astype(np.float32),
        nn.meta.unbox(abstract))
    shardings = rules_lib.logical_to_shardings(nn.get_partition_spec(abstract), mesh)
    data = SyntheticData(run.data, global_batch_size=GLOBAL_BATCH)
    with jax.set_mesh(mesh):
        params = jax.device_put(host_params, shardings)
        batch = data.train_batch(0, rules_lib.batch_sharding(mesh))

        def value_and_grad(params, batch):
            with nn.logical_axis_rules(rules_lib.DEFAULT_RULES):
                return jax.value_and_grad(functools.partial(loss_fn, model=model), has_aux=True)(
                    params, batch
                )

        (loss, _), grads = jax.jit(
            value_and_grad, out_shardings=((rules_lib.replicated(mesh), None), shardings),
        )(params, batch)
        if mesh.size > 1:  # the equality must not come from everything being replicated
            assert any(not leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(params))
        return float(loss), jax.device_get(grads)


@pytest.fixture(scope="module")
def tiny_reference():
    run = fdl.build(load_experiment("LLaMA7B", TINY).run_config())
    assert (run.model.kv_heads, run.model.position_kind) == (2, PositionEmbedding.ROTARY)
    one = build_mesh(MeshConfig(ici_mesh_shape=(1, 1, 1)), devices=jax.devices()[:1])
    return run, _loss_and_grads(run, one)


@pytest.mark.parametrize("ici", [(2, 2, 2), (1, 4, 2)], ids=lambda s: "x".join(map(str, s)))
def test_tiny_llama_mesh_matches_one_device(ici, tiny_reference) -> None:
    run, (loss_ref, grads_ref) = tiny_reference
    loss, grads = _loss_and_grads(run, build_mesh(MeshConfig(ici_mesh_shape=ici)))
    assert abs(loss - loss_ref) / abs(loss_ref) < 1e-5
    flat_ref = jax.tree_util.tree_leaves_with_path(grads_ref)
    flat = jax.tree.leaves(grads)
    assert len(flat) == len(flat_ref) > 10
    for (path, ref), got in zip(flat_ref, flat):
        ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
        err = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
        assert err < 1e-5, f"gradient {jax.tree_util.keystr(path)} differs on {ici}"
