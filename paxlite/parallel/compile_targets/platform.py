"""Which platform a program is being built for: the models' kernel choices read this.

Inside `jax.set_mesh(mesh)` or `jax.sharding.use_abstract_mesh(...)` (how paxlite builds every
step) that is the mesh's devices, which for a compile-only GPU or TPU target are GPUs or TPUs while
this process's default backend is the CPU; with no mesh set, this process's default backend and its
first device.
"""

from __future__ import annotations

from paxlite.parallel.compile_targets.chips import GpuSpec
from paxlite.parallel.compile_targets.target import GPU_SPECS


def spec_for_device_kind(device_kind: str) -> GpuSpec | None:
    """The GPU description whose device_kind this is (None: no GPU paxlite describes)."""
    return next((spec for spec in GPU_SPECS.values() if spec.device_kind == device_kind), None)


def compile_platform() -> tuple[str, str | None]:
    """(platform, compute capability) of the devices the program being traced is for: 'gpu' and
    its capability ('9.0') for a GPU, 'tpu' and None for a TPU (a compile-only one too), 'cpu'."""
    import jax

    device = jax.sharding.get_abstract_mesh().abstract_device
    backend = jax.default_backend()
    if device is None or device.platform == backend:
        capability = None
        if backend == "gpu":
            capability = getattr(jax.devices()[0], "compute_capability", None)
        return backend, capability
    spec = spec_for_device_kind(device.device_kind or "")
    return device.platform, spec.compute_capability_text if spec else None
