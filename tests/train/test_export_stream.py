"""export_merged reads, merges and writes one layer at a time: its output equals `merge_lora` of the
whole restored model (float32, to the last bit's rounding), scanned or not, whatever the saved
chunking, and a checkpoint of another LoRA model is refused before anything is written."""

import dataclasses
import os

import flax.linen as nn
import jax
import numpy as np
import pytest
from flax import traverse_util

from paxlite.checkpointing import pretrained
from paxlite.models.lora_merge import merge_lora
from paxlite.models.transformer import abstract_variables
from paxlite.train.export import base_model_config, export_merged
from tests.models.test_lora import CONFIGS, _init, _randomise_lora_b, _with_lora


def _restore(path, config):
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                            nn.meta.unbox(abstract_variables(config)["params"]))
    return pretrained.restore_params(path, abstract)


@pytest.mark.parametrize("layout", ["llama_gqa", "scanned_fused_qkv", "gpt_fused_qkv"])
def test_streamed_export_equals_the_whole_model_merge(layout, tmp_path):
    config = _with_lora(CONFIGS[layout])
    params = _randomise_lora_b(_init(config))
    # Orbax on one device, scanned stacks one layer per chunk (as every save now writes them).
    pretrained.save_params(tmp_path / "job", params, step=7, model_config=config)
    step_dir = export_merged(tmp_path / "job", tmp_path / "merged", model_config=config)
    assert step_dir == tmp_path / "merged" / "checkpoints" / "checkpoint_00000007"
    assert sorted(os.listdir(tmp_path)) == ["job", "merged"]  # scratch copies removed
    base = base_model_config(config)
    assert pretrained.load_model_config(tmp_path / "merged") == base
    step, got = _restore(tmp_path / "merged", base)
    assert step == 7
    want = traverse_util.flatten_dict(merge_lora(params, config=config), sep="/")
    got = traverse_util.flatten_dict(got, sep="/")
    assert sorted(got) == sorted(want)
    changed = 0
    for key in want:
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), rtol=1e-6,
                                   atol=1e-7, err_msg=key)
        changed += not np.array_equal(np.asarray(got[key]),
                                      np.asarray(traverse_util.flatten_dict(params, sep="/")[key]))
    assert changed >= 2  # the adapters were folded in, not dropped


def test_checkpoint_of_another_lora_model_is_refused_before_writing(tmp_path):
    config = _with_lora(CONFIGS["llama_gqa"])
    pretrained.save_params(tmp_path / "job", _init(config), model_config=config)
    other = dataclasses.replace(config, lora_rank=config.lora_rank + 1)
    with pytest.raises(
        pretrained.PretrainedCheckpointError,
        match=r"(?s)does not fit the LoRA model.*lora_a: checkpoint shape \(16, 3\)",
    ):
        export_merged(tmp_path / "job", tmp_path / "merged", model_config=other)
    assert sorted(os.listdir(tmp_path)) == ["job"]
