"""Today's open models as registered experiments (llama3.py, mistral.py, qwen.py: the published
shapes and parameter counts, the Hugging Face ids), and FineTune from any converted model.

The counts are the published ones, which transformers gives for each model's config.json; the
models are traced abstractly (tests/experiments/traced.py), nothing is allocated. FineTune starts
from a tiny LLaMA that transformers writes here and `python -m paxlite convert` converts, in this
process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys

import fiddle as fdl
import jax
import numpy as np
import pytest

from paxlite.cli.catalogue import parameter_counts
from paxlite.config.errors import ConfigError
from paxlite.experiments import EXPERIMENTS, finetune
from paxlite.experiments.build import load_experiment
from paxlite.models.rotary import RopeScaling
from tests.experiments.traced import traced_num_params
from tests.in_process import paxlite_command

PUBLISHED = {
    "LLaMA3_1_8B": 8_030_261_248,
    "LLaMA3_1_70B": 70_553_706_496,
    "LLaMA3_2_1B": 1_235_814_400,
    "LLaMA3_2_3B": 3_212_749_824,
    "Mistral7B": 7_248_023_552,
    "Qwen2_5_0_5B": 494_032_768,
    "Qwen2_5_7B": 7_615_616_512,
    "Qwen3_8B": 8_190_735_360,
    "Qwen3_30B_A3B": 30_532_122_624,
    "Gemma2_9B": 9_241_705_984,
}
# From each published config.json, by hand: (hidden_size, intermediate_size, num_hidden_layers,
# num_attention_heads, num_key_value_heads, head_dim, vocab_size, rope_theta, rms_norm_eps,
# tie_word_embeddings)
CONFIG_JSON = {
    "LLaMA3_1_8B": (4096, 14336, 32, 32, 8, 128, 128256, 5e5, 1e-5, False),
    "LLaMA3_1_70B": (8192, 28672, 80, 64, 8, 128, 128256, 5e5, 1e-5, False),
    "LLaMA3_2_1B": (2048, 8192, 16, 32, 8, 64, 128256, 5e5, 1e-5, True),
    "LLaMA3_2_3B": (3072, 8192, 28, 24, 8, 128, 128256, 5e5, 1e-5, True),
    "Mistral7B": (4096, 14336, 32, 32, 8, 128, 32768, 1e6, 1e-5, False),
    "Qwen2_5_0_5B": (896, 4864, 24, 14, 2, 64, 151936, 1e6, 1e-6, True),
    "Qwen2_5_7B": (3584, 18944, 28, 28, 4, 128, 152064, 1e6, 1e-6, False),
    "Qwen3_8B": (4096, 12288, 36, 32, 8, 128, 151936, 1e6, 1e-6, False),
    "Qwen3_30B_A3B": (2048, 6144, 48, 32, 4, 128, 151936, 1e6, 1e-6, False),
}


def _model(name: str):
    return fdl.build(EXPERIMENTS[name].resolve({}).model_config())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_parameter_counts(name: str) -> None:
    model = _model(name)
    assert traced_num_params(model) == PUBLISHED[name]
    assert parameter_counts(model)[0] == PUBLISHED[name]  # what `list` and `show` print


@pytest.mark.parametrize("name", sorted(CONFIG_JSON))
def test_shapes_and_rope_settings_are_the_published_config_json(name: str) -> None:
    m = _model(name)
    assert (m.model_dims, m.hidden_dims, m.num_layers, m.num_heads, m.kv_heads, m.dims_per_head,
            m.vocab_size, m.rope_theta, m.norm_epsilon, m.tie_embeddings) == CONFIG_JSON[name]
    assert (m.use_bias, m.gated_mlp, m.activation.value, m.sliding_window) == (
        False, True, "silu", None)
    factor = {"LLaMA3_1": 8.0, "LLaMA3_2": 32.0}.get(name[:8])
    want = None if factor is None else RopeScaling(
        factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192)
    assert m.rope_scaling == want
    assert (m.qkv_bias, m.qk_norm) == {
        "Qwen2_5_0_5B": (True, False), "Qwen2_5_7B": (True, False), "Qwen3_8B": (None, True),
        "Qwen3_30B_A3B": (None, True),
    }.get(name, (None, False))


def test_hugging_face_ids_name_the_same_experiments() -> None:
    for hf_id, name in {"meta-llama/Llama-3.1-8B": "LLaMA3_1_8B",
                        "meta-llama/Llama-3.1-70B": "LLaMA3_1_70B",
                        "meta-llama/Llama-3.2-1B": "LLaMA3_2_1B",
                        "meta-llama/Llama-3.2-3B": "LLaMA3_2_3B",
                        "mistralai/Mistral-7B-v0.3": "Mistral7B",
                        "Qwen/Qwen2.5-0.5B": "Qwen2_5_0_5B", "Qwen/Qwen2.5-7B": "Qwen2_5_7B",
                        "Qwen/Qwen3-8B": "Qwen3_8B", "Qwen/Qwen3-30B-A3B": "Qwen3_30B_A3B",
                        "Qwen/Qwen3-30B-A3B-Base": "Qwen3_30B_A3B"}.items():
        assert type(load_experiment(hf_id)) is EXPERIMENTS[name], hf_id


def test_fine_tuning_defaults() -> None:
    e = load_experiment("LLaMA3_1_8B")
    assert (e.ICI_MESH_SHAPE, e.DCN_MESH_SHAPE, e.PERCORE_BATCH_SIZE, e.MAX_SEQ_LEN) == (
        [1, 8, 1], [1, 1, 1], 2, 8192)
    assert (e.LEARNING_RATE, e.LR_SCHEDULE, e.LR_COS_WARMUP, e.LR_COS_DECAY_END, e.MAX_STEPS) == (
        2e-5, "linear_rampup_cosine_decay", 100, 1000, 1000)
    assert load_experiment("LLaMA3_1_8B", ["MAX_STEPS=300"]).LR_COS_DECAY_END == 300
    assert not EXPERIMENTS["Qwen3_8B"].family_adds_bos and EXPERIMENTS["Mistral7B"].family_adds_bos


def test_qwen3_moe_experts_and_mesh() -> None:
    """Qwen3-30B-A3B's published config.json: 128 experts of moe_intermediate_size 768 on every
    layer (decoder_sparse_step 1, no mlp_only_layers), top-8 renormalised (norm_topk_prob true),
    no shared expert; a full fine-tune's memory defaults on 8 devices (FSDP over all of them,
    Adam's first moment in bfloat16, the loss in blocks of 1,024 positions)."""
    model = _model("Qwen3_30B_A3B")
    moe = model.moe
    assert (moe.num_experts, moe.experts_per_token, moe.routing.value, moe.moe_layer_interval,
            moe.expert_hidden_dims, moe.gated_experts, moe.expert_activation.value,
            moe.renormalize_top_k) == (128, 8, "dropless_topk", 1, 768, True, "silu", True)
    assert moe.load_balancing_weight == pytest.approx(0.001 * 8 / 48)  # HF coef x top-k / layers
    assert parameter_counts(model)[1] == 3_353_032_704  # active per token
    e = load_experiment("Qwen3_30B_A3B")
    assert (e.ICI_MESH_SHAPE, e.DCN_MESH_SHAPE, e.PERCORE_BATCH_SIZE, e.LEARNING_RATE,
            e.ADAM_MU_DTYPE, e.LOSS_CHUNK_SIZE) == ([1, 8, 1, 1], [1, 1, 1], 1, 2e-5,
                                                    "bfloat16", 1024)
    assert fdl.build(e.optimizer_config()).mu_dtype == "bfloat16"


def test_rope_scaling_settings_are_checked_in_their_names() -> None:
    with pytest.raises(ConfigError, match=r"ROPE_SCALING_FACTOR set but ROPE_SCALING='none'"):
        load_experiment("LLaMA3_1_8B", ["ROPE_SCALING=none", "ROPE_SCALING_FACTOR=4.0"])
    assert _model_with("LLaMA3_1_8B", ["ROPE_SCALING=none"]).rope_scaling is None
    with pytest.raises(ConfigError, match=r"ROPE_SCALING_HIGH_FREQ_FACTOR=0.5 must be larger"):
        load_experiment("LLaMA3_1_8B", ["ROPE_SCALING_HIGH_FREQ_FACTOR=0.5"])
    with pytest.raises(ConfigError, match=r"SLIDING_WINDOW=0 must be None"):
        load_experiment("Mistral7B", ["SLIDING_WINDOW=0"])
    assert _model_with("Mistral7B", ["SLIDING_WINDOW=4096"]).sliding_window == 4096
    # a seq axis cannot run a window: refused in the settings' names before anything is built
    with pytest.raises(ConfigError, match=r"SLIDING_WINDOW=4096 with a seq axis of 2"):
        load_experiment("Mistral7B", ["SLIDING_WINDOW=4096", "ICI_MESH_SHAPE=[1,4,1,1,1,2]"])


def test_gemma2_9b_is_the_published_config_json() -> None:
    """Gemma 2 9B's config.json: hidden 3584, ffn 14336, 42 layers, 16 heads, 8 kv heads x 256,
    vocabulary 256000, tied, window 4096 on the even layers, soft-caps 50 / 30,
    query_pre_attn_scalar 256, RoPE base 1e4 unscaled, eps 1e-6, gelu_pytorch_tanh."""
    m = _model("Gemma2_9B")
    assert (m.model_dims, m.hidden_dims, m.num_layers, m.num_heads, m.kv_heads, m.dims_per_head,
            m.vocab_size, m.rope_theta, m.norm_epsilon, m.tie_embeddings) == (
        3584, 14336, 42, 16, 8, 256, 256000, 1e4, 1e-6, True)
    assert (m.norm.value, m.activation.value, m.gated_mlp, m.use_bias, m.post_norms,
            m.scale_embeddings, m.query_scale_dims, m.attention_logit_cap, m.final_logit_cap,
            m.sliding_window, m.rope_scaling, m.qk_norm, m.local_rope_theta) == (
        "gemma_rms_norm", "gelu_tanh", True, False, True, True, 256, 50.0, 30.0, 4096, None,
        False, None)
    assert [t.value for t in m.layer_types] == ["sliding_attention", "full_attention"] * 21
    assert (m.scan_layers, m.layers_per_scan_unit, m.attention_kind.value) == (
        True, 2, "dot_product")
    for hf_id in ("google/gemma-2-9b", "google/gemma-2-9b-it"):
        assert type(load_experiment(hf_id)) is EXPERIMENTS["Gemma2_9B"], hf_id
    # the fused kernels have no soft-cap: refused in the settings' names
    with pytest.raises(ConfigError, match=r"ATTENTION_LOGIT_SOFTCAP=50.0 with "
                                          r"ATTENTION_KIND='flash'"):
        load_experiment("Gemma2_9B", ["ATTENTION_KIND=flash"])
    assert _model_with("Gemma2_9B", ["ATTENTION_KIND=flash", "ATTENTION_LOGIT_SOFTCAP=None"]
                       ).attention_logit_cap is None
    # a pipeline splits the stack by units of a sliding and a global layer
    with pytest.raises(ConfigError, match=r"NUM_LAYERS=42 \(21 units of 2 layers\) does not "
                                          r"split into 2 pipeline stages"):
        load_experiment("Gemma2_9B", ["NUM_STAGES=2", "ICI_MESH_SHAPE=[2,4,1]"])


def _model_with(name: str, overrides: list[str]):
    return fdl.build(load_experiment(name, overrides).model_config())


# ---------------------------------------------------------------------------- FineTune
@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> str:
    """A tiny random LLaMA-3.2 (tied embeddings, `llama3` RoPE scaling) written by transformers,
    converted by `python -m paxlite convert`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from paxlite import __main__ as paxlite_cli

    root = tmp_path_factory.mktemp("finetune")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=5e5,
                         initializer_range=0.1, tie_word_embeddings=True,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 16})
    LlamaForCausalLM(config).save_pretrained(root / "hf", safe_serialization=True)
    output = root / "converted"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", [paxlite_cli.__file__, "convert", "--from=hf", "--to=paxlite",
                                    f"--input={root / 'hf'}", f"--output={output}"])
        assert paxlite_cli.run() == 0
    return str(output)


def test_finetune_reads_the_model_from_model_config_json(converted: str) -> None:
    from paxlite.checkpointing.pretrained import MODEL_CONFIG_FILE, load_model_config

    assert finetune.MODEL_CONFIG_FILE == MODEL_CONFIG_FILE
    recorded = load_model_config(converted)
    for path in (converted, os.path.join(converted, "checkpoints")):
        e = load_experiment("FineTune", [f"CHECKPOINT_RESTORE_PATH={path}",
                                         "ATTENTION_KIND=dot_product"])  # not fused
        assert (e.NUM_LAYERS, e.MODEL_DIMS, e.NUM_HEADS, e.NUM_KV_HEADS, e.DIMS_PER_HEAD,
                e.HIDDEN_DIMS, e.VOCAB_SIZE, e.ROPE_THETA, e.TIE_EMBEDDINGS) == (
            2, 32, 4, 2, 8, 64, 128, 5e5, True)
        assert (e.ROPE_SCALING, e.ROPE_SCALING_FACTOR, e.ROPE_SCALING_LOW_FREQ_FACTOR,
                e.ROPE_SCALING_HIGH_FREQ_FACTOR, e.ROPE_SCALING_ORIGINAL_MAX_POSITION) == (
            "llama3", 32.0, 1.0, 4.0, 16)
        assert e.VOCAB_PATH is None  # the random model has no tokenizer to copy
        model = fdl.build(e.model_config())
        assert model == recorded
    # Overrides win where no shape changes; a shape the weights do not have is one error.
    e = load_experiment("FineTune", [f"CHECKPOINT_RESTORE_PATH={converted}", "MAX_SEQ_LEN=16",
                                     "LAYERNORM_EPSILON=1e-6", "ATTENTION_KIND=dot_product"])
    model = fdl.build(e.model_config())
    assert model == dataclasses.replace(recorded, max_seq_len=16, norm_epsilon=1e-6)
    e = load_experiment("FineTune", [f"CHECKPOINT_RESTORE_PATH={converted}", "ROPE_SCALING=none"])
    assert fdl.build(e.model_config()).rope_scaling is None
    with pytest.raises(ConfigError, match=r"^VOCAB_SIZE=256 \(the checkpoint's is 128\); "
                                          r"NUM_LAYERS=3 \(the checkpoint's is 2\): the weights "):
        load_experiment("FineTune", [f"CHECKPOINT_RESTORE_PATH={converted}", "NUM_LAYERS=3",
                                     "VOCAB_SIZE=256"])


def test_finetune_takes_the_tokenizer_beside_the_model(converted: str, tmp_path) -> None:
    shutil.copy(os.path.join(converted, finetune.MODEL_CONFIG_FILE), tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"")
    path = f"CHECKPOINT_RESTORE_PATH={tmp_path}"
    assert load_experiment("FineTune", [path]).VOCAB_PATH == str(tmp_path / "tokenizer.model")
    (tmp_path / "tokenizer.json").write_text("{}")  # what transformers reads first
    assert load_experiment("FineTune", [path]).VOCAB_PATH == str(tmp_path / "tokenizer.json")
    assert load_experiment("FineTune", [path, "VOCAB_PATH=/v.model"]).VOCAB_PATH == "/v.model"


def test_finetune_show_and_its_one_line_errors(converted: str, tmp_path, monkeypatch,
                                              capfd) -> None:
    from paxlite.checkpointing.pretrained import load_model_config

    run = paxlite_command(monkeypatch, capfd)
    shown = run("show", "--fdl_config=FineTune", f"--fdl.CHECKPOINT_RESTORE_PATH={converted}")
    assert shown.returncode == 0, shown.stderr
    count = parameter_counts(load_model_config(converted))[0]
    assert f"num_params: {count}" in shown.stdout
    for line in ("NUM_LAYERS = 2", "MODEL_DIMS = 32", "NUM_KV_HEADS = 2", "VOCAB_SIZE = 128",
                 "ROPE_SCALING = 'llama3'", "TIE_EMBEDDINGS = True"):
        assert line in shown.stdout
    for flags, says in (
            ([f"--fdl.CHECKPOINT_RESTORE_PATH={tmp_path}"], f"no {tmp_path}/model_config.json"),
            ([], "pass --fdl.CHECKPOINT_RESTORE_PATH=DIR")):
        result = run("show", "--fdl_config=FineTune", *flags)
        assert result.returncode == 2, result
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("paxlite: error: "), result.stderr
        assert says in lines[0]
    (tmp_path / "model_config.json").write_text("{not json")
    result = run("show", "--fdl_config=FineTune", f"--fdl.CHECKPOINT_RESTORE_PATH={tmp_path}")
    assert result.returncode == 2 and "cannot read" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_finetune_trains_from_the_converted_weights(converted: str, tmp_path) -> None:
    """The run starts from exactly the converted parameters, then trains 2 steps."""
    from paxlite.checkpointing.pretrained import read_state
    from paxlite.experiments.build import build_run_config
    from paxlite.train.loop import Run, RunContext

    _, config = build_run_config("FineTune", [
        f"CHECKPOINT_RESTORE_PATH={converted}", "SYNTHETIC_DATA=true", "MAX_STEPS=2",
        "MAX_SEQ_LEN=16", "PERCORE_BATCH_SIZE=1",
        "EVAL_INTERVAL_STEPS=2", "SUMMARY_INTERVAL_STEPS=1", "CHECKPOINT_EVERY_N_STEPS=2"])
    saved = read_state(converted)[2]["params"]
    context = RunContext(job_dir=str(tmp_path / "job"), enable_checkpoint_saving=False)
    with Run(config, context) as run:
        start = run.restore_or_init()
        flat = dict(jax.tree_util.tree_flatten_with_path(start.params)[0])
        want = dict(jax.tree_util.tree_flatten_with_path(saved)[0])
        assert flat.keys() == want.keys()
        for key, value in want.items():
            np.testing.assert_array_equal(np.asarray(flat[key]), value, err_msg=str(key))
        final = run.train()
    assert int(final.step) == 2
    moved = [not np.array_equal(np.asarray(a), b) for a, b in
             zip(jax.tree.leaves(final.params), jax.tree.leaves(saved))]
    assert all(moved)


def test_a_registered_experiment_still_checks_the_checkpoint_against_itself(converted: str,
                                                                             tmp_path) -> None:
    """LLaMA3_2_1B describes its own model: the tiny checkpoint does not fit it, which the run says
    before any state is built (FineTune would have taken the checkpoint's shapes)."""
    from paxlite.checkpointing.pretrained import PretrainedCheckpointError
    from paxlite.experiments.build import build_run_config
    from paxlite.train.loop import Run, RunContext

    _, config = build_run_config("meta-llama/Llama-3.2-1B", [
        f"CHECKPOINT_RESTORE_PATH={converted}", "SYNTHETIC_DATA=true", "MAX_SEQ_LEN=64",
        "PERCORE_BATCH_SIZE=1"])
    context = RunContext(job_dir=str(tmp_path / "job"), enable_checkpoint_saving=False)
    with pytest.raises(PretrainedCheckpointError, match="parameters this model does not have"):
        Run(config, context)


def test_finetune_of_a_gemma2_checkpoint(tmp_path) -> None:
    """Gemma 2's soft-capped attention has no fused kernel: FineTune runs its einsums by default
    and refuses 'flash' in one line; Gemma's text starts with BOS as LLaMA's does."""
    from paxlite.checkpointing.pretrained import MODEL_CONFIG_FILE, model_config_to_json
    from paxlite.interop.hf_config import from_hf_config

    _, recorded = from_hf_config({
        "model_type": "gemma2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8})
    (tmp_path / MODEL_CONFIG_FILE).write_text(model_config_to_json(recorded))
    path = f"CHECKPOINT_RESTORE_PATH={tmp_path}"
    e = load_experiment("FineTune", [path])
    assert (e.ATTENTION_KIND, e.family_adds_bos) == ("dot_product", True)
    assert fdl.build(e.model_config()) == recorded
    with pytest.raises(ConfigError, match=r"^ATTENTION_KIND='flash' with the checkpoint's "
                                          r"attention logit soft-cap 50.0 \(Gemma 2\)"):
        load_experiment("FineTune", [path, "ATTENTION_KIND=flash"])


def _recorded(tmp_path, hf_config: dict) -> str:
    """CHECKPOINT_RESTORE_PATH=DIR of a model_config.json as `convert` records ``hf_config``."""
    from paxlite.checkpointing.pretrained import MODEL_CONFIG_FILE, model_config_to_json
    from paxlite.interop.hf_config import from_hf_config

    _, recorded = from_hf_config(hf_config)
    (tmp_path / MODEL_CONFIG_FILE).write_text(model_config_to_json(recorded))
    return f"CHECKPOINT_RESTORE_PATH={tmp_path}"


_SMALL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}


def test_finetune_of_a_gemma3_checkpoint_with_linear_rope_and_a_pipeline(tmp_path) -> None:
    """Gemma 3's linear RoPE scaling on its global layers is the checkpoint's, and a pipeline
    splits whole periods of its sliding and global layers, refusing in one line what does not
    split (FineTune's scanned unit is the checkpoint's)."""
    path = _recorded(tmp_path, {**_SMALL, "model_type": "gemma3_text", "sliding_window": 4,
                                "sliding_window_pattern": 2, "rope_theta": 1e6,
                                "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    e = load_experiment("FineTune", [path])
    assert (e.ROPE_SCALING, e.ROPE_SCALING_FACTOR) == ("linear", 8.0)
    model = fdl.build(e.model_config())
    assert (model.rope_scaling.kind.value, model.rope_scaling.factor) == ("linear", 8.0)
    assert e.layers_per_scan_unit() == 2
    two_stages = load_experiment("FineTune", [path, "ICI_MESH_SHAPE=[1,1,1,1,2]"])
    assert fdl.build(two_stages.model_config()).pipeline.num_stages == 2
    with pytest.raises(ConfigError, match=r"NUM_LAYERS=4 \(2 units of 2 layers\) does not split "
                                          r"into 4 pipeline stages"):
        load_experiment("FineTune", [path, "ICI_MESH_SHAPE=[1,1,1,1,4]"])
    with pytest.raises(ConfigError, match=r"ROPE_SCALING_LOW_FREQ_FACTOR set but "
                                          r"ROPE_SCALING='linear' reads only ROPE_SCALING_FACTOR"):
        load_experiment("FineTune", [path, "ROPE_SCALING_LOW_FREQ_FACTOR=2.0"])


def test_finetune_of_a_qwen3_moe_checkpoint_with_lora_and_a_pipeline(tmp_path) -> None:
    """An MoE checkpoint: LoRA on the MLP matmuls is refused in the setting's name; a pipeline
    splits the checkpoint's units (every layer sparse: one layer each)."""
    path = _recorded(tmp_path, {**_SMALL, "model_type": "qwen3_moe", "num_experts": 4,
                                "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                "norm_topk_prob": True})
    for targets in ("all", "mlp"):
        with pytest.raises(ConfigError, match=rf"LORA_TARGET_LAYERS='{targets}' puts adapters on "
                                              r"the MLP matmuls.*LORA_TARGET_LAYERS=attention"):
            load_experiment("FineTune", [path, "USE_LORA=true", f"LORA_TARGET_LAYERS={targets}"])
    lora = load_experiment("FineTune", [path, "USE_LORA=true", "LORA_TARGET_LAYERS=attention"])
    assert lora.with_lora(lora.model_config()).lora_rank == 8
    e = load_experiment("FineTune", [path, "ICI_MESH_SHAPE=[1,1,1,1,2]"])
    assert e.layers_per_scan_unit() == 1
    assert fdl.build(e.model_config()).pipeline.num_stages == 2


def test_an_export_of_a_finetune_job_keeps_the_base_models_context(converted: str,
                                                                   tmp_path) -> None:
    """The job trained at MAX_SEQ_LEN=16; the HF export of its model says the 64 positions of
    the converted model it started from (RoPE has no table that the training length bounds)."""
    from paxlite.cli.conversion import model_config_from_job

    overrides = {"CHECKPOINT_RESTORE_PATH": converted, "MAX_SEQ_LEN": 16}
    (tmp_path / "config.json").write_text(json.dumps({
        "experiment": "FineTune", "hparams": overrides, "overridden": sorted(overrides)}))
    assert load_experiment("FineTune", [f"{k}={v}" for k, v in overrides.items()]).MAX_SEQ_LEN \
        == 16
    assert model_config_from_job(tmp_path).max_seq_len == 64


def test_fine_tuning_text_starts_with_bos_as_the_model_is_prompted(converted: str,
                                                                  tmp_path) -> None:
    """FineTune of a LLaMA-style checkpoint and the registered open families feed each document's
    first token from BOS (the text pipeline falls back to 0 for a tokenizer without one); a GPT-2
    checkpoint and Pax's experiments keep SeqIO's 0. Set where nothing reads it: one line."""
    from paxlite.data.packing import DocumentStart

    data = f"DATA_DIR={tmp_path}"
    llama = load_experiment("FineTune", [f"CHECKPOINT_RESTORE_PATH={converted}", data])
    assert llama.DOCUMENT_START == "bos"
    assert fdl.build(llama.data_config()).document_start is DocumentStart.BOS
    gpt2 = _recorded(tmp_path, {"model_type": "gpt2", "vocab_size": 64, "n_embd": 32,
                                "n_layer": 2, "n_head": 4, "n_positions": 16})
    assert load_experiment("FineTune", [gpt2]).DOCUMENT_START == "zero"
    assert [load_experiment(name).DOCUMENT_START for name in (
        "LLaMA3_1_8B", "Qwen3_8B", "Gemma2_9B", "GPT126M", "LLaMA7B")] == [
        "bos", "bos", "bos", "zero", "zero"]
    with pytest.raises(ConfigError, match=r"DOCUMENT_START='zero' is read by the text pipeline "
                                          r"only .*SYNTHETIC_DATA=True: drop it"):
        load_experiment("FineTune", [f"CHECKPOINT_RESTORE_PATH={converted}",
                                     "SYNTHETIC_DATA=true", "DOCUMENT_START=zero"])


def test_finetune_moves_a_deepseek_v3_choice_bias_only_when_asked(tmp_path) -> None:
    """MOE_BIAS_UPDATE_SPEED reaches a converted DeepSeek-V3's routers (0 by default, whatever the
    checkpoint recorded: the bias stays as loaded), and is refused in one line for a checkpoint
    whose router has no choice bias (V2's) and for a bad value."""
    import dataclasses

    from paxlite.checkpointing.pretrained import MODEL_CONFIG_FILE, model_config_to_json
    from paxlite.interop.hf_config import from_hf_config
    from tests.interop.test_hf_deepseek import _json

    v3, v2 = tmp_path / "v3", tmp_path / "v2"
    _, recorded = from_hf_config(_json("v3"))
    router = recorded.moe.deepseek_router
    moving = dataclasses.replace(recorded, moe=dataclasses.replace(
        recorded.moe, deepseek_router=dataclasses.replace(router, bias_update_speed=0.5)))
    for directory, model in ((v3, moving), (v2, from_hf_config(_json("v2_lite"))[1])):
        directory.mkdir()
        (directory / MODEL_CONFIG_FILE).write_text(model_config_to_json(model))

    def speed(*overrides):
        e = load_experiment("FineTune", [f"CHECKPOINT_RESTORE_PATH={v3}", *overrides])
        return fdl.build(e.model_config()).moe.deepseek_router.bias_update_speed

    assert speed() == 0.0
    assert speed("MOE_BIAS_UPDATE_SPEED=0.001") == 0.001
    with pytest.raises(ConfigError, match=r"^MOE_BIAS_UPDATE_SPEED=0.001: the checkpoint's router "
                                          r"has no choice bias"):
        load_experiment("FineTune", [f"CHECKPOINT_RESTORE_PATH={v2}",
                                     "MOE_BIAS_UPDATE_SPEED=0.001"])
    with pytest.raises(ConfigError, match="MOE_BIAS_UPDATE_SPEED=-1.0"):
        load_experiment("FineTune", [f"CHECKPOINT_RESTORE_PATH={v3}", "MOE_BIAS_UPDATE_SPEED=-1.0"])
