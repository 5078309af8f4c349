"""Three things XLA's GPU compiler showed at scale, each compiled here for 8 compile-only H100s.

Every program is the real train step of a run (`planner.search.compile_train_step`, with the run's
XLA preset), and each assertion failed before its fix:

- grouped-query attention with fewer kv heads than the tensor axis (2 on tensor 4): the parameters
  were refused ("dimension 2 over tensor=4"); with the kv heads merely replicated, cuDNN's
  attention refuses query heads split beside whole kv heads ("Query, key and value should have
  same sharding"). The kv kernels are now replicated and the kv activations repeated to 4 heads
  (compiled with cuDNN on that mesh in test_kernels.py's `gqa_tensor4`);
- the embedding, final norm and logits around a pipeline were computed whole by every stage:
  temporaries 129.6 MiB here, now 33.0 (each stage computes 1/4 of the rows);
- the circular schedule at R = 3 on 8 stages replicated the whole layer stack on every device
  (temporaries 589.9 MiB, twice the 291 MiB stack); the layers now move to their stages (104.5).
"""

from __future__ import annotations

import math

import fiddle as fdl
import flax.linen as nn
import jax
import pytest

from paxlite.experiments.build import load_experiment
from paxlite.models.transformer import abstract_variables
from paxlite.planner.results import StepMeasurement
from paxlite.planner.search import compile_train_step

pytestmark = pytest.mark.gpu_compile
TINY = "paxlite.experiments.tiny."
# 24 layers of d_model 512 (7.3 MiB of float32 weights each) as 8 stages, short rows: the stack,
# not the activations, is what a device's temporaries would hold
CIRCULAR = ("NUM_LAYERS=24", "MODEL_DIMS=512", "HIDDEN_DIMS=2048", "NUM_HEADS=8",
            "DIMS_PER_HEAD=64", "MAX_SEQ_LEN=16", "ICI_MESH_SHAPE=[1,1,1,1,8]",
            "NUM_MICROBATCHES=8", "PIPELINE_REPEATS=3", "USE_REPEATED_LAYER=True",
            "CHECKPOINT_POLICY='SAVE_NOTHING'", "PERCORE_BATCH_SIZE=2")
# data 2 x pipeline 4 with a vocabulary of 16384: the float32 logits dominate
LOGITS = ("NUM_LAYERS=4", "VOCAB_SIZE=16384", "MAX_SEQ_LEN=128", "ICI_MESH_SHAPE=[2,1,1,1,4]",
          "NUM_MICROBATCHES=4", "USE_REPEATED_LAYER=True", "PERCORE_BATCH_SIZE=2")


def _compile(name: str, *overrides: str) -> tuple[StepMeasurement, object]:
    experiment = load_experiment(TINY + name, overrides)
    return compile_train_step(experiment, num_devices=8, target="h100"), experiment


def test_the_circular_schedule_holds_no_copy_of_the_whole_stack():
    result, experiment = _compile("TinySynthetic", *CIRCULAR)
    assert result.mesh.pipeline == 8
    layers = nn.meta.unbox(abstract_variables(fdl.build(experiment.model_config())))["params"]
    stack = sum(math.prod(leaf.shape) * leaf.dtype.itemsize
                for leaf in jax.tree.leaves(layers["layers"]))
    assert result.memory.temp_bytes < stack / 2, (result.memory.temp_bytes, stack)


def test_each_stage_computes_its_share_of_the_logits():
    result, _ = _compile("TinySynthetic", *LOGITS)
    batch, seq = result.global_batch_size, result.seq_len
    # float32 logits of one data shard's rows: what every stage held before (and their gradient)
    data_shard_logits = batch // result.mesh.data * seq * 16384 * 4
    assert result.memory.temp_bytes < data_shard_logits, result.memory
