"""USE_CUDNN_FLASH_ATTENTION (Pax's name), ATTENTION_IMPLEMENTATION and ATTENTION_KIND: how they
map onto the model, and the one-line errors where a kernel asked for cannot run (before anything is
built or compiled)."""

from __future__ import annotations

import fiddle as fdl
import pytest

from paxlite.config.errors import ConfigError
from paxlite.experiments.build import load_experiment
from paxlite.experiments.gpt import GPT126M
from paxlite.models.attention import AttentionKind
from paxlite.models.attention_kernels import AttentionImplementation as Impl
from tests.fork_server import paxlite_python
from tests.xla_test_flags import COMPILE_FLAGS


def _model(name, assignments):
    experiment = load_experiment(name, assignments)
    return experiment, fdl.build(experiment.model_config())


@pytest.mark.parametrize("assignments, kind, implementation", [
    ([], AttentionKind.DOT_PRODUCT, Impl.AUTO),
    (["USE_CUDNN_FLASH_ATTENTION=True"], AttentionKind.FLASH, Impl.CUDNN),
    (["ATTENTION_IMPLEMENTATION=pallas_triton"], AttentionKind.FLASH, Impl.PALLAS_TRITON),
    (["ATTENTION_IMPLEMENTATION=cudnn"], AttentionKind.FLASH, Impl.CUDNN),
    (["ATTENTION_KIND=flash"], AttentionKind.FLASH, Impl.AUTO),
    (["ATTENTION_KIND=flash", "ATTENTION_IMPLEMENTATION=xla"], AttentionKind.FLASH, Impl.XLA),
])
def test_settings_reach_the_model(assignments, kind, implementation):
    experiment, model = _model("Pile126M", assignments)
    assert (model.attention_kind, model.attention_implementation) == (kind, implementation)
    assert experiment.ATTENTION_KIND == kind.value
    assert experiment.ATTENTION_IMPLEMENTATION == implementation.value


def test_fuji_flash_keeps_auto_and_takes_pax_switch():
    _, model = _model("fuji-7B-v2-flash", [])
    assert (model.attention_kind, model.attention_implementation) == (
        AttentionKind.FLASH,
        Impl.AUTO,
    )
    _, model = _model("fuji-7B-v2", ["USE_CUDNN_FLASH_ATTENTION=true"])
    assert (model.attention_kind, model.attention_implementation) == (
        AttentionKind.FLASH,
        Impl.CUDNN,
    )


@pytest.mark.parametrize("assignments, message", [
    (["USE_CUDNN_FLASH_ATTENTION=True", "FPROP_DTYPE=float32"],
     ("USE_CUDNN_FLASH_ATTENTION=true cannot run Pile126M: cuDNN flash attention takes bfloat16 or "
     "float16 activations, and the compute dtype is float32")),
    (["USE_CUDNN_FLASH_ATTENTION=True", "DIMS_PER_HEAD=300"], "at most 256 .*got 300"),
    (["ATTENTION_IMPLEMENTATION=cudnn", "DIMS_PER_HEAD=100"],
     "ATTENTION_IMPLEMENTATION='cudnn' cannot run Pile126M: .*multiple of 8"),
    (["USE_CUDNN_FLASH_ATTENTION=True", "MAX_SEQ_LEN=2047"], "even sequence length, got 2047"),
    (["USE_CUDNN_FLASH_ATTENTION=True", "ATTENTION_IMPLEMENTATION=xla"],
     "USE_CUDNN_FLASH_ATTENTION=true asks for cuDNN and ATTENTION_IMPLEMENTATION='xla'"),
    (["ATTENTION_KIND=dot_product", "ATTENTION_IMPLEMENTATION=pallas_triton"],
     "'pallas_triton' is a fused kernel and ATTENTION_KIND='dot_product' runs einsums"),
])
def test_a_kernel_that_cannot_run_is_one_error(assignments, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_experiment("Pile126M", assignments)
    assert "\n" not in str(info.value)


def test_pallas_refuses_a_relative_position_bias_model():
    with pytest.raises(
        ConfigError, match="'pallas_triton' cannot run GLaM126M64E: .*no logit bias"
    ):
        load_experiment("GLaM126M64E", ["ATTENTION_IMPLEMENTATION=pallas_triton"])
    _, model = _model("GLaM126M64E", ["USE_CUDNN_FLASH_ATTENTION=true"])  # cuDNN takes the bias
    assert model.attention_implementation is Impl.CUDNN


def test_chunks_and_sinks_refuse_the_kernels_without_them():
    """Llama 4's chunks and gpt-oss's sinks: cuDNN and Pallas-Triton named are one line at
    validation; 'flash' with 'auto' (XLA for them) is accepted."""
    refused = r"^ATTENTION_IMPLEMENTATION='pallas_triton' cannot run Llama4Scout17B16E: .*8192"
    with pytest.raises(ConfigError, match=refused) as info:
        load_experiment("Llama4Scout17B16E", ["ATTENTION_KIND=flash",
                                              "ATTENTION_IMPLEMENTATION=pallas_triton"])
    assert "\n" not in str(info.value) and "'xla'" in str(info.value)
    with pytest.raises(ConfigError, match=r"^USE_CUDNN_FLASH_ATTENTION=true cannot run GptOss20B: "
                                          r"cuDNN flash attention takes no attention sinks"):
        load_experiment("GptOss20B", ["ATTENTION_KIND=flash", "USE_CUDNN_FLASH_ATTENTION=true",
                                      "FPROP_DTYPE=bfloat16"])
    assert load_experiment("GptOss20B", ["ATTENTION_KIND=flash"]).ATTENTION_IMPLEMENTATION == "auto"


class _DropsAttention(GPT126M):
    """A family whose model_config overrides the mapped attention settings."""

    def model_config(self):
        config = super().model_config()
        config.attention_kind = AttentionKind.DOT_PRODUCT
        config.attention_implementation = Impl.AUTO
        return config


def test_a_family_that_drops_the_settings_is_refused():
    registry = {"_DropsAttention": _DropsAttention}
    with pytest.raises(ConfigError, match="_DropsAttention's model does not use them"):
        load_experiment("_DropsAttention", ["USE_CUDNN_FLASH_ATTENTION=True"], registry=registry)


def test_show_counts_a_cudnn_experiment_on_a_cpu_machine():
    """The parameter count traces the model with XLA attention: `show` of a GPU run works here."""
    from paxlite.cli.show import describe

    plain = describe(load_experiment("Pile126M", []))
    shown = describe(load_experiment("Pile126M", ["USE_CUDNN_FLASH_ATTENTION=True"]))
    assert shown["num_params"] == plain["num_params"] > 0
    assert shown["hparams"]["ATTENTION_IMPLEMENTATION"] == "cudnn"
    assert shown["hparams"]["ATTENTION_KIND"] == "flash"


def test_cudnn_on_a_cpu_job_stops_with_one_line_and_exit_2(tmp_path):
    """The backend is known when the step is traced: the job stops there, before compiling."""
    import os
    import subprocess

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = COMPILE_FLAGS
    result = subprocess.run(
        [paxlite_python(), "-m", "paxlite.main", "--fdl_config=fuji-test-v3",
         "--fdl.USE_CUDNN_FLASH_ATTENTION=True", "--fdl.DIMS_PER_HEAD=8",
         "--fdl.SYNTHETIC_DATA=true", "--fdl.MAX_STEPS=2", f"--job_log_dir={tmp_path}"],
        capture_output=True, text=True, env=env, timeout=300, check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("paxlite: error:")]
    assert errors == [
        ("paxlite: error: attention implementation 'cudnn' (USE_CUDNN_FLASH_ATTENTION) cannot run: "
        "cuDNN flash attention runs on NVIDIA GPUs, and this job's JAX backend is 'cpu'; use "
        "'auto' (cuDNN where it fits, else XLA) or 'xla'")]
    assert "Traceback" not in result.stderr


def test_auto_says_once_which_kernel_it_runs_and_why(caplog):
    """AUTO falling back to XLA (here: CPU backend, float32) is logged, once for the whole model
    (every layer, init and apply resolve it), naming why; cuDNN is not what runs."""
    import logging

    import jax
    import jax.numpy as jnp

    from paxlite.models import attention_kernels
    from paxlite.models.transformer import Transformer, TransformerConfig

    attention_kernels._log_once.cache_clear()  # another test may have logged the same choice
    config = TransformerConfig(vocab_size=32, num_layers=3, model_dims=16, num_heads=2,
                               dims_per_head=8, hidden_dims=32, max_seq_len=8,
                               attention_kind="flash", attention_implementation="auto")
    tokens = jnp.zeros((1, 8), jnp.int32)
    model = Transformer(config)
    with caplog.at_level(logging.INFO):
        variables = model.init({"params": jax.random.key(0)}, tokens)
        model.apply(variables, tokens)
    records = [r for r in caplog.records if "ATTENTION_IMPLEMENTATION='auto'" in r.getMessage()]
    assert [r.levelno for r in records] == [logging.WARNING], [r.getMessage() for r in records]
    assert records[0].getMessage() == (
        "ATTENTION_IMPLEMENTATION='auto' runs XLA attention (jax.nn.dot_product_attention "
        "implementation='xla'), not cuDNN flash attention: cuDNN flash attention runs on NVIDIA "
        "GPUs, and this job's JAX backend is 'cpu'; cuDNN flash attention takes bfloat16 or "
        "float16 activations, and the compute dtype is float32")
    assert attention_kernels.auto_choice_message([]) == (
        "ATTENTION_IMPLEMENTATION='auto' runs cuDNN flash attention")
