"""DeepSeek-V3's auxiliary-loss-free balancing in the train step (train/router_bias.py): after one
step each MoE layer's choice bias equals a NumPy computation of ``bias + speed * sign(mean load -
load_e)`` from the step's own routing (the router logits of the same batch, routed in NumPy,
padding excluded); speed 0 leaves it bit for bit; the optimizer holds no state for it (AdamW with
weight decay never moves it); a mesh with data, tensor and expert axes and gradient accumulation
give the one-device, one-batch update."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

from paxlite.models.linear import Linear
from paxlite.models.moe_config import MoeConfig
from paxlite.models.moe_router_deepseek import DeepseekRouter, trainable_paths
from paxlite.models.transformer import LLAMA_ARCHITECTURE, Transformer, TransformerConfig
from paxlite.parallel.mesh import MeshConfig, build_mesh
from paxlite.train.step import TrainState, compile_steps, split_trainable
from tests.host_params import random_host_params

E, K, GROUPS, TOP_GROUPS, T, B, SPEED = 8, 2, 4, 2, 8, 8, 0.01
MOE_LAYERS = ("layers_1", "layers_2")


def _config(speed: float) -> TransformerConfig:
    router = DeepseekRouter(score="sigmoid", choice="noaux_tc", num_groups=GROUPS,
                            top_groups=TOP_GROUPS, routed_scaling=2.5, bias_update_speed=speed)
    return TransformerConfig(
        vocab_size=64, num_layers=3, model_dims=16, num_heads=2, dims_per_head=8, hidden_dims=24,
        max_seq_len=T, tie_embeddings=False, **LLAMA_ARCHITECTURE,
        moe=MoeConfig(num_experts=E, experts_per_token=K, routing="dropless_topk",
                      gated_experts=True, expert_activation="silu", expert_hidden_dims=8,
                      shared_expert_hidden_dims=8, first_moe_layer=1, deepseek_router=router))


def _batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 64, size=(B, T + 1)).astype(np.int32)
    segment_ids = np.ones((B, T), np.int32)
    segment_ids[1, 2:] = 0  # padding: routed, never counted
    segment_ids[3, 1:] = 0
    segment_ids[6, 3:] = 0
    positions = np.tile(np.arange(T, dtype=np.int32), (B, 1))
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "weights": (segment_ids > 0).astype(np.float32), "segment_ids": segment_ids,
            "positions": positions}


def _step(config: TransformerConfig, *, ici=(1, 1, 1), accum: int = 1):
    """(params before, params after one AdamW step, the optimizer state) on ``ici``."""
    model = Transformer(config)
    devices = jax.devices()[:int(np.prod(ici))]
    mesh = build_mesh(MeshConfig(ici_mesh_shape=ici), devices=devices)
    optimizer = optax.adamw(1e-2, weight_decay=0.5)
    with jax.set_mesh(mesh):
        steps = compile_steps(model=model, optimizer=optimizer,
                              schedule=optax.constant_schedule(1e-2), mesh=mesh, seq_len=T,
                              seed=0, deterministic=True, grad_accum_steps=accum,
                              trainable=trainable_paths(config))
        # seeded host parameters (the bias too, so its move is seen), not init's sampler
        params = random_host_params(steps.abstract_state.params, seed=1)
        opt_state = optimizer.init(split_trainable(params, trainable_paths(config))[0])
        state = jax.device_put(
            TrainState(step=np.zeros((), np.int32), params=params, opt_state=opt_state),
            steps.state_shardings)
        new, metrics = steps.train(state, jax.device_put(_batch(), steps.batch_sharding))
        assert "router_load" not in metrics  # the counts move the bias, not the logs
        return params, jax.device_get(new.params), jax.device_get(new.opt_state)


def _numpy_updates(config: TransformerConfig, params, speed: float
                   ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Each MoE layer's bias moved by the rule, its loads routed in NumPy from the router logits
    the model computes on the batch (captured, not sown); and by the wrong rule that counts padding
    too (the test checks that it would be seen)."""
    batch = _batch()
    _, state = jax.jit(lambda p: Transformer(config).apply(
        {"params": p}, batch["inputs"], positions=batch["positions"],
        segment_ids=batch["segment_ids"], deterministic=True,
        capture_intermediates=lambda mdl, _: isinstance(mdl, Linear) and mdl.name == "router",
    ))(params)
    real = (batch["segment_ids"] > 0).reshape(-1)
    want, wrong = {}, {}
    for layer in MOE_LAYERS:
        logits = np.asarray(state["intermediates"][layer]["moe"]["router"]["__call__"][0],
                            np.float64).reshape(-1, E)
        bias = np.asarray(params[layer]["moe"]["score_correction_bias"], np.float64)
        choice = 1 / (1 + np.exp(-logits)) + bias  # [N, E]
        grouped = choice.reshape(-1, GROUPS, E // GROUPS)
        group_score = np.sort(grouped, axis=-1)[:, :, -2:].sum(-1)  # [N, G]: the two best
        kept = np.argsort(-group_score, axis=-1)[:, :TOP_GROUPS]
        mask = np.zeros_like(group_score, bool)
        np.put_along_axis(mask, kept, True, axis=-1)
        choice = np.where(np.repeat(mask, E // GROUPS, axis=-1), choice, -np.inf)
        chosen = np.argsort(-choice, axis=-1)[:, :K]  # [N, K]
        for rule, rows in ((want, real), (wrong, np.ones_like(real))):
            load = np.bincount(chosen[rows].reshape(-1), minlength=E).astype(np.float64)
            rule[layer] = bias + speed * np.sign(load.mean() - load)
    return want, wrong


@pytest.fixture(scope="module")
def one_device():
    return _step(_config(SPEED))


def _biases(params) -> dict[str, np.ndarray]:
    return {layer: np.asarray(params[layer]["moe"]["score_correction_bias"])
            for layer in MOE_LAYERS}


def test_bias_moves_by_the_steps_own_routing(one_device):
    before, after, _ = one_device
    want, wrong = _numpy_updates(_config(SPEED), before, SPEED)
    got = _biases(after)
    assert any(np.any(wrong[layer] != want[layer]) for layer in MOE_LAYERS)
    for layer in MOE_LAYERS:
        np.testing.assert_allclose(got[layer], want[layer], rtol=0, atol=1e-7, err_msg=layer)
        moved = got[layer] - np.asarray(before[layer]["moe"]["score_correction_bias"])
        assert np.any(np.abs(moved) > SPEED / 2), layer  # the test sees a real move


def test_optimizer_holds_no_state_for_the_bias(one_device):
    _, _, opt_state = one_device
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(opt_state)]
    assert any("router" in p for p in paths)  # the router's kernel trains
    assert not any("score_correction_bias" in p for p in paths)


def test_speed_zero_leaves_the_bias_bit_for_bit():
    before, after, _ = _step(_config(0.0))
    for layer, bias in _biases(after).items():
        np.testing.assert_array_equal(bias, before[layer]["moe"]["score_correction_bias"])
    other = after["layers_1"]["moe"]["router"]["kernel"]  # while the rest trains
    assert np.max(np.abs(other - before["layers_1"]["moe"]["router"]["kernel"])) > 1e-4


def test_mesh_and_accumulation_give_the_one_batch_update(one_device):
    _, after, _ = one_device
    want = _biases(after)
    # data 2 x tensor 2 x expert 2, and two microbatches of 4 rows (each split 4 ways)
    _, sharded, _ = _step(_config(SPEED), ici=(2, 1, 2, 2), accum=2)
    for layer, bias in _biases(sharded).items():
        np.testing.assert_array_equal(bias, want[layer], err_msg=layer)


def test_bad_speeds_are_refused():
    with pytest.raises(ValueError, match="bias_update_speed=-0.1 must be a finite number >= 0"):
        _config(-0.1)
    with pytest.raises(ValueError, match="only 'noaux_tc' .* routes by a choice bias"):
        DeepseekRouter(score="softmax", choice="greedy", bias_update_speed=0.001)
