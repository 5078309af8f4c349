"""FLOP counting against published per-token totals and hand arithmetic."""

import pytest

from paxlite.train.flops import flops_per_token, model_flops_utilization, peak_flops_per_device
from tests.xla_test_flags import COMPILE_FLAGS


def _gpt(*, layers: int, dims: int, heads: int, head_dim: int, hidden: int, vocab: int) -> int:
    return flops_per_token(
        num_layers=layers,
        model_dims=dims,
        num_heads=heads,
        num_kv_heads=heads,
        dims_per_head=head_dim,
        hidden_dims=hidden,
        vocab_size=vocab,
        seq_len=2048,
    )


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (dict(layers=12, dims=768, heads=12, head_dim=64, hidden=3072, vocab=50304), 854_654_976),
        (
            dict(layers=24, dims=4096, heads=32, head_dim=128, hidden=16384, vocab=50304),
            31_435_259_904,
        ),
        (
            dict(layers=96, dims=12288, heads=96, head_dim=128, hidden=49152, vocab=50257),
            1_061_877_915_648,
        ),
    ],
    ids=["GPT126M", "GPT5B", "GPT175B"],
)
def test_gpt_family_published_totals(kwargs: dict, expected: int) -> None:
    assert _gpt(**kwargs) == expected


def test_llama2_7b_published_total() -> None:
    got = flops_per_token(
        num_layers=32,
        model_dims=4096,
        num_heads=32,
        num_kv_heads=32,
        dims_per_head=128,
        hidden_dims=11008,
        vocab_size=32000,
        seq_len=4096,
        gated_mlp=True,
    )
    assert got == 42_863_689_728


def test_tiny_gqa_gated_by_hand() -> None:
    # L2 D8 H2 K1 h4 F16 V10 S6, gated:
    # per layer: qkv 2*8*(2+2)*4 = 256, out 2*8*2*4 = 128, mlp 2*8*16*3 = 768 -> 1152
    # forward matmuls 2*1152 + unembedding 2*8*10 = 2464 -> x3 = 7392
    # causal attention 2 layers * 3 * 2*6*2*4 = 576
    got = flops_per_token(
        num_layers=2,
        model_dims=8,
        num_heads=2,
        num_kv_heads=1,
        dims_per_head=4,
        hidden_dims=16,
        vocab_size=10,
        seq_len=6,
        gated_mlp=True,
    )
    assert got == 7392 + 576


@pytest.mark.parametrize("gated", [False, True])
def test_non_attention_part_is_six_times_matmul_params(gated: bool) -> None:
    dims = dict(L=3, D=16, H=4, K=2, h=8, F=40, V=50, S=32)
    n_matmul = dims["L"] * (
        dims["D"] * (dims["H"] + 2 * dims["K"]) * dims["h"]  # wq, wk, wv
        + dims["H"] * dims["h"] * dims["D"]  # wo
        + dims["D"] * dims["F"] * (3 if gated else 2)  # (gate,) up, down
    ) + dims["D"] * dims["V"]  # unembedding
    total = flops_per_token(
        num_layers=dims["L"],
        model_dims=dims["D"],
        num_heads=dims["H"],
        num_kv_heads=dims["K"],
        dims_per_head=dims["h"],
        hidden_dims=dims["F"],
        vocab_size=dims["V"],
        seq_len=dims["S"],
        gated_mlp=gated,
    )
    attention = 6 * dims["L"] * dims["S"] * dims["H"] * dims["h"]
    assert total - attention == 6 * n_matmul


# TinyLLaMA with USE_LORA=true (rank 8 on q, k, v, o, wi, wi_gate, wo), by hand:
#   L2 D32 H4 K2 h8 F64 V512 S64, gated.
#   forward matmuls T: per layer qkv 2*32*(4+4)*8 = 4096, out 2*32*32 = 2048, mlp 2*32*64*3 = 12288
#     -> 18432; x2 layers = 36864; unembedding 2*32*512 = 32768 -> T = 69632
#   adapters per layer r*(in+out): q 8*(32+32) = 512, k 8*(32+16) = 384, v 384, o 512,
#     wi 8*(32+64) = 768, wi_gate 768, wo 8*(64+32) = 768 -> 4096; x2 layers = 8192
#   causal attention 2 * 3 * 2*64*4*8 = 24576
TINY_LLAMA_DENSE = 3 * 69632 + 24576  # 233472: every weight trains
TINY_LLAMA_LORA = 2 * 69632 + 6 * 8192 + 24576  # 212992: frozen base, trained adapters


def test_lora_counts_no_weight_gradients_of_frozen_weights() -> None:
    sizes = dict(num_layers=2, model_dims=32, num_heads=4, num_kv_heads=2, dims_per_head=8,
                 hidden_dims=64, vocab_size=512, seq_len=64, gated_mlp=True)
    assert flops_per_token(**sizes) == TINY_LLAMA_DENSE
    assert flops_per_token(**sizes, lora_params=8192) == TINY_LLAMA_LORA
    with pytest.raises(ValueError, match="lora_params"):
        flops_per_token(**sizes, lora_params=0)


def test_lora_experiment_reports_the_work_done_to_the_loop_and_to_show() -> None:
    import json
    import os
    import subprocess
    import sys

    from paxlite.experiments.build import build_run_config, load_experiment

    name = "paxlite.experiments.tiny.TinyLLaMA"
    assert load_experiment(name, []).flops_per_token() == TINY_LLAMA_DENSE
    assert (
        load_experiment(name, ["USE_LORA=true", "LORA_RANDOM_BASE=true"]).flops_per_token()
        == TINY_LLAMA_LORA
    )
    _, config = build_run_config(
        name,
        ["USE_LORA=true", "LORA_RANDOM_BASE=true", "SYNTHETIC_DATA=true", "EVAL_TASK=validation"],
    )
    assert config.loop.flops_per_token == TINY_LLAMA_LORA  # what MFU in metrics.jsonl uses
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = COMPILE_FLAGS
    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "paxlite",
            "show",
            f"--fdl_config={name}",
            "--fdl.USE_LORA=true",
            "--fdl.LORA_RANDOM_BASE=true",
            "--format=json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert json.loads(shown.stdout)["flops_per_token"] == TINY_LLAMA_LORA


def test_rejects_non_positive_sizes() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        flops_per_token(
            num_layers=1,
            model_dims=8,
            num_heads=1,
            num_kv_heads=1,
            dims_per_head=8,
            hidden_dims=8,
            vocab_size=0,
            seq_len=8,
        )


@pytest.mark.parametrize(
    ("kind", "fp8", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", False, 989e12),
        ("NVIDIA H100 80GB HBM3", True, 1979e12),
        ("NVIDIA H200", False, 989e12),
        ("nvidia h200", True, 1979e12),
        ("NVIDIA H100 PCIe", False, 756e12),
        ("NVIDIA A100-SXM4-80GB", False, 312e12),
        ("NVIDIA A100-SXM4-80GB", True, None),
        ("cpu", False, None),
        ("TPU v9 imaginary", False, None),
    ],
)
def test_peak_table(kind: str, fp8: bool, expected: float | None) -> None:
    assert peak_flops_per_device(kind, fp8=fp8) == expected


def test_override_wins_and_is_in_tflops() -> None:
    assert peak_flops_per_device("cpu", override_tflops=1.5) == 1.5e12
    assert peak_flops_per_device("NVIDIA H200", override_tflops=500.0, fp8=True) == 500e12
    with pytest.raises(ValueError, match="override_tflops"):
        peak_flops_per_device("cpu", override_tflops=0.0)


def test_mfu() -> None:
    # 1,157,192 tokens/s: GPT126M on one H200 at 100% MFU (docs/training.md derives it).
    mfu = model_flops_utilization(
        tokens_per_s=1_157_192 * 8 * 0.4,
        flops_per_token=854_654_976,
        peak_flops_per_device=989e12,
        num_devices=8,
    )
    assert mfu == pytest.approx(0.4, rel=1e-6)
    assert (
        model_flops_utilization(
            tokens_per_s=1e5, flops_per_token=1e9, peak_flops_per_device=None, num_devices=8
        )
        is None
    )
    with pytest.raises(ValueError, match="num_devices"):
        model_flops_utilization(
            tokens_per_s=1.0, flops_per_token=1.0, peak_flops_per_device=1.0, num_devices=0
        )


def test_chunked_layers_count_keys_of_their_chunk_by_hand() -> None:
    """Llama 4's chunked layers: causal attention over min(C, S) keys. L4 (3 chunked, C 8, one
    full) at S 24: attention 3 * 2 * (8 + 8 + 8 + 24) * H * h; the matmuls as without chunks."""
    sizes = dict(num_layers=4, model_dims=8, num_heads=2, num_kv_heads=1, dims_per_head=4,
                 hidden_dims=16, vocab_size=10, seq_len=24, gated_mlp=True)
    full = flops_per_token(**sizes)
    chunked = flops_per_token(**sizes, attention_chunk_size=8, num_chunked_layers=3)
    assert full - chunked == 3 * 3 * 2 * (24 - 8) * 2 * 4
    # a chunk at least the sequence long is the full count
    assert flops_per_token(**sizes, attention_chunk_size=24, num_chunked_layers=3) == full
    with pytest.raises(ValueError, match="num_chunked_layers"):
        flops_per_token(**sizes, attention_chunk_size=8, num_chunked_layers=5)
    with pytest.raises(ValueError, match="attention_chunk_size"):
        flops_per_token(**sizes, num_chunked_layers=1)


def test_llama4_scout_counts_its_36_chunked_layers() -> None:
    """The experiment hands its layer pattern to the count: at 16,384 tokens, its 36 chunked
    layers (of 48; every 4th is NoPE and global) see 8,192 keys, 40 heads of 128."""
    from paxlite.experiments.build import load_experiment

    name = "Llama4Scout17B16E"
    short = load_experiment(name, ["MAX_SEQ_LEN=8192"]).flops_per_token()
    long = load_experiment(name, ["MAX_SEQ_LEN=16384"]).flops_per_token()
    # doubling S adds the attention of 8,192 more keys on the 12 global layers only
    assert long - short == 12 * 3 * 2 * 8192 * 40 * 128
