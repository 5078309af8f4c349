"""The planner's result objects as JSON, by one rule for all of them.

A record's JSON is its fields in order, under their own names, so `plan --format=json` prints
what the objects hold and a reader of a result type reads the JSON's keys. Three marks on a field
cover the shapes the JSON has always had: `optional()` (a key left out while None: a lever's
verdict, a CPU compile's kernels), `flattened()` (a nested record whose keys sit in its parent's
object: a plan's verdict) and `json_key` (a key that is no Python name: a plan's "class").
`from_json` reads the same JSON back, so a plan made in a subprocess is the object that printed it.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Mapping
from typing import Any, Self

_OMIT_NONE = "paxlite_omit_none"
_FLATTEN = "paxlite_flatten"
_JSON_KEY = "paxlite_json_key"


def optional(*, flatten: bool = False) -> Any:
    """A field that is None by default and whose key the JSON leaves out while it is None."""
    return dataclasses.field(default=None, metadata={_OMIT_NONE: True, _FLATTEN: flatten})


def flattened() -> Any:
    """A nested record whose keys sit in its parent's JSON object (None: each key null)."""
    return dataclasses.field(metadata={_FLATTEN: True})


def json_key(key: str) -> Any:
    """A field whose JSON key is `key` (one that cannot be a field name, such as "class")."""
    return dataclasses.field(metadata={_JSON_KEY: key})


class JsonRecord:
    """A frozen dataclass that becomes JSON (`to_json`) and is read back (`from_json`)."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None and field.metadata.get(_OMIT_NONE):
                continue
            if field.metadata.get(_FLATTEN):
                out.update(value.to_json() if value is not None
                           else dict.fromkeys(_record_keys(_record_type(self, field))))
            else:
                out[field.metadata.get(_JSON_KEY, field.name)] = _to_json(value)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        values = {}
        for field in dataclasses.fields(cls):
            if field.metadata.get(_FLATTEN):
                record = _record_type(cls, field)
                present = any(data.get(key) is not None for key in _record_keys(record))
                values[field.name] = record.from_json(data) if present else None
                continue
            key = field.metadata.get(_JSON_KEY, field.name)
            if key in data:  # absent: the default (an optional field's None)
                values[field.name] = _from_json(data[key], _hints(cls)[field.name])
        return cls(**values)


def _to_json(value: Any) -> Any:
    if isinstance(value, JsonRecord):
        return value.to_json()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_to_json(item) for item in value]
    if isinstance(value, dict):
        return {key: _to_json(item) for key, item in value.items()}
    return value


def _from_json(value: Any, hint: Any) -> Any:
    """`value` as the type `hint` names: records, enums, tuples and types with a `from_json` (a
    compile target, written as its name) are rebuilt; the rest (numbers, strings, dicts of them) is
    the JSON's own."""
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        choices = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return _from_json(value, choices[0]) if len(choices) == 1 else value
    if origin is tuple:
        item_hint = typing.get_args(hint)[0]
        return tuple(_from_json(item, item_hint) for item in value)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(value)
    if isinstance(hint, type) and hasattr(hint, "from_json"):  # records, a CompileTarget's name
        return hint.from_json(value)
    return value


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _record_type(owner: Any, field: dataclasses.Field) -> type[JsonRecord]:
    """The record type of a flattened field (`R` or `R | None`)."""
    hint = _hints(owner if isinstance(owner, type) else type(owner))[field.name]
    choices = typing.get_args(hint) or (hint,)
    return next(arg for arg in choices if isinstance(arg, type) and issubclass(arg, JsonRecord))


def _record_keys(record: type[JsonRecord]) -> list[str]:
    return [field.metadata.get(_JSON_KEY, field.name) for field in dataclasses.fields(record)]
