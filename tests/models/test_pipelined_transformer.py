"""The Transformer with ``config.pipeline`` set (models/pipelined_stack.py) against the same model
without a pipeline, run on each microbatch separately (rows m, m + M, ...: the split the pipeline
promises), with the same parameters.

Exactness is the point: logits, the sown auxiliary loss and every parameter-gradient leaf of a
scalar loss agree to 1e-5, on one device and on 8 CPU devices with the stages over a `pipeline` mesh
axis, parameters sharded by DEFAULT_RULES and the pipeline's buffers filled with NaN (a bubble leak
shows as NaN). Parameters are random (biases non-zero, every layer different), so a wrong layer
order, stage order or microbatch order cannot hide.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from paxlite.models import sown
from paxlite.models.activations import Activation
from paxlite.models.decode import init_cache
from paxlite.models.linear import FP8_COLLECTION, Fp8Config
from paxlite.models.moe_config import MoeConfig, MoeRouting
from paxlite.models.parallel_config import PipelineConfig
from paxlite.models.pipelined_stack import bubble_fill_for_tests
from paxlite.models.transformer import (
    NormKind,
    RematPolicy,
    Transformer,
    TransformerConfig,
    abstract_variables,
    logical_param_axes,
)
from paxlite.models.transformer_config import LayerImplementation, PositionEmbedding
from paxlite.parallel.rules import DEFAULT_RULES

B, T, V = 8, 8, 64
AXES = ("pipeline", "data", "fsdp", "seq", "tensor", "expert")
BASE = dict(vocab_size=V, num_layers=4, model_dims=16, num_heads=2, dims_per_head=8,
            hidden_dims=32, max_seq_len=T)
LLAMA = dict(norm=NormKind.RMS_NORM, activation=Activation.SILU, gated_mlp=True, use_bias=False,
             tie_embeddings=False, position_embedding=PositionEmbedding.ROTARY)


def config(*, stages: int, micro: int, repeats: int = 1, **overrides: Any) -> TransformerConfig:
    fields = {**BASE, **overrides}
    return TransformerConfig(**fields, pipeline=PipelineConfig(
        num_stages=stages, num_microbatches=micro, repeats=repeats))


CASES = {  # name: config
    # RoPE and packed rows: positions, mask and segment ids travel as side inputs; the model and
    # microbatches of scan-S4 and scan-S8, so one reference serves the three
    "scan-gpipe": config(stages=2, micro=4, scan_layers=True, **{**LLAMA, "num_layers": 8}),
    "unscanned-circular-remat": config(stages=2, micro=4, repeats=2,
                                       remat_policy=RematPolicy.SAVE_NOTHING),
    # S4 has 2 layers per stage
    "scan-S4": config(stages=4, micro=4, scan_layers=True, remat_policy=RematPolicy.SAVE_DOT_ONLY,
                      **{**LLAMA, "num_layers": 8}),
    "scan-S8": config(stages=8, micro=4, scan_layers=True, **{**LLAMA, "num_layers": 8}),
    # GLaM-like: every other layer MoE (scan unit 2: layers_0..3 grouped into units of layer_0,
    # layer_1 for the pipeline), GShard top-2, load balancing loss; unscanned
    "glam": config(stages=2, micro=2, moe=MoeConfig(
        num_experts=4, routing=MoeRouting.GSHARD_TOP2, moe_layer_interval=2, num_groups=2,
        load_balancing_weight=0.01)),
    # Mixtral-like: every layer MoE, dropless top-2 with gated experts; scanned, circular
    "mixtral": config(stages=2, micro=4, repeats=2, scan_layers=True, **LLAMA, moe=MoeConfig(
        num_experts=4, routing=MoeRouting.DROPLESS_TOPK, gated_experts=True,
        expert_activation=Activation.SILU, load_balancing_weight=0.01)),
}
MESHES = {  # (pipeline, data, fsdp, seq, tensor, expert)
    "unscanned-circular-remat": (2, 1, 2, 1, 2, 1),
    "scan-S4": (4, 2, 1, 1, 1, 1),
    "scan-S8": (8, 1, 1, 1, 1, 1),
    "glam": (2, 1, 1, 1, 1, 2),
    "mixtral": (2, 2, 1, 1, 1, 1),
}


def plain(cfg: TransformerConfig) -> TransformerConfig:
    """The same model without a pipeline (and without remat, which changes no number)."""
    return dataclasses.replace(cfg, pipeline=None, remat_policy=RematPolicy.NONE)


def inputs(seed: int = 0) -> dict[str, jax.Array]:
    """Tokens, a cotangent for the logits, and packed rows: two documents and trailing padding
    (segment 0) per row, the split point differing by row, positions restarting per document."""
    rng = np.random.default_rng(seed)
    split = 2 + np.arange(B) % 5  # [B]
    t = np.arange(T)[None, :]
    segment_ids = np.where(t < split[:, None], 1, 2)
    segment_ids[:, -1] = 0
    positions = np.where(t < split[:, None], t, t - split[:, None])
    # host arrays: a device array would compile a program for each eager slice of it, and each
    # reshard onto a mesh
    return {"tokens": rng.integers(0, V, (B, T)).astype(np.int32),
            "cotangent": (rng.normal(size=(B, T, V)) / (B * T)).astype(np.float32),
            "segment_ids": segment_ids.astype(np.int32),
            "positions": positions.astype(np.int32)}


def model_inputs(cfg: TransformerConfig, data: dict) -> dict:
    if cfg.position_kind is PositionEmbedding.ROTARY:  # packed rows
        return {"segment_ids": data["segment_ids"], "positions": data["positions"]}
    return {}


def pipelined_forward(cfg: TransformerConfig, sown_shapes: list | None = None):
    """variables -> (loss, (logits, aux loss, summaries)): the model as it is. `sown_shapes`: a
    list that gets the sown collections' tree (names and shapes) when the forward is traced."""
    def forward(variables, data):
        logits, state = Transformer(cfg).apply(
            variables, data["tokens"], **model_inputs(cfg, data), mutable=list(sown.COLLECTIONS))
        if sown_shapes is not None:
            sown_shapes.append(_shapes(state))
        aux = sown.total_aux_loss(state)
        loss = jnp.sum(logits * data["cotangent"]) + aux
        return loss, (logits, aux, sown.summary_means(state))
    return forward


def _shapes(tree: Any) -> Any:
    return jax.tree.map(lambda a: a.shape, tree)


def reference(cfg: TransformerConfig, variables: dict, data: dict) -> tuple[tuple, Any]:
    """((logits, aux, summaries, gradients), the sown collections' tree) of the unpipelined model
    run on each microbatch m = rows m, m + M, ... separately: one compiled program for one
    microbatch, called M times, its results put back in row order and combined in float64 NumPy.
    The loss it differentiates is the microbatches' logit terms plus the mean of their auxiliary
    losses (each microbatch's gradient carries 1/M of its own), and summaries are the mean over
    microbatches, as the pipeline promises."""
    num_micro = cfg.pipeline.num_microbatches
    model = Transformer(plain(cfg))
    sown_shapes = []

    def one(variables, tokens, cotangent, extra):
        logits, state = model.apply(variables, tokens, **extra, mutable=list(sown.COLLECTIONS))
        sown_shapes.append(_shapes(state))  # while tracing
        aux = sown.total_aux_loss(state)
        loss = jnp.sum(logits * cotangent) + aux / num_micro
        return loss, (logits, aux, sown.summary_means(state))

    step = jax.jit(jax.value_and_grad(one, has_aux=True))
    logits = np.zeros((B, T, V), np.float64)
    aux, summaries, grads = 0.0, {}, None
    for m in range(num_micro):
        rows = slice(m, None, num_micro)
        extra = {k: v[rows] for k, v in model_inputs(cfg, data).items()}
        (_, (lg, a, sm)), g = jax.device_get(
            step(variables, data["tokens"][rows], data["cotangent"][rows], extra))
        logits[rows] = lg
        aux += float(a) / num_micro
        summaries = {k: summaries.get(k, 0.0) + float(v) / num_micro for k, v in sm.items()}
        g = jax.tree.map(lambda x: np.asarray(x, np.float64), g)
        grads = g if grads is None else jax.tree.map(np.add, grads, g)
    return (logits, aux, summaries, grads), sown_shapes[0]


def value_and_grads(forward, variables, data):
    """(logits, aux, summaries, gradients of every variable collection passed)."""
    (_, (logits, aux, summaries)), grads = jax.jit(
        jax.value_and_grad(forward, has_aux=True))(variables, data)
    return logits, aux, summaries, grads


def params_of(cfg: TransformerConfig, seed: int = 1) -> dict:
    return {"params": _random_params(plain(cfg), seed=seed)}


@functools.cache
def _abstract_variables(cfg: TransformerConfig) -> Any:
    """Traced once per model: an abstract init traces the whole model."""
    return nn.meta.unbox(abstract_variables(cfg))


@functools.cache
def _random_params(cfg: TransformerConfig, *, seed: int) -> Any:
    """Non-trivial params (biases non-zero, scales != 1; tests/models/test_transformer.py's
    random_params), made once per model and seed as host arrays: a device array per leaf would
    compile a conversion per shape, and a reshard per shape onto each mesh."""
    rng = np.random.default_rng(seed)

    def leaf(path: tuple, shape: jax.ShapeDtypeStruct) -> np.ndarray:
        noise = rng.normal(size=shape.shape)
        value = 1.0 + 0.2 * noise if path[-1].key == "scale" else 0.3 * noise
        return value.astype(np.float32)

    return jax.tree_util.tree_map_with_path(leaf, _abstract_variables(cfg)["params"])


def assert_same(got, want, *, atol=1e-5, rtol=1e-5):
    """Float32 sums in another order: 1e-5 absolute, plus 1e-5 relative for the large gradients (an
    embedding row that gathers many tokens reaches ~3, where one reordered sum differs by ~1e-5)."""
    logits, aux, summaries, grads = got
    ref_logits, ref_aux, ref_summaries, ref_grads = want
    assert np.all(np.isfinite(logits))
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=atol)
    np.testing.assert_allclose(aux, ref_aux, rtol=0, atol=atol)
    assert summaries.keys() == ref_summaries.keys()
    for key in summaries:
        np.testing.assert_allclose(
            summaries[key], ref_summaries[key], rtol=0, atol=atol, err_msg=key
        )
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    for (path, g), r in zip(flat, jax.tree.leaves(ref_grads), strict=True):
        assert np.all(np.isfinite(g)), jax.tree_util.keystr(path)
        np.testing.assert_allclose(
            g, r, rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path)
        )


@pytest.fixture(scope="module")
def references():
    """The unpipelined per-microbatch results and sown shapes, computed once per (model,
    microbatch count)."""
    data, cache, refs = inputs(), {}, {}
    for name, cfg in CASES.items():
        key = (plain(cfg), cfg.pipeline.num_microbatches)
        if key not in cache:
            cache[key] = reference(cfg, params_of(cfg), data)
        refs[name] = cache[key]
    return refs


@pytest.mark.parametrize("name", ["scan-gpipe", "unscanned-circular-remat"])
def test_one_device_equals_unpipelined_per_microbatch(name, references):
    """GPipe and circular, scanned and unscanned, with and without remat: logits and every gradient
    leaf equal the unpipelined model run on each microbatch."""
    cfg = CASES[name]
    with bubble_fill_for_tests(jnp.nan):
        got = value_and_grads(pipelined_forward(cfg), params_of(cfg), inputs())
    assert_same(got, references[name][0])


def _mesh(shape):
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES))


@pytest.mark.parametrize("name", list(MESHES))
def test_mesh_equals_unpipelined_per_microbatch(name, references):
    """8 devices, stages over `pipeline`, params sharded by DEFAULT_RULES, NaN in the bubbles: the
    same numbers as the unpipelined model per microbatch on one device (so also as the one-device
    pipeline), and the stage shift is a real collective-permute. For the MoE models this includes
    the aux loss (the mean over microbatches of the per-microbatch loss) and the summaries, and the
    sown values keep the unpipelined model's names and per-layer shapes."""
    cfg = CASES[name]
    mesh = _mesh(MESHES[name])
    variables = params_of(cfg)
    axes = logical_param_axes(plain(cfg))  # traced off the mesh: an init on one token
    with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES), bubble_fill_for_tests(jnp.nan):
        shardings = nn.logical_to_mesh_sharding(axes, mesh, DEFAULT_RULES)
        variables = {"params": jax.device_put(variables["params"], shardings)}
        rows = nn.logical_to_mesh_sharding(P("activation_batch"), mesh, DEFAULT_RULES)
        data = {k: jax.device_put(v, rows) for k, v in inputs().items()}
        sown_shapes = []  # the pipelined model's, on all B rows
        step = jax.jit(jax.value_and_grad(pipelined_forward(cfg, sown_shapes), has_aux=True))
        compiled = step.lower(variables, data).compile()
        (_, (logits, aux, summaries)), grads = compiled(variables, data)
    results, plain_sown_shapes = references[name]  # the plain model's, on one microbatch
    assert_same((logits, aux, summaries, grads), results)
    assert "collective-permute" in compiled.as_text()
    if cfg.moe is not None:
        assert float(aux) > 0 and "moe/aux_loss" in summaries
        assert sown_shapes[0] == plain_sown_shapes


def test_init_equals_the_unpipelined_model():
    """Same parameter tree (names, shapes, logical axes) and the same initial values: a checkpoint
    does not depend on the pipeline. Unscanned GLaM keeps layers_0..layers_3 (traced only)."""
    cfg = CASES["scan-gpipe"]
    tokens = inputs()["tokens"]
    # both inits in one program (from the same key)
    got, want = jax.jit(lambda t: tuple(Transformer(c).init({"params": jax.random.key(3)}, t)
                                        for c in (cfg, plain(cfg))))(tokens)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert nn.get_partition_spec(got) == nn.get_partition_spec(want)
    for a, b in zip(jax.tree.leaves(nn.meta.unbox(got)), jax.tree.leaves(nn.meta.unbox(want)),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    glam = CASES["glam"]
    got, want = abstract_variables(glam), abstract_variables(plain(glam))
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert nn.get_partition_spec(got) == nn.get_partition_spec(want)
    assert [k for k in got["params"] if k.startswith("layers")] == [f"layers_{i}" for i in range(4)]


def _fp8_state(cfg: TransformerConfig) -> Any:
    """A non-trivial delayed-scaling state: scales near 1, histories with past maxima."""
    rng = np.random.default_rng(7)
    abstract = _abstract_variables(plain(cfg))[FP8_COLLECTION]

    def leaf(path, shape):
        name = path[-1].key
        value = 0.5 + rng.uniform(size=shape.shape) if name.endswith("scale") else \
            rng.uniform(0, 2, size=shape.shape)
        return value.astype(np.float32)

    return jax.tree_util.tree_map_with_path(leaf, abstract)


def test_fp8_new_state_is_the_max_over_microbatches():
    """FP8 (delayed scaling): the new state (the gradient w.r.t. the FP8 collection) of the
    pipelined model (on a (pipeline, fsdp, tensor) = (2, 2, 2) mesh) is the elementwise max of the
    unpipelined model's new states over the same microbatches on one device, not their sum (which
    autodiff would give a layer used M times)."""
    cfg = config(
        stages=2, micro=4, repeats=2, scan_layers=True, fp8=Fp8Config(amax_history_length=3)
    )
    data = inputs()
    params, fp8 = params_of(cfg)["params"], _fp8_state(cfg)

    def new_state(c, p, f, tokens, cotangent):
        return jax.grad(lambda f: jnp.sum(Transformer(c).apply(
            {"params": p, FP8_COLLECTION: f}, tokens) * cotangent))(f)

    # Parameters and state are the programs' arguments, not host arrays closed over (which the
    # programs would carry as constants); the reference is one microbatch's program, called for
    # each of the 4 (the pipeline's strided split), the max taken in NumPy.
    with (jax.set_mesh(_mesh((2, 1, 2, 1, 2, 1))), nn.logical_axis_rules(DEFAULT_RULES),
          bubble_fill_for_tests(jnp.nan)):
        got = jax.jit(lambda p, f, d: new_state(cfg, p, f, d["tokens"], d["cotangent"]))(
            params, fp8, data)
    one = jax.jit(functools.partial(new_state, plain(cfg)))  # one microbatch, called 4 times
    per_micro = [jax.device_get(one(params, fp8, data["tokens"][m::4], data["cotangent"][m::4]))
                 for m in range(4)]
    want = jax.tree.map(lambda *a: np.max(np.stack(a), axis=0), *per_micro)
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want),
                            strict=True):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=0, err_msg=jax.tree_util.keystr(path))


def test_dropout_differs_per_microbatch_and_needs_no_rng_without_it():
    """With dropout, identical rows in different microbatches get different masks (one key per
    layer and microbatch) and the same rng gives the same result; without dropout, or when
    deterministic, no rng is needed (traced without one)."""
    cfg = config(stages=2, micro=2, scan_layers=True, dropout_prob=0.5)
    variables = params_of(cfg)
    tokens = np.tile(inputs()["tokens"][:1], (4, 1))  # rows 0, 2 are microbatch 0; rows 1, 3: 1
    run = jax.jit(lambda v, t, key: Transformer(cfg).apply(
        v, t, deterministic=False, rngs={"dropout": key}))
    out = np.asarray(run(variables, tokens, jax.random.key(0)))
    assert np.all(np.isfinite(out))
    assert not np.allclose(out[0], out[1])
    np.testing.assert_array_equal(out, run(variables, tokens, jax.random.key(0)))
    for c, deterministic in ((dataclasses.replace(cfg, dropout_prob=0.0), False), (cfg, True)):
        jax.eval_shape(lambda v, c=c, d=deterministic: Transformer(c).apply(
            v, tokens, deterministic=d), variables)


def test_decoding_runs_the_plain_stack_on_the_same_params():
    """With a KV cache the pipelined config traces to exactly the plain model's program, even for
    a batch of 3 rows that 2 microbatches could not split."""
    cfg = CASES["scan-gpipe"]
    params = params_of(cfg)["params"]
    cache = init_cache(Transformer(plain(cfg)), batch=3, max_len=T)
    tokens = inputs()["tokens"][:3]
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (3, T))
    mask = np.broadcast_to(np.tril(np.ones((T, T), bool)), (3, 1, T, T))

    def prefill(c):
        return jax.make_jaxpr(lambda p, k: Transformer(c).apply(
            {"params": p, "cache": k}, tokens, positions=positions, decode_mask=mask,
            mutable=["cache"]))(params, cache)

    assert str(prefill(cfg)) == str(prefill(plain(cfg)))


def test_bad_settings_are_refused_with_the_numbers():
    """Refused while tracing (abstractly: nothing is compiled or run)."""
    tokens = inputs()["tokens"]

    def init(cfg):
        return jax.eval_shape(lambda: Transformer(cfg).init({"params": jax.random.key(0)}, tokens))

    with pytest.raises(ValueError, match=r"^num_layers=3 does not split into 2 pipeline stages "
                                         r"x repeats=1: the layer count must be a multiple of 2"):
        init(config(stages=2, micro=2, num_layers=3))
    cfg = CASES["scan-gpipe"]
    bad_batch = dataclasses.replace(cfg, pipeline=PipelineConfig(num_stages=2, num_microbatches=3))
    with pytest.raises(ValueError, match=r"a batch of 8 rows does not split into 3 pipeline "
                                         r"microbatches"):
        jax.eval_shape(lambda: Transformer(bad_batch).apply(params_of(cfg), tokens))
    te = config(stages=2, micro=2, layer_implementation=LayerImplementation.TRANSFORMER_ENGINE,
                dims_per_head=8, num_heads=2)
    with pytest.raises(ValueError, match=r"^pipeline parallelism .*transformer_engine"):
        init(te)
