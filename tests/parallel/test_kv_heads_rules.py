"""The rules table names every logical axis the models use, and key/value heads that do not divide
the tensor axis (2 kv heads on tensor 4; MQA's one) are replicated rather than refused.

An axis name missing from DEFAULT_RULES is silently replicated by Flax, so the first test walks the
names the models actually use: the parameters of tiny GPT, LLaMA (GQA), GLaM, Mixtral and a LoRA
model, their decode KV caches, and every "activation_*" name in paxlite/models. The others train
and decode GQA/MQA models on fsdp 2 x tensor 4 against one device.
"""

import pathlib
import re

import fiddle as fdl
import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from paxlite.experiments.build import load_experiment
from paxlite.models import decode
from paxlite.models.transformer import Transformer, abstract_variables, logical_param_axes
from paxlite.parallel import rules as rules_lib
from paxlite.parallel.mesh import MeshConfig, build_mesh
from paxlite.train.optimizer import make_optimizer
from paxlite.train.schedules import make_schedule
from paxlite.train.step import TrainState, compile_steps
from tests.host_params import random_host_params
from tests.models.test_decode import PROMPTS, _params, llama
from tests.train.train_step_gradients import recording_gradients

MODELS_DIR = pathlib.Path(__file__).resolve().parents[2] / "paxlite" / "models"
RULE_NAMES = {name for name, _ in rules_lib.DEFAULT_RULES}
EXPERIMENTS = {
    "gpt": ("TinySynthetic", ("USE_REPEATED_LAYER=True",)),  # scanned: the "layers" axis
    "llama_gqa": ("TinyLLaMA", ()),
    "glam": ("TinyGLaM", ()),
    "mixtral": ("TinyMixtral", ()),
    "llama_lora": ("TinyLLaMA", ("USE_LORA=True", "LORA_RANDOM_BASE=True")),
}


def _model_config(name: str):
    experiment, overrides = EXPERIMENTS[name]
    loaded = load_experiment(f"paxlite.experiments.tiny.{experiment}", overrides)
    return fdl.build(loaded.with_lora(loaded.model_config()))  # with_lora: as runs build it


def _names(specs) -> set[str]:
    leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    return {entry for spec in leaves for entry in spec if entry is not None}


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_every_parameter_and_cache_axis_has_a_rule(name: str) -> None:
    cfg = _model_config(name)
    params = _names(logical_param_axes(cfg))
    cache = decode.init_cache(Transformer(cfg), batch=1, max_len=4)
    cached = _names(decode.cache_logical_axes(cfg, cache))
    assert "embed" in params and "activation_batch" in cached  # the walk saw them
    if name == "gpt":
        assert "layers" in params
    if name == "llama_lora":
        assert "lora_rank" in params
    if name in ("llama_gqa", "mixtral"):
        assert {"kv_heads", "activation_kv_heads"} <= params | cached
    assert not (params | cached) - RULE_NAMES, ("logical axes without a rule: "
                                                f"{(params | cached) - RULE_NAMES}")


def test_every_activation_name_in_the_models_has_a_rule() -> None:
    """Activation constraints are traced, not stored: their names are read from the source."""
    used = {match for path in MODELS_DIR.glob("*.py")
            for match in re.findall(r"[\"'](activation_[a-z_]+)[\"']", path.read_text())}
    assert {"activation_batch", "activation_kv_heads", "activation_embed_and_logits_batch"} <= used
    assert not used - RULE_NAMES, f"activation axes without a rule: {sorted(used - RULE_NAMES)}"


def test_fitted_names_keep_only_the_mesh_axes_that_divide() -> None:
    mesh_shape = {"pipeline": 4, "data": 1, "fsdp": 2, "seq": 1, "tensor": 4, "expert": 1}
    rules = rules_lib.DEFAULT_RULES

    def spec(names, shape):
        return rules_lib.fitted_spec(names, shape, mesh_shape, rules)

    kernel = ("embed", "kv_heads", "kv")
    assert spec(kernel, (32, 4, 8)) == P("fsdp", "tensor", None)
    assert spec(kernel, (32, 2, 8)) == P("fsdp", None, None)  # 2 kv heads on tensor 4: whole
    assert spec(kernel, (32, 1, 8)) == P("fsdp", None, None)  # MQA
    rows = ("activation_embed_and_logits_batch", "activation_length", "activation_vocab")
    assert spec(rows, (16, 8, 64)) == P(("data", "fsdp", "expert", "pipeline"), "seq", "tensor")
    assert spec(rows, (6, 8, 64)) == P(("data", "fsdp", "expert"), "seq", "tensor")  # 6 % 8
    # Other names keep their rule when it does not divide: check_divisible names the problem.
    assert spec(("embed", "heads", "kv"), (32, 2, 8)) == P("fsdp", "tensor", None)


def test_kv_kernels_split_over_tensor_when_their_heads_divide_it() -> None:
    """The rule itself: 2 kv heads on tensor 2 hold one head per device (half the bytes)."""
    cfg = llama(num_heads=4, num_kv_heads=2)
    mesh = jax.make_mesh(
        (1, 1, 1, 1, 2, 1),
        ("pipeline", "data", "fsdp", "seq", "tensor", "expert"),
        devices=jax.devices()[:2],
        axis_types=(AxisType.Auto,) * 6,
    )
    abstract = nn.meta.unbox(abstract_variables(cfg))["params"]
    shardings = rules_lib.logical_to_shardings(logical_param_axes(cfg), mesh, shapes=abstract)
    for kernel in ("key", "value"):
        sharding = shardings["layers_0"]["attention"][kernel]["kernel"]
        leaf = abstract["layers_0"]["attention"][kernel]["kernel"]
        assert sharding.spec == P("fsdp", "tensor", None)
        assert sharding.shard_shape(leaf.shape) == (leaf.shape[0], 1, leaf.shape[2])


MESH_SHAPE = {"pipeline": 1, "data": 1, "fsdp": 2, "seq": 1, "tensor": 4, "expert": 1}


def _train(cfg, mesh, optimizer, schedule):
    """Loss and gradients at seeded host parameters, then the loss of a second train step (after
    one update). The gradients are the first step's, as its optimizer was given them
    (tests/train/train_step_gradients.py): one program per mesh, the train step."""
    model = Transformer(cfg)
    optimizer = recording_gradients(optimizer)
    with jax.set_mesh(mesh):
        steps = compile_steps(model=model, optimizer=optimizer, schedule=schedule, mesh=mesh,
                              seq_len=cfg.max_seq_len, seed=0, deterministic=True)
        host = random_host_params(steps.abstract_state.params)
        state = jax.device_put(
            TrainState(step=np.zeros((), np.int32), params=host, opt_state=optimizer.init(host)),
            steps.state_shardings)
        rng = np.random.default_rng(1)
        tokens = rng.integers(0, cfg.vocab_size, (8, cfg.max_seq_len + 1), dtype=np.int32)
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
                 "weights": np.ones((8, cfg.max_seq_len), np.float32)}
        batch = jax.device_put(batch, steps.batch_sharding)
        state, metrics = steps.train(state, batch)
        loss, grads = float(metrics["loss"]), jax.device_get(state.opt_state[1])
        _, metrics = steps.train(state, batch)
        return loss, grads, float(metrics["loss"]), steps.state_shardings


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa_2_kv_heads", "mqa"])
def test_training_with_fewer_kv_heads_than_tensor_equals_one_device(kv_heads: int) -> None:
    # One layer and 16 positions: the kv heads are sharded per layer and per head; a second layer
    # or longer rows would only lengthen the two compiles (one device, the fsdp x tensor mesh).
    experiment = load_experiment(
        "paxlite.experiments.tiny.TinyLLaMA",
        (f"NUM_KV_HEADS={kv_heads}", "NUM_LAYERS=1", "MAX_SEQ_LEN=16"),
    )
    cfg = fdl.build(experiment.model_config())
    schedule = make_schedule(fdl.build(experiment.schedule_config()))
    optimizer = make_optimizer(fdl.build(experiment.optimizer_config()), schedule)
    assert cfg.num_heads == 4 and cfg.num_kv_heads == kv_heads
    one = build_mesh(MeshConfig(ici_mesh_shape=(1, 1, 1)), devices=jax.devices()[:1])
    loss_ref, grads_ref, step_ref, _ = _train(cfg, one, optimizer, schedule)
    mesh = build_mesh(MeshConfig(ici_mesh_shape=(1, 2, 4)))
    assert dict(mesh.shape) == MESH_SHAPE
    loss, grads, step_loss, shardings = _train(cfg, mesh, optimizer, schedule)
    attention = shardings.params["layers_0"]["attention"]
    assert attention["key"]["kernel"].spec == P("fsdp", None, None)  # the kv heads whole
    assert attention["query"]["kernel"].spec == P("fsdp", "tensor", None)
    assert abs(loss - loss_ref) <= 1e-5 * abs(loss_ref)
    assert abs(step_loss - step_ref) <= 1e-5 * abs(step_ref)
    for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(grads_ref),
                                 jax.tree.leaves(grads)):
        err = np.linalg.norm(np.asarray(got, np.float64) - want) / max(np.linalg.norm(want), 1e-30)
        assert err < 1e-5, f"gradient {jax.tree_util.keystr(path)}: relative error {err}"


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa_2_kv_heads", "mqa"])
def test_decoding_with_fewer_kv_heads_than_tensor_equals_one_device(kv_heads: int) -> None:
    """Greedy tokens as one device; the cache's kv heads (repeated to 4) one per tensor shard."""
    cfg = llama(num_heads=4, num_kv_heads=kv_heads, num_layers=1)  # the cache is per layer
    params = _params(cfg)
    want = decode.generate(cfg, params, PROMPTS, max_new_tokens=4)
    mesh = jax.make_mesh(tuple(MESH_SHAPE.values()), tuple(MESH_SHAPE),
                         axis_types=(AxisType.Auto,) * 6)
    shardings = rules_lib.logical_to_shardings(logical_param_axes(cfg), mesh, shapes=params)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules_lib.DEFAULT_RULES):
        got = decode.generate_with_cache(cfg, jax.device_put(params, shardings), PROMPTS,
                                         max_new_tokens=4, batch_multiple=2)
    assert got.ids == want
    key = got.cache["layers_0"]["attention"]["cached_key"]
    batch_axes = ("data", "fsdp", "expert")
    assert key.sharding.is_equivalent_to(
        NamedSharding(mesh, P(batch_axes, None, "tensor", None)), key.ndim)
    rows, length, heads, dims = key.shape
    assert heads == 4  # each kv head repeated 4 / kv_heads times: one per tensor shard
    assert {s.data.shape for s in key.addressable_shards} == {(rows // 2, length, 1, dims)}
