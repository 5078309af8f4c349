"""The one exception type for configuration mistakes, and the 'did you mean' helper it uses.

Every mistake a user can make on the command line or in an experiment class (unknown name, wrong
type, impossible combination of values) raises `ConfigError` with a single message that names the
bad value and what would be valid, so `main` can print it without a traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from paxlite.errors import UserError


class ConfigError(UserError, ValueError):
    """A user-facing configuration mistake; the message alone says what to change."""


def suggestions(word: str, choices: Iterable[str], *, limit: int = 3) -> list[str]:
    """Up to `limit` choices close to `word`, compared case-insensitively, best first.

    Case-insensitive because the commonest near-miss is case ('num_layers', 'pile126m'), which plain
    difflib scores poorly.
    """
    by_lower: dict[str, list[str]] = {}
    for choice in choices:
        by_lower.setdefault(choice.lower(), []).append(choice)
    if word.lower() in by_lower:  # a pure case slip: the exact spelling is the only useful hint
        return by_lower[word.lower()][:limit]
    found: list[str] = []
    for lower in difflib.get_close_matches(word.lower(), list(by_lower), n=limit, cutoff=0.6):
        found.extend(by_lower[lower])
    return found[:limit]


def did_you_mean(word: str, choices: Iterable[str], *, limit: int = 3) -> str:
    """' (did you mean 'A', 'B'?)' for the closest choices, or '' when nothing is close."""
    close = suggestions(word, choices, limit=limit)
    if not close:
        return ""
    return " (did you mean " + ", ".join(repr(c) for c in close) + "?)"
