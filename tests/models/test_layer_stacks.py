"""Which layer stack and which attention core run: the two selectors, decided before any tracing
(models/layer_stacks.py, models/attention.py). What each form computes is checked against the
others in test_transformer.py, test_pipelined_transformer.py and test_seq_parallel_transformer.py.
"""

from __future__ import annotations

import dataclasses

import pytest
from jax import checkpoint_policies

from paxlite.models.attention import AttentionCore, AttentionKind, select_core
from paxlite.models.block import Block, BlockUnit
from paxlite.models.layer_stacks import (
    StackKind,
    layer_attributes,
    remat_policy,
    scan_unit,
    stack_kind,
)
from paxlite.models.moe_config import MoeConfig
from paxlite.models.parallel_config import PipelineConfig
from paxlite.models.transformer import RematPolicy
from tests.models.test_transformer import tiny

PIPELINED = tiny(num_layers=4, pipeline=PipelineConfig(num_stages=2, num_microbatches=2))


@pytest.mark.parametrize("config, decode, initializing, want", [
    (PIPELINED, False, False, StackKind.PIPELINED),
    (PIPELINED, False, True, StackKind.UNROLLED),  # init runs the stored form
    (PIPELINED, True, False, StackKind.UNROLLED),  # so does decoding
    (dataclasses.replace(PIPELINED, scan_layers=True), True, False, StackKind.SCANNED),
    (tiny(scan_layers=True), False, False, StackKind.SCANNED),
    (tiny(), False, False, StackKind.UNROLLED),
])
def test_stack_kind(config, decode, initializing, want) -> None:
    assert stack_kind(config, decode=decode, initializing=initializing) is want


def test_remat_is_decided_once_and_never_while_decoding() -> None:
    config = tiny(remat_policy=RematPolicy.SAVE_NOTHING)
    assert remat_policy(config, decode=False) is checkpoint_policies.nothing_saveable
    assert remat_policy(config, decode=True) is None
    assert remat_policy(tiny(), decode=False) is None


def test_scan_unit_and_layer_attributes() -> None:
    assert scan_unit(tiny()) == (Block, {"moe_layer": False})
    assert scan_unit(tiny(moe=MoeConfig(num_experts=2))) == (Block, {"moe_layer": True})
    glam = tiny(num_layers=4, moe=MoeConfig(num_experts=2, moe_layer_interval=2))
    assert scan_unit(glam) == (BlockUnit, {})
    config = tiny()
    assert layer_attributes(config, deterministic=False, decode=False) == {
        "config": config, "deterministic": False}
    assert layer_attributes(config, deterministic=True, decode=True) == {
        "config": config, "deterministic": True, "decode": True}


@pytest.mark.parametrize("kind, decode, seq_shards, want", [
    (AttentionKind.DOT_PRODUCT, False, 1, AttentionCore.EINSUM),
    (AttentionKind.FLASH, False, 1, AttentionCore.FUSED),
    ("flash", True, 1, AttentionCore.CACHED),  # a cache is read under the caller's mask
    (AttentionKind.DOT_PRODUCT, True, 1, AttentionCore.CACHED),
    (AttentionKind.FLASH, False, 4, AttentionCore.SEQUENCE_PARALLEL),
    (AttentionKind.DOT_PRODUCT, False, 2, AttentionCore.SEQUENCE_PARALLEL),
])
def test_select_core(kind, decode, seq_shards, want) -> None:
    assert select_core(kind=kind, decode=decode, seq_shards=seq_shards) is want
