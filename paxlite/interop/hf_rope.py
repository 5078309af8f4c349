"""RoPE in Hugging Face ``config.json``: its base and frequency scaling in either form.

transformers 4.x writes a top-level ``rope_theta`` and ``rope_scaling`` (``{"rope_type":
"llama3", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}``,
whose kind older files spell ``type``); 5.x one ``rope_parameters`` object holding all of them.
Both are read; a kind paxlite does not implement (linear, dynamic, yarn, longrope, ...) is one
error naming the field and its value, never a model with plain RoPE in its place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from paxlite.interop.errors import UnsupportedCheckpointError, refuse_if
from paxlite.models.rotary import RopeScaling, RopeScalingKind
from paxlite.models.transformer_config import TransformerConfig

DEFAULT_ROPE_THETA: float = 10000.0


_LLAMA3_FIELDS: tuple[str, ...] = (
    "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope_scaling_of(field: str, params: Mapping[str, Any]) -> RopeScaling | None:
    """The scaling of one rope object (4.x ``rope_scaling`` or 5.x ``rope_parameters``)."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return None
    supported = ", ".join(repr(k.value) for k in RopeScalingKind)
    refuse_if(rope_type not in {k.value for k in RopeScalingKind}, field, dict(params),
               f"rope_type {rope_type!r} is not one paxlite implements (plain RoPE, 'default', "
               f"and {supported})")
    missing = [name for name in _LLAMA3_FIELDS if params.get(name) is None]
    if missing:
        raise UnsupportedCheckpointError(
            f"config.json {field} (rope_type={rope_type!r}) has no {', '.join(missing)}")
    try:
        return RopeScaling(kind=RopeScalingKind(rope_type), factor=float(params["factor"]),
                           low_freq_factor=float(params["low_freq_factor"]),
                           high_freq_factor=float(params["high_freq_factor"]),
                           original_max_position_embeddings=int(
                               params["original_max_position_embeddings"]))
    except ValueError as error:
        raise UnsupportedCheckpointError(f"config.json {field}: {error}") from None


def rope_of(hf: Mapping[str, Any], *, default: float = DEFAULT_ROPE_THETA
            ) -> tuple[float, RopeScaling | None]:
    """(RoPE base, frequency scaling) from either spelling: 5.x ``rope_parameters``, else 4.x's
    top-level ``rope_theta`` and ``rope_scaling`` (whose kind older files spell ``type``)."""
    theta = default if hf.get("rope_theta") is None else float(hf["rope_theta"])
    scaling = None
    for field, holds in (("rope_scaling", "rope_type"), ("rope_parameters", "rope_theta")):
        params = hf.get(field)  # 5.x's rope_parameters, read last, wins
        if params is None:
            continue
        if not isinstance(params, Mapping):
            raise UnsupportedCheckpointError(
                f"config.json {field}={params!r} must be null or an object holding {holds}")
        scaling = _rope_scaling_of(field, params)
        if params.get("rope_theta") is not None:
            theta = float(params["rope_theta"])
    return theta, scaling


def rope_theta_of(hf: Mapping[str, Any], *, default: float = DEFAULT_ROPE_THETA) -> float:
    """RoPE base from either spelling; refuses any RoPE scaling (for layouts without it)."""
    theta, scaling = rope_of(hf, default=default)
    refuse_if(scaling is not None, "rope_scaling", scaling,
               "this model type converts with unscaled RoPE only")
    return theta


def rope_fields(config: TransformerConfig) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(5.x ``rope_parameters``, 4.x ``rope_scaling``) of a model: the latter None without
    scaling, else the same scaling fields without ``rope_theta`` (4.x writes that at the top)."""
    theta = float(config.rope_theta)
    scaling = config.rope_scaling
    if scaling is None:
        return {"rope_type": "default", "rope_theta": theta}, None
    legacy = {"rope_type": scaling.kind.value, "factor": float(scaling.factor),
              "low_freq_factor": float(scaling.low_freq_factor),
              "high_freq_factor": float(scaling.high_freq_factor),
              "original_max_position_embeddings": scaling.original_max_position_embeddings}
    return {**legacy, "rope_theta": theta}, legacy
