"""tests/gpu_pass.py, the GPU pass of `make test` and of benchmarks/gpu/run.sh: it names every file
that has a `gpu` test, both callers run it, and its pytest keeps the files in the order it gives
them."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

from tests import gpu_pass

REPO = pathlib.Path(gpu_pass.REPO)
_GPU_MARK = re.compile(r"pytest\.mark\.gpu\b")


def test_every_file_with_a_gpu_test_is_in_the_gpu_pass_and_only_those():
    marked = sorted(str(path.relative_to(REPO)) for path in (REPO / "tests").rglob("test_*.py")
                    if _GPU_MARK.search(path.read_text()))
    assert marked, "no gpu-marked test found: the pattern no longer matches how tests are marked"
    assert sorted(gpu_pass.GPU_TEST_FILES) == marked
    assert len(set(gpu_pass.GPU_TEST_FILES)) == len(gpu_pass.GPU_TEST_FILES)


def test_make_test_and_the_gpu_script_run_the_gpu_pass():
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile.split("\ntest: ", 1)[1].split("\n\n", 1)[0]
    assert "tests/gpu_pass.py" in recipe, recipe
    script = (REPO / "benchmarks" / "gpu" / "run.sh").read_text()
    commands = [line for line in script.splitlines() if not line.lstrip().startswith("#")]
    assert any("tests/gpu_pass.py" in line for line in commands)
    assert not any(re.search(r"pytest .*tests/test_gpu\.py", line) for line in commands)


def test_without_a_gpu_it_says_so_and_succeeds(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    assert gpu_pass.main([]) == 0
    assert "no NVIDIA GPU" in capsys.readouterr().out


def test_a_driver_that_lists_a_gpu_is_seen(monkeypatch, tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpu_pass.has_gpu()
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed'\nexit 9\n")
    assert not gpu_pass.has_gpu()


def test_the_pass_keeps_its_order_and_compiles_without_the_cpu_only_flags():
    env = gpu_pass.environment({k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    env["JAX_PLATFORMS"] = "cpu"  # collection only: no GPU needed
    code = ("import os, sys; import tests.conftest; "
            "sys.exit(pytest.main(['--collect-only', '-q', '-m', 'gpu', '-p', 'no:cacheprovider', "
            "*sys.argv[1:]]))")
    done = subprocess.run(
        [sys.executable, "-c", "import pytest; " + code, *gpu_pass.GPU_TEST_FILES],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    files = []
    for line in done.stdout.splitlines():
        if "::" in line:
            name = line.split("::", 1)[0]
            if not files or files[-1] != name:
                files.append(name)
    assert files == list(gpu_pass.GPU_TEST_FILES)
    flags = subprocess.run(
        [sys.executable, "-c", "import tests.conftest, os; print(os.environ['XLA_FLAGS'])"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    assert "xla_backend_optimization_level" not in flags, flags
