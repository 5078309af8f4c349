"""HF Mixtral <-> paxlite: logits equal to saved transformers logits, exports transformers loads,
exact round trips (also scanned and through the command line), and one clear error per refusal.

The reference is tests/testdata/hf_mixtral_tiny (made by tests/testdata/make_hf_mixtral_tiny.py):
seeded Mixtral initialisation differs between transformers versions, so it is saved, not rebuilt.
"""

import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from paxlite.__main__ import main
from paxlite.cli.convert import ConversionError, architecture_differences
from paxlite.interop import hf, layouts
from paxlite.interop.hf_config import (
    Family,
    UnsupportedCheckpointError,
    family_of_config,
    from_hf_config,
    to_hf_config,
)
from paxlite.models.moe_config import MoeRouting
from tests.in_process import paxlite_command

GOLDEN = Path(__file__).resolve().parents[1] / "testdata" / "hf_mixtral_tiny"
TOKENS = np.load(GOLDEN / "tokens.npy")
HF_LOGITS = np.load(GOLDEN / "logits.npy")  # float32 [2, 16, 256] from MixtralForCausalLM
ATOL = 1e-5 * float(np.abs(HF_LOGITS).max())  # 1e-5 relative to the largest logit
NUM_PARAMS = 254_784  # MixtralConfig(vocab 256, hidden 64, intermediate 128, 2 layers, 4 experts)


def _tensors(path):
    with safe_open(os.path.join(path, "model.safetensors"), framework="np") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118  safe_open is not iterable


def _config():
    return json.loads((GOLDEN / "config.json").read_text())


def _hf_model_logits(directory):
    import torch
    from transformers import MixtralForCausalLM

    model = MixtralForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        logits = model(torch.tensor(TOKENS, dtype=torch.long)).logits.float().numpy()
    return logits, sum(p.numel() for p in model.parameters())


def _assert_same_params(a, b):
    fa, fb = layouts.flatten(a), layouts.flatten(b)
    assert sorted(fa) == sorted(fb)
    for name in fa:
        assert fa[name].dtype == fb[name].dtype and np.array_equal(fa[name], fb[name]), name


@pytest.fixture(scope="module")
def golden():
    return hf.load(GOLDEN)


def test_golden_files_are_what_transformers_computes():
    logits, count = _hf_model_logits(GOLDEN)
    assert count == NUM_PARAMS
    np.testing.assert_allclose(logits, HF_LOGITS, atol=ATOL, rtol=0)


def test_logits_match_saved_transformers_logits(golden):
    assert golden.family is Family.MIXTRAL
    moe = golden.config.moe
    assert (moe.num_experts, moe.experts_per_token, moe.routing, moe.moe_layer_interval,
            moe.gated_experts) == (4, 2, MoeRouting.DROPLESS_TOPK, 1, True)
    assert golden.config.rope_theta == 1e6 and golden.config.hidden_dims == 128
    assert golden.num_params == NUM_PARAMS
    layer = golden.params["layers_0"]
    assert "mlp" not in layer
    assert {k: v["kernel"].shape for k, v in layer["moe"].items()} == {
        "router": (64, 4), "wi_gate": (4, 64, 128), "wi": (4, 64, 128), "wo": (4, 128, 64)}
    # the mapping itself, against the file: router = gateᵀ, wi_gate[e] = w1ᵀ, wo[e] = w2ᵀ
    tensors = _tensors(GOLDEN)
    prefix = "model.layers.1.block_sparse_moe."
    moe1 = golden.params["layers_1"]["moe"]
    assert np.array_equal(moe1["router"]["kernel"], tensors[prefix + "gate.weight"].T)
    assert np.array_equal(moe1["wi_gate"]["kernel"][2], tensors[prefix + "experts.2.w1.weight"].T)
    assert np.array_equal(moe1["wi"]["kernel"][3], tensors[prefix + "experts.3.w3.weight"].T)
    assert np.array_equal(moe1["wo"]["kernel"][1], tensors[prefix + "experts.1.w2.weight"].T)
    ours = golden.logits(TOKENS)
    assert ours.dtype == np.float32 and ours.shape == HF_LOGITS.shape
    np.testing.assert_allclose(ours, HF_LOGITS, atol=ATOL, rtol=0)


def test_swapped_gate_and_up_would_be_caught(golden):
    """The tolerance is tight enough: exchanging w1 and w3 (a plausible bug) is far outside it."""
    params = {k: dict(v) for k, v in golden.params.items()}
    moe = dict(params["layers_0"]["moe"])
    moe["wi"], moe["wi_gate"] = moe["wi_gate"], moe["wi"]
    params["layers_0"] = {**params["layers_0"], "moe": moe}
    wrong = dataclasses.replace(golden, params=params).logits(TOKENS)
    assert np.abs(wrong - HF_LOGITS).max() > 100 * ATOL


def test_save_is_loaded_by_transformers_and_reads_back_identical(golden, tmp_path):
    hf.save(golden, tmp_path / "out")
    original, written = _tensors(GOLDEN), _tensors(tmp_path / "out")
    assert sorted(written) == sorted(original)  # the per-expert names, as transformers writes
    assert len(written) == 41
    for name in original:
        assert written[name].tobytes() == original[name].tobytes(), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["model_type"], config["num_local_experts"], config["num_experts_per_tok"],
            config["rope_parameters"]["rope_theta"], config["sliding_window"],
            config["router_aux_loss_coef"], config["output_router_logits"]) == (
        "mixtral", 4, 2, 1e6, None, 0.001, False)
    logits, count = _hf_model_logits(tmp_path / "out")
    assert count == golden.num_params
    np.testing.assert_allclose(logits, HF_LOGITS, atol=ATOL, rtol=0)
    _assert_same_params(hf.load(tmp_path / "out").params, golden.params)


def test_scanned_paxlite_round_trip_is_identical(golden, tmp_path):
    scanned = dataclasses.replace(golden, config=dataclasses.replace(golden.config,
                                                                      scan_layers=True))
    hf.to_paxlite(scanned, tmp_path / "pax")
    saved = json.loads((tmp_path / "pax" / "model_config.json").read_text())
    assert saved["scan_layers"] is True and saved["moe"]["num_experts"] == 4
    back = hf.from_paxlite(tmp_path / "pax")
    assert back.family is Family.MIXTRAL and back.config.moe == golden.config.moe
    _assert_same_params(back.params, golden.params)


def test_fused_in_memory_names_are_read_too(golden, tmp_path):
    """transformers 5.x's module names (experts fused per layer), e.g. a state_dict saved raw."""
    tensors = _tensors(GOLDEN)
    for i in range(2):
        p = f"model.layers.{i}.block_sparse_moe."
        gate = [tensors.pop(f"{p}experts.{e}.w1.weight") for e in range(4)]
        up = [tensors.pop(f"{p}experts.{e}.w3.weight") for e in range(4)]
        down = [tensors.pop(f"{p}experts.{e}.w2.weight") for e in range(4)]
        q = f"model.layers.{i}.mlp."
        tensors[q + "gate.weight"] = tensors.pop(p + "gate.weight")
        tensors[q + "experts.gate_up_proj"] = np.concatenate(
            [np.stack(gate), np.stack(up)], axis=1)  # [E, 2F, D]
        tensors[q + "experts.down_proj"] = np.stack(down)  # [E, D, F]
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(GOLDEN / "config.json", fused)
    save_file(tensors, fused / "model.safetensors", metadata={"format": "pt"})
    _assert_same_params(hf.load(fused).params, golden.params)


def test_cli_converts_both_ways(tmp_path, monkeypatch, capfd):
    command = paxlite_command(monkeypatch, capfd)  # `python -m paxlite`, in this process
    result = command("convert", "--from=hf", "--to=paxlite", f"--input={GOLDEN}",
                     f"--output={tmp_path / 'pax'}")
    assert result.returncode == 0, result.stderr
    assert "converted mixtral hf -> paxlite: 254,784 parameters, float32" in result.stdout
    rc = main(["convert", "--from=paxlite", "--to=hf", f"--input={tmp_path / 'pax'}",
               f"--output={tmp_path / 'back'}"])
    assert rc == 0
    original, back = _tensors(GOLDEN), _tensors(tmp_path / "back")
    assert sorted(back) == sorted(original)
    for name in original:
        assert back[name].tobytes() == original[name].tobytes(), name
    logits, _ = _hf_model_logits(tmp_path / "back")
    np.testing.assert_allclose(logits, HF_LOGITS, atol=ATOL, rtol=0)


@pytest.mark.parametrize("change, message", [
    ({"router_jitter_noise": 0.01}, "router_jitter_noise=0.01 is not supported: paxlite's router"),
    ({"sliding_window": 64}, "sliding_window=64 is not supported: paxlite has no sliding-window"),
    ({"n_shared_experts": 2}, ("n_shared_experts=2 (model_type='mixtral') is not supported: "
                              "paxlite's MoE holds routed experts only")),
    ({"model_type": "qwen2_moe", "shared_expert_intermediate_size": 256, "num_experts": 4},
     ("shared_expert_intermediate_size=256 (model_type='qwen2_moe') is not supported: paxlite's "
     "MoE holds routed experts only")),
    # (DeepSeek converts now: tests/interop/test_hf_deepseek.py; GLM-4-MoE stays refused)
    ({"model_type": "glm4_moe", "n_shared_experts": 1, "n_routed_experts": 4},
     "n_shared_experts=1 (model_type='glm4_moe')"),
    ({"model_type": "glm4_moe", "n_routed_experts": 4},
     ("model_type='glm4_moe' (n_routed_experts=4) is a mixture-of-experts model paxlite does "
      "not convert")),
    ({"model_type": "olmoe", "num_experts": 4}, "model_type='olmoe' (num_experts=4)"),
    ({"num_experts_per_tok": 5}, ("num_experts_per_tok=5 is not supported: it must be between 1 "
                                 "and num_local_experts=4")),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"num_local_experts": None}, "has no 'num_local_experts'; it is required"),
])
def test_refusals_name_the_field(change, message):
    # another model_type comes with its own fields, not Mixtral's
    config = {**_config(), **change} if "model_type" not in change else change
    with pytest.raises(ConversionError, match="^config.json .*" + message.replace("(", r"\(")
                       .replace(")", r"\)").replace("*", r"\*")) as err:
        from_hf_config(config)
    assert isinstance(err.value, UnsupportedCheckpointError) and "\n" not in str(err.value)


def test_window_covering_the_context_and_router_loss_settings_are_read():
    base = _config()
    _, same = from_hf_config({**base, "sliding_window": base["max_position_embeddings"]})
    assert same == from_hf_config(base)[1]
    assert same.moe.load_balancing_weight == 0.0  # output_router_logits false: HF adds no loss
    _, trained = from_hf_config({**base, "output_router_logits": True,
                                 "router_aux_loss_coef": 0.02})
    # HF: coef * E * sum(density * proxy) once; paxlite: weight * E / K * sum(...) per layer
    assert trained.moe.load_balancing_weight == pytest.approx(0.02 * 2 / 2)
    written = to_hf_config(trained, family=Family.MIXTRAL, router_aux_loss_coef=0.02)
    assert (written["output_router_logits"], written["router_aux_loss_coef"]) == (True, 0.02)
    assert to_hf_config(same, family=Family.MIXTRAL, router_aux_loss_coef=0.02)[
        "router_aux_loss_coef"] == 0.02  # inactive, carried back as it was read


def test_cli_refusal_is_one_line_and_exit_code_2(tmp_path, capsys):
    bad = tmp_path / "jitter"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**_config(), "router_jitter_noise": 0.1}))
    shutil.copy(GOLDEN / "model.safetensors", bad)
    rc = main(["convert", "--from=hf", "--to=paxlite", f"--input={bad}",
               f"--output={tmp_path / 'pax'}"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip().splitlines() == [
        ("paxlite: error: config.json router_jitter_noise=0.1 is not supported: paxlite's router "
        "adds no noise (router_jitter_noise must be 0)")]
    assert not (tmp_path / "pax").exists()


def test_models_hf_mixtral_cannot_hold_are_refused_on_export(golden, tmp_path):
    glam = dataclasses.replace(golden.config, moe=dataclasses.replace(
        golden.config.moe, routing=MoeRouting.GSHARD_TOP2, moe_layer_interval=2))
    with pytest.raises(UnsupportedCheckpointError, match=r"as Mixtral in moe.routing="
                       r"'gshard_top2' \(needs 'dropless_topk'\), moe.moe_layer_interval=2"):
        family_of_config(glam)


def test_fdl_config_check_compares_the_experts(golden):
    config = golden.config
    eight = dataclasses.replace(config, moe=dataclasses.replace(config.moe, num_experts=8))
    assert architecture_differences(config, want=eight) == [
        "moe.num_experts: converted 4, experiment 8"]
    dense = dataclasses.replace(config, moe=None)
    assert architecture_differences(config, want=dense) == [
        "moe: converted '4 experts, top-2', experiment None"]
    assert architecture_differences(config, want=config) == []
