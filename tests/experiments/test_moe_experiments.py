"""GLaM and Mixtral experiments: parameter counts (total and active) against hand formulas, FLOPs
per token by hand, Pax's names and settings, and every MoE misconfiguration as one ConfigError.

The counts come from the config (models/moe_params.py) and, once the MoE layer is in the model,
from the built model (`paxlite.cli.catalogue.parameter_counts` counts abstractly when it can);
the hand formulas here are written out independently of both.
"""

import json
import os
import subprocess

import fiddle as fdl
import pytest

from paxlite.cli.show import describe
from paxlite.config.errors import ConfigError
from paxlite.config.registry import resolve_experiment
from paxlite.experiments import EXPERIMENTS, glam, mixtral, tiny
from paxlite.experiments.build import load_experiment
from paxlite.models import moe_params
from paxlite.models.activations import Activation
from paxlite.models.moe_config import MoeRouting
from paxlite.models.transformer import NormKind, PositionEmbedding
from paxlite.train import flops as flops_lib
from tests.experiments.traced import traced_num_params, traced_variables
from tests.fork_server import paxlite_python


def glam_params(*, L, D, H, h, F, V, E, buckets=32):
    """Praxis GLaM by hand: tied [V, D] embedding; per layer two RMSNorm scales, q/k/v/o, a
    [buckets, H] relative bias; even layers a [D, E] router and E x (wi, wo); odd layers a gated
    dense FFN (wi, wi_gate, wo); a final RMSNorm scale. No biases."""
    attention_layer = 2 * D + 4 * D * H * h + buckets * H
    moe_ffn = D * E + E * 2 * D * F
    dense_ffn = 3 * D * F
    return V * D + L * attention_layer + (L // 2) * moe_ffn + (L // 2) * dense_ffn + D


def glam_active(*, L, D, F, E, total):
    return total - (L // 2) * (E - 2) * 2 * D * F  # a token skips E - 2 experts per MoE layer


def mixtral_params(*, L, D, H, KV, h, F, V, E):
    """HF MixtralForCausalLM by hand: untied embedding and head; per layer two RMSNorms, q/k/v/o
    with grouped-query k/v, a [D, E] gate and E SwiGLU experts (w1, w2, w3); a final norm."""
    return 2 * V * D + L * (2 * D + 2 * D * H * h + 2 * D * KV * h + D * E + E * 3 * D * F) + D


def model_of(name, *assignments):
    return fdl.build(load_experiment(name, list(assignments)).model_config())


@pytest.mark.parametrize("kernel, local_copies", [("ragged_dot", 32), ("tiled", 0)])
def test_the_dropless_routing_memory_is_counted_by_hand(kernel, local_copies):
    """Qwen3_30B_A3B with an expert axis (fsdp 2 x expert 4, 8 x 8,192 tokens): each device sorts
    expert 4 x 8,192 tokens x k 8 = 262,144 rows of D 2,048 and F 768 in bf16; ragged_dot's
    lowering copies them once per local expert (128 / 4), the tiled kernel does not."""
    model = model_of("Qwen3_30B_A3B", "FPROP_DTYPE='bfloat16'", f"MOE_GROUPED_MATMUL='{kernel}'")
    got = moe_params.routing_memory(model, global_tokens=8 * 8192,
                                    mesh={"data": 1, "fsdp": 2, "tensor": 1, "expert": 4})
    rows = 4 * 8192 * 8
    assert got["sorted_rows_per_device"] == rows == 262_144
    assert got["sorted_rows_bytes_per_device"] == rows * (2048 + 768) * 2
    assert got["ragged_dot_dense_expansion_bytes_per_device"] == (
        local_copies * rows * (2048 + 768) * 2)


# --------------------------------------------------------------------- parameter counts
def test_mixtral_8x7b_has_exactly_the_published_count():
    model = model_of("Mixtral8x7B")
    total = moe_params.closed_form_num_params(model)
    assert total == 46_702_792_704
    assert total == mixtral_params(L=32, D=4096, H=32, KV=8, h=128, F=14336, V=32000, E=8)
    # Active: the gate and 2 of 8 experts per layer (Mistral's "12.9B active").
    active = moe_params.num_active_params(model, total)
    assert active == 46_702_792_704 - 32 * 6 * 3 * 4096 * 14336 == 12_879_925_248


@pytest.mark.parametrize("name, dims, published", [
    ("GLaM126M64E", dict(L=12, D=768, H=12, h=64, F=3072, V=50304, E=64), 1.9e9),
    ("GLaM64B64E", dict(L=64, D=8192, H=64, h=128, F=32768, V=50304, E=64), 1.14e12),
])
def test_glam_totals_match_the_hand_formula_and_the_published_sizes(name, dims, published):
    model = model_of(name)
    total = moe_params.closed_form_num_params(model)
    assert total == glam_params(**dims)
    assert abs(total - published) / published < 0.015  # the README rounds: ~1.9B, ~1.14T
    active = moe_params.num_active_params(model, total)
    assert active == glam_active(L=dims["L"], D=dims["D"], F=dims["F"], E=dims["E"], total=total)


def test_glam_exact_totals():
    assert moe_params.closed_form_num_params(model_of("GLaM126M64E")) == 1_921_670_400
    assert moe_params.closed_form_num_params(model_of("GLaM64B64E")) == 1_142_891_356_160


@pytest.mark.parametrize("name", ["GPT126M", "LLaMA70B", "TinySynthetic", "Fuji7BV3", "Fuji1BV3",
                                  "TinyShakespeare"])
def test_closed_form_equals_the_built_dense_model(name):
    """The dense part of the closed form, checked against the model actually built."""
    model = model_of(name)
    traced = traced_num_params(model)  # an abstract trace of the built model, not the closed form
    assert moe_params.closed_form_num_params(model) == traced
    assert moe_params.num_active_params(model, traced) == traced


# --------------------------------------------------------------------- show / describe
@pytest.fixture(scope="module")
def tiny_glam_info():
    return describe(load_experiment("TinyGLaM"), num_local_devices=8)


def test_show_reports_total_and_active_params_of_an_moe_model(tiny_glam_info):
    info = tiny_glam_info
    total = glam_params(L=4, D=32, H=4, h=8, F=64, V=256, E=8)
    assert info["num_params"] == total == 103_712
    assert info["num_active_params"] == glam_active(L=4, D=32, F=64, E=8, total=total) == 54_560


def test_show_reports_active_equal_to_total_for_a_dense_model():
    info = describe(load_experiment("TinySynthetic"), num_local_devices=8)
    assert info["num_active_params"] == info["num_params"] == 120_576


def test_mixtral_show_json_through_the_cli():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [paxlite_python(), "-m", "paxlite", "show", "--fdl_config=Mixtral8x7B", "--format=json"],
        capture_output=True, text=True, env=env, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    info = json.loads(result.stdout)
    assert info["num_params"] == 46_702_792_704
    assert info["num_active_params"] == 12_879_925_248
    assert info["hparams"]["MOE_ROUTING"] == "dropless_topk"


# --------------------------------------------------------------------- FLOPs
def test_tiny_glam_flops_per_token_by_hand(tiny_glam_info):
    D, H, h, F, V, S, E, k = 32, 4, 8, 64, 256, 64, 8, 2
    attention_matmuls = 2 * D * 3 * H * h + 2 * D * H * h
    dense_ffn = 2 * D * F * 3  # gated GELU: wi, wi_gate, wo
    moe_ffn = 2 * D * E + k * 2 * D * F * 2  # router + 2 plain experts (wi, wo)
    forward = 4 * attention_matmuls + 2 * dense_ffn + 2 * moe_ffn + 2 * D * V
    expected = 3 * forward + 4 * 6 * S * H * h
    assert tiny_glam_info["flops_per_token"] == expected == 371_712


def test_tiny_mixtral_flops_per_token_by_hand():
    D, H, K, h, F, V, S, E, k = 32, 4, 2, 8, 64, 512, 64, 8, 2
    per_layer = 2 * D * (H + 2 * K) * h + 2 * D * H * h + 2 * D * E + k * 2 * D * F * 3
    expected = 3 * (2 * per_layer + 2 * D * V) + 2 * 6 * S * H * h
    assert load_experiment("TinyMixtral").flops_per_token() == expected == 310_272


def test_flops_moe_arguments_are_checked():
    sizes = dict(num_layers=2, model_dims=8, num_heads=2, num_kv_heads=2, dims_per_head=4,
                 hidden_dims=16, vocab_size=32, seq_len=8)
    with pytest.raises(ValueError, match="experts_per_token=3 exceeds num_experts=2"):
        flops_lib.flops_per_token(**sizes, num_moe_layers=1, num_experts=2, experts_per_token=3)
    with pytest.raises(ValueError, match="num_moe_layers"):
        flops_lib.flops_per_token(**sizes, num_moe_layers=3, num_experts=4)


# --------------------------------------------------------------------- names and settings
@pytest.mark.parametrize("name, cls", [
    ("paxml.contrib.gpu.scripts_gpu.configs.PileGLaM126M64E", glam.PileGLaM126M64E),
    ("paxml.contrib.gpu.scripts_gpu.configs.LambadaGLaM64B64E", glam.LambadaGLaM64B64E),
    ("paxml.contrib.gpu.scripts_gpu.configs.GLaM126M64EBase", glam.GLaM126M64E),
    ("paxml.contrib.gpu.scripts_gpu.configs.GLaM64B64EBase", glam.GLaM64B64E),
    ("GLaM126M64EBase", glam.GLaM126M64E),
    ("paxlite.experiments.mixtral.Mixtral8x7B", mixtral.Mixtral8x7B),
    ("TinyMixtral", tiny.TinyMixtral),
])
def test_pax_names_resolve(name, cls):
    assert resolve_experiment(name, EXPERIMENTS) is cls


def test_glam_architecture_and_pax_settings():
    exp = load_experiment("GLaM126M64E")
    model = fdl.build(exp.model_config())
    assert model.norm is NormKind.RMS_NORM and not model.use_bias and model.tie_embeddings
    assert model.activation is Activation.GELU_TANH and model.gated_mlp  # Praxis GELU approximate
    assert model.position_kind is PositionEmbedding.RELATIVE_BIAS
    assert (model.relative_position_buckets, model.relative_position_max_distance) == (32, 128)
    moe = model.moe
    assert (moe.num_experts, moe.experts_per_token, moe.routing) == (64, 2, MoeRouting.GSHARD_TOP2)
    assert (moe.moe_layer_interval, moe.gated_experts, moe.expert_activation) == (
        2, False, Activation.RELU)
    assert moe.capacity_factor == 2.0 and moe.num_groups is None
    assert moe.load_balancing_weight == pytest.approx(0.01 / (12 / 2))
    assert (exp.ICI_MESH_SHAPE, exp.DCN_MESH_SHAPE, exp.PERCORE_BATCH_SIZE) == (
        [1, 64, 1],
        [1, 1, 1],
        4,
    )
    assert (exp.USE_REPEATED_LAYER, exp.Z_LOSS_WEIGHT, exp.USE_EXPERT_PARALLEL) == (
        False,
        0.0,
        False,
    )
    big = load_experiment("GLaM64B64E")
    assert (big.NUM_LAYERS, big.NUM_HEADS, big.DIMS_PER_HEAD, big.MODEL_DIMS, big.HIDDEN_DIMS) == (
        64, 64, 128, 8192, 32768)
    assert (big.MAX_SEQ_LEN, big.ICI_MESH_SHAPE, big.DCN_MESH_SHAPE) == (
        1024,
        [1, 1, 8],
        [1, 64, 1],
    )
    assert (big.ADAM_BETA1, big.ADAM_BETA2, big.CLIP_GRADIENT_NORM_TO_VALUE) == (0.9, 0.99, 1.0)
    assert (big.LEARNING_RATE, big.LR_COS_WARMUP, big.LR_COS_DECAY_START, big.LR_COS_DECAY_END) == (
        2e-5, 398, 399, 162900)
    assert (
        big.CHECKPOINT_EVERY_N_STEPS,
        big.CHECKPOINT_MAX_TO_KEEP,
        big.SUMMARY_INTERVAL_STEPS,
    ) == (100, 2, 10)
    assert big.USE_REPEATED_LAYER
    assert load_experiment("LambadaGLaM126M64E").EVAL_TASK == "lambada"
    assert load_experiment("SyntheticGLaM126M64E").uses_synthetic_data()


def test_mixtral_architecture():
    model = model_of("Mixtral8x7B")
    assert (model.rope_theta, model.kv_heads, model.tie_embeddings) == (1e6, 8, False)
    assert model.norm is NormKind.RMS_NORM and model.norm_epsilon == 1e-5
    assert model.position_kind is PositionEmbedding.ROTARY and model.max_seq_len == 4096
    moe = model.moe
    assert (moe.num_experts, moe.experts_per_token, moe.routing) == (8, 2, MoeRouting.DROPLESS_TOPK)
    assert (moe.moe_layer_interval, moe.gated_experts, moe.expert_activation) == (
        1, True, Activation.SILU)
    assert moe.load_balancing_weight == pytest.approx(0.02 / 32)


def test_z_loss_weight_reaches_the_loop_and_the_router_settings_the_model():
    exp = load_experiment("TinyGLaM", ["Z_LOSS_WEIGHT=1e-4", "ROUTER_Z_LOSS_WEIGHT=0.001",
                                       "LOAD_BALANCING_WEIGHT=0.02", "NUM_GROUPS=4"])
    run = fdl.build(exp.run_config())
    assert run.loop.z_loss_weight == 1e-4
    assert run.model.moe.router_z_loss_weight == 0.001 and run.model.moe.num_groups == 4
    assert run.model.moe.load_balancing_weight == pytest.approx(0.02 / 2)  # 2 MoE layers of 4
    assert fdl.build(load_experiment("TinySynthetic").run_config()).loop.z_loss_weight == 0.0


# --------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "name, assignments, message",
    [
        (
            "TinyGLaM",
            ["ICI_MESH_SHAPE=[1,1,1,3]"],
            "NUM_EXPERTS=8 does not split over the expert mesh axis of size 3",
        ),
        ("TinyGLaM", ["DCN_MESH_SHAPE=[1,1,1,16]"], "valid expert axis sizes: [1, 2, 4, 8]"),
        (
            "TinyMixtral",
            ["NUM_EXPERTS_PER_TOKEN=9"],
            "NUM_EXPERTS_PER_TOKEN=9 is larger than NUM_EXPERTS=8",
        ),
        ("TinyGLaM", ["NUM_EXPERTS_PER_TOKEN=3"], "use MOE_ROUTING='dropless_topk'"),
        (
            "TinyGLaM",
            ["CAPACITY_FACTOR=0.0"],
            "CAPACITY_FACTOR=0.0 must be > 0 with MOE_ROUTING='gshard_top2'",
        ),
        ("TinyGLaM", ["CAPACITY_FACTOR=-1.0"], "CAPACITY_FACTOR=-1.0 must be > 0"),
        (
            "TinyMixtral",
            ["CAPACITY_FACTOR=1.5"],
            "CAPACITY_FACTOR read only with MOE_ROUTING='gshard_top2'",
        ),
        ("TinyGLaM", ["MOE_GROUPED_MATMUL=ragged_dot"], "MOE_GROUPED_MATMUL is read only with"),
        ("TinyMixtral", ["MOE_GROUPED_MATMUL=pallas_triton"], "one of 'ragged_dot'"),
        (
            "TinyGLaM",
            ["USE_EXPERT_PARALLEL=true"],
            "USE_EXPERT_PARALLEL=true needs an expert mesh axis > 1: give ICI_MESH_SHAPE",
        ),
        ("GLaM126M64E", ["USE_EXPERT_PARALLEL=true"], "--fdl.ICI_MESH_SHAPE=[1,64,1,4]"),
        (
            "TinySynthetic",
            ["ICI_MESH_SHAPE=[1,1,1,2]"],
            "TinySynthetic is a dense model with no experts",
        ),
        (
            "TinySynthetic",
            ["USE_EXPERT_PARALLEL=true"],
            "USE_EXPERT_PARALLEL=true, and TinySynthetic is a dense model",
        ),
        (
            "TinySynthetic",
            ["NUM_EXPERTS=8"],
            "--fdl.NUM_EXPERTS: mixture-of-experts setting(s), and TinySynthetic is a dense model",
        ),
        (
            "LLaMA7B",
            ["CAPACITY_FACTOR=2.0", "Z_LOSS_WEIGHT=1e-4"],
            "--fdl.CAPACITY_FACTOR, --fdl.Z_LOSS_WEIGHT: mixture-of-experts",
        ),
        ("TinyGLaM", ["NUM_GROUPS=0"], "NUM_GROUPS=0 must be a positive integer or None"),
        ("TinyGLaM", ["LOAD_BALANCING_WEIGHT=-0.1"], "LOAD_BALANCING_WEIGHT=-0.1 must be >= 0"),
    ],
)
def test_moe_misconfiguration_is_one_config_error(name, assignments, message):
    with pytest.raises(ConfigError) as info:
        load_experiment(name, assignments)
    text = str(info.value)
    assert message in text and "\n" not in text


def test_dense_model_given_moe_settings_exits_2_with_one_line():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [paxlite_python(), "-m", "paxlite", "show", "--fdl_config=Pile126M", "--fdl.NUM_EXPERTS=8"],
        capture_output=True, text=True, env=env, timeout=300, check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("paxlite: error:") and "dense model" in lines[0]
    assert "Traceback" not in result.stderr


def test_default_moe_experiments_validate():
    for name in ("GLaM126M64E", "GLaM64B64E", "Mixtral8x7B", "TinyGLaM", "TinyMixtral",
                 "PileGLaM64B64E", "SyntheticGLaM126M64E"):
        load_experiment(name)  # no ConfigError


def test_a_four_entry_mesh_splits_the_experts():
    exp = load_experiment("TinyGLaM", ["ICI_MESH_SHAPE=[1,2,1,4]", "USE_EXPERT_PARALLEL=true"])
    info = describe(exp, num_local_devices=8)
    assert info["mesh"]["expert"] == 4 and info["num_devices"] == 8


@pytest.mark.parametrize("name", ["TinyGLaM", "TinyMixtral", "GLaM126M64E", "Mixtral8x7B"])
def test_closed_form_equals_the_built_moe_model(name):
    """Once the MoE layer is in the model, its abstract count must be the closed form's."""
    import jax

    model = model_of(name)
    paths = jax.tree_util.tree_leaves_with_path(traced_variables(model)["params"])
    # the built model has experts
    assert any("moe" in jax.tree_util.keystr(path) for path, _ in paths)
    assert moe_params.closed_form_num_params(model) == traced_num_params(model)
