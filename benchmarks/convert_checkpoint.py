"""Conversion time and peak host memory for a ~1B-parameter LLaMA-style checkpoint.

A random Hugging Face checkpoint (LLaMA layout, GQA, untied head, bfloat16 safetensors as published
models are stored) is written once, then converted with the commands users run, each in its own
process so that its peak resident memory (ru_maxrss of the child) is its own:

    python -m paxlite convert --from=hf --to=paxlite ...     (HF bf16 -> paxlite float32 params)
    python -m paxlite convert --from=paxlite --to=hf ...     (paxlite -> HF, bf16 again)
    the same from the checkpoint saved as training saves it  (Orbax, scanned, a chunk per leaf)
    export_merged of a LoRA run's checkpoint                 (Orbax, scanned, rank-8 adapters)
    python -m paxlite convert --from=meta --to=paxlite ...   (the same weights as 2 Meta shards)
    python -m paxlite convert --from=paxlite --to=pax / --from=pax --to=paxlite

Both paxlite -> HF exports must give back every input tensor bit for bit (bf16 -> f32 -> bf16 is
exact), and one layer of the merged export is checked against a float64 merge, so the numbers are
for conversions that are also checked. Each command is also run on a tiny model (D 64, one layer):
the figure reported is the peak less that baseline (Python, JAX and Orbax themselves), against the
model's float32 bytes.

    .venv/bin/python benchmarks/convert_checkpoint.py [--work_dir build/bench_convert] [--layers 16]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
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


def compare(a_dir: str, b_dir: str) -> int:
    """Number of tensors compared; raises if any differs in name, dtype or bits."""
    from safetensors import safe_open

    def read(path: str) -> dict[str, np.ndarray]:
        files = [
            os.path.join(path, n) for n in sorted(os.listdir(path)) if n.endswith(".safetensors")
        ]
        out = {}
        for name in files:
            with safe_open(name, framework="pt") as fh:
                for key in fh.keys():  # noqa: SIM118  safe_open is not iterable
                    out[key] = (
                        fh.get_tensor(key).view(-1).view(dtype=__import__("torch").int16).numpy()
                    )
        return out

    a, b = read(a_dir), read(b_dir)
    if sorted(a) != sorted(b):
        raise AssertionError(f"tensor names differ: {sorted(set(a) ^ set(b))[:10]}")
    for key in a:
        if not np.array_equal(a[key], b[key]):
            raise AssertionError(f"{key} differs after the round trip")
    return len(a)


def write_orbax_copies(pax: str, orbax: str, lora: str) -> None:
    """Child: the converted checkpoint ``pax`` saved again the way training saves (Orbax, scanned
    layers, one chunk per leaf spanning every layer), and as a LoRA run's checkpoint (rank 8,
    nonzero adapters on every projection) for export_merged. This child holds the model; the
    measured commands run in their own processes."""
    import dataclasses as dc

    import jax
    from flax import linen as nn

    from paxlite.checkpointing.pretrained import save_params
    from paxlite.interop import hf
    from paxlite.interop.layouts import stack_layers
    from paxlite.models.transformer import abstract_variables

    pretrained = hf.from_paxlite(pax)
    config = dc.replace(pretrained.config, scan_layers=True)
    stacked = stack_layers(pretrained.params, num_layers=config.num_layers)
    del pretrained
    save_params(orbax, stacked, model_config=config)  # what hf.to_paxlite writes, scanned
    lora_config = dc.replace(config, lora_rank=8, lora_alpha=16.0)
    rng = np.random.default_rng(0)
    shapes = nn.meta.unbox(abstract_variables(lora_config)["params"])

    def leaf(path, shape_dtype):
        name = "/".join(str(k.key) for k in path)
        if name.endswith(("lora_a", "lora_b")):
            return (rng.standard_normal(shape_dtype.shape, np.float32) * 0.01).astype(np.float32)
        node = stacked
        for k in path:
            node = node[k.key]
        return node

    save_params(lora, jax.tree_util.tree_map_with_path(leaf, shapes), step=1,
                model_config=lora_config)


def write_meta_from_hf(hf_dir: str, meta_dir: str, *, shards: int = 2) -> None:
    """Child: the random HF checkpoint as Meta's release lays it out: params.json and
    ``consolidated.NN.pth`` model-parallel shards (column-parallel weights split along rows,
    row-parallel ones and the embedding along columns, norms replicated), q/k rows in Meta's
    interleaved RoPE order, bfloat16."""
    import torch
    from safetensors.torch import load_file

    from paxlite.interop.layouts import rotate_half_to_interleaved

    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    d, heads, kv = (
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    )
    head_dim = d // heads
    state = load_file(os.path.join(hf_dir, "model.safetensors"))

    def meta_rows(w: torch.Tensor, n: int) -> torch.Tensor:  # HF rotate-half rows -> interleaved
        rows = rotate_half_to_interleaved(w.view(torch.int16).numpy(), heads=n, head_dim=head_dim)
        return torch.from_numpy(np.ascontiguousarray(rows)).view(torch.bfloat16)

    meta = {
        "tok_embeddings.weight": state.pop("model.embed_tokens.weight"),
        "norm.weight": state.pop("model.norm.weight"),
        "output.weight": state.pop("lm_head.weight"),
    }
    for i in range(config["num_hidden_layers"]):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        meta.update(
            {
                dst + "attention.wq.weight": meta_rows(
                    state.pop(src + "self_attn.q_proj.weight"), heads
                ),
                dst + "attention.wk.weight": meta_rows(
                    state.pop(src + "self_attn.k_proj.weight"), kv
                ),
                dst + "attention.wv.weight": state.pop(src + "self_attn.v_proj.weight"),
                dst + "attention.wo.weight": state.pop(src + "self_attn.o_proj.weight"),
                dst + "feed_forward.w1.weight": state.pop(src + "mlp.gate_proj.weight"),
                dst + "feed_forward.w2.weight": state.pop(src + "mlp.down_proj.weight"),
                dst + "feed_forward.w3.weight": state.pop(src + "mlp.up_proj.weight"),
                dst + "attention_norm.weight": state.pop(src + "input_layernorm.weight"),
                dst + "ffn_norm.weight": state.pop(src + "post_attention_layernorm.weight"),
            }
        )
    os.makedirs(meta_dir)
    columns = ("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight", "output.weight")
    for k in range(shards):
        part = {}
        for name, tensor in meta.items():
            if name.endswith(columns):
                part[name] = tensor.chunk(shards, dim=0)[k].clone()
            elif name.endswith(("wo.weight", "w2.weight", "tok_embeddings.weight")):
                part[name] = tensor.chunk(shards, dim=1)[k].clone()
            else:
                part[name] = tensor.clone()
        torch.save(part, os.path.join(meta_dir, f"consolidated.{k:02d}.pth"))
    # FFN size: multiple_of * ceil(int(2 * 4d / 3) / multiple_of) = F for F a multiple of 2048.
    params = {"dim": d, "n_layers": config["num_hidden_layers"], "n_heads": heads, "n_kv_heads": kv,
              "vocab_size": config["vocab_size"], "multiple_of": config["intermediate_size"] // 2,
              "norm_eps": config["rms_norm_eps"], "rope_theta": 10000.0}
    with open(os.path.join(meta_dir, "params.json"), "w") as f:
        json.dump(params, f)


def experiment_flags(hf_dir: str) -> list[str]:
    """--fdl_config for --from=pax: LLaMA7B resized to the random checkpoint's shapes."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        c = json.load(f)
    d, heads = c["hidden_size"], c["num_attention_heads"]
    return ["--fdl_config=LLaMA7B", f"--fdl.NUM_LAYERS={c['num_hidden_layers']}",
            f"--fdl.MODEL_DIMS={d}", f"--fdl.HIDDEN_DIMS={c['intermediate_size']}",
            f"--fdl.NUM_HEADS={heads}", f"--fdl.NUM_KV_HEADS={c['num_key_value_heads']}",
            f"--fdl.DIMS_PER_HEAD={d // heads}", f"--fdl.VOCAB_SIZE={c['vocab_size']}",
            f"--fdl.LAYERNORM_EPSILON={c['rms_norm_eps']}", "--fdl.USE_REPEATED_LAYER=false"]


def run_child(argv: list[str]) -> tuple[float, float]:
    """(seconds, peak RSS GiB) of one child process; os.wait4 gives that child's own rusage."""
    start = time.perf_counter()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{argv} failed with status {os.waitstatus_to_exitcode(status)}")
    return seconds, usage.ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


def export_merged_argv(source: str, output: str) -> list[str]:
    """What `python -m paxlite export_merged` runs, without an experiment to name: the LoRA config
    is the model_config.json beside the checkpoint."""
    code = ("import sys; from paxlite.cli.convert import return_freed_buffers; "
            "return_freed_buffers(); from paxlite.train.export import export_merged; "
            "from paxlite.checkpointing.pretrained import load_model_config; "
            "export_merged(sys.argv[1], sys.argv[2], model_config=load_model_config(sys.argv[1]))")
    return ["-c", code, source, output]


def same_params(a: str, b: str) -> None:
    """Two unscanned paxlite checkpoints hold the same params, bit for bit (read leaf by leaf)."""
    from paxlite.checkpointing.pretrained import find_checkpoint
    from paxlite.checkpointing.stream_read import CheckpointReader

    readers = [CheckpointReader(find_checkpoint(p)[1]) for p in (a, b)]
    if sorted(readers[0].leaves) != sorted(readers[1].leaves):
        raise AssertionError(f"{a} and {b} hold different params")
    for leaf in readers[0].leaves:
        if readers[0].read(leaf).tobytes() != readers[1].read(leaf).tobytes():
            raise AssertionError(f"{b}: params/{'/'.join(leaf)} differs from {a}'s")


def check_merged(lora: str, merged: str, *, layer: int) -> None:
    """One layer's MLP output kernel of the export is base + (alpha / r) * A @ B (float64
    reference)."""
    from paxlite.checkpointing.pretrained import find_checkpoint
    from paxlite.checkpointing.stream_read import CheckpointReader

    def row(path: str, leaf: tuple[str, ...]) -> np.ndarray:
        _, step_dir = find_checkpoint(path)
        with tempfile.TemporaryDirectory() as scratch:
            return (
                CheckpointReader(step_dir, scratch_dir=scratch).read(leaf, layer).astype(np.float64)
            )

    kernel = row(lora, ("layers", "mlp", "wo", "kernel"))
    a, b = (
        row(lora, ("layers", "mlp", "wo", "lora_a")),
        row(lora, ("layers", "mlp", "wo", "lora_b")),
    )
    want = kernel + 16.0 / 8 * a @ b
    have = row(merged, ("layers", "mlp", "wo", "kernel"))
    if not np.allclose(have, want, rtol=1e-5, atol=1e-6) or np.allclose(have, kernel):
        raise AssertionError(
            f"export_merged: layer {layer}'s wo kernel is not base + scale * A @ B"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work_dir", default=os.path.join(REPO, "build", "bench_convert"))
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--max_shard_size", default="1GB", help="of the paxlite -> HF export")
    parser.add_argument("--write_hf", default=None, help=argparse.SUPPRESS)  # child: write, exit
    parser.add_argument("--write_orbax", nargs=3, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--write_meta", nargs=2, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write_hf:
        print(write_random_hf(args.write_hf, layers=args.layers, sizes=TINY if args.tiny else FULL))
        return
    if args.write_orbax:
        write_orbax_copies(*args.write_orbax)
        return
    if args.write_meta:
        write_meta_from_hf(*args.write_meta)
        return
    shutil.rmtree(args.work_dir, ignore_errors=True)
    os.makedirs(args.work_dir)
    me = os.path.abspath(__file__)
    results = {}
    for size in ("tiny", "full"):  # tiny: the process's own footprint (Python, JAX, Orbax)
        d = {n: os.path.join(args.work_dir, f"{size}_{n}") for n in (
            "hf_in", "paxlite", "hf_out", "orbax", "hf_from_orbax", "lora", "merged", "meta",
            "from_meta", "pax", "from_pax")}
        layers = 1 if size == "tiny" else args.layers
        num_params = write_in_child(d["hf_in"], layers=layers, tiny=size == "tiny")
        if size == "full":
            gib = os.path.getsize(os.path.join(d["hf_in"], "model.safetensors")) / 2**30
            print(f"random LLaMA-style checkpoint: {num_params:,} parameters, {gib:.2f} GiB bf16 "
                  "safetensors")
        convert = ["-m", "paxlite", "convert"]
        to_hf = ["--to=hf", "--dtype=bfloat16", f"--max_shard_size={args.max_shard_size}"]
        results[size] = {
            "hf -> paxlite": run_child(
                convert
                + ["--from=hf", "--to=paxlite", f"--input={d['hf_in']}", f"--output={d['paxlite']}"]
            ),
            "paxlite -> hf": run_child(
                convert
                + ["--from=paxlite", *to_hf, f"--input={d['paxlite']}", f"--output={d['hf_out']}"]
            ),
        }
        subprocess.run([sys.executable, me, "--write_orbax", d["paxlite"], d["orbax"], d["lora"]],
                       check=True, cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"))
        results[size]["paxlite (Orbax, scanned) -> hf"] = run_child(
            convert + ["--from=paxlite", *to_hf, f"--input={d['orbax']}",
                       f"--output={d['hf_from_orbax']}"])
        results[size]["export_merged (Orbax, scanned, LoRA r8)"] = run_child(
            export_merged_argv(d["lora"], d["merged"]))
        subprocess.run([sys.executable, me, "--write_meta", d["hf_in"], d["meta"]], check=True,
                       cwd=REPO)
        results[size]["meta bf16 (2 shards) -> paxlite"] = run_child(
            convert + ["--from=meta", "--to=paxlite", f"--input={d['meta']}",
                       f"--output={d['from_meta']}"])
        results[size]["paxlite -> pax"] = run_child(
            convert + ["--from=paxlite", "--to=pax", f"--input={d['paxlite']}",
                       f"--output={d['pax']}"])
        results[size]["pax -> paxlite"] = run_child(
            convert + ["--from=pax", "--to=paxlite", f"--input={d['pax']}",
                       f"--output={d['from_pax']}", *experiment_flags(d["hf_in"])])
    full = {n: os.path.join(args.work_dir, f"full_{n}") for n in (
        "hf_in", "paxlite", "hf_out", "hf_from_orbax", "lora", "merged", "from_meta", "from_pax")}
    count = compare(full["hf_in"], full["hf_out"])
    compare(full["hf_in"], full["hf_from_orbax"])
    for other in ("from_meta", "from_pax"):  # the same float32 params as the HF conversion's
        same_params(full["paxlite"], full[other])
    check_merged(full["lora"], full["merged"], layer=args.layers - 1)
    print(f"round trips exact: {count} tensors bit-identical (both paxlite -> hf); meta -> paxlite "
          "and paxlite -> pax -> paxlite give the hf -> paxlite params bit for bit; export_merged "
          "checked against a float64 merge of one layer")
    f32 = num_params * 4 / 2**30
    for what, (t, m) in results["full"].items():
        _, b = results["tiny"][what]
        print(f"{what}: {t:.1f} s, peak RSS {m:.2f} GiB, tiny model {b:.2f} GiB: "
              f"(peak - tiny) / f32 params = {(m - b) / f32:.2f}x the {f32:.2f} GiB")


if __name__ == "__main__":
    main()
