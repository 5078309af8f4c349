"""TPU checks, run on the chip by tests/tpu_pass.py (JAX_PLATFORMS=tpu,cpu; the `tpu` tests are
skipped elsewhere).

Each check compares the TPU with the CPU backend of the same process: a training run (losses and
every trained parameter, tests/test_gpu.py's comparison), Orbax checkpoints written from one
backend's arrays and restored onto the other (bit for bit, both ways), greedy generation, and
lm-evaluation-harness scores of the same random model. Float32 matmuls run at "highest" precision
where exactness is asked for: at the TPU's default precision a float32 matmul passes through
bfloat16 and agrees with the CPU to about three digits only.

Only one program can hold the chip, so everything here runs in the test process (no subprocess
touches the TPU). The `_on` helpers take the devices to run on; the CPU test at the end runs them
on two CPU meshes, so the code and tolerances used on the chip run in every `make test`.
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Sequence

import fiddle as fdl
import jax
import numpy as np
import pytest

from paxlite.checkpointing.checkpoint import Checkpointer
from paxlite.data.synthetic import SyntheticData
from paxlite.experiments.build import load_experiment
from paxlite.models.decode import generate
from paxlite.models.transformer import Transformer, TransformerConfig
from paxlite.parallel.mesh import MeshConfig, build_mesh
from paxlite.parallel.rules import DEFAULT_RULES
from paxlite.train.optimizer import make_optimizer
from paxlite.train.schedules import make_schedule
from paxlite.train.step import compile_steps
from tests.test_gpu import OVERRIDES, assert_same_training, train_tiny

TASKS_DIR = pathlib.Path(__file__).resolve().parent / "testdata" / "lm_eval"
LM_EVAL_TASKS = ["paxlite_mc", "paxlite_ppl", "paxlite_gen"]


def tpus() -> list[jax.Device]:
    return jax.devices("tpu")[:1]


def cpus() -> list[jax.Device]:
    return jax.devices("cpu")[:1]


# ------------------------------------------------------------------------------------ training
@pytest.mark.tpu
def test_tpu_training_matches_cpu_parameters_and_losses():
    # At "highest" precision both backends compute float32 matmuls in float32; the TPU's
    # transcendental functions (exp, log, tanh, erf) agree with the CPU's to four or five digits
    # only, which 20 Adam steps grow. 1e-3 of the distance each parameter travelled is still 1000
    # times smaller than what a wrong gradient of one leaf does (tests/test_gpu.py). The same seed
    # gives the same initialisation up to the chip's inverse error function, which draws the
    # normal samples: 2.6e-5 relative at most (first run on the chip, 2026-12-07).
    tpu = train_tiny(tpus())
    cpu = train_tiny(cpus())
    assert_same_training(tpu, cpu, loss_rtol=1e-4, param_rtol=1e-3, init_rtol=1e-4)


@pytest.mark.tpu
def test_tpu_bfloat16_losses_follow_float32_cpu():
    overrides = [*OVERRIDES[:-1], "FPROP_DTYPE=bfloat16"]
    tpu = train_tiny(tpus(), overrides=overrides)
    cpu = train_tiny(cpus(), overrides=overrides)
    np.testing.assert_allclose(tpu.losses, cpu.losses, rtol=3e-2)
    assert tpu.losses[-1] < tpu.losses[0] - 1.0, tpu.losses


@pytest.mark.tpu
def test_tpu_splash_training_matches_xla_attention_on_the_chip():
    # The whole model with the splash kernel against XLA's attention, both on the chip: 20 Adam
    # steps of TinySynthetic (packed rows: segment ids reach the kernel) at float32 "highest".
    splash = train_tiny(tpus(), overrides=[*OVERRIDES, "ATTENTION_IMPLEMENTATION='splash'"])
    xla = train_tiny(tpus(), overrides=[*OVERRIDES, "ATTENTION_IMPLEMENTATION='xla'"])
    assert_same_training(splash, xla, loss_rtol=1e-4, param_rtol=1e-3)


# --------------------------------------------------------------------------------- checkpoints
def _steps_on(devices: Sequence[jax.Device]):
    run = fdl.build(load_experiment("TinySynthetic", list(OVERRIDES)).run_config())
    mesh = build_mesh(MeshConfig(ici_mesh_shape=(len(devices), 1, 1)), devices=list(devices))
    schedule = make_schedule(run.schedule)
    with jax.set_mesh(mesh):
        steps = compile_steps(model=Transformer(run.model),
                              optimizer=make_optimizer(run.optimizer, schedule),
                              schedule=schedule, mesh=mesh, seq_len=run.data.seq_len, seed=0,
                              deterministic=True)
    return steps, mesh, SyntheticData(run.data, global_batch_size=8)


def _trained_state(devices: Sequence[jax.Device], num_steps: int = 3):
    steps, mesh, data = _steps_on(devices)
    with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
        state = steps.init()
        for index in range(num_steps):
            state, _ = steps.train(state, data.train_batch(index, steps.batch_sharding))
    return state


def _save(directory: pathlib.Path, step: int, state) -> None:
    with Checkpointer(directory, save_interval_steps=1, max_to_keep=None) as checkpointer:
        assert checkpointer.save(step, state, force=True)
        checkpointer.wait_until_finished()


def _restore(directory: pathlib.Path, devices: Sequence[jax.Device]):
    steps, _, _ = _steps_on(devices)
    with Checkpointer(directory, save_interval_steps=1, max_to_keep=None) as checkpointer:
        step, state = checkpointer.restore_latest(steps.abstract_state)
    platforms = {d.platform for leaf in jax.tree.leaves(state) for d in leaf.sharding.device_set}
    assert platforms == {devices[0].platform}, platforms
    return step, state


def _assert_bitwise_equal(got, want) -> None:
    got_leaves = jax.tree_util.tree_leaves_with_path(jax.device_get(got))
    want_leaves = jax.tree.leaves(jax.device_get(want))
    assert len(got_leaves) == len(want_leaves) > 10
    for (path, a), b in zip(got_leaves, want_leaves, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, jax.tree_util.keystr(path)
        # bit for bit: compare the bytes (NaN payloads and -0.0 included)
        assert a.tobytes() == b.tobytes(), jax.tree_util.keystr(path)


def check_checkpoint_round_trip(first: Sequence[jax.Device], second: Sequence[jax.Device],
                                root: pathlib.Path) -> None:
    """A state trained on `first`, saved, restored onto `second`, saved from there and restored
    onto `first` again: every leaf is the same bytes at each stage."""
    state = _trained_state(first)
    _save(root / "a", 3, state)
    step, on_second = _restore(root / "a", second)
    assert step == 3
    _assert_bitwise_equal(on_second, state)
    _save(root / "b", 3, on_second)
    step, back = _restore(root / "b", first)
    assert step == 3
    _assert_bitwise_equal(back, state)


@pytest.mark.tpu
def test_checkpoints_move_between_tpu_and_cpu_bit_for_bit(tmp_path):
    check_checkpoint_round_trip(tpus(), cpus(), tmp_path)


# ---------------------------------------------------------------------- generation and lm_eval
# A random model whose logits are far apart (initialised with a large scale), so greedy choices
# have no near-ties that rounding order could flip.
_MODEL = TransformerConfig(num_layers=2, model_dims=64, num_heads=4, dims_per_head=16,
                           hidden_dims=128, vocab_size=200, max_seq_len=32, dtype="float32")


@functools.cache
def _random_params(config: TransformerConfig):
    """Host arrays, made once and shared by both sides of a comparison (read-only, so neither can
    change them): the init jitted, one compile instead of one per initializer op."""
    init = jax.jit(lambda key: Transformer(config).init(key, np.zeros((1, 8), np.int32))["params"])
    # logits spread by ~10 nats
    params = jax.tree.map(lambda x: np.asarray(x) * 25.0, init(jax.random.key(7)))
    for leaf in jax.tree.leaves(params):
        leaf.setflags(write=False)
    return params


def generate_on(devices: Sequence[jax.Device], prompts: list[list[int]]) -> list[list[int]]:
    mesh = build_mesh(MeshConfig(ici_mesh_shape=(len(devices), 1, 1)), devices=list(devices))
    params = _random_params(_MODEL)
    with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
        import flax.linen as nn

        with nn.logical_axis_rules(DEFAULT_RULES):
            return generate(_MODEL, params, prompts, max_new_tokens=12)


PROMPTS = [[1, 17, 93, 5], [1, 150, 2, 88, 41, 7], [1, 3]]


@pytest.mark.tpu
def test_generate_on_tpu_equals_cpu():
    got, want = generate_on(tpus(), PROMPTS), generate_on(cpus(), PROMPTS)
    assert got == want
    assert all(len(ids) >= 12 for ids in want), want


def lm_eval_on(devices: Sequence[jax.Device], tokenizer_path: pathlib.Path) -> dict:
    """lm_eval's results (samples logged) of the random model on a mesh of `devices`."""
    from paxlite.data.tokenizer import Tokenizer
    from paxlite.eval.harness import ModelRunner
    from paxlite.eval.harness_lm import evaluate

    tokenizer = Tokenizer(str(tokenizer_path))
    mesh = build_mesh(MeshConfig(ici_mesh_shape=(len(devices), 1, 1)), devices=list(devices))
    with jax.default_matmul_precision("highest"):
        runner = ModelRunner(model_config=_MODEL, params=_random_params(_MODEL), mesh=mesh,
                             batch_size=4, eos_id=tokenizer.eos_id, decode=tokenizer.decode,
                             vocab_limit=tokenizer.vocab_size)
        return evaluate(runner=runner, tokenizer=tokenizer, bos_id=1, tasks=LM_EVAL_TASKS,
                        include_path=str(TASKS_DIR), log_samples=True, bootstrap_iters=0)


def assert_same_lm_eval(got: dict, want: dict) -> None:
    for task in LM_EVAL_TASKS:
        mine = sorted(got["samples"][task], key=lambda s: s["doc_id"])
        theirs = sorted(want["samples"][task], key=lambda s: s["doc_id"])
        assert len(mine) == len(theirs) > 0
        for a, b in zip(mine, theirs, strict=True):
            ra, rb = [r[0] for r in a["resps"]], [r[0] for r in b["resps"]]
            if task == "paxlite_gen":
                assert ra == rb
            elif task == "paxlite_mc":  # (log-likelihood, is_greedy) per choice
                np.testing.assert_allclose([r[0] for r in ra], [r[0] for r in rb], atol=1e-3)
                assert [r[1] for r in ra] == [r[1] for r in rb]
            else:
                np.testing.assert_allclose(ra, rb, rtol=1e-5)
        for key, value in want["results"][task].items():
            if key.startswith(("acc", "exact_match")) and "_stderr" not in key:
                assert got["results"][task][key] == value, (task, key)


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory) -> pathlib.Path:
    from tests.interop.test_hf_export import train_bpe

    return pathlib.Path(train_bpe(tmp_path_factory.mktemp("spm")))


@pytest.mark.tpu
def test_lm_eval_on_tpu_equals_cpu(tokenizer_path, monkeypatch):
    monkeypatch.chdir(TASKS_DIR)  # the task YAMLs name their data relative to it
    assert_same_lm_eval(lm_eval_on(tpus(), tokenizer_path), lm_eval_on(cpus(), tokenizer_path))


# ------------------------------------------------------------ the same checks on CPU devices
@pytest.mark.slow
def test_the_tpu_checks_run_on_cpu_devices(tmp_path, tokenizer_path, monkeypatch):
    """The checkpoint, generation and lm_eval checks with two CPU meshes in the TPU's place (one
    device against four): the code the chip runs is exercised in every `make test`."""
    one, four = jax.devices("cpu")[:1], jax.devices("cpu")[:4]
    check_checkpoint_round_trip(one, four, tmp_path)
    assert generate_on(four, PROMPTS) == generate_on(one, PROMPTS)
    monkeypatch.chdir(TASKS_DIR)
    assert_same_lm_eval(lm_eval_on(four, tokenizer_path), lm_eval_on(one, tokenizer_path))


def test_a_changed_leaf_is_not_bit_for_bit():
    """The bitwise comparison fails on the smallest change (one float32 ulp)."""
    state = {"a": {"w": np.ones((4, 4), np.float32)}, **{f"b{i}": np.zeros(3) for i in range(10)}}
    changed = jax.tree.map(np.copy, state)
    changed["a"]["w"][1, 2] = np.nextafter(np.float32(1), np.float32(2))
    _assert_bitwise_equal(state, jax.tree.map(np.copy, state))
    with pytest.raises(AssertionError, match=r"\['a'\]\['w'\]"):
        _assert_bitwise_equal(changed, state)



def test_fp8_on_a_tpu_is_one_setting_error():
    """USE_FP8 on a TPU stops before anything compiles; the CPU (and a GPU) keep running it."""
    from types import SimpleNamespace

    from paxlite.errors import SettingError
    from paxlite.train.run_build import check_fp8_platform

    v5e = SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")  # what the chip reports
    with pytest.raises(SettingError, match=r"^USE_FP8=true cannot run on a TPU v5 lite: TPUs "
                                           r"have no FP8 matmul units") as error:
        check_fp8_platform(fp8=True, device=v5e)
    assert "\n" not in str(error.value)
    check_fp8_platform(fp8=False, device=v5e)
    check_fp8_platform(fp8=True, device=jax.devices("cpu")[0])
