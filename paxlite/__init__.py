"""paxlite: Pax-compatible LLM training on JAX, Flax, Optax, Orbax and Fiddle."""

__version__ = "0.1.0"
