"""Transformer Engine layers (models/te_layer.py, ENABLE_TE / ENABLE_FP8).

On CPU: the environment variables' errors and the one-line "needs a GPU" error with exit 2 through
the command line; the TE layer's arguments. On a GPU with TE (``-m gpu``): the TE layer built from
paxlite's converted parameters computes paxlite's layer, and its parameter tree is what
interop/te.py writes.
"""

from __future__ import annotations

import os
import re
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from paxlite.config.errors import ConfigError
from paxlite.experiments.transformer_engine_settings import env_flag, transformer_engine_fields
from paxlite.models import te_layer
from paxlite.models.transformer import LLAMA_ARCHITECTURE, TransformerConfig
from paxlite.models.transformer_config import LayerImplementation
from tests.fork_server import paxlite_python

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPT = TransformerConfig(vocab_size=64, num_layers=2, model_dims=32, num_heads=4, dims_per_head=8,
                        hidden_dims=48, max_seq_len=16)
LLAMA = TransformerConfig(vocab_size=64, num_layers=2, model_dims=32, num_heads=4, dims_per_head=8,
                          hidden_dims=48, max_seq_len=16, num_kv_heads=2, tie_embeddings=False,
                          **LLAMA_ARCHITECTURE)


def _te_available() -> bool:
    try:
        te_layer.import_transformer_engine()
    except te_layer.TransformerEngineUnavailableError:
        return False
    return True


@pytest.mark.parametrize(("env", "message"), [
    ({"ENABLE_TE": "yes"}, "ENABLE_TE='yes' is not valid; expected one of 0, 1, true, false"),
    ({"ENABLE_FP8": "2"}, "ENABLE_FP8='2' is not valid"),
    ({"ENABLE_FP8": "1"}, "use --fdl.USE_FP8=True"),
    ({"ENABLE_TE": "1"}, "with --fdl.USE_FP8=True"),
])
def test_bad_environment_is_one_config_error(env, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        transformer_engine_fields(native_fp8="ENABLE_TE" in env and env["ENABLE_TE"] == "1",
                                  environ=env)


def test_flags_read_like_pax():
    assert env_flag("X", {"X": "TRUE"}) and not env_flag("X", {"X": "0"}) and not env_flag("X", {})
    assert transformer_engine_fields(environ={"ENABLE_TE": "false", "ENABLE_FP8": "0"}) == {}


# JAX_PLATFORMS=cpu: refused whether or not TE is installed (no TE, or a backend that is not a GPU)
def test_enable_te_without_gpu_exits_2_with_one_line(tmp_path):
    env = {**os.environ, "ENABLE_TE": "1", "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [paxlite_python(), "-m", "paxlite.main", "--fdl_config=TinySynthetic",
         f"--job_log_dir={tmp_path / 'job'}"], capture_output=True, text=True, env=env, timeout=300,
        check=False)
    lines = [line for line in result.stderr.strip().splitlines() if "error" in line.lower()]
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1 and "Transformer Engine" in lines[0] and "NGC JAX container" in lines[0]
    assert "paxlite[te]" in lines[0] and not (tmp_path / "job" / "checkpoints").exists()


def test_layer_arguments_describe_paxlites_block():
    gpt, llama = te_layer.transformer_layer_kwargs(GPT), te_layer.transformer_layer_kwargs(LLAMA)
    assert (gpt["layernorm_type"], gpt["mlp_activations"], gpt["use_bias"]) == (
        "layernorm", ("gelu",), True)
    assert gpt["zero_centered_gamma"] and not gpt["enable_rotary_pos_emb"]
    assert (llama["layernorm_type"], llama["mlp_activations"], llama["num_gqa_groups"]) == (
        "rmsnorm", ("silu", "linear"), 2)
    assert llama["enable_rotary_pos_emb"] and llama["rotary_pos_emb_windows"] == (1, 10000.0)
    for kw in (gpt, llama):
        assert kw["self_attn_mask_type"] == "causal" and kw["scale_attn_logits"]
        assert not kw["enable_relative_embedding"] and kw["hidden_size"] == 32


def test_autocast_arguments_are_pax_recipe_on_our_mesh_axes():
    import dataclasses

    config = dataclasses.replace(GPT, layer_implementation=LayerImplementation.TRANSFORMER_ENGINE)
    kw = te_layer.autocast_kwargs(config)
    assert kw["enabled"] is False
    assert kw["recipe"] == {"margin": 0, "fp8_format": "HYBRID", "amax_history_len": 1024,
                            "amax_compute_algo": "max"}
    assert kw["mesh_resource"] == {"dp_resource": "data", "fsdp_resource": "fsdp",
                                   "tp_resource": "tensor"}
    assert te_layer.fp8_state_collections(config) == ()
    fp8 = dataclasses.replace(config, te=dataclasses.replace(config.te_settings, fp8=True))
    assert te_layer.fp8_state_collections(fp8) == ("fp8_metas",)


# ENABLE_TE=1 with settings TE's layer would not read: refused at validation, before TE is imported,
# so the same one line on a CPU machine and on a GPU with TE (formerly silently ignored there).
@pytest.mark.parametrize(("name", "settings", "ignored"), [
    ("TinySynthetic", ["ATTENTION_KIND=flash"], r"ATTENTION_KIND='flash' \(TE's TransformerLayer"),
    ("TinySynthetic", ["USE_CUDNN_FLASH_ATTENTION=true"], r"USE_CUDNN_FLASH_ATTENTION=true \(TE's"),
    ("TinySynthetic", ["ATTENTION_KIND=flash", "ATTENTION_IMPLEMENTATION=xla"],
     r"ATTENTION_IMPLEMENTATION='xla', ATTENTION_KIND='flash' \("),
    ("TinySynthetic", ["USE_REPEATED_LAYER=true", "CHECKPOINT_POLICY=SAVE_CONTEXT"],
     r"CHECKPOINT_POLICY='SAVE_CONTEXT' \(it selects tensors by checkpoint_name tags"),
    # AXLearn's -flash variant sets ATTENTION_KIND itself; Fuji's remat policy is name-based
    ("fuji-test-v2-flash", ["USE_REPEATED_LAYER=true"],
     r"ATTENTION_KIND='flash' \(.*\); CHECKPOINT_POLICY='SAVE_DOT_FOR_MLPERF_200B' \("),
], ids=["kind", "cudnn-switch", "implementation", "remat", "fuji-flash"])
def test_settings_te_would_ignore_are_refused(monkeypatch, name, settings, ignored):
    from paxlite.experiments.build import load_experiment

    monkeypatch.setenv("ENABLE_TE", "1")
    with pytest.raises(ConfigError) as info:
        load_experiment(name, settings)
    message = str(info.value)
    prefix = "ENABLE_TE=1 runs Transformer Engine's layers, which would ignore "
    assert message.startswith(prefix) and message.endswith("; or set ENABLE_TE=0"), message
    assert re.match(re.escape(prefix) + r"\w[\w-]*'s " + ignored, message), message
    assert "\n" not in message


def test_settings_te_runs_pass_the_check(monkeypatch):
    """Defaults and remat policies that do not select by name get past it (to TE's own check)."""
    from paxlite.experiments.build import load_experiment

    monkeypatch.setenv("ENABLE_TE", "1")
    for settings in ([], ["USE_REPEATED_LAYER=true", "CHECKPOINT_POLICY=SAVE_NOTHING"]):
        if _te_available():
            load_experiment("TinySynthetic", settings)
        else:
            with pytest.raises(te_layer.TransformerEngineUnavailableError):
                load_experiment("TinySynthetic", settings)
    monkeypatch.setenv("ENABLE_TE", "0")  # without TE every one of them is read
    load_experiment("TinySynthetic", ["ATTENTION_KIND=flash", "USE_REPEATED_LAYER=true",
                                      "CHECKPOINT_POLICY=SAVE_CONTEXT"])


@pytest.mark.parametrize(("changes", "message"), [
    ({"attention_kind": "flash"}, "attention_kind='flash'"),
    ({"attention_kind": "flash", "attention_implementation": "cudnn"},
     "attention_kind='flash': .*; attention_implementation='cudnn'"),
    ({"scan_layers": True, "remat_policy": "save_qkv_out_proj"},
     "remat_policy='save_qkv_out_proj': it keeps tensors by their checkpoint_name tags"),
], ids=["kind", "implementation", "remat"])
def test_te_layer_refuses_what_it_would_ignore(changes, message):
    """From Python (no experiment): the TE layer says so when traced, before importing TE."""
    import dataclasses

    from paxlite.models.transformer import Transformer

    config = dataclasses.replace(GPT, layer_implementation=LayerImplementation.TRANSFORMER_ENGINE,
                                 **changes)
    with pytest.raises(ValueError, match="layer_implementation='transformer_engine' would ignore "
                       + message):
        jax.eval_shape(lambda: Transformer(config).init({"params": jax.random.key(0)},
                                                        jnp.zeros((1, 16), jnp.int32)))
    assert (
        te_layer.settings_te_ignores(
            attention_kind="dot_product",
            attention_implementation="auto",
            remat_policy="save_dot_with_no_batch_dim",
        )
        == []
    )


# ---------------------------------------------------------------- GPU, with TE
@pytest.mark.gpu
@pytest.mark.parametrize("config", [GPT, LLAMA], ids=["gpt", "llama"])
def test_te_model_computes_paxlites_model(config):
    import dataclasses

    if not _te_available():
        pytest.skip("Transformer Engine with a GPU is not available")
    from paxlite.interop import te
    from paxlite.models.transformer import Transformer

    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 64)
    params = nn.meta.unbox(
        Transformer(config).init({"params": jax.random.key(0)}, tokens)["params"]
    )
    te_config = dataclasses.replace(config, layer_implementation="transformer_engine")
    te_init = nn.meta.unbox(Transformer(te_config).init({"params": jax.random.key(0)}, tokens))
    layer = te_init["params"]["layers_0"]
    flat = {"/".join(str(getattr(k, "key", k)) for k in p): v.shape
            for p, v in jax.tree_util.tree_flatten_with_path(layer)[0]}
    assert flat == te.te_param_shapes(config)
    converted = te.params_to_te(jax.tree.map(np.asarray, params), config=config)
    ours = Transformer(config).apply({"params": params}, tokens)
    theirs = Transformer(te_config).apply({"params": converted}, tokens)
    np.testing.assert_allclose(np.asarray(theirs), np.asarray(ours), rtol=2e-3, atol=2e-3)
    assert jnp.all(jnp.isfinite(theirs))
