"""docker/Dockerfile, .dockerignore and docker/pin_image_stack.py, checked without a Docker daemon
(CI has none)."""

import importlib.util
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# docker/ is not a package: the image runs the script by its path, so the tests load it the same way
_SPEC = importlib.util.spec_from_file_location(
    "pin_image_stack", ROOT / "docker" / "pin_image_stack.py"
)
pins = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(pins)


def instructions(text: str) -> list[tuple[str, str]]:
    """[(INSTRUCTION, arguments)] with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        word, _, rest = pending.strip().partition(" ")
        out.append((word.upper(), " ".join(rest.split())))
        pending = ""
    return out


@pytest.fixture(scope="module")
def dockerfile():
    return instructions((ROOT / "docker" / "Dockerfile").read_text())


def _all(dockerfile, word):
    return [args for w, args in dockerfile if w == word]


def _env(dockerfile) -> dict[str, str]:
    env = {}
    for args in _all(dockerfile, "ENV"):
        env.update(item.split("=", 1) for item in shlex.split(args))
    return env


def test_instruction_parser_joins_continuations_and_drops_comments():
    parsed = instructions("# c\nFROM a:1\nENV A=1 \\\n    B=2\n\nRUN x \\\n && y\n")
    assert parsed == [("FROM", "a:1"), ("ENV", "A=1 B=2"), ("RUN", "x && y")]


def test_base_is_a_tagged_ngc_jax_image(dockerfile):
    assert dockerfile[0][0] == "ARG" and dockerfile[1][0] == "FROM"
    name, default = dockerfile[0][1].split("=", 1)
    assert dockerfile[1][1] == "${" + name + "}"
    assert re.fullmatch(r"nvcr\.io/nvidia/jax:\d\d\.\d\d-py3", default), default
    assert len(_all(dockerfile, "FROM")) == 1


def test_workdir_workspace_and_the_checkout(dockerfile):
    assert _all(dockerfile, "WORKDIR") == ["/opt/paxlite"]
    assert "COPY . /opt/paxlite" in [f"COPY {a}" for a in _all(dockerfile, "COPY")]
    runs = " && ".join(_all(dockerfile, "RUN"))
    assert "mkdir -p /opt/paxlite/workspace" in runs or "/opt/paxlite/workspace" in " ".join(
        _all(dockerfile, "VOLUME"))


def test_environment_as_rosettas_image(dockerfile):
    env = _env(dockerfile)
    assert (env["ENABLE_TE"], env["NVTE_FUSED_ATTN"], env["NCCL_NVLS_ENABLE"]) == ("1", "1", "0")


def test_install_keeps_the_images_jax_and_uses_our_constraints(dockerfile):
    (run,) = [r for r in _all(dockerfile, "RUN") if "pip install" in r]
    steps = [s.strip() for s in run.split("&&")]
    write = next(i for i, s in enumerate(steps) if "pin_image_stack.py write" in s)
    install = next(i for i, s in enumerate(steps) if s.startswith("pip install"))
    verify = next(i for i, s in enumerate(steps) if "pin_image_stack.py verify" in s)
    assert write < install < verify
    _, _, source, merged = shlex.split(steps[write])[1:]
    assert source == "constraints.txt" and (ROOT / source).is_file()
    argv = shlex.split(steps[install])
    assert argv[argv.index("-c") + 1] == merged == shlex.split(steps[verify])[-1]
    assert "--no-cache-dir" in argv
    target = argv[-1]
    path, extras = re.fullmatch(r"(/[\w/]+)\[([\w,]+)\]", target).groups()
    assert (
        path == _all(dockerfile, "WORKDIR")[0]
        and argv[argv.index(path + f"[{extras}]") - 1] == "-e"
    )
    # seqio and eval from setup.cfg; not `gpu` (jax[cuda12]): the image's CUDA JAX is what that
    # extra provides
    assert set(extras.split(",")) == {"seqio", "eval"}
    assert re.search(r"^seqio =", (ROOT / "setup.cfg").read_text(), re.MULTILINE)
    assert re.search(r"^eval =\n    lm_eval", (ROOT / "setup.cfg").read_text(), re.MULTILINE)
    assert re.search(r"^gpu =\n    jax\[cuda12\]", (ROOT / "setup.cfg").read_text(), re.MULTILINE)


# ------------------------------------------------------------------------------ .dockerignore
def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule, enough for our file: a pattern excludes a path or any directory above it; `*`
    stays within one path element, `**` spans any number; a later `!pattern` re-includes."""
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        regex = (
            re.escape(pattern.lstrip("!").strip("/"))
            .replace(r"\*\*/", "(.*/)?")
            .replace(r"\*\*", ".*")
        )
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        parts = path.split("/")
        if any(re.fullmatch(regex, "/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            excluded = not negate
    return excluded


@pytest.fixture(scope="module")
def ignore_patterns():
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def test_ignore_matcher_follows_dockers_rules():
    assert _ignored("a/b/__pycache__/x.pyc", ["**/__pycache__"])
    assert _ignored("build/lib/x.py", ["build"]) and not _ignored("paxlite/build.py", ["build"])
    assert _ignored("job_7/config.json", ["job_*"]) and not _ignored("tests/job_7", ["job_*"])
    assert not _ignored("keep", ["*", "!keep"])


@pytest.mark.parametrize(
    "path",
    [
        ".venv/bin/python",
        ".git/HEAD",
        "build/lib/paxlite/main.py",
        "demo_job/20261201-000000/config.json",
        "job_pile/checkpoints/x",
        "workspace/log_dir/metrics.jsonl",
        "output/output-1-n-0.txt",
        "paxlite/__pycache__/main.cpython-312.pyc",
        "paxlite.egg-info/PKG-INFO",
    ],
)
def test_dockerignore_leaves_out_environments_and_job_directories(ignore_patterns, path):
    assert _ignored(path, ignore_patterns)


@pytest.mark.parametrize(
    "path",
    [
        "constraints.txt",
        "setup.cfg",
        "pyproject.toml",
        "README.md",
        "docker/pin_image_stack.py",
        "paxlite/main.py",
        "scripts_gpu/common.sh",
        "slurm/example_slurm_pile.sub",
        "k8s/indexed-job.yaml",
    ],
)
def test_dockerignore_keeps_what_the_image_needs(ignore_patterns, path):
    assert (ROOT / path).exists() and not _ignored(path, ignore_patterns)


# ------------------------------------------------------------------------------ pin_image_stack.py
NGC = {"jax": "0.12.1.dev20261103+ngc", "jaxlib": "0.12.1.dev20261103+ngc",
       "jax-cuda13-plugin": "0.12.1.dev20261103+ngc", "jax-cuda13-pjrt": "0.12.1.dev20261103+ngc",
       "transformer-engine": "2.21.0+0a1b2c3", "flax": "0.12.10", "numpy": "2.3.5"}


@pytest.mark.parametrize("change, python, message", [
    ({}, (3, 11), "Python 3.11; paxlite needs >= 3.12"),
    ({"jax": "0.11.2"}, (3, 12), "jax 0.11.2; paxlite needs jax >= 0.12"),
    # PEP 440
    ({"jax": "0.12.0.dev20260901"}, (3, 12), "jax 0.12.0.dev20260901; paxlite needs jax >= 0.12"),
    ({"jax-cuda13-plugin": None}, (3, 12), "no CUDA plugin"),
    ({"transformer-engine": None}, (3, 12), "no Transformer Engine"),
    ({"jaxlib": None}, (3, 12), "not a JAX image"),
])
def test_check_base_refuses_what_paxlite_cannot_use(change, python, message):
    installed = {k: v for k, v in {**NGC, **change}.items() if v is not None}
    with pytest.raises(pins.BaseImageError, match=re.escape(message)):
        pins.check_base(installed, python=python)


def test_check_base_accepts_an_ngc_like_image():
    pins.check_base(NGC, python=(3, 12))
    pins.check_base({**NGC, "jax": "0.12.0"}, python=(3, 13))


def test_merged_constraints_pin_the_images_stack_and_keep_the_rest():
    ours = (ROOT / "constraints.txt").read_text()
    stack = pins.image_stack(NGC)
    assert stack == {k: v for k, v in NGC.items() if k not in ("flax", "numpy")}
    merged = pins.merged_constraints(ours, stack)
    lines = merged.splitlines()
    assert "jax==0.12.1.dev20261103+ngc" in lines and "transformer-engine==2.21.0+0a1b2c3" in lines
    assert "jax==0.12.0.1" in ours.splitlines() and "jax==0.12.0.1" not in lines
    assert not any(line.startswith("jaxlib==0.12.0.1") for line in lines)
    # every other line of ours is kept, in order; flax/numpy stay at our pins (not TE-compiled
    # parts)
    expected = [line for line in ours.splitlines() if not re.match(r"^(jax|jaxlib)==", line)]
    assert lines[:len(expected)] == expected and "flax==0.12.12" in lines
    assert pins.read_pins(merged) == stack


def test_changed_names_what_pip_replaced():
    stack = pins.image_stack(NGC)
    assert pins.changed(stack, NGC) == []
    after = {**NGC, "jaxlib": "0.12.0.1"}
    del after["transformer-engine"]
    assert pins.changed(stack, after) == ["jaxlib 0.12.1.dev20261103+ngc -> 0.12.0.1",
                                          "transformer-engine 2.21.0+0a1b2c3 -> removed"]


def _fake_site(root: pathlib.Path, versions: dict[str, str]) -> str:
    for name, version in versions.items():
        info = root / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return str(root)


def test_script_writes_then_verifies_in_an_image_like_environment(tmp_path):
    """The two commands the Dockerfile runs, with distributions that shadow this venv's as the
    image's would."""
    script = str(ROOT / "docker" / "pin_image_stack.py")
    stack = {k: v for k, v in NGC.items() if k not in ("flax", "numpy")}

    def run(*args, site):
        env = {**os.environ, "PYTHONPATH": site}
        return subprocess.run(
            [sys.executable, script, *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )

    site = _fake_site(tmp_path / "site", stack)
    out = tmp_path / "image-constraints.txt"
    written = run("write", str(ROOT / "constraints.txt"), str(out), site=site)
    assert written.returncode == 0, written.stderr
    assert "jax==0.12.1.dev20261103+ngc" in written.stdout
    assert {k: v for k, v in pins.read_pins(out.read_text()).items() if k in stack} == stack
    assert run("verify", str(out), site=site).returncode == 0

    replaced = _fake_site(tmp_path / "replaced", {**stack, "jaxlib": "0.12.0.1"})
    failed = run("verify", str(out), site=replaced)
    assert failed.returncode == 1 and "jaxlib 0.12.1.dev20261103+ngc -> 0.12.0.1" in failed.stderr

    old = _fake_site(tmp_path / "old", {**stack, "jax": "0.11.2"})
    refused = run("write", str(ROOT / "constraints.txt"), str(tmp_path / "x.txt"), site=old)
    assert (
        refused.returncode == 2
        and refused.stderr.count("\n") == 1
        and "jax 0.11.2" in refused.stderr
    )


def test_docs_name_the_dockerfiles_base_and_environment(dockerfile):
    docs = (ROOT / "docs" / "container.md").read_text()
    base = dockerfile[0][1].split("=", 1)[1]
    assert f"`{base}`" in docs
    for name, value in _env(dockerfile).items():
        assert f"| `{name}` | `{value}` |" in docs, name
