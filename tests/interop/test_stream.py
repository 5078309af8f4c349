"""Streaming HF -> paxlite: sharded safetensors read lazily, the checkpoint written layer by layer
is the one Orbax writes (bit for bit, restored sharded), and bad input fails before any output."""

import dataclasses
import json
import os
import pathlib
import shutil

import jax
import numpy as np
import pytest

from paxlite.checkpointing.pretrained import restore_params
from paxlite.cli.convert import ConvertRequest, Source, Target, convert
from paxlite.errors import UserError
from paxlite.interop import hf, stream
from tests.interop.conftest import TOKENS, hf_logits

TOL = 1e-4


@pytest.fixture(scope="module")
def sharded_llama(llama_gqa, tmp_path_factory):
    """The tiny GQA LLaMA saved by transformers in several safetensors shards with an index."""
    _, model = llama_gqa
    directory = tmp_path_factory.mktemp("sharded") / "llama"
    model.save_pretrained(directory, max_shard_size="60KB")
    assert os.path.exists(directory / "model.safetensors.index.json")
    return directory, model


def _to_paxlite(source, output, **kw):
    return convert(ConvertRequest(source=Source.HF, target=Target.PAXLITE, input=str(source),
                                  output=str(output), **kw))


def _leaves(tree):
    return {jax.tree_util.keystr(p): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_sharded_input_streams_to_a_checkpoint_with_the_same_logits(sharded_llama, tmp_path):
    directory, model = sharded_llama
    summary = _to_paxlite(directory, tmp_path / "pax")
    assert summary.num_params == sum(p.numel() for p in model.parameters())
    restored = hf.from_paxlite(tmp_path / "pax")
    np.testing.assert_allclose(restored.logits(TOKENS), hf_logits(model), atol=TOL, rtol=0)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_streamed_checkpoint_equals_the_orbax_one(sharded_llama, tmp_path, scan_layers):
    directory, _ = sharded_llama
    pretrained = hf.load(directory)
    config = dataclasses.replace(pretrained.config, scan_layers=scan_layers)
    hf.to_paxlite(dataclasses.replace(pretrained, config=config), tmp_path / "orbax")
    stream.write_paxlite(stream.open_hf(directory, dtype="float32"), tmp_path / "streamed",
                         config=config)
    assert (json.loads((tmp_path / "streamed" / "model_config.json").read_text())
            == json.loads((tmp_path / "orbax" / "model_config.json").read_text()))
    from flax import linen as nn

    from paxlite.models.transformer import abstract_variables

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    spec = jax.sharding.PartitionSpec
    abstract = nn.meta.unbox(abstract_variables(config)["params"])

    def sharded(leaf):  # last axis over "model" where it divides: restored sharded onto a mesh
        axes = [None] * leaf.ndim
        if leaf.ndim and leaf.shape[-1] % 4 == 0:
            axes[-1] = "model"
        return jax.ShapeDtypeStruct(leaf.shape, np.float32,
                                    sharding=jax.sharding.NamedSharding(mesh, spec(*axes)))

    abstract = jax.tree.map(sharded, abstract)
    _, want = restore_params(tmp_path / "orbax", abstract)
    _, have = restore_params(tmp_path / "streamed", abstract)
    want, have = _leaves(want), _leaves(have)
    assert sorted(have) == sorted(want)
    for name in want:
        assert have[name].tobytes() == want[name].tobytes(), name


def test_bfloat16_streamed(sharded_llama, tmp_path):
    directory, _ = sharded_llama
    _to_paxlite(directory, tmp_path / "bf16", dtype="bfloat16")
    restored = hf.from_paxlite(tmp_path / "bf16", dtype="float32")
    expect = hf.cast_params(hf.load(directory, dtype="bfloat16").params, "float32")
    have, want = _leaves(restored.params), _leaves(expect)
    for name in want:
        np.testing.assert_array_equal(have[name], want[name], err_msg=name)


def _broken(sharded_llama, tmp_path, how):
    directory = tmp_path / "in"
    shutil.copytree(sharded_llama[0], directory)
    shards = sorted(p for p in os.listdir(directory) if p.endswith(".safetensors"))
    if how == "truncated":
        data = (directory / shards[1]).read_bytes()
        (directory / shards[1]).write_bytes(data[: len(data) // 2])
    elif how == "missing":
        os.remove(directory / shards[-1])
    elif how == "misplaced":
        index = json.loads((directory / "model.safetensors.index.json").read_text())
        name = min(index["weight_map"])
        index["weight_map"][name] = next(s for s in shards if s != index["weight_map"][name])
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory, shards


@pytest.mark.parametrize(("how", "match"), [
    ("truncated", (r"model-00002-of-\d+\.safetensors is not a complete safetensors file .*"
                  "download it again")),
    ("missing", r"names 1 shard\(s\) that are not in .*: model-000(\d+)-of-000\1\.safetensors"),
    ("misplaced", r"places 1 tensor\(s\) where they are not"),
])
def test_bad_shards_refused_before_writing(sharded_llama, tmp_path, how, match):
    directory, _ = _broken(sharded_llama, tmp_path, how)
    for target in (Target.PAXLITE, Target.HF):
        with pytest.raises(UserError, match=match):
            convert(ConvertRequest(source=Source.HF, target=target, input=str(directory),
                                   output=str(tmp_path / "out")))
        assert not os.path.exists(tmp_path / "out")
        assert not os.path.exists(tmp_path / "out.partial")


def test_quantized_tensor_refused_before_writing(sharded_llama, tmp_path):
    from safetensors.numpy import save_file

    directory = tmp_path / "in"
    shutil.copytree(sharded_llama[0], directory)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.norm.weight"]
    tensors = dict(hf.read_hf_tensors(directory))
    kept = {n: tensors[n] for n, f in index["weight_map"].items() if f == shard}
    kept["model.norm.weight"] = np.ones(kept["model.norm.weight"].shape, np.int8)
    save_file(kept, str(directory / shard))
    with pytest.raises(UserError, match=r"tensor model.norm.weight is stored as I8; paxlite "
                                        r"converts float weights only \(F32, BF16, F16, F64\)"):
        _to_paxlite(directory, tmp_path / "out")
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize(("change", "match"), [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling="),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0}},
     "rope_type 'yarn' is not one paxlite implements"),
    ({"model_type": "gemma3"}, "model_type='gemma3' is not supported"),  # gemma2 converts now
])
def test_unsupported_configs_refused_before_writing(sharded_llama, tmp_path, change, match):
    directory = tmp_path / "in"
    shutil.copytree(sharded_llama[0], directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UserError, match=match):
        _to_paxlite(directory, tmp_path / "out")
    assert not os.path.exists(tmp_path / "out")


def test_wrong_shape_refused_before_the_output_is_made(sharded_llama, tmp_path):
    directory = tmp_path / "in"
    shutil.copytree(sharded_llama[0], directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "intermediate_size": 100}))
    with pytest.raises(UserError, match=r"gate_proj.weight has 172 rows but intermediate_size=100"):
        _to_paxlite(directory, tmp_path / "out")
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(tmp_path / "out.partial")


def test_writer_chunks_rows_and_layers(tmp_path, monkeypatch):
    """Leaves split into several chunks (rows, and one layer per chunk) read back exactly."""
    import ml_dtypes

    from paxlite.checkpointing import stream_write

    monkeypatch.setattr(stream_write, "CHUNK_BYTES", 3 * 7 * 4)  # 3 rows of a [10, 7] float32
    rng = np.random.default_rng(0)
    table = rng.normal(size=(10, 7)).astype(np.float32)
    layers = rng.normal(size=(3, 5, 7)).astype(ml_dtypes.bfloat16)
    (tmp_path / "ck").mkdir()
    writer = stream_write.CheckpointWriter(str(tmp_path / "ck"))
    writer.write(("params", "table"), table)
    for i in range(3):
        writer.write_layer(("params", "layers", "w"), i, layers[i], num_layers=3)
    step_dir = writer.close()
    zarray = json.loads((pathlib.Path(step_dir) / "state" / "params.table" / ".zarray").read_text())
    assert zarray["chunks"] == [3, 7]
    abstract = {"table": jax.ShapeDtypeStruct((10, 7), np.float32),
                "layers": {"w": jax.ShapeDtypeStruct((3, 5, 7), np.float32)}}
    _, restored = restore_params(tmp_path / "ck", abstract)
    np.testing.assert_array_equal(np.asarray(restored["table"]), table)
    np.testing.assert_array_equal(np.asarray(restored["layers"]["w"]), layers.astype(np.float32))
