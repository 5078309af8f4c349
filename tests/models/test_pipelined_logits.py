"""Around a pipelined stack each stage computes its share of the embedding, final norm and logits.

The layers run as a pipeline over the `pipeline` axis; what comes before and after them (embedding,
final norm, logits, loss) used to run with the rows split over the batch axes only, so every stage
computed every row's logits. Their rows are now split over the stages too
("activation_embed_and_logits_batch"). Exactness is the pipeline tests' (test_pipelined_transformer,
tests/train/test_pipeline_seq_training); this is the memory it saves, on the compiled train step.
"""

from paxlite.experiments.build import load_experiment
from paxlite.planner.search import compile_train_step

VOCAB = 16384
# data 2 x pipeline 4, 4 layers, 16 rows of 128 tokens: the float32 logits dominate the step
LOGITS = ("NUM_LAYERS=4", f"VOCAB_SIZE={VOCAB}", "MAX_SEQ_LEN=128", "ICI_MESH_SHAPE=[2,1,1,1,4]",
          "NUM_MICROBATCHES=4", "USE_REPEATED_LAYER=True", "PERCORE_BATCH_SIZE=2")


def test_each_stage_holds_a_quarter_of_its_data_shards_logits():
    """Temporaries 134.5 MiB before (a data shard's logits, 64 MiB, and their gradient on every
    stage), 37.5 MiB now."""
    experiment = load_experiment("paxlite.experiments.tiny.TinySynthetic", LOGITS)
    result = compile_train_step(experiment, num_devices=8, target="cpu")
    assert (result.mesh.data, result.mesh.pipeline) == (2, 4)
    rows = result.global_batch_size // result.mesh.data
    data_shard_logits = rows * result.seq_len * VOCAB * 4
    assert result.memory.temp_bytes < data_shard_logits, result.memory
