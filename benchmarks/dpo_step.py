"""CPU step time and memory of a DPO step against the SFT step of the same model and batch.

Why: a DPO step runs the reference model forward beside the policy's forward and backward, and
(full fine-tuning) holds the reference's parameters; docs/chat.md states what that costs. This
benchmark builds, in one process, on a 1-device mesh, the jitted train steps (`compile_steps`:
forward, backward, Adam) of one model for

- ``sft``: the cross entropy over the learned tokens of the batch (TRAIN_TASK=chat's step);
- ``dpo``: DPO with a reference of its own (full fine-tuning; the reference's parameters are an
  argument of the step);
- ``sft_lora`` / ``dpo_lora``: the same with LoRA adapters (the reference is the base model with
  the adapters off, inside the step),

on the same batch (one pair a row: chosen then rejected, so both steps see the same tokens), times
them in interleaved rounds (A/B, B/A, ...) and reports median ms/step, the ratio DPO / SFT, XLA's
FLOP count of each compiled step (`cost_analysis`) and its argument and temporary bytes
(`memory_analysis`).

    .venv/bin/python benchmarks/dpo_step.py --steps 3 --rounds 5
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paxlite.models.lora import is_lora_path
from paxlite.models.transformer import Transformer, TransformerConfig
from paxlite.parallel.mesh import MeshConfig, build_mesh
from paxlite.train.dpo import DpoSteps
from paxlite.train.step import compile_steps


def _batch(*, rows: int, seq: int, vocab: int) -> dict[str, np.ndarray]:
    """One pair a row, each side half the row: a quarter prompt, three quarters learned."""
    rng = np.random.default_rng(0)
    half = seq // 2
    inputs = rng.integers(1, vocab, (rows, seq)).astype(np.int32)
    segment = np.repeat(np.array([1, 2], np.int32), half)[None].repeat(rows, 0)
    positions = np.tile(np.arange(half, dtype=np.int32), 2)[None].repeat(rows, 0)
    targets = np.zeros_like(inputs)
    weights = np.zeros(inputs.shape, np.float32)
    for start in (0, half):
        targets[:, start:start + half - 1] = inputs[:, start + 1:start + half]
        weights[:, start + half // 4 - 1:start + half - 1] = 1.0
    return {"inputs": inputs, "targets": targets, "weights": weights, "positions": positions,
            "segment_ids": segment}


def _case(config: TransformerConfig, *, dpo: bool, lora: bool, mesh, batch):
    schedule = optax.constant_schedule(1e-4)
    steps = compile_steps(
        model=Transformer(config), optimizer=optax.adam(schedule), schedule=schedule, mesh=mesh,
        seq_len=config.max_seq_len, seed=0, deterministic=True,
        trainable=is_lora_path if lora else None,
        dpo=DpoSteps(beta=0.1, train=True, eval=False, separate_reference=not lora)
        if dpo else None)
    state = steps.init()
    reference = ()
    if steps.abstract_reference:
        reference = (jax.tree.map(jnp.copy, state.params),)
    compiled = steps.train.lower(state, batch, *reference).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    memory = compiled.memory_analysis()

    def run(state, n):
        for _ in range(n):
            state, metrics = compiled(state, batch, *reference)
        jax.block_until_ready(metrics["loss"])
        return state

    state = run(state, 1)  # warm
    return {"run": run, "state": state, "gflop": cost.get("flops", float("nan")) / 1e9,
            "argument_mb": memory.argument_size_in_bytes / 2**20,
            "temp_mb": memory.temp_size_in_bytes / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dims", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rows", type=int, default=8)
    args = parser.parse_args()
    config = TransformerConfig(vocab_size=4096, num_layers=args.layers, model_dims=args.dims,
                               num_heads=4, dims_per_head=args.dims // 4,
                               hidden_dims=4 * args.dims, max_seq_len=args.seq)
    mesh = build_mesh(MeshConfig(ici_mesh_shape=(1, 1, 1)), devices=jax.devices()[:1])
    batch = _batch(rows=args.rows, seq=args.seq, vocab=config.vocab_size)
    print(f"jax {jax.__version__}, {platform.machine()}, {os.cpu_count()} CPUs; model "
          f"{args.layers} layers x d {args.dims}, vocab {config.vocab_size}, {args.rows} rows x "
          f"{args.seq} tokens; {args.rounds} rounds of {args.steps} steps")
    print("| pair | SFT ms/step | DPO ms/step | median ratio | per-round ratios | GFLOP SFT / "
          "DPO | argument MiB SFT / DPO | temp MiB SFT / DPO |")
    print("|---|---|---|---|---|---|---|---|")
    with jax.set_mesh(mesh):
        for name, lora in (("full", False), ("lora", True)):
            lora_config = dataclasses.replace(config, lora_rank=8) if lora else config
            cases = {kind: _case(lora_config, dpo=kind == "dpo", lora=lora, mesh=mesh,
                                 batch=batch) for kind in ("sft", "dpo")}
            times = {kind: [] for kind in cases}
            for round_index in range(args.rounds):
                order = ("sft", "dpo") if round_index % 2 == 0 else ("dpo", "sft")
                for kind in order:
                    case = cases[kind]
                    started = time.perf_counter()
                    case["state"] = case["run"](case["state"], args.steps)
                    times[kind].append(1000 * (time.perf_counter() - started) / args.steps)
            ratios = [d / s for s, d in zip(times["sft"], times["dpo"], strict=True)]
            sft, dpo = cases["sft"], cases["dpo"]
            print(f"| {name} | {statistics.median(times['sft']):.1f} | "
                  f"{statistics.median(times['dpo']):.1f} | **{statistics.median(ratios):.2f}** | "
                  f"{', '.join(f'{r:.2f}' for r in ratios)} | {sft['gflop']:.2f} / "
                  f"{dpo['gflop']:.2f} | {sft['argument_mb']:.1f} / {dpo['argument_mb']:.1f} | "
                  f"{sft['temp_mb']:.1f} / {dpo['temp_mb']:.1f} |")


if __name__ == "__main__":
    main()
