"""The open families' attention options (LLaMA-3's RoPE scaling, Qwen2's q/k/v biases, Qwen3's q/k
norms, Mistral's sliding window) on the pipeline and seq axes: the real train step's loss, every
gradient leaf and the losses of two optimizer steps equal the unpipelined model's on one device to
1e-5, as tests/train/test_pipeline_seq_training.py compares them (NaN in the pipeline's bubbles).

One tiny experiment carries all four options, so one one-device reference serves both pipeline
schedules; the seq axis, which refuses a window, runs the other three against a reference without
it. Each option alone moves this model's first loss by 0.1% to 1% (measured when written), far
over the tolerance, so a pipeline that dropped any one fails. A failure names the gradient leaf
(a bias or norm scale points at its option; --fdl.SLIDING_WINDOW=None, ROPE_SCALING=none,
QKV_BIAS=false or QK_NORM=false on both sides tells the others apart). The options one at a time
on data/fsdp/tensor meshes: tests/models/test_sliding_window.py.
"""

from __future__ import annotations

import fiddle as fdl
import jax
import pytest

from paxlite.experiments.architecture_settings import (
    AttentionVariantSettings,
    RopeScalingSettings,
)
from paxlite.experiments.build import load_experiment
from paxlite.experiments.gpt import SyntheticTokens
from paxlite.experiments.llama import BaseLLaMA
from paxlite.experiments.model_settings import RotarySettings
from paxlite.experiments.tiny import TinyLLaMASizes, TinyRun
from paxlite.models.pipelined_stack import bubble_fill_for_tests
from paxlite.parallel.mesh import build_mesh
from tests.host_params import random_host_params
from tests.in_process import paxlite_main
from tests.train.test_pipeline_seq_training import _assert_match
from tests.train.train_step_gradients import loss_grads_and_losses

GLOBAL_BATCH = 8
NUM_STEPS = 2


class TinyOpenOptions(SyntheticTokens, TinyLLaMASizes, TinyRun, RopeScalingSettings,
                      AttentionVariantSettings, RotarySettings, BaseLLaMA):
    """TinyLLaMA's widths (4 query / 2 key-value heads x 8, d_model 32) with 4 scanned layers, 32
    tokens, the fused kernel (XLA on CPU) and all four options: 'llama3' scaling whose original
    context of 64 keeps the fastest of the 4 frequencies, blends the next and divides the slower
    two by 4; q/k/v biases; q/k norms; an 8-key window."""

    NUM_LAYERS = 4
    MAX_SEQ_LEN = 32
    USE_REPEATED_LAYER = True
    ATTENTION_KIND = "flash"
    ROPE_SCALING = "llama3"
    ROPE_SCALING_FACTOR = 4.0
    ROPE_SCALING_ORIGINAL_MAX_POSITION = 64
    QKV_BIAS = True
    QK_NORM = True
    SLIDING_WINDOW = 8


NO_WINDOW = ("SLIDING_WINDOW=None",)


def _run_config(overrides):
    experiment = load_experiment("TinyOpenOptions", list(overrides),
                                 registry={"TinyOpenOptions": TinyOpenOptions})
    return fdl.build(experiment.run_config())


def _loss_grads_and_losses(run, mesh, *, seq_shards: int = 1):
    _, loss, grads, losses = loss_grads_and_losses(
        run, mesh, global_batch=GLOBAL_BATCH, num_steps=NUM_STEPS,
        initial_params=random_host_params, seq_shards=seq_shards)
    return loss, grads, losses


@pytest.fixture(scope="module")
def one_device():
    """The unpipelined one-device runs, by the overrides that set their options (made once)."""
    cache = {}

    def get(options: tuple[str, ...]):
        if options not in cache:
            run = _run_config([*options, "ICI_MESH_SHAPE=[1,1,1]"])
            assert run.model.pipeline is None
            cache[options] = _loss_grads_and_losses(
                run, build_mesh(run.mesh, devices=jax.devices()[:1]))
        return cache[options]

    return get


# ICI_MESH_SHAPE [data, fsdp, tensor, expert, pipeline] and the pipeline's settings: GPipe with the
# heads (and their biases) split over a tensor axis; the circular schedule over fsdp-sharded
# parameters.
PIPELINES = {
    "gpipe-p2d2t2": ("ICI_MESH_SHAPE=[2,1,2,1,2]", "NUM_MICROBATCHES=2"),
    "circular-p2d2f2": ("ICI_MESH_SHAPE=[2,2,1,1,2]", "NUM_MICROBATCHES=4",
                        "PIPELINE_REPEATS=2"),
}


@pytest.mark.parametrize("case", sorted(PIPELINES))
def test_all_four_options_pipelined_equal_the_unpipelined_one_device_run(case, one_device):
    run = _run_config(PIPELINES[case])
    model = run.model
    assert model.pipeline.num_stages == 2 and model.scan_layers
    assert (model.rope_scaling.factor, model.qkv_bias, model.qk_norm, model.sliding_window) == (
        4.0, True, True, 8)
    with bubble_fill_for_tests(float("nan")):
        got = _loss_grads_and_losses(run, build_mesh(run.mesh))
    _assert_match(got, one_device(()), case)


def test_seq_axis_with_rope_scaling_biases_and_norms_equals_one_device(one_device):
    """(data, seq, tensor) = (2, 2, 2), the batches in the train loop's load-balanced order."""
    run = _run_config([*NO_WINDOW, "ICI_MESH_SHAPE=[2,1,2,1,1,2]"])
    assert run.model.sliding_window is None and run.model.qk_norm
    got = _loss_grads_and_losses(run, build_mesh(run.mesh), seq_shards=2)
    _assert_match(got, one_device(NO_WINDOW), "seq")


def test_a_window_on_the_seq_axis_is_one_line_from_the_command_line(tmp_path, monkeypatch,
                                                                      capfd):
    """Mistral v0.1's window with a seq axis: refused before anything is built or run."""
    with paxlite_main(monkeypatch, capfd) as main:
        result = main("--fdl_config=Mistral7B", "--fdl.SLIDING_WINDOW=4096",
                      "--fdl.ICI_MESH_SHAPE=[1,4,1,1,1,2]", f"--job_log_dir={tmp_path / 'job'}")
    assert result.returncode == 2, result
    assert result.stderr.strip().splitlines() == [
        ("paxlite: error: invalid Mistral7B hyperparameters: SLIDING_WINDOW=4096 with a seq axis "
         "of 2: the sequence-parallel attention attends to the whole context; drop the seq axis")
    ], result.stderr
