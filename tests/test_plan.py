"""The dry-run planner: exact per-device state bytes, the verdict, the CLI and --mode=dry_run;
per-stage memory and the bubble of a pipelined run, the longest sequence that fits, the pipeline
lever."""

import json
import math
import os
import subprocess

import fiddle as fdl
import pytest

from paxlite.config.errors import ConfigError
from paxlite.experiments.build import load_experiment
from paxlite.models.transformer import num_params
from paxlite.parallel.compile_targets import CompileTarget
from paxlite.parallel.mesh import MeshError
from paxlite.planner import levers as plan_levers
from paxlite.planner import longest_seq as plan_longest_seq
from paxlite.planner import plan as plan_lib
from paxlite.planner import search as plan_search
from paxlite.planner.results import (
    DeviceMemory,
    LongestSeqFound,
    MeshSizes,
    Plan,
    StepMeasurement,
)
from tests.fork_server import paxlite_python
from tests.in_process import paxlite_command
from tests.xla_test_flags import COMPILE_FLAGS

ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
ENV["XLA_FLAGS"] = COMPILE_FLAGS  # a plain process: one CPU device until the planner asks for more

# 1 layer, d_model 64, 8 heads of 8, vocabulary 256: every dimension splits 8 ways.
TINY = ("NUM_LAYERS=1", "MAX_SEQ_LEN=32", "PERCORE_BATCH_SIZE=1")
# Parameters without an embed dimension stay whole on every device (norms; QKV, out and MLP biases):
# per layer 2 norms x (scale + bias) + QKV bias 3 x 8 x 8 + out bias + MLP biases; + final norm.
REPLICATED = (2 * 2 * 64 + 3 * 8 * 8 + 64 + 256 + 64) + 2 * 64


def _tiny_plan(*mesh: str, num_devices: int, **kwargs) -> Plan:
    experiment = load_experiment("TinySynthetic", (*TINY, *mesh))
    return plan_lib.plan_experiment(experiment, num_devices=num_devices, **kwargs)


def _hand_count(*, layers=1, d=64, heads=8, head=8, mlp=256, vocab=256, seq=64) -> int:
    """GPT block: 2 LayerNorms (scale+bias), fused biased QKV, biased out projection, biased MLP;
    tied embedding, learned positions (max_seq_len rows), final LayerNorm."""
    block = 2 * 2 * d + (d * 3 * heads * head + 3 * heads * head) + (heads * head * d + d)
    block += d * mlp + mlp + mlp * d + d
    return layers * block + vocab * d + seq * d + 2 * d


@pytest.fixture(scope="module")
def fsdp_plans() -> dict[int, Plan]:
    return {f: _tiny_plan(f"ICI_MESH_SHAPE=[{8 // f},{f},1]", num_devices=8) for f in (1, 2, 4, 8)}


def test_parameter_bytes_are_an_exact_hand_count_over_fsdp(fsdp_plans):
    config = fdl.build(load_experiment("TinySynthetic", TINY).model_config())
    count = _hand_count(seq=32)
    assert num_params(config) == count
    for fsdp, p in fsdp_plans.items():
        m = p.memory_per_device
        # Every parameter has one embed dimension (64, divisible by 8) sharded over fsdp, except
        # the norm scales/biases and the biases without an embed dimension, which are replicated.
        sharded = count - REPLICATED
        assert m.parameter_bytes == 4 * (sharded // fsdp + REPLICATED), fsdp
        assert m.gradient_bytes == m.parameter_bytes
        assert p.num_params == count


def test_sharded_state_falls_as_one_over_fsdp(fsdp_plans):
    full = fsdp_plans[1].memory_per_device
    replicated_bytes = 4 * REPLICATED
    for fsdp in (2, 4, 8):
        m = fsdp_plans[fsdp].memory_per_device
        sharded = m.parameter_bytes - replicated_bytes
        assert sharded * fsdp == full.parameter_bytes - replicated_bytes
        # Adam: mu and nu shaped and sharded like the parameters, plus replicated scalars.
        scalars = full.optimizer_state_bytes - 2 * full.parameter_bytes
        assert 0 <= scalars <= 64
        assert m.optimizer_state_bytes == 2 * m.parameter_bytes + scalars
        assert m.argument_bytes < full.argument_bytes
    assert [fsdp_plans[f].mesh.fsdp for f in (1, 2, 4, 8)] == [1, 2, 4, 8]


def test_plan_fields_and_flops(fsdp_plans):
    p = fsdp_plans[2]
    as_json = p.to_json()
    for key in ("experiment", "num_devices", "mesh", "global_batch_size", "tokens_per_step",
                "num_params", "memory_per_device", "peak_formula", "device_memory_bytes", "fits",
                "margin_bytes", "flops_per_step", "step_time_at_100pct_mfu_s", "levers",
                "compile_s"):
        assert key in as_json, key
    m = p.memory_per_device
    assert m.peak_bytes == (m.argument_bytes + m.output_bytes - m.alias_bytes
                            + m.temp_bytes + m.generated_code_bytes)
    assert m.alias_bytes > 0  # the donated state is updated in place
    assert p.global_batch_size == 8 and p.tokens_per_step == 8 * 32
    # 6 N_matmul + 6 L S H h per token (paxlite/train/flops.py), by hand.
    n_matmul = (64 * 3 * 64 + 64 * 64 + 2 * 64 * 256) + 64 * 256
    assert p.flops_per_step.analytic == (6 * n_matmul + 6 * 1 * 32 * 64) * 256
    # The compiler counts the same matmuls (plus elementwise work), split over 8 devices.
    ratio = p.flops_per_step.compiler_total / p.flops_per_step.analytic
    assert 0.9 < ratio < 2.0, ratio
    assert p.step_time_at_100pct_mfu_s == pytest.approx(p.flops_per_step.analytic / (8 * 989e12))
    assert p.verdict.fits and p.levers == ()
    # f32 logits [B/(data x fsdp), N/tensor, T, S] = [1, 8, 32, 32]
    assert p.attention_logits_bytes_per_layer == 4 * 8 * 32 * 32
    # the JSON is the plan's, read back to the same plan
    assert Plan.from_json(json.loads(json.dumps(as_json))) == p


def test_fits_flips_and_levers_are_computed(fsdp_plans, monkeypatch):
    fits = fsdp_plans[2]  # mesh data 4 x fsdp 2
    peak = fits.memory_per_device.peak_bytes
    # Two compiled levers, the two checked below (the first two candidates to compile; the seq lever
    # after them is "not compiled"), and no combination of them: the seq lever and the levers
    # compiled together are covered by the lever plan below (test_gradient_accumulation_...).
    monkeypatch.setattr(plan_levers, "_MAX_COMPILED_LEVERS", 2)
    monkeypatch.setattr(plan_levers, "_combined_lever", lambda *args, **kwargs: None)
    tight = _tiny_plan("ICI_MESH_SHAPE=[4,2,1]", num_devices=8, device_memory_gib=peak / 2**30 / 2)
    assert fits.verdict.fits and not tight.verdict.fits
    assert tight.memory_per_device == fits.memory_per_device
    assert tight.verdict.margin_bytes == tight.device_memory_bytes - peak < 0
    levers = {lever.lever: lever for lever in tight.levers}
    all_fsdp = levers["fsdp 2 -> 8 (all of data moved to fsdp)"]
    assert all_fsdp.method == "compiled" and all_fsdp.peak_bytes < peak
    # The analytic step in between: only the sharded state shrinks (exactly 1/fsdp).
    m = fits.memory_per_device
    state = m.parameter_bytes + m.optimizer_state_bytes + m.gradient_bytes
    assert levers["fsdp 2 -> 4 (data 4 -> 2)"].peak_bytes == peak - state + math.ceil(state / 2)
    remat = levers["CHECKPOINT_POLICY=SAVE_NOTHING (recompute each unrolled layer)"]
    # Compiled (on this one-layer model recomputation saves nothing; the LLaMA70B plan in
    # docs/parallelism.md shows the lever at scale), the layers left unrolled: the policy set
    # explicitly wraps each of them, and the checkpoint layout stays.
    assert remat.method == "compiled" and remat.overrides == {"CHECKPOINT_POLICY": "SAVE_NOTHING"}
    assert remat.peak_bytes > 0 and remat.verdict is not None
    half = levers["PERCORE_BATCH_SIZE 1 -> 0.5"]
    # Half of 8 rows over data x fsdp = 8 ways is not a whole number of rows per device.
    assert half.applicable is False and "does not divide" in half.reason
    # Two microbatches of 4 rows cannot be spread over 8 devices either: refused, with the reason.
    accum = levers["GRAD_ACCUM_STEPS 1 -> 2 (same global batch, same training)"]
    assert accum.applicable is False and "GRAD_ACCUM_STEPS" in accum.reason


LEVER_SETTINGS = ("ICI_MESH_SHAPE=[2,1,1]", "PERCORE_BATCH_SIZE=8")


@pytest.fixture(scope="module")
def lever_plan_and_base() -> tuple[Plan, StepMeasurement]:
    """Nothing fits: four levers (one on another mesh) compiled at once, then all together; and the
    base step's measurement the plan's levers started from (recorded on its way to the levers, so
    the one-at-a-time comparison below compiles the levers only, not the base step again)."""
    bases = []

    def recording_levers(experiment, base, **kwargs):
        bases.append(base)
        return plan_levers.levers(experiment, base, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plan_lib, "levers", recording_levers)
        plan = _tiny_plan(*LEVER_SETTINGS, num_devices=2, device_memory_gib=1e-4)
    [base] = bases
    return plan, base


@pytest.fixture(scope="module")
def lever_plan(lever_plan_and_base) -> Plan:
    return lever_plan_and_base[0]


# slow: the levers compiled one at a time, for comparison (~15 s on 2 cores)
@pytest.mark.slow
def test_levers_compiled_at_once_measure_what_one_at_a_time_measures(lever_plan_and_base,
                                                                     monkeypatch):
    """The levers compile in threads (plan_search.compile_variants), each under its own mesh: a mesh
    or rules context leaking between threads would change some lever's bytes. The levers-together
    compile that ends the plan is one variant, compiled without a thread either way: it is not
    compiled again here (test_gradient_accumulation_lever_lowers_the_peak checks it)."""
    lever_plan, base = lever_plan_and_base
    *singles, together = lever_plan.levers
    assert together.lever.startswith("together: ")
    assert sum(lever.method == "compiled" for lever in singles) >= 3
    monkeypatch.setattr(plan_lib.os, "cpu_count", lambda: 1)  # one worker: one lever after another
    monkeypatch.setattr(plan_levers, "_combined_lever", lambda *args, **kwargs: None)
    serial = plan_levers.levers(load_experiment("TinySynthetic", (*TINY, *LEVER_SETTINGS)), base,
                               num_devices=2, device_bytes=lever_plan.device_memory_bytes)
    assert tuple(serial) == tuple(singles)


@pytest.mark.slow  # compiles the step with and without accumulation (~29 s on 2 cores)
def test_gradient_accumulation_lever_lowers_the_peak(lever_plan):
    plan = lever_plan
    accum = {lever.lever: lever for lever in plan.levers}[
        "GRAD_ACCUM_STEPS 1 -> 2 (same global batch, same training)"]
    assert accum.method == "compiled" and accum.peak_bytes < plan.memory_per_device.peak_bytes
    # Nothing fits alone, so the same-training levers are also compiled together (batch halving
    # is not among them).
    together = plan.levers[-1]
    singles = [lever for lever in plan.levers[:-1]
               if lever.method == "compiled" and lever.peak_bytes is not None
               and "PERCORE_BATCH_SIZE" not in lever.overrides]
    assert len(singles) >= 2 and together.lever.startswith("together: ")
    # Levers that set the same hyperparameter do not combine; the earlier one is taken: here the
    # seq lever (mesh and GRAD_ACCUM_STEPS) gives way to the fsdp move and the accumulation lever.
    by_name = {lever.lever.split(" (")[0]: lever for lever in singles}
    seq = by_name["seq 1 -> 2"]
    assert set(seq.overrides) == {"ICI_MESH_SHAPE", "DCN_MESH_SHAPE", "GRAD_ACCUM_STEPS"}
    want = {**by_name["fsdp 1 -> 2"].overrides,
            **by_name["CHECKPOINT_POLICY=SAVE_NOTHING"].overrides,
            **accum.overrides}
    assert together.overrides == want and "PERCORE_BATCH_SIZE" not in together.overrides
    assert seq.lever not in together.lever
    assert together.peak_bytes < min(lever.peak_bytes for lever in singles if lever is not seq)


@pytest.fixture(scope="module")
def four_entry_plan() -> Plan:
    """Pax's 4-entry mesh on 2 devices, nothing fitting, with a fused attention kernel requested:
    the plan of the two tests below (before: one plan each, the same step compiled twice). Only
    the fsdp move is compiled: one more compile."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plan_levers, "_MAX_COMPILED_LEVERS", 1)
        return _tiny_plan("ICI_MESH_SHAPE=[2,1,1,1]", "DCN_MESH_SHAPE=[1,1,1]",
                          "ATTENTION_IMPLEMENTATION=pallas_triton", num_devices=2,
                          device_memory_gib=1e-4)


def test_a_four_entry_mesh_is_planned_and_its_levers_keep_the_expert_entry(four_entry_plan):
    plan = four_entry_plan
    assert plan.mesh == MeshSizes(pipeline=1, data=2, fsdp=1, seq=1, tensor=1, expert=1)
    assert plan.ici_mesh_shape == (2, 1, 1, 1) and plan.dcn_mesh_shape == (1, 1, 1)
    assert plan.attention_logits_bytes_per_layer == 4 * (2 // 2) * 8 * 32 * 32
    move = {lever.lever: lever for lever in plan.levers}["fsdp 1 -> 2 (all of data moved to fsdp)"]
    # Each shape keeps its own length: the expert entry stays where the user put it.
    assert move.overrides == {"ICI_MESH_SHAPE": [1, 2, 1, 1], "DCN_MESH_SHAPE": [1, 1, 1]}
    assert move.method == "compiled" and move.peak_bytes > 0
    assert ("mesh pipeline 1 x data 2 x fsdp 1 x seq 1 x tensor 1 x expert 1 (ICI [2, 1, 1, 1] x "
            "DCN [1, 1, 1])"
            in plan_lib.format_text(plan))


def test_mesh_mismatch_and_unknown_experiment_raise():
    experiment = load_experiment("TinySynthetic", ("ICI_MESH_SHAPE=[2,2,1]",))
    with pytest.raises(MeshError, match=r"needs 4 devices, but the plan is for --devices=8"):
        plan_lib.plan_experiment(experiment, num_devices=8)
    with pytest.raises(ConfigError, match="NoSuchExperiment"):
        plan_lib.plan(plan_lib.PlanRequest(name="NoSuchExperiment", num_devices=8))


def test_fake_device_env_replaces_the_device_count():
    flags = "--a=1 --xla_force_host_platform_device_count=8"
    env = plan_lib.fake_device_env(256, {"XLA_FLAGS": flags})
    # and LLVM's quickest code generation: the plan reads only what XLA decides before it
    assert env["XLA_FLAGS"] == ("--a=1 --xla_backend_optimization_level=0 "
                                "--xla_force_host_platform_device_count=256")
    assert env["JAX_PLATFORMS"] == "cpu"
    mine = plan_lib.fake_device_env(4, {"XLA_FLAGS": "--xla_backend_optimization_level=2"})[
        "XLA_FLAGS"
    ]
    assert mine == "--xla_backend_optimization_level=2 --xla_force_host_platform_device_count=4"


def test_the_quick_code_generation_plans_the_same_bytes_and_flops(fsdp_plans):
    """This process compiles at LLVM level 0 (tests/xla_test_flags.py); a planner process given
    level 3 must measure the same memory and FLOPs, or the planner's own level 0 would change its
    answers. The level-0 plan is the module's data 4 x fsdp 2 plan, compiled once for the tests
    above (before: a plan of its own on 2 devices, one more compile here)."""
    mesh = ("ICI_MESH_SHAPE=[4,2,1]",)
    result = _run(
        "-m",
        "paxlite",
        "plan",
        "--fdl_config=TinySynthetic",
        *(f"--fdl.{a}" for a in TINY + mesh),
        "--devices=8",
        "--format=json",
        env={**ENV, "XLA_FLAGS": "--xla_backend_optimization_level=3"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    level3 = json.loads(result.stdout)
    level0 = fsdp_plans[2]
    assert level0.ici_mesh_shape == (4, 2, 1) and level3["ici_mesh_shape"] == [4, 2, 1]
    assert level3["memory_per_device"]["peak_bytes"] > 0
    assert level3["memory_per_device"] == level0.memory_per_device.to_json()
    assert level3["flops_per_step"]["compiler_per_device"] == \
        level0.flops_per_step.compiler_per_device > 0


def test_a_process_with_fewer_devices_plans_in_a_subprocess():
    # pytest runs with 8 devices: 16 need a fresh `python -m paxlite plan` (exercised end to end by
    # the --mode=dry_run test below, whose process has one device).
    assert plan_lib.prepare_this_process(8) and not plan_lib.prepare_this_process(16)
    command = plan_lib.plan_command_line(
        plan_lib.PlanRequest(name="TinySynthetic", assignments=("NUM_LAYERS=1",), num_devices=16),
        output_format=plan_lib.OutputFormat.JSON)
    assert command[1:5] == ["-m", "paxlite", "plan", "--fdl_config=TinySynthetic"]
    assert "--fdl.NUM_LAYERS=1" in command and "--devices=16" in command


def _run(*args, cwd=None, env=None, timeout=300):
    return subprocess.run(
        [paxlite_python(), *args],
        capture_output=True,
        text=True,
        env=ENV if env is None else env,
        timeout=timeout,
        cwd=cwd,
        check=False,
    )


@pytest.mark.parametrize("flags, message", [
    (["--fdl_config=NoSuchExperiment", "--devices=8"], "NoSuchExperiment"),
    (["--fdl_config=TinySynthetic", "--fdl.ICI_MESH_SHAPE=[2,2,1]", "--devices=8"],
     "needs 4 devices, but the plan is for --devices=8"),
    (["--fdl_config=TinySynthetic", "--devices=0"], "--devices=0"),
])
def test_cli_errors_exit_2_with_one_message(flags, message, monkeypatch, capfd):
    # in this process (tests/in_process.py): each mistake is found before JAX plans anything
    result = paxlite_command(monkeypatch, capfd)("plan", *flags)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("paxlite: error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_dry_run_mode_writes_plan_json_and_allocates_nothing(tmp_path):
    """A text experiment with no dataset given: the planner needs shapes only."""
    job = tmp_path / "job"
    result = _run("-m", "paxlite.main", "--fdl_config=TinyShakespeare", "--mode=dry_run",
                  *(f"--fdl.{a}" for a in TINY), "--fdl.ICI_MESH_SHAPE=[2,2,1]",
                  f"--job_log_dir={job}")
    assert result.returncode == 0, result.stderr[-2000:]
    p = json.loads((job / "plan.json").read_text())
    assert p["num_devices"] == 4 and p["mesh"] == {
        "pipeline": 1,
        "data": 2,
        "fsdp": 2,
        "seq": 1,
        "tensor": 1,
        "expert": 1,
    }
    assert p["overrides"]["ICI_MESH_SHAPE"] == [2, 2, 1]
    assert "Verdict: fits" in result.stdout
    assert sorted(os.listdir(job)) == ["plan.json"]  # no checkpoints, metrics or summaries
    assert math.isclose(p["peak_tflops_per_device"], 989.0)


def test_a_fresh_process_plans_itself_without_a_second_jax_start():
    """`python -m paxlite plan` sets the fake devices before JAX starts, so it never re-executes
    itself."""
    code = (
        "import subprocess, sys\n"
        "from paxlite.planner import plan\n"
        "spawned = []\n"
        "plan.subprocess.run = lambda *a, **k: spawned.append(a) or subprocess.CompletedProcess(a, "
        "1)\nrequest = plan.PlanRequest(name='TinySynthetic', "
        f"assignments={TINY + ('ICI_MESH_SHAPE=[2,1,1]',)!r}, num_devices=2)\n"
        "code = plan.run_plan_command(request, output_format=plan.OutputFormat.JSON)\n"
        "print('RESULT', code, len(spawned))\n"
    )
    result = _run("-c", code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "RESULT 0 0"


# The plan of GLaM64B64E on 512 devices, made as plan_lib.plan makes it for a process with fewer
# devices (a fresh process with 512 fake CPU devices, read back from its JSON), with the planner's
# lever budget set to the two expert levers, its first two candidates: the pipeline and
# accumulation levers after them (and so their combination) are covered by this file's tiny plans
# and cost three more compiles of the 64B step here.
_GLAM_PLAN = (
    "import json\n"
    "from paxlite.planner import levers, plan\n"
    "levers._MAX_COMPILED_LEVERS = 2\n"
    "request = plan.PlanRequest(name='GLaM64B64E', num_devices=512)\n"
    "print(json.dumps(plan.plan(request).to_json()))\n"
)


# slow: compiles a 64B MoE step for 512 devices, then the two expert levers (~40 s on 2 cores)
@pytest.mark.slow
def test_glam64b64e_on_512_devices_has_a_verdict_moe_memory_and_expert_levers():
    """The issue's case: Pax's GLaM 64B/64E mesh (FSDP 64 x tensor 8) planned for 512 devices."""
    result = _run("-c", _GLAM_PLAN, env=plan_lib.fake_device_env(512, ENV), timeout=1800)
    assert result.returncode == 0, result.stderr[-2000:]
    p = Plan.from_json(json.loads(result.stdout))
    assert p.mesh == MeshSizes(pipeline=1, data=1, fsdp=64, seq=1, tensor=8, expert=1)
    assert isinstance(p.verdict.fits, bool)
    moe, gshard = p.moe, p.moe.gshard
    # by hand: 64 groups (the batch shards: fsdp 64), S = 2048 x 1024 / 64 = 32768 tokens,
    # C = int(32768 x 2.0 / 64) = 1024 (a multiple of 4), one group per device, bf16 dispatch
    assert (gshard.groups, gshard.group_size, gshard.capacity) == (64, 32768, 1024)
    assert gshard.dispatch_combine_bytes_per_device == 32768 * 64 * 1024 * (4 + 2)
    assert moe.experts_per_device == 64 and moe.moe_layers == 32
    text = plan_lib.format_text(p)
    assert "dispatch + combine of one MoE layer" in text and "12.00 GiB per device" in text
    if not p.verdict.fits:
        levers = {lever.lever.split(" (")[0]: lever for lever in p.levers}
        expert = levers["expert 1 -> 8"]
        assert expert.overrides["DCN_MESH_SHAPE"] == [1, 8, 1, 8]
        assert expert.peak_bytes is not None
        assert levers["NUM_GROUPS 64 -> 128"].peak_bytes is not None


def test_a_dpo_plan_takes_the_reference_parameters_beside_the_state(fsdp_plans, tmp_path):
    """TRAIN_TASK=dpo plans the DPO step, whose arguments hold the reference model's parameters
    beside the state: exactly the parameters' bytes, sharded as they are (same batch arrays)."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "a b", "chosen": " c", "rejected": " d"}) + "\n")
    dpo = _tiny_plan("ICI_MESH_SHAPE=[4,2,1]", "TRAIN_TASK=dpo", f"DPO_DATA={pairs}",
                     num_devices=8)
    m, ce = dpo.memory_per_device, fsdp_plans[2].memory_per_device  # the same mesh, no DPO
    assert ce.reference_bytes is None
    assert m.reference_bytes == m.parameter_bytes == ce.parameter_bytes
    assert m.argument_bytes == ce.argument_bytes + m.reference_bytes
    assert Plan.from_json(json.loads(json.dumps(dpo.to_json()))) == dpo
    text = plan_lib.format_text(dpo)
    assert "DPO reference" in text and "(state + batch + DPO reference)" in text


def test_a_fused_attention_kernel_is_planned_with_xla_attention_and_says_so(four_entry_plan,
                                                                          fsdp_plans):
    """The CPU compiler has no Triton or cuDNN kernels: the plan compiles XLA's attention
    instead (the 4-entry mesh plan above asks for 'pallas_triton')."""
    plan = four_entry_plan
    assert plan.overrides["ATTENTION_IMPLEMENTATION"] == "pallas_triton"
    assert plan.attention_note.startswith("attention planned with 'xla': the CPU compiler cannot "
                                          "compile 'pallas_triton'")
    # the same model with its default attention (a plan the module has made already): no note
    assert fsdp_plans[2].attention_note is None


# ------------------------------------------------------------------------------------------------
# Pipeline and sequence parallelism in the planner

# 4 scanned layers (so the [L, ...] stack splits over the stages), 2 rows per device, 32 tokens.
STACK = ("NUM_LAYERS=4", "MAX_SEQ_LEN=32", "PERCORE_BATCH_SIZE=2", "USE_REPEATED_LAYER=true")


@pytest.fixture(scope="module")
def pipelined_plan() -> Plan:
    """Circular schedule: 2 stages x 2 repeats over 2 devices, 4 microbatches of the 4-row batch."""
    return plan_lib.plan_experiment(
        load_experiment(
            "TinySynthetic",
            (*STACK, "ICI_MESH_SHAPE=[1,1,1,1,2]", "NUM_MICROBATCHES=4", "PIPELINE_REPEATS=2"),
        ),
        num_devices=2,
    )


def test_a_pipelined_plan_reports_its_schedule_and_the_bubble_formula(pipelined_plan):
    pipe = pipelined_plan.pipeline
    assert pipelined_plan.mesh.pipeline == 2 and pipelined_plan.global_batch_size == 4
    assert (pipe.num_stages, pipe.repeats, pipe.schedule) == (2, 2, "circular")
    assert (pipe.num_microbatches, pipe.microbatch_rows, pipe.iterations) == (4, 1, 2 * 4 + 2 - 1)
    assert pipe.microbatch_rows_per_device == 1  # the batch axes are 1: each device runs whole rows
    # (S - 1) / (R*M + S - 1) by hand: 1 / 9
    assert pipe.bubble_fraction == pytest.approx(1 / 9, abs=1e-15)
    assert pipelined_plan.sequence_parallel is None and pipelined_plan.longest_seq is None
    text = plan_lib.format_text(pipelined_plan)
    assert "circular schedule (repeats 2), 4 microbatches of 1 rows, 9 iterations" in text
    assert "bubble fraction 0.1111 = (S - 1) / (R*M + S - 1) with S = 2, R = 2, M = 4" in text
    assert "The memory above is PER STAGE" in text
    json.dumps(pipelined_plan.to_json())


def test_a_stage_holds_its_half_of_the_layers(pipelined_plan, unpipelined_plan):
    """Per-device (= per-stage) parameters against a hand count and against the same stack
    unpipelined."""
    block = _hand_count(layers=1, seq=32) - _hand_count(layers=0, seq=32)
    rest = _hand_count(layers=0, seq=32)  # embedding, positions, final norm: on every stage
    pipe = pipelined_plan.pipeline
    assert pipe.stage_layer_parameter_bytes == 4 * 2 * block and pipe.layers_split_over_stages
    assert pipe.parameter_bytes_on_every_stage == 4 * rest
    staged = pipelined_plan.memory_per_device.parameter_bytes
    assert staged == 4 * (2 * block + rest)
    # data 2: the same global batch, the same four layers (unrolled: the parameters are the same)
    whole = unpipelined_plan
    assert whole.global_batch_size == pipelined_plan.global_batch_size and whole.pipeline is None
    assert whole.memory_per_device.parameter_bytes == 4 * (4 * block + rest) > staged
    assert pipelined_plan.memory_per_device.optimizer_state_bytes < \
        whole.memory_per_device.optimizer_state_bytes


def _tiny_plan_of(base: tuple[str, ...], *more: str, num_devices: int, **kwargs) -> Plan:
    return plan_lib.plan_experiment(
        load_experiment("TinySynthetic", (*base, *more)), num_devices=num_devices, **kwargs
    )


@pytest.fixture(scope="module")
def unpipelined_plan() -> Plan:
    """STACK's four layers unrolled on data 2, in memory that not even all-FSDP state fits: the
    whole stack the stage above is compared with, and the plan the pipeline lever is offered for
    (before: a plan of its own, of a 2-layer model, for the lever). One lever compiled: the
    pipeline lever, the first candidate."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plan_levers, "_MAX_COMPILED_LEVERS", 1)  # the pipeline lever only
        return _tiny_plan_of(STACK, "USE_REPEATED_LAYER=false", "ICI_MESH_SHAPE=[2,1,1]",
                             num_devices=2, device_memory_gib=1e-4)


def test_the_longest_sequence_fits_and_the_next_step_does_not(monkeypatch):
    """A seq run: the search's answer and the step above it are what the compiler measured at those
    two lengths. Every compile the search makes is recorded here, keyed by the MAX_SEQ_LEN of the
    experiment it was given, so the two are checked against compiles of their own lengths without
    compiling them a second time (the seq axis keeps these programs out of the persistent cache:
    NotPersistentlyCached). The plan is made at T = 128, a step of the default 128, so the search
    compiles only T = 256 and 512 before its first fit (through those and the plan's 128), whose
    root at 10.24 MiB lands on the answer: 3 compiles beyond the plan's (a plan at T = 32 took 4:
    128 is added to the first lengths; step 16 took 6, and this test compiled 2 more to check
    them)."""
    memory_gib = 0.01
    step = 128
    compiled = {}  # MAX_SEQ_LEN -> the measurement compile_train_step returned for it
    measure = plan_search.compile_train_step

    def recording_compile(experiment, **kwargs):
        measured = measure(experiment, **kwargs)
        assert measured.seq_len == experiment.MAX_SEQ_LEN
        assert experiment.MAX_SEQ_LEN not in compiled  # each length compiled once
        compiled[experiment.MAX_SEQ_LEN] = measured
        return measured

    monkeypatch.setattr(plan_search, "compile_train_step", recording_compile)
    p = _tiny_plan_of(TINY, "MAX_SEQ_LEN=128", "PERCORE_BATCH_SIZE=0.5",
                      "ICI_MESH_SHAPE=[1,1,1,1,1,2]", num_devices=2, device_memory_gib=memory_gib,
                      seq_step=step)
    # T / seq = 128 / 2 tokens a shard; half a row per device over 2 devices: one row, on seq
    assert p.sequence_parallel.to_json() == {
        "seq": 2, "strategy": "all_gather", "load_balance": True, "tokens_per_shard": 64,
        "rows_per_device": 1, "tokens_per_device": 64}
    found = p.longest_seq  # a seq run: searched without being asked
    assert found.pinned and found.step == 128  # lcm(128, 2 x seq chunks)
    length = found.seq_len
    assert length % 128 == 0 and found.tokens_per_shard == length // 2
    assert found.method.startswith(
        "peak(T) = a + b*T + c*T^2 fitted to compiles at T = 128, 256, 512")
    assert found.fit is not None and found.fit.through == (128, 256, 512)
    assert found.compiles == len(compiled) <= plan_longest_seq.MAX_SEQ_SEARCH_COMPILES
    device_bytes = int(memory_gib * 2**30)
    at, above = compiled[length], compiled[length + step]
    assert at.memory.peak_bytes == found.peak_bytes <= device_bytes
    assert above.memory.peak_bytes == found.next_peak_bytes > device_bytes
    assert (
        f"Longest sequence that fits 10.24 MiB at 1 row(s) per device, seq 2: {length:,} tokens"
        in plan_lib.format_text(p)
    )


def _measured(*, seq_len: int, peak_bytes: int) -> StepMeasurement:
    """A stand-in compile on data 8 whose peak is `peak_bytes` (what the search reads)."""
    return StepMeasurement(
        compiled_for=CompileTarget.CPU,
        mesh=MeshSizes(pipeline=1, data=8, fsdp=1, seq=1, tensor=1, expert=1),
        ici_mesh_shape=(8, 1, 1), dcn_mesh_shape=(1, 1, 1), global_batch_size=8, seq_len=seq_len,
        memory=DeviceMemory(parameter_bytes=0, optimizer_state_bytes=0, gradient_bytes=0,
                            argument_bytes=0, output_bytes=0, alias_bytes=0, temp_bytes=peak_bytes,
                            generated_code_bytes=0, peak_bytes=peak_bytes),
        pipeline_split_parameter_bytes=0, compiler_flops_per_device=None, compile_s=0.0)


def _search_with(peak_of, *, device_bytes: int, step: int = 128, seq_len: int = 1024,
                 monkeypatch) -> tuple[LongestSeqFound, list[list[int]]]:
    """The search against a memory curve given as a function, with no compiler: what it decides
    alone, and the lengths it compiled, call by call."""
    calls = []

    def fake_compile(experiment, variants, *, num_devices):
        calls.append([changes["MAX_SEQ_LEN"] for changes in variants])
        return [_measured(seq_len=changes["MAX_SEQ_LEN"],
                          peak_bytes=int(peak_of(changes["MAX_SEQ_LEN"]))) for changes in variants]

    monkeypatch.setattr(plan_longest_seq, "compile_variants", fake_compile)
    experiment = load_experiment("TinySynthetic", ())
    base = _measured(seq_len=seq_len, peak_bytes=int(peak_of(seq_len)))
    found = plan_longest_seq.find_longest_seq(experiment, base, num_devices=8,
                                              device_bytes=device_bytes, step=step)
    return found, calls


@pytest.mark.parametrize("peak_of", [
    lambda t: 3e9 + 2e5 * t + 40.0 * t * t,  # quadratic: the fit's own form
    lambda t: 3e9 + 2e5 * t + 40.0 * t * t + 1e-3 * t**3,  # not quadratic: the fit is refined
    lambda t: 3e9 + 1.5e6 * t + 2e8 * (t // 4096),  # steps, as buffer assignment sometimes is
])
def test_the_length_search_finds_the_last_fitting_step_of_any_rising_curve(peak_of, monkeypatch):
    device_bytes = 80 * 2**30
    want = max(t for t in range(128, 10**6, 128) if peak_of(t) <= device_bytes)  # by brute force
    found, calls = _search_with(peak_of, device_bytes=device_bytes, monkeypatch=monkeypatch)
    assert found.pinned and found.seq_len == want, found.compiled
    assert found.peak_bytes <= device_bytes < found.next_peak_bytes
    assert calls[0] == [2048, 4096] and found.compiles <= plan_longest_seq.MAX_SEQ_SEARCH_COMPILES


def test_the_length_search_stops_at_its_compile_budget_and_says_where(monkeypatch):
    device_bytes = 80 * 2**30
    found, _ = _search_with(lambda t: 1e3 * t, device_bytes=device_bytes, step=1,
                            monkeypatch=monkeypatch)
    # a line fitted exactly: found in the first refinement
    assert found.pinned and found.seq_len == device_bytes // 1000
    # nothing fits: said so after compiling the shortest step
    nothing, _ = _search_with(lambda t: 100 * 2**30 + t, device_bytes=device_bytes,
                              monkeypatch=monkeypatch)
    assert not nothing.pinned and nothing.seq_len is None and nothing.bracket[0] is None
    def wiggly(t):
        return 7e10 + 3e6 * t * (1 + 0.5 * math.sin(t))

    found, _ = _search_with(wiggly, device_bytes=device_bytes, step=1, monkeypatch=monkeypatch)
    assert found.compiles <= plan_longest_seq.MAX_SEQ_SEARCH_COMPILES
    lo, hi = found.bracket
    assert wiggly(lo) <= device_bytes < wiggly(hi)  # what it reports is what it compiled
    if found.pinned:
        assert hi == lo + 1 and found.seq_len == lo


def test_the_pipeline_lever_appears_when_fsdp_alone_does_not_fit(unpipelined_plan):
    """Memory that not even all-FSDP state fits: pipelining (stages from data) is offered first and
    compiled."""
    p = unpipelined_plan
    assert not p.verdict.fits and p.pipeline is None
    lever = next(lever for lever in p.levers if lever.lever.startswith("pipeline"))
    # 2 stages (the ICI data axis has 2 devices); each holds 4 rows, so 2 x 2 microbatches
    assert lever.lever.startswith("pipeline 1 -> 2 stages (2 from data in ICI), "
                                  "NUM_MICROBATCHES=4 + USE_REPEATED_LAYER=true")
    assert "bubble 20.0%" in lever.lever  # (2 - 1) / (4 + 2 - 1)
    assert lever.overrides == {"ICI_MESH_SHAPE": [1, 1, 1, 1, 2], "DCN_MESH_SHAPE": [1, 1, 1],
                               "NUM_MICROBATCHES": 4, "USE_REPEATED_LAYER": True}
    assert lever.method == "compiled" and lever.peak_bytes < p.memory_per_device.peak_bytes
    assert any("not compiled" in (lever.method or "") for lever in p.levers)
    assert "not compiled (the planner compiles at most 1 levers per plan)" in plan_lib.format_text(
        p
    )


def test_the_longest_sequence_request_travels_to_a_subprocess_and_bad_values_are_named():
    request = plan_lib.PlanRequest(
        name="TinySynthetic", num_devices=16, longest_seq="on", seq_step=64
    )
    assert request.longest_seq is plan_lib.LongestSeq.ON
    command = plan_lib.plan_command_line(request, output_format=plan_lib.OutputFormat.JSON)
    assert "--longest_seq=on" in command and "--seq_step=64" in command
    default = plan_lib.plan_command_line(plan_lib.PlanRequest(name="TinySynthetic", num_devices=16),
                                         output_format=plan_lib.OutputFormat.JSON)
    assert not any(arg.startswith(("--longest_seq", "--seq_step")) for arg in default)
    with pytest.raises(ValueError, match=r"--longest_seq='maybe': expected one of auto, on, off"):
        plan_lib.PlanRequest(name="TinySynthetic", num_devices=8, longest_seq="maybe")
    with pytest.raises(ValueError, match=r"--seq_step=0: expected a positive integer"):
        plan_lib.PlanRequest(name="TinySynthetic", num_devices=8, seq_step=0)
    assert plan_lib.LongestSeq.AUTO.wanted(seq=2) and not plan_lib.LongestSeq.AUTO.wanted(seq=1)


def test_a_lever_refused_while_its_model_is_built_says_the_reason_only():
    """fdl.build's error carries Fiddle's build context (every argument) after a blank line; a
    refused lever's line keeps the model's own reason."""
    import fiddle as fdl

    from paxlite.models.transformer import TransformerConfig
    from paxlite.planner.levers import refusal_reason

    bad = fdl.Config(TransformerConfig, vocab_size=64, num_layers=2, model_dims=16, num_heads=2,
                     dims_per_head=8, hidden_dims=32, max_seq_len=8, sliding_window=0)
    with pytest.raises(ValueError) as raised:
        fdl.build(bad)
    assert "Fiddle context" in str(raised.value)
    reason = refusal_reason(raised.value)
    assert reason.startswith("TransformerConfig.sliding_window=0")
    assert "Fiddle" not in reason and "\n" not in reason
