"""From an experiment's name and its overrides to the resolved experiment and its run's Fiddle tree.

Here rather than in config/ because it needs the registry of experiments, and the experiments are
built on config/'s base class: config/ stays below them, and only this package knows them all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import fiddle as fdl

from paxlite.config.errors import ConfigError
from paxlite.config.experiment import Experiment
from paxlite.config.modifiers import ConfigModifier
from paxlite.config.overrides import parse_overrides
from paxlite.config.registry import resolve_experiment, resolve_registered_experiment
from paxlite.experiments import EXPERIMENTS
from paxlite.train.run_config import RunConfig


def load_experiment(
    name: str,
    assignments: Sequence[str] = (),
    *,
    registry: Mapping[str, type[Experiment]] | None = None,
) -> Experiment:
    """Resolve --fdl_config, validate and apply --fdl.X assignments ("NAME=VALUE"), compute derived
    values."""
    cls = resolve_experiment(name, EXPERIMENTS if registry is None else registry)
    return cls.resolve(parse_overrides(cls, assignments))


def load_recorded_experiment(
    name: str,
    overrides: Mapping[str, Any],
    assignments: Sequence[str] = (),
    *,
    source: str = "the job's config.json",
    fdl_config: str | None = None,
) -> Experiment:
    """The experiment a job ran, from its config.json's record (name, overridden values), with
    further
    --fdl.X assignments on top.

    The recorded `name` resolves against the registry only (never imported: see
    `resolve_registered_experiment`). `fdl_config`, typed by the user, replaces it and may be
    anything `--fdl_config` accepts, a dotted path to the user's own module included; the recorded
    overrides (plain values, no code) still apply.
    """
    if fdl_config:
        cls = resolve_experiment(fdl_config, EXPERIMENTS)
    else:
        cls = resolve_registered_experiment(name, EXPERIMENTS, source=source)
    return cls.resolve({**overrides, **parse_overrides(cls, assignments)})


def run_tree(experiment: Experiment) -> fdl.Config[RunConfig]:
    """The Fiddle tree of the run; `fdl.build` of it gives the RunConfig dataclass."""
    return experiment.run_config()


def build_tree(tree: fdl.Config[RunConfig]) -> RunConfig:
    """`fdl.build` of a run tree, where a ValueError from a config dataclass's own checks (a
    hyperparameter the experiment's checks let through) is the user's: one ConfigError line."""
    from paxlite.errors import UserError

    try:
        return fdl.build(tree)
    except ValueError as e:
        # Fiddle builds plain config dataclasses here (no JAX runs): a ValueError is one of their
        # __post_init__ value checks.
        if isinstance(e, UserError):
            raise
        raise ConfigError(str(e).split("\n\nFiddle context:", 1)[0]) from e


def build_run_config(name: str, assignments: Sequence[str] = ()) -> tuple[Experiment, RunConfig]:
    experiment = load_experiment(name, assignments)
    return experiment, build_tree(run_tree(experiment))


def configure(
    experiment: str | type[Experiment], *modifiers: ConfigModifier, **overrides: Any
) -> Experiment:
    """The resolved experiment: `modifiers` applied in order, then `overrides` (NAME=value) on top.

    `experiment` is a registered name, a dotted path, or an Experiment subclass. Names and values
    are checked exactly as on the command line (unknown names get "did you mean").
    """
    cls = (
        experiment if isinstance(experiment, type) else resolve_experiment(experiment, EXPERIMENTS)
    )
    if not (isinstance(cls, type) and issubclass(cls, Experiment)):
        raise ConfigError("configure() needs an experiment name or an Experiment subclass, got "
                          f"{experiment!r}")
    values: dict[str, Any] = {}
    for modifier in modifiers:
        values = modifier(values)
    values.update(overrides)
    return cls.resolve(values)
