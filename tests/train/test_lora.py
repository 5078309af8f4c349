"""LoRA training: only the adapters train, the base stays bit-identical, sharding and gradient
accumulation agree, and the command line runs full SFT -> LoRA -> merged export end to end."""

import json
import os
import subprocess

import fiddle as fdl
import flax.linen as nn
import jax
import numpy as np
import pytest
from flax import traverse_util

from paxlite.checkpointing import pretrained
from paxlite.config.errors import ConfigError
from paxlite.data.synthetic import SyntheticData
from paxlite.experiments.build import load_experiment
from paxlite.experiments.tiny import TinyLLaMA
from paxlite.models.lora import is_lora_path
from paxlite.models.lora_merge import merge_lora
from paxlite.models.transformer import Transformer, TransformerConfig, abstract_variables
from paxlite.parallel.mesh import MeshConfig, build_mesh
from paxlite.train.export import base_model_config
from paxlite.train.optimizer import make_optimizer
from paxlite.train.schedules import make_schedule
from paxlite.train.step import compile_steps
from tests.fork_server import paxlite_python
from tests.in_process import paxlite_command
from tests.xla_test_flags import COMPILE_FLAGS

GLOBAL_BATCH = 8
NUM_STEPS = 3
LORA = ["USE_LORA=true", "LORA_RANDOM_BASE=true", "LORA_RANK=4", "LR_SCHEDULE=constant",
        "LEARNING_RATE=1e-2"]


class TinyLLaMAForLoRATest(TinyLLaMA):
    """TinyLLaMA (GQA, RoPE, SwiGLU, untied head) on synthetic tokens, with one layer (the jobs'
    checks go leaf by leaf, so a second layer only lengthens each run's compiles) and a smaller
    vocabulary and rows."""

    SYNTHETIC_DATA = True
    NUM_LAYERS = 1
    VOCAB_SIZE = 128
    MAX_SEQ_LEN = 16
    PERCORE_BATCH_SIZE = 4
    LEARNING_RATE = 1e-2
    SUMMARY_INTERVAL_STEPS = 1
    EVAL_INTERVAL_STEPS = 1000
    EVAL_LOOP_NUM_BATCHES = 1


def _flat(tree):
    return traverse_util.flatten_dict(jax.device_get(tree), sep="/")


def _run_config(overrides=()):
    return fdl.build(load_experiment("TinySynthetic", LORA + list(overrides)).run_config())


def _steps(run, mesh, *, grad_accum_steps=1):
    schedule = make_schedule(run.schedule)
    with jax.set_mesh(mesh):
        return compile_steps(
            model=Transformer(run.model), optimizer=make_optimizer(run.optimizer, schedule),
            schedule=schedule, mesh=mesh, seq_len=run.data.seq_len, seed=run.loop.seed,
            deterministic=True, grad_accum_steps=grad_accum_steps, trainable=is_lora_path,
        )


def _train(run, mesh, state0, *, grad_accum_steps=1, num_steps=NUM_STEPS, steps=None):
    """(states after each step on host, losses); every run starts from the same host state0.
    `steps`: the compiled steps of these settings where the caller has them (not traced again)."""
    steps = steps or _steps(run, mesh, grad_accum_steps=grad_accum_steps)
    data = SyntheticData(run.data, global_batch_size=GLOBAL_BATCH)
    states, losses = [], []
    with jax.set_mesh(mesh):
        state = jax.device_put(state0, steps.state_shardings)
        for index in range(num_steps):
            state, metrics = steps.train(state, data.train_batch(index, steps.batch_sharding))
            states.append(jax.device_get(state))
            losses.append(float(metrics["loss"]))
    return states, losses


@pytest.fixture(scope="module")
def reference():
    """LoRA on TinySynthetic: the initial state, then NUM_STEPS steps on a (2, 2, 2) mesh (and
    the compiled steps, which the tests on this mesh reuse)."""
    run = _run_config()
    mesh = build_mesh(MeshConfig(ici_mesh_shape=(2, 2, 2)))
    steps = _steps(run, mesh)
    with jax.set_mesh(mesh):
        state0 = jax.device_get(steps.init())
        sharded_init = steps.init()
    states, losses = _train(run, mesh, state0, steps=steps)
    return run, mesh, state0, sharded_init, states, losses, steps


def test_only_the_adapters_train(reference):
    run, mesh, state0, sharded_init, states, losses, steps = reference
    before, after = _flat(state0.params), _flat(states[-1].params)
    lora_keys = [k for k in before if is_lora_path(k)]
    # 2 layers x (qkv, out, wi, wo) x (lora_a, lora_b)
    assert len(lora_keys) == 16
    for key in before:
        if is_lora_path(key):
            continue
        assert np.array_equal(after[key], before[key]), f"base weight {key} changed"
    for key in lora_keys:
        if key.endswith("lora_b"):
            assert not np.any(before[key]) and np.any(after[key]), key
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    # Optimizer state: Adam's mu and nu for the adapters only, nothing for the frozen weights.
    opt_leaves = jax.tree_util.tree_leaves_with_path(state0.opt_state)
    moments = [(jax.tree_util.keystr(p), leaf) for p, leaf in opt_leaves if np.ndim(leaf) > 0]
    assert len(moments) == 2 * len(lora_keys)
    assert all("lora_" in path for path, _ in moments)
    assert sum(np.size(leaf) for _, leaf in moments) == 2 * sum(before[k].size for k in lora_keys)
    # The frozen weights keep their shardings through the step (FSDP x tensor on this mesh).
    qkv = sharded_init.params["layers_0"]["attention"]["qkv"]["kernel"]
    assert qkv.sharding.spec == jax.sharding.PartitionSpec("fsdp", None, "tensor", None)
    with jax.set_mesh(mesh):
        batch = SyntheticData(run.data, global_batch_size=GLOBAL_BATCH).train_batch(
            0, steps.batch_sharding)
        trained, _ = steps.train(sharded_init, batch)
    kernel = trained.params["layers_0"]["attention"]["qkv"]["kernel"]
    assert kernel.sharding == qkv.sharding
    np.testing.assert_array_equal(np.asarray(kernel), before["layers_0/attention/qkv/kernel"])


def test_sharded_2x2x2_matches_one_device(reference):
    run, _, state0, _, states, losses, _ = reference
    one = build_mesh(MeshConfig(ici_mesh_shape=(1, 1, 1)), devices=jax.devices()[:1])
    states_one, losses_one = _train(run, one, state0)
    np.testing.assert_allclose(losses, losses_one, rtol=1e-5)
    got, want = _flat(states[0].params), _flat(states_one[0].params)
    # After one step lora_b has moved by about lr = 1e-2 per element (Adam's first step is nearly
    # lr * sign(g)); where |g| is near Adam's epsilon round-off decides the last digits, so the
    # tolerance is 1e-3 of one step.
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-5, err_msg=key)


def test_gradient_accumulation_with_lora(reference):
    run, mesh, state0, _, states, losses, _ = reference
    states_acc, losses_acc = _train(run, mesh, state0, grad_accum_steps=2, num_steps=1)
    assert losses_acc[0] == pytest.approx(losses[0], rel=1e-5)
    got, want = _flat(states_acc[0].params), _flat(states[0].params)
    for key in want:
        if is_lora_path(key):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-5, err_msg=key)
        else:
            assert np.array_equal(got[key], want[key]), key


def test_lora_hyperparameters():
    experiment = load_experiment("TinySynthetic", LORA)
    assert experiment.CHECKPOINT_IGNORE_RULES == ["^.*lora.*$"]  # Pax LoRAMixin
    model = fdl.build(experiment.run_config()).model
    assert (model.lora_rank, model.lora_alpha, model.lora_targets.value) == (4, None, "all")
    assert load_experiment("TinySynthetic", []).CHECKPOINT_IGNORE_RULES is None
    explicit = load_experiment("TinySynthetic", LORA + ["CHECKPOINT_IGNORE_RULES=[]"])
    assert explicit.CHECKPOINT_IGNORE_RULES == []
    with pytest.raises(ConfigError, match="'all', 'attention', 'mlp'"):
        load_experiment("TinySynthetic", ["USE_LORA=true", "LORA_TARGET_LAYERS='qkv'"])
    for bad in ("LORA_RANK=0", "LORA_RANK=-4"):
        with pytest.raises(ConfigError, match="LORA_RANK"):
            load_experiment("TinySynthetic", ["USE_LORA=true", bad])
    with pytest.raises(ConfigError, match="LORA_ALPHA"):
        load_experiment("TinySynthetic", ["USE_LORA=true", "LORA_ALPHA=0.0"])
    with pytest.raises(ConfigError, match="not a regular expression"):
        load_experiment("TinySynthetic", ["CHECKPOINT_IGNORE_RULES=['(']"])


ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
ENV["XLA_FLAGS"] = COMPILE_FLAGS  # one CPU device
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [ENV.get("PYTHONPATH")] if p])


def _cli(*args):
    result = subprocess.run([paxlite_python(), *args], capture_output=True, text=True, env=ENV,
                            timeout=600, cwd=ROOT, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _restore(path, config: TransformerConfig):
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                            nn.meta.unbox(abstract_variables(config)["params"]))
    return pretrained.restore_params(path, abstract)


@pytest.mark.slow  # two training processes and an export from the command line (~32 s on 2 cores)
def test_full_sft_then_lora_then_merged_export_from_the_command_line(tmp_path, monkeypatch, capfd):
    name = "--fdl_config=tests.train.test_lora.TinyLLaMAForLoRATest"  # a dotted path, as users' own
    job_a, job_b, out = tmp_path / "a", tmp_path / "b", tmp_path / "merged"
    # Job A: full fine-tuning (the normal training path), 2 steps.
    _cli("-m", "paxlite.main", name, "--fdl.MAX_STEPS=2", f"--job_log_dir={job_a}")
    # Job B: LoRA initialised from A (Pax: CHECKPOINT_RESTORE_PATH + USE_LORA).
    _cli("-m", "paxlite.main", name, "--fdl.MAX_STEPS=2", f"--fdl.CHECKPOINT_RESTORE_PATH={job_a}",
         "--fdl.USE_LORA=true", "--fdl.LORA_RANK=2", "--fdl.LORA_ALPHA=4.0",
         f"--job_log_dir={job_b}")
    # The merged export reads B's overrides from its config.json; B's experiment is a dotted path to
    # a module, which a job's record alone never imports: the user names it. The command runs in
    # this process (tests/in_process.py): it trains nothing, so its devices do not matter.
    export = paxlite_command(monkeypatch, capfd)("export_merged", name, f"--input={job_b}",
                                                 f"--output={out}")
    assert export.returncode == 0, export.stderr[-3000:]

    experiment = TinyLLaMAForLoRATest.resolve({"USE_LORA": True, "LORA_RANK": 2, "LORA_ALPHA": 4.0,
                                               "CHECKPOINT_RESTORE_PATH": str(job_a)})
    lora_config = fdl.build(experiment.run_config()).model
    base_config = base_model_config(lora_config)
    step_a, params_a = _restore(job_a, base_config)
    step_b, params_b = _restore(job_b, lora_config)
    assert (step_a, step_b) == (2, 2)
    flat_a, flat_b = _flat(params_a), _flat(params_b)
    assert set(flat_b) - set(flat_a) == {k for k in flat_b if is_lora_path(k)}
    for key, value in flat_a.items():  # B's base weights are A's, bit for bit
        assert np.array_equal(flat_b[key], value), key
    assert all(np.any(v) for k, v in flat_b.items() if k.endswith("lora_b"))
    assert pretrained.load_model_config(out) == base_config
    step_m, merged = _restore(out, base_config)
    assert step_m == 2
    expected = _flat(merge_lora(params_b, config=lora_config))
    got = _flat(merged)
    assert got.keys() == expected.keys()
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key])
    assert not np.array_equal(got["layers_0/mlp/wo/kernel"], flat_a["layers_0/mlp/wo/kernel"])
    lines = [json.loads(x) for x in (job_b / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "loss" in x] == [1, 2]


def test_a_merged_export_carries_the_runs_tokenizer(tmp_path, monkeypatch):
    """export_merged copies VOCAB_PATH's tokenizer beside the merged model, as `convert` copies
    one: an HF tokenizer.json with the files read with it (and the tokenizer.model beside it), or
    a SentencePiece model as tokenizer.model with its tokenizer_config.json; `generate` and
    `--to=hf` then find it there."""
    from paxlite.cli.export_merged import _copy_tokenizer
    from paxlite.data.tokenizer import tokenizer_in

    hf_dir, spm_dir = tmp_path / "hf", tmp_path / "spm"
    hf_dir.mkdir()
    spm_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "tokenizer.model", "tokenizer_model_type.json"):
        (hf_dir / name).write_text(f"{name} of the HF directory")
    (spm_dir / "my.model").write_text("a SentencePiece model")
    (spm_dir / "tokenizer_config.json").write_text("its settings")
    for source, want in ((hf_dir, {"tokenizer.json": "tokenizer.json of the HF directory",
                                   "tokenizer_config.json": "tokenizer_config.json of the HF "
                                                            "directory",
                                   "special_tokens_map.json": "special_tokens_map.json of the HF "
                                                              "directory",
                                   "tokenizer.model": "tokenizer.model of the HF directory",
                                   "tokenizer_model_type.json": "tokenizer_model_type.json of "
                                                                "the HF directory"}),
                         (spm_dir / "my.model", {"tokenizer.model": "a SentencePiece model",
                                                 "tokenizer_config.json": "its settings"})):
        out = tmp_path / f"out_{source.name}"
        out.mkdir()
        _copy_tokenizer(str(source), str(out))
        assert {p.name: p.read_text() for p in out.iterdir()} == want
        assert tokenizer_in(out) is not None
    monkeypatch.delenv("VOCAB_PATH", raising=False)
    _copy_tokenizer(None, str(tmp_path / "nothing"))  # synthetic data: no tokenizer, no error
    assert not (tmp_path / "nothing").exists()
