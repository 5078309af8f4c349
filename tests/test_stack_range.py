"""The range of versions setup.cfg declares is the range that is tested.

Two stacks are tested: constraints.txt (CI's, Python 3.12) and constraints-py311.txt (the oldest:
Python 3.11 with jax 0.10.2, the TPU image's; `make test-py311` installs paxlite under it, trains).
Each floor in setup.cfg is the py311 pin, so a floor cannot drift below what anything installs, and
CI's pins lie inside the range. Pure file reading: no JAX, no install.
"""

from __future__ import annotations

import configparser
import pathlib
import re

from packaging.requirements import Requirement
from packaging.version import Version

from tests.installed_check import pins

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _setup() -> configparser.ConfigParser:
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    return setup


def _requirements(text: str) -> list[Requirement]:
    lines = (line.split("#")[0].strip() for line in text.splitlines())
    return [Requirement(line) for line in lines if line]


def _floors() -> dict[str, str]:
    """install_requires: distribution -> its floor (each entry is `name>=version`, nothing else)."""
    floors = {}
    for requirement in _requirements(_setup()["options"]["install_requires"]):
        (spec,) = requirement.specifier
        assert spec.operator == ">=", f"{requirement}: declare a floor only (>=)"
        floors[requirement.name] = spec.version
    return floors


def test_each_floor_is_the_oldest_stacks_pin():
    oldest = pins(ROOT / "constraints-py311.txt")
    unpinned = sorted(set(_floors()) - set(oldest))
    assert not unpinned, f"constraints-py311.txt pins no version of {unpinned}"
    differ = {name: (floor, oldest[name]) for name, floor in _floors().items()
              if floor != oldest[name]}
    assert not differ, f"setup.cfg floor != constraints-py311.txt pin: {differ}"


def test_ci_pins_lie_inside_the_declared_range():
    ci = pins(ROOT / "constraints.txt")
    assert set(_floors()) <= set(ci), sorted(set(_floors()) - set(ci))
    below = {name: (ci[name], floor) for name, floor in _floors().items()
             if Version(ci[name]) < Version(floor)}
    assert not below, f"constraints.txt pins below setup.cfg's floor: {below}"


def test_python_range_and_classifiers():
    setup = _setup()
    assert setup["options"]["python_requires"].strip() == ">=3.11"
    classifiers = setup["metadata"]["classifiers"]
    for version in ("3.11", "3.12"):
        assert f"Programming Language :: Python :: {version}" in classifiers


def test_the_tpu_extra_is_jax_with_libtpu_from_the_jax_floor():
    (tpu,) = _requirements(_setup()["options.extras_require"]["tpu"])
    assert (tpu.name, tpu.extras) == ("jax", {"tpu"})
    assert str(tpu.specifier) == f">={_floors()['jax']}"


def test_the_docs_name_both_stacks_as_pinned():
    """docs/quickstart.md's "Supported versions" states each stack's Python and JAX as pinned."""
    text = (ROOT / "docs" / "quickstart.md").read_text()
    section = text[text.index("### Supported versions"):]
    section = section[:section.index("\n## ")]
    for constraints, python in (("constraints-py311.txt", "3.11"), ("constraints.txt", "3.12")):
        jax = pins(ROOT / constraints)["jax"]
        assert re.search(rf"Python {python}\b[^|\n]*\|[^|\n]*\bjax {re.escape(jax)}\b", section), (
            f"docs/quickstart.md's Supported versions should give Python {python} with jax {jax} "
            f"({constraints})")


def test_make_test_runs_the_oldest_stack_check_beside_the_first_session():
    """make test-py311 runs in make test's second line of work (the gpu_compile session's), never
    in the first (the CPU session, which has no idle CPU time to spare)."""
    makefile = (ROOT / "Makefile").read_text()

    def recipe(target: str) -> str:
        match = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE)
        assert match, f"no {target} target in the Makefile"
        return match[1]

    assert "test-py311" in recipe("test-gpu-compile-session")
    assert "test-py311" not in recipe("test-cpu-session")
    assert "constraints-py311.txt" in recipe("$(PY311_STAMP)")


def test_the_private_couplings_were_checked_at_the_bottom_of_the_range():
    """paxlite/compat.py's couplings were checked under constraints-py311.txt too: a new pin there
    means running tests/test_compat.py under it again, then updating OLDEST_CHECKED_VERSIONS."""
    from paxlite import compat

    oldest = pins(ROOT / "constraints-py311.txt")
    assert {name for name, _ in compat.OLDEST_CHECKED_VERSIONS} == {
        name for name, _ in compat.CHECKED_VERSIONS}
    for name, version in compat.OLDEST_CHECKED_VERSIONS:
        assert oldest[name] == version, (
            f"constraints-py311.txt pins {name}=={oldest[name]}, but paxlite/compat.py was checked "
            f"against {version} there: run tests/test_compat.py under it, then update "
            "OLDEST_CHECKED_VERSIONS")
