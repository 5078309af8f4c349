"""Turning `--fdl_config=NAME` into an experiment class.

Three spellings work, so Pax scripts run unchanged: a registered short name (`Pile126M`) or one of
its aliases (AXLearn's `fuji-7B-v2` for `Fuji7BV2`), a dotted import path
(`paxlite.experiments.gpt.Pile126M`, or a user's own module), and a legacy Pax path
(`paxml.contrib.gpu.scripts_gpu.configs.Pile126M`) whose last component is a registered name. The
registry itself is a mapping passed in by the caller (a plain dict, or a `Registry` that also knows
aliases): no global, no import-time side effects.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any

from paxlite.config.errors import ConfigError, did_you_mean
from paxlite.config.experiment import Experiment

_LEGACY_PREFIXES = ("paxml.", "praxis.")


class Registry(Mapping[str, type[Experiment]]):
    """Registered experiments by name, plus aliases (other projects' names for the same ones).

    Iterating gives the primary names only, so `list` and the golden tests see each experiment
    once; lookups accept both (`registry["fuji-7B-v2"] is registry["Fuji7BV2"]`).
    """

    def __init__(self, experiments: Mapping[str, type[Experiment]],
                 *, aliases: Mapping[str, str] | None = None) -> None:
        self._experiments = dict(experiments)
        self._aliases = dict(aliases or {})
        for alias, target in self._aliases.items():
            if target not in self._experiments:
                raise ConfigError(f"registry alias {alias!r} names unregistered {target!r}")
            if alias in self._experiments:
                raise ConfigError(f"registry alias {alias!r} is also a registered primary name")

    @property
    def aliases(self) -> Mapping[str, str]:
        """alias -> primary name."""
        return dict(self._aliases)

    def __getitem__(self, name: str) -> type[Experiment]:
        return self._experiments[self._aliases.get(name, name)]

    def __contains__(self, name: object) -> bool:
        return name in self._experiments or name in self._aliases

    def __iter__(self) -> Iterator[str]:
        return iter(self._experiments)

    def __len__(self) -> int:
        return len(self._experiments)


def _all_names(registry: Mapping[str, type[Experiment]]) -> list[str]:
    """Primary names and aliases: what a 'did you mean' may suggest."""
    return [*registry, *getattr(registry, "aliases", {})]


def _family_hint(name: str, registry: Mapping[str, type[Experiment]]) -> str:
    """'; valid fuji-* names: ...' when `name` starts like a family of aliases ('fuji-8B-v3')."""
    prefix = name.split("-", 1)[0].lower()
    if prefix == name.lower() or name.lower() in {n.lower() for n in _all_names(registry)}:
        return ""  # no family, or a case slip that 'did you mean' already names exactly
    family = [a for a in getattr(registry, "aliases", {}) if a.lower().startswith(prefix + "-")]
    if not family:
        return ""
    return f"; valid {prefix}-* names: " + ", ".join(family)


def legacy_pax_name(name: str) -> str | None:
    """The last part of a `paxml.`/`praxis.` dotted name ('a.configs.Pile126M' -> 'Pile126M')."""
    if not name.startswith(_LEGACY_PREFIXES):
        return None
    last = name.rsplit(".", 1)[-1]
    return last or None


def resolve_experiment(name: str, registry: Mapping[str, type[Experiment]]) -> type[Experiment]:
    """The experiment class that `--fdl_config=name` means; ConfigError with suggestions if none."""
    name = name.strip()
    if not name:
        raise ConfigError(
            "--fdl_config is required: a registered name such as "
            f"{_some_names(registry)}, or a dotted path pkg.module.Class"
        )
    if name in registry:
        return registry[name]
    legacy = legacy_pax_name(name)
    if legacy is not None:
        if legacy in registry:
            return registry[legacy]
        raise ConfigError(
            f"--fdl_config={name}: legacy Pax name whose experiment {legacy!r} is not "
            f"registered in paxlite{did_you_mean(legacy, registry)}; "
            "`python -m paxlite list` shows them all"
        )
    if "." in name:
        return _import_experiment(name, registry)
    raise ConfigError(
        f"--fdl_config={name}: unknown experiment{did_you_mean(name, _all_names(registry))}"
        f"{_family_hint(name, registry)}; "
        "use a registered name (`python -m paxlite list`) or a dotted path pkg.module.Class"
    )


def resolve_registered_experiment(
    name: str, registry: Mapping[str, type[Experiment]], *, source: str
) -> type[Experiment]:
    """The registered experiment that `name` (read from `source`, e.g. a job's config.json) means.

    Never imports anything: a job directory is data that anyone may have written, and importing the
    dotted path it names would run code from wherever that path points (`python -m` puts the
    current directory on the import path). So only registered names, their aliases, legacy Pax
    names of them and a registered class's own dotted path are accepted.
    """
    name = name.strip()
    if name in registry:
        return registry[name]
    legacy = legacy_pax_name(name)
    if legacy is not None and legacy in registry:
        return registry[legacy]
    for cls in registry.values():
        if name == f"{cls.__module__}.{cls.__qualname__}":
            return cls
    raise ConfigError(
        f"{source} names the experiment {name!r}, which is not a registered experiment; names read "
        "from a job directory are never imported (that would run code the directory points to): "
        f"pass --fdl_config={name} yourself to import it"
    )


def _some_names(registry: Mapping[str, type[Experiment]]) -> str:
    names = sorted(registry)[:3]
    return ", ".join(names) if names else "(none registered)"


def _import_experiment(path: str, registry: Mapping[str, type[Experiment]]) -> type[Experiment]:
    """Imports the longest importable module prefix of `path`, then follows attributes."""
    parts = path.split(".")
    if any(not p.isidentifier() for p in parts):
        raise ConfigError(f"--fdl_config={path}: not a dotted path of Python identifiers")
    module = None
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            # Only a missing prefix means "try a shorter one"; a module that exists but imports
            # something missing is the user's real problem, reported as such.
            if err.name is not None and module_name.startswith(err.name) and (
                    module_name == err.name or module_name[len(err.name)] == "."):
                continue
            raise ConfigError(
                f"--fdl_config={path}: importing {module_name} failed: {err}"
            ) from err
        except Exception as err:  # a user module that raises on import
            raise ConfigError(
                f"--fdl_config={path}: importing {module_name} failed: {type(err).__name__}: {err}"
            ) from err
        break
    if module is None:
        raise ConfigError(
            f"--fdl_config={path}: no module {'.'.join(parts[:-1])!r} can be imported"
            f"{did_you_mean(parts[-1], registry)}"
        )
    target: Any = module
    walked = module_name
    for attr in parts[cut:]:
        if not hasattr(target, attr):
            choices = [n for n, v in vars(target).items() if _is_experiment_class(v)]
            raise ConfigError(
                f"--fdl_config={path}: {walked} has no attribute {attr!r}"
                f"{did_you_mean(attr, [*choices, *registry])}"
            )
        target = getattr(target, attr)
        walked = f"{walked}.{attr}"
    if not _is_experiment_class(target):
        raise ConfigError(
            f"--fdl_config={path}: {_what(target)}, not a subclass of "
            "paxlite.config.experiment.Experiment"
        )
    return target


def _is_experiment_class(value: Any) -> bool:
    return isinstance(value, type) and issubclass(value, Experiment)


def _what(value: Any) -> str:
    if isinstance(value, Experiment):
        return f"an instance of {type(value).__name__}; name the class itself"
    if isinstance(value, type):
        return f"a class ({value.__module__}.{value.__qualname__})"
    kind = type(value).__name__
    article = "an" if kind[:1].lower() in "aeiou" else "a"
    if callable(value):
        return f"{article} {kind} ({getattr(value, '__qualname__', value)!r})"
    return f"{article} {kind} ({value!r})"
