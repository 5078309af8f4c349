"""paxlite -> HF layer by layer: every checkpoint layout Orbax or the streaming writer makes
(OCDBT or not, scanned or not, chunked per layer, per device shard or whole) exports the same
safetensors, bit for bit, as restoring the whole model with Orbax and saving it."""

import dataclasses
import json
import os
import shutil
from unittest import mock

import jax
import numpy as np
import pytest

from paxlite.checkpointing import checkpoint
from paxlite.checkpointing.pretrained import PretrainedCheckpointError, find_checkpoint, save_params
from paxlite.checkpointing.stream_read import CheckpointReader
from paxlite.checkpointing.stream_write import write_subtrees
from paxlite.cli.convert import ConvertRequest, Source, Target, convert
from paxlite.interop import hf
from tests.interop.conftest import TOKENS, hf_logits


def _read_safetensors(directory) -> dict[str, np.ndarray]:
    """Every tensor of an HF directory, through safetensors' own reader (which checks the
    format)."""
    from safetensors import safe_open

    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), framework="numpy") as f:
                for key in f.keys():  # noqa: SIM118  safe_open is not iterable
                    assert key not in out
                    out[key] = f.get_tensor(key)
    return out


def _assert_same_export(have_dir, want_dir) -> None:
    have, want = _read_safetensors(have_dir), _read_safetensors(want_dir)
    assert sorted(have) == sorted(want)
    for key in want:
        assert have[key].dtype == want[key].dtype, key
        assert have[key].shape == want[key].shape, key
        np.testing.assert_array_equal(have[key].view(np.uint8), want[key].view(np.uint8),
                                      err_msg=key)
    for name in ("config.json", "generation_config.json"):
        assert (json.loads((have_dir / name).read_text())
                == json.loads((want_dir / name).read_text()))


def _export(checkpoint, output, **kw):
    return convert(ConvertRequest(source=Source.PAXLITE, target=Target.HF, input=str(checkpoint),
                                  output=str(output), **kw))


def _sharded_stacked(pretrained, mesh):
    """The scanned params as jax arrays sharded over the mesh's 4-way axis (last axis where it
    divides): Orbax then writes one chunk per device shard, each spanning every layer."""
    spec = jax.sharding.PartitionSpec
    params = hf.layouts.stack_layers(pretrained.params, num_layers=pretrained.config.num_layers)

    def put(x):
        axes = [None] * x.ndim
        if x.ndim and x.shape[-1] % 4 == 0:
            axes[-1] = "model"
        return jax.device_put(x, jax.sharding.NamedSharding(mesh, spec(*axes)))

    return jax.tree.map(put, params)


LAYOUTS = ["orbax_unscanned", "orbax_scanned", "orbax_scanned_one_chunk", "orbax_scanned_sharded",
           "streamed_unscanned", "streamed_scanned"]


def _write_checkpoint(layout, pretrained, root):
    config = pretrained.config
    scanned = dataclasses.replace(config, scan_layers=True)
    if layout == "orbax_unscanned":
        hf.to_paxlite(pretrained, root)
    elif layout == "orbax_scanned":
        hf.to_paxlite(dataclasses.replace(pretrained, config=scanned), root)
    elif layout == "orbax_scanned_one_chunk":  # as saved before stacks were chunked per layer
        with mock.patch.object(checkpoint, "layer_chunked_save_args", lambda state: None):
            hf.to_paxlite(dataclasses.replace(pretrained, config=scanned), root)
    elif layout == "orbax_scanned_sharded":
        mesh = jax.make_mesh((2, 4), ("data", "model"))
        save_params(root, _sharded_stacked(pretrained, mesh), model_config=scanned)
    else:
        layer_config = scanned if layout == "streamed_scanned" else config
        write_subtrees(iter(pretrained.params.items()), root, config=layer_config)
    return root


@pytest.fixture(scope="module")
def llama(llama_gqa):
    directory, model = llama_gqa
    return hf.load(directory), model


@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_equals_the_whole_model_export(llama, layout, tmp_path):
    pretrained, model = llama
    checkpoint = _write_checkpoint(layout, pretrained, tmp_path / "ckpt")
    reference = hf.from_paxlite(checkpoint)  # Orbax restores the whole model
    hf.save(reference, tmp_path / "want")
    summary = _export(checkpoint, tmp_path / "have")
    assert summary.num_params == pretrained.num_params
    _assert_same_export(tmp_path / "have", tmp_path / "want")
    # The per-layer scratch copies are gone; the input is untouched.
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "have", "want"]
    assert hf.load(tmp_path / "have").num_params == pretrained.num_params
    np.testing.assert_allclose(hf.load(tmp_path / "have").logits(TOKENS), hf_logits(model),
                               atol=1e-4, rtol=0)


def test_gpt2_bfloat16_sharded_export(gpt2, tmp_path):
    directory, _ = gpt2
    pretrained = hf.load(directory)
    scanned = dataclasses.replace(pretrained.config, scan_layers=True)
    checkpoint = tmp_path / "ckpt"
    hf.to_paxlite(dataclasses.replace(pretrained, config=scanned), checkpoint)
    hf.save(hf.from_paxlite(checkpoint), tmp_path / "want", dtype="bfloat16", max_shard_size="40KB")
    _export(checkpoint, tmp_path / "have", dtype="bfloat16", max_shard_size="40KB")
    files = sorted(os.listdir(tmp_path / "have"))
    assert "model.safetensors.index.json" in files
    assert sorted(os.listdir(tmp_path / "want")) == files
    index = json.loads((tmp_path / "have" / "model.safetensors.index.json").read_text())
    have = _read_safetensors(tmp_path / "have")
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in have.values())
    for name, file in index["weight_map"].items():  # each tensor is in the file the index names
        from safetensors import safe_open

        with safe_open(str(tmp_path / "have" / file), framework="numpy") as f:
            assert name in f.keys()  # noqa: SIM118
    _assert_same_export(tmp_path / "have", tmp_path / "want")


@pytest.mark.parametrize(("layout", "copies"), [("orbax_scanned_one_chunk", True),
                                               ("orbax_scanned", False),
                                               ("orbax_scanned_sharded", False)])
def test_reader_rows_equal_orbax(llama, tmp_path, layout, copies):
    """Leaves chunked across layers (one device's save before stacks were chunked per layer: one
    chunk per leaf) are copied once per layer into the scratch directory; per-layer chunks, also
    of a sharded save (global shape from TensorStore, not the metadata's per-shard write shape),
    are read as they are."""
    pretrained, _ = llama
    checkpoint = _write_checkpoint(layout, pretrained, tmp_path / "ckpt")
    _, step_dir = find_checkpoint(checkpoint)
    scratch = tmp_path / "scratch"
    reader = CheckpointReader(step_dir, scratch_dir=str(scratch))
    assert reader.scanned
    assert reader.tops() == ["embedding", "final_norm", "output", "layers_0", "layers_1"]
    for i in (1, 0):
        layer = reader.subtree(f"layers_{i}")
        want = pretrained.params[f"layers_{i}"]
        assert jax.tree.structure(layer) == jax.tree.structure(want)
        jax.tree.map(np.testing.assert_array_equal, layer, want)
    assert os.path.isdir(scratch) == copies
    if copies:
        assert "layers.mlp.wi.kernel" in os.listdir(scratch)
    np.testing.assert_array_equal(reader.read(("embedding", "embedding")),
                                  pretrained.params["embedding"]["embedding"])


def test_damaged_checkpoint_is_one_error_and_no_output(llama, tmp_path):
    pretrained, _ = llama
    checkpoint = _write_checkpoint("streamed_unscanned", pretrained, tmp_path / "ckpt")
    _, step_dir = find_checkpoint(checkpoint)
    shutil.rmtree(step_dir / "state" / "params.layers_1.attention.out.kernel")
    with pytest.raises(PretrainedCheckpointError,
                       match="layers_1/attention/out/kernel cannot be read"):
        _export(checkpoint, tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
