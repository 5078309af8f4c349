"""LayerNorm / RMSNorm against float64 NumPy formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from paxlite.models.norms import LayerNorm, RMSNorm


def _inputs(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    # A large common offset makes a naive low-precision variance visibly wrong.
    x = rng.normal(3.0, 2.0, (2, 5, 12))
    scale = 1.0 + 0.3 * rng.normal(size=12)
    bias = 0.5 * rng.normal(size=12)
    return x, scale, bias


def test_layer_norm_matches_float64_numpy() -> None:
    x, scale, bias = _inputs(0)
    eps = 1e-3
    module = LayerNorm(epsilon=eps)
    variables = module.init(jax.random.key(0), jnp.asarray(x, jnp.float32))
    params = {"scale": jnp.asarray(scale, jnp.float32), "bias": jnp.asarray(bias, jnp.float32)}
    got = module.apply({"params": params}, jnp.asarray(x, jnp.float32))
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    want = (x - mean) / np.sqrt(var + eps) * scale + bias
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert got.dtype == jnp.float32
    # Default init is scale=1, bias=0, with the shared 'norm' logical axis.
    unboxed = nn.meta.unbox(variables)["params"]
    np.testing.assert_array_equal(np.asarray(unboxed["scale"]), np.ones(12))
    np.testing.assert_array_equal(np.asarray(unboxed["bias"]), np.zeros(12))
    specs = nn.get_partition_spec(variables)["params"]
    assert specs == {"scale": jax.sharding.PartitionSpec("norm"),
                     "bias": jax.sharding.PartitionSpec("norm")}


def test_rms_norm_matches_float64_numpy() -> None:
    x, scale, _ = _inputs(1)
    eps = 1e-2
    module = RMSNorm(epsilon=eps)
    variables = module.init(jax.random.key(0), jnp.asarray(x, jnp.float32))
    assert set(variables["params"]) == {"scale"}
    got = module.apply({"params": {"scale": jnp.asarray(scale, jnp.float32)}},
                       jnp.asarray(x, jnp.float32))
    want = x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * scale
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_bfloat16_compute_reduces_in_float32(cls: type[nn.Module]) -> None:
    """bf16 in, bf16 out, and the statistics are f32: error is only the final bf16 rounding."""
    x, _, _ = _inputs(2)
    x_bf16 = jnp.asarray(x, jnp.bfloat16)
    module = cls(epsilon=1e-5, dtype=jnp.bfloat16)
    variables = module.init(jax.random.key(0), x_bf16)
    got = module.apply(variables, x_bf16)
    assert got.dtype == jnp.bfloat16
    assert nn.meta.unbox(variables)["params"]["scale"].dtype == jnp.float32
    x64 = np.asarray(x_bf16.astype(jnp.float32), np.float64)  # exactly what the module saw
    if cls is LayerNorm:
        centred = x64 - x64.mean(-1, keepdims=True)
        want = centred / np.sqrt((centred**2).mean(-1, keepdims=True) + 1e-5)
    else:
        want = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-5)
    # One bf16 rounding of a value of size ~2 is at most 2**-8 relative.
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2**-8, atol=2**-8)
