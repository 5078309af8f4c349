"""CHECKPOINT_POLICY on unrolled layers: the inherited default keeps every activation (Pax), a
policy set explicitly is applied to each unrolled layer, and that lowers the step's compiled memory
without changing its gradients.

The references are independent of the code under test: the gradients of the same parameters
through the model built without remat, and XLA's own memory analysis of the two compiled steps.
"""

import fiddle as fdl
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from paxlite.config.modifiers import OverridesModifier, RematPolicyModifier
from paxlite.experiments import EXPERIMENTS
from paxlite.experiments.build import configure, load_experiment
from paxlite.experiments.tiny import TinySynthetic
from paxlite.models.transformer import RematPolicy, Transformer, abstract_variables

# Big enough that the activations of 4 layers dwarf the weights (d 64, 128 tokens, 8 rows).
SIZES = ("NUM_LAYERS=4", "MAX_SEQ_LEN=128", "PERCORE_BATCH_SIZE=1")


class _ChosenPolicy(TinySynthetic):
    """An experiment class choosing a policy for its unrolled layers."""

    CHECKPOINT_POLICY = "SAVE_DOT_ONLY"


class _DefaultWrittenOut(TinySynthetic):
    """An experiment class writing out the default, as Pax's GPT126M does."""

    CHECKPOINT_POLICY = "SAVE_NOTHING"


def _model(*overrides: str):
    return fdl.build(load_experiment("TinySynthetic", (*SIZES, *overrides)).model_config())


def test_the_inherited_default_keeps_every_activation_on_unrolled_layers():
    for experiment in (load_experiment("TinySynthetic"), load_experiment("GPT126M"),
                       _DefaultWrittenOut.resolve({})):
        assert not experiment.USE_REPEATED_LAYER
        assert not experiment.checkpoint_policy_set(), experiment.name
        assert experiment.remat_policy() is RematPolicy.NONE
        assert fdl.build(experiment.model_config()).remat_policy is RematPolicy.NONE
        assert experiment.remat_description().startswith("none (unrolled layers keep every ")


def test_a_policy_set_explicitly_reaches_each_unrolled_layer():
    # on the command line, even the default's name
    for name in ("SAVE_NOTHING", "SAVE_QKV_OUT_PROJ"):
        experiment = load_experiment("GPT126M", [f"CHECKPOINT_POLICY={name}"])
        assert fdl.build(experiment.model_config()).remat_policy is RematPolicy[name]
        assert experiment.remat_description() == (
            f"{name} on each unrolled layer (CHECKPOINT_POLICY set explicitly)")
    # an experiment class's own value other than the default
    assert _ChosenPolicy.resolve({}).remat_policy() is RematPolicy.SAVE_DOT_ONLY
    # a config modifier, like an override
    experiment = configure("TinySynthetic",
                           OverridesModifier({"CHECKPOINT_POLICY": "SAVE_OUT_PROJ"}))
    assert experiment.remat_policy() is RematPolicy.SAVE_OUT_PROJ
    # a scanned experiment's policy follows it when its layers are unrolled
    experiment = load_experiment("GPT5B", ["USE_REPEATED_LAYER=false"])
    assert experiment.remat_policy() is RematPolicy.SAVE_DOT_WITH_NO_BATCH_DIM
    # the scanned stack takes it as it always did
    experiment = configure("TinySynthetic", RematPolicyModifier("SAVE_CONTEXT"))
    assert experiment.remat_description() == "SAVE_CONTEXT on each scanned layer"


def test_no_registered_experiment_changes_its_default_remat():
    """Every registered experiment with unrolled layers keeps everything, as under Pax (the
    explicit-policy rule changes no experiment's own step: GPT126M's speed stays)."""
    unrolled = 0
    for name, cls in EXPERIMENTS.items():
        if getattr(cls, "model_from_checkpoint", False):
            continue  # FineTune's model is its checkpoint's (and it scans)
        experiment = cls.resolve({})
        if experiment.USE_REPEATED_LAYER:
            assert experiment.remat_policy() is RematPolicy.parse(experiment.CHECKPOINT_POLICY)
        else:
            unrolled += 1
            assert experiment.remat_policy() is RematPolicy.NONE, name
    assert unrolled > 10


def _loss_fn(model):
    def loss(params, tokens):
        logits = Transformer(model).apply({"params": params}, tokens[:, :-1])
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    return loss


@pytest.fixture(scope="module")
def compiled_steps():
    """The gradient step of the default (no remat) and of SAVE_NOTHING set explicitly, compiled
    for one CPU device, with both gradients on the same parameters and tokens."""
    plain, remat = _model(), _model("CHECKPOINT_POLICY=SAVE_NOTHING")
    assert (plain.scan_layers, plain.remat_policy) == (False, RematPolicy.NONE)
    assert (remat.scan_layers, remat.remat_policy) == (False, RematPolicy.SAVE_NOTHING)
    rng = np.random.default_rng(0)
    abstract = nn.meta.unbox(abstract_variables(plain))["params"]
    params = jax.tree.map(
        lambda a: jnp.asarray(0.2 * rng.normal(size=a.shape), a.dtype), abstract)
    tokens = jnp.asarray(rng.integers(0, plain.vocab_size, (8, 129)), jnp.int32)
    out = {}
    for name, model in (("plain", plain), ("remat", remat)):
        step = jax.jit(jax.grad(_loss_fn(model)))
        compiled = step.lower(params, tokens).compile()
        out[name] = (compiled.memory_analysis().temp_size_in_bytes,
                     jax.device_get(compiled(params, tokens)))
    return out


def test_remat_of_unrolled_layers_lowers_the_compiled_temporaries(compiled_steps):
    plain_bytes, _ = compiled_steps["plain"]
    remat_bytes, _ = compiled_steps["remat"]
    # 4 layers each keeping [8, 8, 128, 128] float32 attention probabilities alone (4 MiB) and
    # their MLP activations, against one layer's rebuilt at a time
    assert remat_bytes < 0.5 * plain_bytes, (remat_bytes, plain_bytes)


def test_remat_of_unrolled_layers_gives_the_plain_gradients(compiled_steps):
    _, plain = compiled_steps["plain"]
    _, remat = compiled_steps["remat"]
    for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(plain),
                                 jax.tree.leaves(remat)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7,
                                   err_msg=jax.tree_util.keystr(path))


def test_the_plan_says_which_remat_the_step_has():
    """`plan`'s text and JSON name the remat the compiled step has (one tiny compile)."""
    from paxlite.planner import plan as plan_lib
    from paxlite.planner.results import Plan

    experiment = load_experiment("TinySynthetic", ["NUM_LAYERS=1", "MAX_SEQ_LEN=32",
                                                   "PERCORE_BATCH_SIZE=1",
                                                   "CHECKPOINT_POLICY=SAVE_NOTHING"])
    plan = plan_lib.plan_experiment(experiment, num_devices=8)
    want = "SAVE_NOTHING on each unrolled layer (CHECKPOINT_POLICY set explicitly)"
    assert plan.to_json()["remat"] == want
    assert Plan.from_json(plan.to_json()) == plan
    assert f"\n  remat: {want}\n" in plan_lib.format_text(plan)
