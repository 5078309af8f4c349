"""``convert --to=pax`` writes what Pax 1.4.0's own ``checkpoints.restore_checkpoint`` reads.

paxml cannot be installed beside paxlite (it pins jax 0.4.26), so the facts its restore depends on
are written here from its source (google/paxml at paxml-v1.4.0), and checked on what both writers
(`pax.save`, the whole model; `stream_paxlite_to_pax`, the CLI's) put on disk:

- ``checkpoint_managers._get_checkpoint_version``: the version is
  ``checkpoint_metadata.restore_metadata(step_dir)["version"]``, i.e.
  ``ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(step_dir / "metadata")``, the JSON file
  ``checkpoint_<STEP>/metadata/metadata``; without it the version is 0.0, a pre-1.0 layout
  ("Individual parameter subdirectory not found at .../step"). Without OCDBT Pax expects 1.1
  (``checkpoint_version._VERSION``; 1.2 is OCDBT).
- ``checkpoint_metadata.PaxMetadata.from_dict``: ``train_state_metadata`` holds ``mdl_vars`` only
  (``from_padded_and_unpadded`` drops step and opt_states), a nested dict whose leaves carry
  ``_array_metadata_tag`` True, ``is_optax_masked_node``, ``unpadded_shape`` and ``dtype``;
  ``is_compatible`` compares them with the model's when Pax restores with unpadded shapes.
- ``checkpoints.PaxCheckpointHandler.restore`` (``_tensorstore_prepare``): one TensorStore array
  per flattened TrainState name, ``step`` and ``mdl_vars.params.<name>`` (no opt_states when the
  saved TrainState has none, as saxml's converter writes), each read with the rank of the model's
  leaf: ``step`` is a scalar ("Ranks do not match" for shape [1]).
"""

import json
import os

import numpy as np
import orbax.checkpoint as ocp
import pytest

from paxlite.cli.convert import ConvertRequest, Source, Target, convert, read_paxlite
from paxlite.interop import pax
from tests.interop.test_pax import LLAMA, P, make_pax

PAX_VERSION_WITHOUT_OCDBT = 1.1  # paxml/checkpoint_version.py, _VERSION
ARRAY_METADATA_KEYS = {"_array_metadata_tag", "is_optax_masked_node", "unpadded_shape", "dtype"}


def _open(path):
    import tensorstore as ts

    return ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": str(path)}},
                   open=True, read=True).result()


def _leaves(tree, prefix=""):
    """{'.'-joined name: leaf dict} of the nested train_state_metadata (Pax's flattening)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and not value.get("_array_metadata_tag"):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@pytest.fixture(scope="module")
def paxlite_llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("pax_write")
    source = make_pax(root / "pax", LLAMA, repeated=True, separate_qkv=True)[0]
    convert(ConvertRequest(source=Source.PAX, target=Target.PAXLITE, input=str(source),
                           output=str(root / "paxlite"), fdl_config=LLAMA))
    return root / "paxlite"


@pytest.mark.parametrize("writer,dtype", [("stream", "float32"), ("whole", "bfloat16")])
def test_to_pax_writes_the_files_pax_restore_checkpoint_reads(paxlite_llama, tmp_path, writer,
                                                               dtype):
    out = tmp_path / "pax"
    if writer == "stream":
        convert(ConvertRequest(source=Source.PAXLITE, target=Target.PAX, input=str(paxlite_llama),
                               output=str(out), dtype=dtype))
    else:
        pax.save(read_paxlite(paxlite_llama, dtype=dtype), out, repeated=True, dtype=dtype, step=7)
    (step_dir,) = (out / "checkpoints").iterdir()
    step = 0 if writer == "stream" else 7
    assert step_dir.name == f"checkpoint_{step:08d}"
    state = step_dir / "state"

    # The version file, read as paxml's checkpoint_metadata.restore_metadata reads it.
    metadata = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(step_dir / "metadata")
    assert json.loads((step_dir / "metadata" / "metadata").read_text()) == metadata
    assert metadata["version"] == PAX_VERSION_WITHOUT_OCDBT
    assert set(metadata["train_state_metadata"]) == {"mdl_vars"}
    leaves = _leaves(metadata["train_state_metadata"])

    # The state item: step (a scalar) and one array per mdl_vars.params name, nothing else.
    names = sorted(os.listdir(state))
    params = [n for n in names if n.startswith(P)]
    assert names == sorted(["step", *params]) and len(params) > 5
    step_array = _open(state / "step")
    assert step_array.shape == () and int(step_array.read().result()) == step
    # the unscanned experiment's x_layers_<i>; repeat.sub (nested one level deeper) when asked
    assert any(".repeat.sub.x_layers_0." in n for n in params) == (writer == "whole")

    # The metadata lists exactly those arrays, each with its shape and dtype as on disk.
    assert sorted(leaves) == params
    for name in params:
        array = _open(state / name)
        leaf = leaves[name]
        assert set(leaf) == ARRAY_METADATA_KEYS, name
        assert leaf["_array_metadata_tag"] is True and leaf["is_optax_masked_node"] is False
        assert tuple(leaf["unpadded_shape"]) == tuple(array.shape), name
        assert leaf["dtype"] == dtype == np.dtype(array.dtype.numpy_dtype).name, name
