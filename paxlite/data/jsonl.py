"""Reading an evaluation set from a JSONL file: every line counts or the read fails.

A bad line is an error naming the file and line, never a skipped example: a silently smaller test
set changes the reported accuracy without anyone noticing.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

from paxlite.data.errors import DatasetError

Example = TypeVar("Example")


def read_jsonl_examples(path: str, parse_line: Callable[[str], Example], *, what: str,
                        expected: str) -> list[Example]:
    """`parse_line` of every non-blank line of `path`, in file order.

    `what` names the data set in errors ("BoolQ"); `expected` says what the file should be. Raises
    ValueError for a missing file, a line `parse_line` rejects (its ValueError), or an empty file.
    """
    if not os.path.isfile(path):
        raise DatasetError(f"{what} file {path!r} does not exist (expected {expected})")
    examples: list[Example] = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                examples.append(parse_line(line))
            except ValueError as e:  # json.JSONDecodeError is a ValueError too
                raise DatasetError(f"{path}:{line_number}: bad {what} line: {e}") from e
    if not examples:
        raise DatasetError(f"{what} file {path!r} holds no examples")
    return examples
