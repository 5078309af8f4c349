"""paxlite <-> Transformer Engine parameter trees (interop/te.py) and the convert command, on CPU.

The TE side is checked against an independent float64 NumPy forward of TE's TransformerLayer
semantics (zero-centred LayerNorm, fused qkv / kv, consecutive-pair RoPE, scaled causal softmax,
act(wi[:, 0]) * wi[:, 1]) run on the converted tree, compared with paxlite's own layer.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from paxlite.interop import te
from paxlite.interop.errors import ConversionError
from paxlite.models.transformer import LLAMA_ARCHITECTURE, Transformer, TransformerConfig
from paxlite.models.transformer_config import LayerImplementation

GPT = TransformerConfig(vocab_size=32, num_layers=2, model_dims=16, num_heads=4, dims_per_head=4,
                        hidden_dims=24, max_seq_len=8)
LLAMA = TransformerConfig(vocab_size=32, num_layers=2, model_dims=16, num_heads=4, dims_per_head=4,
                          hidden_dims=24, max_seq_len=8, num_kv_heads=2, tie_embeddings=False,
                          **LLAMA_ARCHITECTURE)


def _params(config, seed=0):
    tokens = jnp.zeros((1, 4), jnp.int32)
    params = nn.meta.unbox(
        Transformer(config).init({"params": jax.random.key(seed)}, tokens)["params"]
    )
    # random norm scales and biases, so that a dropped shift or bias would show
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    return jax.tree.unflatten(tree, [np.asarray(x + 0.1 * jax.random.normal(k, x.shape), np.float64)
                                     for x, k in zip(leaves, keys)])


@pytest.fixture(scope="module", params=["gpt", "llama"])
def model(request):
    config = GPT if request.param == "gpt" else LLAMA
    return config, _params(config)


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        else:
            out[prefix + k] = np.asarray(v)
    return out


def test_round_trip_is_identity(model):
    config, params = model
    back = te.params_from_te(te.params_to_te(params, config=config), config=config)
    a, b = _flat(params), _flat(back)
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_scanned_round_trip(model):
    from paxlite.interop import layouts

    config, params = model
    scanned = dataclasses.replace(config, scan_layers=True)
    stacked = layouts.stack_layers(params, num_layers=config.num_layers)
    te_tree = te.params_to_te(stacked, config=scanned)
    assert te_tree["layers"]["transformer_layer"]["mlp"]["wo_kernel"].shape == (2, 24, 16)
    back = te.params_from_te(te_tree, config=scanned)
    for name, value in _flat(stacked).items():
        np.testing.assert_array_equal(value, _flat(back)[name], err_msg=name)


def test_te_tree_has_te_names_and_shapes(model):
    config, params = model
    layer = _flat(te.params_to_te(params, config=config)["layers_0"])
    assert {k: v.shape for k, v in layer.items()} == te.te_param_shapes(config)
    if config is GPT:  # fused qkv, biases, LayerNorm (ln_bias), plain MLP: A = 1
        assert layer["transformer_layer/attention/qkv/kernel"].shape == (16, 3, 16)
        assert layer["transformer_layer/mlp/wi_kernel"].shape == (16, 1, 24)
        assert "transformer_layer/mlp/ln_bias" in layer
    else:  # GQA: query + kv [D, 2, K*H], no biases, RMSNorm, gated MLP: A = 2
        assert layer["transformer_layer/attention/kv/kernel"].shape == (16, 2, 8)
        assert layer["transformer_layer/attention/query/kernel"].shape == (16, 16)
        assert layer["transformer_layer/mlp/wi_kernel"].shape == (16, 2, 24)
        assert not [k for k in layer if k.endswith("bias")]


def test_norm_scale_shift_and_gate_order(model):
    config, params = model
    layer = te.params_to_te(params, config=config)["layers_0"]["transformer_layer"]
    src = params["layers_0"]
    norm_at = layer["attention"]["qkv" if config is GPT else "query"]
    shift = 1.0 if config is GPT else 0.0  # LayerNorm: zero-centred gamma; RMSNorm: as stored
    np.testing.assert_array_equal(norm_at["scale"], src["pre_attention_norm"]["scale"] - shift)
    if config is LLAMA:  # the activated half first (TE: act(x W[:, 0]) * (x W[:, 1]))
        np.testing.assert_array_equal(
            layer["mlp"]["wi_kernel"][:, 0], src["mlp"]["wi_gate"]["kernel"]
        )
        np.testing.assert_array_equal(layer["mlp"]["wi_kernel"][:, 1], src["mlp"]["wi"]["kernel"])


# ---------------------------------------------------------------- reference forward
def _te_norm(x, p, config):
    if config.norm.value == "layer_norm":  # zero-centred gamma
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + config.norm_epsilon) * (1 + p["scale"]) + p["ln_bias"]
    return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + config.norm_epsilon) * p["scale"]


# TE rotary_pos_emb, group_method='consecutive', windows (1, theta)
def _rope_consecutive(x, theta):
    t, h = x.shape[1], x.shape[-1]
    scales = theta ** (2 * np.arange(h // 2) / h)
    ang = np.arange(t)[None, :, None, None] / np.repeat(scales, 2)[None, None, None, :]
    shifted = np.where(np.arange(h) % 2, np.roll(x, 1, -1), np.roll(x, -1, -1))
    return x * np.cos(ang) + shifted * np.sin(ang) * np.sign(np.arange(h) % 2 - 0.5)


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def _te_layer_forward(x, p, config):
    b, t, _ = x.shape
    n, h, k = config.num_heads, config.dims_per_head, config.kv_heads
    att = p["attention"]
    bias = (lambda q, name: q[name]) if config.use_bias else (lambda q, name: 0.0)
    if "qkv" in att:
        y = _te_norm(x, att["qkv"], config)
        qkv = np.einsum("btd,dcf->btcf", y, att["qkv"]["kernel"]) + bias(att["qkv"], "bias")
        q, kk, v = (qkv[:, :, i].reshape(b, t, n, h) for i in range(3))
    else:
        y = _te_norm(x, att["query"], config)
        q = (y @ att["query"]["kernel"] + bias(att["query"], "bias")).reshape(b, t, n, h)
        kv = np.einsum("btd,dcf->btcf", y, att["kv"]["kernel"]) + bias(att["kv"], "bias")
        kk, v = (kv[:, :, i].reshape(b, t, k, h) for i in range(2))
    if config.position_kind.value == "rotary":
        q, kk = _rope_consecutive(q, config.rope_theta), _rope_consecutive(kk, config.rope_theta)
    kk, v = np.repeat(kk, n // k, axis=2), np.repeat(v, n // k, axis=2)
    logits = np.einsum("btnh,bsnh->bnts", q, kk) / np.sqrt(h)
    logits = np.where(np.tril(np.ones((t, t), bool)), logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ctx = np.einsum("bnts,bsnh->btnh", probs, v).reshape(b, t, n * h)
    x = x + ctx @ att["out"]["kernel"] + bias(att["out"], "bias")
    m = p["mlp"]
    y = _te_norm(x, m, config)
    hid = np.einsum("btd,daf->btaf", y, m["wi_kernel"]) + bias(m, "wi_bias")
    if config.gated_mlp:
        g = hid[:, :, 0]
        act = g / (1 + np.exp(-g)) * hid[:, :, 1]
    else:
        act = _gelu_tanh(hid[:, :, 0])
    return x + act @ m["wo_kernel"] + bias(m, "wo_bias")


def test_te_tree_computes_paxlites_layer(model):
    """TE's layer semantics on the converted tree == paxlite's Block on the original params."""
    from paxlite.models.attention import make_attention_mask
    from paxlite.models.transformer import Block

    config, params = model
    x = np.asarray(jax.random.normal(jax.random.key(3), (2, 6, 16)), np.float64)
    mask = make_attention_mask(seq_len=6, segment_ids=None)
    positions = jnp.broadcast_to(jnp.arange(6), (2, 6))
    f32 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params["layers_0"])
    ours, _ = Block(config=config).apply({"params": f32}, jnp.asarray(x, jnp.float32), mask,
                                         positions if config is LLAMA else None)
    te_layer = te.params_to_te(params, config=config)["layers_0"]["transformer_layer"]
    ref = _te_layer_forward(x, te_layer, config)
    np.testing.assert_allclose(np.asarray(ours), ref, rtol=2e-4, atol=2e-4)


def test_moments_move_without_the_scale_shift(model):
    config, params = model
    moments = te.params_to_te(params, config=config, kind=te.Kind.MOMENTS)["layers_0"]
    at = moments["transformer_layer"]["attention"]["qkv" if config is GPT else "query"]
    np.testing.assert_array_equal(at["scale"], params["layers_0"]["pre_attention_norm"]["scale"])


def test_state_conversion_and_weight_only(model):
    config, params = model
    state = {"step": np.int32(7), "params": params,
             "opt_state": [{}, {"count": np.int32(7), "mu": params, "nu": params}, {}, {},
                           {"count": np.int32(7)}]}
    full = te.convert_state(state, config=config, to_te=True)
    assert full["opt_state"][1]["mu"]["layers_0"]["transformer_layer"]
    assert full["opt_state"][4] == {"count": 7}
    back = te.convert_state(full, config=config, to_te=False)
    np.testing.assert_array_equal(back["opt_state"][1]["nu"]["layers_1"]["mlp"]["wo"]["kernel"],
                                  params["layers_1"]["mlp"]["wo"]["kernel"])
    light = te.convert_state(
        state, config=config, to_te=True, options=te.TeOptions(weight_only=True)
    )
    assert "opt_state" not in light and int(light["step"]) == 7


@pytest.mark.parametrize(("config", "options", "message"), [
    (GPT, te.TeOptions(num_gqa_groups=2), "--num-gqa-groups=2 but the model has 4"),
    (GPT, te.TeOptions(te_qkv_layout=te.QkvLayout.KV_PACKED), "use --te-qkv-layout=qkv_packed"),
    (LLAMA, te.TeOptions(te_qkv_layout=te.QkvLayout.QKV_PACKED), "use --te-qkv-layout=kv_packed"),
    (GPT, te.TeOptions(skip_bias=True), "--skip-bias but the model has biases"),
    (GPT, te.TeOptions(use_gated_activations=True), "MLP is not gated"),
    (GPT, te.TeOptions(pax_split_qkv=True), "one fused qkv kernel"),
])
def test_contradicting_options_are_errors(config, options, message):
    with pytest.raises(ConversionError, match=message):
        te.resolve_options(config, options)


def test_pax_llama70b_options_fit_a_gqa_model():
    options = te.TeOptions(num_gqa_groups=2, te_qkv_layout=te.QkvLayout.KV_PACKED, skip_bias=True,
                           weight_only=True, use_gated_activations=True, pax_split_qkv=True)
    assert te.resolve_options(LLAMA, options) is te.QkvLayout.KV_PACKED


def test_te_cannot_build_moe_or_mismatched_heads():
    with pytest.raises(ValueError, match="num_heads x dims_per_head"):
        dataclasses.replace(GPT, dims_per_head=8, layer_implementation="transformer_engine")


# ---------------------------------------------------------------- the command
def _run(args):
    from paxlite.__main__ import main

    return main(["convert", *args])


def test_cli_round_trip_keeps_optimizer_state(tmp_path, capsys):
    from paxlite.checkpointing.pretrained import load_model_config, read_state, save_state

    params = _params(LLAMA)
    src = tmp_path / "src"
    state = {"params": params, "opt_state": [{}, {"count": np.int32(3), "mu": params, "nu": params},
                                             {}, {}, {"count": np.int32(3)}]}
    save_state(src, jax.tree.map(lambda a: np.asarray(a, np.float32), state), step=3,
               model_config=LLAMA)
    assert _run(["--from=paxlite", "--to=te", f"--input={src}", f"--output={tmp_path / 'te'}",
                 "--num-gqa-groups=2", "--te-qkv-layout=kv_packed", "--pax-split-qkv",
                 "--use-gated-activations", "--skip-bias"]) == 0
    te_config = load_model_config(tmp_path / "te")
    assert te_config.layer_implementation is LayerImplementation.TRANSFORMER_ENGINE
    step, _, te_state = read_state(tmp_path / "te")
    assert step == 3 and "transformer_layer" in te_state["opt_state"][1]["mu"]["layers_0"]
    assert _run(["--from=te", "--to=paxlite", f"--input={tmp_path / 'te'}",
                 f"--output={tmp_path / 'back'}"]) == 0
    _, _, back = read_state(tmp_path / "back")
    for name, value in _flat(params).items():
        np.testing.assert_allclose(_flat(back["params"])[name], value, rtol=1e-6, err_msg=name)
    assert json.loads((tmp_path / "back" / "model_config.json").read_text())[
        "layer_implementation"] == "paxlite"
    assert _run(["--from=paxlite", "--to=te", f"--input={src}", f"--output={tmp_path / 'w'}",
                 "--weight-only"]) == 0
    assert "opt_state" not in read_state(tmp_path / "w")[2]


@pytest.mark.parametrize(("args", "message"), [
    (["--from=paxlite", "--to=te", "--te-qkv-layout=qkv_packed"], "use --te-qkv-layout=kv_packed"),
    (["--from=hf", "--to=te"], "convert to and from paxlite only"),
    (["--from=paxlite", "--to=hf", "--weight-only"], "--weight-only only applies to --to=te"),
    (["--from=te", "--to=paxlite"], "is not a Transformer Engine model"),
])
def test_cli_errors_exit_2(tmp_path, capsys, args, message):
    from paxlite.checkpointing.pretrained import save_params

    save_params(tmp_path / "src", jax.tree.map(lambda a: np.asarray(a, np.float32), _params(LLAMA)),
                model_config=LLAMA)
    assert _run([*args, f"--input={tmp_path / 'src'}", f"--output={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not os.path.exists(tmp_path / "out")
