"""ms per forward + backward of Llama 4's chunked attention and gpt-oss's sinks, per kernel, on a
TPU.

Why: the fused paths run these two layers differently. XLA's attention (``ATTENTION_IMPLEMENTATION
=xla``, and ``auto``) masks the chunks densely and carries the sinks as one extra key slot with a
bias (models/kernel_masks.py); the splash kernel skips the blocks outside every chunk and takes the
sinks as its own argument; the einsum core (attention kind ``dot_product``) is the reference. Which
is faster, and by how much at long sequences, decides what a Llama 4 or gpt-oss run should set.

Cases, all causal on the same q, k, v (bfloat16, grouped kv heads):
- ``chunked``: chunks of --chunk positions (Llama 4's RoPE layers);
- ``sinks``: one sink logit per head, full causal (gpt-oss's full layers);
- ``sinks_window``: sinks with a sliding window of --window (gpt-oss's sliding layers).

Before timing, each path's output and dq, dk, dv are checked against the einsum core's (the script
fails if one disagrees beyond bfloat16's tolerance). Times are medians over --rounds of --steps
jitted calls, compile excluded; the ratio column is against the einsum core.

    python benchmarks/tpu/attention_variants.py                  # TPU: B=1 T=8192 N=16 K=4 H=128
    python benchmarks/tpu/attention_variants.py --cpu --tiny     # seconds on CPU (a smoke test)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

CASES = ("chunked", "sinks", "sinks_window")
PATHS = ("einsum", "xla", "splash")


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run on CPU (splash interpreted)")
    parser.add_argument("--tiny", action="store_true",
                        help="B=1 T=256 N=2 K=1 H=128 chunk 128 window 64, 1 round of 1 step")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="also print one JSON line of results")
    args = parser.parse_args(argv)
    if args.tiny:
        args.batch, args.seq_len, args.heads, args.kv_heads = 1, 256, 2, 1
        args.chunk, args.window, args.steps, args.rounds = 128, 64, 1, 1
    unknown = set(args.cases.split(",")) - set(CASES)
    if unknown:
        parser.error(f"--cases: unknown {sorted(unknown)}; known: {', '.join(CASES)}")
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp
    import numpy as np

    from paxlite.models.attention_kernels import AttentionImplementation as Impl
    from paxlite.models.attention_kernels import einsum_attention, flash_attention
    from paxlite.models.kernel_masks import chunk_mask, make_attention_mask, sliding_window_mask

    interpret = jax.default_backend() != "tpu"
    b, t, n, kv, h = args.batch, args.seq_len, args.heads, args.kv_heads, args.head_dim
    keys = jax.random.split(jax.random.key(0), 5)
    q = (jax.random.normal(keys[0], (b, t, n, h)) * h**-0.5).astype(jnp.bfloat16)
    k, v = (jax.random.normal(key, (b, t, kv, h)).astype(jnp.bfloat16) for key in keys[1:3])
    dout = jax.random.normal(keys[3], q.shape).astype(jnp.bfloat16)
    sinks = jax.random.normal(keys[4], (n,), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

    def settings(case):
        chunk = args.chunk if case == "chunked" else None
        window = args.window if case == "sinks_window" else None
        return chunk, window, None if case == "chunked" else sinks

    def path(case, name):
        chunk, window, case_sinks = settings(case)
        if name == "einsum":
            mask = make_attention_mask(seq_len=t, segment_ids=None)
            if chunk is not None:
                mask = mask & chunk_mask(positions, positions, chunk=chunk)
            if window is not None:
                mask = mask & sliding_window_mask(positions, positions, window=window)
            return lambda q, k, v: einsum_attention(q, k, v, mask=mask, dtype=jnp.bfloat16,
                                                    sinks=case_sinks)
        implementation = Impl.XLA if name == "xla" else Impl.SPLASH
        return lambda q, k, v: flash_attention(
            q, k, v, implementation=implementation, sliding_window=window, chunk=chunk,
            positions=positions, sinks=case_sinks, interpret=interpret and name == "splash")

    def fwd_bwd(fn):
        def both(q, k, v, dout):
            out, vjp = jax.vjp(fn, q, k, v)
            return (out, *vjp(dout))
        return jax.jit(both)

    rows = []
    for case in args.cases.split(","):
        compiled = {name: fwd_bwd(path(case, name)) for name in PATHS}
        results = {name: fn(q, k, v, dout) for name, fn in compiled.items()}
        reference = results["einsum"]
        for name, got in results.items():
            for part, g, w in zip(("out", "dq", "dk", "dv"), got, reference, strict=True):
                g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
                err = float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-6))
                if err > 3e-2:
                    print(f"FAIL: {case} {name} {part} differs from the einsum core by {err:.2e} "
                          "(relative to its max; tolerance 3e-2)")
                    return 1
        times: dict[str, list[float]] = {name: [] for name in compiled}
        for _ in range(args.rounds):
            for name, fn in compiled.items():
                jax.block_until_ready(fn(q, k, v, dout))
                start = time.perf_counter()
                for _ in range(args.steps):
                    out = fn(q, k, v, dout)
                jax.block_until_ready(out)
                times[name].append((time.perf_counter() - start) / args.steps * 1e3)
        base = statistics.median(times["einsum"])
        for name in PATHS:
            ms = statistics.median(times[name])
            rows.append(dict(case=case, path=name, ms=round(ms, 3), vs_einsum=round(ms / base, 3)))

    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}; "
          f"B={b} T={t} N={n} K={kv} H={h} bfloat16, chunk {args.chunk}, window {args.window}")
    print("| case | path | ms fwd+bwd | / einsum |")
    print("|---|---|--:|--:|")
    for row in rows:
        print(f"| {row['case']} | {row['path']} | {row['ms']:.3f} | {row['vs_einsum']:.3f} |")
    if args.json:
        print(json.dumps(dict(device=device.device_kind, shape=dict(B=b, T=t, N=n, K=kv, H=h),
                              chunk=args.chunk, window=args.window, rows=rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
