"""Whether a saved train state fits the one this run expects, and how to read it if it does.

Apart from the checkpointer (checkpoint.py) because comparing a checkpoint's metadata with the
run's abstract state is its own question, asked before any array is read: which entries differ (so
a mismatch is reported by name, not as an Orbax error), whether the difference is only the earlier
layout of the optax chain (opt_state_layout.py), and which empty fields an older checkpoint
may lack.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from paxlite.checkpointing import opt_state_layout as layout

PyTree = Any


def _leaf_name(path: tuple) -> str:
    """'opt_state/1/mu/layers_0/mlp/wi/kernel' for both saved metadata and the abstract state."""
    keys = (getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)
    return "/".join(str(k) for k in keys)


def _shapes(tree: PyTree) -> dict[str, tuple[int, ...]]:
    return {
        _leaf_name(path): tuple(leaf.shape)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def mismatches(saved: PyTree, expected: PyTree) -> list[str]:
    """Every entry that differs between a saved tree's metadata and the expected tree, named."""
    have, want = _shapes(saved), _shapes(expected)
    problems = [f"  {name}: in the checkpoint {have[name]}, not in this run"
                for name in sorted(set(have) - set(want))]
    problems += [f"  {name}: expected by this run {want[name]}, not in the checkpoint"
                 for name in sorted(set(want) - set(have))]
    problems += [f"  {name}: checkpoint shape {have[name]}, this run's shape {want[name]}"
                 for name in sorted(set(have) & set(want)) if have[name] != want[name]]
    return problems


def earlier_optimizer_layout(
    saved: PyTree, abstract_state: PyTree
) -> layout.EarlierLayout | None:
    """The earlier optimizer layout `saved` (a checkpoint's metadata) has, if, with its Adam state
    and schedule count moved to their current positions, it matches `abstract_state` exactly."""
    current = layout.opt_state_of(abstract_state)
    if not isinstance(saved, dict) or not isinstance(current, tuple):
        return None
    earlier = layout.earlier_layout(saved.get("opt_state"))
    if earlier is None or len(current) != layout.NUM_STAGES:
        return None
    mapped = layout.with_opt_state(saved, earlier.as_current(saved["opt_state"]))
    return None if mismatches(mapped, abstract_state) else earlier


def without_absent_empty_fields(saved: PyTree, target: PyTree) -> tuple[PyTree, Any]:
    """(restore target, rebuild) for a state whose empty fields an older checkpoint lacks.

    A train state field that holds nothing in this run (the FP8 state of a model without FP8) and
    is absent from the checkpoint (saved before the field existed) is left out of the restore, and
    `rebuild` puts the restored entries back into the state type. Otherwise (target, None).
    """
    if not dataclasses.is_dataclass(target) or not isinstance(saved, dict):
        return target, None
    fields = [f.name for f in dataclasses.fields(target)]
    absent = [n for n in fields if n not in saved and not jax.tree.leaves(getattr(target, n))]
    if not absent:
        return target, None
    kept = {n: getattr(target, n) for n in fields if n not in absent}
    return kept, lambda restored: dataclasses.replace(target, **restored)
