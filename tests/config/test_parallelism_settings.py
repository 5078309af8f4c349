"""Pipeline and seq settings: what they resolve to, and one line naming the numbers for what cannot
run, before anything is compiled (experiments/parallelism_settings.py, train/grad_accum.py).

The rules are the configs' (PipelineConfig.problems, check_seq_divides); the messages name the
hyperparameters (parallelism_settings.PIPELINE_FIELD_NAMES)."""

import fiddle as fdl
import pytest

from paxlite.config.errors import ConfigError
from paxlite.errors import SettingError
from paxlite.experiments.build import load_experiment
from paxlite.models.parallel_config import PipelineConfig
from paxlite.train.grad_accum import pipeline_microbatches


def _problem(overrides, name="TinySynthetic") -> str:
    with pytest.raises(ConfigError) as info:
        fdl.build(load_experiment(name, list(overrides)).run_config())
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(("overrides", "expected"), [
    (["NUM_LAYERS=6", "ICI_MESH_SHAPE=[1,1,1,1,4]"],
     ("NUM_LAYERS=6 does not split into 4 pipeline stages x PIPELINE_REPEATS=1: the layer count "
     "must be a multiple of 4")),
    (["NUM_LAYERS=4", "ICI_MESH_SHAPE=[1,1,1,1,2]", "PIPELINE_REPEATS=2", "NUM_MICROBATCHES=1"],
     ("PIPELINE_REPEATS=2 (the circular schedule) needs at least as many microbatches as stages: "
     "NUM_MICROBATCHES=1 < 2 stages")),
    (["NUM_STAGES=3", "ICI_MESH_SHAPE=[2,1,1,4]"],
     ("NUM_STAGES=3 is not a multiple of the pipeline mesh axis (2 = ICI [2, 1, 1, 4] x DCN [1, 1, "
     "1])")),
    (["NUM_MICROBATCHES=4"], "NUM_MICROBATCHES set, but the run has one pipeline stage"),
    # the rule is data/context_order.py's check_seq_divides, reported under the settings' names
    (["MAX_SEQ_LEN=24", "ICI_MESH_SHAPE=[1,1,1,1,1,8]"],
     ("MAX_SEQ_LEN=24 (CONTEXT_PARALLEL_LOAD_BALANCE=True): sequence length 24 does not divide "
      "over the seq mesh axis of size 8: load balancing (dual_chunk_swap) cuts each row into "
      "2 * 8 = 16 equal chunks; use a sequence length that is a multiple of 16")),
    (["MAX_SEQ_LEN=20", "ICI_MESH_SHAPE=[1,1,1,1,1,8]", "CONTEXT_PARALLEL_LOAD_BALANCE=false"],
     ("MAX_SEQ_LEN=20 (CONTEXT_PARALLEL_LOAD_BALANCE=False): sequence length 20 does not divide "
      "over the seq mesh axis of size 8: each of the 8 shards holds an equal slice of every row; "
      "use a sequence length that is a multiple of 8")),
    (["CONTEXT_PARALLEL_STRATEGY=ring"], ("CONTEXT_PARALLEL_STRATEGY set, but the mesh has no seq "
                                         "axis")),
    (["NUM_MICROBATCHES=2", "MICROBATCH_SIZE=4", "ICI_MESH_SHAPE=[1,1,1,1,2]"],
     "NUM_MICROBATCHES=2 and MICROBATCH_SIZE=4 both set"),
])
def test_settings_that_cannot_run_are_one_line(overrides, expected):
    assert expected in _problem(overrides)


def test_glam_layers_count_in_scan_units():
    # GLaM scans a dense + MoE pair: 4 layers are 2 units, which do not split into 4 stages
    assert ("NUM_LAYERS=4 (2 units of 2 layers) does not split into 4 pipeline stages"
            in _problem(["ICI_MESH_SHAPE=[1,1,1,1,4]", "NUM_LAYERS=4", "USE_REPEATED_LAYER=true"],
                        name="TinyGLaM"))


def test_the_batch_of_each_pass_must_split_into_microbatches_over_the_batch_axes():
    pipe = PipelineConfig(num_stages=2, num_microbatches=3)
    with pytest.raises(SettingError, match=r"a batch of 16 rows does not split into 3 pipeline "
                                           r"microbatches"):
        pipeline_microbatches(pipe, global_batch_size=32, grad_accum_steps=2, batch_split=1)
    with pytest.raises(SettingError, match=r"pipeline microbatches of 2 rows \(16 rows / 8 "
                                           r"microbatches\) do not divide over data x fsdp x "
                                           r"expert = 4 ways"):
        pipeline_microbatches(
            PipelineConfig(num_stages=2, num_microbatches=8),
            global_batch_size=16,
            grad_accum_steps=1,
            batch_split=4,
        )
    with pytest.raises(SettingError, match="MICROBATCH_SIZE=3"):
        pipeline_microbatches(PipelineConfig(num_stages=2, microbatch_size=3), global_batch_size=16,
                              grad_accum_steps=1, batch_split=1)
    assert (
        pipeline_microbatches(
            PipelineConfig(num_stages=4), global_batch_size=16, grad_accum_steps=1, batch_split=2
        )
        == 4
    )  # default: as many as stages


def test_show_reports_the_schedule_and_the_seq_split():
    from paxlite.cli.show import describe

    info = describe(
        load_experiment(
            "TinySynthetic",
            [
                "NUM_LAYERS=8",
                "ICI_MESH_SHAPE=[1,1,1,1,4,2]",
                "PIPELINE_REPEATS=2",
                "NUM_MICROBATCHES=4",
            ],
        ),
        num_local_devices=8,
    )
    assert info["mesh"] == {"pipeline": 4, "data": 1, "fsdp": 1, "seq": 2, "tensor": 1, "expert": 1}
    assert info["pipeline"] == {
        "num_stages": 4,
        "repeats": 2,
        "schedule": "circular",
        "num_microbatches": 4,
        "microbatch_rows": 4,
        "bubble_fraction": round(3 / 11, 4),
    }
    assert info["sequence_parallel"] == {"seq": 2, "strategy": "all_gather", "load_balance": True,
                                         "tokens_per_shard": 32}
    plain = describe(load_experiment("TinySynthetic", []), num_local_devices=8)
    assert "pipeline" not in plain and "sequence_parallel" not in plain
