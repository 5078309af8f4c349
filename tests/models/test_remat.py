"""Pax's CHECKPOINT_POLICY names on the scanned stack: same numbers, different saved residuals.

Every policy must give SAVE_EVERYTHING's loss and gradients; what differs is what the backward pass
keeps, read from `jax.ad_checkpoint.print_saved_residuals` (the per-layer residuals of the scanned
stack are the `[layers, ...]` outputs of the scan).
"""

import contextlib
import io
import re
import typing
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from paxlite.config.errors import ConfigError
from paxlite.experiments.base import TransformerLmSettings
from paxlite.experiments.build import build_run_config
from paxlite.models.transformer import (
    RematPolicy,
    Transformer,
    TransformerConfig,
    abstract_variables,
)

# Distinct sizes so that every residual's shape says what it is.
L, B, T, D, N, H, F, V = 2, 3, 5, 16, 2, 6, 24, 32
POLICIES = [p for p in RematPolicy if p is not RematPolicy.NONE]


def _cfg(policy: RematPolicy) -> TransformerConfig:
    return TransformerConfig(vocab_size=V, num_layers=L, model_dims=D, num_heads=N,
                             dims_per_head=H, hidden_dims=F, max_seq_len=T + 1, scan_layers=True,
                             remat_policy=policy)


def _params_and_tokens() -> tuple[Any, jax.Array]:
    rng = np.random.default_rng(0)

    def leaf(path: tuple, shape: jax.ShapeDtypeStruct) -> jax.Array:
        noise = rng.normal(size=shape.shape)
        return jnp.asarray(1.0 + 0.2 * noise if path[-1].key == "scale" else 0.3 * noise,
                           jnp.float32)

    abstract = nn.meta.unbox(abstract_variables(_cfg(RematPolicy.SAVE_EVERYTHING)))["params"]
    params = jax.tree_util.tree_map_with_path(leaf, abstract)
    return params, jnp.asarray(rng.integers(0, V, (B, T + 1)), jnp.int32)


PARAMS, TOKENS = _params_and_tokens()


def _loss(cfg: TransformerConfig):
    def loss(params: Any) -> jax.Array:
        logits = Transformer(cfg).apply({"params": params}, TOKENS[:, :-1])
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, TOKENS[:, 1:, None], axis=-1))

    return loss


@pytest.fixture(scope="module")
def losses_and_grads() -> dict[str, tuple[jax.Array, Any]]:
    """Every policy's loss and gradients, compiled as one program (one compile is much faster on
    CPU than ten; each policy's rematerialisation is still its own part of the program)."""
    def all_policies(params: Any) -> dict[str, tuple[jax.Array, Any]]:
        return {p.name: jax.value_and_grad(_loss(_cfg(p)))(params) for p in POLICIES}

    return jax.device_get(jax.jit(all_policies)(PARAMS))


@pytest.mark.parametrize("policy", [p for p in POLICIES if p is not RematPolicy.SAVE_EVERYTHING],
                         ids=lambda p: p.name)
def test_policy_gives_save_everything_loss_and_grads(policy: RematPolicy,
                                                     losses_and_grads) -> None:
    ref_loss, ref_grads = losses_and_grads[RematPolicy.SAVE_EVERYTHING.name]
    loss, grads = losses_and_grads[policy.name]
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    total = np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree.leaves(ref_grads)))
    for (path, ref), got in zip(jax.tree_util.tree_leaves_with_path(ref_grads),
                                jax.tree.leaves(grads)):
        # Exactly-zero gradients (the key bias) are judged against the whole gradient's size.
        err = np.linalg.norm(np.asarray(got, np.float64) - np.asarray(ref, np.float64))
        assert err <= 1e-6 * max(np.linalg.norm(ref), 1e-3 * total), jax.tree_util.keystr(path)


def _stacked_residuals(policy: RematPolicy) -> list[tuple[int, ...]]:
    """Shapes of the per-layer values the backward pass keeps, sorted."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(_loss(_cfg(policy)), PARAMS)
    shapes = []
    for line in out.getvalue().splitlines():
        match = re.match(r"f32\[([\d,]*)\] output of scan", line)
        if match:
            shapes.append(tuple(int(d) for d in match.group(1).split(",")))
    return sorted(shapes)


def test_policies_differ_in_what_they_save() -> None:
    layer_input = (L, B, T, D)  # always kept: a remat'd layer is recomputed from its input
    qkv, context, out_proj = (L, B, T, 3, N, H), (L, B, T, N, H), (L, B, T, D)
    attention_probs = (L, B, N, T, T)
    assert _stacked_residuals(RematPolicy.SAVE_NOTHING) == [layer_input]
    assert _stacked_residuals(RematPolicy.SAVE_ITERATION_INPUT) == [layer_input]
    assert _stacked_residuals(RematPolicy.SAVE_OUT_PROJ) == sorted([layer_input, out_proj])
    assert _stacked_residuals(RematPolicy.SAVE_CONTEXT) == sorted([layer_input, context])
    assert _stacked_residuals(RematPolicy.SAVE_QKV_OUT_PROJ) == sorted([layer_input, qkv, out_proj])
    assert _stacked_residuals(RematPolicy.SAVE_CONTEXT_AND_OUT_PROJ) == sorted(
        [layer_input, context, out_proj])
    assert _stacked_residuals(RematPolicy.SAVE_DOT_FOR_MLPERF_200B) == sorted(
        [layer_input, qkv, context, out_proj])
    # Matmuls against weights (no batch dimension) versus all matmuls, the attention ones included.
    no_batch = _stacked_residuals(RematPolicy.SAVE_DOT_WITH_NO_BATCH_DIM)
    dots = _stacked_residuals(RematPolicy.SAVE_DOT_ONLY)
    assert qkv in no_batch and (L, B, T, F) in no_batch and attention_probs not in no_batch
    assert attention_probs in dots and set(no_batch) < set(dots)
    assert len(_stacked_residuals(RematPolicy.SAVE_EVERYTHING)) > len(dots)


def test_every_pax_name_is_a_hyperparameter_value_and_parses() -> None:
    names = typing.get_args(
        TransformerLmSettings.hparam_specs()["CHECKPOINT_POLICY"].annotation)
    assert sorted(names) == sorted(p.name for p in POLICIES)
    for name in names:
        assert RematPolicy.parse(name) is RematPolicy[name]
        assert RematPolicy.parse(name.lower()) is RematPolicy[name]


def test_unknown_policy_lists_valid_names() -> None:
    with pytest.raises(ValueError, match=r"'SAVE_DOT_ONYL' \(did you mean SAVE_DOT_ONLY\?\); "
                                         r"valid names: SAVE_NOTHING, SAVE_EVERYTHING, "):
        RematPolicy.parse("SAVE_DOT_ONYL")
    with pytest.raises(ValueError, match=r"'full'; valid names: SAVE_NOTHING.*SAVE_CONTEXT_AND"):
        RematPolicy.parse("full")
    with pytest.raises(ConfigError, match=r"CHECKPOINT_POLICY.*SAVE_CONTEXT"):
        build_run_config("TinySyntheticRepeated", ["CHECKPOINT_POLICY=SAVE_CONTXT"])


def test_policy_reaches_the_scanned_model_and_unrolled_layers_where_set() -> None:
    _, config = build_run_config("TinySyntheticRepeated", ["CHECKPOINT_POLICY=SAVE_QKV_OUT_PROJ"])
    assert config.model.scan_layers and config.model.remat_policy is RematPolicy.SAVE_QKV_OUT_PROJ
    # unrolled: the inherited default keeps everything, as in Pax; a policy set is applied
    # (tests/experiments/test_checkpoint_policy.py: its memory and gradients)
    _, config = build_run_config("TinySynthetic", [])
    assert not config.model.scan_layers and config.model.remat_policy is RematPolicy.NONE
    _, config = build_run_config("TinySynthetic", ["CHECKPOINT_POLICY=SAVE_QKV_OUT_PROJ"])
    assert not config.model.scan_layers
    assert config.model.remat_policy is RematPolicy.SAVE_QKV_OUT_PROJ
