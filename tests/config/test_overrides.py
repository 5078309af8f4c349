"""--fdl.NAME=VALUE parsing: Pax value syntax, bare strings, type errors, did-you-mean names."""

from __future__ import annotations

from typing import Literal

import pytest

from paxlite.config.errors import ConfigError
from paxlite.config.overrides import parse_assignments, parse_overrides, parse_value
from paxlite.config.values import HParamSpec
from paxlite.experiments.base import TransformerLmSettings


class Named(TransformerLmSettings):
    RUN_NAME: str = "run"
    VOCAB_PATH: str | None = None
    PRECISION: Literal["fp8", "bf16"] | None = None
    SCALES: list[float] = [1.0]


def _spec(name: str) -> HParamSpec:
    return Named.hparam_specs()[name]


def test_parse_assignments_splits_at_first_equals_and_last_wins() -> None:
    got = parse_assignments(["NUM_LAYERS=4", "RUN_NAME=a=b", "NUM_LAYERS=6", "VOCAB_PATH="])
    assert got == {"RUN_NAME": "a=b", "NUM_LAYERS": "6", "VOCAB_PATH": ""}


def test_parse_assignments_errors() -> None:
    with pytest.raises(ConfigError, match=r"--fdl.NUM_LAYERS: missing '='; write --fdl.NUM_LAY"):
        parse_assignments(["NUM_LAYERS"])
    with pytest.raises(ConfigError, match="missing the parameter name"):
        parse_assignments(["=4"])


@pytest.mark.parametrize(
    ("name", "raw", "expected"),
    [
        ("NUM_LAYERS", "4", 4),
        ("NUM_LAYERS", "-1_000", -1000),
        ("LEARNING_RATE", "1e-4", 1e-4),
        ("LEARNING_RATE", "3", 3.0),
        ("ADAM_BETA1", "0", 0.0),
        ("USE_REPEATED_LAYER", "TRUE", True),
        ("USE_REPEATED_LAYER", "False", False),
        ("USE_REPEATED_LAYER", "true", True),
        ("PACKED_INPUT", "fAlSe", False),
        ("ICI_MESH_SHAPE", "[1,8,1]", [1, 8, 1]),
        ("ICI_MESH_SHAPE", "(2, 2, 2)", [2, 2, 2]),
        ("ICI_MESH_SHAPE", "None", None),
        ("PEAK_TFLOPS", "None", None),
        ("PEAK_TFLOPS", "989.5", 989.5),
        ("SCALES", "[1, 0.5]", [1.0, 0.5]),
        ("FPROP_DTYPE", "bfloat16", "bfloat16"),
        ("FPROP_DTYPE", '"bfloat16"', "bfloat16"),
        ("FPROP_DTYPE", "'float32'", "float32"),
        ("LR_SCHEDULE", "constant", "constant"),
        ("RUN_NAME", "123", "123"),  # str-typed: a non-str literal keeps the raw text
        ("RUN_NAME", "true", "true"),
        ("RUN_NAME", "[1,2]", "[1,2]"),
        ("RUN_NAME", "'quoted'", "quoted"),
        ("RUN_NAME", "", ""),
        ("VOCAB_PATH", "/a/b.model", "/a/b.model"),
        ("VOCAB_PATH", "None", None),
        ("PRECISION", "fp8", "fp8"),
        ("PRECISION", "None", None),
    ],
)
def test_parse_value(name: str, raw: str, expected: object) -> None:
    value = parse_value(raw, _spec(name))
    assert value == expected
    assert type(value) is type(expected)


@pytest.mark.parametrize(
    ("name", "raw", "message"),
    [
        ("NUM_LAYERS", "abc", ("--fdl.NUM_LAYERS=abc: expected int, got 'abc', which is not a "
                               "Python literal")),
        ("NUM_LAYERS", "4.0", "--fdl.NUM_LAYERS=4.0: expected int, got 4.0 (float)"),
        ("NUM_LAYERS", "true", "--fdl.NUM_LAYERS=true: expected int, got True (bool)"),
        ("LEARNING_RATE", "fast", "--fdl.LEARNING_RATE=fast: expected float, got 'fast'"),
        ("LEARNING_RATE", "'1e-3'", "expected float, got '1e-3' (str)"),
        ("USE_REPEATED_LAYER", "1", ("--fdl.USE_REPEATED_LAYER=1: expected bool (true or false), "
                                     "got 1 (int)")),
        ("USE_REPEATED_LAYER", "yes", "expected bool (true or false), got 'yes'"),
        ("ICI_MESH_SHAPE", "[1,8,1", "--fdl.ICI_MESH_SHAPE=[1,8,1: expected list[int] or None"),
        ("ICI_MESH_SHAPE", "[1,'8',1]", "expected list[int] or None, got '8' (str) at index 1"),
        ("DCN_MESH_SHAPE", "1", "expected list[int], got 1 (int)"),
        ("FPROP_DTYPE", "bf16", ("--fdl.FPROP_DTYPE=bf16: expected one of 'float32', 'bfloat16' "
                                 "(did you mean 'bfloat16'?)")),
        ("FPROP_DTYPE", "BFLOAT16", "(did you mean 'bfloat16'?)"),
        ("FPROP_DTYPE", "16", "expected one of 'float32', 'bfloat16', got '16' (str)"),
        ("PRECISION", "fp4", "expected one of 'fp8', 'bf16' or None (did you mean 'fp8'"),
    ],
)
def test_parse_value_errors(name: str, raw: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_value(raw, _spec(name))
    assert message in str(info.value)


def test_unparseable_value_names_type_and_syntax() -> None:
    with pytest.raises(ConfigError) as info:
        parse_value("abc", _spec("NUM_LAYERS"))
    message = str(info.value)
    assert message.startswith("--fdl.NUM_LAYERS=abc: expected int, got 'abc'")
    assert "lists as [1,8,1]" in message and "quote" not in message


def test_parse_overrides_then_resolve() -> None:
    items = ["NUM_LAYERS=4", "LR_COS_WARMUP=500", "ADAM_BETA1=0", "FPROP_DTYPE=bfloat16",
             "ICI_MESH_SHAPE=[1,8,1]", "NUM_LAYERS=6", "USE_REPEATED_LAYER=TRUE"]
    overrides = parse_overrides(Named, items)
    assert overrides == {"NUM_LAYERS": 6, "LR_COS_WARMUP": 500, "ADAM_BETA1": 0.0,
                         "FPROP_DTYPE": "bfloat16", "ICI_MESH_SHAPE": [1, 8, 1],
                         "USE_REPEATED_LAYER": True}
    exp = Named.resolve(overrides)
    assert exp.NUM_LAYERS == 6 and exp.LR_COS_DECAY_START == 501
    assert exp.ADAM_BETA1 == 0.0 and exp.USE_REPEATED_LAYER is True
    assert exp.overridden == frozenset(overrides)


def test_parse_overrides_unknown_names() -> None:
    with pytest.raises(ConfigError) as info:
        parse_overrides(Named, ["NUM_LAYRS=4"])
    assert "unknown hyperparameter(s) for Named: --fdl.NUM_LAYRS (did you mean 'NUM_LAYERS'" in (
        str(info.value))
    with pytest.raises(ConfigError, match=r"--fdl.num_layers \(did you mean 'NUM_LAYERS'"):
        parse_overrides(Named, ["num_layers=4"])  # names are case-sensitive
    with pytest.raises(ConfigError, match=r"--fdl.model.num_layers"):
        parse_overrides(Named, ["model.num_layers=4"])
    with pytest.raises(ConfigError, match=r"--fdl.FRPOP_DTYPE \(did you mean 'FPROP_DTYPE'"):
        parse_overrides(Named, ["FRPOP_DTYPE=bfloat16"])
