"""The error of a conversion that cannot be done as asked; standard library only, so that the
`convert` command can name it without importing the converters (NumPy, JAX) before they run."""


class ConversionError(ValueError):
    """A conversion that cannot be done as asked (e.g. the model is not the experiment's)."""
