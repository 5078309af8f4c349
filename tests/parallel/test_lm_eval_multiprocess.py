"""`python -m paxlite lm_eval` over two processes (4 CPU devices each, Pax's --multiprocess_gpu
flags): process 0 runs lm_eval and both compute every batch, over a mesh whose data axis spans the
processes. Its results file equals the one of a single process on the same 8-device mesh."""

import json
import os
import pathlib
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxlite.__main__ import main
from tests.fork_server import paxlite_python
from tests.parallel.test_multiprocess import _env, _free_port

TASKS_DIR = pathlib.Path(__file__).resolve().parents[1] / "testdata" / "lm_eval"
TASKS = ("paxlite_mc", "paxlite_ppl", "paxlite_gen")
EXPERIMENT = "paxlite.experiments.tiny.TinyLLaMA"


def _checkpoint(directory, vocab: str) -> list[str]:
    """A TinyLLaMA checkpoint of seeded random parameters (MAX_SEQ_LEN 32: the perplexity
    documents take several windows), written as `convert` writes one; its --fdl flags."""
    import fiddle as fdl
    from flax import linen as nn

    from paxlite.checkpointing.pretrained import save_params
    from paxlite.experiments.build import load_experiment
    from paxlite.models.transformer import Transformer

    flags = ["--fdl.MAX_SEQ_LEN=32", f"--fdl.VOCAB_PATH={vocab}"]
    experiment = load_experiment(EXPERIMENT, [f.removeprefix("--fdl.") for f in flags])
    model = Transformer(fdl.build(experiment.model_config()))
    shapes = nn.meta.unbox(jax.eval_shape(model.init, jax.random.key(0),
                                          jnp.zeros((1, 8), jnp.int32))["params"])
    rng = np.random.default_rng(5)
    params = jax.tree.map(lambda s: (0.3 * rng.standard_normal(s.shape)).astype(s.dtype), shapes)
    save_params(directory, params, model_config=model.config)
    return flags


def _flags(model, fdl, output):
    return ["lm_eval", f"--checkpoint={model}", f"--fdl_config={EXPERIMENT}", *fdl,
            f"--tasks={','.join(TASKS)}", f"--include_path={TASKS_DIR}", "--bootstrap_iters=0",
            "--batch_size=2", "--log_samples", f"--output_path={output}"]


@pytest.mark.multiprocess
def test_two_processes_score_as_one(tmp_path, monkeypatch):
    from tests.interop.test_hf_export import train_bpe

    fdl = _checkpoint(tmp_path / "model", train_bpe(tmp_path / "spm"))
    monkeypatch.chdir(TASKS_DIR)  # the task YAMLs name their data relative to it
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert main([*_flags(tmp_path / "model", [*fdl, "--fdl.ICI_MESH_SHAPE=[2,2,2]"],
                         tmp_path / "one.json")]) == 0

    port = _free_port()
    env = {**_env(4), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    procs = [subprocess.Popen(
        [paxlite_python(), "-m", "paxlite",
         *_flags(tmp_path / "model", [*fdl, "--fdl.ICI_MESH_SHAPE=[1,2,2]",
                                       "--fdl.DCN_MESH_SHAPE=[2,1,1]"],  # data over processes
                 tmp_path / f"two_{i}.json"),
         "--multiprocess_gpu", f"--server_addr=127.0.0.1:{port}", "--num_hosts=2",
         f"--host_idx={i}"],
        cwd=TASKS_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)]
    try:
        outputs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    tails = "\n".join(f"--- process {i}\n{err[-3000:]}" for i, (_, err) in enumerate(outputs))
    assert [p.returncode for p in procs] == [0, 0], tails
    assert not os.path.exists(tmp_path / "two_1.json")  # process 1 computes, writes nothing
    assert "|paxlite_mc" in outputs[0][0] and "|paxlite_mc" not in outputs[1][0]
    one = json.loads((tmp_path / "one.json").read_text())
    two = json.loads((tmp_path / "two_0.json").read_text())
    for task in TASKS:
        for key, value in one["results"][task].items():
            if isinstance(value, float):
                assert two["results"][task][key] == pytest.approx(value, rel=1e-5), (task, key)
            else:
                assert two["results"][task][key] == value, (task, key)
        by_doc = [sorted(run["samples"][task], key=lambda s: s["doc_id"]) for run in (one, two)]
        for a, b in zip(*by_doc, strict=True):
            if task == "paxlite_gen":
                assert a["resps"] == b["resps"]
            else:
                got = [r[0][0] if isinstance(r[0], list) else r[0] for r in b["resps"]]
                want = [r[0][0] if isinstance(r[0], list) else r[0] for r in a["resps"]]
                np.testing.assert_allclose(got, want, atol=1e-5)
