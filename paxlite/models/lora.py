"""LoRA: low-rank adapters on the frozen weight matmuls, with Pax's GPU semantics.

Pax (`praxis/contrib/gpu/scripts_gpu/lora_layers.py`) adds to a weight ``W`` two trainable factors
``A`` (the layer's input features x rank, initialised like the layer's weight) and ``B`` (rank x the
layer's output features, zeros), and uses ``W + A @ B`` on every forward: no alpha/rank scaling, no
dropout. paxlite keeps that and adds Hugging Face PEFT's optional ``alpha``: the delta is
``(alpha / rank) * A @ B``, and ``alpha=None`` means ``alpha = rank``, i.e. scale 1 = Pax.

Why ``x @ W + scale * (x @ A) @ B`` instead of materialising ``W + scale * A @ B``: the two are the
same function, but with the effective kernel materialised, the backward pass computes the full
``[in, out]`` gradient of ``W + AB`` (a matmul as large as the forward one) only to contract it
with ``A`` and ``B``. The factored form never forms a full-size weight gradient, so freezing the
base weights also saves a third of the matmul work; the extra forward cost is ``rank / in`` of
the layer's. At initialisation ``B = 0``, so the output is bit-identical to the base layer's.

Layouts carry logical axis names so the adapters shard like their kernel: for a kernel
``[*inputs, *groups, *outputs]`` (e.g. the fused QKV ``[embed, 3, heads, kv]``, inputs ``embed``,
groups the ``3`` of q/k/v, outputs ``heads, kv``), ``lora_a`` is ``[*inputs, *groups, rank]`` and
``lora_b`` is ``[*groups, rank, *outputs]``; the rank axis is ``lora_rank`` (the rules table keeps
it whole). A group axis gives each slice of the kernel its own adapter pair: q, k and v get
separate LoRA, as Pax's ``LoraCombinedQKVProjection`` (``[3, D, r]`` / ``[3, N*H, r]``).
"""

from __future__ import annotations

import dataclasses
import enum
import re
import string
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.typing import DTypeLike

LORA_RANK_AXIS: str = "lora_rank"
LORA_A: str = "lora_a"
LORA_B: str = "lora_b"
# Pax LoRAMixin's rule for both CHECKPOINT_IGNORE_RULES and bprop_variable_inclusion.
PAX_LORA_RULE: str = r"^.*lora.*$"


class LoraTargets(str, enum.Enum):
    """Which projections get adapters (Pax ``LORA_TARGET_LAYERS``).

    ATTENTION: q, k, v (fused or separate) and the attention output projection. MLP: every MLP
    matmul (``wi``, ``wi_gate``, ``wo``). ALL: both. The embedding and output head never do.
    """

    ALL = "all"
    ATTENTION = "attention"
    MLP = "mlp"

    @property
    def attention(self) -> bool:
        return self in (LoraTargets.ALL, LoraTargets.ATTENTION)

    @property
    def mlp(self) -> bool:
        return self in (LoraTargets.ALL, LoraTargets.MLP)


def rank_problems(rank: object, *, name: str = "lora_rank") -> list[str]:
    """What ``rank`` cannot be, in the words of the field ``name`` (TransformerConfig's by
    default: the experiments report it under LORA_RANK before a model is built)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        return [f"{name}={rank!r} must be a positive integer (Pax's default is 8)"]
    return []


def alpha_problems(alpha: object, *, name: str = "lora_alpha") -> list[str]:
    """What ``alpha`` cannot be, in the words of the field ``name`` (as ``rank_problems``)."""
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
                              or not alpha > 0):
        return [f"{name}={alpha!r} must be > 0, or None (= the rank: scale 1, as Pax)"]
    return []


def check_rank(rank: object, *, name: str = "lora_rank") -> int:
    problems = rank_problems(rank, name=name)
    if problems:
        raise ValueError(problems[0])
    return rank


def check_alpha(alpha: object, *, name: str = "lora_alpha") -> None:
    problems = alpha_problems(alpha, name=name)
    if problems:
        raise ValueError(problems[0])


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraSpec:
    """The adapters of one Linear.

    Attributes:
        rank: r, the inner dimension of A @ B.
        alpha: the delta is scaled by alpha / rank; None means alpha = rank (scale 1, as Pax).
        num_group_dims: kernel dimensions right after the input dimensions that get one adapter
            pair per index (1 for the fused QKV kernel's q/k/v axis), instead of being outputs.
    """

    rank: int
    alpha: float | None = None
    num_group_dims: int = 0

    def __post_init__(self) -> None:
        check_rank(self.rank, name="LoraSpec.rank")
        check_alpha(self.alpha, name="LoraSpec.alpha")
        if isinstance(self.num_group_dims, bool) or self.num_group_dims < 0:
            raise ValueError(f"LoraSpec.num_group_dims={self.num_group_dims!r} must be >= 0")

    @property
    def scale(self) -> float:
        return (self.rank if self.alpha is None else self.alpha) / self.rank

    def with_groups(self, num_group_dims: int) -> LoraSpec:
        return dataclasses.replace(self, num_group_dims=num_group_dims)


def _split_equation(equation: str) -> tuple[str, str, str]:
    inputs, out = equation.replace(" ", "").split("->")
    x_letters, k_letters = inputs.split(",")
    return x_letters, k_letters, out


def num_input_dims(equation: str) -> int:
    """How many leading kernel dimensions the einsum contracts with the input (D; or N, H)."""
    x_letters, k_letters, _ = _split_equation(equation)
    count = 0
    while count < len(k_letters) and k_letters[count] in x_letters:
        count += 1
    if count == 0 or any(letter in x_letters for letter in k_letters[count:]):
        raise ValueError(
            f"LoRA needs the contracted (input) dimensions to lead the kernel; {equation!r} has "
            f"kernel {k_letters!r} with input letters from {x_letters!r} elsewhere"
        )
    return count


def _layout(
    kernel: tuple[Any, ...], *, equation: str, spec: LoraSpec, rank_entry: Any
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """(A, B) of a kernel described entry by entry (its shape, or its axis names)."""
    n_in = num_input_dims(equation)
    n_g = spec.num_group_dims
    if n_in + n_g >= len(kernel):
        raise ValueError(
            f"LoRA on {equation!r}: {n_in} input and {n_g} group dimensions leave no output "
            f"dimension in the kernel {kernel}"
        )
    inputs, groups, outputs = kernel[:n_in], kernel[n_in:n_in + n_g], kernel[n_in + n_g:]
    return (*inputs, *groups, rank_entry), (*groups, rank_entry, *outputs)


def lora_shapes(
    kernel_shape: tuple[int, ...], *, equation: str, spec: LoraSpec
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of ``lora_a`` [*inputs, *groups, r] and ``lora_b`` [*groups, r, *outputs]."""
    return _layout(tuple(kernel_shape), equation=equation, spec=spec, rank_entry=spec.rank)


def lora_axes(
    kernel_axes: tuple[str, ...], *, equation: str, spec: LoraSpec
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Logical axis names of ``lora_a`` and ``lora_b``: the kernel's, with ``lora_rank`` added."""
    return _layout(tuple(kernel_axes), equation=equation, spec=spec, rank_entry=LORA_RANK_AXIS)


def create_lora_params(
    module: nn.Module,
    *,
    equation: str,
    kernel_shape: tuple[int, ...],
    kernel_axes: tuple[str, ...],
    spec: LoraSpec,
    init_std: float,
    param_dtype: DTypeLike,
) -> tuple[jax.Array, jax.Array]:
    """Declares ``lora_a`` (normal(init_std), like the kernel, Pax) and ``lora_b`` (zeros) on
    `module`, which must be inside ``setup`` or a compact method."""
    a_shape, b_shape = lora_shapes(kernel_shape, equation=equation, spec=spec)
    a_axes, b_axes = lora_axes(kernel_axes, equation=equation, spec=spec)
    lora_a = module.param(
        LORA_A,
        nn.with_logical_partitioning(nn.initializers.normal(stddev=init_std), a_axes),
        a_shape,
        param_dtype,
    )
    lora_b = module.param(
        LORA_B, nn.with_logical_partitioning(nn.initializers.zeros, b_axes), b_shape, param_dtype
    )
    return lora_a, lora_b


def _fresh_letters(used: str, count: int) -> str:
    free = [c for c in string.ascii_letters if c not in used]
    return "".join(free[:count])


def lora_output(
    x: jax.Array,
    lora_a: jax.Array,
    lora_b: jax.Array,
    *,
    equation: str,
    spec: LoraSpec,
    dtype: DTypeLike,
) -> jax.Array:
    """``scale * (x @ A) @ B`` laid out like ``einsum(equation, x, kernel)``, in `dtype`.

    E.g. the fused QKV (``BTD,DKNH->BTKNH``, one group axis K): ``BTD,DKr->BTKr`` then
    ``BTKr,KrNH->BTKNH``.
    """
    x_letters, k_letters, out_letters = _split_equation(equation)
    n_in = num_input_dims(equation)
    n_g = spec.num_group_dims
    inputs, groups, outputs = k_letters[:n_in], k_letters[n_in:n_in + n_g], k_letters[n_in + n_g:]
    r = _fresh_letters(equation, 1)
    kept = "".join(c for c in x_letters if c not in inputs)
    xa = jnp.einsum(
        f"{x_letters},{inputs}{groups}{r}->{kept}{groups}{r}", x.astype(dtype), lora_a.astype(dtype)
    )  # [*batch, *groups, r]
    y = jnp.einsum(f"{kept}{groups}{r},{groups}{r}{outputs}->{out_letters}", xa,
                   lora_b.astype(dtype))
    return y * jnp.asarray(spec.scale, dtype) if spec.scale != 1.0 else y


def lora_delta(
    lora_a: jax.Array,
    lora_b: jax.Array,
    *,
    num_group_dims: int,
    num_batch_dims: int = 0,
) -> jax.Array:
    """``A @ B`` shaped like the kernel ``[*batch, *inputs, *groups, *outputs]``, in float32.

    ``num_batch_dims`` leading dimensions are shared by A, B and the kernel (the ``layers`` axis
    of a scanned stack).
    """
    n_b, n_g = num_batch_dims, num_group_dims
    n_in = lora_a.ndim - 1 - n_g - n_b
    n_out = lora_b.ndim - 1 - n_g - n_b
    if n_in < 1 or n_out < 1:
        raise ValueError(
            f"lora_a {lora_a.shape} and lora_b {lora_b.shape} do not fit {n_b} batch and {n_g} "
            "group dimensions"
        )
    letters = _fresh_letters("", n_b + n_in + n_g + 1 + n_out)
    bat, inp = letters[:n_b], letters[n_b:n_b + n_in]
    grp, r = letters[n_b + n_in:n_b + n_in + n_g], letters[n_b + n_in + n_g]
    out = letters[n_b + n_in + n_g + 1:]
    return jnp.einsum(
        f"{bat}{inp}{grp}{r},{bat}{grp}{r}{out}->{bat}{inp}{grp}{out}",
        lora_a.astype(jnp.float32),
        lora_b.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_components(path: str | Iterable[Any]) -> tuple[str, ...]:
    """A parameter path as names: '/'- or '.'-joined text, or a sequence of keys (JAX key paths
    or strings)."""
    if isinstance(path, str):
        return tuple(part for part in re.split(r"[/.]", path) if part)
    return tuple(_key_name(k) for k in path)


def is_lora_path(path: str | Iterable[Any]) -> bool:
    """Whether a parameter path names a LoRA factor (``.../lora_a`` or ``.../lora_b``)."""
    return any(part in (LORA_A, LORA_B) for part in path_components(path))
