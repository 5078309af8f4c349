"""`python -m paxlite convert --from=hf --to=paxlite --fdl_config=NAME` for the open families: a
tiny checkpoint that transformers writes (test_hf_open_families.py's, one per family) converts
into the registered experiment of its family, shrunk to its shapes with --fdl. overrides, and the
output has the experiment's model (its scanned layout, its switches) with transformers' logits
(1e-4, float32); the same checkpoint against an experiment whose switch differs is refused, exit
2, naming that one field with both values. In this process (tests/in_process.py)."""

import json

import numpy as np

from paxlite.checkpointing.pretrained import model_config_from_json
from paxlite.interop import hf
from paxlite.interop.hf_config import Family
from tests.in_process import paxlite_command
from tests.interop import test_hf_open_families as open_families

family_dir = open_families.family_dir  # its module fixture: the four tiny checkpoints, here too

# family -> (registered experiment, the overrides its switches need to be the checkpoint's, the
# overrides that make one new switch differ, the line naming it). The tiny LLaMA-3 scales RoPE by
# 8 from an original context of 16 (LLaMA-3.2's: 32 from 8192); Mistral v0.3 has no window, the
# tiny Mistral 4 keys.
EXPERIMENTS = {
    Family.LLAMA: ("LLaMA3_2_1B",
                   ("ROPE_SCALING_FACTOR=8.0", "ROPE_SCALING_ORIGINAL_MAX_POSITION=16"),
                   ("ROPE_SCALING_FACTOR=8.0",),
                   ("rope_scaling: converted RopeScaling(kind=<RopeScalingKind.LLAMA3: "
                    "'llama3'>, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, "
                    "original_max_position_embeddings=16), experiment RopeScaling(kind="
                    "<RopeScalingKind.LLAMA3: 'llama3'>, factor=8.0, low_freq_factor=1.0, "
                    "high_freq_factor=4.0, original_max_position_embeddings=8192)")),
    Family.MISTRAL: ("Mistral7B", ("SLIDING_WINDOW=4",), (),
                     "sliding_window: converted 4, experiment None"),
    Family.QWEN2: ("Qwen2_5_0_5B", (), ("QKV_BIAS=false",),
                   "uses_qkv_bias: converted True, experiment False"),
    Family.QWEN3: ("Qwen3_8B", (), ("QK_NORM=false",), "qk_norm: converted True, experiment False"),
}


def _shapes(directory) -> tuple[str, ...]:
    """The overrides that shrink an experiment to the checkpoint's shapes, RoPE base and norm
    epsilon (none of the four new switches)."""
    config = json.loads((directory / "config.json").read_text())
    heads = config["num_attention_heads"]
    return tuple(f"--fdl.{name}={value}" for name, value in {
        "NUM_LAYERS": config["num_hidden_layers"], "NUM_HEADS": heads,
        "NUM_KV_HEADS": config["num_key_value_heads"], "MODEL_DIMS": config["hidden_size"],
        "HIDDEN_DIMS": config["intermediate_size"], "VOCAB_SIZE": config["vocab_size"],
        "DIMS_PER_HEAD": config.get("head_dim") or config["hidden_size"] // heads,
        "LAYERNORM_EPSILON": config["rms_norm_eps"],
        "ROPE_THETA": config["rope_parameters"]["rope_theta"]}.items())


def _convert(monkeypatch, capfd, directory, output, *, experiment: str, overrides):
    run = paxlite_command(monkeypatch, capfd)
    return run("convert", "--from=hf", "--to=paxlite", f"--input={directory}",
               f"--output={output}", f"--fdl_config={experiment}", *_shapes(directory),
               *(f"--fdl.{o}" for o in overrides))


def test_convert_into_the_familys_experiment(family_dir, tmp_path, monkeypatch, capfd):
    family, directory, _, want = family_dir
    experiment, switches, _, _ = EXPERIMENTS[family]
    result = _convert(monkeypatch, capfd, directory, tmp_path / "out", experiment=experiment,
                      overrides=switches)
    assert result.returncode == 0, result.stderr
    config = model_config_from_json((tmp_path / "out" / "model_config.json").read_text())
    assert config.scan_layers and config.attention_kind.value == "flash"  # the experiment's
    assert (config.rope_scaling is not None, config.uses_qkv_bias, config.qk_norm,
            config.sliding_window) == {
        Family.LLAMA: (True, False, False, None), Family.MISTRAL: (False, False, False, 4),
        Family.QWEN2: (False, True, False, None), Family.QWEN3: (False, False, True, None),
    }[family]
    converted = hf.from_paxlite(tmp_path / "out", dtype="float32")
    np.testing.assert_allclose(converted.logits(open_families.TOKENS), want, atol=1e-4, rtol=0)


def test_a_differing_switch_is_refused_naming_it(family_dir, tmp_path, monkeypatch, capfd):
    family, directory, _, _ = family_dir
    experiment, _, overrides, line = EXPERIMENTS[family]
    result = _convert(monkeypatch, capfd, directory, tmp_path / "out", experiment=experiment,
                      overrides=overrides)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[0] == (f"paxlite: error: the converted model is not {experiment}'s model "
                        "(1 differing fields):"), result.stderr
    assert lines[1].strip() == line, result.stderr
    assert not (tmp_path / "out").exists()
