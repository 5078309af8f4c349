"""RoPE in Hugging Face ``config.json``: its base and frequency scaling in either form.

transformers 4.x writes a top-level ``rope_theta`` and ``rope_scaling`` (``{"rope_type":
"llama3", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}``,
whose kind older files spell ``type``); 5.x one ``rope_parameters`` object holding all of them.
Both are read; a kind paxlite does not implement for the model type (dynamic, longrope, ...;
'linear' for Gemma only, 'yarn' for the types that pass it in ``kinds``) is one error naming
the field and its value, never a model with plain RoPE in its place. Gemma 3's per-layer-type
``rope_parameters`` are read in hf_gemma.py, one entry at a time through `rope_of_entry`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from paxlite.interop.errors import UnsupportedCheckpointError, refuse_if
from paxlite.models.rotary import RopeScaling, RopeScalingKind
from paxlite.models.transformer_config import TransformerConfig

DEFAULT_ROPE_THETA: float = 10000.0


# The fields each scaling kind reads (config.json's names, RopeScaling's too).
_KIND_FIELDS: Mapping[RopeScalingKind, tuple[str, ...]] = {
    RopeScalingKind.LLAMA3: ("factor", "low_freq_factor", "high_freq_factor",
                             "original_max_position_embeddings"),
    RopeScalingKind.LINEAR: ("factor",),
    RopeScalingKind.YARN: ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                           "mscale", "mscale_all_dim", "attention_factor", "truncate"),
}
LLAMA3_ONLY: tuple[RopeScalingKind, ...] = (RopeScalingKind.LLAMA3,)
YARN_ONLY: tuple[RopeScalingKind, ...] = (RopeScalingKind.YARN,)
# YaRN's fields a file may leave out: RopeScaling's defaults (transformers') or None stand in;
# a missing original context is filled in as transformers does (`_yarn_context`).
_YARN_OPTIONAL = frozenset({"beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                            "attention_factor", "truncate"})


def _yarn_context(params: Mapping[str, Any], hf: Mapping[str, Any] | None) -> dict[str, Any]:
    """YaRN's original context as transformers fills it in: a top-level
    ``original_max_position_embeddings`` when the file has one, else the rope object's, else
    ``max_position_embeddings``."""
    hf = hf or {}
    for original in (hf.get("original_max_position_embeddings"),
                     params.get("original_max_position_embeddings")):
        if original is not None:
            return {"original_max_position_embeddings": original}
    return {"original_max_position_embeddings": hf.get("max_position_embeddings")}


def _rope_scaling_of(field: str, params: Mapping[str, Any],
                     kinds: Collection[RopeScalingKind],
                     hf: Mapping[str, Any] | None = None) -> RopeScaling | None:
    """The scaling of one rope object (4.x ``rope_scaling`` or 5.x ``rope_parameters``);
    ``hf``: the whole config.json, where YaRN's missing fields are filled from."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", 1.0)
    refuse_if(partial != 1.0, field, dict(params),
              f"partial_rotary_factor={partial!r}: paxlite rotates every dimension of a head")
    if rope_type == "default":
        return None
    supported = ", ".join(repr(k.value) for k in kinds)
    refuse_if(rope_type not in {k.value for k in kinds}, field, dict(params),
               f"rope_type {rope_type!r} is not one paxlite implements for this model type "
               f"(plain RoPE, 'default', and {supported})")
    kind = RopeScalingKind(rope_type)
    if kind is RopeScalingKind.YARN:
        params = {**params, **_yarn_context(params, hf)}
    missing = [name for name in _KIND_FIELDS[kind]
               if params.get(name) is None and not (kind is RopeScalingKind.YARN
                                                    and name in _YARN_OPTIONAL)]
    if missing:
        raise UnsupportedCheckpointError(
            f"config.json {field} (rope_type={rope_type!r}) has no {', '.join(missing)}")
    fields = {name: _field_value(name, params[name]) for name in _KIND_FIELDS[kind]
              if params.get(name) is not None}
    try:
        return RopeScaling(kind=kind, **fields)
    except ValueError as error:
        raise UnsupportedCheckpointError(f"config.json {field}: {error}") from None


def _field_value(name: str, value: Any) -> Any:
    """A scaling field's value as RopeScaling holds it (booleans and counts kept, the rest
    float; a value of another type is left for RopeScaling to refuse by name)."""
    if name == "truncate" or isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    if name == "original_max_position_embeddings":
        return int(value) if float(value).is_integer() else value
    return float(value)


def rope_of_entry(field: str, params: Any, *, theta: float,
                  kinds: Collection[RopeScalingKind] = LLAMA3_ONLY,
                  hf: Mapping[str, Any] | None = None) -> tuple[float, RopeScaling | None]:
    """(RoPE base, scaling) of one rope object ``field`` (null: ``theta``, unscaled); ``hf``:
    the whole config.json, for YaRN's fields that transformers fills in from it."""
    if params is None:
        return theta, None
    if not isinstance(params, Mapping):
        raise UnsupportedCheckpointError(
            f"config.json {field}={params!r} must be null or an object holding rope_type")
    if params.get("rope_theta") is not None:
        theta = float(params["rope_theta"])
    return theta, _rope_scaling_of(field, params, kinds, hf)


def refuse_partial_rotation(hf: Mapping[str, Any]) -> None:
    """A top-level ``partial_rotary_factor`` (transformers moves it into the RoPE object)."""
    partial = hf.get("partial_rotary_factor")
    refuse_if(partial is not None and partial != 1.0, "partial_rotary_factor", partial,
              "paxlite rotates every dimension of a head")


def rope_of(hf: Mapping[str, Any], *, default: float = DEFAULT_ROPE_THETA,
            kinds: Collection[RopeScalingKind] = LLAMA3_ONLY
            ) -> tuple[float, RopeScaling | None]:
    """(RoPE base, frequency scaling) from either spelling: 5.x ``rope_parameters`` or 4.x's
    top-level ``rope_theta`` and ``rope_scaling`` (whose kind older files spell ``type``);
    ``kinds``: the scalings the model type may have. As transformers 5 reads a file holding
    both: a non-empty ``rope_scaling`` replaces ``rope_parameters`` whole, and the base is then
    its own ``rope_theta``, else the top-level one, else ``default``."""
    refuse_partial_rotation(hf)
    theta = default if hf.get("rope_theta") is None else float(hf["rope_theta"])
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    if not hf.get(field):
        return theta, None
    return rope_of_entry(field, hf[field], theta=theta, kinds=kinds, hf=hf)


def rope_theta_of(hf: Mapping[str, Any], *, default: float = DEFAULT_ROPE_THETA) -> float:
    """RoPE base from either spelling; refuses any RoPE scaling (for layouts without it)."""
    theta, scaling = rope_of(hf, default=default)
    refuse_if(scaling is not None, "rope_scaling", scaling,
               "this model type converts with unscaled RoPE only")
    return theta


def rope_fields(config: TransformerConfig) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(5.x ``rope_parameters``, 4.x ``rope_scaling``) of a model: the latter None without
    scaling, else the same scaling fields without ``rope_theta`` (4.x writes that at the top)."""
    return rope_entry(theta=float(config.rope_theta), scaling=config.rope_scaling)


def rope_entry(*, theta: float, scaling: RopeScaling | None
               ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """`rope_fields` of one RoPE base and scaling (Gemma 3 writes one per layer type)."""
    if scaling is None:
        return {"rope_type": "default", "rope_theta": theta}, None
    legacy = {"rope_type": scaling.kind.value}
    for name in _KIND_FIELDS[scaling.kind]:
        value = getattr(scaling, name)
        if value is None:  # YaRN's optional fields the file did not have
            continue
        keep = name in ("original_max_position_embeddings", "truncate")
        legacy[name] = value if keep else float(value)
    return {**legacy, "rope_theta": theta}, legacy
