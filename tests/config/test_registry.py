"""--fdl_config resolution: short names, dotted paths, legacy Pax names, and their errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from paxlite.config.errors import ConfigError
from paxlite.config.experiment import Experiment
from paxlite.config.registry import legacy_pax_name, resolve_experiment


class Pile126M(Experiment):
    NUM_LAYERS = 12


class Pile5B(Experiment):
    NUM_LAYERS = 24


class LLaMA7B(Experiment):
    NUM_LAYERS = 32


REGISTRY: dict[str, type[Experiment]] = {"Pile126M": Pile126M, "Pile5B": Pile5B,
                                         "LLaMA7B": LLaMA7B}
NOT_AN_EXPERIMENT = 42


def test_short_name() -> None:
    assert resolve_experiment("Pile126M", REGISTRY) is Pile126M
    assert resolve_experiment("  LLaMA7B ", REGISTRY) is LLaMA7B


@pytest.mark.parametrize(
    "name",
    [
        "paxml.contrib.gpu.scripts_gpu.configs.Pile126M",
        "paxml.tasks.lm.params.nvidia.Pile126M",
        "praxis.anything.Pile126M",
    ],
)
def test_legacy_pax_names(name: str) -> None:
    assert legacy_pax_name(name) == "Pile126M"
    assert resolve_experiment(name, REGISTRY) is Pile126M


def test_legacy_pax_name_helper() -> None:
    assert legacy_pax_name("paxlite.experiments.gpt.Pile126M") is None
    assert legacy_pax_name("Pile126M") is None
    assert legacy_pax_name("paxml.") is None
    assert legacy_pax_name("paxmlx.configs.A") is None


def test_legacy_name_not_registered() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_experiment("paxml.contrib.gpu.scripts_gpu.configs.Pile126m", REGISTRY)
    text = str(info.value)
    assert "legacy Pax name" in text and "'Pile126m' is not registered" in text
    assert "(did you mean 'Pile126M'?)" in text


def test_dotted_path_to_this_module() -> None:
    assert resolve_experiment(f"{__name__}.Pile5B", {}) is Pile5B
    assert resolve_experiment("paxlite.config.experiment.Experiment", REGISTRY) is Experiment


def test_dotted_path_to_non_experiment() -> None:
    with pytest.raises(ConfigError, match=r"a class \(paxlite.config.errors.ConfigError\), not a "
                                          r"subclass of paxlite.config.experiment.Experiment"):
        resolve_experiment("paxlite.config.errors.ConfigError", REGISTRY)
    with pytest.raises(ConfigError, match=r"a function \('did_you_mean'\), not a subclass"):
        resolve_experiment("paxlite.config.errors.did_you_mean", REGISTRY)
    with pytest.raises(ConfigError, match=r"an int \(42\), not a subclass"):
        resolve_experiment(f"{__name__}.NOT_AN_EXPERIMENT", REGISTRY)


def test_dotted_path_missing_attribute_suggests() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_experiment(f"{__name__}.Pile5b", REGISTRY)
    assert "has no attribute 'Pile5b'" in str(info.value)
    assert "did you mean 'Pile5B'" in str(info.value)


def test_unimportable_module() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_experiment("no_such_package.configs.Pile126M", REGISTRY)
    text = str(info.value)
    assert "no module 'no_such_package.configs' can be imported" in text
    assert "(did you mean 'Pile126M'?)" in text


def test_module_with_broken_import_is_reported(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cfg_missing_dep.py").write_text("import no_such_dependency_xyz\n")
    (tmp_path / "cfg_raises.py").write_text("raise RuntimeError('bad config module')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="importing cfg_missing_dep failed: .*no_such_dependency"):
        resolve_experiment("cfg_missing_dep.Exp", REGISTRY)
    with pytest.raises(ConfigError, match="importing cfg_raises failed: RuntimeError: bad config"):
        resolve_experiment("cfg_raises.Exp", REGISTRY)


def test_user_module_experiment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_experiments.py").write_text(
        "from paxlite.experiments.base import TransformerLmSettings\n"
        "class Mine(TransformerLmSettings):\n"
        "    NUM_LAYERS = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    found = resolve_experiment("my_experiments.Mine", REGISTRY)
    assert found.__name__ == "Mine" and found.resolve().NUM_LAYERS == 3


@pytest.mark.parametrize(
    ("name", "suggestion"),
    [("pile126m", "'Pile126M'"), ("PILE5B", "'Pile5B'"), ("Pile126", "'Pile126M'"),
     ("llama7b", "'LLaMA7B'")],
)
def test_unknown_short_name_suggests_case_insensitively(name: str, suggestion: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_experiment(name, REGISTRY)
    text = str(info.value)
    assert f"--fdl_config={name}: unknown experiment (did you mean {suggestion}" in text


def test_unknown_name_without_close_match() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_experiment("Zebra", REGISTRY)
    assert "did you mean" not in str(info.value)
    assert "python -m paxlite list" in str(info.value)


def test_empty_name() -> None:
    for name in ("", "   "):
        with pytest.raises(ConfigError, match="--fdl_config is required"):
            resolve_experiment(name, REGISTRY)
