"""Pax's own checkpoints: built here with TensorStore as docs/interop.md ("Pax checkpoints")
describes them (names, shapes, zero-centred LayerNorm scales, ``repeat.sub``), read by
``convert --from=pax`` and directly as CHECKPOINT_RESTORE_PATH, written back by ``--to=pax``.

The reference model is paxlite's Transformer with the same random numbers placed by the hand-written
table `_reference_params` below (independent of paxlite/checkpointing/pax_layout.py's table): a
wrong name, axis order or scale shift in the product changes the logits.
"""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from flax import traverse_util

from paxlite.__main__ import main
from paxlite.checkpointing import pretrained
from paxlite.cli.convert import ConvertRequest, Source, Target, convert, experiment_model_config
from paxlite.interop import hf
from paxlite.models.transformer import Transformer

LLAMA = "paxlite.experiments.tiny.TinyLLaMA"  # 4 heads, 2 kv heads: separate q/k/v
LLAMA_MHA = (LLAMA, ("NUM_KV_HEADS=4",))  # fused combined_qkv
TOKENS = np.random.default_rng(1).integers(0, 256, size=(2, 12)).astype(np.int32)
P = "mdl_vars.params."


def _write(path, array):
    import tensorstore as ts

    array = np.ascontiguousarray(array)
    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(path)},
            "metadata": {"shape": list(array.shape), "chunks": list(array.shape) or [],
                         "dtype": array.dtype.str}}
    ts.open(spec, create=True).result().write(array).result()


def _pax_tensors(config, rng, *, separate_qkv):
    """{Pax name: array} per layer ('L.' prefix = one layer) and at the top, as Pax names them."""
    d, n, k, h, f, v = (config.model_dims, config.num_heads, config.kv_heads, config.dims_per_head,
                        config.hidden_dims, config.vocab_size)
    r = lambda *s: rng.normal(0, 0.3, s).astype(np.float32)
    gpt = config.use_bias
    layers = []
    for _ in range(config.num_layers):
        t = {"layer_norm.scale": r(d), "ff_layer.layer_norm.scale": r(d),
             "self_attention.post.w": r(d, n, h),
             "ff_layer.ffn_layer1.linear.w": r(d, f), "ff_layer.ffn_layer2.linear.w": r(f, d)}
        if separate_qkv:
            t.update({"self_attention.query.w": r(d, n, h), "self_attention.key.w": r(d, k, h),
                      "self_attention.value.w": r(d, k, h)})
        else:
            t["self_attention.combined_qkv.w"] = r(3, d, n, h)
        if gpt:
            t.update({"layer_norm.bias": r(d), "ff_layer.layer_norm.bias": r(d),
                      "self_attention.combined_qkv.b": r(3, n, h), "self_attention.post.b": r(d),
                      "ff_layer.ffn_layer1.bias.b": r(f), "ff_layer.ffn_layer2.bias.b": r(d)})
        else:
            t["ff_layer.ffn_layer1_gate.linear.w"] = r(d, f)
        layers.append(t)
    top = {"lm.softmax.logits_ffn.linear.w": r(d, v), "lm.final_ln.scale": r(d)}
    if gpt:
        top.update({"lm.final_ln.bias": r(d), "lm.position_emb.emb_var": r(config.max_seq_len, d)})
    else:
        top["lm.embedding_lookup.emb_var"] = r(v, d)
    return top, layers


def _reference_params(config, top, layers):
    """The same numbers in paxlite's unscanned tree, placed by hand."""
    gpt = config.use_bias
    one = 1.0 if gpt else 0.0  # praxis LayerNorm applies 1 + scale; LLaMA's RMSNorm the scale
    out = {"final_norm": {"scale": top["lm.final_ln.scale"] + one}}
    if gpt:
        out["final_norm"]["bias"] = top["lm.final_ln.bias"]
        out["embedding"] = {"embedding": top["lm.softmax.logits_ffn.linear.w"].T}
        out["position_embedding"] = {"embedding": top["lm.position_emb.emb_var"]}
    else:
        out["embedding"] = {"embedding": top["lm.embedding_lookup.emb_var"]}
        out["output"] = {"kernel": top["lm.softmax.logits_ffn.linear.w"]}
    for i, t in enumerate(layers):
        att = {"out": {"kernel": np.einsum("dnh->nhd", t["self_attention.post.w"])}}
        if "self_attention.query.w" in t and config.kv_heads != config.num_heads:
            att.update(
                {p: {"kernel": t[f"self_attention.{p}.w"]} for p in ("query", "key", "value")}
            )
        elif "self_attention.query.w" in t:
            att["qkv"] = {"kernel": np.stack([t[f"self_attention.{p}.w"]
                                              for p in ("query", "key", "value")], axis=1)}
        else:
            att["qkv"] = {"kernel": np.einsum("tdnh->dtnh", t["self_attention.combined_qkv.w"])}
        mlp = {"wi": {"kernel": t["ff_layer.ffn_layer1.linear.w"]},
               "wo": {"kernel": t["ff_layer.ffn_layer2.linear.w"]}}
        layer = {"pre_attention_norm": {"scale": t["layer_norm.scale"] + one},
                 "pre_mlp_norm": {"scale": t["ff_layer.layer_norm.scale"] + one},
                 "attention": att, "mlp": mlp}
        if gpt:
            layer["pre_attention_norm"]["bias"] = t["layer_norm.bias"]
            layer["pre_mlp_norm"]["bias"] = t["ff_layer.layer_norm.bias"]
            att["qkv"]["bias"] = t["self_attention.combined_qkv.b"]
            att["out"]["bias"] = t["self_attention.post.b"]
            mlp["wi"]["bias"] = t["ff_layer.ffn_layer1.bias.b"]
            mlp["wo"]["bias"] = t["ff_layer.ffn_layer2.bias.b"]
        else:
            mlp["wi_gate"] = {"kernel": t["ff_layer.ffn_layer1_gate.linear.w"]}
        out[f"layers_{i}"] = layer
    return out


def make_pax(directory, experiment, assignments=(), *, repeated=False, separate_qkv=False,
             seed=0, drop=None):
    """A Pax job directory: checkpoints/checkpoint_00000100/state/<arrays> (+ step); returns
    (directory, reference logits of TOKENS)."""
    config = experiment_model_config(experiment, assignments)
    top, layers = _pax_tensors(config, np.random.default_rng(seed), separate_qkv=separate_qkv)
    state = directory / "checkpoints" / "checkpoint_00000100" / "state"
    state.mkdir(parents=True)
    tensors = dict(top)
    if repeated:
        tensors.update({f"lm.transformer.repeat.sub.x_layers_0.{name}":
                        np.stack([t[name] for t in layers]) for name in layers[0]})
    else:
        tensors.update({f"lm.transformer.x_layers_{i}.{name}": a
                        for i, t in enumerate(layers) for name, a in t.items()})
    for name, array in tensors.items():
        if name != drop:
            _write(state / (P + name), array)
    _write(state / "step", np.asarray(100, np.int32))
    reference = _reference_params(config, top, layers)
    model = dataclasses.replace(config, scan_layers=False)
    logits = np.asarray(Transformer(model).apply({"params": reference}, TOKENS), np.float32)
    return directory, logits, reference


@pytest.fixture(scope="module")
def gpt_pax(tmp_path_factory):
    return make_pax(tmp_path_factory.mktemp("pax") / "gpt", "TinySynthetic")


@pytest.fixture(scope="module")
def gpt_pax_repeated(tmp_path_factory):
    return make_pax(tmp_path_factory.mktemp("pax") / "gpt_rep", "TinySynthetic", repeated=True)


@pytest.fixture(scope="module")
def llama_pax_separate(tmp_path_factory):
    return make_pax(tmp_path_factory.mktemp("pax") / "llama_gqa", LLAMA, separate_qkv=True)


@pytest.fixture(scope="module")
def llama_pax_fused(tmp_path_factory):
    return make_pax(tmp_path_factory.mktemp("pax") / "llama_mha", *LLAMA_MHA)


TOL = dict(atol=2e-5, rtol=1e-5)


def _convert(source, out, experiment, assignments=(), target=Target.PAXLITE):
    return convert(ConvertRequest(source=Source.PAX, target=target, input=str(source),
                                  output=str(out), fdl_config=experiment,
                                  assignments=tuple(assignments)))


@pytest.mark.parametrize("case,experiment,assignments", [
    ("gpt_pax", "TinySynthetic", ()),
    ("gpt_pax_repeated", "TinySyntheticRepeated", ()),  # repeat.sub -> a scanned stack
    ("gpt_pax_repeated", "TinySynthetic", ()),  # repeat.sub -> layers_<i>
    ("gpt_pax", "TinySyntheticRepeated", ()),  # x_layers_<i> -> a scanned stack
    ("llama_pax_separate", LLAMA, ()),
    ("llama_pax_fused", *LLAMA_MHA),
])
def test_convert_from_pax_gives_the_source_logits(request, tmp_path, case, experiment,
                                                  assignments):
    directory, logits, _ = request.getfixturevalue(case)
    _convert(directory, tmp_path / "out", experiment, assignments)
    saved = json.loads((tmp_path / "out" / "model_config.json").read_text())
    assert saved["scan_layers"] == experiment_model_config(experiment, assignments).scan_layers
    back = hf.from_paxlite(tmp_path / "out")
    np.testing.assert_allclose(back.logits(TOKENS), logits, **TOL)


def test_separate_qkv_names_into_a_fused_model(tmp_path):
    """saxml writes query/key/value for LLaMA-70B-style configs; with kv == heads paxlite fuses."""
    directory, logits, _ = make_pax(tmp_path / "src", *LLAMA_MHA, separate_qkv=True)
    _convert(directory, tmp_path / "out", *LLAMA_MHA)
    np.testing.assert_allclose(hf.from_paxlite(tmp_path / "out").logits(TOKENS), logits, **TOL)


def test_checkpoint_restore_path_reads_pax_directly(tmp_path, gpt_pax_repeated):
    """The Pax job dir (what run_llama_boolq.sh passes) initialises a run, exactly."""
    from paxlite.experiments.build import build_run_config
    from paxlite.train.loop import Run, RunContext

    directory, _, reference = gpt_pax_repeated
    config = build_run_config("TinySynthetic", [f"CHECKPOINT_RESTORE_PATH={str(directory)!r}",
                                                "MAX_STEPS=1"])[1]
    with Run(config, RunContext(job_dir=str(tmp_path / "job"))) as run:
        state = run.restore_or_init()
        restored = traverse_util.flatten_dict(jax.device_get(state.params), sep="/")
    want = traverse_util.flatten_dict(reference, sep="/")
    assert set(restored) == set(want)
    for name, value in want.items():
        np.testing.assert_array_equal(restored[name], value, err_msg=name)


def test_restore_params_of_llama_and_its_checkpoints_dir(llama_pax_separate):
    directory, _, reference = llama_pax_separate
    config = experiment_model_config(LLAMA)
    from flax import linen as nn

    from paxlite.models.transformer import abstract_variables

    abstract = nn.meta.unbox(abstract_variables(config)["params"])
    for path in (directory / "checkpoints", directory / "checkpoints" / "checkpoint_00000100"):
        step, params = pretrained.restore_params(path, abstract)
        assert step == 100
        assert pretrained.unread_checkpoint_params(abstract, rules=(), path=str(path)) == []
        got = traverse_util.flatten_dict(jax.device_get(params), sep="/")
        for name, value in traverse_util.flatten_dict(reference, sep="/").items():
            np.testing.assert_array_equal(got[name], value, err_msg=name)


@pytest.mark.parametrize("experiment,assignments,case", [
    ("TinySyntheticRepeated", (), "gpt_pax"), (LLAMA, (), "llama_pax_separate")])
def test_round_trip_paxlite_pax_paxlite_is_exact(request, tmp_path, experiment, assignments, case):
    directory, _, _ = request.getfixturevalue(case)
    _convert(directory, tmp_path / "a", experiment, assignments)
    rc = main(["convert", "--from=paxlite", "--to=pax", f"--input={tmp_path / 'a'}",
               f"--output={tmp_path / 'pax'}"])
    assert rc == 0
    step_dir = tmp_path / "pax" / "checkpoints" / "checkpoint_00000000"
    assert (step_dir / "commit_success.txt").exists()
    names = sorted(os.listdir(step_dir / "state"))
    assert "step" in names
    repeated = experiment_model_config(experiment, assignments).scan_layers
    assert any(".repeat.sub.x_layers_0." in n for n in names) == repeated
    _convert(tmp_path / "pax", tmp_path / "b", experiment, assignments)
    a, b = hf.from_paxlite(tmp_path / "a"), hf.from_paxlite(tmp_path / "b")
    flat_a = traverse_util.flatten_dict(a.params, sep="/")
    flat_b = traverse_util.flatten_dict(b.params, sep="/")
    assert set(flat_a) == set(flat_b)
    for name in flat_a:
        np.testing.assert_array_equal(flat_a[name], flat_b[name], err_msg=name)


# ---------------------------------------------------------------- bad input
def _cli(capsys, *args):
    rc = main(["convert", *args])
    return rc, capsys.readouterr().err


def test_a_different_size_names_the_tensor(capsys, tmp_path, gpt_pax):
    directory, _, _ = gpt_pax
    rc, err = _cli(capsys, "--from=pax", "--to=paxlite", f"--input={directory}",
                   f"--output={tmp_path / 'out'}", "--fdl_config=TinySynthetic",
                   "--fdl.HIDDEN_DIMS=128")
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert ("mdl_vars.params.lm.transformer.x_layers_0.ff_layer.ffn_layer1.linear.w has shape "
            "(64, 256), expected (64, 128)") in err
    assert not (tmp_path / "out").exists()


def test_more_layers_than_the_model_are_refused_and_named(capsys, tmp_path, gpt_pax):
    directory, _, _ = gpt_pax
    rc, err = _cli(capsys, "--from=pax", "--to=paxlite", f"--input={directory}",
                   f"--output={tmp_path / 'out'}", "--fdl_config=TinySynthetic",
                   "--fdl.NUM_LAYERS=1")
    assert (
        rc == 2 and "lm.transformer.x_layers_1." in err and "not a parameter of this model" in err
    )


def test_missing_tensor_is_named(capsys, tmp_path):
    name = "lm.transformer.x_layers_1.self_attention.post.w"
    directory, _, _ = make_pax(tmp_path / "src", "TinySynthetic", drop=name)
    rc, err = _cli(capsys, "--from=pax", "--to=paxlite", f"--input={directory}",
                   f"--output={tmp_path / 'out'}", "--fdl_config=TinySynthetic")
    assert rc == 2
    assert (f"{P}{name} is missing (expected shape (64, 8, 8), for paxlite's "
            "layers_1/attention/out/kernel)") in err


def test_restore_path_of_a_different_size_names_the_tensor(llama_pax_separate):
    directory, _, _ = llama_pax_separate
    config = experiment_model_config(LLAMA, ("HIDDEN_DIMS=32",))
    from flax import linen as nn

    from paxlite.models.transformer import abstract_variables

    abstract = nn.meta.unbox(abstract_variables(config)["params"])
    with pytest.raises(pretrained.PretrainedCheckpointError) as err:
        pretrained.restore_params(directory, abstract)
    assert "ffn_layer1.linear.w has shape (32, 64), expected (32, 32)" in str(err.value)


def test_output_with_a_checkpoint_and_missing_fdl_config_are_refused(capsys, tmp_path, gpt_pax):
    directory, _, _ = gpt_pax
    (tmp_path / "out" / "checkpoints").mkdir(parents=True)
    rc, err = _cli(capsys, "--from=pax", "--to=paxlite", f"--input={directory}",
                   f"--output={tmp_path / 'out'}", "--fdl_config=TinySynthetic")
    assert rc == 2 and str(tmp_path / "out") in err
    rc, err = _cli(capsys, "--from=pax", "--to=paxlite", f"--input={directory}",
                   f"--output={tmp_path / 'new'}")
    assert rc == 2 and "--from=pax needs --fdl_config" in err
