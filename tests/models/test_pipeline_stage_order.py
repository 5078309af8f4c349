"""The circular schedule's weights reach their stages without a whole copy of the stack, and the
schedule keeps no activation-sized mask per iteration (models/pipeline.py).

With R repeats stage s runs layers (r*S + s)*K + k, while the stack is split over the `pipeline`
axis in contiguous blocks. Unless S divides R or R divides S, XLA's partitioner cannot turn one
layout into the other by reshaping and replicated the whole stack on every device (GPT175B on
pipeline 8, R = 12: 762 GiB of temporaries per device, against 80 at R = 1). The pipeline now moves
each chunk of K layers to its stage by collective-permutes. Checked here: the move's rounds against
the definition, exactness of such schedules on a mesh (values and gradients against the plain
layer loop, NaN in the bubbles), the compiled temporaries against R = 1, and the residuals.
"""

import contextlib
import functools
import io
import re

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from paxlite.models.pipeline import _stage_order_rounds, pipeline_apply
from tests.models.test_pipeline import assert_close, layer, make, sequential, value_and_grads


@pytest.mark.parametrize("stages,repeats,devices", [
    (4, 3, 4), (8, 12, 8), (4, 6, 4), (8, 3, 8), (8, 2, 4), (16, 3, 4), (2, 5, 2), (4, 1, 4)])
def test_rounds_deliver_each_stage_its_layers(stages: int, repeats: int, devices: int) -> None:
    """Play the rounds on lists: device p starts with chunks p*per .. (p+1)*per - 1 (contiguous)
    and must end with stage s's chunks r*S + s, stages in order, repeats in order within each."""
    rounds = _stage_order_rounds(stages, repeats, devices)
    per = stages // devices * repeats
    assert len(rounds) == per
    held = [[None] * per for _ in range(devices)]
    for src, pairs, dst in rounds:
        assert sorted(p for p, _ in pairs) == sorted(d for _, d in pairs) == list(range(devices))
        for p, d in pairs:
            assert held[d][dst[d]] is None  # every slot written once
            held[d][dst[d]] = p * per + src[p]
    q = stages // devices
    for d in range(devices):
        assert held[d] == [
            r * stages + s for s in range(d * q, (d + 1) * q) for r in range(repeats)
        ]


MESH_CASES = [  # (stages, repeats, microbatches, layers per stage, pipeline devices)
    (4, 3, 8, 2, 4),  # neither 4 | 3 nor 3 | 4; chunks of 2 layers
    (8, 3, 8, 1, 4),  # two stages per device
]


@functools.cache
def _sequential_reference(num_layers: int, microbatches: int):
    """Inputs and the layer loop's values and gradients, once per size: the cases above share
    theirs (24 layers, 8 microbatches), and the unrolled loop is the costliest program to trace."""
    params, x, ct = make(num_layers, microbatches)
    return params, x, ct, value_and_grads(sequential, params, x, ct)


@pytest.mark.parametrize("case", MESH_CASES, ids=[f"S{s}-R{r}-M{m}-K{k}-P{p}"
                                                  for s, r, m, k, p in MESH_CASES])
def test_circular_schedules_on_a_mesh_equal_the_layer_loop(case) -> None:
    """The stack split over `pipeline` as the rules split it ("layers"), x 2 fsdp on the weights'
    input dimension; NaN in the bubbles; values and gradients as the sequential loop."""
    s, r, m, k, devices = case
    params, x, ct, want = _sequential_reference(s * r * k, m)
    mesh = jax.make_mesh((devices, 8 // devices), ("pipeline", "fsdp"),
                         axis_types=(AxisType.Auto,) * 2)
    split = {
        "w": NamedSharding(mesh, P("pipeline", "fsdp")),
        "b": NamedSharding(mesh, P("pipeline")),
    }
    with jax.set_mesh(mesh):
        got = value_and_grads(
            lambda p, xs: pipeline_apply(layer, p, xs, num_stages=s, repeats=r,
                                         bubble_fill=jnp.nan),
            jax.device_put(params, split), x, ct)
    assert_close(got, want)


def _temp_bytes(repeats: int, *, width: int = 256, layers: int = 24) -> int:
    """Compiled temporaries of one device for the gradient of a pipelined stack of `layers`
    [width, width] layers on pipeline 8 (8 stages, 8 microbatches of 8 rows)."""
    mesh = jax.make_mesh((8,), ("pipeline",), axis_types=(AxisType.Auto,))
    split = NamedSharding(mesh, P("pipeline"))
    params = {"w": jax.ShapeDtypeStruct((layers, width, width), jnp.float32, sharding=split),
              "b": jax.ShapeDtypeStruct((layers, width), jnp.float32, sharding=split)}
    x = jax.ShapeDtypeStruct((8, 8, width), jnp.float32, sharding=NamedSharding(mesh, P()))

    def loss(p, xs):
        return jnp.sum(pipeline_apply(layer, p, xs, num_stages=8, repeats=repeats, remat=True) ** 2)

    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss)).lower(params, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_circular_schedule_needs_no_copy_of_the_whole_stack() -> None:
    """R = 3 on 8 stages (contiguous blocks of 3 layers, stages needing every 8th): before, the
    partitioner replicated the whole 6 MiB stack (temporaries 6.02 MiB against 2.29 at R = 1);
    now each device moves its own 0.75 MiB (2.08 MiB)."""
    stack = 24 * 256 * 256 * 4
    gpipe, circular = _temp_bytes(1), _temp_bytes(3)
    assert circular < stack / 2, (circular, stack)
    assert circular <= 1.5 * gpipe, (circular, gpipe)


def test_the_backward_pass_keeps_a_flag_per_iteration_not_a_mask() -> None:
    """Residuals of the schedule's selects: [iterations, S] booleans. (jnp.where keeps its mask
    broadcast to the activations', [iterations, S, mb, D]: GPT175B at R = 12, 14 GiB a device.)"""
    params, x, _ = make(8, 8)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(lambda p: jnp.sum(
            pipeline_apply(layer, p, x, num_stages=4, repeats=2, remat=True)), params)
    masks = set(re.findall(r"bool\[[0-9,]*\]", out.getvalue()))
    assert "bool[19,4]" in masks  # each iteration's valid stages (R*M + S - 1 = 19)
    assert not [mask for mask in masks if mask.endswith(",4,8]")], masks  # nothing [.., mb, D]
