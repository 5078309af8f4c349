"""CHECKPOINT_RESTORE_PATH on a Pax checkpoint reads each device's shard, not whole leaves
(issue 23 item 2): values on a sharded 8-device mesh equal the source arrays, and TensorStore
reads each chunk of the files once, each read covering only a device's index range.

The Pax checkpoints are test_pax.py's (built with TensorStore in Pax's layout), their repeated
arrays re-chunked as Pax chunks them (by device shard, every chunk spanning all layers), so that a
read of one layer decodes a chunk holding all of them.
"""

import jax
import numpy as np
import pytest
from flax import linen as nn
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec

from paxlite.checkpointing import pax_layout, pretrained
from paxlite.cli.convert import experiment_model_config
from paxlite.models.transformer import abstract_variables
from tests.interop.test_pax import LLAMA, make_pax
from tests.interop.test_pax_stream import STEP, _sharded_like_pax

LLAMA_SCANNED = (LLAMA, ("USE_REPEATED_LAYER=True",))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{case: (Pax job dir, reference params (unscanned, float32))}."""
    root = tmp_path_factory.mktemp("pax_restore")
    gpt, _, gpt_ref = make_pax(root / "gpt_rep", "TinySynthetic", repeated=True)
    llama, _, llama_ref = make_pax(root / "llama", LLAMA, separate_qkv=True, seed=2)
    return {"gpt_rep_sharded": (_sharded_like_pax(gpt, root / "gpt_sharded"), gpt_ref),
            "llama_x_layers": (llama, llama_ref)}


def _abstract(experiment, assignments, mesh):
    """The model's params, each leaf split over as many mesh axes as its shape allows."""
    config = experiment_model_config(experiment, assignments)
    shapes = nn.meta.unbox(abstract_variables(config)["params"])

    def place(leaf):
        spec, free = [], list(mesh.axis_names)
        for n in leaf.shape:
            axis = next((a for a in free if n % mesh.shape[a] == 0 and n > mesh.shape[a]), None)
            spec.append(axis)
            if axis is not None:
                free.remove(axis)
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                    sharding=NamedSharding(mesh, PartitionSpec(*spec)))

    return jax.tree.map(place, shapes), config.scan_layers


def _want(reference, scanned):
    flat = traverse_util.flatten_dict(reference, sep="/")
    if not scanned:
        return flat
    out = {n: v for n, v in flat.items() if not n.startswith("layers_")}
    layers = sorted(
        {int(n.split("/")[0][len("layers_") :]) for n in flat if n.startswith("layers_")}
    )
    for name in {n.split("/", 1)[1] for n in flat if n.startswith("layers_0/")}:
        out[f"layers/{name}"] = np.stack([flat[f"layers_{i}/{name}"] for i in layers])
    return out


def _file_bytes(state):
    return sum(f.stat().st_size for f in state.rglob("*") if f.is_file())


def _bytes_read():
    """Bytes TensorStore has read from files in this process so far (its own counter)."""
    import tensorstore as ts

    metrics = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read")
    return sum(value["value"] for metric in metrics for value in metric["values"])


@pytest.mark.parametrize("case,experiment,assignments", [
    ("gpt_rep_sharded", "TinySyntheticRepeated", ()),  # repeat.sub -> a scanned stack
    ("gpt_rep_sharded", "TinySynthetic", ()),  # repeat.sub rows -> layers_<i>
    ("llama_x_layers", *LLAMA_SCANNED),  # x_layers_<i>, separate q/k/v -> a scanned stack
])
def test_sharded_restore_reads_each_shard_once_and_equals_the_source(
        checkpoints, case, experiment, assignments):
    directory, reference = checkpoints[case]
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    abstract, scanned = _abstract(experiment, assignments, mesh)
    step_dir = directory / "checkpoints" / "checkpoint_00000100"
    reader = pax_layout.BlockReader(pax_layout.pax_arrays(step_dir))
    before = _bytes_read()
    restored = pretrained._restore_pax(step_dir, abstract, reader=reader)
    read_from_disk = _bytes_read() - before

    # (a) every shard holds the source's numbers, bit for bit
    got = traverse_util.flatten_dict(restored, sep="/")
    want = _want(reference, scanned)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].sharding == traverse_util.flatten_dict(abstract, sep="/")[name].sharding
        for shard in got[name].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index], err_msg=name)

    # (b) nothing outside this process's device ranges was read, nothing twice: the reads returned
    # exactly the model's bytes (float32 here, as the Pax arrays) ...
    assert reader.bytes_read == sum(leaf.size * 4 for leaf in jax.tree.leaves(abstract))
    # ... and TensorStore read each file's chunks once (a per-layer read of a chunk that spans the
    # layers reads it once per layer: twice the repeated arrays' bytes for these 2 layers).
    assert read_from_disk <= _file_bytes(directory.joinpath(*STEP)), (read_from_disk,)
