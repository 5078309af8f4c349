"""Mistral v0.1's sliding window on cuDNN's fused attention, as XLA's GPU compiler builds it for
8 H100s: the real train step (`planner.search.compile_train_step`, as test_kernels.py compiles
it) of a Mistral at test size with ATTENTION_IMPLEMENTATION='cudnn' holds cuDNN's fused attention
calls, forward and backward, of the same kind as the same model without a window, and the window
reaches them: their backend config carries cuDNN's sliding_window_length (the window, its own key
included; 0 for none).

Two compiles. The window is 16 of 64 tokens, so it excludes keys; the model is test_kernels.py's
size (bfloat16, 64 dims per head: what cuDNN takes) in Mistral7B's layout (a scanned,
rematerialised stack).
"""

from __future__ import annotations

import json
import re

import pytest

from paxlite.experiments.build import load_experiment
from paxlite.planner import search
from paxlite.planner.search import compile_train_step

pytestmark = pytest.mark.gpu_compile

WINDOW = 16
TINY_MISTRAL = ("NUM_LAYERS=2", "NUM_HEADS=4", "NUM_KV_HEADS=2", "DIMS_PER_HEAD=64",
                "MODEL_DIMS=256", "HIDDEN_DIMS=512", "VOCAB_SIZE=512", "MAX_SEQ_LEN=64",
                "ATTENTION_IMPLEMENTATION='cudnn'", "ICI_MESH_SHAPE=[8,1,1]")
# compile_train_step feeds packed rows, whose segments reach cuDNN as a dense mask: the bias
# variants (tests/gpu_compile/test_kernels.py). How many call sites the scanned, rematerialised
# stack keeps is XLA's choice; the window must not change it.
CUDNN_CALLS = ("__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward")
_CUDNN_CALL = re.compile(r'custom_call_target="(__cudnn\$fmha[^"]*)".*?backend_config=(\{.*\})')


def _cudnn_windows(monkeypatch, *overrides: str) -> tuple[dict[str, int], dict[str, set[int]]]:
    """(the cuDNN calls of the compiled train step, each call's sliding_window_length values),
    read from the optimized program that compile_train_step counts its kernels in."""
    texts = []
    counted = search.custom_calls

    def keep_text(text: str) -> dict[str, int]:
        texts.append(text)
        return counted(text)

    monkeypatch.setattr(search, "custom_calls", keep_text)
    result = compile_train_step(load_experiment("Mistral7B", (*TINY_MISTRAL, *overrides)),
                                num_devices=8, target="h100")
    assert result.compiled_for == "h100" and len(texts) == 1
    calls = {name: n for name, n in result.gpu_program.kernels.items()
             if name.startswith("__cudnn$")}
    windows: dict[str, set[int]] = {}
    for target, config in _CUDNN_CALL.findall(texts[0]):
        fmha = json.loads(config)["cudnn_fmha_backend_config"]
        windows.setdefault(target, set()).add(int(fmha.get("sliding_window_length", 0)))
    return calls, windows


def test_cudnn_runs_the_sliding_window_in_its_fused_kernel(monkeypatch):
    calls, windows = _cudnn_windows(monkeypatch, f"SLIDING_WINDOW={WINDOW}")
    plain_calls, plain_windows = _cudnn_windows(monkeypatch)
    assert calls == plain_calls and set(calls) == set(CUDNN_CALLS), (calls, plain_calls)
    assert min(calls.values()) >= 1
    assert windows == {name: {WINDOW} for name in CUDNN_CALLS}
    assert plain_windows == {name: {0} for name in CUDNN_CALLS}
