"""The Python configuration API: named-axis meshes, hybrid shapes and composable modifiers."""

import fiddle as fdl
import pytest

from paxlite.config.errors import ConfigError
from paxlite.config.modifiers import (
    ChainConfigModifier,
    GradientAccumulationModifier,
    HybridMeshShape,
    MeshShape,
    MeshShapeModifier,
    OverridesModifier,
    RematPolicyModifier,
    mesh_shape_from_axes,
)
from paxlite.experiments.build import configure, load_experiment


def test_mesh_shape_from_axes_uses_axlearn_names():
    assert mesh_shape_from_axes(fsdp=8).as_list() == [1, 8, 1]
    assert mesh_shape_from_axes(data=2, model=4).as_list() == [2, 1, 4]  # model is AXLearn's tensor
    assert mesh_shape_from_axes(data=-1, fsdp=4).resolve(32) == [8, 4, 1]
    # pipeline and seq are the 5th and 6th entries; earlier ones keep their meaning (issue 24)
    assert mesh_shape_from_axes(fsdp=2, pipeline=4).as_list() == [1, 2, 1, 1, 4]
    assert mesh_shape_from_axes(data=2, seq=4).as_list() == [2, 1, 1, 1, 1, 4]
    assert mesh_shape_from_axes(pipeline=2, data=-1, fsdp=2, seq=2).resolve(32) == [
        4,
        2,
        1,
        1,
        2,
        2,
    ]
    with pytest.raises(ConfigError, match="at most one mesh axis may be -1"):
        mesh_shape_from_axes(data=-1, fsdp=-1)
    with pytest.raises(ConfigError, match="do not divide 12 devices"):
        mesh_shape_from_axes(data=-1, fsdp=8).resolve(12)
    with pytest.raises(ConfigError, match="not both"):
        mesh_shape_from_axes(tensor=2, model=2)


def test_mesh_shape_expert_axis_is_the_fourth_entry():
    # A dense shape (expert 1) keeps its 3 entries, as every recorded config has them.
    assert mesh_shape_from_axes(fsdp=2, expert=1).as_list() == [1, 2, 1]
    assert mesh_shape_from_axes(fsdp=2, expert=4).as_list() == [1, 2, 1, 4]
    assert mesh_shape_from_axes(fsdp=2, expert=-1).resolve(8) == [1, 2, 1, 4]
    overrides = MeshShapeModifier(HybridMeshShape(ici=mesh_shape_from_axes(expert=8),
                                                  dcn=mesh_shape_from_axes(data=-1)),
                                  num_local_devices=8, num_processes=2)({})
    assert overrides == {"ICI_MESH_SHAPE": [1, 1, 1, 8], "DCN_MESH_SHAPE": [2, 1, 1]}


def test_axlearn_hybrid_pipeline_and_seq_resolve_into_a_run():
    """AXLearn's documented call: mesh_shape_from_axes(pipeline=.., data=.., fsdp=.., seq=..) for
    ICI and for DCN, in a HybridMeshShape; the run gets a pipeline of the DCN x ICI stages and a seq
    axis."""
    overrides = MeshShapeModifier(
        HybridMeshShape(ici=mesh_shape_from_axes(pipeline=1, data=1, fsdp=2, seq=2),
                        dcn=mesh_shape_from_axes(pipeline=2, data=-1)),
        num_local_devices=4, num_processes=4)({})
    assert overrides == {"ICI_MESH_SHAPE": [1, 2, 1, 1, 1, 2], "DCN_MESH_SHAPE": [2, 1, 1, 1, 2]}
    experiment = configure(
        "TinySynthetic",
        MeshShapeModifier(
            HybridMeshShape(
                ici=mesh_shape_from_axes(fsdp=2, seq=2),
                dcn=mesh_shape_from_axes(pipeline=2, data=-1),
            ),
            num_local_devices=4,
            num_processes=4,
        ),
        NUM_LAYERS=4,
        MAX_SEQ_LEN=64,
    )
    run = fdl.build(experiment.run_config())
    assert run.mesh.axis_sizes(4) == {
        "pipeline": 2,
        "data": 2,
        "fsdp": 2,
        "seq": 2,
        "tensor": 1,
        "expert": 1,
    }
    assert run.model.pipeline.num_stages == 2


def test_configure_matches_the_same_command_line():
    """A chain of modifiers gives exactly the experiment the equivalent --fdl flags give."""
    experiment = configure(
        "Synthetic5B",
        ChainConfigModifier(
            [
                MeshShapeModifier(
                    HybridMeshShape(
                        ici=mesh_shape_from_axes(fsdp=-1), dcn=mesh_shape_from_axes(data=-1)
                    ),
                    num_local_devices=8,
                    num_processes=16,
                ),
                RematPolicyModifier("SAVE_NOTHING"),
                OverridesModifier({"MAX_STEPS": 10}),
            ]
        ),
        LR_COS_WARMUP=500,
    )
    flags = load_experiment(
        "Synthetic5B",
        [
            "ICI_MESH_SHAPE=[1,8,1]",
            "DCN_MESH_SHAPE=[16,1,1]",
            "MAX_STEPS=10",
            "USE_REPEATED_LAYER=true",
            "CHECKPOINT_POLICY=SAVE_NOTHING",
            "LR_COS_WARMUP=500",
        ],
    )
    assert experiment.hparams() == flags.hparams()
    # derived after the override, as on the command line
    assert experiment.LR_COS_DECAY_START == 501
    assert fdl.build(experiment.mesh_config()) == fdl.build(flags.mesh_config())


def test_later_modifiers_win_and_inputs_are_not_mutated():
    first = {"MAX_STEPS": 1}
    chained = ChainConfigModifier(
        [OverridesModifier({"MAX_STEPS": 2}), OverridesModifier({"MAX_STEPS": 3})]
    )
    assert chained(first) == {"MAX_STEPS": 3} and first == {"MAX_STEPS": 1}
    plain = MeshShapeModifier(MeshShape(data=2, fsdp=2, tensor=2))({})
    assert plain == {"ICI_MESH_SHAPE": [2, 2, 2], "DCN_MESH_SHAPE": [1, 1, 1]}


def test_gradient_accumulation_modifier_sets_the_hyperparameter():
    assert GradientAccumulationModifier(4)({"X": 1}) == {"X": 1, "GRAD_ACCUM_STEPS": 4}
    experiment = configure("Synthetic126M", GradientAccumulationModifier(4))
    assert (
        experiment.GRAD_ACCUM_STEPS == 4
        and fdl.build(experiment.loop_config()).grad_accum_steps == 4
    )
    with pytest.raises(ConfigError, match="grad_acc_steps must be an integer >= 1"):
        GradientAccumulationModifier(0)


def test_names_and_values_are_checked_as_on_the_command_line():
    with pytest.raises(ConfigError, match="NUM_LAYRS.*did you mean 'NUM_LAYERS'"):
        configure("Synthetic126M", NUM_LAYRS=2)
    with pytest.raises(ConfigError, match="did you mean"):
        configure("Synthetic126m")


def test_the_example_in_docs_configuration_gives_what_it_says():
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "configuration.md")
    with open(path) as f:
        text = f.read()
    start = text.index("cat > my_configs.py <<'EOF'\n") + len("cat > my_configs.py <<'EOF'\n")
    namespace: dict = {}
    example = compile(text[start : text.index("\nEOF\n", start)], "docs/configuration.md", "exec")
    exec(example, namespace)  # noqa: S102  running the documented example is what this test checks
    experiment = namespace["experiment"]
    assert (experiment.ICI_MESH_SHAPE, experiment.DCN_MESH_SHAPE, experiment.GRAD_ACCUM_STEPS) == (
        [1, 8, 1], [16, 1, 1], 4)
    assert (
        experiment.CHECKPOINT_POLICY == "SAVE_DOT_WITH_NO_BATCH_DIM"
        and experiment.MAX_STEPS == 1000
    )
    assert type(namespace["run_config"].data).__name__ == "SyntheticDataConfig"


def test_global_mesh_shape_is_the_whole_job_split_over_processes():
    from paxlite.config.modifiers import GlobalMeshShapeModifier

    # AXLearn's data=-1, fsdp=8 on four 8-device processes: fsdp within each, data across them
    modifier = GlobalMeshShapeModifier(
        mesh_shape_from_axes(data=-1, fsdp=8), num_devices=32, num_processes=4
    )
    assert modifier({}) == {"ICI_MESH_SHAPE": [1, 8, 1], "DCN_MESH_SHAPE": [4, 1, 1]}
    one = GlobalMeshShapeModifier(mesh_shape_from_axes(fsdp=-1), num_devices=8, num_processes=1)
    assert one({"MAX_STEPS": 3}) == {
        "MAX_STEPS": 3,
        "ICI_MESH_SHAPE": [1, 8, 1],
        "DCN_MESH_SHAPE": [1, 1, 1],
    }


def test_a_launcher_mesh_rule_with_pipeline_and_seq_resolves():
    """A custom Fuji mesh rule (as examples/custom_fuji.py adds one) stating pipeline and seq in
    AXLearn's names resolves through the launcher's select_mesh into a run with both axes."""
    from paxlite.experiments.fuji_mesh import MeshRule, select_mesh

    rule = MeshRule("custom", ChainConfigModifier([
        MeshShapeModifier(HybridMeshShape(ici=mesh_shape_from_axes(fsdp=2, seq=2),
                                          dcn=mesh_shape_from_axes(pipeline=2)),
                          num_local_devices=4, num_processes=2),
        GradientAccumulationModifier(2),
    ]))
    choice = select_mesh("test", "custom", extra_rules=[rule])
    assert choice.rule is rule
    experiment = configure("FujiTestV3", choice.modifier, MAX_SEQ_LEN=64, SYNTHETIC_DATA=True)
    assert experiment.ICI_MESH_SHAPE == [1, 2, 1, 1, 1, 2] and experiment.DCN_MESH_SHAPE == [
        1,
        1,
        1,
        1,
        2,
    ]
    run = fdl.build(experiment.run_config())
    assert run.mesh.axis_sizes(4) == {
        "pipeline": 2,
        "data": 1,
        "fsdp": 2,
        "seq": 2,
        "tensor": 1,
        "expert": 1,
    }
    assert run.model.pipeline.num_stages == 2 and run.loop.grad_accum_steps == 2
