"""The error of a conversion that cannot be done as asked; standard library only, so that the
`convert` command can name it without importing the converters (NumPy, JAX) before they run."""

from paxlite.errors import UserError


class ConversionError(UserError, ValueError):
    """A conversion that cannot be done as asked (e.g. the model is not the experiment's)."""


class UnsupportedCheckpointError(ConversionError):
    """A checkpoint or config that paxlite cannot represent exactly; the message names the field."""
