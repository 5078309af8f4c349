"""Streaming Meta -> paxlite (`meta.open_meta` / `meta.write_paxlite`, ``convert --from=meta
--to=paxlite``): the checkpoint equals the in-memory conversion (``hf.from_meta``) bit for bit,
scanned or not, in float32 and bfloat16; logits equal transformers'; the shards are unmapped after
each layer; bad input fails with one error before the output directory exists."""

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest

from paxlite.__main__ import main
from paxlite.checkpointing.pretrained import load_model_config, restore_params
from paxlite.cli.convert import (
    ConvertRequest,
    Source,
    Target,
    adopt_config,
    convert,
    experiment_model_config,
)
from paxlite.errors import UserError
from paxlite.interop import hf, meta
from paxlite.interop.hf_write import numpy_dtype
from tests.interop.conftest import TOKENS, hf_logits
from tests.interop.test_meta import write_meta

TOL = 1e-4
VOCAB = 256  # params.json says -1, as Meta's do
TINY_LLAMA = ("NUM_LAYERS=2", "NUM_HEADS=4", "NUM_KV_HEADS=2", "MODEL_DIMS=64", "HIDDEN_DIMS=172",
              "DIMS_PER_HEAD=16", "VOCAB_SIZE=256", "LAYERNORM_EPSILON=1e-6",
              "USE_REPEATED_LAYER=true")


@pytest.fixture(scope="module")
def meta_gqa(llama_gqa, tmp_path_factory):
    """The tiny GQA LLaMA as 2 Meta shards, float32."""
    directory = tmp_path_factory.mktemp("meta") / "gqa"
    write_meta(directory, llama_gqa[1], permute=True)
    return directory


@pytest.fixture(scope="module")
def meta_mha_bf16(llama_mha, tmp_path_factory):
    """The tiny MHA LLaMA (paxlite's fused qkv) as 2 Meta shards, bfloat16 as Meta stores them."""
    import torch

    directory = tmp_path_factory.mktemp("meta") / "mha_bf16"
    write_meta(directory, llama_mha[1], permute=True, dtype=torch.bfloat16)
    return directory


def _restored(path, config):
    """{leaf path: array} of a paxlite checkpoint, restored in the dtype it was written in."""
    from flax import linen as nn

    from paxlite.models.transformer import abstract_variables

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    dtype = numpy_dtype(config.param_dtype)
    abstract = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=device),
                            nn.meta.unbox(abstract_variables(config)["params"]))
    _, params = restore_params(path, abstract)
    return {jax.tree_util.keystr(p): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}


def _assert_same_checkpoint(have_dir, want_dir):
    config_json = json.loads((want_dir / "model_config.json").read_text())
    assert json.loads((have_dir / "model_config.json").read_text()) == config_json
    config = load_model_config(want_dir)
    want, have = _restored(want_dir, config), _restored(have_dir, config)
    assert sorted(have) == sorted(want)
    for name in want:
        assert have[name].dtype == want[name].dtype, name
        assert have[name].tobytes() == want[name].tobytes(), name
    return config


@pytest.mark.parametrize(("stored", "dtype", "scan_layers"), [
    ("meta_gqa", "float32", False),
    ("meta_gqa", "bfloat16", True),
    ("meta_mha_bf16", "float32", True),
    ("meta_mha_bf16", "bfloat16", False),
])
def test_streamed_checkpoint_equals_the_in_memory_one(request, tmp_path, stored, dtype,
                                                      scan_layers):
    directory = request.getfixturevalue(stored)
    pretrained = hf.from_meta(directory, vocab_size=VOCAB, dtype=dtype)
    config = dataclasses.replace(pretrained.config, scan_layers=scan_layers)
    hf.to_paxlite(dataclasses.replace(pretrained, config=config), tmp_path / "in_memory")
    source = meta.open_meta(directory, vocab_size=VOCAB, dtype=dtype)
    assert source.config == pretrained.config
    num_params = meta.write_paxlite(source, tmp_path / "streamed",
                                    config=dataclasses.replace(source.config,
                                                               scan_layers=scan_layers))
    assert num_params == pretrained.num_params
    saved = _assert_same_checkpoint(tmp_path / "streamed", tmp_path / "in_memory")
    assert saved.scan_layers is scan_layers and saved.param_dtype == dtype


@pytest.mark.parametrize("embedding_axis", [1, 0], ids=["llama2_split", "llama3_split"])
def test_command_line_logits_equal_transformers(meta_gqa, llama_gqa, tmp_path, capsys,
                                                embedding_axis):
    _, model = llama_gqa
    directory = meta_gqa
    if embedding_axis == 0:  # LLaMA-3 splits the token embedding along the vocabulary
        directory = tmp_path / "llama3_split"
        write_meta(directory, model, permute=True, embedding_axis=0)
    rc = main(["convert", "--from=meta", "--to=paxlite", f"--input={directory}",
               f"--output={tmp_path / 'pax'}", f"--vocab_size={VOCAB}"])
    assert rc == 0
    count = sum(p.numel() for p in model.parameters())
    assert f"converted llama meta -> paxlite: {count:,} parameters" in capsys.readouterr().out
    restored = hf.from_paxlite(tmp_path / "pax")
    np.testing.assert_allclose(restored.logits(TOKENS), hf_logits(model), atol=TOL, rtol=0)


def test_fdl_config_writes_the_experiments_scanned_layout(meta_gqa, tmp_path):
    convert(ConvertRequest(source=Source.META, target=Target.PAXLITE, input=str(meta_gqa),
                           output=str(tmp_path / "streamed"), vocab_size=VOCAB,
                           fdl_config="LLaMA7B", assignments=TINY_LLAMA))
    experiment = experiment_model_config("LLaMA7B", TINY_LLAMA)
    reference = adopt_config(hf.from_meta(meta_gqa, vocab_size=VOCAB), config=experiment,
                             experiment="LLaMA7B")
    hf.to_paxlite(reference, tmp_path / "in_memory")
    saved = _assert_same_checkpoint(tmp_path / "streamed", tmp_path / "in_memory")
    assert saved.scan_layers is True and saved.dtype == "bfloat16"  # the experiment's
    assert saved.param_dtype == "float32"  # the conversion's


def _mapped(directory) -> int:
    """How many memory mappings of ``directory``'s files this process holds."""
    with open("/proc/self/maps") as f:
        return sum(str(directory) in line for line in f)


def test_shards_are_unmapped_after_each_layer(meta_gqa):
    tensors = meta.open_meta(meta_gqa, vocab_size=VOCAB).tensors
    assert _mapped(meta_gqa) == 0  # opening read the pickles and the norms, and let go
    layer_0 = sorted(n for n in tensors if n.startswith("layers.0."))
    kept = [tensors[layer_0[0]]]
    assert _mapped(meta_gqa) > 0  # the shards, while layer 0 is read
    kept += [tensors[name] for name in layer_0[1:]]
    assert _mapped(meta_gqa) == 0  # the whole layer read: unmapped, though its arrays live
    kept.append(tensors["layers.1.attention.wq.weight"])
    assert _mapped(meta_gqa) > 0
    kept.append(tensors["tok_embeddings.weight"])  # another group: layer 1's mapping goes
    assert _mapped(meta_gqa) == 0
    np.testing.assert_array_equal(kept[-1], meta.load_meta(meta_gqa, vocab_size=VOCAB)[1]
                                  ["embedding"]["embedding"])


def _edit_shards(directory, edit) -> None:
    import torch

    for path in sorted(directory.glob("consolidated.*.pth")):
        state = torch.load(path, weights_only=True)
        edit(int(path.name.split(".")[1]), state)
        torch.save(state, path)


def _break(directory, how):
    import torch

    if how == "missing tensor":
        _edit_shards(directory, lambda i, s: s.pop("layers.1.feed_forward.w3.weight"))
    elif how == "extra tensor":
        _edit_shards(directory, lambda i, s: s.update({"layers.0.attention.extra": torch.ones(3)}))
    elif how == "wrong shape":
        def wider(i, s):
            s["layers.1.attention.wk.weight"] = torch.zeros(24, 64)
        _edit_shards(directory, wider)
    elif how == "missing last shard":
        os.remove(directory / "consolidated.01.pth")
    elif how == "missing first shard":
        os.remove(directory / "consolidated.00.pth")
    elif how == "truncated shard":
        data = (directory / "consolidated.01.pth").read_bytes()
        (directory / "consolidated.01.pth").write_bytes(data[: len(data) // 2])
    elif how == "shards differ":
        _edit_shards(directory, lambda i, s: s.pop("norm.weight") if i == 1 else None)
    elif how == "replicated differ":
        _edit_shards(directory, lambda i, s: s["layers.0.ffn_norm.weight"].add_(i))
    elif how == "not a tensor":
        _edit_shards(directory, lambda i, s: s.update({"step": "100"}))
    elif how == "integer tensor":
        def quantized(i, s):
            s["layers.0.attention.wq.weight"] = s["layers.0.attention.wq.weight"].to(torch.int8)
        _edit_shards(directory, quantized)


@pytest.mark.parametrize(("how", "match"), [
    ("missing tensor", r"missing tensors: layers\.1\.feed_forward\.w3\.weight$"),
    ("extra tensor",
     r"unexpected tensors \(not part of this model\): layers\.0\.attention\.extra$"),
    ("wrong shape", (r"layers\.1\.attention\.wk\.weight has 48 rows but n_kv_heads \* "
                     r"\(dim / n_heads\) = 2 \* 16 = 32")),
    ("missing last shard", (r"holds 1 Meta shard\(s\), but the checkpoint is split 2 ways .*"
                            r"consolidated\.01\.pth is missing")),
    ("missing first shard", r"not numbered 00\.\.00: found \[1\]"),
    ("truncated shard", r"consolidated\.01\.pth as a torch checkpoint .*: a truncated or corrupt"),
    ("shards differ", r"Meta shard 1 holds different tensors from shard 0: \['norm\.weight'\]"),
    ("replicated differ",
     r"disagree on the replicated tensor layers\.0\.ffn_norm\.weight \(shard 1 vs 0\)"),
    ("not a tensor", r"entry 'step' is a str, not a tensor"),
    ("integer tensor", (r"layers\.0\.attention\.wq\.weight is stored as torch\.int8; paxlite "
                        r"converts float weights only")),
])
def test_bad_input_fails_before_the_output_exists(meta_gqa, tmp_path, monkeypatch, how, match):
    from paxlite.interop import stream

    def write_subtrees(*args, **kwargs):
        raise AssertionError("began writing the output")

    monkeypatch.setattr(stream, "write_subtrees", write_subtrees)
    directory = tmp_path / "in"
    shutil.copytree(meta_gqa, directory)
    _break(directory, how)
    with pytest.raises(UserError, match=match):
        convert(ConvertRequest(source=Source.META, target=Target.PAXLITE, input=str(directory),
                               output=str(tmp_path / "out"), vocab_size=VOCAB))
    assert not os.path.exists(tmp_path / "out")
    assert not os.path.exists(tmp_path / "out.partial")


@pytest.mark.parametrize(("stored", "dtype"), [("meta_gqa", "bfloat16"),
                                               ("meta_mha_bf16", "float32")])
def test_meta_to_hf_streams_the_in_memory_export(request, tmp_path, stored, dtype):
    """--from=meta --to=hf, read one layer at a time, writes the safetensors the whole-model path
    (`hf.save(hf.from_meta(...))`) writes, byte for byte, here in several shards."""
    from tests.interop.test_stream_read import _assert_same_export

    directory = request.getfixturevalue(stored)
    hf.save(hf.from_meta(directory, vocab_size=VOCAB, dtype=dtype), tmp_path / "want",
            dtype=dtype, max_shard_size="60KB")
    summary = convert(ConvertRequest(source=Source.META, target=Target.HF, input=str(directory),
                                     output=str(tmp_path / "have"), vocab_size=VOCAB, dtype=dtype,
                                     max_shard_size="60KB"))
    assert summary.num_params == hf.from_meta(directory, vocab_size=VOCAB).num_params
    assert "model.safetensors.index.json" in os.listdir(tmp_path / "have")
    _assert_same_export(tmp_path / "have", tmp_path / "want")
