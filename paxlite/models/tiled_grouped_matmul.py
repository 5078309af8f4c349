"""The ``TILED`` grouped-matmul kernel of the dropless experts: one batched matmul over row tiles.

Why: XLA:GPU lowers ``jax.lax.ragged_dot`` by expanding its rows to a zero-padded dense array per
group, ``[G, M, K]``: on Qwen3-30B-A3B's 8-GPU layout (32 local experts, 262,144 exchanged rows of
2,048) one such array is 32 GiB, and a training step's temporaries reach 107 GiB per device with
two layers. JAX 0.12's wheels have neither the Pallas-Triton lowering nor XLA's Triton ragged dot,
and XLA's cuDNN ragged-dot fusion stops the compiler with a failed check. So this kernel stays in
plain XLA ops, with memory and FLOPs proportional to the rows instead of rows x groups:

1. Each group's rows are padded to a multiple of the tile height T, so every tile of T rows holds
   one group's rows only (at most ``M + G (T - 1)`` rows in all: a static bound).
2. The rows are gathered into that layout, ``[tiles, T, K]``, with zeros in the padding.
3. One batched matmul against each tile's group matrix, gathered ``[tiles, K, N]``.
4. Each input row's result is gathered back from its tile.

Its gradients are JAX's own (gathers transpose to scatter-adds), so no custom VJP is needed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MAX_TILE_ROWS = 2048  # larger tiles pad more rows and gather fewer group matrices


def tile_rows(num_rows: int, num_groups: int) -> int:
    """T: the largest power of two at most the mean group size (so the padding adds at most M
    rows), capped at `MAX_TILE_ROWS`."""
    mean = max(1, num_rows // num_groups)
    return min(MAX_TILE_ROWS, 1 << (mean.bit_length() - 1))


def tiled_grouped_matmul(x: jax.Array, kernel: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x [M, K] (rows sorted by group), kernel [G, K, N], group_sizes [G] -> [M, N]; rows past
    ``sum(group_sizes)`` are unspecified, as for every grouped-matmul kernel (linear.py)."""
    m, k = x.shape
    g, _, n = kernel.shape
    tile = tile_rows(m, g)
    num_tiles = -(-(m + g * (tile - 1)) // tile)  # a static bound on the padded tiles
    sizes = group_sizes.astype(jnp.int32)  # [G]
    ends = jnp.cumsum(sizes)  # [G]
    starts = ends - sizes  # [G] each group's first row in x
    padded = (sizes + tile - 1) // tile * tile  # [G]
    padded_ends = jnp.cumsum(padded)  # [G]
    padded_starts = padded_ends - padded  # [G] each group's first row in the tiled layout

    # Tiled layout -> x: which group each slot holds, and which row of x (padding: none).
    slots = jnp.arange(num_tiles * tile)  # [P]
    slot_group = jnp.minimum(jnp.searchsorted(padded_ends, slots, side="right"), g - 1)  # [P]
    offset = slots - padded_starts[slot_group]  # [P]
    holds_row = offset < sizes[slot_group]  # [P] False in the padding and past the last group
    source = jnp.where(holds_row, starts[slot_group] + offset, 0)  # [P]
    x_tiles = jnp.where(holds_row[:, None], x[source], jnp.zeros((), x.dtype))  # [P, K]
    x_tiles = x_tiles.reshape(num_tiles, tile, k).astype(kernel.dtype)  # [tiles, T, K]
    tile_group = slot_group[::tile]  # [tiles] one group per tile
    y_tiles = jnp.einsum("tmk,tkn->tmn", x_tiles, kernel[tile_group],
                         preferred_element_type=kernel.dtype)  # [tiles, T, N]

    # x -> tiled layout: each row's slot (rows past the groups: any slot, unspecified).
    rows = jnp.arange(m)  # [M]
    row_group = jnp.minimum(jnp.searchsorted(ends, rows, side="right"), g - 1)
    slot = jnp.clip(padded_starts[row_group] + rows - starts[row_group], 0, num_tiles * tile - 1)
    return y_tiles.reshape(num_tiles * tile, n)[slot]  # [M, N]
