"""Pax's ``ENABLE_TE`` / ``ENABLE_FP8`` environment variables, read here only: settings of the
model's layers, given by the environment rather than by --fdl.X.

Models never read the environment: this turns the two variables into TransformerConfig fields
(``layer_implementation``, ``te``) that every experiment family's model config receives. ENABLE_TE
on a machine where Transformer Engine cannot run is refused here, before the mesh, the data or the
model are built (one line, exit 2 at the command line), and so are the settings TE's layer would
silently ignore (attention switches, name-based remat policies): ``check_settings_te_ignores``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from paxlite.config.errors import ConfigError

_TRUE, _FALSE = ("1", "true"), ("0", "false", "")


def env_flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """An environment switch as Pax's scripts write it: 1/0/true/false (any case); unset is
    False."""
    environ = os.environ if environ is None else environ
    raw = environ.get(name, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"environment variable {name}={raw!r} is not valid; expected one of 0, 1, "
                      "true, false")


def check_settings_te_ignores(experiment: Any, *,
                              environ: Mapping[str, str] | None = None) -> None:
    """With ENABLE_TE=1, one ConfigError naming every hyperparameter TE's TransformerLayer would
    not read (models/te_layer.py ``settings_te_ignores``); nothing without ENABLE_TE.

    ``experiment``: a resolved LanguageModelExperiment. Called at validation, before the model
    config (whose TE fields import TE) is made, so the refusal reads the same on any machine.
    """
    if not env_flag("ENABLE_TE", environ):
        return
    from paxlite.models.te_layer import (
        NAME_BASED_REMAT_POLICIES,
        TE_ATTENTION_REASON,
        settings_te_ignores,
    )

    ignored = {field: value for field, value, _ in settings_te_ignores(
        attention_kind=experiment.ATTENTION_KIND,
        attention_implementation=experiment.ATTENTION_IMPLEMENTATION,
        remat_policy=experiment.remat_policy())}
    attention = ["USE_CUDNN_FLASH_ATTENTION=true"] if experiment.USE_CUDNN_FLASH_ATTENTION else []
    for field, hparam in (("attention_implementation", "ATTENTION_IMPLEMENTATION"),
                          ("attention_kind", "ATTENTION_KIND")):
        # a value derived from one already named (USE_CUDNN_FLASH_ATTENTION -> 'cudnn' -> 'flash')
        # is named again only when the user gave it too
        if field in ignored and (not attention or hparam in experiment.overridden):
            attention.append(f"{hparam}={ignored[field]!r}")
    problems = []
    if attention:
        problems.append(f"{', '.join(attention)} ({TE_ATTENTION_REASON}; leave ATTENTION_KIND="
                        "'dot_product', ATTENTION_IMPLEMENTATION='auto', "
                        "USE_CUDNN_FLASH_ATTENTION=false)")
    if "remat_policy" in ignored:
        names = ", ".join(sorted(p.name for p in NAME_BASED_REMAT_POLICIES))
        problems.append(f"CHECKPOINT_POLICY={experiment.CHECKPOINT_POLICY!r} (it selects tensors "
                        "by checkpoint_name tags, and TE's TransformerLayer tags none, so it would "
                        f"keep nothing; none of {names} works with TE: use SAVE_NOTHING or "
                        "SAVE_EVERYTHING)")
    if problems:
        raise ConfigError(f"ENABLE_TE=1 runs Transformer Engine's layers, which would ignore "
                          f"{experiment.name}'s " + "; ".join(problems) + "; or set ENABLE_TE=0")


def transformer_engine_fields(*, native_fp8: bool = False,
                              environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """TransformerConfig fields for ENABLE_TE / ENABLE_FP8 ({} when TE is off).

    ``native_fp8`` is the experiment's USE_FP8 (XLA's FP8 matmuls), which TE layers do not use.
    """
    from paxlite.models.te_config import TransformerEngineConfig
    from paxlite.models.te_layer import import_transformer_engine
    from paxlite.models.transformer_config import LayerImplementation

    enable_te = env_flag("ENABLE_TE", environ)
    enable_fp8 = env_flag("ENABLE_FP8", environ)
    if enable_fp8 and not enable_te:
        raise ConfigError("ENABLE_FP8=1 is Transformer Engine's FP8 and needs ENABLE_TE=1; for "
                          "XLA's native FP8 without TE use --fdl.USE_FP8=True")
    if not enable_te:
        return {}
    if native_fp8:
        raise ConfigError("ENABLE_TE=1 with --fdl.USE_FP8=True: TE layers do their own FP8; use "
                          "ENABLE_FP8=1 with TE, or USE_FP8=True with ENABLE_TE=0")
    import_transformer_engine()  # one clear error without a GPU / TE, before expensive work
    return {"layer_implementation": LayerImplementation.TRANSFORMER_ENGINE,
            "te": TransformerEngineConfig(fp8=enable_fp8)}
