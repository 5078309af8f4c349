"""Hyperparameter values checked against their annotations: the one set of type rules.

Class defaults, Derived results and command-line overrides all go through `check_value`, so a value
is accepted or refused by the same rules wherever it comes from (`NUM_LAYERS=4.0` is an error in a
subclass, in a Derived function and on the command line alike). Apart from `experiment.py`, which
resolves with these rules, and `overrides.py`, which parses the command line into values for them.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

from paxlite.config.errors import ConfigError, did_you_mean


@dataclasses.dataclass(frozen=True, kw_only=True)
class HParamSpec:
    """One hyperparameter: its name, its annotation (the most derived one) and its class default."""

    name: str
    annotation: Any
    default: Any  # a value, or a Derived




class _Mismatch(Exception):
    """Internal: a value does not fit an annotation; turned into ConfigError with a label."""

    def __init__(self, expected: str, got: str | None, hint: str = "") -> None:
        super().__init__(expected)
        self.expected = expected
        self.got = got
        self.hint = hint

    def text(self) -> str:
        got = f", got {self.got}" if self.got is not None else ""
        return f"expected {self.expected}{got}{self.hint}"


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _is_enum(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, enum.Enum)


def type_name(annotation: Any) -> str:
    """A readable name for an annotation, as used in error messages ('list[int] or None')."""
    origin = typing.get_origin(annotation)
    if annotation is type(None) or annotation is None:
        return "None"
    if annotation is Any:
        return "any value"
    if origin is Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(annotation))
    if _is_enum(annotation):
        return "one of " + ", ".join(repr(m.value) for m in annotation)
    if _is_union(annotation):
        return " or ".join(type_name(a) for a in typing.get_args(annotation))
    if origin in (list, dict):
        args = typing.get_args(annotation)
        inner = ", ".join(type_name(a) for a in args)
        return f"{origin.__name__}[{inner}]" if args else origin.__name__
    if annotation is bool:
        return "bool (true or false)"
    if isinstance(annotation, type):
        return annotation.__name__
    return repr(annotation)


def accepts_str(annotation: Any) -> bool:
    """Whether a bare word on the command line can be a value of this annotation."""
    if annotation is str:
        return True
    if typing.get_origin(annotation) is Literal:
        return any(isinstance(c, str) for c in typing.get_args(annotation))
    if _is_enum(annotation):
        return any(isinstance(m.value, str) for m in annotation)
    if _is_union(annotation):
        return any(accepts_str(a) for a in typing.get_args(annotation))
    return False


def _coerce(annotation: Any, value: Any) -> Any:
    """`value` converted to `annotation` (tuple -> list, int -> float); else raises _Mismatch."""
    origin = typing.get_origin(annotation)
    if annotation is Any or annotation is object:
        return value
    if annotation is type(None) or annotation is None:
        if value is None:
            return None
        raise _Mismatch("None", _describe(value))
    if _is_union(annotation):
        return _coerce_union(annotation, value)
    if origin is Literal:
        choices = typing.get_args(annotation)
        for choice in choices:
            if type(value) is type(choice) and value == choice:
                return choice
        raise _choice_mismatch(annotation, value, [c for c in choices if isinstance(c, str)])
    if _is_enum(annotation):
        if isinstance(value, annotation):
            return value
        for member in annotation:
            if type(value) is type(member.value) and value == member.value:
                return member
        raise _choice_mismatch(
            annotation, value, [m.value for m in annotation if isinstance(m.value, str)]
        )
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch(type_name(bool), _describe(value))
    if annotation is int:
        # bool is an int subclass and 4.0 is integral, but both are almost always a mistake here.
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
        raise _Mismatch("int", _describe(value))
    if annotation is float:
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return float(value)
        raise _Mismatch("float", _describe(value))
    if annotation is str:
        if isinstance(value, str):
            return value
        raise _Mismatch("str", _describe(value))
    if origin is list or annotation is list:
        return _coerce_list(annotation, value)
    if origin is dict or annotation is dict:
        return _coerce_dict(annotation, value)
    raise ConfigError(
        f"unsupported hyperparameter annotation {annotation!r}; use int, float, bool, str, "
        "Literal[...], an Enum, list[...], dict[...] or X | None"
    )


def _choice_mismatch(annotation: Any, value: Any, words: list[str]) -> _Mismatch:
    """For Literal/Enum: the choices, plus the closest ones when the value is a near-miss word."""
    hint = did_you_mean(value, words) if isinstance(value, str) else ""
    return _Mismatch(type_name(annotation), None if hint else _describe(value), hint)


def _coerce_union(annotation: Any, value: Any) -> Any:
    members = typing.get_args(annotation)
    if value is None and type(None) in members:
        return None
    real = [m for m in members if m is not type(None)]
    failures: list[_Mismatch] = []
    for member in real:
        try:
            return _coerce(member, value)
        except _Mismatch as mismatch:
            failures.append(mismatch)
    if len(failures) == 1:  # Optional[X]: keep X's precise detail (element index, did-you-mean)
        only = failures[0]
        raise _Mismatch(type_name(annotation), only.got, only.hint)
    raise _Mismatch(type_name(annotation), _describe(value))


def _coerce_list(annotation: Any, value: Any) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise _Mismatch(type_name(annotation), _describe(value))
    args = typing.get_args(annotation)
    if not args:
        return list(value)
    out = []
    for index, item in enumerate(value):
        try:
            out.append(_coerce(args[0], item))
        except _Mismatch:
            raise _Mismatch(type_name(annotation), f"{_describe(item)} at index {index}") from None
    return out


def _coerce_dict(annotation: Any, value: Any) -> dict[Any, Any]:
    if not isinstance(value, Mapping):
        raise _Mismatch(type_name(annotation), _describe(value))
    args = typing.get_args(annotation)
    if not args:
        return dict(value)
    out = {}
    for key, item in value.items():
        try:
            out[_coerce(args[0], key)] = _coerce(args[1], item)
        except _Mismatch:
            got = f"{_describe(key)}: {_describe(item)}"
            raise _Mismatch(type_name(annotation), got) from None
    return out


def check_value(spec: HParamSpec, value: Any, *, label: str | None = None) -> Any:
    """Checks `value` against `spec.annotation` and returns it coerced (tuple -> list, 1 -> 1.0).

    `label` starts the error message; by default the command-line form `--fdl.NAME=value`.
    """
    try:
        return _coerce(spec.annotation, value)
    except _Mismatch as mismatch:
        where = label if label is not None else f"--fdl.{spec.name}={value!r}"
        raise ConfigError(f"{where}: {mismatch.text()}") from None


def to_json_friendly(value: Any) -> Any:
    """Lists for tuples, enum values for members, recursively; everything else unchanged."""
    if isinstance(value, enum.Enum):
        return to_json_friendly(value.value)
    if isinstance(value, (list, tuple)):
        return [to_json_friendly(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): to_json_friendly(v) for k, v in value.items()}
    return value
