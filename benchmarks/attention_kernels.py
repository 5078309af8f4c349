"""ms per forward + backward of causal attention over packed rows, for each fused path.

Why: packed rows (segment ids) are the default for real data, and the public cuDNN API takes them
only as a dense [B, 1, T, S] mask (turned into a bias read in both passes), while JAX's
Pallas-Triton flash attention masks by the [B, T] segment ids inside the kernel. Which is faster
decides what ATTENTION_IMPLEMENTATION=auto should pick for packed training (docs/attention.md).

Paths, all on the same q, k, v and packed segment ids (documents of random lengths per row):
- ``xla_dense_mask``: jax.nn.dot_product_attention(implementation='xla') with the dense mask;
- ``cudnn_dense_mask``: the same call with implementation='cudnn' (GPU only);
- ``pallas_segment_ids``: paxlite's Pallas-Triton path (interpreted on CPU);
- ``cudnn_unpacked``: cuDNN causal without any mask (GPU only), the bound packed rows aim at.

Before timing, every path's output and dq, dk, dv are checked against ``xla_dense_mask`` (the
script fails if one disagrees). Times are medians over --rounds of --steps jitted calls, compile
excluded; the ratio column is against ``xla_dense_mask``.

    .venv/bin/python benchmarks/attention_kernels.py               # GPU: B=4 T=2048 N=16 H=128 bf16
    .venv/bin/python benchmarks/attention_kernels.py --cpu --tiny  # seconds on CPU (a smoke test)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run on CPU (Pallas interpreted)")
    parser.add_argument(
        "--tiny", action="store_true", help="B=1 T=32 N=2 K=1 H=16 float32, 1 round"
    )
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--documents", type=int, default=4, help="mean documents per packed row")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="also print one JSON line of results")
    args = parser.parse_args(argv)
    if args.tiny:
        args.batch, args.seq_len, args.heads, args.kv_heads, args.head_dim = 1, 32, 2, 1, 16
        args.dtype, args.documents, args.steps, args.rounds = "float32", 3, 1, 1
    return args


def _segments(rng, batch: int, length: int, documents: int):
    """[B, T] int32 ids 1, 2, ... of documents with random cut points (documents per row on
    average)."""
    import numpy as np

    rows = []
    for _ in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, length), size=max(0, documents - 1), replace=False))
        rows.append(np.searchsorted(cuts, np.arange(length), side="right") + 1)
    return np.stack(rows).astype(np.int32)


def main(argv=None) -> int:
    args = _parse(argv)
    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp
    import numpy as np

    from paxlite.models.attention import make_attention_mask
    from paxlite.models.attention_kernels import AttentionImplementation as Impl
    from paxlite.models.attention_kernels import cudnn_problems, flash_attention, pallas_attention

    backend = jax.default_backend()
    kv_heads = args.kv_heads or args.heads
    dtype = jnp.dtype(args.dtype)
    shape = dict(B=args.batch, T=args.seq_len, N=args.heads, K=kv_heads, H=args.head_dim)
    rng = np.random.default_rng(0)
    keys = jax.random.split(jax.random.key(0), 4)
    q = (jax.random.normal(keys[0], (args.batch, args.seq_len, args.heads, args.head_dim))
         * args.head_dim**-0.5).astype(dtype)
    k, v = (
        jax.random.normal(key, (args.batch, args.seq_len, kv_heads, args.head_dim)).astype(dtype)
        for key in keys[1:3]
    )
    dout = jax.random.normal(keys[3], q.shape).astype(dtype)
    segments = jnp.asarray(_segments(rng, args.batch, args.seq_len, args.documents))
    mask = make_attention_mask(seq_len=args.seq_len, segment_ids=segments)

    paths = {
        "xla_dense_mask": lambda q, k, v: flash_attention(
            q, k, v, implementation=Impl.XLA, mask=mask
        ),
        "cudnn_dense_mask": lambda q, k, v: flash_attention(
            q, k, v, implementation=Impl.CUDNN, mask=mask
        ),
        "pallas_segment_ids": lambda q, k, v: pallas_attention(
            q, k, v, segment_ids=segments, interpret=backend != "gpu"
        ),
        "cudnn_unpacked": lambda q, k, v: flash_attention(q, k, v, implementation=Impl.CUDNN),
    }
    capability = getattr(jax.devices()[0], "compute_capability", None) if backend == "gpu" else None
    skipped = {}
    for name in ("cudnn_dense_mask", "cudnn_unpacked"):
        problems = cudnn_problems(dtype=dtype, head_dim=args.head_dim, seq_len=args.seq_len,
                                  dense_bias=name == "cudnn_dense_mask", backend=backend,
                                  compute_capability=capability)
        if problems:
            skipped[name] = "; ".join(problems)
    if backend != "gpu":
        skipped.setdefault("pallas_segment_ids_note", "interpreted on CPU: not a GPU time")

    def fwd_bwd(fn):
        def both(q, k, v, dout):
            out, vjp = jax.vjp(fn, q, k, v)
            return (out, *vjp(dout))
        return jax.jit(both)

    compiled = {name: fwd_bwd(fn) for name, fn in paths.items() if name not in skipped}
    results = {name: fn(q, k, v, dout) for name, fn in compiled.items()}
    reference = results["xla_dense_mask"]
    tolerance = 2e-2 if dtype != jnp.float32 else 1e-4
    for name, got in results.items():
        if name == "cudnn_unpacked":
            continue  # a different function (no segments): timed, not compared
        for part, g, w in zip(("out", "dq", "dk", "dv"), got, reference):
            g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
            err = float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-6))
            if err > tolerance:
                print(f"FAIL: {name} {part} differs from xla_dense_mask by {err:.2e} "
                      f"(relative to its max; tolerance {tolerance:g})")
                return 1

    times: dict[str, list[float]] = {name: [] for name in compiled}
    for _ in range(args.rounds):
        for name, fn in compiled.items():  # interleaved rounds: drift hits every path alike
            start = time.perf_counter()
            for _ in range(args.steps):
                out = fn(q, k, v, dout)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) * 1e3 / args.steps)

    device = jax.devices()[0].device_kind
    print(f"attention fwd+bwd on {device} ({backend}), {args.dtype}, "
          + " ".join(f"{key}={val}" for key, val in shape.items())
          + f", {args.documents} documents per row on average, causal; median of {args.rounds} "
          f"rounds x {args.steps} steps")
    base = statistics.median(times["xla_dense_mask"])
    medians = {}
    for name in paths:
        if name in skipped:
            print(f"  {name:20s} skipped: {skipped[name]}")
            continue
        medians[name] = statistics.median(times[name])
        print(f"  {name:20s} {medians[name]:10.3f} ms   x{medians[name] / base:6.3f}")
    if "pallas_segment_ids_note" in skipped:
        print(f"  note: pallas_segment_ids {skipped['pallas_segment_ids_note']}")
    if args.json:
        print(json.dumps({"device": device, "backend": backend, "dtype": args.dtype, **shape,
                          "ms_per_fwd_bwd": medians}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
