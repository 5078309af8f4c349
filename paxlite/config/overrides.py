"""Parsing `--fdl.NAME=VALUE` overrides with Pax's value syntax, checked against the experiment.

Pax (through Fiddle) reads `true`/`false` in any case as booleans and everything else with
`ast.literal_eval`, so strings must be quoted. paxlite keeps that syntax and additionally accepts a
bare word for a string-valued parameter (`--fdl.FPROP_DTYPE=bfloat16`), because the quoted form is
the commonest way Pax users trip over shell quoting. Names and types are validated, which Pax never
did; the type checks (`check_value`) live here too, because resolving class defaults and Derived
values in experiment.py uses exactly the same rules as the command line.
"""

from __future__ import annotations

import ast
import enum
import numbers
import types
import typing
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from paxlite.config.errors import ConfigError, did_you_mean

if TYPE_CHECKING:  # experiment.py imports this module, so only for annotations
    from paxlite.config.experiment import Experiment, HParamSpec

_NOT_A_LITERAL = object()

# ------------------------------------------------------------------------------------------------
# Type checking and coercion (used by Experiment.resolve for defaults, overrides and derived values)


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


# ------------------------------------------------------------------------------------------------
# Command-line syntax


def parse_assignments(items: Sequence[str]) -> dict[str, str]:
    """['NUM_LAYERS=4', ...] -> {'NUM_LAYERS': '4'}; split at the first '='; the last one wins."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(
                f"--fdl.{item}: missing '='; write --fdl.{item.strip() or 'NAME'}=VALUE"
            )
        name = name.strip()
        if not name:
            raise ConfigError(f"--fdl.{item}: missing the parameter name before '='")
        out.pop(name, None)  # re-insert so the dict's order is that of the effective assignments
        out[name] = raw
    return out


def _literal(raw: str) -> Any:
    """Pax's value syntax: true/false in any case, else a Python literal; else _NOT_A_LITERAL."""
    if raw.strip().lower() in ("true", "false"):
        return raw.strip().lower() == "true"
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return _NOT_A_LITERAL


def parse_value(raw: str, spec: HParamSpec) -> Any:
    """Parses the text after '=' for `spec`, then checks and coerces it to the annotation.

    A string-valued parameter also takes the raw text when it is not a Python literal or when the
    literal is of the wrong type (`--fdl.RUN_NAME=123` is the string '123').
    """
    label = f"--fdl.{spec.name}={raw}"
    parsed = _literal(raw)
    if parsed is not _NOT_A_LITERAL:
        try:
            return check_value(spec, parsed, label=label)
        except ConfigError:
            if not accepts_str(spec.annotation):
                raise
    if accepts_str(spec.annotation):
        return check_value(spec, raw, label=label)
    raise ConfigError(
        f"{label}: expected {type_name(spec.annotation)}, got {raw!r}, which is not a Python "
        "literal (write numbers as 4 or 1e-4, lists as [1,8,1], None, true/false)"
    )


def parse_overrides(cls: type[Experiment], items: Sequence[str]) -> dict[str, Any]:
    """['NAME=VALUE', ...] -> {NAME: value} checked against `cls` (unknown names: did-you-mean)."""
    assignments = parse_assignments(items)
    cls.check_names(assignments)
    specs = cls.hparam_specs()
    return {name: parse_value(raw, specs[name]) for name, raw in assignments.items()}
