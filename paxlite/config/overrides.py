"""Parsing `--fdl.NAME=VALUE` overrides with Pax's value syntax, checked against the experiment.

Pax (through Fiddle) reads `true`/`false` in any case as booleans and everything else with
`ast.literal_eval`, so strings must be quoted. paxlite keeps that syntax and additionally accepts a
bare word for a string-valued parameter (`--fdl.FPROP_DTYPE=bfloat16`), because the quoted form is
the commonest way Pax users trip over shell quoting. Names and types are validated, which Pax never
did, by the rules in `values.py` that class defaults and Derived values go through too.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from typing import Any

from paxlite.config.errors import ConfigError
from paxlite.config.experiment import Experiment
from paxlite.config.values import HParamSpec, accepts_str, check_value, type_name

_NOT_A_LITERAL = object()


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
