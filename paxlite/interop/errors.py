"""The error of a conversion that cannot be done as asked; standard library only, so that the
`convert` command can name it without importing the converters (NumPy, JAX) before they run."""

from typing import Any

from paxlite.errors import UserError


class ConversionError(UserError, ValueError):
    """A conversion that cannot be done as asked (e.g. the model is not the experiment's)."""


class UnsupportedCheckpointError(ConversionError):
    """A checkpoint or config that paxlite cannot represent exactly; the message names the field."""


def refuse_if(condition: bool, field: str, value: Any, why: str) -> None:
    """An `UnsupportedCheckpointError` naming a config.json field and its value, if `condition`."""
    if condition:
        raise UnsupportedCheckpointError(f"config.json {field}={value!r} is not supported: {why}")
