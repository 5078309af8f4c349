"""The dropless experts' grouped matmul: which kernel runs, and that the rows past the groups are
never read.

``jax.lax.ragged_dot`` documents nothing about the rows past ``sum(group_sizes)``: its CPU lowering
leaves zeros there, a GPU kernel may leave anything. With an expert axis every shard has such rows
(the assignments of other shards' experts sort last), so the layer must mask them itself. The test
kernel below writes NaN into them, forward and backward; the layer's output and every gradient
must stay finite and equal to what the real kernel gives, on one device and on meshes with an
expert axis (and a tensor axis, whose psum would spread a NaN to every row).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from paxlite.models.activations import Activation
from paxlite.models.linear import grouped_matmul, ragged_dot
from paxlite.models.moe import GROUPED_MATMUL_KERNELS, MoeMlp, grouped_matmul_kernel
from paxlite.models.moe_config import GroupedMatmul, MoeConfig, MoeRouting
from paxlite.models.tiled_grouped_matmul import MAX_TILE_ROWS, tile_rows, tiled_grouped_matmul
from paxlite.parallel import rules as rules_lib
from paxlite.parallel.mesh import MeshConfig, build_mesh

D, F, E = 16, 24, 8
CONFIG = MoeConfig(num_experts=E, experts_per_token=2, routing=MoeRouting.DROPLESS_TOPK,
                   gated_experts=True, expert_activation=Activation.SILU)


def _past_groups(rows: int, group_sizes: jax.Array) -> jax.Array:
    return (jnp.arange(rows) >= jnp.sum(group_sizes))[:, None]  # [M, 1]


@jax.custom_vjp
def nan_past_groups(x, kernel, group_sizes):
    """ragged_dot, with NaN in every row past the groups: the worst a kernel may leave there."""
    return jnp.where(_past_groups(x.shape[0], group_sizes), jnp.nan,
                     ragged_dot(x, kernel, group_sizes))


def _nan_fwd(x, kernel, group_sizes):
    return nan_past_groups(x, kernel, group_sizes), (x, kernel, group_sizes)


def _nan_bwd(res, g):
    x, kernel, group_sizes = res
    _, vjp = jax.vjp(lambda x_, k_: ragged_dot(x_, k_, group_sizes), x, kernel)
    dx, dkernel = vjp(g)
    # the dgrad's rows past the groups are unspecified too
    return jnp.where(_past_groups(x.shape[0], group_sizes), jnp.nan, dx), dkernel, None


nan_past_groups.defvjp(_nan_fwd, _nan_bwd)


def test_the_nan_kernel_really_writes_nan():
    """The check below is not vacuous: without grouped_matmul's masks the NaN reaches the caller."""
    x = jnp.ones((6, 3))
    kernel = jnp.ones((2, 3, 4))
    sizes = jnp.asarray([2, 1], jnp.int32)
    raw = np.asarray(nan_past_groups(x, kernel, sizes))
    assert np.isfinite(raw[:3]).all() and np.isnan(raw[3:]).all()
    dx = jax.grad(lambda v: jnp.sum(jnp.nan_to_num(nan_past_groups(v, kernel, sizes))))(x)
    assert np.isnan(np.asarray(dx)[3:]).all()
    masked = np.asarray(grouped_matmul(x, kernel, sizes, kernel_fn=nan_past_groups))
    np.testing.assert_array_equal(masked, np.concatenate([np.full((3, 4), 3.0), np.zeros((3, 4))]))
    dx = jax.grad(lambda v: jnp.sum(grouped_matmul(v, kernel, sizes, kernel_fn=nan_past_groups)))(x)
    np.testing.assert_array_equal(np.asarray(dx), np.concatenate([np.full((3, 3), 4.0),
                                                                  np.zeros((3, 3))]))


def test_every_grouped_matmul_value_has_its_kernel():
    """MOE_GROUPED_MATMUL is read: each value names a kernel (a new value without one is refused,
    not silently run as ragged_dot), and the layer runs exactly the kernel its config names."""
    assert set(GROUPED_MATMUL_KERNELS) == set(GroupedMatmul)
    assert grouped_matmul_kernel("ragged_dot") is ragged_dot
    assert grouped_matmul_kernel("tiled") is tiled_grouped_matmul
    calls = []

    def counting(x, kernel, group_sizes):
        calls.append(x.shape)
        return ragged_dot(x, kernel, group_sizes)

    x = jax.random.normal(jax.random.key(0), (2, 4, D))
    layer = MoeMlp(config=CONFIG, hidden_dims=F)
    # jitted: the routing op by op costs more CPU time than compiling it
    params = jax.jit(layer.init)({"params": jax.random.key(1)}, x)
    want = jax.jit(layer.apply)(params, x)
    got = jax.jit(MoeMlp(config=CONFIG, hidden_dims=F, grouped_matmul_fn=counting).apply)(
        params, x)
    assert len(calls) == 3  # wi, wi_gate, wo
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _value_and_grads(layer, params, x, w, mesh=None):
    def loss(params, x):
        return jnp.sum(layer.apply({"params": params}, x) * w)

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    if mesh is None:
        return jax.device_get(fn(params, x))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules_lib.DEFAULT_RULES):
        return jax.device_get(fn(params, x))


@pytest.fixture(scope="module")
def one_device():
    x = jax.random.normal(jax.random.key(0), (8, 8, D), jnp.float32)
    w = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
    layer = MoeMlp(config=CONFIG, hidden_dims=F, init_std=0.3)
    params = nn.meta.unbox(jax.jit(layer.init)({"params": jax.random.key(1)}, x)["params"])
    return x, w, params, _value_and_grads(layer, params, x, w)


def _assert_same(got, want, *, rtol):
    for (path, ref), value in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
        name = jax.tree_util.keystr(path)
        assert np.isfinite(value).all(), f"{name} is not finite"
        assert np.abs(ref).max() > 0, f"{name} is zero: nothing compared"
        np.testing.assert_allclose(
            value, ref, rtol=rtol, atol=rtol * np.abs(ref).max(), err_msg=name
        )


def test_one_device_ignores_the_rows_past_the_groups(one_device):
    x, w, params, want = one_device
    layer = MoeMlp(config=CONFIG, hidden_dims=F, init_std=0.3, grouped_matmul_fn=nan_past_groups)
    _assert_same(_value_and_grads(layer, params, x, w), want, rtol=0)


# expert axis alone (7 of 8 experts' rows are past the groups on each shard); with fsdp and tensor
# (the tensor psum would spread a NaN row to every shard's result)
@pytest.mark.parametrize("ici", [(1, 1, 1, 8), (1, 2, 2, 2)], ids=lambda s: "x".join(map(str, s)))
def test_expert_axis_ignores_the_rows_past_the_groups(ici, one_device):
    x, w, params, want = one_device
    mesh = build_mesh(MeshConfig(ici_mesh_shape=ici))
    make = functools.partial(MoeMlp, config=CONFIG, hidden_dims=F, init_std=0.3)
    real = _value_and_grads(make(), params, x, w, mesh)
    nan = _value_and_grads(make(grouped_matmul_fn=nan_past_groups), params, x, w, mesh)
    _assert_same(nan, real, rtol=0)  # the same program but for what sits in the masked rows
    _assert_same(nan, want, rtol=1e-5)  # and what one device computes


def test_tile_heights():
    assert tile_rows(64, 4) == 16 and tile_rows(100, 8) == 8 and tile_rows(3, 8) == 1
    assert tile_rows(262_144, 32) == MAX_TILE_ROWS == 2048  # Qwen3-30B-A3B's exchanged rows


# empty groups, one group with every row, groups ending before the last row (an expert shard's
# rows past the groups), group sizes that are not multiples of the tile
@pytest.mark.parametrize("sizes", [[10, 0, 30, 20], [64, 0, 0, 0], [0, 0, 0, 0], [1, 2, 3, 58],
                                   [17, 17, 17, 13]])
def test_the_tiled_kernel_equals_ragged_dot(sizes):
    """Forward equal, bit for bit, in the rows inside the groups; gradients equal to float32
    rounding (the weight gradient sums each group's rows in another order)."""
    x = jax.random.normal(jax.random.key(0), (64, 16), jnp.float32)
    kernel = jax.random.normal(jax.random.key(1), (4, 16, 8), jnp.float32)
    w = jax.random.normal(jax.random.key(2), (64, 8), jnp.float32)
    group_sizes = jnp.asarray(sizes, jnp.int32)

    @functools.partial(jax.jit, static_argnums=0)
    def value_and_grads(kernel_fn, x, kernel):
        def loss(x, kernel):
            out = grouped_matmul(x, kernel, group_sizes, kernel_fn=kernel_fn)
            return jnp.sum(out * w), out
        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, kernel)

    (_, want), want_grads = value_and_grads(ragged_dot, x, kernel)
    (_, got), got_grads = value_and_grads(tiled_grouped_matmul, x, kernel)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for g, r in zip(got_grads, want_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("ici", [None, (1, 2, 2, 2)], ids=["one-device", "fsdp2xtensor2xexpert2"])
def test_the_tiled_kernel_in_the_layer_equals_ragged_dot_on_one_device(ici, one_device):
    x, w, params, want = one_device
    config = dataclasses.replace(CONFIG, grouped_matmul=GroupedMatmul.TILED)
    mesh = None if ici is None else build_mesh(MeshConfig(ici_mesh_shape=ici))
    got = _value_and_grads(MoeMlp(config=config, hidden_dims=F, init_std=0.3), params, x, w, mesh)
    _assert_same(got, want, rtol=1e-5)
