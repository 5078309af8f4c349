"""AXLearn's Fuji family: exact parameter counts, names, batches, step counts, the learner against
hand formulas, flash attention against dot-product attention, and fuji-test-v3 training via main."""

import functools
import json
import math
import os

import fiddle as fdl
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxlite.cli.show import describe
from paxlite.config.errors import ConfigError
from paxlite.experiments import EXPERIMENTS, fuji
from paxlite.experiments.build import load_experiment
from paxlite.models.attention import AttentionKind
from paxlite.models.transformer import PositionEmbedding, Transformer, TransformerConfig
from paxlite.parallel.mesh import MeshError, global_batch_size
from paxlite.train.loop import Run, RunContext
from paxlite.train.optimizer import make_optimizer
from paxlite.train.schedules import make_schedule
from tests.experiments.traced import traced_num_params
from tests.in_process import paxlite_main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
T = 1024**4
# AXLearn's table, written out by hand (docs/training.md's tables; the test model's ffn 32 is from
# fuji-test-v1_init.txt). (size, version): (layers, d, heads, head_dim, kv heads, ffn, vocab, tied,
# seq, theta, total tokens)
TABLE = {
    ("test", "1"): (4, 8, 4, 2, 2, 32, 32, True, 64, 1e4, 1 * T),
    ("test", "2"): (4, 8, 4, 2, 2, 32, 32, True, 64, 1e4, 2 * T),
    ("test", "3"): (4, 8, 4, 2, 2, 32, 32, True, 64, 5e5, 15 * T),
    ("test", "3-tiktoken"): (4, 8, 4, 2, 2, 32, 32, True, 64, 5e5, 15 * T),
    ("7B", "1"): (32, 4096, 32, 128, 32, 11008, 32768, True, 2048, 1e4, 1 * T),
    ("70B", "1"): (80, 8192, 64, 128, 64, 28672, 32768, False, 2048, 1e4, int(1.4 * T)),
    ("7B", "2"): (32, 4096, 32, 128, 32, 11008, 32768, True, 4096, 1e4, 2 * T),
    ("70B", "2"): (80, 8192, 64, 128, 8, 28672, 32768, False, 4096, 1e4, 2 * T),
    ("1B", "3"): (16, 2048, 32, 64, 8, 8192, 131072, True, 8192, 5e5, 15 * T),
    ("3B", "3"): (28, 3072, 24, 128, 8, 8192, 131072, True, 8192, 5e5, 15 * T),
    ("7B", "3"): (32, 4096, 32, 128, 8, 11008, 131072, True, 8192, 5e5, 15 * T),
    ("70B", "3"): (80, 8192, 64, 128, 8, 28672, 131072, False, 8192, 5e5, 15 * T),
    ("405B", "3"): (126, 16384, 128, 128, 8, 53248, 131072, False, 8192, 5e5, 15 * T),
    ("1B", "3-tiktoken"): (16, 2048, 32, 64, 8, 8192, 128256, True, 8192, 5e5, 15 * T),
    ("3B", "3-tiktoken"): (28, 3072, 24, 128, 8, 8192, 128256, True, 8192, 5e5, 15 * T),
    ("8B", "3-tiktoken"): (32, 4096, 32, 128, 8, 14336, 128256, False, 8192, 5e5, 15 * T),
    ("70B", "3-tiktoken"): (80, 8192, 64, 128, 8, 28672, 128256, False, 8192, 5e5, 15 * T),
    ("405B", "3-tiktoken"): (126, 16384, 128, 128, 8, 53248, 128256, False, 8192, 5e5, 15 * T),
}
SINGLE_HOST_SIZES = ("1B", "3B", "7B", "8B")
# The parameter counts AXLearn's shapes give, in billions (3 or 4 significant digits).
DERIVED_BILLIONS = {("1B", "3"): "1.242", ("3B", "3"): "3.221", ("7B", "1"): "6.610",
                    ("7B", "2"): "6.610", ("7B", "3"): "6.208", ("70B", "1"): "78.38",
                    ("70B", "2"): "68.99", ("70B", "3"): "70.60", ("8B", "3-tiktoken"): "8.030",
                    ("405B", "3"): "405.95"}


def _variants():
    """(size, version, flash, single_host, fp8): -fp8 for every size but test."""
    for (size, version) in TABLE:
        for fp8 in (False, True) if size != "test" else (False,):
            for single_host in (False, True) if size in SINGLE_HOST_SIZES else (False,):
                for flash in (False, True):
                    yield size, version, flash, single_host, fp8


VARIANTS = list(_variants())


def _name(size, version, flash, single_host, fp8=False):
    return (f"fuji-{size}-v{version}" + "-flash" * flash + "-fp8" * fp8
            + "-single-host" * single_host)


@functools.cache
def _experiment(name):
    """load_experiment(name), no overrides, once per name and process: the tests below read every
    variant's values and build its model config, and none changes the experiment."""
    return load_experiment(name)


def _count(size, version):
    """The LLaMA parameter formula (docs/migrating_from_pax.md), one V x D table where Fuji ties
    the head."""
    layers, d, heads, h, kv, f, v, tied, *_ = TABLE[size, version]
    per_layer = 2 * d * heads * h + 2 * d * kv * h + 3 * d * f + 2 * d
    return (1 if tied else 2) * v * d + layers * per_layer + d


def test_registered_pairs_and_variants_are_exactly_axlearns():
    fuji_names = {alias for alias in EXPERIMENTS.aliases if alias.startswith("fuji-")}
    assert fuji_names == {_name(*v) for v in VARIANTS}
    # 52 BF16 configs; -fp8 doubles the 44 that are not the test model's
    assert len(fuji.FUJI_EXPERIMENTS) == len(VARIANTS) == 52 + 44
    assert set(fuji.TOTAL_TOKENS) == {(v, s) for s, v in TABLE}
    assert fuji.SINGLE_HOST_SIZES == SINGLE_HOST_SIZES
    tiktoken = fuji.VERSIONS["3-tiktoken"]  # Llama 3's tokenizer
    assert (tiktoken.vocab_size, tiktoken.pad_id, tiktoken.eos_id) == (128_256, 128_004, 128_001)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: _name(*v))
def test_every_name_resolves_to_one_class(variant):
    size, version, flash, single_host, fp8 = variant
    spelled = version.replace("-tiktoken", "Tiktoken")
    class_name = (f"Fuji{'Test' if size == 'test' else size}V{spelled}"
                  + "Flash" * flash + "Fp8" * fp8 + "SingleHost" * single_host)
    cls = getattr(fuji, class_name)
    assert cls.__name__ == class_name and cls.axlearn_name == _name(*variant)
    for spelling in (_name(*variant), class_name, f"paxlite.experiments.fuji.{class_name}"):
        assert type(load_experiment(spelling)) is cls, spelling
    assert EXPERIMENTS[class_name] is EXPERIMENTS[_name(*variant)] is cls


@pytest.mark.parametrize("pair", sorted(TABLE, key=str), ids=lambda p: f"{p[0]}-v{p[1]}")
def test_parameter_counts_by_abstract_init(pair):
    size, version = pair
    for variant in [v for v in VARIANTS if v[:2] == pair]:
        model = fdl.build(_experiment(_name(*variant)).model_config())
        assert traced_num_params(model) == _count(size, version), _name(*variant)
    if pair in DERIVED_BILLIONS:
        printed = DERIVED_BILLIONS[pair]
        digits = len(printed.split(".")[1])
        assert f"{_count(size, version) / 1e9:.{digits}f}" == printed
    if pair == ("test", "1"):
        assert _count(size, version) == 4168
    exact = {("8B", "3-tiktoken"): 8_030_261_248, ("405B", "3"): 405_945_663_488}  # by hand
    if pair in exact:
        assert _count(size, version) == exact[pair]


def test_architecture_and_learner_values():
    for (size, version), row in TABLE.items():
        _layers, d, _heads, _h, kv, _f, _v, tied, _seq, theta, _total = row
        e = _experiment(f"fuji-{size}-v{version}")
        assert (e.NUM_LAYERS, e.MODEL_DIMS, e.NUM_HEADS, e.DIMS_PER_HEAD, e.NUM_KV_HEADS,
                e.HIDDEN_DIMS, e.VOCAB_SIZE, e.TIE_EMBEDDINGS, e.MAX_SEQ_LEN, e.ROPE_THETA,
                e.TOTAL_TOKENS) == row
        model = fdl.build(e.model_config())
        assert (model.norm.value, model.norm_epsilon, model.activation.value, model.gated_mlp,
                model.use_bias, model.position_kind, model.rope_theta, model.tie_embeddings,
                model.kv_heads) == ("rms_norm", 1e-5, "silu", True, False, PositionEmbedding.ROTARY,
                                    theta, tied, kv)
        assert (model.scan_layers, model.dtype, model.param_dtype) == (True, "bfloat16", "float32")
        peak, wd = {"test": (6e-4, 0.01), "70B": (1.5e-4, 0.1),
                    "405B": (1.5e-4, 0.1)}.get(size, (3e-4, 0.1))
        assert (e.LEARNING_RATE, e.DECOUPLED_WEIGHT_DECAY) == (peak, wd)
        assert e.WEIGHT_DECAY == pytest.approx(wd / peak)
        assert (e.ADAM_BETA1, e.ADAM_BETA2, e.ADAM_EPSILON, e.CLIP_GRADIENT_NORM_TO_VALUE,
                e.ADAM_CLIP_THRESHOLD) == (0.9, 0.95, 1e-8, 1.0, -1.0)
        assert e.INIT_STD == d**-0.5
        assert model.attention_kind is AttentionKind.DOT_PRODUCT
        flash = fdl.build(_experiment(f"fuji-{size}-v{version}-flash").model_config())
        assert flash.attention_kind is AttentionKind.FLASH


def test_global_batches_max_steps_and_single_host():
    # (size, version): (global batch, steps); AXLearn goldens for the steps
    want = {("7B", "1"): (2048, 262_144), ("70B", "1"): (2048, 367_001),
            ("7B", "2"): (1024, 524_288), ("70B", "2"): (1024, 524_288),
            **{(size, "3"): (2048, 983_040) for size in ("1B", "3B", "7B", "70B", "405B")},
            **{(size, "3-tiktoken"): (2048, 983_040) for size in ("1B", "3B", "8B", "70B", "405B")},
            **{("test", version): (64, 3000) for version in ("1", "2", "3", "3-tiktoken")}}
    # AXLearn's intent: / 32 for v1, v2 and / 128 for v3, v3-tiktoken
    single_host = {"1": 64, "2": 32, "3": 16, "3-tiktoken": 16}
    for size, version, flash, single, fp8 in VARIANTS:
        e = _experiment(_name(size, version, flash, single, fp8))
        batch, steps = want[size, version]
        assert e.MAX_STEPS == steps and e.LR_COS_DECAY_END == steps
        assert e.GLOBAL_BATCH_SIZE == (single_host[version] if single else batch)
    for name, batch, seq in (("fuji-7B-v1-single-host", 64, 2048),
                             ("fuji-3B-v3-flash-single-host", 16, 8192)):
        info = describe(load_experiment(name), num_local_devices=8)  # what `show` prints
        assert (info["global_batch_size"], info["tokens_per_step"]) == (batch, batch * seq)
    assert "16 x 2048" in fuji.Fuji7BV1SingleHost.__doc__
    assert "8 x 4096" in fuji.Fuji7BV2SingleHost.__doc__
    # the global batch does not follow the device count (PERCORE_BATCH_SIZE is not used)
    e = load_experiment("fuji-7B-v2", ["ICI_MESH_SHAPE=[2,4,1]", "DCN_MESH_SHAPE=[4,1,1]"])
    assert describe(e, num_local_devices=8)["global_batch_size"] == 1024


def test_global_batch_that_does_not_split_is_one_clear_error():
    assert global_batch_size(percore_batch_size=1.0, num_devices=8, batch_split=4,
                             fixed_global_batch_size=12) == 12  # tensor 2: 1.5 rows per device
    with pytest.raises(MeshError, match=r"GLOBAL_BATCH_SIZE=12 does not divide over data x fsdp x "
                                        r"expert = 8 ways \(8 devices, 1.5 rows per device\)"):
        global_batch_size(percore_batch_size=1.0, num_devices=8, batch_split=8,
                          fixed_global_batch_size=12)
    with pytest.raises(ConfigError, match="GLOBAL_BATCH_SIZE must be a positive"):
        load_experiment("fuji-test-v3", ["GLOBAL_BATCH_SIZE=0"])
    # The run refuses it when it builds its mesh, before data, model or compilation.
    overrides = ["SYNTHETIC_DATA=true", "GLOBAL_BATCH_SIZE=12"]
    run_config = fdl.build(load_experiment("fuji-test-v3", overrides).run_config())
    with pytest.raises(MeshError, match="GLOBAL_BATCH_SIZE=12 does not divide over data x fsdp"):
        Run(run_config, RunContext(job_dir="/nonexistent/never-written"))


def _axlearn_multiplier(step: int, *, warmup: int, max_step: int, alpha: float) -> float:
    """AXLearn's cosine_with_linear_warmup(peak 1, begin 0), by hand."""
    if step < warmup:
        return step / warmup
    progress = min(step - warmup, max_step - warmup) / (max_step - warmup)
    return alpha + (1 - alpha) * 0.5 * (1 + math.cos(math.pi * progress))


@pytest.mark.parametrize("name, max_step", [("fuji-7B-v2", 524_288), ("fuji-70B-v1", 367_001)])
def test_learning_rate_is_peak_times_cosine_with_linear_warmup(name, max_step):
    e = load_experiment(name)
    schedule = make_schedule(fdl.build(e.schedule_config()))
    steps = (0, 1, 999, 1999, 2000, 2001, 100_000, max_step // 2, max_step - 1, max_step,
             2 * max_step)
    for step in steps:
        multiplier = _axlearn_multiplier(step, warmup=2000, max_step=max_step, alpha=0.1)
        want = e.LEARNING_RATE * multiplier
        assert float(schedule(step)) == pytest.approx(want, rel=1e-5, abs=1e-12), step
    assert float(schedule(max_step)) == pytest.approx(0.1 * e.LEARNING_RATE, rel=1e-5)
    # a smoke test with a few steps keeps a valid schedule (decay end at least the warm-up)
    assert load_experiment(name, ["MAX_STEPS=3"]).LR_COS_DECAY_END == 2000


def test_one_step_is_axlearns_adamw_decoupled_update():
    """-eta * (peak * adam + wd * param) after clipping to norm 1; eta = 1 with no warm-up."""
    e = load_experiment("fuji-7B-v3", ["LR_COS_WARMUP=0"])
    schedule = make_schedule(fdl.build(e.schedule_config()))
    optimizer = make_optimizer(fdl.build(e.optimizer_config()), schedule)
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(3, 4)), "b": rng.normal(size=(5,))}
    grads = {"w": 3.0 * rng.normal(size=(3, 4)), "b": 3.0 * rng.normal(size=(5,))}
    as32 = lambda tree: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)
    updates, _ = optimizer.update(as32(grads), optimizer.init(as32(params)), as32(params))
    norm = math.sqrt(sum(float(np.sum(g**2)) for g in grads.values()))
    assert norm > 1.0  # so clipping is exercised
    for key, param in params.items():
        g = grads[key] / norm  # clipped to global norm 1
        adam = g / (np.abs(g) + 1e-8)  # first step: m_hat = g, v_hat = g^2 (b1 0.9, b2 0.95)
        want = -(3e-4 * adam + 0.1 * param)
        np.testing.assert_allclose(np.asarray(updates[key], np.float64), want, rtol=2e-5, atol=1e-9)


def _tiny(kv_heads, attention_kind):
    return TransformerConfig(
        vocab_size=64, num_layers=1, model_dims=16, num_heads=4, dims_per_head=4,
        num_kv_heads=kv_heads, hidden_dims=32, max_seq_len=12, norm="rms_norm", activation="silu",
        gated_mlp=True, use_bias=False, tie_embeddings=True, position_embedding="rotary",
        rope_theta=5e5, attention_kind=attention_kind)


@pytest.mark.parametrize("kv_heads", [2, None], ids=["gqa", "mha"])
def test_flash_attention_equals_dot_product(kv_heads):
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 64)
    other = tokens.at[0, 1].set((tokens[0, 1] + 1) % 64)  # a change inside packed document 1
    segments = jnp.asarray([[1] * 5 + [2] * 4 + [0] * 3, [7] * 12], jnp.int32)
    positions = jnp.asarray([[*range(5), *range(4), *range(3)], [*range(12)]], jnp.int32)
    dense, flash = (Transformer(_tiny(kv_heads, kind)) for kind in ("dot_product", "flash"))
    params = jax.tree.map(  # same parameters, same layout for both
        lambda s: jnp.asarray(np.random.default_rng(0).normal(0, 0.3, s.shape), jnp.float32),
        jax.eval_shape(dense.init, {"params": jax.random.key(0)}, tokens))

    @jax.jit
    def logits(params):  # one compilation for every case
        packed = {"positions": positions, "segment_ids": segments}
        return {"dense": dense.apply(params, tokens), "flash": flash.apply(params, tokens),
                "dense_packed": dense.apply(params, tokens, **packed),
                "flash_packed": flash.apply(params, tokens, **packed),
                "flash_packed_other": flash.apply(params, other, **packed)}

    out = jax.tree.map(np.asarray, logits(params))
    np.testing.assert_allclose(out["flash"], out["dense"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["flash_packed"], out["dense_packed"], rtol=1e-5, atol=1e-5)
    assert not np.allclose(out["dense"], out["dense_packed"])  # the segments do change the result
    # the packed rows really are isolated: changing document 1 leaves document 2 unchanged
    a, b = out["flash_packed"][0], out["flash_packed_other"][0]
    np.testing.assert_allclose(a[5:9], b[5:9], rtol=1e-6, atol=1e-6)
    assert not np.allclose(a[1:5], b[1:5])


def test_flash_reaches_every_family_model():
    """ATTENTION_KIND is mapped once, in transformer_fields, so GPT (Pax's USE_CUDNN_FLASH_ATTENTION
    family) gets it as LLaMA does; a family dropping it is refused (tests/experiments/
    test_attention_settings.py)."""
    for name in ("GPT126M", "LLaMA7B"):
        model = fdl.build(load_experiment(name, ["ATTENTION_KIND=flash"]).model_config())
        assert model.attention_kind is AttentionKind.FLASH, name


@pytest.mark.parametrize("name, message", [
    ("fuji-7b-v2", "did you mean 'fuji-7B-v2'"),
    ("fuji-13B-v3", "valid fuji-* names: fuji-test-v1, "),
    ("Fuji7bV2", "did you mean 'Fuji7BV2'"),
])
def test_typos_get_suggestions(name, message):
    with pytest.raises(ConfigError, match=message.replace("*", r"\*")) as err:
        load_experiment(name)
    if name == "fuji-13B-v3":
        listed = str(err.value).split(";")[1]
        assert "fuji-70B-v3-flash" in listed and "fuji-8B-v3-tiktoken" in listed
        assert "fuji-13B" not in listed


def test_fuji_test_v3_trains_three_steps_through_main(tmp_path, monkeypatch, capfd):
    # `python -m paxlite.main` in this process (tests/in_process.py), on its 8 fake devices as a
    # process started from here would have them
    job = tmp_path / "job"
    monkeypatch.chdir(REPO)
    with paxlite_main(monkeypatch, capfd) as run:
        result = run("--fdl_config=fuji-test-v3", "--fdl.SYNTHETIC_DATA=true", "--fdl.MAX_STEPS=3",
                     "--fdl.SUMMARY_INTERVAL_STEPS=1", "--fdl.EVAL_LOOP_NUM_BATCHES=1",
                     "--enable_checkpoint_saving=false", f"--job_log_dir={job}")
    assert result.returncode == 0, result.stderr[-3000:]
    with open(job / "config.json") as f:
        config = json.load(f)
    got = (config["experiment"], config["global_batch_size"], config["mesh"]["data"])
    assert got == ("FujiTestV3", 64, 8)
    with open(job / "metrics.jsonl") as f:
        train = [line for line in map(json.loads, f) if "loss" in line]
    assert [line["step"] for line in train] == [1, 2, 3]
    assert all(math.isfinite(line["loss"]) for line in train)
    # warm-up from 0 over 2000 steps: the rate logged at step s is 6e-4 * (s - 1) / 2000
    assert [line["learning_rate"] for line in train] == pytest.approx([0.0, 3e-7, 6e-7], abs=1e-12)


def test_fp8_variants_are_axlearns_intent_on_every_gpu():
    """-fp8: USE_FP8 with AXLearn's amax history of 128 (on every GPU, as AXLearn intends)."""
    for size, version, flash, single, fp8 in VARIANTS:
        e = _experiment(_name(size, version, flash, single, fp8))
        assert e.USE_FP8 is fp8
        model = fdl.build(e.model_config())
        if fp8:
            assert e.FP8_AMAX_HISTORY_LENGTH == 128
            assert model.fp8.amax_history_length == 128
        else:
            assert model.fp8 is None
    assert "fuji-test-v1-fp8" not in EXPERIMENTS and "fuji-7B-v2-flash-fp8" in EXPERIMENTS


def test_named_trainer_configs_is_axlearns_registry_lookup():
    from paxlite.config.modifiers import GradientAccumulationModifier

    configs = fuji.named_trainer_configs()
    assert set(configs) == {_name(*v) for v in VARIANTS}
    assert type(configs["fuji-8B-v3-tiktoken"]()) is fuji.Fuji8BV3Tiktoken
    e = configs["fuji-test-v1"](GradientAccumulationModifier(2), MAX_STEPS=10)
    assert (e.GRAD_ACCUM_STEPS, e.MAX_STEPS, e.overridden) == (
        2,
        10,
        {"GRAD_ACCUM_STEPS", "MAX_STEPS"},
    )
    with pytest.raises(ConfigError, match="did you mean 'MAX_STEPS'"):
        configs["fuji-test-v1"](MAX_STEP=10)
