"""FP8 matmuls (models/linear.py over Flax's Fp8Einsum), checked against float64 NumPy.

Quantisation error bounds of e4m3; the delayed-scaling update after three steps by hand; the FP8
forward against a NumPy matmul of the quantised operands; each matmul (expert ones included) owning
its own state, per layer under the scan; LoRA adapters staying out of FP8; dropless MoE refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import linen as nn
from flax import traverse_util
from flax.linen import fp8_ops

from paxlite.models.linear import FP8_COLLECTION, ExpertLinear, Fp8Config, Linear
from paxlite.models.lora import LoraSpec
from paxlite.models.moe_config import MoeConfig, MoeRouting
from paxlite.models.transformer import Transformer, TransformerConfig

E4M3_MAX = 448.0
E5M2_MAX = 57344.0


def _np_qdq(x: np.ndarray, scale: float) -> np.ndarray:
    """Reference quantise-dequantise in float64 (ml_dtypes' e4m3fn rounding)."""
    q = np.clip(x / scale, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q.astype(np.float64) * scale


def test_e4m3_quantise_dequantise_error_bounds():
    rng = np.random.default_rng(0)
    x = rng.normal(size=4096) * np.exp(rng.uniform(-4, 2, size=4096))
    scale = np.max(np.abs(x)) / E4M3_MAX
    q = fp8_ops.quantize(jnp.asarray(x, jnp.float32), jnp.float8_e4m3fn,
                         jnp.asarray([scale], jnp.float32), jnp.float32)
    dq = np.asarray(fp8_ops.dequantize(q, jnp.float32, jnp.asarray([scale], jnp.float32)),
                    np.float64)
    normal = np.abs(x / scale) >= 2.0**-6  # e4m3's smallest normal
    # round to nearest with 3 mantissa bits: relative error <= 2^-4 (plus float32 slack)
    rel = np.abs(dq[normal] - x[normal]) / np.abs(x[normal])
    assert rel.max() <= 2.0**-4 * (1 + 1e-5)
    assert rel.max() > 2.0**-6  # really 8 bits, not a float32 pass-through
    # subnormals: absolute error <= half their spacing (2^-9) times the scale
    assert np.abs(dq[~normal] - x[~normal]).max() <= 2.0**-10 * scale * (1 + 1e-5)
    np.testing.assert_allclose(dq, _np_qdq(x, scale), rtol=1e-6, atol=1e-12)
    # values past the range clip to +-448 x scale
    big = fp8_ops.quantize(jnp.asarray([1e4, -1e4], jnp.float32), jnp.float8_e4m3fn,
                           jnp.ones((1,), jnp.float32), jnp.float32)
    np.testing.assert_array_equal(np.asarray(big, np.float32), [E4M3_MAX, -E4M3_MAX])


def test_delayed_scaling_after_three_steps_matches_a_hand_computation():
    rng = np.random.default_rng(1)
    lin = Linear(equation="BD,DF->BF", kernel_shape=(16, 32), kernel_axes=("embed", "mlp"),
                 fp8=Fp8Config(amax_history_length=3))
    x0 = rng.normal(size=(8, 16)).astype(np.float32)
    g0 = rng.normal(size=(8, 32)).astype(np.float32)
    variables = nn.meta.unbox(lin.init(jax.random.key(0), x0))
    params, fp8 = variables["params"], variables[FP8_COLLECTION]

    @jax.jit
    def step(fp8, x, g):
        def objective(f):
            y = lin.apply({"params": params, FP8_COLLECTION: f}, x)
            return jnp.sum(y * g), y
        (_, y), new = jax.value_and_grad(objective, has_aux=True)(fp8)
        return new, y

    xs = [x0 * c for c in (1.0, 4.0, 0.5)]
    gs = [g0 * c for c in (2.0, 0.1, 1.0)]
    a = [float(np.max(np.abs(x))) for x in xs]  # input amax per step
    b = [float(np.max(np.abs(g))) for g in gs]  # output-gradient amax per step
    k = float(np.max(np.abs(np.asarray(params["kernel"]))))
    for x, g in zip(xs, gs, strict=True):
        fp8, y = step(fp8, x, g)
    state = {key.split("/")[-1]: np.asarray(v) for key, v in
             traverse_util.flatten_dict(fp8, sep="/").items()}
    # history: roll by -1, slot 0 = this step's amax -> [a3, a1, a2] after three steps
    np.testing.assert_allclose(state["input_amax_history"], [a[2], a[0], a[1]], rtol=1e-6)
    np.testing.assert_allclose(state["kernel_amax_history"], [k, k, k], rtol=1e-6)
    np.testing.assert_allclose(state["output_grad_amax_history"], [b[2], b[0], b[1]], rtol=1e-6)
    # the scale of step 3 comes from the history before it, [a2, 0, a1]: max / fp8_max
    np.testing.assert_allclose(state["input_scale"], [max(a[0], a[1]) / E4M3_MAX], rtol=1e-6)
    np.testing.assert_allclose(state["kernel_scale"], [k / E4M3_MAX], rtol=1e-6)
    np.testing.assert_allclose(state["output_grad_scale"], [max(b[0], b[1]) / E5M2_MAX], rtol=1e-6)
    # the forward of step 3: float64 matmul of the operands quantised with those scales
    kernel = np.asarray(params["kernel"], np.float64)
    want = _np_qdq(xs[2].astype(np.float64), max(a[0], a[1]) / E4M3_MAX) @ _np_qdq(
        kernel, k / E4M3_MAX
    )
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(y) - xs[2] @ kernel).max() > 1e-3  # really quantised


def _config(**kwargs) -> TransformerConfig:
    base = dict(vocab_size=32, num_layers=2, model_dims=16, num_heads=2, dims_per_head=8,
                hidden_dims=32, max_seq_len=8, fp8=Fp8Config(amax_history_length=4))
    return TransformerConfig(**{**base, **kwargs})


def _state_after_one_step(config: TransformerConfig):
    """Init and one gradient of the FP8 state, each jitted: op by op, the FP8 model's many small
    operations cost about twice the CPU time of compiling the two programs (8.1 -> 4.0 s)."""
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 32, (2, 8)), jnp.int32)
    model = Transformer(config)
    variables = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), tokens))

    @jax.jit
    def fp8_gradient(fp8, params):
        return jax.grad(lambda f: jnp.sum(model.apply(
            {"params": params, FP8_COLLECTION: f}, tokens)))(fp8)

    new = fp8_gradient(variables[FP8_COLLECTION], variables["params"])
    return variables["params"], traverse_util.flatten_dict(new, sep="/")


@pytest.mark.slow  # FP8 dense and MoE models initialised and differentiated (~28 s on 2 cores)
def test_every_matmul_and_expert_matmul_owns_its_state():
    config = _config(moe=MoeConfig(num_experts=4, moe_layer_interval=1), gated_mlp=False)
    params, state = _state_after_one_step(config)
    flat_params = traverse_util.flatten_dict(params, sep="/")
    owners = sorted({key.rsplit("/", 2)[0] for key in state})
    assert owners == sorted(
        f"layers_{i}/{m}" for i in range(2) for m in ("attention/qkv", "attention/out",
                                                     "moe/wi", "moe/wo"))
    # each history holds the max of its own kernel: wi's and wo's differ, so nothing is shared
    amax = {}
    for owner in owners:
        want = float(np.max(np.abs(np.asarray(flat_params[f"{owner}/kernel"]))))
        got = float(state[f"{owner}/fp8_einsum/kernel_amax_history"][0])
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=owner)
        amax[owner] = got
    assert amax["layers_0/moe/wi"] != amax["layers_0/moe/wo"]
    assert len(set(amax.values())) == len(owners)


def test_scanned_layers_stack_one_state_per_layer():
    _, state = _state_after_one_step(_config(scan_layers=True))
    history = state["layers/attention/qkv/fp8_einsum/kernel_amax_history"]
    assert history.shape == (2, 4)
    assert history[0, 0] != history[1, 0] and history[0, 0] > 0  # each layer's own kernel


def test_fp8_with_dropless_routing_is_refused():
    with pytest.raises(ValueError, match="dropless grouped matmul has no FP8 form"):
        _config(moe=MoeConfig(num_experts=4, routing=MoeRouting.DROPLESS_TOPK,
                              experts_per_token=2))
    expert = ExpertLinear(kernel_shape=(2, 4, 4), kernel_axes=("expert", "embed", "mlp"),
                          fp8=Fp8Config())
    with pytest.raises(ValueError, match="USE_FP8.*MOE_ROUTING='gshard_top2'"):
        expert.init_with_output(jax.random.key(0), method=ExpertLinear.kernel_value)


def test_lora_adapters_stay_in_the_compute_dtype():
    """LoRA + FP8: the frozen base matmul runs FP8, the low-rank delta does not."""
    rng = np.random.default_rng(3)
    spec = LoraSpec(rank=2, alpha=4.0)
    lin = Linear(equation="BD,DF->BF", kernel_shape=(16, 32), kernel_axes=("embed", "mlp"),
                 fp8=Fp8Config(amax_history_length=2), lora=spec)
    x = jnp.asarray(rng.normal(size=(4, 16)), jnp.float32)
    variables = nn.meta.unbox(lin.init(jax.random.key(0), x))
    params = dict(variables["params"])
    params["lora_b"] = jnp.asarray(rng.normal(size=params["lora_b"].shape), jnp.float32)
    with_delta = lin.apply({**variables, "params": params}, x)
    base = lin.apply(
        {**variables, "params": {**params, "lora_b": jnp.zeros_like(params["lora_b"])}}, x
    )
    a, b = (np.asarray(params[n], np.float64) for n in ("lora_a", "lora_b"))
    want = (spec.alpha / spec.rank) * (np.asarray(x, np.float64) @ a) @ b
    np.testing.assert_allclose(
        np.asarray(with_delta - base, np.float64), want, rtol=1e-4, atol=1e-5
    )
    assert FP8_COLLECTION in variables
