"""HF <-> paxlite: logit parity with transformers, exports it reloads, exact round trips."""

import json
import os

import numpy as np
import pytest
from safetensors import safe_open

from paxlite.interop import hf
from tests.in_process import paxlite_command
from tests.interop.conftest import TOKENS, hf_logits, make_llama

TOL = 1e-4


def _tensors(path):
    with safe_open(os.path.join(path, "model.safetensors"), framework="np") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118  safe_open is not iterable


@pytest.mark.parametrize("fixture", ["llama_gqa", "llama_mha", "gpt2"])
def test_logits_match_transformers(fixture, request):
    directory, model = request.getfixturevalue(fixture)
    pretrained = hf.load(directory)
    assert pretrained.family == ("gpt2" if fixture == "gpt2" else "llama")
    assert pretrained.num_params == sum(p.numel() for p in model.parameters())
    ours, ref = pretrained.logits(TOKENS), hf_logits(model)
    assert ours.dtype == np.float32 and ours.shape == (2, 16, 256)
    np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)
    if fixture == "llama_mha":  # kv heads == heads: the fused [D, 3, N, H] kernel
        assert pretrained.params["layers_0"]["attention"]["qkv"]["kernel"].shape == (64, 3, 4, 16)
    if fixture == "llama_gqa":
        assert pretrained.params["layers_0"]["attention"]["key"]["kernel"].shape == (64, 2, 16)


def test_rope_theta_read_in_both_spellings(tmp_path):
    directory, model = make_llama(tmp_path / "theta", kv_heads=2, rope_theta=500000.0)
    ref = hf_logits(model)
    assert hf.load(directory).config.rope_theta == 500000.0
    np.testing.assert_allclose(hf.load(directory).logits(TOKENS), ref, atol=TOL, rtol=0)
    # transformers 4.x spelling: top-level rope_theta and torch_dtype, no rope_parameters.
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("rope_parameters")
    config["rope_theta"] = 500000.0
    config["torch_dtype"] = config.pop("dtype")
    config_path.write_text(json.dumps(config))
    legacy = hf.load(directory)
    assert legacy.config.rope_theta == 500000.0
    np.testing.assert_allclose(legacy.logits(TOKENS), ref, atol=TOL, rtol=0)
    # The theta must matter, or this test could not fail.
    config["rope_theta"] = 10000.0
    config_path.write_text(json.dumps(config))
    assert np.abs(hf.load(directory).logits(TOKENS) - ref).max() > 1e-2


@pytest.mark.parametrize("fixture", ["llama_gqa", "gpt2"])
def test_export_reloads_in_transformers(fixture, request, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    directory, model = request.getfixturevalue(fixture)
    pretrained = hf.load(directory)
    hf.save(pretrained, tmp_path / "out")
    assert sorted(os.listdir(tmp_path / "out")) == [
        "config.json", "generation_config.json", "model.safetensors"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert type(reloaded).__name__ == type(model).__name__
    np.testing.assert_allclose(hf_logits(reloaded), hf_logits(model), atol=TOL, rtol=0)
    # Exported tensors are the original ones, bit for bit.
    original, exported = _tensors(directory), _tensors(tmp_path / "out")
    assert sorted(exported) == sorted(original)
    for name in original:
        assert exported[name].tobytes() == original[name].tobytes(), name
    with pytest.raises(FileExistsError, match="not empty"):
        hf.save(pretrained, tmp_path / "out")


def test_bfloat16_export_and_load(llama_gqa, tmp_path):
    import ml_dtypes

    directory, _ = llama_gqa
    hf.save(hf.load(directory), tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert hf.stored_hf_dtype(tmp_path / "bf16") == "bfloat16"
    exported = _tensors(tmp_path / "bf16")
    assert all(a.dtype == ml_dtypes.bfloat16 for a in exported.values())
    loaded = hf.load(tmp_path / "bf16")  # read back in float32: exactly the rounded values
    q = exported["model.layers.0.self_attn.v_proj.weight"].astype(np.float32)
    np.testing.assert_array_equal(
        loaded.params["layers_0"]["attention"]["value"]["kernel"].reshape(64, 32), q.T)


def test_gpt2_names_without_prefix_and_buffers(gpt2, tmp_path):
    from safetensors.numpy import save_file

    directory, model = gpt2
    tensors = {k.removeprefix("transformer."): v for k, v in _tensors(directory).items()}
    tensors["h.0.attn.bias"] = np.tril(np.ones((1, 1, 128, 128), np.float32))
    tensors["h.0.attn.masked_bias"] = np.array(-1e4, np.float32)
    tensors["lm_head.weight"] = tensors["wte.weight"]
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text((directory / "config.json").read_text())
    save_file(tensors, old / "model.safetensors", metadata={"format": "pt"})
    np.testing.assert_allclose(hf.load(old).logits(TOKENS), hf_logits(model), atol=TOL, rtol=0)


def test_cli_round_trip_hf_paxlite_hf_is_byte_equal(llama_gqa, tmp_path, monkeypatch, capfd):
    directory, model = llama_gqa
    command = paxlite_command(monkeypatch, capfd)  # `python -m paxlite`, in this process
    result = command("convert", "--from=hf", "--to=paxlite", f"--input={directory}",
                     f"--output={tmp_path / 'pax'}")
    assert result.returncode == 0, result.stderr
    assert "converted llama hf -> paxlite: 123,712 parameters, float32" in result.stdout
    assert (tmp_path / "pax" / "model_config.json").exists()
    pax = hf.from_paxlite(tmp_path / "pax")
    np.testing.assert_allclose(pax.logits(TOKENS), hf_logits(model), atol=TOL, rtol=0)
    hf.save(pax, tmp_path / "back")
    original, back = _tensors(directory), _tensors(tmp_path / "back")
    assert sorted(back) == sorted(original)
    for name in original:
        assert back[name].dtype == original[name].dtype
        assert back[name].tobytes() == original[name].tobytes(), name
