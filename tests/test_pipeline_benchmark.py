"""benchmarks/pipeline_step.py --tiny: both schedules run against the unpipelined twin on 8 CPU
devices, after checking that both compute the same first loss; the bubble and the expected ratio are
the formula's.

The formula is recomputed here from S, R and M, not read from paxlite, so a wrong
``bubble_fraction`` or a wrong expected ratio in the report fails."""

import importlib.util
import json
import pathlib
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "pipeline_step.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("pipeline_step_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_tiny_run_reports_both_schedules_against_the_bubble_formula(bench, capsys, monkeypatch):
    checked = []
    real_check = bench.check_same_loss

    def spy(label, *, loss, twin_loss):
        checked.append((loss, twin_loss))
        real_check(label, loss=loss, twin_loss=twin_loss)

    monkeypatch.setattr(bench, "check_same_loss", spy)
    report = bench.main(["--tiny", "--json"])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == report
    cases = {c["schedule"]: c for c in report["cases"]}
    assert set(cases) == {"gpipe", "circular"}
    # the loss check ran before timing, once per case, on the losses the report gives
    assert [tuple(c["loss"]) for c in report["cases"]] == [
        (round(a, 6), round(b, 6)) for a, b in checked]
    for case in cases.values():
        s, r, m = case["stages"], case["repeats"], case["microbatches"]
        assert (s, m, case["data"]) == (4, 4, 2)
        assert case["bubble_fraction"] == pytest.approx((s - 1) / (r * m + s - 1), abs=1e-4)
        assert case["expected_ratio"] == pytest.approx((r * m + s - 1) / (r * m), abs=1e-3)
        pipelined, twin = case["loss"]
        assert abs(pipelined - twin) <= 1e-4 * abs(twin)
        assert case["pipelined_median_ms"] > 0 and case["twin_median_ms"] > 0
        assert case["ratio"] == pytest.approx(
            case["pipelined_ms"][0] / case["twin_ms"][0], rel=0.01)
    assert (cases["gpipe"]["repeats"], cases["circular"]["repeats"]) == (1, 2)
    assert (
        "| gpipe | 4 x 2 | 1 | 4 | 0.429 |" in out and "| circular | 4 x 2 | 2 | 4 | 0.273 |" in out
    )
    assert "not a parallel speed-up" in out


def test_a_pipelined_loss_unlike_the_twins_is_refused(bench):
    """The guard alone, not a second tiny run: that would read its pipelined steps back from the
    test session's persistent compilation cache, and such a step has deadlocked in its collectives
    on the 8 CPU devices (jax 0.12.0.1, 3 runs in 4)."""
    bench.check_same_loss("ok", loss=5.0 * (1 + 5e-5), twin_loss=5.0)
    with pytest.raises(AssertionError, match="differs from the unpipelined twin"):
        bench.check_same_loss("bad", loss=5.0 * (1 + 2e-4), twin_loss=5.0)


@pytest.mark.parametrize("argv, message", [
    (["--layers", "6"], "--layers=6 must be a multiple of 2 x --stages = 8"),
    (["--batch", "24"], "--batch=24 must split"),
    (["--microbatch_factors", "1,x"], "--microbatch_factors='1,x'"),
])
def test_bad_sizes_are_refused_naming_the_value(bench, capsys, argv, message):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err
