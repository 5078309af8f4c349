"""Every registered experiment: exact Pax dimensions, parameter counts, and a golden dump of its
configuration.

The golden files make any change to an experiment's hyperparameters or parameter layout a reviewable
diff. Regenerate with `UPDATE_GOLDEN=1 pytest tests/experiments`.
"""

import math
import os

import fiddle as fdl
import flax.linen as nn
import jax
import pytest

from paxlite.cli.catalogue import parameter_counts
from paxlite.experiments import EXPERIMENTS
from paxlite.experiments.build import load_experiment
from tests.experiments.traced import traced_num_params, traced_variables

GOLDEN_DIR = os.path.join(os.path.dirname(__file__), "..", "testdata", "golden")


def golden_text(name: str) -> str:
    experiment = EXPERIMENTS[name].resolve({})
    lines = [
        f"# {name}: {type(experiment).__module__}.{type(experiment).__qualname__}",
        "[hparams]",
    ]
    lines += [f"{key} = {value!r}" for key, value in experiment.hparams().items()]
    model = fdl.build(experiment.model_config())
    variables = traced_variables(model)["params"]  # shared with the other tests tracing this model
    specs = nn.get_partition_spec(variables)
    lines.append("[params]")
    count = 0
    for (path, leaf), spec in zip(
        jax.tree_util.tree_leaves_with_path(nn.meta.unbox(variables)), jax.tree.leaves(
            specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    ):
        key = "/".join(str(getattr(k, "key", k)) for k in path)
        lines.append(f"{key} {leaf.dtype} {tuple(leaf.shape)} {tuple(spec)}")
        count += math.prod(leaf.shape)
    # The count `list` and `show` print (a closed form of the config) is the traced model's, less
    # DeepSeek-V3's never-trained router choice biases (state, as transformers' buffers are).
    state = sum(math.prod(leaf.shape) for path, leaf in
                jax.tree_util.tree_leaves_with_path(nn.meta.unbox(variables))
                if getattr(path[-1], "key", None) == "score_correction_bias")
    assert parameter_counts(model)[0] == count - state, (name, parameter_counts(model)[0], count)
    lines.append("[derived]")
    lines.append(f"num_params = {count}")
    lines.append(f"flops_per_token = {experiment.flops_per_token()}")
    return "\n".join(lines) + "\n"


# Every registered experiment with a model of its own (FineTune's is its checkpoint's).
WITH_MODEL = sorted(name for name, cls in EXPERIMENTS.items()
                    if not getattr(cls, "model_from_checkpoint", False))


@pytest.mark.parametrize("name", WITH_MODEL)
def test_golden(name):
    path = os.path.join(GOLDEN_DIR, f"{name}.txt")
    text = golden_text(name)
    if os.environ.get("UPDATE_GOLDEN"):
        with open(path, "w") as f:
            f.write(text)
    with open(path) as f:
        expected = f.read()
    assert text == expected, (f"{name} differs from {path}; if intended, regenerate with "
                              "UPDATE_GOLDEN=1")


def test_every_golden_file_has_an_experiment():
    names = {f[: -len(".txt")] for f in os.listdir(GOLDEN_DIR) if f.endswith(".txt")}
    assert names == set(WITH_MODEL)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("GPT126M", 125_262_336),
        ("Synthetic126M", 125_262_336),
        ("Pile126M", 125_262_336),
        ("GPT5B", 5_047_558_144),
        ("Synthetic5B", 5_047_558_144),
        ("GPT175B", 174_604_259_328),
        ("Synthetic175B", 174_604_259_328),
    ],
)
def test_exact_parameter_counts(name, expected):
    model = fdl.build(EXPERIMENTS[name].resolve({}).model_config())
    assert traced_num_params(model) == expected


def test_pax_gpt_hyperparameters():
    """Values from Pax's GPT126MBase / GPT5BBase / GPT175BBase, written out here by hand."""
    gpt126m = EXPERIMENTS["Synthetic126M"].resolve({})
    assert (gpt126m.NUM_LAYERS, gpt126m.NUM_HEADS, gpt126m.MODEL_DIMS, gpt126m.HIDDEN_DIMS) == (
        12,
        12,
        768,
        3072,
    )
    assert (gpt126m.VOCAB_SIZE, gpt126m.MAX_SEQ_LEN, gpt126m.PERCORE_BATCH_SIZE) == (50304, 2048, 4)
    assert (gpt126m.ICI_MESH_SHAPE, gpt126m.DCN_MESH_SHAPE) == ([8, 1, 1], [8, 1, 1])
    assert (gpt126m.LEARNING_RATE, gpt126m.LR_COS_WARMUP, gpt126m.LR_COS_DECAY_START,
            gpt126m.LR_COS_DECAY_END) == (6e-4, 636, 637, 500000)
    assert (gpt126m.ADAM_BETA1, gpt126m.ADAM_BETA2, gpt126m.ADAM_EPSILON, gpt126m.WEIGHT_DECAY) == (
        0.9, 0.95, 1e-8, 0.1)
    assert (gpt126m.CLIP_GRADIENT_NORM_TO_VALUE, gpt126m.ADAM_CLIP_THRESHOLD) == (1.0, -1.0)
    assert (gpt126m.INIT_STD, gpt126m.SOFTMAX_INIT_STD, gpt126m.FPROP_DTYPE) == (
        0.023,
        0.023,
        "bfloat16",
    )
    gpt5b = EXPERIMENTS["Synthetic5B"].resolve({})
    assert (
        gpt5b.LEARNING_RATE,
        gpt5b.LR_COS_WARMUP,
        gpt5b.LR_COS_DECAY_START,
        gpt5b.LR_COS_DECAY_END,
    ) == (1.6e-4, 115, 116, 62500)
    assert (gpt5b.ICI_MESH_SHAPE, gpt5b.DCN_MESH_SHAPE, gpt5b.PERCORE_BATCH_SIZE) == (
        [1, 8, 1],
        [1, 32, 1],
        8,
    )
    assert (gpt5b.USE_REPEATED_LAYER, gpt5b.CHECKPOINT_POLICY) == (
        True,
        "SAVE_DOT_WITH_NO_BATCH_DIM",
    )
    assert (
        gpt5b.CHECKPOINT_EVERY_N_STEPS,
        gpt5b.SUMMARY_INTERVAL_STEPS,
        gpt5b.INPUT_DROPOUT_PROB,
    ) == (250, 10, 0.1)
    gpt175b = EXPERIMENTS["Synthetic175B"].resolve({})
    assert (gpt175b.VOCAB_SIZE, gpt175b.PERCORE_BATCH_SIZE, gpt175b.INIT_STD) == (50257, 6, 0.023)
    assert (gpt175b.LEARNING_RATE, gpt175b.LR_COS_WARMUP, gpt175b.LR_COS_DECAY_END) == (
        2e-5,
        265,
        108600,
    )
    assert gpt175b.CHECKPOINT_EVERY_N_STEPS == 100


def test_model_config_follows_overrides():
    experiment = load_experiment("Synthetic126M", ["NUM_LAYERS=2", "USE_REPEATED_LAYER=true",
                                                   "FPROP_DTYPE=float32", "LR_COS_WARMUP=500"])
    model = fdl.build(experiment.model_config())
    assert (model.num_layers, model.scan_layers, model.dtype) == (2, True, "float32")
    # Pax applies CHECKPOINT_POLICY to repeated layers
    assert model.remat_policy.value == "save_nothing"
    schedule = fdl.build(experiment.schedule_config())
    assert (schedule.warmup_steps, schedule.decay_start) == (500, 501)  # derived after the override


def test_pile_without_data_dir_is_a_clear_error(monkeypatch):
    from paxlite.config.errors import ConfigError

    monkeypatch.delenv("TFDS_DATA_DIR", raising=False)
    experiment = load_experiment("Pile126M")
    with pytest.raises(ConfigError, match=r"neither DATA_DIR nor "
                                          r"TFDS_DATA_DIR.*--fdl.SYNTHETIC_DATA=true"):
        experiment.run_config()
    text = fdl.build(
        load_experiment("Pile126M", ["DATA_DIR=/data/pile", "VOCAB_PATH=/v.model"]).data_config()
    )
    assert (text.data_dir, text.vocab_path, text.seq_len, text.packed) == (
        "/data/pile",
        "/v.model",
        2048,
        True,
    )
    assert load_experiment("Pile126M", ["SYNTHETIC_DATA=true"]).run_config() is not None


def test_pile_reads_pax_tfds_data_dir_from_the_flag_or_the_environment(monkeypatch):
    from paxlite.config.errors import ConfigError

    monkeypatch.delenv("TFDS_DATA_DIR", raising=False)
    text = fdl.build(
        load_experiment("Pile126M", ["TFDS_DATA_DIR='/tfds'", "VOCAB_PATH=/v.model"]).data_config()
    )
    assert (text.data_dir, text.tfds_name) == ("/tfds", "the_pile:1.0.0")
    monkeypatch.setenv("TFDS_DATA_DIR", "/env/tfds")
    text = fdl.build(load_experiment("Pile126M", ["TFDS_DATASET='c4/en:3.0.1'"]).data_config())
    assert (text.data_dir, text.tfds_name) == ("/env/tfds", "c4/en:3.0.1")
    # DATA_DIR (paxlite's own format) wins over an environment-wide TFDS_DATA_DIR
    text = fdl.build(load_experiment("Pile126M", ["DATA_DIR=/data/pile"]).data_config())
    assert (text.data_dir, text.tfds_name) == ("/data/pile", None)
    with pytest.raises(ConfigError, match=r"TFDS_DATASET='wiki:1.0.0'.*the_pile"):
        load_experiment("Pile126M", ["TFDS_DATASET='wiki:1.0.0'"])
    with pytest.raises(ConfigError, match=r"name\[/config\]:X.Y.Z"):
        load_experiment("Pile126M", ["TFDS_DATASET=the_pile"])
    with pytest.raises(ConfigError, match=r"INPUT_PIPELINE=seqio reads TFDS datasets"):
        load_experiment("Pile126M", ["DATA_DIR=/data/pile", "INPUT_PIPELINE=seqio"]).run_config()


def test_whole_eval_set_is_refused_for_synthetic_data():
    from paxlite.config.errors import ConfigError

    with pytest.raises(ConfigError, match="EVAL_LOOP_NUM_BATCHES=-1"):
        load_experiment("Synthetic126M", ["EVAL_LOOP_NUM_BATCHES=-1"])
