"""The pipeline schedule (paxlite/models/pipeline.py) against the plain sequential layer loop.

Every case holds values to 1e-6 and every gradient (parameters and inputs) to 1e-5 of applying the
L layers one after another to each microbatch, with distinct random weights per layer (so a wrong
stage or repeat order cannot hide), on one device and on 8 CPU devices with the stage dimension
sharded over a `pipeline` mesh axis. Bubbles are filled with NaN where stated, so a bubble value or
gradient that leaks into the results shows as NaN.
"""

import contextlib
import io
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from paxlite.models.pipeline import (
    STAGE_RULE,
    bubble_fraction,
    pipeline_apply,
    pipeline_apply_with_extras,
)

D = 8  # features
MB = 4  # rows per microbatch
CASES = [  # (stages, repeats, microbatches, layers per stage)
    (2, 1, 4, 2),
    (4, 1, 4, 1),
    (8, 1, 8, 1),
    (2, 2, 4, 2),
    (4, 2, 8, 1),
]
CASE_IDS = [f"S{s}-R{r}-M{m}-K{k}" for s, r, m, k in CASES]


def layer(p, x):
    """One layer: dense + tanh, x [mb, D]."""
    return jnp.tanh(jnp.einsum("bd,de->be", x, p["w"]) + p["b"])


def make(num_layers: int, num_micro: int, seed: int = 0):
    """Random weights, inputs and a cotangent, drawn on the host (NumPy): jax.random would compile
    a small program for each shape drawn."""
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return (scale * rng.normal(size=shape)).astype(np.float32)

    params = {"w": normal(num_layers, D, D, scale=1 / np.sqrt(D)),
              "b": normal(num_layers, D, scale=0.1)}
    x = normal(num_micro, MB, D)
    cotangent = normal(num_micro, MB, D)  # weights every output differently
    return params, x, cotangent


def sequential(params, x):
    """The reference: each microbatch through layers 0..L-1 in order, one Python step per layer.

    The microbatches are a lax.map loop (each the same [mb, D] program, so the same numbers as a
    Python loop over them, bit for bit): traced once instead of once per microbatch."""
    num_layers = params["w"].shape[0]

    def one(h):
        for i in range(num_layers):
            h = layer({"w": params["w"][i], "b": params["b"][i]}, h)
        return h

    return jax.lax.map(one, x)


def outputs_and_grads(fn, params, x, cotangent):
    """fn's outputs, and the gradients (parameters, inputs) of sum(outputs * cotangent)."""
    def loss(p, xs):
        return jnp.sum(fn(p, xs) * cotangent)

    return fn(params, x), jax.grad(loss, argnums=(0, 1))(params, x)


def value_and_grads(fn, params, x, cotangent):
    return jax.jit(lambda p, xs, ct: outputs_and_grads(fn, p, xs, ct))(params, x, cotangent)


def pipelined(num_stages, repeats, **kwargs):
    return lambda p, xs: pipeline_apply(layer, p, xs, num_stages=num_stages, repeats=repeats,
                                        **kwargs)


def assert_close(got, want):
    (out, grads), (ref_out, ref_grads) = got, want
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def references():
    """Sequential values and gradients per case, computed once."""
    refs = {}
    for s, r, m, k in CASES:
        params, x, ct = make(s * r * k, m)
        refs[(s, r, m, k)] = value_and_grads(sequential, params, x, ct)
    return refs


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_equals_sequential_with_nan_bubbles(case, references):
    """GPipe (R=1) and circular (R>1) equal the layer loop; NaN in the shift state and circular
    buffer never reaches outputs or gradients, and gives the same numbers as a zero fill."""
    s, r, m, k = case
    params, x, ct = make(s * r * k, m)
    # the fill is an argument of the compiled program: NaN and zero run the same program
    filled = jax.jit(lambda fill, p, xs, c: outputs_and_grads(
        pipelined(s, r, bubble_fill=fill), p, xs, c))
    nan_filled = filled(jnp.nan, params, x, ct)
    assert_close(nan_filled, references[case])
    zero_filled = filled(0.0, params, x, ct)
    for a, b in zip(jax.tree.leaves(nan_filled), jax.tree.leaves(zero_filled), strict=True):
        np.testing.assert_array_equal(a, b)


def test_sequential_reference_matches_float64():
    """The reference loop itself against NumPy float64 (independent of JAX's ops)."""
    params, x, _ = make(4, 2)
    w, b, h = (np.asarray(a, np.float64) for a in (params["w"], params["b"], x))
    for i in range(4):
        h = np.tanh(np.einsum("mbd,de->mbe", h, w[i]) + b[i])
    np.testing.assert_allclose(sequential(params, x), h, rtol=0, atol=1e-6)


def _saved_per_iteration(fn, params, x) -> list[str]:
    """The float residuals the backward pass keeps per scan iteration (leading dimension 19)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(lambda p: jnp.sum(fn(p, x)), params)
    return sorted(re.findall(r"f32\[19,[0-9,]*\]", out.getvalue()))


def test_remat_is_exact_and_saves_only_stage_inputs(references):
    """remat: same numbers; per iteration only the stages' inputs f32[T=19, S=4, mb=4, D=8] are
    kept. Without remat the per-layer activations are kept too, but never the weights an iteration
    selects ([T, K, S, D, D] would be a copy of a repeat's weights per iteration)."""
    case = (4, 2, 8, 1)
    s, r, m, k = case
    params, x, ct = make(s * r * k, m)
    assert_close(value_and_grads(pipelined(s, r, remat=True, bubble_fill=jnp.nan), params, x, ct),
                 references[case])
    assert _saved_per_iteration(pipelined(s, r, remat=True), params, x) == ["f32[19,4,4,8]"]
    plain = _saved_per_iteration(pipelined(s, r), params, x)
    assert "f32[19,1,4,4,8]" in plain  # activations of the K=1 layer of each of the S=4 stages
    assert not [res for res in plain if res.endswith(",8,8]")], plain


def _run_on_mesh(mesh, fn, params, x, ct):
    """Values, gradients and compiled HLO text of fn on `mesh`, inputs' rows over `data`."""
    def loss(p, xs):
        return jnp.sum(fn(p, xs) * ct)

    step = jax.jit(lambda p, xs: (fn(p, xs), jax.grad(loss, argnums=(0, 1))(p, xs)))
    with jax.set_mesh(mesh):
        x = jax.device_put(x, NamedSharding(mesh, P(None, "data")))
        compiled = step.lower(params, x).compile()
        return compiled(params, x), compiled.as_text()


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_pipeline_mesh_equals_one_device(case, references):
    """8 CPU devices as (pipeline=S, data=8/S): equal to one device, with the stage dimension
    really split over `pipeline` (the stage shift compiles to a collective-permute)."""
    s, r, m, k = case
    params, x, ct = make(s * r * k, m)
    mesh = Mesh(np.array(jax.devices()).reshape(s, 8 // s), ("pipeline", "data"))
    got, hlo = _run_on_mesh(mesh, pipelined(s, r, bubble_fill=jnp.nan), params, x, ct)
    assert_close(got, references[case])
    assert "collective-permute" in hlo


def test_no_pipeline_axis_means_replicated_stages(references):
    """A mesh without a `pipeline` axis, or rules mapping `stage` to None, keeps the stages on every
    device: same numbers, no stage shift between devices. The contrast with the test above shows the
    collective-permute there comes from the stage sharding."""
    case = (4, 1, 4, 1)
    s, r, m, k = case
    params, x, ct = make(s * r * k, m)
    data_only = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "tensor"))
    got, hlo = _run_on_mesh(data_only, pipelined(s, r), params, x, ct)
    assert_close(got, references[case])
    assert "collective-permute" not in hlo
    pipe = Mesh(np.array(jax.devices()).reshape(4, 2), ("pipeline", "data"))
    with nn.logical_axis_rules([(STAGE_RULE[0], None)]):
        got, hlo = _run_on_mesh(pipe, pipelined(s, r), params, x, ct)
    assert_close(got, references[case])
    assert "collective-permute" not in hlo


def test_bad_counts_are_refused_with_the_numbers():
    params, x, _ = make(6, 4)
    with pytest.raises(ValueError, match=r"^6 layers do not split into 4 stages x 1 repeats: .* "
                                         r"multiple of 4$"):
        pipeline_apply(layer, params, x, num_stages=4)
    with pytest.raises(ValueError, match=r"^6 layers do not split into 2 stages x 2 repeats"):
        pipeline_apply(layer, params, x, num_stages=2, repeats=2)
    params, x, _ = make(8, 2)
    with pytest.raises(
        ValueError,
        match=r"circular schedule \(2 repeats\) needs at least as many "
        r"microbatches as stages: got 2 microbatches for 4 stages",
    ):
        pipeline_apply(layer, params, x, num_stages=4, repeats=2)
    with pytest.raises(ValueError, match=r"num_stages=0 and repeats=1 must both be >= 1"):
        pipeline_apply(layer, params, x, num_stages=0)
    with pytest.raises(ValueError, match=r"remat_policy is used only with remat=True"):
        pipeline_apply(
            layer, params, x, num_stages=2, remat_policy=jax.checkpoint_policies.everything_saveable
        )
    bad = {"w": params["w"], "b": params["b"][:4]}
    with pytest.raises(ValueError, match=r"disagree on their leading layer axis: sizes \[4, 8\]"):
        pipeline_apply(layer, bad, x, num_stages=2)
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("pipeline", "data"))
    with jax.set_mesh(mesh), pytest.raises(
            ValueError, match=r"^2 pipeline stages do not divide over the 'pipeline' mesh axis of "
                              r"size 4"):
        pipeline_apply(layer, params, x, num_stages=2)


def test_bubble_fraction():
    """(S - 1) / (R*M + S - 1): 4 stages, 4 microbatches: 3/7; two repeats shrink it to 3/11."""
    assert bubble_fraction(num_stages=4, repeats=1, num_microbatches=4) == pytest.approx(3 / 7)
    assert bubble_fraction(num_stages=4, repeats=2, num_microbatches=4) == pytest.approx(3 / 11)
    assert bubble_fraction(num_stages=1, repeats=1, num_microbatches=4) == 0


def side_layer(p, x, side, call):
    """A layer reading a per-microbatch side input (a shift [mb, D] and a None leaf) and returning
    extras: a value of its output and the call's own numbers (which layer, which microbatch)."""
    assert side["none"] is None
    y = jnp.tanh(jnp.einsum("bd,de->be", x, p["w"]) + p["b"] + side["shift"])
    extras = {"energy": jnp.sum(y * y), "layer": call.layer.astype(jnp.float32),
              "micro": call.microbatch.astype(jnp.float32)}
    return y, extras


def side_sequential(params, x, side):
    """The reference: microbatch by microbatch, layer by layer; extras summed per layer."""
    num_layers, num_micro = params["w"].shape[0], x.shape[0]
    outs, energy = [], [0.0] * num_layers
    for m in range(num_micro):
        h = x[m]
        for i in range(num_layers):
            h = jnp.tanh(jnp.einsum("bd,de->be", h, params["w"][i]) + params["b"][i]
                         + side["shift"][m])
            energy[i] = energy[i] + jnp.sum(h * h)
        outs.append(h)
    return jnp.stack(outs), jnp.stack(energy)


@pytest.mark.parametrize("case,on_mesh", [((4, 1, 4, 1), False), ((2, 2, 4, 2), True)],
                         ids=["S4-R1-M4-K1", "S2-R2-M4-K2-mesh"])
def test_side_inputs_and_extras_equal_sequential(case, on_mesh):
    """pipeline_apply_with_extras: each microbatch reads its own side input; extras are summed per
    layer over the microbatches and only over valid iterations (NaN-filled buffers, and bubble
    calls that would add to `layer`/`micro` sums if counted); values and gradients (through the
    outputs and the extras) equal the sequential loop."""
    s, r, m, k = case
    num_layers = s * r * k
    params, x, ct = make(num_layers, m)
    side = {"shift": (0.1 * np.random.default_rng(5).normal(size=(m, MB, D))).astype(np.float32),
            "none": None}
    energy_weights = np.linspace(0.5, 1.5, num_layers, dtype=np.float32)

    def run(p, xs, sd):
        out, extras = pipeline_apply_with_extras(side_layer, p, xs, side=sd, num_stages=s,
                                                 repeats=r, bubble_fill=jnp.nan)
        return out, extras

    def loss(fn, p, xs, sd):
        out, energy = fn(p, xs, sd)
        return jnp.sum(out * ct) + jnp.sum(energy * energy_weights)

    def pipelined_energy(p, xs, sd):
        out, extras = run(p, xs, sd)
        return out, extras["energy"]

    def pipelined_loss(p, xs, sd):
        return loss(pipelined_energy, p, xs, sd)

    step = jax.jit(lambda p, xs, sd: (run(p, xs, sd),
                                      jax.grad(pipelined_loss, argnums=(0, 1, 2))(p, xs, sd)))
    mesh = Mesh(np.array(jax.devices()).reshape(s, 8 // s), ("pipeline", "data"))
    with (jax.set_mesh(mesh) if on_mesh else contextlib.nullcontext()):
        (out, extras), grads = step(params, x, side)
    energy = extras["energy"]
    # the loop compiled as one program (run op by op, each operation would compile its own)
    ref_out, ref_energy, ref_grads = jax.jit(lambda p, xs, sd: (
        *side_sequential(p, xs, sd),
        jax.grad(lambda *a: loss(side_sequential, *a), argnums=(0, 1, 2))(p, xs, sd)))(
            params, x, side)
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=1e-6)
    np.testing.assert_allclose(energy, ref_energy, rtol=1e-6)
    np.testing.assert_array_equal(extras["layer"], m * np.arange(num_layers))  # sum over m of l
    np.testing.assert_array_equal(extras["micro"], np.full(num_layers, m * (m - 1) / 2))
    for g, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g, want, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"side inputs must be \[M=4, \.\.\.\]"):
        pipeline_apply_with_extras(side_layer, params, x, side={"shift": side["shift"][:2]},
                                   num_stages=s, repeats=r)
