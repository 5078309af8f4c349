"""LoRA on the model: Pax's target sets and layouts, exact step-0 identity, merging, alpha."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from paxlite.models.linear import Linear
from paxlite.models.lora import LoraSpec, LoraTargets, is_lora_path
from paxlite.models.lora_merge import merge_lora
from paxlite.models.transformer import (
    Activation,
    NormKind,
    PositionEmbedding,
    Transformer,
    TransformerConfig,
)
from paxlite.parallel.rules import DEFAULT_RULES

D, N, H, F, V, T, R = 16, 4, 4, 32, 64, 8, 3

GPT = TransformerConfig(vocab_size=V, num_layers=2, model_dims=D, num_heads=N, dims_per_head=H,
                        hidden_dims=F, max_seq_len=T)
LLAMA = TransformerConfig(
    vocab_size=V, num_layers=2, model_dims=D, num_heads=N, num_kv_heads=2, dims_per_head=H,
    hidden_dims=F, max_seq_len=T, norm=NormKind.RMS_NORM, activation=Activation.SILU,
    gated_mlp=True, use_bias=False, tie_embeddings=False,
    position_embedding=PositionEmbedding.ROTARY,
)
SCANNED = dataclasses.replace(LLAMA, num_kv_heads=None, scan_layers=True)
CONFIGS = {"gpt_fused_qkv": GPT, "llama_gqa": LLAMA, "scanned_fused_qkv": SCANNED}
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, V, (2, T)), jnp.int32)


def _with_lora(config, **kwargs):
    return dataclasses.replace(config, lora_rank=R, **kwargs)


def _init(config, seed=0):
    init = jax.jit(lambda key: Transformer(config).init({"params": key}, TOKENS))
    return nn.meta.unbox(init(jax.random.key(seed))["params"])


# Outside any trace only (under eval_shape it would keep tracers): a real initialisation once per
# config in this module, its threefry sampler being the slow part of these tests on CPU; the tests
# read the arrays and never change them.
_init_once = functools.cache(_init)


def _logits(config, params):
    return _forward(config)(params)


@functools.cache
def _forward(config):
    """One jitted forward per config: the base model of each layout runs in two tests, and a new
    jit would trace and lower it again."""
    return jax.jit(lambda p: Transformer(config).apply({"params": p}, TOKENS))


def _flat(params):
    return traverse_util.flatten_dict(params, sep="/")


def _without_lora(params):
    return traverse_util.unflatten_dict(
        {k: v for k, v in _flat(params).items() if not is_lora_path(k)}, sep="/")


def _randomise_lora_b(params, seed=1):
    rng = np.random.default_rng(seed)
    flat = {k: (jnp.asarray(rng.standard_normal(v.shape) * 0.05, v.dtype) if k.endswith("lora_b")
                else v) for k, v in _flat(params).items()}
    return traverse_util.unflatten_dict(flat, sep="/")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def lora_model(request):
    """(config with LoRA, its freshly initialised params), once per model layout."""
    config = _with_lora(CONFIGS[request.param])
    return config, _init_once(config)


def test_at_initialisation_the_lora_model_is_the_base_model_exactly(lora_model):
    config, lora_params = lora_model
    base_config = dataclasses.replace(config, lora_rank=None)
    base_params = _without_lora(lora_params)
    lora_logits = _logits(config, lora_params)
    base_logits = _logits(base_config, base_params)
    np.testing.assert_array_equal(np.asarray(lora_logits), np.asarray(base_logits))
    # Every lora_b starts at zero, every lora_a does not.
    for key, value in _flat(lora_params).items():
        if key.endswith("lora_b"):
            assert not np.any(np.asarray(value)), key
        elif key.endswith("lora_a"):
            assert np.std(np.asarray(value)) > 0.01, key


def test_adapters_leave_the_base_initialisation_unchanged():
    """A base checkpoint loads into the LoRA model as it is: same names, shapes and (for unrolled
    layers) initial values. Under nn.scan the adapters' draws shift the random stream of later
    weights; a restore overwrites those anyway."""
    base_params = _flat(_init(LLAMA))
    stripped = _flat(_without_lora(_init_once(_with_lora(LLAMA))))
    assert stripped.keys() == base_params.keys()
    for key, value in base_params.items():
        np.testing.assert_array_equal(np.asarray(stripped[key]), np.asarray(value))
    scanned = jax.eval_shape(lambda: _flat(_without_lora(_init(_with_lora(SCANNED)))))
    assert {k: v.shape for k, v in scanned.items()} == {
        k: v.shape for k, v in jax.eval_shape(lambda: _flat(_init(SCANNED))).items()}


def _adapted_layers(params):
    """{'attention/qkv', 'mlp/wi', ...}: the Linears of layer 0 that carry lora_a and lora_b."""
    flat = _flat(params)
    found = set()
    for key in flat:
        if key.endswith("/lora_a"):
            prefix = key[: -len("/lora_a")]
            assert f"{prefix}/lora_b" in flat and f"{prefix}/kernel" in flat
            found.add(prefix)
    assert all(k.startswith(("layers_0/", "layers_1/", "layers/")) for k in found), found
    return {k.split("/", 1)[1] for k in found}


@pytest.mark.parametrize(
    "targets, fused, expected",
    [
        ("attention", True, {"attention/qkv", "attention/out"}),
        ("attention", False, {"attention/query", "attention/key", "attention/value",
                              "attention/out"}),
        ("mlp", False, {"mlp/wi", "mlp/wi_gate", "mlp/wo"}),
        ("mlp", True, {"mlp/wi", "mlp/wo"}),  # GPT's plain MLP has no gate
        ("all", False, {"attention/query", "attention/key", "attention/value", "attention/out",
                        "mlp/wi", "mlp/wi_gate", "mlp/wo"}),
        ("all", True, {"attention/qkv", "attention/out", "mlp/wi", "mlp/wo"}),
    ],
)
def test_targets_cover_exactly_paxs_projections(targets, fused, expected):
    config = _with_lora(GPT if fused else LLAMA, lora_targets=targets)
    params = jax.eval_shape(lambda: _init(config))
    assert _adapted_layers(params) == expected
    # Two layers, each adapted the same way; the embedding and output head never are.
    assert sum(is_lora_path(k) for k in _flat(params)) == 2 * 2 * len(expected)


def test_layouts_shapes_and_logical_axes():
    variables = jax.eval_shape(
        lambda: Transformer(_with_lora(LLAMA)).init({"params": jax.random.key(0)}, TOKENS))
    fused = jax.eval_shape(
        lambda: Transformer(_with_lora(GPT)).init({"params": jax.random.key(0)}, TOKENS))

    def shape_and_names(tree, path):
        node = tree["params"]
        for part in path.split("/"):
            node = node[part]
        return node.value.shape, node.names

    # Pax's combined QKV: separate adapters per q/k/v ([3, D, r] / [3, N*H, r] in Pax's layout).
    assert shape_and_names(fused, "layers_0/attention/qkv/lora_a") == (
        (D, 3, R), ("embed", "qkv", "lora_rank"))
    assert shape_and_names(fused, "layers_0/attention/qkv/lora_b") == (
        (3, R, N, H), ("qkv", "lora_rank", "heads", "kv"))
    assert shape_and_names(variables, "layers_0/attention/key/lora_b") == (
        (R, 2, H), ("lora_rank", "kv_heads", "kv"))
    assert shape_and_names(variables, "layers_0/attention/out/lora_a") == (
        (N, H, R), ("heads", "kv", "lora_rank"))
    assert shape_and_names(variables, "layers_0/mlp/wo/lora_a") == ((F, R), ("mlp", "lora_rank"))
    assert shape_and_names(variables, "layers_0/mlp/wi/lora_b") == ((R, F), ("lora_rank", "mlp"))
    # The input axes shard like the kernel's input, the rank axis is replicated.
    assert tuple(nn.logical_to_mesh_axes(("embed", "lora_rank"), DEFAULT_RULES)) == ("fsdp", None)
    assert tuple(nn.logical_to_mesh_axes(("lora_rank", "mlp"), DEFAULT_RULES)) == (None, "tensor")


def _numpy_merged_kernel(kernel, lora_a, lora_b, *, scale, groups):
    """W + scale * A @ B in float64 NumPy, written out per layout."""
    w, a, b = (np.asarray(x, np.float64) for x in (kernel, lora_a, lora_b))
    r = a.shape[-1]
    if groups:  # fused QKV: kernel [D, 3, N, H], A [D, 3, r], B [3, r, N, H]
        out = w.copy()
        for k in range(w.shape[1]):
            out[:, k] += scale * (a[:, k, :] @ b[k].reshape(r, -1)).reshape(w[:, k].shape)
        return out
    return w + scale * (a.reshape(-1, r) @ b.reshape(r, -1)).reshape(w.shape)


def test_merged_params_equal_base_plus_lora(lora_model):
    config, params = lora_model
    config = dataclasses.replace(config, lora_alpha=2.0 * R)  # scale 2
    params = _randomise_lora_b(params)
    merged = merge_lora(params, config=config)
    assert not any(is_lora_path(k) for k in _flat(merged))
    base_config = dataclasses.replace(config, lora_rank=None, lora_alpha=None)
    lora_logits = _logits(config, params)
    merged_logits = _logits(base_config, merged)
    np.testing.assert_allclose(np.asarray(merged_logits), np.asarray(lora_logits), atol=1e-5,
                               rtol=1e-5)
    flat, merged_flat = _flat(params), _flat(merged)
    checked = 0
    for key in flat:
        if not key.endswith("/lora_a"):
            continue
        prefix = key[: -len("/lora_a")]
        kernel, a, b = flat[f"{prefix}/kernel"], flat[key], flat[f"{prefix}/lora_b"]
        if config.scan_layers:  # one leading layers axis on all three
            expected = np.stack([
                _numpy_merged_kernel(kernel[i], a[i], b[i], scale=2.0,
                                     groups=prefix.endswith("qkv"))
                for i in range(kernel.shape[0])])
        else:
            expected = _numpy_merged_kernel(kernel, a, b, scale=2.0, groups=prefix.endswith("qkv"))
        got = np.asarray(merged_flat[f"{prefix}/kernel"])
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
        assert not np.allclose(got, np.asarray(kernel), atol=1e-4)  # the delta is really there
        checked += 1
    assert checked >= 5
    for key, value in merged_flat.items():  # everything else is untouched
        if not key.endswith("kernel") or key not in {k.replace("lora_a", "kernel") for k in flat
                                                     if k.endswith("lora_a")}:
            np.testing.assert_array_equal(np.asarray(value), np.asarray(flat[key]))


@pytest.mark.parametrize("alpha", [None, 3.0, 6.0, 0.75])
def test_alpha_over_rank_scales_the_delta(alpha):
    """y = x W + (alpha / r) x A B, checked against float64 NumPy; alpha None means scale 1."""
    layer = Linear(equation="BTD,DF->BTF", kernel_shape=(D, F), kernel_axes=("embed", "mlp"),
                   bias_axes=("mlp",), lora=LoraSpec(rank=R, alpha=alpha))
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, T, D)), jnp.float32)
    params = nn.meta.unbox(layer.init({"params": jax.random.key(3)}, x)["params"])
    params = {**params, "lora_b": jnp.asarray(np.random.default_rng(4).standard_normal((R, F)),
                                              jnp.float32),
              "bias": jnp.full((F,), 0.5, jnp.float32)}
    y = np.asarray(layer.apply({"params": params}, x), np.float64)
    x64 = np.asarray(x, np.float64)
    w, a, b = (np.asarray(params[k], np.float64) for k in ("kernel", "lora_a", "lora_b"))
    scale = 1.0 if alpha is None else alpha / R
    expected = x64 @ w + scale * (x64 @ a) @ b + 0.5
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    assert LoraSpec(rank=R, alpha=alpha).scale == scale


def test_bad_lora_settings_are_refused():
    for rank in (0, -2, True, 2.0):
        with pytest.raises(ValueError, match="lora_rank"):
            dataclasses.replace(GPT, lora_rank=rank)
    with pytest.raises(ValueError, match="'all', 'attention', 'mlp'"):
        dataclasses.replace(GPT, lora_rank=4, lora_targets="qkv")
    with pytest.raises(ValueError, match="lora_alpha"):
        dataclasses.replace(GPT, lora_rank=4, lora_alpha=0.0)
    with pytest.raises(ValueError, match="rank"):
        LoraSpec(rank=0)
    with pytest.raises(ValueError, match="lora_rank=None"):
        merge_lora(jax.eval_shape(lambda: _init(GPT)), config=GPT)  # refused before any math
    assert dataclasses.replace(GPT, lora_targets="mlp").lora_targets is LoraTargets.MLP


def test_is_lora_path_spellings():
    assert is_lora_path("layers_0/mlp/wi/lora_a")
    assert is_lora_path("layers_0.attention.qkv.lora_b")
    assert is_lora_path(("layers", "mlp", "wo", "lora_b"))
    path = jax.tree_util.tree_flatten_with_path({"wi": {"lora_a": 1}})[0][0][0]
    assert is_lora_path(path)
    for name in ("layers_0/mlp/wi/kernel", "lora", "layers_0/flora_a/kernel"):
        assert not is_lora_path(name)
