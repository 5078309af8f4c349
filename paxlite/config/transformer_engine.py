"""Pax's ``ENABLE_TE`` / ``ENABLE_FP8`` environment variables, read here (the config layer) only.

Models never read the environment: this turns the two variables into TransformerConfig fields
(``layer_implementation``, ``te``) that every experiment family's model config receives. ENABLE_TE
on a machine where Transformer Engine cannot run is refused here, before the mesh, the data or the
model are built (one line, exit 2 at the command line).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from paxlite.config.errors import ConfigError

_TRUE, _FALSE = ("1", "true"), ("0", "false", "")


def env_flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """An environment switch as Pax's scripts write it: 1/0/true/false (any case); unset is False."""
    environ = os.environ if environ is None else environ
    raw = environ.get(name, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"environment variable {name}={raw!r} is not valid; expected one of 0, 1, "
                      "true, false")


def transformer_engine_fields(*, native_fp8: bool = False,
                              environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """TransformerConfig fields for ENABLE_TE / ENABLE_FP8 ({} when TE is off).

    ``native_fp8`` is the experiment's USE_FP8 (XLA's FP8 matmuls), which TE layers do not use.
    """
    from paxlite.models.te_layer import import_transformer_engine
    from paxlite.models.transformer_config import LayerImplementation, TransformerEngineConfig

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
