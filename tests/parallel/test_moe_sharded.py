"""MoE models on expert-parallel meshes compute what one device computes.

Loss and every gradient leaf of a tiny GLaM (GShard top-2: dispatch/combine einsums, the G -> E
resharding GSPMD turns into an all-to-all) and a tiny Mixtral (dropless top-2: the shard_map
exchange over the expert axis, tensor-split expert matmuls) on 8 CPU devices, against the same
parameters and batch on one device. XLA:CPU has computed wrong gradients on some meshes before
(tests/train/test_sharded_equivalence.py), so every gradient is compared, not only the loss.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from paxlite.models.activations import Activation
from paxlite.models.moe import batch_shards
from paxlite.models.moe_config import MoeConfig, MoeRouting
from paxlite.models.transformer import LLAMA_ARCHITECTURE, Transformer, TransformerConfig
from paxlite.models.transformer_config import NormKind, PositionEmbedding
from paxlite.parallel import rules as rules_lib
from paxlite.parallel.mesh import MeshConfig, build_mesh
from paxlite.train.losses import loss_fn
from paxlite.train.step import compile_steps
from tests.host_params import random_host_params

SEQ, ROWS, VOCAB = 16, 8, 128
SIZES = dict(vocab_size=VOCAB, num_layers=2, model_dims=32, num_heads=4, dims_per_head=8,
             hidden_dims=64, max_seq_len=SEQ, dropout_prob=0.0)

GLAM = TransformerConfig(
    **SIZES, norm=NormKind.RMS_NORM, use_bias=False, gated_mlp=True, activation=Activation.GELU,
    position_embedding=PositionEmbedding.RELATIVE_BIAS, relative_position_buckets=8,
    relative_position_max_distance=12, scale_query=False,
    moe=MoeConfig(num_experts=8, routing=MoeRouting.GSHARD_TOP2, capacity_factor=2.0,
                  num_groups=8, moe_layer_interval=2, load_balancing_weight=0.01),
)
# One layer: every layer is an MoE layer, so a second repeats the first and adds a third to each of
# the file's Mixtral traces and compiles (the scanned test stacks two).
MIXTRAL = TransformerConfig(
    **{**SIZES, "num_layers": 1}, **LLAMA_ARCHITECTURE, num_kv_heads=2, tie_embeddings=False,
    moe=MoeConfig(num_experts=8, experts_per_token=2, routing=MoeRouting.DROPLESS_TOPK,
                  gated_experts=True, expert_activation=Activation.SILU,
                  load_balancing_weight=0.02, router_z_loss_weight=0.001),
)
MODELS = {"glam": GLAM, "mixtral": MIXTRAL}

# (ICI, DCN): all devices on experts; data x expert; fsdp x tensor x expert; a hybrid layout (one
# process standing in for two nodes: data across them, tensor x expert within).
MESHES = [((1, 1, 1, 8), (1, 1, 1)), ((2, 1, 1, 4), (1, 1, 1)), ((1, 2, 2, 2), (1, 1, 1)),
          ((1, 1, 2, 2), (2, 1, 1))]


def _batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, size=(ROWS, SEQ + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "weights": np.ones((ROWS, SEQ), np.float32)}


def _loss_and_grads(config: TransformerConfig, mesh, params=None):
    """On `mesh`: the objective, loss, summaries, parameters and gradients at `params`, or at the
    parameters `compile_steps`'s init makes there (None). `params`: a function of the abstract
    parameters returning host arrays."""
    model = Transformer(config)
    with jax.set_mesh(mesh):
        steps = compile_steps(
            model=model,
            optimizer=optax.sgd(0.1),
            schedule=optax.constant_schedule(0.1),
            mesh=mesh,
            seq_len=SEQ,
            seed=3,
            deterministic=True,
        )
        param_shardings = steps.state_shardings.params
        if params is None:
            state_params = steps.init().params
        else:
            state_params = jax.device_put(params(steps.abstract_state.params), param_shardings)
        batch = jax.device_put(_batch(), steps.batch_sharding)

        def value_and_grad(params, batch):
            with nn.logical_axis_rules(rules_lib.DEFAULT_RULES):
                return jax.value_and_grad(functools.partial(loss_fn, model=model), has_aux=True)(
                    params, batch)

        (objective, aux), grads = jax.jit(
            value_and_grad, in_shardings=(param_shardings, steps.batch_sharding),
            out_shardings=((rules_lib.replicated(mesh), None), param_shardings),
        )(state_params, batch)
        return (float(objective), float(aux["loss"]), jax.device_get(aux["summaries"]),
                jax.device_get(state_params), jax.device_get(grads))


def _one_device():
    return build_mesh(MeshConfig(ici_mesh_shape=(1, 1, 1)), devices=jax.devices()[:1])


@functools.cache
def _reference(name: str):
    """(config, `_loss_and_grads` on one device at init's parameters) of MODELS[name]: computed
    once, for the mesh tests and the scanned GLaM's."""
    config = MODELS[name]
    return config, _loss_and_grads(config, _one_device())


@pytest.fixture(scope="module", params=sorted(MODELS))
def reference(request):
    return _reference(request.param)


def _rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


@pytest.mark.parametrize("ici,dcn", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_moe_mesh_matches_one_device(ici, dcn, reference):
    assert_mesh_matches_one_device(ici, dcn, reference)


def assert_mesh_matches_one_device(ici, dcn, reference, *, params=None):
    """On the mesh `ici` x `dcn`, `reference`'s (config, `_loss_and_grads` on one device) again:
    the same parameters (init's, when `params` is None: its mesh invariance), objective, loss,
    summaries and every gradient. `params`: as `_loss_and_grads`'s, the reference's own (host
    parameters: one compile a mesh instead of two, init's threefry sampler costing about as much
    as the step)."""
    config, (objective_ref, loss_ref, summaries_ref, params_ref, grads_ref) = reference
    mesh = build_mesh(MeshConfig(ici_mesh_shape=ici, dcn_mesh_shape=dcn))
    assert mesh.shape["expert"] == ici[3] * (dcn[3] if len(dcn) == 4 else 1)
    objective, loss, summaries, params, grads = _loss_and_grads(config, mesh, params)
    jax.tree.map(np.testing.assert_array_equal, params, params_ref)
    assert objective > loss  # the load-balancing (and router z-) losses are in the objective
    assert abs(objective - objective_ref) / abs(objective_ref) < 1e-5
    assert abs(loss - loss_ref) / abs(loss_ref) < 1e-5
    assert set(summaries) == set(summaries_ref) >= {"moe/aux_loss", "moe/dropped_fraction"}
    for key, value in summaries_ref.items():
        np.testing.assert_allclose(summaries[key], value, rtol=1e-5, err_msg=key)
    flat_ref = jax.tree_util.tree_leaves_with_path(grads_ref)
    flat = jax.tree.leaves(grads)
    assert len(flat) == len(flat_ref) > 10
    for (path, ref), got in zip(flat_ref, flat):
        assert np.abs(ref).max() > 0, (f"gradient {jax.tree_util.keystr(path)} is zero: nothing "
                                       "tested")
        assert _rel_err(got, ref) < 1e-5, (f"gradient {jax.tree_util.keystr(path)} differs on "
                                           f"{ici}x{dcn}")


@pytest.mark.parametrize("ici,shards", [((1, 1, 1, 8), 8), ((2, 1, 1, 4), 8), ((1, 2, 2, 2), 4),
                                        ((1, 1, 8), 1)])
def test_default_groups_are_the_batch_shards(ici, shards):
    """NUM_GROUPS=None: one GShard group per batch shard (data x fsdp x expert), as Pax derives
    it."""
    mesh = build_mesh(MeshConfig(ici_mesh_shape=ici))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules_lib.DEFAULT_RULES):
        seen = []
        jax.jit(lambda x: seen.append(batch_shards()) or x)(jnp.zeros(()))
    assert seen == [shards]


@pytest.mark.parametrize("routing,collectives", [
    # GShard: tokens dispatched where their group is, then one all-to-all each way (G -> E -> G)
    (MoeRouting.GSHARD_TOP2, {"all-to-all"}),
    # dropless: the tokens of an expert group gathered, the weighted outputs reduce-scattered back
    (MoeRouting.DROPLESS_TOPK, {"all-gather", "reduce-scatter"}),
])
def test_the_token_exchange_is_the_designed_collective(routing, collectives):
    """On an all-expert mesh the forward pass of one MoE layer communicates only as designed (an
    all-gather of the tokens in GShard routing would be correct but cost E x the traffic)."""
    import re

    from jax.sharding import NamedSharding, PartitionSpec

    from paxlite.models.moe import MoeMlp

    layer = MoeMlp(config=MoeConfig(num_experts=8, routing=routing), hidden_dims=64)
    mesh = build_mesh(MeshConfig(ici_mesh_shape=(1, 1, 1, 8)))
    x = jnp.ones((8, 16, 32))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules_lib.DEFAULT_RULES):
        boxed = jax.eval_shape(lambda: layer.init({"params": jax.random.key(0)}, x))
        shardings = nn.meta.unbox(
            rules_lib.logical_to_shardings(nn.get_partition_spec(boxed), mesh))["params"]
        # Lowering needs only shapes and shardings: no init compiled (threefry is slow on CPU).
        params = jax.tree.map(
            lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
            jax.eval_shape(
                lambda: nn.meta.unbox(layer.init({"params": jax.random.key(0)}, x))["params"]
            ),
            shardings,
        )
        rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp", "expert")))
        apply = jax.jit(lambda p, x: layer.apply({"params": p}, x), in_shardings=(shardings, rows))
        hlo = apply.lower(params, x).compile().as_text()
    found = set(
        re.findall(r"\b(all-to-all|all-gather|reduce-scatter|all-reduce|collective-permute)\b", hlo)
    )
    assert found == collectives, found


# scanned, rematerialised MoE steps compiled sharded (and Mixtral's on one device: ~30 s each)
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_scanned_rematerialised_moe_on_a_mesh_matches_one_device(name):
    """The scanned layer stack (GLaM: a 2-layer unit) with SAVE_NOTHING remat: the sown losses and
    summaries stacked by nn.scan, and the dropless shard_map inside scan and remat.

    GLaM's two layers are the whole of MODELS["glam"]: its one-device reference is the module's
    (`_reference`: unrolled, not rematerialised, at init's parameters, computed once for the mesh
    tests), here against the scanned stack on the mesh at the same parameters stacked, whose
    gradients are unstacked to compare. Mixtral's scanned stack has two layers where MODELS' has
    one: its reference is the scanned stack on one device, both sides at the same random
    parameters (init's mesh invariance is test_moe_mesh_matches_one_device's)."""
    import dataclasses

    from paxlite.interop.layouts import stack_layers, unstack_layers

    config = dataclasses.replace(MODELS[name], num_layers=2, scan_layers=True,
                                 remat_policy="save_nothing")
    unit = config.layers_per_scan_unit
    if name == "glam":
        assert MODELS[name].num_layers == 2
        _, (objective_ref, loss_ref, summaries_ref, params_ref, grads_ref) = _reference(name)
        stacked = stack_layers(params_ref, num_layers=2, unit=unit)

        def params(abstract):
            assert jax.tree.structure(abstract) == jax.tree.structure(stacked)
            return stacked
    else:
        params = random_host_params
        objective_ref, loss_ref, summaries_ref, _, grads_ref = _loss_and_grads(
            config, _one_device(), params=params)
    objective, loss, summaries, _, grads = _loss_and_grads(
        config, build_mesh(MeshConfig(ici_mesh_shape=(1, 2, 1, 4))), params=params)
    if name == "glam":
        grads = unstack_layers(grads, num_layers=2, unit=unit)
    assert abs(objective - objective_ref) / abs(objective_ref) < 1e-5
    assert abs(loss - loss_ref) / abs(loss_ref) < 1e-5
    assert set(summaries) == set(summaries_ref)
    for key, value in summaries_ref.items():
        np.testing.assert_allclose(summaries[key], value, rtol=1e-5, err_msg=key)
    flat_ref = jax.tree_util.tree_leaves_with_path(grads_ref)
    assert jax.tree.structure(grads) == jax.tree.structure(grads_ref)
    for (path, ref), got in zip(flat_ref, jax.tree.leaves(grads)):
        assert _rel_err(got, ref) < 1e-5, f"gradient {jax.tree_util.keystr(path)} differs"
