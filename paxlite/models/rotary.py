"""Rotary position embedding (RoPE) in the Meta / Pax *interleaved-pair* layout.

Each head vector of size h is read as h/2 pairs, pair j = (x[2j], x[2j+1]), and pair j is rotated
by the angle ``pos * theta^(-2j/h)``:

    out[2j]     = x[2j] * cos(a_j) - x[2j+1] * sin(a_j)
    out[2j + 1] = x[2j] * sin(a_j) + x[2j+1] * cos(a_j)

This is Meta's original ``llama/model.py`` and Pax's ``LLaMARotaryEmbedding``, so Meta (and
saxml-converted Pax) checkpoints load with no permutation. Hugging Face checkpoints use the
*rotate-half* layout instead, pair j = (x[j], x[j + h/2]); HF's converter permuted the output rows
of the query and key projections (per head: even rows first, then odd rows) to match it. Loading an
HF checkpoint into this layout therefore needs the inverse row permutation on q and k at conversion
time (``meta_row[2j + p] = hf_row[p * h/2 + j]``, docs/interop.md "The RoPE permutation"); v and
the output projection are untouched. Skipping it gives a model that runs and produces plausible,
wrong logits.

Angles come from the batch's ``positions`` rather than ``arange(T)``, so packed rows whose
positions restart at 0 for every document rotate each document exactly as if it ran alone.
The rotation is computed in float32 and cast back, as large positions times the fastest frequency
lose too much precision in bfloat16.

``RopeScaling`` rescales the frequencies for contexts longer than the pretraining one (LLaMA-3.1's
``llama3`` rule: low frequencies divided by ``factor``, high ones kept, a smooth blend between;
YaRN's ``yarn`` blends by pair index instead and also multiplies cos and sin by an attention
factor, which scales every query-key logit by its square).
The rule acts on the frequency of pair j, which is pair j in either row layout, so HF and Meta
checkpoints share it unchanged.

Einsum letters: B batch, T length, N heads, H dims per head.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import jax
import jax.numpy as jnp

DEFAULT_THETA: float = 10000.0


class RopeScalingKind(str, enum.Enum):
    """How the RoPE frequencies are rescaled; the value is Hugging Face's ``rope_type``."""

    LLAMA3 = "llama3"  # LLaMA-3.1/3.2/3.3: low frequencies / factor, smooth blend in between
    LINEAR = "linear"  # every frequency / factor (Gemma 3's global layers); reads factor only
    YARN = "yarn"  # YaRN (gpt-oss, DeepSeek-V2/V3): ramp by pair index, cos and sin scaled


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Frequency scaling of RoPE (``TransformerConfig.rope_scaling``); JSON-able plain values.

    LLAMA3: a pair whose wavelength 2 pi / f is longer than original_max_position_embeddings /
    low_freq_factor turns slower by ``factor``; one shorter than original / high_freq_factor
    keeps its frequency; in between the two are blended linearly in original / wavelength.
    LINEAR: every frequency divided by ``factor`` (positions interpolated); the other fields are
    not read.
    YARN: pairs below the dimension where the pretraining context made ``beta_fast`` turns keep
    their frequency, pairs above the one with ``beta_slow`` turns are divided by ``factor``, and a
    linear ramp in the pair index blends between (the bounds floored / ceiled when ``truncate``);
    cos and sin are multiplied by `attention_scaling` (``attention_factor`` when given, else
    0.1 ln(factor) + 1, or that with ``mscale`` over that with ``mscale_all_dim`` when both are
    set). low_freq_factor and high_freq_factor are not read.
    """

    kind: RopeScalingKind = RopeScalingKind.LLAMA3
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN's alone (defaults: transformers'; None: absent from config.json)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __repr__(self) -> str:
        """The fields the kind reads plus LLaMA-3's (the repr older messages quote)."""
        names = [f.name for f in dataclasses.fields(self)]
        if self.kind is not RopeScalingKind.YARN:
            names = names[:names.index("beta_fast")]
        return f"RopeScaling({', '.join(f'{n}={getattr(self, n)!r}' for n in names)})"

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", RopeScalingKind(self.kind))
        except ValueError:
            valid = ", ".join(repr(m.value) for m in RopeScalingKind)
            raise ValueError(f"RopeScaling.kind={self.kind!r} is not valid; expected one of "
                             f"{valid}") from None
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"RopeScaling.{name}={value!r} must be a positive number")
        if not self.high_freq_factor >= self.low_freq_factor:
            raise ValueError(
                f"RopeScaling.high_freq_factor={self.high_freq_factor!r} must be larger than "
                f"or equal to low_freq_factor={self.low_freq_factor!r} (they bound the blended "
                "band; equal: no band, Llama 4's)")
        original = self.original_max_position_embeddings
        if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
            raise ValueError(f"RopeScaling.original_max_position_embeddings={original!r} must be "
                             "a positive integer")
        for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
            value = getattr(self, name)
            optional = name not in ("beta_fast", "beta_slow")
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                extra = " (or None)" if optional else ""
                raise ValueError(f"RopeScaling.{name}={value!r} must be a positive number{extra}")
        if not isinstance(self.truncate, bool):
            raise ValueError(f"RopeScaling.truncate={self.truncate!r} must be true or false")

    def attention_scaling(self) -> float:
        """What cos and sin are multiplied by: YaRN's attention factor, 1 for the other kinds."""
        if self.kind is not RopeScalingKind.YARN:
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def magnitude(scale: float) -> float:
            return 1.0 if self.factor <= 1 else 0.1 * scale * math.log(self.factor) + 1.0

        if self.mscale and self.mscale_all_dim:
            return float(magnitude(self.mscale) / magnitude(self.mscale_all_dim))
        return magnitude(1.0)

    def _yarn(self, inv_freq: jax.Array, *, theta: float) -> jax.Array:
        """YaRN's frequencies: interpolated (/ factor) and kept ones blended by pair index."""
        dims = 2 * inv_freq.shape[0]
        original = self.original_max_position_embeddings

        def dimension(turns: float) -> float:  # the pair index that turns ``turns`` times
            return dims * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

        low, high = dimension(self.beta_fast), dimension(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dims - 1)
        if low == high:
            high += 0.001  # a one-pair ramp would divide by zero
        ramp = jnp.clip((jnp.arange(dims // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
        kept = 1 - ramp  # [H/2]: 1 keeps the frequency, 0 divides it by factor
        # 1 / (factor * theta^(2j/H)) rather than inv_freq / factor: the same float32 rounding as
        # transformers', which large positions (angle = pos * frequency) would magnify
        wavelengths = 1.0 / inv_freq  # [H/2], theta^(2j/H) exactly where inv_freq is its inverse
        interpolated = 1.0 / (jnp.float32(self.factor) * wavelengths)
        return interpolated * (1 - kept) + inv_freq * kept

    def scale(self, inv_freq: jax.Array, *, theta: float = DEFAULT_THETA) -> jax.Array:
        """float32 frequencies [H/2] of base ``theta`` -> the rescaled ones (the kind's rule, in
        float32; only YaRN's reads the base)."""
        if self.kind is RopeScalingKind.LINEAR:
            return inv_freq / self.factor
        if self.kind is RopeScalingKind.YARN:
            return self._yarn(inv_freq, theta=theta)
        original = float(self.original_max_position_embeddings)
        wavelength = 2 * math.pi / inv_freq  # [H/2]
        slow = jnp.where(wavelength > original / self.low_freq_factor, inv_freq / self.factor,
                         inv_freq)
        if self.high_freq_factor == self.low_freq_factor:  # an empty band: a step
            return slow
        blend = ((original / wavelength - self.low_freq_factor)
                 / (self.high_freq_factor - self.low_freq_factor))
        blended = (1 - blend) * slow / self.factor + blend * slow
        medium = ((wavelength >= original / self.high_freq_factor)
                  & (wavelength <= original / self.low_freq_factor))
        return jnp.where(medium, blended, slow)


def rotary_angles(positions: jax.Array, *, dims_per_head: int, theta: float = DEFAULT_THETA,
                  scaling: RopeScaling | None = None) -> jax.Array:
    """positions int [B, T] -> float32 angles [B, T, H/2], angle[..., j] = pos * theta^(-2j/H)
    (that frequency rescaled by ``scaling`` when given)."""
    if dims_per_head <= 0 or dims_per_head % 2:
        raise ValueError(
            f"rotary embedding needs an even, positive dims_per_head, got {dims_per_head}"
        )
    if not theta > 0:
        raise ValueError(f"rotary theta must be a positive number, got {theta!r}")
    exponents = jnp.arange(0, dims_per_head, 2, dtype=jnp.float32) / dims_per_head  # [H/2]
    inv_freq = 1.0 / (jnp.float32(theta) ** exponents)  # [H/2]
    if scaling is not None:
        inv_freq = scaling.scale(inv_freq, theta=theta)
    return positions.astype(jnp.float32)[:, :, None] * inv_freq[None, None, :]  # [B, T, H/2]


def apply_rotary(x: jax.Array, positions: jax.Array, *, theta: float = DEFAULT_THETA,
                 scaling: RopeScaling | None = None) -> jax.Array:
    """Rotate interleaved pairs of x [B, T, N, H] by their positions [B, T]; same shape and dtype.

    Works for any number of heads N, so the same call serves queries (N heads) and keys (KV heads).
    A YaRN ``scaling`` also multiplies cos and sin by its `RopeScaling.attention_scaling`.
    """
    if x.ndim != 4:
        raise ValueError(f"rotary embedding expects x of shape [B, T, N, H], got {x.shape}")
    if positions.shape != x.shape[:2]:
        raise ValueError(
            f"positions must have shape [batch, length] = {x.shape[:2]}, got {positions.shape}"
        )
    batch, length, heads, dims = x.shape
    angles = rotary_angles(positions, dims_per_head=dims, theta=theta,
                           scaling=scaling)[:, :, None, :]  # [B, T, 1, H/2]
    magnitude = 1.0 if scaling is None else scaling.attention_scaling()
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if magnitude != 1.0:
        cos, sin = cos * magnitude, sin * magnitude
    pairs = x.astype(jnp.float32).reshape(batch, length, heads, dims // 2, 2)  # [B, T, N, H/2, 2]
    even, odd = pairs[..., 0], pairs[..., 1]  # each [B, T, N, H/2]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)
