"""Install paxlite into an NGC JAX image without replacing the JAX build its Transformer Engine was made for.

The image's jaxlib, its CUDA plugin (jax-cuda12/13-plugin and -pjrt) and Transformer Engine's JAX extension
were built together: TE's extension is compiled against that jaxlib's XLA FFI headers and the image's CUDA
and cuDNN. Installing paxlite's constraints.txt as it is would swap PyPI's jax/jaxlib in under a TE built
for another one (a mismatch found only when a TE kernel runs on a GPU), and paxlite's `gpu` extra
(`jax[cuda12]`) would add PyPI's CUDA 12 plugin and CUDA 12 libraries beside the image's own CUDA JAX. So
the Dockerfile installs paxlite without the `gpu` extra (the image *is* a CUDA JAX) under a constraints
file in which the image's versions of those distributions replace our pins, and checks afterwards that pip
changed none of them.

    python docker/pin_image_stack.py write constraints.txt OUT   # check the base image, write OUT
    python docker/pin_image_stack.py verify OUT                  # after pip install: the stack is unchanged

Runs under the image's Python before paxlite is installed, so it needs only the standard library (and
`packaging`, or pip's vendored copy of it, for PEP 440 versions).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
from collections.abc import Mapping

MIN_PYTHON = (3, 12)
MIN_JAX = "0.12"
# Distributions the image's TE build depends on, by normalised name (PEP 503).
STACK = re.compile(r"^(jax|jaxlib|jax-cuda\d+-(plugin|pjrt)|transformer-engine(-.+)?|nvidia-.+)$")
HOW_TO_FIX = ("pick another base: docker build --build-arg BASE_IMAGE=nvcr.io/nvidia/jax:<yy.mm>-py3 "
              "(docs/container.md)")


class BaseImageError(Exception):
    """The base image cannot carry paxlite: one line saying what it lacks."""


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _version(text: str):
    try:
        from packaging.version import Version
    except ImportError:  # pip is always there; its vendored packaging is the same code
        from pip._vendor.packaging.version import Version
    return Version(text)


def installed_versions() -> dict[str, str]:
    """Normalised distribution name -> version of everything importlib.metadata sees (editable installs too)."""
    versions: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            versions.setdefault(normalise(name), dist.version)
    return versions


def image_stack(installed: Mapping[str, str]) -> dict[str, str]:
    """The image's JAX/CUDA/TE distributions and their versions, to be kept as they are."""
    return {name: version for name, version in sorted(installed.items()) if STACK.match(name)}


def check_base(installed: Mapping[str, str], *, python: tuple[int, ...] = tuple(sys.version_info[:2])) -> None:
    """Refuse a base image paxlite cannot use, before pip runs (BaseImageError naming what is missing)."""
    if python < MIN_PYTHON:
        raise BaseImageError(f"base image has Python {'.'.join(map(str, python))}; paxlite needs >= "
                             f"{'.'.join(map(str, MIN_PYTHON))} (NGC JAX images have 3.12 since 24.10): {HOW_TO_FIX}")
    if "jax" not in installed or "jaxlib" not in installed:
        raise BaseImageError(f"base image has no jax/jaxlib installed: it is not a JAX image; {HOW_TO_FIX}")
    if _version(installed["jax"]) < _version(MIN_JAX):
        raise BaseImageError(f"base image has jax {installed['jax']}; paxlite needs jax >= {MIN_JAX}: {HOW_TO_FIX}")
    if not any(re.match(r"^jax-cuda\d+-plugin$", name) for name in installed):
        raise BaseImageError("base image's JAX has no CUDA plugin (jax-cuda12-plugin or jax-cuda13-plugin): "
                             f"it is a CPU JAX; {HOW_TO_FIX}")
    if not any(name.startswith("transformer-engine") for name in installed):
        raise BaseImageError("base image has no Transformer Engine (ENABLE_TE=1 is this image's default and "
                             f"TE's JAX extension has no PyPI wheel); {HOW_TO_FIX}")


def requirement_name(line: str) -> str | None:
    """The distribution a constraints line pins ('jax==0.12.0.1  # why' -> 'jax'); None for comments."""
    line = line.split("#", 1)[0].strip()
    match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)", line)
    return normalise(match.group(1)) if match else None


def merged_constraints(ours: str, stack: Mapping[str, str]) -> str:
    """constraints.txt with the image's stack pinned at the image's versions in place of our pins."""
    kept = [line for line in ours.splitlines() if requirement_name(line) not in stack]
    pins = [f"{name}=={version}" for name, version in stack.items()]
    return "\n".join(kept + ["# the base image's own JAX / CUDA / Transformer Engine build, kept as it is"] + pins) + "\n"


def changed(pinned: Mapping[str, str], installed: Mapping[str, str]) -> list[str]:
    """'name old -> new' for each stack distribution pip replaced or removed."""
    return [f"{name} {version} -> {installed.get(name, 'removed')}" for name, version in pinned.items()
            if installed.get(name) != version]


def read_pins(text: str) -> dict[str, str]:
    """The image pins merged_constraints wrote (the lines after its marker comment)."""
    pins = text.split("# the base image's own", 1)[1].splitlines()[1:]
    return {normalise(line.split("==", 1)[0]): line.split("==", 1)[1] for line in pins if "==" in line}


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[1] == "write":
        installed = installed_versions()
        try:
            check_base(installed)
        except BaseImageError as error:
            print(f"paxlite image: error: {error}", file=sys.stderr)
            return 2
        stack = image_stack(installed)
        with open(argv[2]) as f:
            text = merged_constraints(f.read(), stack)
        with open(argv[3], "w") as f:
            f.write(text)
        print("paxlite image: keeping the base image's " + ", ".join(f"{n}=={v}" for n, v in stack.items()
                                                                    if not n.startswith("nvidia-")))
        return 0
    if len(argv) == 3 and argv[1] == "verify":
        with open(argv[2]) as f:
            problems = changed(read_pins(f.read()), installed_versions())
        if problems:
            print("paxlite image: error: pip replaced the base image's JAX/TE build: " + "; ".join(problems),
                  file=sys.stderr)
            return 1
        return 0
    print("usage: pin_image_stack.py write CONSTRAINTS OUT | verify OUT", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
