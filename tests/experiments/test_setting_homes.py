"""Each hyperparameter has one home: it is declared (an UPPERCASE class attribute with a type
annotation) in exactly one class, in a topic module under paxlite/experiments/ or in a family file
for what only that family has, never in config/ (the machinery). A family that changes a default
assigns the value without an annotation, so a second declaration (and a second default that could
drift from the first) is caught here."""

import ast
import collections
import pathlib

import pytest

from paxlite.experiments import EXPERIMENTS

PAXLITE = pathlib.Path(__file__).resolve().parents[2] / "paxlite"


def declarations(root: pathlib.Path) -> dict[str, list[str]]:
    """{NAME: ["path:Class", ...]} for every annotated UPPERCASE class attribute under `root`."""
    homes = collections.defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for statement in node.body:
                target = getattr(statement, "target", None)
                if (isinstance(statement, ast.AnnAssign) and isinstance(target, ast.Name)
                        and target.id.isupper() and len(target.id) > 1):
                    homes[target.id].append(f"{path.relative_to(root.parent)}:{node.name}")
    return homes


def test_every_hyperparameter_is_declared_once_outside_config():
    homes = declarations(PAXLITE)
    twice = {name: places for name, places in homes.items() if len(places) > 1}
    assert not twice, f"declared in more than one place: {twice}"
    in_config = {name: places for name, places in homes.items()
                 if any(place.startswith("paxlite/config/") for place in places)}
    assert not in_config, f"config/ holds machinery only, but declares: {in_config}"


def test_the_scan_sees_every_registered_hyperparameter():
    """The scan above is only as good as what it finds: every hyperparameter a registered experiment
    resolves must be one of the declarations it found."""
    found = set(declarations(PAXLITE))
    names = set()
    for name in sorted(EXPERIMENTS):
        names |= set(EXPERIMENTS[name].hparam_specs())
    assert names and names <= found, sorted(names - found)


@pytest.mark.parametrize("source, expected", [
    ("class A:\n    X_Y: int = 1\nclass B:\n    X_Y: int = 2\n", {"X_Y": 2}),
    ("class A:\n    X_Y: int = 1\nclass B(A):\n    X_Y = 2\n", {"X_Y": 1}),
])
def test_the_scan_counts_declarations_not_assignments(tmp_path, source, expected):
    root = tmp_path / "paxlite"
    root.mkdir()
    (root / "m.py").write_text(source)
    assert {k: len(v) for k, v in declarations(root).items()} == expected
