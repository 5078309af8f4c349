"""Refusals name the field; --fdl_config checks the architecture; paxlite checkpoints read back."""

import json
import shutil

import numpy as np
import pytest

from paxlite.__main__ import main
from paxlite.checkpointing.pretrained import save_params
from paxlite.cli.convert import (
    ConversionError,
    ConvertRequest,
    Source,
    Target,
    convert,
    read_paxlite,
)
from paxlite.interop import hf, layouts
from paxlite.interop.hf_config import UnsupportedCheckpointError, from_hf_config
from paxlite.models.transformer import Activation
from tests.interop.conftest import TOKENS, hf_logits

TOL = 1e-4
# LLaMA7B's hyperparameters shrunk to the tiny GQA model's architecture.
TINY_LLAMA = ("NUM_LAYERS=2", "NUM_HEADS=4", "NUM_KV_HEADS=2", "MODEL_DIMS=64", "HIDDEN_DIMS=172",
              "DIMS_PER_HEAD=16", "VOCAB_SIZE=256", "LAYERNORM_EPSILON=1e-6")


def _config(directory):
    return json.loads((directory / "config.json").read_text())


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling="),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5}},
     "rope_parameters={'rope_type': 'yarn'"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"model_type": "mixtral"}, "no 'num_local_experts'"),
    ({"model_type": "bert"}, "model_type='bert' is not supported"),
])
def test_unsupported_hf_configs_name_the_field(llama_gqa, change, message):
    config = {**_config(llama_gqa[0]), **change}
    with pytest.raises(UnsupportedCheckpointError, match=message.replace("(", r"\(")):
        from_hf_config(config)


def test_gpt2_config_defaults(gpt2):
    config = _config(gpt2[0])
    assert config["n_inner"] is None and config["activation_function"] == "gelu_new"
    family, ours = from_hf_config(config)
    assert (family, ours.hidden_dims, ours.activation, ours.tie_embeddings) == (
        "gpt2", 256, Activation.GELU_TANH, True)


def test_shape_mismatch_and_missing_or_extra_tensors(llama_gqa, tmp_path):
    directory = tmp_path / "bad_heads"
    directory.mkdir()
    shutil.copy(llama_gqa[0] / "model.safetensors", directory)
    (directory / "config.json").write_text(json.dumps(
        {**_config(llama_gqa[0]), "num_attention_heads": 2, "head_dim": 16}))
    with pytest.raises(layouts.LayoutError,
                       match=r"q_proj.weight has 64 rows but num_attention_heads \* head_dim = "
                             r"2 \* 16 = 32"):
        hf.load(directory)
    _, config = from_hf_config(_config(llama_gqa[0]))
    tensors = dict(hf.read_hf_tensors(llama_gqa[0]))  # a lazy mapping: read it to edit it
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    tensors["model.layers.0.mlp.extra.weight"] = np.zeros(3, np.float32)
    with pytest.raises(layouts.LayoutError) as err:
        layouts.llama_to_params(tensors, config=config)
    assert "missing tensors: model.layers.1.mlp.up_proj.weight" in str(err.value)
    assert "unexpected tensors (not part of this model): model.layers.0.mlp.extra.weight" in str(
        err.value)


def test_fdl_config_match_writes_the_experiments_layout(llama_gqa, tmp_path):
    directory, model = llama_gqa
    convert(ConvertRequest(source=Source.HF, target=Target.PAXLITE, input=str(directory),
                           output=str(tmp_path / "pax"), fdl_config="LLaMA7B",
                           assignments=TINY_LLAMA + ("USE_REPEATED_LAYER=true",)))
    saved = json.loads((tmp_path / "pax" / "model_config.json").read_text())
    assert saved["scan_layers"] is True and saved["dtype"] == "bfloat16"  # the experiment's
    back = hf.from_paxlite(tmp_path / "pax", dtype="float32")
    np.testing.assert_allclose(back.logits(TOKENS), hf_logits(model), atol=TOL, rtol=0)


def test_fdl_config_mismatch_names_each_field(llama_gqa, tmp_path, capsys):
    wrong = [a for a in TINY_LLAMA if not a.startswith(("VOCAB_SIZE", "NUM_HEADS", "NUM_KV"))]
    rc = main(["convert", "--from=hf", "--to=paxlite", f"--input={llama_gqa[0]}",
               f"--output={tmp_path / 'pax'}", "--fdl_config=LLaMA7B", "--fdl.NUM_HEADS=8",
               "--fdl.DIMS_PER_HEAD=8"] + [f"--fdl.{a}" for a in wrong if "DIMS_PER" not in a])
    err = capsys.readouterr().err
    assert rc == 2
    assert "not LLaMA7B's model" in err
    for line in ("vocab_size: converted 256, experiment 32000",
                 "num_heads: converted 4, experiment 8", "kv_heads: converted 2, experiment 8",
                 "dims_per_head: converted 16, experiment 8"):
        assert line in err
    assert not (tmp_path / "pax").exists()


def test_job_config_json_and_lora_refusal(llama_gqa, tmp_path):
    directory, model = llama_gqa
    pretrained = hf.load(directory)
    # A training job directory: checkpoints + config.json, no model_config.json.
    job = tmp_path / "job"
    save_params(job, pretrained.params, step=20)
    hparams = dict(a.split("=") for a in TINY_LLAMA)
    hparams = {k: (float(v) if "EPSILON" in k else int(v)) for k, v in hparams.items()}
    (job / "config.json").write_text(json.dumps(
        {"experiment": "LLaMA7B", "hparams": hparams, "overridden": sorted(hparams)}))
    with pytest.raises(ConversionError, match="read by paxlite.cli.convert.read_paxlite"):
        hf.from_paxlite(job)  # interop/ cannot rebuild an experiment; it says who can
    from_job = read_paxlite(job)
    np.testing.assert_allclose(from_job.logits(TOKENS), hf_logits(model), atol=TOL, rtol=0)
    (job / "config.json").unlink()
    with pytest.raises(ConversionError, match="no model config for the checkpoint"):
        read_paxlite(job)
    # LoRA leaves: the merged model must be exported, not the adapters.
    params = dict(pretrained.params)
    params["layers_0"] = {**params["layers_0"], "lora_a": np.zeros((64, 2), np.float32)}
    save_params(tmp_path / "lora", params, model_config=pretrained.config)
    with pytest.raises(UnsupportedCheckpointError,
                       match="layers_0/lora_a.*export_merged"):
        hf.from_paxlite(tmp_path / "lora")


def test_models_hf_cannot_hold_are_refused(gpt2, tmp_path):
    import dataclasses

    pretrained = hf.load(gpt2[0])
    rotary = dataclasses.replace(pretrained, config=dataclasses.replace(
        pretrained.config, position_embedding="rotary"))
    with pytest.raises(UnsupportedCheckpointError,
                       match=r"position_kind='rotary' \(needs 'learned'\)"):
        hf.save(rotary, tmp_path / "out")
