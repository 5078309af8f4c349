"""Checkpoints and pipelines (issue 24): a pipelined run stopped and resumed continues bit for bit,
and the saved layout does not depend on the mesh, so a checkpoint of a (data, fsdp, tensor) =
(2,2,2) run resumes on a pipelined mesh and the other way round, each step's loss within 1e-5 of the
uninterrupted (2,2,2) run (same global batch). Evaluation runs on the pipelined mesh too (the eval
step pipelines).

A pipelined step is compiled afresh in every run (it stays out of the session's compilation cache,
train/step.py), and that is most of a run here; so the runs form one chain with two pipelined runs:
the flat run goes straight to step 3N; the pipelined run resumes its checkpoint of step N and goes
on to 3N, saving at 2N (the flat-to-pipelined case, and the uninterrupted pipelined steps 2N+1..3N);
its checkpoint of step 2N is resumed once on the pipelined mesh (bit for bit against it) and once on
the flat one. A run stopped after step S is a finished run's directory cut back to step S (its
checkpoints and metrics lines up to S: what a run of the same job with MAX_STEPS=S leaves, whose
checkpoint at S is the same state), not a run of its own.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import jax
import numpy as np
import pytest

from paxlite.experiments.build import build_run_config
from paxlite.train.loop import Run, RunContext

N = 2  # steps between the checkpoints a run resumes from (N, 2N) and to its end (3N)
COMMON = [
    "NUM_LAYERS=2",
    "SUMMARY_INTERVAL_STEPS=1",
    f"CHECKPOINT_EVERY_N_STEPS={N}",
    f"EVAL_INTERVAL_STEPS={N}",
    "EVAL_LOOP_NUM_BATCHES=1",
    "LR_COS_WARMUP=1",
    "LR_COS_DECAY_END=8",
]
FLAT = ["ICI_MESH_SHAPE=[2,2,2]"]  # (data, fsdp, tensor)
PIPELINED = ["ICI_MESH_SHAPE=[2,2,1,1,2]", "NUM_MICROBATCHES=2"]  # (data, fsdp, pipeline)


def _run(job_dir, overrides, *, saving=True) -> object:
    _, config = build_run_config("TinySynthetic", COMMON + list(overrides))
    with Run(config, RunContext(job_dir=str(job_dir), enable_checkpoint_saving=saving)) as run:
        return jax.device_get(run.train())


def _lines(job_dir, key: str) -> dict[int, dict]:
    with open(os.path.join(job_dir, "metrics.jsonl")) as f:
        return {line["step"]: line for line in map(json.loads, f) if key in line}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(final state, job directory) by mesh name: "flat", the straight 3N-step run; "pipelined",
    the flat run stopped after step N and resumed on the pipelined mesh to step 3N (saving)."""
    flat = tmp_path_factory.mktemp("flat_straight")
    flat_state = _run(flat, FLAT + [f"MAX_STEPS={3 * N}"])
    pipelined = tmp_path_factory.mktemp("flat_then_pipelined") / "job"
    _stopped_after(flat, pipelined, step=N)
    pipelined_state = _run(pipelined, PIPELINED + [f"MAX_STEPS={3 * N}"])
    return {"flat": (flat_state, flat), "pipelined": (pipelined_state, pipelined)}


def _stopped_after(finished_dir, job, *, step: int) -> None:
    """`job`: the finished run's directory as a run stopped after `step` would have left it, its
    checkpoints of later steps and its metrics lines of later steps removed."""

    def later_checkpoints(_, names):
        return [name for name in names
                if (m := re.fullmatch(r"checkpoint_(\d+)", name)) and int(m.group(1)) > step]

    shutil.copytree(finished_dir, job, ignore=later_checkpoints)
    with open(os.path.join(finished_dir, "metrics.jsonl")) as f:
        kept = [line for line in f if json.loads(line)["step"] <= step]
    with open(os.path.join(job, "metrics.jsonl"), "w") as f:
        f.writelines(kept)
    saved = sorted(os.listdir(os.path.join(job, "checkpoints")))
    assert saved[-1] == f"checkpoint_{step:08d}", saved


def _resume(tmp_path, finished_dir, mesh):
    """The pipelined run of `finished_dir` stopped after step 2N, resumed on `mesh` to step 3N
    (its state returned; a checkpoint of step 3N would be read by nothing)."""
    job = tmp_path / "job"
    _stopped_after(finished_dir, job, step=2 * N)
    state = _run(job, mesh + [f"MAX_STEPS={3 * N}"], saving=False)
    return job, state


def test_a_pipelined_run_resumes_bit_for_bit(tmp_path, runs):
    straight_state, straight_dir = runs["pipelined"]  # uninterrupted on the pipelined mesh after N
    job, state = _resume(tmp_path, straight_dir, PIPELINED)
    got, want = _lines(job, "loss"), _lines(straight_dir, "loss")
    assert sorted(got) == sorted(want) == list(range(1, 3 * N + 1))
    resumed = [s for s in want if s > 2 * N]  # steps 1..2N are the straight run's own lines
    assert [got[s]["loss"] for s in resumed] == [want[s]["loss"] for s in resumed]
    assert [got[s]["grad_norm"] for s in resumed] == [want[s]["grad_norm"] for s in resumed]
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(straight_state), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # the pipelined eval step ran at both boundaries and agrees too
    evals, evals_ref = _lines(job, "eval/loss"), _lines(straight_dir, "eval/loss")
    assert (
        sorted(evals) == [N, 2 * N, 3 * N]
        and evals[3 * N]["eval/loss"] == evals_ref[3 * N]["eval/loss"]
    )


@pytest.mark.parametrize(("start", "finish"), [("flat", "pipelined"), ("pipelined", "flat")])
def test_a_checkpoint_resumes_on_the_other_mesh(tmp_path, runs, start, finish):
    """flat -> pipelined: the fixture's pipelined run (resumed from the flat run's step N);
    pipelined -> flat: its checkpoint of step 2N, resumed on the flat mesh."""
    _, reference_dir = runs["flat"]
    if start == "flat":
        state, job = runs["pipelined"]
        first_resumed = N + 1
    else:
        job, state = _resume(tmp_path, runs["pipelined"][1], FLAT)
        first_resumed = 2 * N + 1
    got, want = _lines(job, "loss"), _lines(reference_dir, "loss")
    assert sorted(got) == list(range(1, 3 * N + 1))
    for step in want:
        assert abs(got[step]["loss"] - want[step]["loss"]) <= 1e-5 * abs(want[step]["loss"]), (
            step,
            got,
            want,
        )
    evals, evals_ref = _lines(job, "eval/loss"), _lines(reference_dir, "eval/loss")
    for step in range(first_resumed + N - 1, 3 * N + 1, N):  # the evaluations after the resume
        assert (
            abs(evals[step]["eval/loss"] - evals_ref[step]["eval/loss"])
            <= 1e-5 * evals_ref[step]["eval/loss"]
        )
    # the parameters after the resumed steps equal the flat run's (Adam may amplify round-off of
    # gradients that are zero in exact arithmetic, so a relative tolerance on the whole tree)
    flat_params = jax.tree.leaves(runs["flat"][0].params)
    for x, y in zip(jax.tree.leaves(state.params), flat_params, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)


def test_a_pipelined_checkpoint_decodes_as_the_flat_one(runs, capsys):
    """`generate` on the pipelined job (its own pipelined mesh; decoding runs the plain layer stack
    over the same parameters) gives the greedy tokens of the same checkpoint on the flat mesh."""
    from paxlite.__main__ import main

    _, pipelined_dir = runs["pipelined"]
    flags = ["generate", f"--job_log_dir={pipelined_dir}", "--fdl_config=TinySynthetic",
             *[f"--fdl.{o}" for o in COMMON], "--prompt_ids=3,1,4,1,5", "--prompt_ids=2,7,1,8",
             "--max_new_tokens=6", "--temperature=0", "--format=json"]
    outputs = []
    for mesh in (PIPELINED, FLAT):
        assert main([*flags, *[f"--fdl.{o}" for o in mesh]]) == 0
        outputs.append([json.loads(line)["ids"] for line in capsys.readouterr().out.splitlines()])
    pipelined, flat = outputs
    assert len(pipelined) == 2 and all(len(ids) == 6 for ids in pipelined)
    assert pipelined == flat


def test_cpu_programs_with_pipeline_or_seq_loops_stay_out_of_the_persistent_cache():
    """XLA:CPU deadlocked in the collectives of a pipelined step read back from JAX's persistent
    cache (`NotPersistentlyCached`): such steps compile with an infinite minimum
    compile time for the cache, so they are never written, also when the planner compiles them
    through `lower` (a CPU run of the same step would read the planned program back); other meshes
    keep the cache."""
    from jax._src import config as jax_config

    from paxlite.train.persistent_cache import cache_safe

    seen = []

    def record():
        seen.append(jax_config.persistent_cache_min_compile_time_secs.value)

    class Step:  # a jitted step's surface: called, or lowered and compiled (the planner)
        def __call__(self):
            record()

        def lower(self):
            return self

        def compile(self):
            record()

    for shape, guarded in (((1, 1, 1, 1, 2), True), ((1, 1, 1, 1, 1, 2), True), ((2, 2, 2), False)):
        seen.clear()
        step = cache_safe(Step(), _mesh_of(shape))
        step()
        step.lower().compile()
        assert (seen == [float("inf")] * 2) is guarded, (shape, seen)
    assert jax_config.persistent_cache_min_compile_time_secs.value != float("inf")


def _mesh_of(shape):
    from paxlite.parallel.mesh import MeshConfig, build_mesh

    devices = jax.devices()[: int(np.prod(shape))]
    return build_mesh(MeshConfig(ici_mesh_shape=shape), devices=devices)
