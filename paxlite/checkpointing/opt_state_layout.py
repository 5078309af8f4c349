"""Reading optimizer state saved in the earlier layout of the optax chain into the current one.

The chain of `optimizer.make_optimizer` always holds five stages: clipping (empty state), Adam
(count, mu, nu), the RMS cap (empty), weight decay (empty) and the learning rate (the schedule's
count). Earlier versions left the disabled stages out, so their checkpoints hold 2 to 5 entries:
[clipping,] Adam, [RMS cap,] [weight decay,] learning rate. The arrays are the same - one Adam
state and, last, one schedule count - and a disabled stage is the identity in both layouts, so
moving those two entries to their current positions resumes the job exactly as the earlier code
would have. Jobs checkpointed before the change must keep resuming: a user's saved run is never
lost. `Checkpointer` checks the mapped tree against the run's state before restoring anything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax

PyTree = Any

ADAM_INDEX = 1  # positions in the current chain (optimizer.make_optimizer)
SCHEDULE_INDEX = 4
NUM_STAGES = 5
_EARLIER_ADAM_INDICES = (0, 1)  # without or with clipping in front


def opt_state_of(state: PyTree) -> Any:
    """The `opt_state` of a train state (a `TrainState`, or a dict such as saved metadata)."""
    if isinstance(state, Mapping):
        return state.get("opt_state")
    return getattr(state, "opt_state", None)


def with_opt_state(state: PyTree, opt_state: Any) -> PyTree:
    """`state` with its `opt_state` replaced, the rest untouched (shared, not copied)."""
    if isinstance(state, Mapping):
        return {**state, "opt_state": opt_state}
    return dataclasses.replace(state, opt_state=opt_state)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EarlierLayout:
    """Where the saved entries are: `length` entries, Adam at `adam`, the schedule count last."""

    length: int
    adam: int

    @property
    def schedule(self) -> int:
        return self.length - 1

    def as_current(self, saved: Sequence[Any]) -> list[Any]:
        """The saved entries at their current positions (None elsewhere), for the shape check."""
        mapped: list[Any] = [None] * NUM_STAGES
        mapped[ADAM_INDEX], mapped[SCHEDULE_INDEX] = saved[self.adam], saved[self.schedule]
        return mapped

    def restore_target(self, current: Sequence[Any]) -> tuple[Any, ...]:
        """A restore target in the saved layout, from the run's abstract (current) opt_state, so
        the arrays come back with the run's shardings; empty entries take an empty stage's state."""
        target = [current[0]] * self.length
        target[self.adam], target[self.schedule] = current[ADAM_INDEX], current[SCHEDULE_INDEX]
        return tuple(target)

    def to_current(self, restored: Sequence[Any], current: Sequence[Any]) -> tuple[Any, ...]:
        """The restored entries placed in the current layout; the other stages' (empty) states
        come from `current`, the run's abstract opt_state."""
        mapped = list(current)
        mapped[ADAM_INDEX], mapped[SCHEDULE_INDEX] = restored[self.adam], restored[self.schedule]
        return tuple(mapped)


def earlier_layout(saved: Any) -> EarlierLayout | None:
    """The earlier layout `saved` (a checkpoint's opt_state metadata) has, or None.

    Earlier layout: a list of 2 to 5 entries of which exactly two hold arrays, the first at index 0
    or 1 (Adam), the other last (the schedule count). Whether their contents fit the run (count,
    mu and nu over the trained parameters) is for the caller to check on the mapped tree.
    """
    if not isinstance(saved, Sequence) or isinstance(saved, str):
        return None
    if not 2 <= len(saved) <= NUM_STAGES:
        return None
    holding = [i for i, entry in enumerate(saved) if jax.tree.leaves(entry)]
    if len(holding) != 2 or holding[0] not in _EARLIER_ADAM_INDICES:
        return None
    if holding[1] != len(saved) - 1:
        return None
    return EarlierLayout(length=len(saved), adam=holding[0])
