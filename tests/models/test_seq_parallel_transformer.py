"""Sequence (context) parallelism through the whole Transformer: loss and every parameter gradient
of a mesh with a ``seq`` axis equal one unsharded device to 1e-5.

Each case runs a tiny model (LLaMA-like: RoPE, grouped-query attention, gated MLP, RMS norm; GPT-
like: learned positions, fused QKV, scanned and remat'd layers; GLaM-like: T5 relative position
bias) on a six-axis mesh under the product's rules table (activations split along the sequence
over ``seq``), optionally with the batch in the dual_chunk_swap order of data/context_order.py
(positions added and every per-token field moved), and compares the weighted token cross-entropy
and its gradients with the same model on one device, original order, no mesh. The lowered program
is checked for the strategy's collective, so a strategy that is not passed through cannot pass.
Unpacked rows have random zero weights; packed rows have segment ids, positions restarting per
document and unweighted padding. Every case compiles once (module-scoped references).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import AxisType

from paxlite.data.context_order import balance_for_seq
from paxlite.errors import SettingError
from paxlite.models.attention import Attention, AttentionKind
from paxlite.models.attention_kernels import AttentionImplementation
from paxlite.models.parallel_config import ContextParallelStrategy
from paxlite.models.transformer import (
    LLAMA_ARCHITECTURE,
    NormKind,
    PositionEmbedding,
    RematPolicy,
    Transformer,
    TransformerConfig,
    abstract_variables,
    logical_param_axes,
)
from paxlite.parallel.rules import DEFAULT_RULES, batch_sharding

AXES = ("pipeline", "data", "fsdp", "seq", "tensor", "expert")
B, T = 4, 16  # T splits into 2 * 8 chunks: seq 8 with load balancing
AG, RING = ContextParallelStrategy.ALL_GATHER, ContextParallelStrategy.RING
_SMALL = dict(vocab_size=32, num_layers=2, model_dims=16, dims_per_head=4, hidden_dims=24,
              max_seq_len=T)
MODELS: dict[str, TransformerConfig] = {
    # RoPE, 4 query heads on 2 kv heads (GQA), SwiGLU, RMS norm, no biases, untied output
    "llama": TransformerConfig(**_SMALL, num_heads=4, num_kv_heads=2, tie_embeddings=False,
                               **LLAMA_ARCHITECTURE),
    # learned absolute positions, fused QKV, biases, layer norm; scanned and remat'd as Pax GPT
    "gpt": TransformerConfig(**_SMALL, num_heads=2, scan_layers=True,
                             remat_policy=RematPolicy.SAVE_NOTHING),
    # T5 relative position bias in every layer (GLaM's, dense here); distances past 6 share buckets
    "relbias": TransformerConfig(**_SMALL, num_heads=2, norm=NormKind.RMS_NORM,
                                 position_embedding=PositionEmbedding.RELATIVE_BIAS,
                                 relative_position_buckets=8, relative_position_max_distance=6,
                                 scale_query=False),
}
SEGMENTS = np.array([[1] * 5 + [2] * 7 + [3] * 4,  # three documents
                     [1] * 9 + [2] * 3 + [0] * 4,  # two documents and padding
                     [1] * 16,  # one document
                     [1, 1, 2, 3, 3, 3, 4, 5, 5, 5, 5, 5, 6, 6, 7, 0]], np.int32)


@dataclasses.dataclass(frozen=True)
class Case:
    model: str
    mesh: tuple[int, int, int, int]  # data, fsdp, seq, tensor
    strategy: ContextParallelStrategy
    packed: bool
    balanced: bool  # the batch in dual_chunk_swap order on the sharded side
    flash: bool = False  # AttentionKind.FLASH with the XLA implementation

    def __str__(self) -> str:
        data, fsdp, seq, tensor = self.mesh
        return "-".join([self.model, f"d{data}f{fsdp}s{seq}t{tensor}", self.strategy.value,
                         "packed" if self.packed else "unpacked",
                         "balanced" if self.balanced else "slot_order"]
                        + (["flash_xla"] if self.flash else []))


CASES = [
    Case("llama", (1, 1, 2, 1), AG, packed=True, balanced=True),
    Case("llama", (1, 1, 4, 1), RING, packed=False, balanced=True),
    Case("llama", (1, 1, 8, 1), AG, packed=False, balanced=False),
    Case("llama", (1, 2, 2, 2), RING, packed=True, balanced=True),
    Case("gpt", (1, 1, 2, 1), RING, packed=True, balanced=False),
    Case("gpt", (1, 1, 8, 1), RING, packed=False, balanced=True),
    Case("gpt", (1, 2, 2, 2), AG, packed=False, balanced=True),
    Case("gpt", (2, 1, 4, 1), AG, packed=True, balanced=True, flash=True),
    Case("relbias", (1, 2, 4, 1), RING, packed=True, balanced=True),
    Case("relbias", (1, 1, 2, 2), AG, packed=False, balanced=False),
]


def make_mesh(data: int = 1, fsdp: int = 1, seq: int = 1, tensor: int = 1) -> jax.sharding.Mesh:
    shape = (1, data, fsdp, seq, tensor, 1)
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES),
                         devices=jax.devices()[:int(np.prod(shape))])


def random_params(cfg: TransformerConfig, *, seed: int) -> Any:
    """Non-trivial parameters from the abstract tree (no threefry init to compile), as host arrays
    (a device array per leaf would compile a conversion per shape, and a reshard per shape onto
    each mesh)."""
    rng = np.random.default_rng(seed)

    def leaf(path: tuple, shape: jax.ShapeDtypeStruct) -> np.ndarray:
        noise = rng.normal(size=shape.shape)
        value = 1.0 + 0.2 * noise if path[-1].key == "scale" else 0.3 * noise
        return value.astype(np.float32)

    return jax.tree_util.tree_map_with_path(leaf, nn.meta.unbox(abstract_variables(cfg))["params"])


def make_batch(*, packed: bool, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, _SMALL["vocab_size"], size=(B, T + 1)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    if not packed:
        batch["weights"] = (rng.random((B, T)) < 0.8).astype(np.float32)
        return batch
    positions = np.zeros((B, T), np.int32)  # restart at 0 per document; padding at 0
    for b in range(B):
        for s in np.unique(SEGMENTS[b]):
            where = SEGMENTS[b] == s
            positions[b, where] = 0 if s == 0 else np.arange(where.sum())
    batch.update(segment_ids=SEGMENTS, positions=positions,
                 weights=(SEGMENTS > 0).astype(np.float32))
    return batch


def weighted_cross_entropy(cfg: TransformerConfig, params: Any, batch: dict) -> jax.Array:
    """sum(weights * -log p(target)) / sum(weights): the loss is a weighted sum over tokens."""
    logits = Transformer(cfg).apply({"params": params}, batch["inputs"],
                                    positions=batch.get("positions"),
                                    segment_ids=batch.get("segment_ids"))
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    return jnp.sum(batch["weights"] * nll) / jnp.sum(batch["weights"])


@pytest.fixture(scope="module")
def reference():
    """One device, original token order, no mesh: (params, batch, loss, grads) per model/packing."""
    cache: dict[tuple[str, bool], tuple] = {}

    def get(model: str, packed: bool) -> tuple:
        if (model, packed) not in cache:
            cfg = MODELS[model]
            params = random_params(cfg, seed=len(model))
            batch = make_batch(packed=packed, seed=int(packed))
            loss, grads = jax.jit(jax.value_and_grad(
                lambda p, b: weighted_cross_entropy(cfg, p, b)))(params, batch)
            cache[(model, packed)] = (params, batch, loss, grads)
        return cache[(model, packed)]

    return get


@pytest.mark.parametrize("case", CASES, ids=str)
def test_loss_and_every_gradient_equal_one_device(reference, case: Case) -> None:
    params, batch, want_loss, want_grads = reference(case.model, case.packed)
    cfg = dataclasses.replace(MODELS[case.model], context_parallel_strategy=case.strategy)
    if case.flash:
        cfg = dataclasses.replace(cfg, attention_kind=AttentionKind.FLASH,
                                  attention_implementation=AttentionImplementation.XLA)
    data, fsdp, seq, tensor = case.mesh
    mesh = make_mesh(data, fsdp, seq, tensor)
    if case.balanced:
        batch = balance_for_seq(batch, seq_shards=seq)
        assert "positions" in batch  # added to unpacked rows: tokens keep their true positions
    shardings = nn.logical_to_mesh_sharding(logical_param_axes(cfg), mesh, DEFAULT_RULES)
    sharded_params = jax.device_put(params, shardings)
    sharded_batch = jax.device_put(batch, batch_sharding(mesh))  # from the host
    step = jax.jit(jax.value_and_grad(lambda p, b: weighted_cross_entropy(cfg, p, b)))
    with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
        lowered = step.lower(sharded_params, sharded_batch)
        # The strategy's own collective, written by shard_map before XLA partitions anything.
        text = lowered.as_text()
        if case.strategy is RING:
            assert "collective_permute" in text, "RING did not reach the attention layers"
        else:
            assert "all_gather" in text and "collective_permute" not in text
        loss, grads = lowered.compile()(sharded_params, sharded_batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-5)
    flat_want = dict(jax.tree_util.tree_leaves_with_path(want_grads))
    for path, got in jax.tree_util.tree_leaves_with_path(grads):
        np.testing.assert_allclose(got, flat_want[path], rtol=1e-5, atol=1e-5,
                                   err_msg=jax.tree_util.keystr(path))


# ---------------------------------------------------------------- what cannot run, said clearly

def _trace_attention(module: Attention, mesh, *, mask=None, bias=None, segment_ids=None,
                     length: int = T) -> None:
    x = jnp.zeros((2, length, 8), jnp.float32)
    with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
        jax.eval_shape(lambda: module.init(jax.random.key(0), x, mask, bias=bias,
                                           segment_ids=segment_ids))


@pytest.mark.parametrize("implementation", ["cudnn", "pallas_triton"])
def test_a_fused_kernel_named_with_seq_is_one_setting_error(implementation) -> None:
    module = Attention(num_heads=2, dims_per_head=4, attention_kind=AttentionKind.FLASH,
                       attention_implementation=AttentionImplementation(implementation))
    with pytest.raises(SettingError, match=rf"attention implementation '{implementation}' cannot "
                                           r"run with sequence parallelism \(the mesh's 'seq' "
                                           r"axis has size 2\).*use 'auto' or 'xla'"):
        _trace_attention(module, make_mesh(seq=2))


def test_a_caller_bias_or_a_bare_mask_with_seq_is_refused() -> None:
    mesh = make_mesh(seq=4)
    module = Attention(num_heads=2, dims_per_head=4)
    with pytest.raises(ValueError, match="takes no logit bias argument with sequence parallelism"):
        _trace_attention(module, mesh, bias=jnp.zeros((1, 2, T, T)))
    with pytest.raises(ValueError, match="pass segment_ids"):
        _trace_attention(module, mesh, mask=jnp.ones((1, 1, T, T), bool))


def test_a_length_the_seq_axis_does_not_divide_is_refused() -> None:
    with pytest.raises(ValueError, match="sequence length 12 is not divisible by the 'seq' axis "
                                         "size 8"):
        _trace_attention(Attention(num_heads=2, dims_per_head=4), make_mesh(seq=8), length=12)


def test_the_strategy_defaults_to_all_gather() -> None:
    assert Attention(num_heads=2, dims_per_head=4).context_parallel_strategy is AG
