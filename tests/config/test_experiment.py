"""Experiment: hyperparameter collection over the MRO, type checks, derived values, validation
(on the bare machinery, and on TransformerLmSettings, the generic settings of experiments/)."""

from __future__ import annotations

import enum
import json
from typing import Literal

import pytest

from paxlite.config.errors import ConfigError, did_you_mean, suggestions
from paxlite.config.experiment import Derived, Experiment
from paxlite.config.values import HParamSpec, check_value
from paxlite.experiments.base import TransformerLmSettings

# Pax TransformerLmSpmdAdam values, written out independently of paxlite/experiments/.
PAX_ADAM_DEFAULTS = {
    "NUM_LAYERS": 32, "NUM_HEADS": 16, "MODEL_DIMS": 1024, "HIDDEN_DIMS": 4096,
    "DIMS_PER_HEAD": 64, "VOCAB_SIZE": 32000, "FPROP_DTYPE": "float32", "LEARNING_RATE": 1e-3,
    "LR_SCHEDULE": "linear_rampup_exponential_decay", "LR_LRED_WARMUP": 4000,
    "LR_LRED_DECAY_START": 4001, "LR_LRED_DECAY_END": 300000, "LR_LRED_MIN_RATIO": 0.1,
    "LR_LRED_MAX": 1.0, "LR_COS_WARMUP": 4000, "LR_COS_DECAY_START": 4001,
    "LR_COS_DECAY_END": 300000, "LR_COS_MIN_RATIO": 0.1, "LR_COS_MAX": 1.0, "ADAM_BETA1": 0.9,
    "ADAM_BETA2": 0.99, "ADAM_EPSILON": 1e-6, "ADAM_EPSILON_ROOT": 0.0,
    "ADAM_CLIP_THRESHOLD": 1.0, "WEIGHT_DECAY": 1e-3, "CLIP_GRADIENT_NORM_TO_VALUE": 5.0,
    "CHECKPOINT_EVERY_N_STEPS": 5000, "CHECKPOINT_MAX_TO_KEEP": 10,
    "SUMMARY_INTERVAL_STEPS": 100, "EVAL_INTERVAL_STEPS": 100, "USE_REPEATED_LAYER": False,
    "CHECKPOINT_POLICY": "SAVE_NOTHING", "DROPOUT_PROB": 0.0, "ICI_MESH_SHAPE": None,
    "DCN_MESH_SHAPE": [1, 1, 1], "PACKED_INPUT": True, "SOFTMAX_INIT_STD": 0.02,
}


class Small(TransformerLmSettings):
    """A subclass that only changes values (no annotations), like Pax GPU configs."""

    NUM_LAYERS = 2
    NUM_HEADS = 4
    MODEL_DIMS = 64
    PERCORE_BATCH_SIZE = 2  # an int default for a float hyperparameter is coerced
    DCN_MESH_SHAPE = (1, 1, 1)  # a tuple default becomes a list


class Mode(str, enum.Enum):
    FAST = "fast"
    SLOW = "slow"


class WithNew(Small):
    """Adds hyperparameters, including a chain of derived values and a str/Optional/enum kind."""

    RUN_NAME: str = "run"
    TOKENIZER_PATH: str | None = None
    MODE: Mode = Mode.FAST
    TABLE: dict[str, int] = {"a": 1}
    QUARTER_HIDDEN: int = Derived(lambda hp: hp.HIDDEN_DIMS // 4, doc="HIDDEN_DIMS // 4")
    HALF_QUARTER: int = Derived(lambda hp: hp.QUARTER_HIDDEN // 2, doc="QUARTER_HIDDEN // 2")


def test_base_defaults_match_pax_transformer_lm_spmd_adam() -> None:
    hparams = TransformerLmSettings.resolve().hparams()
    for name, value in PAX_ADAM_DEFAULTS.items():
        assert hparams[name] == value, name
        assert type(hparams[name]) is type(value), name


def test_hparam_specs_are_in_definition_order_with_subclass_additions_last() -> None:
    names = list(WithNew.hparam_specs())
    assert names[:3] == ["NUM_LAYERS", "NUM_HEADS", "MODEL_DIMS"]
    assert names[-6:] == ["RUN_NAME", "TOKENIZER_PATH", "MODE", "TABLE", "QUARTER_HIDDEN",
                          "HALF_QUARTER"]
    spec = WithNew.hparam_specs()["NUM_LAYERS"]
    assert spec == HParamSpec(name="NUM_LAYERS", annotation=int, default=2)
    assert isinstance(WithNew.hparam_specs()["HIDDEN_DIMS"].default, Derived)


def test_subclass_values_and_coercion() -> None:
    exp = Small.resolve()
    assert (exp.NUM_LAYERS, exp.NUM_HEADS, exp.MODEL_DIMS) == (2, 4, 64)
    assert exp.HIDDEN_DIMS == 256 and exp.DIMS_PER_HEAD == 16  # 4 * 64 and 64 // 4
    assert exp.PERCORE_BATCH_SIZE == 2.0 and type(exp.PERCORE_BATCH_SIZE) is float
    assert exp.DCN_MESH_SHAPE == [1, 1, 1] and type(exp.DCN_MESH_SHAPE) is list
    assert exp.name == "Small"
    assert exp.overridden == frozenset()
    assert Small().hparams() == exp.hparams()  # calling the class is the same as resolve()


def test_derived_values_recomputed_after_overrides() -> None:
    exp = TransformerLmSettings.resolve({"LR_COS_WARMUP": 500, "MODEL_DIMS": 512, "NUM_HEADS": 8})
    assert exp.LR_COS_DECAY_START == 501
    assert exp.LR_LRED_DECAY_START == 4001
    assert exp.HIDDEN_DIMS == 2048 and exp.DIMS_PER_HEAD == 64
    assert exp.overridden == {"LR_COS_WARMUP", "MODEL_DIMS", "NUM_HEADS"}


def test_explicit_value_wins_over_derived() -> None:
    exp = TransformerLmSettings.resolve({"LR_COS_WARMUP": 500, "LR_COS_DECAY_START": 700})
    assert exp.LR_COS_DECAY_START == 700
    exp = TransformerLmSettings.resolve({"INIT_STD": 0.5, "SOFTMAX_INIT_STD": 0.25})
    assert (exp.INIT_STD, exp.SOFTMAX_INIT_STD) == (0.5, 0.25)

    class FixedHidden(TransformerLmSettings):
        HIDDEN_DIMS = 3000  # a plain class value replaces the base Derived

    assert FixedHidden.resolve({"MODEL_DIMS": 64}).HIDDEN_DIMS == 3000


def test_chained_derived_values() -> None:
    exp = WithNew.resolve({"MODEL_DIMS": 128})
    # HIDDEN = 4 * 128 = 512; QUARTER = 128; HALF_QUARTER = 64
    assert (exp.HIDDEN_DIMS, exp.QUARTER_HIDDEN, exp.HALF_QUARTER) == (512, 128, 64)
    exp = WithNew.resolve({"QUARTER_HIDDEN": 10})
    assert (exp.HIDDEN_DIMS, exp.QUARTER_HIDDEN, exp.HALF_QUARTER) == (256, 10, 5)


def test_derived_cycle_is_reported_with_names() -> None:
    class Cyclic(Experiment):
        A_VALUE: int = Derived(lambda hp: hp.B_VALUE + 1)
        B_VALUE: int = Derived(lambda hp: hp.C_VALUE + 1)
        C_VALUE: int = Derived(lambda hp: hp.A_VALUE + 1)

    with pytest.raises(ConfigError, match="cycle: A_VALUE -> B_VALUE -> C_VALUE -> A_VALUE"):
        Cyclic.resolve()
    # Overriding one member breaks the cycle: B = 11, A = 12.
    exp = Cyclic.resolve({"C_VALUE": 10})
    assert (exp.A_VALUE, exp.B_VALUE, exp.C_VALUE) == (12, 11, 10)


def test_derived_errors_name_the_inputs() -> None:
    with pytest.raises(ConfigError, match=r"DIMS_PER_HEAD .*NUM_HEADS=0.*ZeroDivisionError"):
        TransformerLmSettings.resolve({"NUM_HEADS": 0})

    class Typo(TransformerLmSettings):
        EXTRA: int = Derived(lambda hp: hp.MODEL_DIM * 2)

    with pytest.raises(ConfigError, match="MODEL_DIM, which is not a hyperparameter.*MODEL_DIMS"):
        Typo.resolve()

    class WrongType(TransformerLmSettings):
        HALF: int = Derived(lambda hp: hp.MODEL_DIMS / 2, doc="MODEL_DIMS / 2")

    with pytest.raises(ConfigError, match=r"derived HALF = MODEL_DIMS / 2 = 512.0: expected int"):
        WrongType.resolve()


def test_zero_and_false_are_kept() -> None:
    exp = TransformerLmSettings.resolve(
        {
            "ADAM_BETA1": 0,
            "WEIGHT_DECAY": 0.0,
            "PACKED_INPUT": False,
            "CLIP_GRADIENT_NORM_TO_VALUE": 0,
            "MAX_STEPS": 0,
        }
    )
    assert exp.ADAM_BETA1 == 0.0 and type(exp.ADAM_BETA1) is float
    assert exp.WEIGHT_DECAY == 0.0 and exp.CLIP_GRADIENT_NORM_TO_VALUE == 0.0
    assert exp.PACKED_INPUT is False and exp.MAX_STEPS == 0


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("NUM_LAYERS", "abc", "--fdl.NUM_LAYERS='abc': expected int, got 'abc' (str)"),
        ("NUM_LAYERS", 4.0, "--fdl.NUM_LAYERS=4.0: expected int, got 4.0 (float)"),
        ("NUM_LAYERS", True, "--fdl.NUM_LAYERS=True: expected int, got True (bool)"),
        ("LEARNING_RATE", "1e-3", "expected float, got '1e-3' (str)"),
        ("LEARNING_RATE", False, "expected float, got False (bool)"),
        ("USE_REPEATED_LAYER", 1, "expected bool (true or false), got 1 (int)"),
        ("DCN_MESH_SHAPE", [1, 2.5, 1], "expected list[int], got 2.5 (float) at index 1"),
        ("DCN_MESH_SHAPE", 8, "expected list[int], got 8 (int)"),
        ("ICI_MESH_SHAPE", "1,8,1", "expected list[int] or None, got '1,8,1' (str)"),
        ("PEAK_TFLOPS", "fast", "expected float or None, got 'fast' (str)"),
        ("FPROP_DTYPE", "bf16",
         ("--fdl.FPROP_DTYPE='bf16': expected one of 'float32', 'bfloat16' "
          "(did you mean 'bfloat16'?)")),
        ("FPROP_DTYPE", 16, "expected one of 'float32', 'bfloat16', got 16 (int)"),
    ],
)
def test_wrong_types_are_rejected(name: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        TransformerLmSettings.resolve({name: value})
    assert message in str(info.value)


def test_accepted_types_and_conversions() -> None:
    exp = WithNew.resolve({
        "LEARNING_RATE": 3, "ICI_MESH_SHAPE": (1, 8, 1), "PEAK_TFLOPS": 989,
        "TOKENIZER_PATH": "/a/b.model", "MODE": "slow", "TABLE": {"x": 2}, "RUN_NAME": "",
    })
    assert exp.LEARNING_RATE == 3.0 and type(exp.LEARNING_RATE) is float
    assert exp.ICI_MESH_SHAPE == [1, 8, 1] and type(exp.ICI_MESH_SHAPE) is list
    assert exp.PEAK_TFLOPS == 989.0 and type(exp.PEAK_TFLOPS) is float
    assert exp.TOKENIZER_PATH == "/a/b.model" and exp.MODE is Mode.SLOW
    assert exp.TABLE == {"x": 2} and exp.RUN_NAME == ""
    with pytest.raises(ConfigError, match=r"expected one of 'fast', 'slow' \(did you mean 'fast'"):
        WithNew.resolve({"MODE": "FAST!"})
    with pytest.raises(ConfigError, match=r"expected dict\[str, int\]"):
        WithNew.resolve({"TABLE": {"x": "y"}})


def test_unknown_override_names_get_suggestions() -> None:
    with pytest.raises(ConfigError) as info:
        TransformerLmSettings.resolve({"NUM_LAYRS": 4, "num_heads": 2})
    text = str(info.value)
    assert "--fdl.NUM_LAYRS (did you mean 'NUM_LAYERS'" in text
    assert "--fdl.num_heads (did you mean 'NUM_HEADS'" in text


def test_bad_class_definitions_are_reported() -> None:
    class Misspelled(TransformerLmSettings):
        FRPOP_DTYPE = "bfloat16"  # Pax would silently create a new attribute

    with pytest.raises(ConfigError, match="FRPOP_DTYPE is not a hyperparameter.*'FPROP_DTYPE'"):
        Misspelled.resolve()

    class BadDefault(TransformerLmSettings):
        NUM_LAYERS = 4.0

    with pytest.raises(ConfigError, match=r"BadDefault.NUM_LAYERS = 4.0: expected int"):
        BadDefault.resolve()

    class NoDefault(Experiment):
        TOKENIZER: str

    with pytest.raises(ConfigError, match="TOKENIZER is annotated but has no value"):
        NoDefault.resolve()


def test_validate_checks_cross_field_constraints() -> None:
    cases = {
        "NUM_LAYERS": (0, "NUM_LAYERS=0 must be a positive integer"),
        "MAX_STEPS": (-1, "MAX_STEPS must be >= 0, got -1"),
        "SUMMARY_INTERVAL_STEPS": (0, "SUMMARY_INTERVAL_STEPS must be >= 1, got 0"),
        "DCN_MESH_SHAPE": ([1, 1], "DCN_MESH_SHAPE=[1, 1]: expected 3 to 6 positive integers"),
        "ICI_MESH_SHAPE": ([1, 0, 1],
                           "ICI_MESH_SHAPE=[1, 0, 1]: expected 3 to 6 positive integers"),
        "PERCORE_BATCH_SIZE": (0, "PERCORE_BATCH_SIZE must be > 0, got 0.0"),
        "LR_COS_DECAY_START": (10, "LR_COS_DECAY_START (10) must be >= LR_COS_WARMUP (4000)"),
        "LR_LRED_DECAY_END": (5, "LR_LRED_DECAY_END (5) must be >= LR_LRED_DECAY_START (4001)"),
        "DROPOUT_PROB": (1.0, "DROPOUT_PROB=1.0 must be a probability in [0, 1)"),
        "HIDDEN_DIMS": (0, "HIDDEN_DIMS=0 must be a positive integer"),
    }
    for name, (value, message) in cases.items():
        with pytest.raises(ConfigError) as info:
            TransformerLmSettings.resolve({name: value})
        assert message in str(info.value), (name, str(info.value))
    # Boundary values that are valid.
    exp = TransformerLmSettings.resolve(
        {
            "LR_COS_WARMUP": 0,
            "LR_COS_DECAY_START": 0,
            "LR_COS_DECAY_END": 0,
            "PERCORE_BATCH_SIZE": 0.5,
            "EVAL_LOOP_NUM_BATCHES": -1,
        }
    )
    assert (exp.LR_COS_DECAY_START, exp.PERCORE_BATCH_SIZE) == (0, 0.5)


def test_subclass_validate_hook_runs_after_resolution() -> None:
    class Even(TransformerLmSettings):
        def validate(self) -> None:
            super().validate()
            if self.HIDDEN_DIMS % 3:
                raise ConfigError(f"HIDDEN_DIMS must divide by 3, got {self.HIDDEN_DIMS}")

    assert Even.resolve({"MODEL_DIMS": 6, "NUM_HEADS": 1}).HIDDEN_DIMS == 24
    with pytest.raises(ConfigError, match="got 28"):
        Even.resolve({"MODEL_DIMS": 7, "NUM_HEADS": 1})  # the derived 4 * 7 = 28 is checked


def test_hparams_are_json_serialisable_and_complete() -> None:
    exp = WithNew.resolve({"ICI_MESH_SHAPE": (2, 2, 2), "MODE": Mode.SLOW})
    hparams = exp.hparams()
    assert list(hparams) == list(WithNew.hparam_specs())
    round_trip = json.loads(json.dumps(hparams))
    assert round_trip == hparams
    assert round_trip["ICI_MESH_SHAPE"] == [2, 2, 2] and round_trip["MODE"] == "slow"
    hparams["DCN_MESH_SHAPE"].append(9)  # a copy: the experiment is unchanged
    assert exp.DCN_MESH_SHAPE == [1, 1, 1]


def test_resolved_experiment_rejects_later_assignment() -> None:
    exp = TransformerLmSettings.resolve()
    with pytest.raises(ConfigError, match="derived values would go stale"):
        exp.LR_COS_WARMUP = 10
    exp.note = "lowercase attributes are not hyperparameters"
    assert exp.note.startswith("lowercase")


def test_check_value_and_suggestions_directly() -> None:
    spec = HParamSpec(name="X", annotation=Literal["a", "b"] | None, default=None)
    assert check_value(spec, None) is None
    assert check_value(spec, "b") == "b"
    with pytest.raises(ConfigError, match=r"^custom: expected one of 'a', 'b' or None, got 3"):
        check_value(spec, 3, label="custom")
    assert suggestions("pile126m", ["Pile126M", "Pile5B", "LLaMA7B"]) == ["Pile126M"]
    assert did_you_mean("zzzz", ["NUM_LAYERS"]) == ""
