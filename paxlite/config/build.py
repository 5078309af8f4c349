"""The one function from (experiment name, --fdl.X overrides) to the Fiddle tree of a run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import fiddle as fdl

from paxlite.config.experiment import Experiment
from paxlite.config.overrides import parse_overrides
from paxlite.config.registry import resolve_experiment
from paxlite.config.run import RunConfig


def default_registry() -> Mapping[str, type[Experiment]]:
    from paxlite.experiments import EXPERIMENTS  # experiments import config/, not the other way round

    return EXPERIMENTS


def load_experiment(
    name: str,
    assignments: Sequence[str] = (),
    *,
    registry: Mapping[str, type[Experiment]] | None = None,
) -> Experiment:
    """Resolve --fdl_config, validate and apply --fdl.X assignments ("NAME=VALUE"), compute derived values."""
    cls = resolve_experiment(name, default_registry() if registry is None else registry)
    return cls.resolve(parse_overrides(cls, assignments))


def run_tree(experiment: Experiment) -> fdl.Config[RunConfig]:
    """The Fiddle tree of the run; `fdl.build` of it gives the RunConfig dataclass."""
    return experiment.run_config()


def build_run_config(name: str, assignments: Sequence[str] = ()) -> tuple[Experiment, RunConfig]:
    experiment = load_experiment(name, assignments)
    return experiment, fdl.build(run_tree(experiment))
