"""alpa_lite.runtime.report: predicted-vs-measured records, the timing hook, and the Spearman helper."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from alpa_lite.runtime.launch import torchrun
from alpa_lite.core.mesh import LogicalMesh
from alpa_lite.zoo.models import build_model
from alpa_lite import plan
from alpa_lite.runtime.report import (StepTimer, idle_fractions, make_record, predicted_collectives, print_report,
                                      relative_error, report_requested, spearman)

WORKER = str(Path(__file__).parent / "workers" / "report_run.py")


# ---------------------------------------------------------------------------------- statistics


def test_spearman_orders():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    # monotone but not linear: ranks agree exactly
    assert spearman([0.1, 0.2, 5.0, 100.0], [1.0, 1.1, 1.2, 9.0]) == pytest.approx(1.0)


def test_spearman_matches_the_textbook_formula_without_ties():
    x = [3.1, 1.2, 7.7, 4.0, 2.5, 9.9]
    y = [2.0, 1.0, 5.0, 6.0, 3.0, 4.0]
    # ranks x: 3 1 5 4 2 6; y: 2 1 5 6 3 4 -> d^2 = 1 0 0 4 1 4 = 10; rho = 1 - 6*10/(6*35)
    assert spearman(x, y) == pytest.approx(1 - 60 / 210)


def test_spearman_ties_get_mean_ranks():
    # x ranks 1.5 1.5 3 4, y ranks 1 2 3 4: Pearson of the ranks (scipy.stats.spearmanr gives 0.9486833)
    assert spearman([1, 1, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486832980505138)


@pytest.mark.parametrize("x,y,match", [([1, 2], [1], "equally many"), ([1], [1], "at least 2"),
                                       ([1, 1, 1], [1, 2, 3], "constant"), ([1, float("nan")], [1, 2], "finite")])
def test_spearman_bad_input(x, y, match):
    with pytest.raises(ValueError, match=match):
        spearman(x, y)


def test_relative_error():
    assert relative_error(1.1, 1.0) == pytest.approx(0.1)
    assert relative_error(0.75, 1.0) == pytest.approx(-0.25)
    with pytest.raises(ValueError, match="positive"):
        relative_error(1.0, 0.0)


def test_report_requested_reads_the_environment(monkeypatch):
    monkeypatch.delenv("ALPA_LITE_REPORT", raising=False)
    assert report_requested(None) is False
    assert report_requested(True) is True
    monkeypatch.setenv("ALPA_LITE_REPORT", "1")
    assert report_requested(None) is True
    assert report_requested(False) is False  # an explicit argument wins
    monkeypatch.setenv("ALPA_LITE_REPORT", "maybe")
    with pytest.raises(ValueError, match="ALPA_LITE_REPORT"):
        report_requested(None)


def test_step_timer_rejects_bad_counts():
    with pytest.raises(ValueError, match="report_warmup"):
        StepTimer(-1)
    with pytest.raises(ValueError, match="report_steps"):
        StepTimer(1, 0)


# ---------------------------------------------------------------------------------- the record


@pytest.fixture(scope="module")
def mlp_plan():
    model, example = build_model("mlp", 8, hidden=32, num_layers=2)
    return plan(model, example, LogicalMesh((2, 2), cluster="cpu-gloo"), force_data_parallel=True)


def test_record_fields_and_values(mlp_plan):
    pred = predicted_collectives(mlp_plan)
    assert sum(n for n, _ in pred.values()) == len(mlp_plan.collectives) > 0
    assert sum(s for _, s in pred.values()) == pytest.approx(sum(c.seconds for c in mlp_plan.collectives))
    counts = {k: float(n) for k, (n, _) in pred.items()}
    seconds = {k: 0.002 for k in pred}
    rec = make_record(mlp_plan, [0.03, 0.01, 0.02], seconds, counts, warmup_steps=2, world_size=4, backend="gloo",
                      name="dp")
    json.dumps(rec)  # JSON-able
    assert rec["name"] == "dp" and rec["mesh"] == [2, 2] and rec["world_size"] == 4 and rec["backend"] == "gloo"
    assert rec["warmup_steps"] == 2 and rec["timed_steps"] == 3
    step = rec["step"]
    assert step["measured_s"] == 0.02 and step["fastest_s"] == 0.01  # the median, the fastest
    assert step["predicted_s"] == pytest.approx(mlp_plan.compute_seconds + mlp_plan.comm_seconds)
    assert step["relative_error"] == pytest.approx(step["predicted_s"] / 0.02 - 1)
    assert step["measured_collective_s"] == pytest.approx(0.002 * len(pred))
    rows = {(r["kind"], r["phase"]): r for r in rec["collectives"]}
    assert set(rows) == set(pred)
    for key, (n, s) in pred.items():
        assert rows[key]["predicted_count"] == n == rows[key]["measured_count"]
        assert rows[key]["predicted_s"] == pytest.approx(s)
    with pytest.raises(ValueError, match="no timed step"):
        make_record(mlp_plan, [], {}, {}, warmup_steps=2, world_size=4)
    assert rec["bubble"] is None  # an SPMD plan has no pipeline bubble


def test_idle_fractions_against_the_slowest_schedule():
    # 2 ranks, 2 steps of (busy, schedule) seconds: step 0 takes 1.0 s (rank 1's), step 1 2.0 s (rank 0's)
    idle = idle_fractions([[(0.5, 0.9), (1.5, 2.0)], [(0.75, 1.0), (1.0, 1.5)]])
    assert idle == [pytest.approx([0.5, 0.25]), pytest.approx([0.25, 0.5])]
    with pytest.raises(ValueError, match="same number of timed steps"):
        idle_fractions([[(0.5, 1.0)], []])
    with pytest.raises(ValueError, match="positive time"):
        idle_fractions([[(0.0, 0.0)]])
    with pytest.raises(ValueError, match="same number of timed steps"):
        idle_fractions([[], []])


def test_pipelined_record_without_timed_schedules_has_no_bubble():
    """A ``StepTimer`` around a pipelined trainer (not the trainer's own) times its steps but no
    rank's schedule: the record has no bubble instead of failing on an empty median (the crash of
    ``benchmarks/cost_fidelity.py`` when it timed pipelines that way)."""
    model, example = build_model("mlp", 8, hidden=32, num_layers=2)
    pp = plan(model, example, LogicalMesh((2, 2), cluster="cpu-gloo"), pipeline=2, num_microbatches=2,
              force_data_parallel=True)
    rec = make_record(pp, [0.02, 0.03], {}, {}, warmup_steps=1, world_size=4, schedule_seconds=[[], [], [], []])
    assert rec["bubble"] is None and rec["step"]["measured_s"] == pytest.approx(0.025)
    rec = make_record(pp, [0.02], {}, {}, warmup_steps=1, world_size=2, schedule_seconds=[[(0.5, 1.0)], [(0.25, 0.5)]])
    assert rec["bubble"]["measured"] == pytest.approx(0.625)  # idle 0.5 and 0.75 of the slowest schedule


def test_print_report_shows_step_and_kinds(mlp_plan):
    from rich.console import Console

    pred = predicted_collectives(mlp_plan)
    rec = make_record(mlp_plan, [0.05], {k: 0.001 for k in pred}, {k: 1.0 for k in pred}, warmup_steps=1,
                      world_size=4)
    rec["bubble"] = {"predicted": 0.25, "measured": 0.3}  # as a pipelined plan's record has it
    console = Console(record=True, width=140)
    print_report(rec, console)
    text = console.export_text()
    assert "predicted vs measured" in text and "step" in text and "50.00" in text
    for kind, phase in pred:
        assert kind in text and phase in text
    assert "bubble" in text and "25.0%" in text and "30.0%" in text and "+5.0 pt" in text


# ---------------------------------------------------------------------------------- 4 ranks


@pytest.fixture(scope="module")
def four_rank_records(tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "records.json"
    plans = {"dp": {"force_data_parallel": True},
             "megatron": {"batch_axis": 0, "param_specs": {"layers.0.weight": "S1R", "layers.1.weight": "RS1"}},
             "pipeline": {"pipeline": 2, "num_microbatches": 2, "force_data_parallel": True}}
    rc = torchrun([WORKER, "--model", "mlp", "--batch", "8", "--overrides", '{"hidden": 32, "num_layers": 2}',
                   "--mesh", "2x2", "--plans", ";".join(f"{k}={json.dumps(v)}" for k, v in plans.items()),
                   "--warmup", "1", "--steps", "2", "--out", str(out)], nproc=4, timeout_s=120,
                  env={"PYTHONPATH": str(Path(__file__).parents[1])}, stdout=sys.stderr)
    assert rc == 0
    return json.loads(out.read_text())


def test_four_rank_report_matches_the_plan(four_rank_records):
    assert set(four_rank_records) == {"dp", "megatron", "pipeline"}
    for name, rec in ((k, v) for k, v in four_rank_records.items() if k != "pipeline"):
        assert rec["name"] == name and rec["world_size"] == 4 and rec["backend"] == "gloo"
        assert rec["warmup_steps"] == 1 and rec["timed_steps"] == 2 and len(rec["step"]["samples_s"]) == 2
        assert rec["step"]["measured_s"] > 0 and rec["step"]["predicted_s"] > 0
        assert rec["collectives"], name
        for row in rec["collectives"]:  # every collective the plan lists is issued, no more, no fewer
            assert row["measured_count"] == row["predicted_count"] > 0, (name, row)
            assert row["measured_s"] > 0, (name, row)
        assert rec["step"]["measured_collective_s"] == pytest.approx(sum(r["measured_s"] for r in rec["collectives"]))
        assert rec["step"]["measured_collective_s"] < max(rec["step"]["samples_s"])
    assert four_rank_records["megatron"]["param_specs"]["layers.0.weight"] == "S1R"
    assert four_rank_records["dp"]["param_specs"]["layers.0.weight"] == "RR"


def test_pipelined_plan_reports_its_step(four_rank_records):
    """``report=True`` times a pipelined plan too: its predicted step is the stage DP's, its
    collectives are those the stages issued (no per-kind prediction: they overlap in the schedule)."""
    rec = four_rank_records["pipeline"]
    assert rec["timed_steps"] == 2 and rec["step"]["measured_s"] > 0 and rec["step"]["predicted_s"] > 0
    assert rec["step"]["predicted_compute_s"] is None
    assert any(r["measured_count"] > 0 and r["predicted_count"] == 0 for r in rec["collectives"])
    bubble = rec["bubble"]  # idle share of the ranks' schedule time: values in tests/test_pipeline_idle.py
    assert 0 < bubble["predicted"] < 1 and 0 <= bubble["measured"] < 1 and len(bubble["samples"]) == 2
    assert len(bubble["by_rank"]) == len(bubble["busy_s"]) == 4 and all(b > 0 for b in bubble["busy_s"])
    assert max(bubble["busy_s"]) <= bubble["schedule_s"]


def test_cost_fidelity_strategies_of_a_pipelined_plan():
    """``benchmarks/cost_fidelity.py`` records each plan's strategies to mark ablation rows whose
    re-planned strategies differ; it read ``plan.nodes``, which a ``PipelinePlan`` lacks, so its
    worker died with AttributeError after timing the "pipeline 1F1B 2x(1x2)" plan. Per stage now."""
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "cost_fidelity.py"
    spec = importlib.util.spec_from_file_location("cost_fidelity_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model, example = build_model("mlp", 8, hidden=32, num_layers=2)
    pp = plan(model, example, LogicalMesh((2, 2), cluster="cpu-gloo"), pipeline=2, num_microbatches=2,
              force_data_parallel=True)
    got = bench.plan_strategies(pp)
    want = {f"{i}/{n}": np_.strategy for i, s in enumerate(pp.stages) for n, np_ in s.plan.nodes.items()}
    assert got == want and {k.split("/")[0] for k in got} == {"0", "1"}
    assert json.loads(json.dumps(got)) == got  # the worker writes it to JSON
    spmd = plan(model, example, LogicalMesh((2, 2), cluster="cpu-gloo"), force_data_parallel=True)
    assert bench.plan_strategies(spmd) == {n: np_.strategy for n, np_ in spmd.nodes.items()}
