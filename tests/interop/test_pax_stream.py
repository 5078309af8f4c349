"""Pax conversions made one layer at a time (interop/pax.py) give exactly what the whole-model
functions give: ``--from=pax --to=paxlite`` what `pax.load` + `hf.to_paxlite` wrote, ``--to=hf``
what `hf.save` wrote, ``--from=paxlite --to=pax`` what `pax.save` wrote; compared array by array,
bit for bit, on the Pax checkpoints test_pax.py builds with TensorStore.
"""

import json
import os
import shutil

import numpy as np
import pytest

from paxlite.__main__ import main
from paxlite.checkpointing import pax_layout
from paxlite.checkpointing.stream_read import CheckpointReader
from paxlite.cli.convert import (
    ConvertRequest,
    Source,
    Target,
    adopt_config,
    convert,
    experiment_model_config,
    read_paxlite,
)
from paxlite.interop import hf, pax
from paxlite.interop.hf_config import UnsupportedCheckpointError
from tests.interop.test_pax import LLAMA, LLAMA_MHA, P, make_pax

LLAMA_SCANNED = (LLAMA, ("USE_REPEATED_LAYER=True",))
REPEAT = pax_layout.REPEATED_PREFIX
STEP = ("checkpoints", "checkpoint_00000100", "state")


def _open(path):
    import tensorstore as ts

    return ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": str(path)}},
                   open=True, read=True).result()


def _write(path, array, *, chunks):
    import tensorstore as ts

    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(path)},
            "metadata": {"shape": list(array.shape), "chunks": list(chunks),
                         "dtype": array.dtype.str, "compressor": {"id": "zstd", "level": 1}}}
    ts.open(spec, create=True).result().write(array).result()


def _sharded_like_pax(source, directory):
    """A copy of a repeat.sub checkpoint whose repeated arrays are chunked (and compressed) as
    Pax's device shards are: every chunk spans all layers, the next axis split in two."""
    shutil.copytree(source, directory)
    state = directory.joinpath(*STEP)
    for child in state.iterdir():
        if f".{REPEAT}." in f".{child.name}":
            array = np.asarray(_open(child).read().result())
            shutil.rmtree(child)
            _write(child, array, chunks=(array.shape[0], max(1, -(-array.shape[1] // 2)),
                                         *array.shape[2:]))
    return directory


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """name -> Pax job directory, each made on first use."""
    root = tmp_path_factory.mktemp("pax_stream")
    made = {}
    recipes = {
        "gpt": lambda d: make_pax(d, "TinySynthetic")[0],
        "gpt_rep": lambda d: make_pax(d, "TinySynthetic", repeated=True)[0],
        "gpt_rep_sharded": lambda d: _sharded_like_pax(get("gpt_rep"), d),
        "llama_sep": lambda d: make_pax(d, LLAMA, separate_qkv=True)[0],
        "llama_fused": lambda d: make_pax(d, *LLAMA_MHA)[0],
        "llama_rep": lambda d: make_pax(d, LLAMA, repeated=True, separate_qkv=True, seed=3)[0],
    }

    def get(name):
        if name not in made:
            made[name] = recipes[name](root / name)
        return made[name]

    return get


def _request(source, target, src, out, experiment=None, assignments=(), dtype="float32"):
    return ConvertRequest(source=source, target=target, input=str(src), output=str(out),
                          fdl_config=experiment, assignments=tuple(assignments), dtype=dtype)


def _paxlite_arrays(directory):
    """{params path: array} of a paxlite checkpoint, as stored (scanned leaves stacked)."""
    step_dir = directory / "checkpoints" / "checkpoint_00000000"
    reader = CheckpointReader(step_dir)
    return {"/".join(path): reader.read(path) for path in reader.leaves}


def _assert_same_arrays(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert got[name].shape == want[name].shape, name
        assert got[name].tobytes() == want[name].tobytes(), name


def _no_scratch_left(directory):
    return [p.name for p in directory.iterdir() if "rechunk" in p.name] == []


# ---------------------------------------------------------------- Pax -> paxlite, HF
@pytest.mark.parametrize("case,experiment,assignments,dtype", [
    ("gpt", "TinySynthetic", (), "float32"),
    ("gpt", "TinySyntheticRepeated", (), "float32"),  # x_layers_<i> -> a scanned stack
    ("gpt_rep", "TinySynthetic", (), "float32"),  # repeat.sub -> layers_<i>
    ("gpt_rep", "TinySyntheticRepeated", (), "float32"),
    ("gpt_rep_sharded", "TinySyntheticRepeated", (), "bfloat16"),  # chunks span the layers
    ("llama_sep", LLAMA, (), "float32"),  # separate q/k/v (GQA)
    ("llama_fused", *LLAMA_MHA, "float32"),  # combined_qkv
    ("llama_rep", *LLAMA_SCANNED, "bfloat16"),
])
def test_streamed_pax_to_paxlite_equals_the_whole_model_conversion(
        sources, tmp_path, case, experiment, assignments, dtype):
    directory = sources(case)
    convert(_request(Source.PAX, Target.PAXLITE, directory, tmp_path / "streamed", experiment,
                     assignments, dtype))
    config = experiment_model_config(experiment, assignments)
    loaded = pax.load(directory, config=config, experiment=experiment, dtype=dtype)
    hf.to_paxlite(adopt_config(loaded, config=config, experiment=experiment), tmp_path / "whole")

    _assert_same_arrays(_paxlite_arrays(tmp_path / "streamed"), _paxlite_arrays(tmp_path / "whole"))
    streamed = json.loads((tmp_path / "streamed" / "model_config.json").read_text())
    assert streamed == json.loads((tmp_path / "whole" / "model_config.json").read_text())
    assert streamed["scan_layers"] == config.scan_layers and streamed["param_dtype"] == dtype
    assert _no_scratch_left(tmp_path)


@pytest.mark.parametrize("case,experiment,assignments,dtype", [
    ("gpt_rep_sharded", "TinySynthetic", (), "float32"),  # GPT-2, tied embeddings
    ("llama_sep", LLAMA, (), "bfloat16"),
])
def test_streamed_pax_to_hf_equals_hf_save(sources, tmp_path, case, experiment, assignments,
                                           dtype):
    from safetensors.numpy import load_file

    directory = sources(case)
    convert(_request(Source.PAX, Target.HF, directory, tmp_path / "streamed", experiment,
                     assignments, dtype))
    config = experiment_model_config(experiment, assignments)
    hf.save(pax.load(directory, config=config, experiment=experiment, dtype=dtype),
            tmp_path / "whole", dtype=dtype)

    names = sorted(os.listdir(tmp_path / "whole"))
    assert sorted(os.listdir(tmp_path / "streamed")) == names
    for name in names:
        if name.endswith(".safetensors"):
            _assert_same_arrays(load_file(tmp_path / "streamed" / name),
                                load_file(tmp_path / "whole" / name))
        else:
            assert (tmp_path / "streamed" / name).read_text() == (
                tmp_path / "whole" / name).read_text(), name
    assert _no_scratch_left(tmp_path)


def test_one_layer_is_read_at_a_time_and_repeated_arrays_once(sources, tmp_path, monkeypatch):
    """Each subtree reads only its own Pax arrays (row i of repeat.sub for layers_i); a repeated
    array chunked across layers is copied once, per layer, not decoded once per layer."""
    directory = sources("gpt_rep_sharded")
    source = pax.open_pax(directory, config=experiment_model_config("TinySynthetic"),
                          experiment="TinySynthetic")
    reads = []
    original = pax_layout.PaxArray.read
    monkeypatch.setattr(pax_layout.PaxArray, "read", lambda self, index=None: (
        reads.append((os.path.basename(self.path), index)), original(self, index))[1])
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    tops = []
    for top, _ in source.subtrees(scratch_dir=str(scratch)):
        tops.append(top)
        assert reads, top
        if top.startswith("layers_"):
            i = int(top.removeprefix("layers_"))
            assert {index for _, index in reads} == {i}, (top, reads)
            assert all(name.startswith(P + REPEAT) for name, _ in reads), reads
        else:
            assert all(index is None and REPEAT not in name for name, index in reads), reads
        reads.clear()
    assert sorted(tops) == ["embedding", "final_norm", "layers_0", "layers_1",
                            "position_embedding"]
    repeated = [n for n in os.listdir(directory.joinpath(*STEP)) if REPEAT in n]
    assert sorted(os.listdir(scratch)) == sorted(repeated)
    for name in repeated:
        assert _open(scratch / name).chunk_layout.read_chunk.shape[0] == 1


# ---------------------------------------------------------------- paxlite -> Pax
def _pax_arrays(directory):
    state = directory / "checkpoints" / "checkpoint_00000000" / "state"
    return {name: np.asarray(_open(state / name).read().result()) for name in os.listdir(state)}


@pytest.mark.parametrize("case,experiment,assignments,to_pax,dtype,orbax", [
    ("gpt", "TinySyntheticRepeated", (), (), "float32", False),  # scanned -> repeat.sub
    ("gpt_rep", "TinySynthetic", (), (), "float32", False),  # unscanned -> x_layers_<i>
    ("llama_sep", LLAMA, (), LLAMA_SCANNED, "float32", False),  # the experiment's repeat.sub
    ("llama_fused", *LLAMA_MHA, (), "bfloat16", False),
    # written by Orbax (hf.to_paxlite), as training does: stacked leaves chunked across layers
    ("llama_rep", *LLAMA_SCANNED, (), "float32", True),
])
def test_streamed_paxlite_to_pax_equals_pax_save_and_round_trips(
        sources, tmp_path, case, experiment, assignments, to_pax, dtype, orbax):
    src = tmp_path / "paxlite"
    if orbax:
        config = experiment_model_config(experiment, assignments)
        loaded = pax.load(sources(case), config=config, experiment=experiment)
        hf.to_paxlite(adopt_config(loaded, config=config, experiment=experiment), src)
    else:
        convert(_request(Source.PAX, Target.PAXLITE, sources(case), src, experiment, assignments))
    convert(_request(Source.PAXLITE, Target.PAX, src, tmp_path / "streamed", *to_pax, dtype=dtype))
    # repeat.sub when the experiment given asks for it, else when the source's layers are scanned
    repeated = experiment_model_config(*(to_pax or (experiment, assignments))).scan_layers
    pax.save(read_paxlite(src, dtype=dtype), tmp_path / "whole", repeated=repeated, dtype=dtype)

    got, want = _pax_arrays(tmp_path / "streamed"), _pax_arrays(tmp_path / "whole")
    _assert_same_arrays(got, want)
    assert any(REPEAT in name for name in got) == repeated
    assert got["step"].dtype == np.int32 and got["step"].ravel().tolist() == [0]
    for out in ("streamed", "whole"):
        assert (tmp_path / out / "checkpoints" / "checkpoint_00000000" / "commit_success.txt"
                ).read_text().startswith("Checkpoint commit was successful to ")
    state = tmp_path / "streamed" / "checkpoints" / "checkpoint_00000000" / "state"
    for name in got:
        if REPEAT in name:  # created [L, ...] and written row by row: one chunk per layer
            assert _open(state / name).chunk_layout.read_chunk.shape[0] == 1, name
    assert _no_scratch_left(tmp_path)

    # Back to paxlite with the source's experiment: the same arrays as the source (float32).
    convert(_request(Source.PAX, Target.PAXLITE, tmp_path / "streamed", tmp_path / "back",
                     experiment, assignments, dtype))
    back, first = _paxlite_arrays(tmp_path / "back"), _paxlite_arrays(src)
    if dtype != "float32":
        from paxlite.interop.hf_write import numpy_dtype

        first = {k: v.astype(numpy_dtype(dtype)) for k, v in first.items()}
    _assert_same_arrays(back, first)


# ---------------------------------------------------------------- bad input
def _cli(capsys, *args):
    rc = main(["convert", *args])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("case,target,override,message", [
    ("gpt_rep", "paxlite", "--fdl.NUM_LAYERS=3",
     f"{P}{REPEAT}.self_attention.post.w has shape (2, 64, 8, 8), expected (3, 64, 8, 8)"),
    ("gpt_rep", "hf", "--fdl.HIDDEN_DIMS=128",
     f"{P}{REPEAT}.ff_layer.ffn_layer1.linear.w has shape (2, 64, 256), expected (2, 64, 128)"),
])
def test_a_wrong_shape_is_one_error_before_the_output_exists(capsys, sources, tmp_path, case,
                                                             target, override, message):
    rc, err = _cli(capsys, "--from=pax", f"--to={target}", f"--input={sources(case)}",
                   f"--output={tmp_path / 'new' / 'out'}", "--fdl_config=TinySynthetic", override)
    assert rc == 2
    assert len(err.strip().splitlines()) == 1, err
    assert message in err
    assert os.listdir(tmp_path) == []


def test_a_missing_repeated_tensor_is_named_before_the_output_exists(capsys, tmp_path):
    name = f"{REPEAT}.ff_layer.ffn_layer2.linear.w"
    directory, _, _ = make_pax(tmp_path / "src", "TinySynthetic", repeated=True, drop=name)
    rc, err = _cli(capsys, "--from=pax", "--to=paxlite", f"--input={directory}",
                   f"--output={tmp_path / 'out'}", "--fdl_config=TinySyntheticRepeated")
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert (f"{P}{name} is missing (expected shape (2, 256, 64), for paxlite's "
            "layers_0/mlp/wo/kernel)") in err
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_to_pax_of_a_checkpoint_that_does_not_fit_its_config_writes_nothing(
        capsys, sources, tmp_path):
    src = tmp_path / "paxlite"
    convert(_request(Source.PAX, Target.PAXLITE, sources("gpt"), src, "TinySynthetic"))
    rc, err = _cli(capsys, "--from=paxlite", "--to=pax", f"--input={src}",
                   f"--output={tmp_path / 'out'}", "--fdl_config=TinySynthetic",
                   "--fdl.HIDDEN_DIMS=128")
    assert rc == 2 and "hidden_dims: converted 256, experiment 128" in err
    # model_config.json edited to say otherwise than the arrays: the shapes are checked first.
    saved = json.loads((src / "model_config.json").read_text())
    (src / "model_config.json").write_text(json.dumps(dict(saved, hidden_dims=128)))
    rc, err = _cli(capsys, "--from=paxlite", "--to=pax", f"--input={src}",
                   f"--output={tmp_path / 'new' / 'out'}")
    assert rc == 2 and "layers_0/mlp/wi/kernel: shape (64, 256), model (64, 128)" in err
    assert sorted(os.listdir(tmp_path)) == ["paxlite"]


def test_plan_writes_names_what_pax_has_no_name_for():
    leaves = {"embedding/embedding": (8, 4), "layers_0/moe/router/kernel": (4, 2)}
    with pytest.raises(pax_layout.PaxCheckpointError, match="layers_0/moe/router/kernel"):
        pax_layout.plan_writes(leaves, repeated=True)


def test_stream_paxlite_to_pax_refuses_lora(sources, tmp_path):
    src = tmp_path / "paxlite"
    convert(_request(Source.PAX, Target.PAXLITE, sources("llama_sep"), src, LLAMA))
    config = read_paxlite(src).config
    reader = CheckpointReader(src / "checkpoints" / "checkpoint_00000000")
    assert not any("lora" in "/".join(p) for p in reader.leaves)
    # A leaf named like a LoRA adapter in the saved tree's metadata.
    metadata_path = src / "checkpoints" / "checkpoint_00000000" / "state" / "_METADATA"
    metadata = json.loads(metadata_path.read_text())
    key, entry = next(iter(metadata["tree_metadata"].items()))
    entry = json.loads(json.dumps(entry))
    entry["key_metadata"][-1]["key"] = "lora_a"
    metadata["tree_metadata"][key + "_lora"] = entry
    metadata_path.write_text(json.dumps(metadata))
    with pytest.raises(UnsupportedCheckpointError, match="LoRA"):
        pax.stream_paxlite_to_pax(src, tmp_path / "new" / "out", config=config, repeated=False)
    assert sorted(os.listdir(tmp_path)) == ["paxlite"]
