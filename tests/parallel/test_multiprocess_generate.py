"""`python -m paxlite generate` over two processes (2 CPU devices each, Pax's --multiprocess_gpu
flags, JAX's gloo collectives): one SPMD decode loop over a mesh whose data axis spans the
processes, the KV cache sharded across both. The tokens equal a one-process greedy reference, and
only process 0 prints them."""

import json
import subprocess

import jax.numpy as jnp
import numpy as np
import pytest

from tests.fork_server import paxlite_python
from tests.parallel.test_multiprocess import _env, _free_port

PROMPTS = ([5, 9, 200, 17], [42], [7, 7, 3])  # 3 rows: padded to 4 for the batch axes
NEW = 4
MODEL = ["--fdl.NUM_LAYERS=1"]


def _checkpoint(directory):
    """A TinySynthetic (one layer) checkpoint of seeded random parameters, written in-process as
    `convert` writes one (model_config.json beside it); (its model, its params)."""
    import fiddle as fdl
    import jax
    from flax import linen as nn

    from paxlite.checkpointing.pretrained import save_params
    from paxlite.experiments.build import load_experiment
    from paxlite.models.transformer import Transformer

    experiment = load_experiment("TinySynthetic", [m.removeprefix("--fdl.") for m in MODEL])
    model = Transformer(fdl.build(experiment.model_config()))
    shapes = nn.meta.unbox(jax.eval_shape(model.init, jax.random.key(0),
                                          jnp.zeros((1, 8), jnp.int32))["params"])
    # N(0, 0.5) everywhere: the initialisation's small weights make a model that repeats its input
    rng = np.random.default_rng(3)
    params = jax.tree.map(lambda s: (0.5 * rng.standard_normal(s.shape)).astype(s.dtype), shapes)
    save_params(directory, params, model_config=model.config)
    return model, params


def _greedy_reference(model, params, prompts, new):
    """One process, no cache: the full forward pass, argmax at every step. The rows are decoded
    together, right-padded to one length, so the forward pass compiles once: the model is causal,
    so a row's logits at its last token do not see the padding after it."""
    import jax

    seqs = [list(p) for p in prompts]
    forward = jax.jit(lambda tokens: model.apply({"params": params}, tokens))
    width = max(map(len, prompts)) + new
    for _ in range(new):
        tokens = np.zeros((len(seqs), width), np.int32)
        for row, seq in enumerate(seqs):
            tokens[row, :len(seq)] = seq
        logits = np.asarray(forward(jnp.asarray(tokens)))
        for row, seq in enumerate(seqs):
            seq.append(int(np.argmax(logits[row, len(seq) - 1])))
    return [seq[len(p):] for seq, p in zip(seqs, prompts, strict=True)]


@pytest.mark.multiprocess
def test_two_processes_generate_the_one_process_tokens(tmp_path):
    model, params = _checkpoint(tmp_path / "model")
    port = _free_port()
    procs = [subprocess.Popen(
        [paxlite_python(), "-m", "paxlite", "generate", f"--checkpoint={tmp_path / 'model'}",
         "--fdl_config=TinySynthetic", *MODEL,
         "--fdl.ICI_MESH_SHAPE=[1,2,1]", "--fdl.DCN_MESH_SHAPE=[2,1,1]",  # data over processes
         *[f"--prompt_ids={','.join(map(str, p))}" for p in PROMPTS],
         f"--max_new_tokens={NEW}", "--format=json", "--multiprocess_gpu",
         f"--server_addr=127.0.0.1:{port}", "--num_hosts=2", f"--host_idx={i}"],
        env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
    # gloo's C++ side prints its connection lines on stdout too (CPU collectives only), sometimes
    # interleaved: the outputs are the JSON lines, all from process 0
    printed = [[line for line in out.splitlines() if line.startswith("{")] for out, _ in outputs]
    assert printed[1] == [], printed[1]  # process 1 stays quiet
    records = [json.loads(line) for line in printed[0]]
    assert [r["prompt_ids"] for r in records] == [list(p) for p in PROMPTS]
    want = _greedy_reference(model, params, PROMPTS, NEW)
    assert [r["ids"] for r in records] == want
