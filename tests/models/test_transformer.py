"""Transformer: parameter counts and names, float64 reference forward, packing, scan, remat,
mixed precision, dropout, sharded gradients and config validation."""

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import AxisType, PartitionSpec

from paxlite.models.transformer import (
    Activation,
    NormKind,
    RematPolicy,
    Transformer,
    TransformerConfig,
    abstract_variables,
    logical_param_axes,
    num_params,
)
from paxlite.parallel.rules import DEFAULT_RULES, batch_sharding

GPT126M = dict(num_layers=12, num_heads=12, model_dims=768, hidden_dims=3072, dims_per_head=64,
               vocab_size=50304, max_seq_len=2048)
GPT5B = dict(num_layers=24, num_heads=32, model_dims=4096, hidden_dims=16384, dims_per_head=128,
             vocab_size=50304, max_seq_len=2048)
GPT175B = dict(num_layers=96, num_heads=96, model_dims=12288, hidden_dims=49152,
               dims_per_head=128, vocab_size=50257, max_seq_len=2048)
LOGICAL_PARAM_NAMES = {"vocab", "embed", "position", "norm", "qkv", "heads", "kv", "mlp", "layers"}


def tiny(**overrides: Any) -> TransformerConfig:
    """num_heads * dims_per_head != model_dims on purpose, to catch mixed-up axes."""
    fields: dict[str, Any] = dict(vocab_size=32, num_layers=2, model_dims=16, num_heads=2,
                                  dims_per_head=6, hidden_dims=24, max_seq_len=12)
    fields.update(overrides)
    return TransformerConfig(**fields)


def random_params(cfg: TransformerConfig, *, seed: int) -> Any:
    """Non-trivial params (biases non-zero, scales != 1) built from the abstract tree.

    Avoids a real init, whose threefry sampler takes seconds to compile on CPU.
    """
    rng = np.random.default_rng(seed)

    def leaf(path: tuple, shape: jax.ShapeDtypeStruct) -> jax.Array:
        noise = rng.normal(size=shape.shape)
        value = 1.0 + 0.2 * noise if path[-1].key == "scale" else 0.3 * noise
        return jnp.asarray(value, jnp.float32)

    abstract = nn.meta.unbox(abstract_variables(cfg))["params"]
    return jax.tree_util.tree_map_with_path(leaf, abstract)


def stack_layers(params: Any, num_layers: int) -> Any:
    """layers_0..layers_{L-1} -> one 'layers' subtree with a leading [L] axis (scan layout)."""
    out = {k: v for k, v in params.items() if not k.startswith("layers_")}
    out["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs),
                                 *[params[f"layers_{i}"] for i in range(num_layers)])
    return out


# ---------------------------------------------------------------- float64 NumPy reference

def _np_norm(x: np.ndarray, p: dict, cfg: TransformerConfig) -> np.ndarray:
    eps = cfg.norm_epsilon
    if cfg.norm is NormKind.LAYER_NORM:
        centred = x - x.mean(-1, keepdims=True)
        normed = centred / np.sqrt((centred**2).mean(-1, keepdims=True) + eps)
        return normed * p["scale"] + p["bias"]
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * p["scale"]


def _np_activation(h: np.ndarray, activation: Activation) -> np.ndarray:
    if activation is Activation.GELU_TANH:
        return 0.5 * h * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (h + 0.044715 * h**3)))
    if activation is Activation.GELU:
        return 0.5 * h * (1.0 + np.vectorize(math.erf)(h / np.sqrt(2.0)))
    if activation is Activation.RELU:
        return np.maximum(h, 0.0)
    return h / (1.0 + np.exp(-h))


def np_forward(cfg: TransformerConfig, params: Any, tokens: np.ndarray, *,
               positions: np.ndarray | None = None,
               segment_ids: np.ndarray | None = None) -> np.ndarray:
    """GPT forward in float64 with per-head matmuls, reading the (non-scan) params tree."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    bias = (lambda d, *keys: d["bias"][keys] if cfg.use_bias else 0.0)
    batch, length = tokens.shape
    x = p["embedding"]["embedding"][tokens]
    if cfg.learned_position_embedding:
        if positions is None:
            positions = np.broadcast_to(np.arange(length), (batch, length))
        x = x + p["position_embedding"]["embedding"][positions]
    allowed = np.tril(np.ones((length, length), bool))[None]
    if segment_ids is not None:
        allowed = allowed & (segment_ids[:, :, None] == segment_ids[:, None, :])
    for i in range(cfg.num_layers):
        lp = p[f"layers_{i}"]
        h = _np_norm(x, lp["pre_attention_norm"], cfg)
        qkv, out = lp["attention"]["qkv"], lp["attention"]["out"]
        attn = np.zeros_like(x)
        for n in range(cfg.num_heads):
            q = h @ qkv["kernel"][:, 0, n] + bias(qkv, 0, n)
            k = h @ qkv["kernel"][:, 1, n] + bias(qkv, 1, n)
            v = h @ qkv["kernel"][:, 2, n] + bias(qkv, 2, n)
            scores = np.where(allowed, q @ k.transpose(0, 2, 1) / np.sqrt(cfg.dims_per_head),
                              -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            attn += (probs @ v) @ out["kernel"][n]
        x = x + attn + bias(out)
        h = _np_norm(x, lp["pre_mlp_norm"], cfg)
        wi, wo = lp["mlp"]["wi"], lp["mlp"]["wo"]
        h = _np_activation(h @ wi["kernel"] + bias(wi), cfg.activation)
        x = x + h @ wo["kernel"] + bias(wo)
    x = _np_norm(x, p["final_norm"], cfg)
    if cfg.tie_embeddings:
        return x @ p["embedding"]["embedding"].T
    return x @ p["output"]["kernel"]


def _tokens(batch: int, length: int, *, seed: int, vocab: int = 32) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (batch, length)), jnp.int32)


# ---------------------------------------------------------------- sizes, names, init

@pytest.mark.parametrize("dims,expected", [
    (GPT126M, 125_262_336), (GPT5B, 5_047_558_144), (GPT175B, 174_604_259_328),
])
@pytest.mark.parametrize("scan_layers", [False, True])
def test_num_params_matches_published_gpt_sizes(dims: dict, expected: int,
                                                scan_layers: bool) -> None:
    cfg = TransformerConfig(**dims, scan_layers=scan_layers)
    assert num_params(cfg) == expected


def test_untied_and_position_free_param_counts_by_hand() -> None:
    cfg = tiny(tie_embeddings=False, learned_position_embedding=False, use_bias=False,
               norm=NormKind.RMS_NORM)
    d, f, n, h, v, layers = 16, 24, 2, 6, 32, 2
    per_layer = d * 3 * n * h + n * h * d + d * f + f * d + 2 * d
    assert num_params(cfg) == v * d + layers * per_layer + d + d * v


def test_param_paths_and_logical_names_are_stable() -> None:
    specs = logical_param_axes(tiny(tie_embeddings=False))
    layer = {
        "pre_attention_norm": {"scale": ("norm",), "bias": ("norm",)},
        "attention": {"qkv": {"kernel": ("embed", "qkv", "heads", "kv"),
                              "bias": ("qkv", "heads", "kv")},
                      "out": {"kernel": ("heads", "kv", "embed"), "bias": ("norm",)}},
        "pre_mlp_norm": {"scale": ("norm",), "bias": ("norm",)},
        "mlp": {"wi": {"kernel": ("embed", "mlp"), "bias": ("mlp",)},
                "wo": {"kernel": ("mlp", "embed"), "bias": ("norm",)}},
    }
    expected = {
        "embedding": {"embedding": ("vocab", "embed")},
        "position_embedding": {"embedding": ("position", "embed")},
        "layers_0": layer, "layers_1": layer,
        "final_norm": {"scale": ("norm",), "bias": ("norm",)},
        "output": {"kernel": ("embed", "vocab")},
    }
    as_tuples = jax.tree.map(tuple, specs, is_leaf=lambda s: isinstance(s, PartitionSpec))
    assert as_tuples == expected
    scanned = logical_param_axes(tiny(scan_layers=True, remat_policy=RematPolicy.SAVE_NOTHING))
    assert set(scanned) == {"embedding", "position_embedding", "layers", "final_norm"}
    assert tuple(scanned["layers"]["attention"]["qkv"]["kernel"]) == (
        "layers", "embed", "qkv", "heads", "kv")


@pytest.mark.parametrize("scan_layers", [False, True])
def test_every_param_has_one_known_logical_name_per_dim(scan_layers: bool) -> None:
    cfg = tiny(scan_layers=scan_layers, tie_embeddings=False)
    shapes = nn.meta.unbox(abstract_variables(cfg))["params"]
    specs = logical_param_axes(cfg)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, PartitionSpec))
    shape_leaves = jax.tree.leaves(shapes)
    assert jax.tree.structure(shapes) == jax.tree.structure(
        specs, is_leaf=lambda s: isinstance(s, PartitionSpec))
    for spec, shape in zip(spec_leaves, shape_leaves, strict=True):
        assert len(spec) == len(shape.shape), (spec, shape)
        assert set(spec) <= LOGICAL_PARAM_NAMES, spec
        assert shape.dtype == jnp.float32


def test_init_distributions_and_boxed_leaves() -> None:
    cfg = tiny(vocab_size=256, model_dims=48, hidden_dims=96, num_heads=4, dims_per_head=12,
               max_seq_len=64, init_std=0.05, softmax_init_std=0.2)
    # A fast PRNG keeps this one real init cheap on CPU; the initialisers are what is tested.
    key = jax.random.key(0, impl="unsafe_rbg")
    variables = jax.jit(Transformer(cfg).init)({"params": key}, jnp.zeros((1, 4), jnp.int32))
    boxed = jax.tree.leaves(variables, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert all(isinstance(leaf, nn.LogicallyPartitioned) for leaf in boxed)
    params = nn.meta.unbox(variables)["params"]
    np.testing.assert_allclose(np.std(params["embedding"]["embedding"]), 0.2, rtol=0.05)
    np.testing.assert_allclose(np.std(params["position_embedding"]["embedding"]), 0.05,
                               rtol=0.05)
    layer = params["layers_1"]
    for kernel in (layer["attention"]["qkv"]["kernel"], layer["attention"]["out"]["kernel"],
                   layer["mlp"]["wi"]["kernel"], layer["mlp"]["wo"]["kernel"]):
        np.testing.assert_allclose(np.std(kernel), 0.05, rtol=0.1)
        assert abs(float(np.mean(kernel))) < 0.01
    np.testing.assert_array_equal(layer["mlp"]["wi"]["bias"], 0.0)
    np.testing.assert_array_equal(layer["pre_mlp_norm"]["scale"], 1.0)


# ---------------------------------------------------------------- numerics

@pytest.mark.parametrize("tie_embeddings", [True, False])
@pytest.mark.parametrize("packed", [False, True])
def test_forward_matches_float64_numpy(tie_embeddings: bool, packed: bool) -> None:
    cfg = tiny(tie_embeddings=tie_embeddings)
    params = random_params(cfg, seed=1)
    tokens = _tokens(2, 9, seed=2)
    positions = segment_ids = None
    if packed:
        segment_ids = np.array([[1, 1, 1, 1, 2, 2, 2, 2, 2], [1, 1, 1, 1, 1, 1, 2, 2, 3]])
        positions = np.array([[0, 1, 2, 3, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1, 0]])
    got = Transformer(cfg).apply(
        {"params": params}, tokens,
        positions=None if positions is None else jnp.asarray(positions, jnp.int32),
        segment_ids=None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32))
    assert got.dtype == jnp.float32 and got.shape == (2, 9, 32)
    want = np_forward(cfg, params, np.asarray(tokens), positions=positions,
                      segment_ids=segment_ids)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("activation", [Activation.GELU, Activation.RELU, Activation.SILU])
def test_variant_forward_matches_float64_numpy(activation: Activation) -> None:
    """RMSNorm, no biases, no position table, untied, and each non-default activation."""
    cfg = tiny(norm="rms_norm", activation=activation.value, use_bias=False,
               learned_position_embedding=False, tie_embeddings=False, norm_epsilon=1e-3)
    params = random_params(cfg, seed=3)
    tokens = _tokens(2, 7, seed=4)
    got = Transformer(cfg).apply({"params": params}, tokens)
    want = np_forward(cfg, params, np.asarray(tokens))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=2e-5)


def test_packed_row_equals_documents_run_alone() -> None:
    cfg = tiny()
    params = random_params(cfg, seed=5)
    model = Transformer(cfg)
    apply = jax.jit(model.apply)
    doc_a, doc_b = _tokens(1, 5, seed=6), _tokens(1, 4, seed=7)
    packed = jnp.concatenate([doc_a, doc_b], axis=1)
    positions = jnp.asarray([[0, 1, 2, 3, 4, 0, 1, 2, 3]], jnp.int32)
    segment_ids = jnp.asarray([[1, 1, 1, 1, 1, 2, 2, 2, 2]], jnp.int32)
    got = apply({"params": params}, packed, positions=positions, segment_ids=segment_ids)
    alone_a = apply({"params": params}, doc_a)
    alone_b = apply({"params": params}, doc_b)
    np.testing.assert_allclose(got[:, :5], alone_a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[:, 5:], alone_b, rtol=1e-5, atol=1e-5)
    # Without segment ids the second document does see the first.
    leaky = apply({"params": params}, packed, positions=positions)
    assert np.abs(np.asarray(leaky[:, 5:] - alone_b)).max() > 1e-3


def test_scan_layers_equals_unrolled_layers() -> None:
    cfg = tiny(num_layers=3)
    params = random_params(cfg, seed=8)
    tokens = _tokens(2, 8, seed=9)
    unrolled = jax.jit(Transformer(cfg).apply)({"params": params}, tokens)
    scan_cfg = dataclasses.replace(cfg, scan_layers=True)
    stacked = stack_layers(params, cfg.num_layers)
    assert jax.tree.map(jnp.shape, stacked) == jax.tree.map(
        jnp.shape, nn.meta.unbox(abstract_variables(scan_cfg))["params"])
    scanned = jax.jit(Transformer(scan_cfg).apply)({"params": stacked}, tokens)
    np.testing.assert_allclose(scanned, unrolled, rtol=1e-5, atol=1e-5)


def _loss_and_grads(cfg: TransformerConfig, params: Any, tokens: jax.Array) -> Any:
    def loss_fn(p: Any) -> jax.Array:
        logits = Transformer(cfg).apply({"params": p}, tokens[:, :-1])
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
    return jax.jit(jax.value_and_grad(loss_fn))(params)


@pytest.fixture(scope="module")
def reference() -> Callable[[bool], dict[str, Any]]:
    """Single-device, no-remat loss and grads, computed once per layer layout (compiles are
    the slow part of these tests on CPU)."""
    cache: dict[bool, dict[str, Any]] = {}

    def get(scan_layers: bool) -> dict[str, Any]:
        if scan_layers not in cache:
            cfg = tiny(scan_layers=scan_layers)
            params = random_params(tiny(), seed=10)
            if scan_layers:
                params = stack_layers(params, cfg.num_layers)
            tokens = _tokens(4, 9, seed=11)
            loss, grads = _loss_and_grads(cfg, params, tokens)
            assert float(jnp.abs(grads["final_norm"]["scale"]).max()) > 0.0
            cache[scan_layers] = dict(cfg=cfg, params=params, tokens=tokens, loss=loss,
                                      grads=grads)
        return cache[scan_layers]

    return get


# Each policy once; SAVE_NOTHING with scan as in Pax GPT175B (compiles dominate the run time).
@pytest.mark.parametrize("scan_layers,policy", [
    (False, RematPolicy.SAVE_EVERYTHING),
    (False, RematPolicy.SAVE_DOT_WITH_NO_BATCH_DIM),
    (True, RematPolicy.SAVE_NOTHING),
])
def test_remat_policies_give_same_loss_and_grads(
        reference: Callable[[bool], dict[str, Any]], scan_layers: bool,
        policy: RematPolicy) -> None:
    ref = reference(scan_layers)
    cfg = dataclasses.replace(ref["cfg"], remat_policy=policy)
    loss, grads = _loss_and_grads(cfg, ref["params"], ref["tokens"])
    np.testing.assert_allclose(loss, ref["loss"], rtol=1e-6)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6),
                 grads, ref["grads"])


def test_bfloat16_compute_is_close_to_float32() -> None:
    cfg = tiny()
    params = random_params(cfg, seed=12)
    tokens = _tokens(2, 8, seed=13)
    want = jax.jit(Transformer(cfg).apply)({"params": params}, tokens)
    bf16_cfg = tiny(dtype="bfloat16")
    got = jax.jit(Transformer(bf16_cfg).apply)({"params": params}, tokens)
    assert got.dtype == jnp.float32
    # Params stay float32 whatever the compute dtype.
    abstract = nn.meta.unbox(abstract_variables(bf16_cfg))["params"]
    assert {leaf.dtype for leaf in jax.tree.leaves(abstract)} == {jnp.dtype(jnp.float32)}
    err = np.abs(np.asarray(got) - np.asarray(want)).max()
    scale = np.abs(np.asarray(want)).max()
    assert err < 0.05 * scale, (err, scale)
    assert err > 0.0  # bf16 was really used


def test_dropout_only_acts_when_not_deterministic() -> None:
    tokens = _tokens(2, 8, seed=14)
    params = random_params(tiny(), seed=15)
    plain = Transformer(tiny()).apply({"params": params}, tokens)
    model = Transformer(tiny(dropout_prob=0.5, input_dropout_prob=0.3))
    det = model.apply({"params": params}, tokens, deterministic=True)
    np.testing.assert_array_equal(det, plain)
    rngs = {"dropout": jax.random.key(0, impl="unsafe_rbg")}
    apply = jax.jit(functools.partial(model.apply, deterministic=False))
    noisy = apply({"params": params}, tokens, rngs=rngs)
    assert np.abs(np.asarray(noisy - plain)).max() > 1e-2
    again = apply({"params": params}, tokens, rngs=rngs)
    np.testing.assert_array_equal(noisy, again)  # same rng, same mask


# ---------------------------------------------------------------- sharding

@pytest.mark.parametrize("scan_layers", [False, True])
def test_sharded_grads_equal_single_device_grads(
        reference: Callable[[bool], dict[str, Any]], scan_layers: bool) -> None:
    """(2,2,2,1) mesh, FSDP x tensor sharded weights, batch over (data, fsdp, expert), under the
    rules and mesh context the trainer uses: loss and every gradient match one device.

    The rules are the product's table (`paxlite.parallel.rules.DEFAULT_RULES`, what
    `compile_steps` traces under), not a copy: a change to the table is tested here too."""
    ref = reference(scan_layers)
    cfg = ref["cfg"]
    # The trainer's mesh always has the expert axis (size 1 here): the rules name it for the batch.
    mesh = jax.make_mesh(
        (1, 2, 2, 1, 2, 1),
        ("pipeline", "data", "fsdp", "seq", "tensor", "expert"),
        axis_types=(AxisType.Auto,) * 6,
    )
    shardings = nn.logical_to_mesh_sharding(logical_param_axes(cfg), mesh, DEFAULT_RULES)
    params = jax.device_put(ref["params"], shardings)
    assert params["embedding"]["embedding"].sharding.spec == PartitionSpec("tensor", "fsdp")
    tokens = jax.device_put(ref["tokens"], batch_sharding(mesh))
    assert tokens.sharding.spec == PartitionSpec(("data", "fsdp", "expert"), None)
    with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
        loss, grads = _loss_and_grads(cfg, params, tokens)
    np.testing.assert_allclose(loss, ref["loss"], rtol=1e-5)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5),
                 grads, ref["grads"])


# ---------------------------------------------------------------- validation

def test_config_accepts_enum_values_as_strings() -> None:
    cfg = tiny(norm="rms_norm", activation="silu", remat_policy="save_dot_with_no_batch_dim")
    assert cfg.norm is NormKind.RMS_NORM
    assert cfg.activation is Activation.SILU
    assert cfg.remat_policy is RematPolicy.SAVE_DOT_WITH_NO_BATCH_DIM


@pytest.mark.parametrize("overrides,message", [
    (dict(dtype="bf16"), r"dtype='bf16' is not valid; expected one of 'float32', 'bfloat16'"),
    (dict(param_dtype="float16"), r"param_dtype='float16'"),
    (dict(num_heads=0), r"num_heads=0 must be a positive integer"),
    (dict(vocab_size=3.5), r"vocab_size=3.5 must be a positive integer"),
    (dict(dropout_prob=1.0), r"dropout_prob=1.0 must be a probability in \[0, 1\)"),
    (dict(input_dropout_prob=-0.1), r"input_dropout_prob=-0.1"),
    (dict(norm="batch_norm"), r"norm='batch_norm' is not valid; expected one of 'layer_norm'"),
    (dict(activation="swish"), r"activation='swish'.*'gelu_tanh', 'gelu', 'relu', 'silu'"),
    (dict(remat_policy="full"), r"remat_policy='full'.*'save_nothing'"),
    (dict(init_std=0.0), r"init_std=0.0 must be a positive number"),
    (dict(softmax_init_std=-1.0), r"softmax_init_std=-1.0"),
    (dict(scan_layers="yes"), r"scan_layers='yes' must be True or False"),
])
def test_config_validation_names_field_and_valid_values(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny(**overrides)


def test_call_rejects_bad_shapes() -> None:
    cfg = tiny()
    params = random_params(cfg, seed=18)
    model = Transformer(cfg)
    with pytest.raises(ValueError, match=r"length 13 exceeds max_seq_len=12"):
        model.apply({"params": params}, jnp.zeros((1, 13), jnp.int32))
    with pytest.raises(ValueError, match=r"segment_ids must have the shape of tokens"):
        model.apply({"params": params}, jnp.zeros((1, 4), jnp.int32),
                    segment_ids=jnp.zeros((1, 5), jnp.int32))
