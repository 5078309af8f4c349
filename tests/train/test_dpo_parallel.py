"""The DPO train and eval steps on the pipeline and seq axes, with FP8, against one device.

A pipeline changes where each layer runs and on how many rows at a time, and a seq axis where each
token is and in which slot (the train loop feeds the dual_chunk_swap order): neither changes a
pair's log-probabilities, so the step after one update and the eval sums must equal the
unpipelined model's on one device fed the original order (1e-5), with the pipeline's bubbles
filled with NaN so that a leak cannot hide. FP8 keeps a scaling state beside the parameters, which
both forward passes (policy and reference) read and the step updates: it must come out the same
too. One program covers the three (each compile of a step costs seconds of the suite's budget);
the models and batches are tests/train/test_dpo_step.py's, whose reference is the DPO loss written
out by hand, and whose data x fsdp x tensor test covers the other axes.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxlite.data.context_order import balance_for_seq
from paxlite.models.linear import Fp8Config
from paxlite.models.parallel_config import PipelineConfig
from paxlite.models.pipelined_stack import bubble_fill_for_tests
from paxlite.parallel.mesh import MeshConfig, build_mesh
from paxlite.train.step import TrainState
from tests.train.test_dpo_step import (
    CFG,
    _assert_same_tree,
    _pair_batch,
    _params,
    _steps,
)

METRICS = ("loss", "dpo/loss", "dpo/rewards_chosen", "dpo/rewards_rejected", "dpo/margin",
           "dpo/accuracy")


def _one_device():
    return build_mesh(MeshConfig(ici_mesh_shape=(1, 1, 1), dcn_mesh_shape=(1, 1, 1)),
                      devices=jax.devices()[:1])


def _one_step(mesh, batch, reference, config):
    """(params, metrics, eval scores) after one step from the seeded initial state, and the FP8
    state before and after it."""
    with jax.set_mesh(mesh):
        steps = _steps(mesh, config=config)
        steps = steps.with_reference(jax.device_put(reference, steps.state_shardings.params))
        state: TrainState = steps.init()
        initial_fp8 = jax.device_get(state.fp8)
        scores = jax.device_get(steps.eval(state.params, batch, fp8=state.fp8))
        state, metrics = steps.train(state, batch)
        return (jax.device_get(state.params), jax.device_get(metrics), scores), \
            (initial_fp8, jax.device_get(state.fp8))


def test_fp8_on_pipeline_and_seq_axes_equals_the_unpipelined_one_device_step():
    """fsdp 2 x pipeline 2 x seq 2: two stages of one layer, two microbatches of four pairs, each
    row's 16 tokens over two seq shards in the load-balanced order; FP8 matmuls with amax
    histories of 3 steps. Both runs start from the same seeded state (the pipelined model
    initialises as the unpipelined one)."""
    config = dataclasses.replace(CFG, num_layers=2, fp8=Fp8Config(amax_history_length=3))
    batch, reference = _pair_batch(seed=3), _params(6, dataclasses.replace(config, fp8=None))
    want, (initial, want_fp8) = _one_step(_one_device(), batch, reference, config)

    # ICI entries: data, fsdp, tensor, expert, pipeline, seq
    mesh = build_mesh(MeshConfig(ici_mesh_shape=(1, 2, 1, 1, 2, 2), dcn_mesh_shape=(1, 1, 1)))
    pipelined = dataclasses.replace(config, pipeline=PipelineConfig(num_stages=2,
                                                                    num_microbatches=2))
    balanced = balance_for_seq(batch, seq_shards=2)
    assert not np.array_equal(balanced["inputs"], batch["inputs"])  # the slots did move
    with bubble_fill_for_tests(jnp.nan):
        got, (_, got_fp8) = _one_step(mesh, balanced, reference, pipelined)

    params, metrics, scores = got
    ref_params, ref_metrics, ref_scores = want
    assert abs(ref_metrics["dpo/margin"]) > 1e-4  # policy and reference differ
    _assert_same_tree(params, ref_params, 1e-5)
    for key in METRICS:
        assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-5, abs=1e-7), key
    assert scores.keys() == ref_scores.keys()
    for key in scores:
        np.testing.assert_allclose(scores[key], ref_scores[key], rtol=1e-5, err_msg=key)
    # the step recorded this batch's amax values (the state is not the one it started from), the
    # pipelined one as the maximum over its microbatches: the same values
    assert jax.tree.leaves(want_fp8) and any(
        not np.array_equal(a, b) for a, b in
        zip(jax.tree.leaves(want_fp8), jax.tree.leaves(initial), strict=True))
    _assert_same_tree(got_fp8, want_fp8, 1e-6)
