"""Conversion time and peak host memory for a ~1B-parameter LLaMA-style checkpoint, both ways.

A random Hugging Face checkpoint (LLaMA layout, GQA, untied head, bfloat16 safetensors as published
models are stored) is written once, then converted with the command users run, each direction in its
own process so that its peak resident memory (ru_maxrss of the child) is its own:

    python -m paxlite convert --from=hf --to=paxlite ...     (HF bf16 -> paxlite float32 params)
    python -m paxlite convert --from=paxlite --to=hf ...     (paxlite -> HF, bf16 again)

The round trip must give back every tensor bit for bit (bf16 -> f32 -> bf16 is exact), so the numbers
are for a conversion that is also checked. Peak memory is reported beside the size of the float32
parameters, the least a converter that holds the whole model must use.

    .venv/bin/python benchmarks/convert_checkpoint.py [--work_dir build/bench_convert] [--layers 16]

Each command is also run on a tiny model (D 64, one layer): the figure reported is the peak less
that baseline (Python, JAX and Orbax themselves), against the model's float32 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


FULL = (2048, 8192, 32, 8, 64, 32000)  # D, F, heads, kv heads, head dim, vocab
TINY = (64, 256, 4, 2, 16, 256)  # the baseline: what a converter process costs with no model


def write_random_hf(path: str, *, layers: int, seed: int = 0,
                    sizes: tuple[int, ...] = FULL) -> int:
    """A random LLaMA-style HF checkpoint (default D 2048, F 8192, 32 heads, 8 kv heads, V 32000);
    returns #params."""
    import torch
    from safetensors.torch import save_file

    d, f, heads, kv, head_dim, vocab = sizes
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d,
        "intermediate_size": f, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "hidden_act": "silu", "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "vocab_size": vocab, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "attention_bias": False, "rope_scaling": None,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "dtype": "bfloat16",
    }
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rand(vocab, d), "lm_head.weight": rand(vocab, d),
               "model.norm.weight": (1 + rand(d)).to(torch.bfloat16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": rand(heads * head_dim, d),
            p + "self_attn.k_proj.weight": rand(kv * head_dim, d),
            p + "self_attn.v_proj.weight": rand(kv * head_dim, d),
            p + "self_attn.o_proj.weight": rand(d, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(f, d),
            p + "mlp.up_proj.weight": rand(f, d),
            p + "mlp.down_proj.weight": rand(d, f),
            p + "input_layernorm.weight": (1 + rand(d)).to(torch.bfloat16),
            p + "post_attention_layernorm.weight": (1 + rand(d)).to(torch.bfloat16),
        })
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return sum(t.numel() for t in tensors.values())


def write_in_child(path: str, *, layers: int, tiny: bool = False) -> int:
    """`write_random_hf` in a child process: a forked child's ru_maxrss starts at its parent's
    RSS, so this process must stay small (torch and the random tensors live in the child)."""
    args = [sys.executable, os.path.abspath(__file__), f"--write_hf={path}", f"--layers={layers}"]
    out = subprocess.run(args + (["--tiny"] if tiny else []), check=True, capture_output=True,
                         text=True).stdout
    return int(out.split()[-1])


def run_convert(args: list[str]) -> tuple[float, float]:
    """(seconds, peak RSS GiB) of one `python -m paxlite convert` run; os.wait4 gives that child's own rusage."""
    start = time.perf_counter()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-m", "paxlite", "convert", *args], cwd=REPO, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"convert {args} failed with status {proc.returncode}")
    return seconds, usage.ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


def compare(a_dir: str, b_dir: str) -> int:
    """Number of tensors compared; raises if any differs in name, dtype or bits."""
    from safetensors import safe_open

    def read(path: str) -> dict[str, np.ndarray]:
        files = [os.path.join(path, n) for n in sorted(os.listdir(path)) if n.endswith(".safetensors")]
        out = {}
        for name in files:
            with safe_open(name, framework="pt") as fh:
                for key in fh.keys():  # noqa: SIM118  safe_open is not iterable
                    out[key] = fh.get_tensor(key).view(-1).view(dtype=__import__("torch").int16).numpy()
        return out

    a, b = read(a_dir), read(b_dir)
    if sorted(a) != sorted(b):
        raise AssertionError(f"tensor names differ: {sorted(set(a) ^ set(b))[:10]}")
    for key in a:
        if not np.array_equal(a[key], b[key]):
            raise AssertionError(f"{key} differs after the round trip")
    return len(a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work_dir", default=os.path.join(REPO, "build", "bench_convert"))
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--max_shard_size", default="1GB", help="of the paxlite -> HF export")
    parser.add_argument("--write_hf", default=None, help=argparse.SUPPRESS)  # child: write, exit
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write_hf:
        print(write_random_hf(args.write_hf, layers=args.layers, sizes=TINY if args.tiny else FULL))
        return
    shutil.rmtree(args.work_dir, ignore_errors=True)
    hf_in, pax, hf_out = (os.path.join(args.work_dir, n) for n in ("hf_in", "paxlite", "hf_out"))
    num_params = write_in_child(hf_in, layers=args.layers)
    size = os.path.getsize(os.path.join(hf_in, "model.safetensors"))
    print(f"random LLaMA-style checkpoint: {num_params:,} parameters, {size / 2**30:.2f} GiB bf16 safetensors")
    # The same two commands on a tiny model: the process's own footprint (Python, JAX, Orbax).
    tiny_in, tiny_pax, tiny_out = (os.path.join(args.work_dir, n) for n in ("tiny_in", "tiny_pax", "tiny_out"))
    write_in_child(tiny_in, layers=1, tiny=True)
    _, b1 = run_convert(["--from=hf", "--to=paxlite", f"--input={tiny_in}", f"--output={tiny_pax}"])
    _, b2 = run_convert(["--from=paxlite", "--to=hf", f"--input={tiny_pax}", f"--output={tiny_out}",
                         "--dtype=bfloat16"])
    t1, m1 = run_convert(["--from=hf", "--to=paxlite", f"--input={hf_in}", f"--output={pax}"])
    t2, m2 = run_convert(["--from=paxlite", "--to=hf", f"--input={pax}", f"--output={hf_out}",
                          "--dtype=bfloat16", f"--max_shard_size={args.max_shard_size}"])
    count = compare(hf_in, hf_out)
    f32 = num_params * 4 / 2**30
    print(f"round trip exact: {count} tensors bit-identical")
    for what, t, m, b in (("hf -> paxlite", t1, m1, b1), ("paxlite -> hf", t2, m2, b2)):
        print(f"{what}: {t:.1f} s, peak RSS {m:.2f} GiB, tiny model {b:.2f} GiB: "
              f"(peak - tiny) / f32 params = {(m - b) / f32:.2f}x the {f32:.2f} GiB")


if __name__ == "__main__":
    main()
