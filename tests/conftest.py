"""Test set-up: eight fake CPU devices so that sharding is exercised on every test run."""

import os

# Must happen before JAX is imported anywhere.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices("gpu"))
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if os.environ.get("JAX_PLATFORMS", "") == "cpu" or not _has_gpu():
        skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU; none on this machine")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)
