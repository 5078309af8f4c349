"""The rules of the house (docs/architecture.md): the import contracts hold, and each one bites.

`make lint` runs `lint-imports` over the contracts in pyproject.toml. Here the same contracts run on
the real tree, and on copies of it with one forbidden import added, so that a contract which could
never fail (a typo in a module name, a rule that covers nothing) fails this test instead.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINT_IMPORTS = os.path.join(os.path.dirname(sys.executable), "lint-imports")
HEAVY_EXTRAS = ("tensorflow", "seqio", "tensorflow_datasets", "torch", "transformers",
                "transformer_engine", "wandb")


def _lint_imports(tree: str) -> subprocess.CompletedProcess:
    # PYTHONPATH first, so the tree under test shadows the editable install of the checkout.
    env = {**os.environ, "PYTHONPATH": tree}
    return subprocess.run(
        [LINT_IMPORTS, "--no-cache", "--config", os.path.join(tree, "pyproject.toml")],
        cwd=tree, env=env, capture_output=True, text=True, timeout=300, check=False,
    )


def _broken_section(output: str) -> str:
    _, sep, broken = output.partition("Broken contracts")
    return broken if sep else ""


def test_the_tree_keeps_every_contract():
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    "path, line, contract, importer",
    [
        ("paxlite/data/jsonl.py", "import paxlite.eval.lambada", "Data flows one way",
         "paxlite.data.jsonl -> paxlite.eval.lambada"),
        ("paxlite/models/lora.py", "import paxlite.models.transformer", "No circles",
         "No cycles are allowed in paxlite.models."),
        ("paxlite/config/values.py", "import paxlite.config.experiment", "No circles",
         "No cycles are allowed in paxlite.config."),
        ("paxlite/train/loop.py", "import paxlite.experiments.gpt", "train/ never knows",
         "paxlite.train.loop -> paxlite.experiments.gpt"),
        ("paxlite/interop/hf.py", "import paxlite.experiments.build", "Layers",
         "paxlite.interop.hf -> paxlite.experiments.build"),
        ("paxlite/models/norms.py", "import paxlite.data.tokenizer", "models/ imports nothing",
         "paxlite.models.norms -> paxlite.data.tokenizer"),
        ("paxlite/experiments/gpt.py", "import optax", "experiments/ only describe",
         "paxlite.experiments.gpt -> optax"),
        ("paxlite/data/packing.py", "import tensorflow", "TensorFlow/SeqIO",
         "paxlite.data.packing -> tensorflow"),
    ],
)
def test_each_contract_breaks_on_a_forbidden_import(tmp_path, path, line, contract, importer):
    tree = tmp_path / "tree"
    shutil.copytree(os.path.join(ROOT, "paxlite"), tree / "paxlite",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), tree / "pyproject.toml")
    with open(tree / path, "a") as f:
        f.write(f"\n{line}  # added by the test\n")
    result = _lint_imports(str(tree))
    assert result.returncode == 1, result.stdout + result.stderr
    broken = _broken_section(result.stdout)
    assert contract in broken, result.stdout
    assert importer in broken, result.stdout


def test_importing_every_module_loads_no_heavy_extra():
    """docs/architecture.md: optional heavy dependencies load only on the path that needs them (the
    contract above says where they are imported; this, that importing paxlite runs none of it)."""
    code = (
        "import importlib, json, pkgutil, sys\n"
        "import paxlite\n"
        "names = [m.name for m in pkgutil.walk_packages(paxlite.__path__, 'paxlite.')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        f"loaded = sorted(k for k in {HEAVY_EXTRAS!r} if k in sys.modules)\n"
        "print(json.dumps([len(names), loaded]))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    num_modules, loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert num_modules > 50  # every module of the package was imported, not an empty walk
    assert loaded == []


def test_the_command_line_parses_before_jax_is_imported():
    """`python -m paxlite plan` sets its fake device count before JAX starts, and the `convert`
    parser is built for every subcommand: neither may pull in JAX or NumPy at import."""
    code = ("import json, sys\nimport paxlite.__main__, paxlite.cli.convert\n"
            "print(json.dumps(sorted(m for m in ('jax', 'numpy', 'flax') if m in sys.modules)))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


MAX_MODULE_LINES = 500  # docs/architecture.md: a module a reader can hold in mind


def _long_modules(root: str) -> dict[str, int]:
    found = {}
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    lines = sum(1 for _ in f)
                if lines > MAX_MODULE_LINES:
                    found[os.path.relpath(path, ROOT)] = lines
    return found


def test_every_module_stays_under_the_line_limit(tmp_path):
    assert _long_modules(os.path.join(ROOT, "paxlite")) == {}
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert list(_long_modules(str(tmp_path)).values()) == [MAX_MODULE_LINES + 1]
