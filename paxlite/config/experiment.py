"""Pax-style experiments: UPPERCASE class attributes are hyperparameters, resolved after overrides.

Users write experiments the Pax way - a subclass that changes a few constants - but two Pax pitfalls
are removed. Values computed from other values are declared as `Derived` and computed *after*
command-line overrides (Pax evaluated `LR_COS_DECAY_START = LR_COS_WARMUP + 1` once, at class
definition, so overriding the warm-up left it stale). And every name and value is checked against
the annotations, so a misspelled override or `NUM_LAYERS=4.0` is an error instead of a silently
created attribute.
"""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from paxlite.config.errors import ConfigError, did_you_mean
from paxlite.config.values import HParamSpec, check_value, to_json_friendly, type_name

_HPARAM_NAME = re.compile(r"[A-Z][A-Z0-9_]*")


def is_hparam_name(name: str) -> bool:
    """Whether `name` is spelled like a hyperparameter (UPPERCASE, digits and underscores)."""
    return _HPARAM_NAME.fullmatch(name) is not None


class Derived:
    """A hyperparameter computed from others after overrides are applied.

    `fn` receives a read-only view whose attributes are the resolved hyperparameters, e.g.
    `HIDDEN_DIMS: int = Derived(lambda hp: 4 * hp.MODEL_DIMS, doc="4 * MODEL_DIMS")`. Setting the
    name explicitly (subclass value or --fdl.X) replaces the computation.
    """

    def __init__(self, fn: Callable[[Any], Any], doc: str = "") -> None:
        if not callable(fn):
            raise ConfigError(f"Derived needs a function of the hyperparameters, got {fn!r}")
        self.fn = fn
        self.doc = doc

    def __repr__(self) -> str:
        return f"Derived({self.doc!r})" if self.doc else "Derived(<function>)"


# ------------------------------------------------------------------------------------------------
# Derived values


class _View:
    """What a Derived function sees: attribute access to hyperparameters, resolved on demand."""

    def __init__(self, resolver: _Resolver, reads: dict[str, Any]) -> None:
        object.__setattr__(self, "_resolver", resolver)
        object.__setattr__(self, "_reads", reads)

    def __getattr__(self, name: str) -> Any:
        value = self._resolver.get(name)
        self._reads[name] = value
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        raise ConfigError(f"a Derived function may not set {name}; return the value instead")


class _Resolver:
    """Computes Derived values depth-first, so dependency order falls out and cycles are caught."""

    def __init__(self, specs: Mapping[str, HParamSpec], values: dict[str, Any],
                 pending: dict[str, Derived]) -> None:
        self.specs = specs
        self.values = values
        self.pending = pending
        self.stack: list[str] = []

    def get(self, name: str) -> Any:
        if name in self.values:
            return self.values[name]
        if name not in self.pending:
            raise ConfigError(
                f"a Derived value{self._context()} reads {name}, which is not a hyperparameter"
                + did_you_mean(name, self.specs)
            )
        if name in self.stack:
            cycle = self.stack[self.stack.index(name):] + [name]
            raise ConfigError("derived hyperparameters form a cycle: " + " -> ".join(cycle))
        self.stack.append(name)
        derived = self.pending[name]
        reads: dict[str, Any] = {}
        try:
            result = derived.fn(_View(self, reads))
        except ConfigError:
            raise
        except Exception as err:  # a user function failing on odd values, e.g. x // 0
            inputs = ", ".join(f"{k}={v!r}" for k, v in reads.items()) or "no values"
            raise ConfigError(
                f"computing derived {name} ({derived.doc or 'no description'}) from {inputs} "
                f"failed: {type(err).__name__}: {err}"
            ) from err
        finally:
            self.stack.pop()
        desc = f" = {derived.doc}" if derived.doc else ""
        value = check_value(self.specs[name], result, label=f"derived {name}{desc} = {result!r}")
        self.values[name] = value
        del self.pending[name]
        return value

    def _context(self) -> str:
        return f" (computing {self.stack[-1]})" if self.stack else ""


# ------------------------------------------------------------------------------------------------
# The experiment base class


class Experiment:
    """Base of every experiment: the machinery, no hyperparameters of its own.

    Subclass and annotate to add a hyperparameter (paxlite/experiments/ declares them by topic,
    next to the code that maps and checks them); assign to change a default. Construct with
    `Exp.resolve({"NUM_LAYERS": 4})` (or `Exp(...)`, the same) to get an instance whose attributes
    are the checked, resolved values.
    """

    overridden: frozenset[str]

    def __init__(self, overrides: Mapping[str, Any] | None = None) -> None:
        cls = type(self)
        specs = cls.hparam_specs()
        overrides = dict(overrides) if overrides is not None else {}
        cls.check_names(overrides)
        values: dict[str, Any] = {}
        pending: dict[str, Derived] = {}
        for name, spec in specs.items():
            if name in overrides:
                values[name] = check_value(spec, overrides[name])
            elif isinstance(spec.default, Derived):
                pending[name] = spec.default
            else:
                label = f"{cls.__name__}.{name} = {spec.default!r}"
                values[name] = check_value(spec, spec.default, label=label)
        resolver = _Resolver(specs, values, pending)
        for name in list(pending):
            if name in pending:  # may have been computed already as another one's dependency
                resolver.get(name)
        for name in specs:
            object.__setattr__(self, name, values[name])
        object.__setattr__(self, "overridden", frozenset(overrides))
        self.validate()

    def __setattr__(self, name: str, value: Any) -> None:
        if is_hparam_name(name):
            raise ConfigError(
                f"cannot set {name} on a resolved experiment: derived values would go stale; "
                f"pass it to {type(self).__name__}.resolve({{{name!r}: ...}}) instead"
            )
        object.__setattr__(self, name, value)

    @classmethod
    def hparam_specs(cls) -> dict[str, HParamSpec]:
        """Every UPPERCASE annotated name over the MRO, base classes' names first."""
        annotations = [_hparam_annotations(klass) for klass in reversed(cls.__mro__)]
        order: list[str] = []
        for ann in annotations:
            order.extend(n for n in ann if is_hparam_name(n) and n not in order)
        specs: dict[str, HParamSpec] = {}
        for name in order:
            annotation = next(ann[name] for ann in reversed(annotations) if name in ann)
            if not hasattr(cls, name):
                raise ConfigError(
                    f"{cls.__name__}.{name} is annotated but has no value; give it a default "
                    f"(None, typed '{type_name(annotation)} | None', if --fdl.{name} must set it)"
                )
            specs[name] = HParamSpec(name=name, annotation=annotation, default=getattr(cls, name))
        _check_unannotated(cls, specs)
        return specs

    @classmethod
    def check_names(cls, names: Iterable[str]) -> None:
        """Raises one ConfigError listing every name that is not a hyperparameter of `cls`."""
        specs = cls.hparam_specs()
        unknown = [n for n in names if n not in specs]
        if unknown:
            parts = [f"--fdl.{n}{did_you_mean(n, specs)}" for n in unknown]
            raise ConfigError(
                f"unknown hyperparameter(s) for {cls.__name__}: " + ", ".join(parts)
                + f"; `python -m paxlite show --fdl_config={cls.__name__}` lists them all"
            )

    @classmethod
    def resolve(cls, overrides: Mapping[str, Any] | None = None) -> Experiment:
        """Checks and applies `overrides`, computes the Derived values, validates; see class doc."""
        return cls(overrides)

    def validate(self) -> None:
        """Cross-field checks; subclasses extend it (call super) and raise ConfigError."""
        problems = self.hparam_problems()
        if problems:
            raise ConfigError(f"invalid {self.name} hyperparameters: " + "; ".join(problems))

    def hparam_problems(self) -> list[str]:
        """What the settings' own values cannot be, one clause each. Each mixin that declares
        hyperparameters extends it (`[*super().hparam_problems(), ...]`), so the checks sit with
        their declarations and are reported together in one error."""
        return []

    def hparams(self) -> dict[str, Any]:
        """Every resolved hyperparameter, JSON-friendly (lists, plain enum values), in order."""
        return {name: to_json_friendly(getattr(self, name)) for name in self.hparam_specs()}

    @property
    def name(self) -> str:
        return type(self).__name__

    def __repr__(self) -> str:
        changed = ", ".join(f"{n}={getattr(self, n)!r}" for n in sorted(self.overridden))
        return f"{self.name}({changed})"


def _hparam_annotations(klass: type) -> dict[str, Any]:
    """The UPPERCASE annotations a class itself declares, string annotations evaluated.

    Only UPPERCASE ones are evaluated, so an unrelated annotation naming a TYPE_CHECKING-only import
    (under `from __future__ import annotations`) cannot break resolution.
    """
    out: dict[str, Any] = {}
    for name, annotation in inspect.get_annotations(klass).items():
        if not is_hparam_name(name):
            continue
        if isinstance(annotation, str):
            module = sys.modules.get(klass.__module__)
            namespace = dict(vars(module)) if module is not None else {}
            try:
                annotation = eval(annotation, namespace, dict(vars(klass)))
            except Exception as err:
                raise ConfigError(
                    f"{klass.__name__}.{name}: cannot evaluate annotation {annotation!r}: "
                    f"{type(err).__name__}: {err}"
                ) from err
        out[name] = annotation
    return out


def _check_unannotated(cls: type, specs: Mapping[str, HParamSpec]) -> None:
    """An UPPERCASE class value no class annotates is a typo (Pax's FRPOP_DTYPE), not a knob."""
    for klass in cls.__mro__:
        for name, value in vars(klass).items():
            if not is_hparam_name(name) or name in specs:
                continue
            if callable(value) or isinstance(value, (classmethod, staticmethod, property)):
                continue
            raise ConfigError(
                f"{klass.__name__}.{name} is not a hyperparameter{did_you_mean(name, specs)}; "
                f"annotate it ({name}: <type> = ...) to add a new one"
            )
