"""Problems a typed config reports in its field names, told in the hyperparameters' names.

Each typed config (models/, parallel/, train/) holds its own rules as a function returning one
clause per problem in its field names (``num_layers=3 ...``); it raises them when it is made. The
experiments ask the same function before anything is built and rename the fields through one
table per config (field -> HPARAM), the table their mapping code reads too, so a rule lives in
one place and a user still reads the name they typed. A field name is renamed only as a whole
word, so the configs' messages use field names as names, never as plain words.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping


def in_hparam_names(problems: Iterable[str], *, names: Mapping[str, str]) -> list[str]:
    """``problems`` with every field name that ``names`` lists replaced by its hyperparameter."""
    if not names:
        return list(problems)
    # Longest first, so that a field never matches inside a longer one it prefixes.
    fields = sorted(names, key=len, reverse=True)
    pattern = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, fields)) + r")(?!\w)")
    return [pattern.sub(lambda m: names[m.group(1)], problem) for problem in problems]
