"""Seeded random parameters for tests that compare two runs from the same starting point."""

import jax
import numpy as np


def random_host_params(abstract_params, seed: int = 0):
    """Host parameters of the abstract tree's shapes and dtypes: normal noise of scale 0.1, around 1
    for norm scales. A sharded-vs-one-device test that starts both sides from these compares the
    loss and gradients without a real init, whose threefry sampler costs more to compile on the CPU
    than the sharded steps it would feed."""
    rng = np.random.default_rng(seed)

    def leaf(path, s):
        noise = rng.normal(0.0, 0.1, s.shape).astype(s.dtype)
        return 1 + noise if "scale" in jax.tree_util.keystr(path) else noise

    return jax.tree_util.tree_map_with_path(leaf, abstract_params)
