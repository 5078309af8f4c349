"""AXLearn's Fuji mesh rules (docs/migrating_from_axlearn.md), chosen by `--mesh_selector`.

AXLearn attaches to each Fuji model a list of (regex, mesh or modifier) rules; the launcher's
`--mesh_selector` (an instance type such as `gpu-p5.48xlarge-256` or `tpu-v5p-512`) picks the first
rule whose regex matches the whole selector. Here each rule is a paxlite config modifier
(config/modifiers.py): the mesh as AXLearn states it, over every device of the job
(`GlobalMeshShapeModifier`: a -1 takes the rest, and the processes go on DCN from the first axis
larger than 1), plus the gradient accumulation and remat policy some rules add. What a rule does
that paxlite cannot (host offload, flash block sizes, splash-attention overrides) is named in
`not_reproduced`, which the launcher logs as a warning when the rule is chosen.

Only the GPU and TPU rules are here (not AXLearn's Trainium ones). AXLearn's table abbreviates
"data -1, fsdp N" as "fsdp N" for several rules; every rule whose fsdp is fixed puts the remaining
devices on data, as AXLearn's default mesh does.

No rule matches (an unknown selector, or a size without rules: test, 1B, 3B, 8B): the model's
default mesh, AXLearn's `mesh_shape_from_axes(data=-1, fsdp=8)` for 1B-8B, `fsdp=-1` for 70B and
405B, `data=-1` for the test model; the launcher logs a warning naming the selector, the rules
that exist and the mesh it uses.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from paxlite.config.errors import ConfigError
from paxlite.config.modifiers import (
    ChainConfigModifier,
    ConfigModifier,
    GlobalMeshShapeModifier,
    GradientAccumulationModifier,
    RematPolicyModifier,
    mesh_shape_from_axes,
)


@dataclasses.dataclass(frozen=True)
class MeshRule:
    """One (regex, modifier) rule; `pattern` must match the whole selector (re.fullmatch)."""

    pattern: str
    modifier: ConfigModifier
    not_reproduced: str = ""  # what AXLearn's rule also does that paxlite does not

    def __post_init__(self):
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ConfigError(f"mesh rule {self.pattern!r} is not a regular expression: {e}") from e

    def matches(self, selector: str) -> bool:
        return re.fullmatch(self.pattern, selector) is not None


def _mesh(*, data: int = 1, fsdp: int = 1, grad_acc_steps: int = 1,
          remat: str | None = None) -> ConfigModifier:
    modifiers: list[ConfigModifier] = [
        GlobalMeshShapeModifier(mesh_shape_from_axes(data=data, fsdp=fsdp))
    ]
    if grad_acc_steps > 1:
        modifiers.append(GradientAccumulationModifier(grad_acc_steps))
    if remat is not None:
        modifiers.append(RematPolicyModifier(remat))
    return modifiers[0] if len(modifiers) == 1 else ChainConfigModifier(modifiers)


_A3 = r"gpu-a3-(high|mega|ultra)gpu-8g-.*"
_A4 = r"gpu-a4-highgpu-8g-.*"
_B200_BLOCK = ("FlashBlockSizeModifier(gpu_block_size=64) (paxlite's flash attention has no block "
               "size setting)")

RULES: dict[str, tuple[MeshRule, ...]] = {
    "7B": (
        MeshRule(r"tpu-v4-(1024|2048)", _mesh(data=-1, fsdp=16)),
        MeshRule(r"tpu-v5litepod-256", _mesh(data=-1, fsdp=256, grad_acc_steps=4),
                 not_reproduced="offloading dots to pinned_host memory"),
        MeshRule(r"tpu-v5litepod-256-4", _mesh(data=-1, fsdp=256, remat="SAVE_DOT_ONLY")),
        MeshRule(r"tpu-v5p-.*", _mesh(data=-1, fsdp=64)),
        MeshRule(r"gpu-(p5.48xlarge|p4de.24xlarge)-(256|512|1024)", _mesh(data=-1, fsdp=8)),
        MeshRule(_A3, _mesh(data=-1, fsdp=8)),
        MeshRule(_A4, _mesh(data=-1, fsdp=8), not_reproduced=_B200_BLOCK),
    ),
    "70B": (
        MeshRule(r"tpu-v5litepod-256-4", _mesh(data=-1, fsdp=256)),
        MeshRule(r"tpu-v6e-256-(4|8)", _mesh(data=-1, fsdp=256)),
        MeshRule(r"tpu-v6e-256", _mesh(data=-1, fsdp=256, grad_acc_steps=4)),
        MeshRule(r"gpu-(p5.48xlarge|p4de.24xlarge)-(512|1024)", _mesh(data=-1, fsdp=128)),
        MeshRule(_A3, _mesh(data=-1, fsdp=64)),
        MeshRule(_A4, _mesh(data=-1, fsdp=16), not_reproduced=_B200_BLOCK),
    ),
    "405B": (
        MeshRule(r"tpu-v5p-.*", _mesh(fsdp=-1), not_reproduced="offloading the layer inputs to "
                                                               "host memory"),
        MeshRule(r"tpu-7x-.*", _mesh(data=-1, fsdp=256),
                 not_reproduced="the splash-attention block-size overrides"),
    ),
}


def default_mesh(size: str) -> ConfigModifier:
    """AXLearn's default Fuji mesh for `size` (what its config has before any rule)."""
    if size == "test":
        return _mesh(data=-1)
    if size in ("70B", "405B"):
        return _mesh(fsdp=-1)
    return _mesh(data=-1, fsdp=8)


@dataclasses.dataclass(frozen=True)
class MeshChoice:
    """What `--mesh_selector` chose: the rule (None: no rule matched) and the modifier to apply."""

    selector: str | None
    rule: MeshRule | None
    modifier: ConfigModifier

    def describe(self) -> str:
        if self.rule is not None:
            return f"mesh rule {self.rule.pattern!r} (--mesh_selector={self.selector})"
        return "the default mesh" + (f" (no rule matches --mesh_selector={self.selector})"
                                     if self.selector else " (no --mesh_selector)")


def select_mesh(size: str, selector: str | None, *,
                extra_rules: Sequence[MeshRule] = ()) -> MeshChoice:
    """The first rule of `size` (then `extra_rules`) that matches `selector` in full, else the
    default mesh. `extra_rules` are a caller's own, e.g. a "custom" rule
    (examples/custom_fuji.py)."""
    rules = (*RULES.get(size, ()), *extra_rules)
    if selector:
        for rule in rules:
            if rule.matches(selector):
                return MeshChoice(selector=selector, rule=rule, modifier=rule.modifier)
    return MeshChoice(selector=selector, rule=None, modifier=default_mesh(size))


def rule_patterns(size: str, *, extra_rules: Sequence[MeshRule] = ()) -> list[str]:
    """The selectors' regexes for `size`, for messages."""
    return [rule.pattern for rule in (*RULES.get(size, ()), *extra_rules)]
