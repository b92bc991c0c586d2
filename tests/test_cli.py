"""The command line: `alpa-lite plan` for a described cluster and `alpa-lite train` (the README's
main job, shortened)."""
import json
import subprocess
import sys

import pytest
import torch

from alpa_lite import Plan
from alpa_lite.cli import main


def alpa_lite(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "alpa_lite.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_plan_prints_tables_and_writes_json(tmp_path):
    out = tmp_path / "plan.json"
    r = alpa_lite("plan", "gpt3-350m", "--mesh", "2x4", "--cluster", "v100", "--batch", "16", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "step time (predicted)" in r.stdout and "blocks.*.ffn.fc.weight" in r.stdout
    assert "collectives per training step" in r.stdout
    assert r.stdout.lstrip().startswith("gpt3-350m") and "HiGHS" not in r.stdout  # no solver banner (ilp.highs_available)
    plan = Plan.from_json(str(out))
    assert plan.mesh.shape == (2, 4) and plan.mesh.cluster == "v100"
    assert plan.param_specs["blocks.0.ffn.fc.weight"] == plan.param_specs["blocks.5.ffn.fc.weight"]


def in_process(capsys, *args):
    """``alpa-lite ARGS`` run by ``cli.main`` in this process (no interpreter start per call):
    (exit code, stdout, stderr)."""
    try:
        code = main(list(args))
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def test_plan_bad_input_is_one_clear_line(capsys):
    r = in_process(capsys, "plan", "gpt3-350m", "--mesh", "2by4")
    assert r.returncode == 2 and "mesh shape must look like '2x4'" in r.stderr
    r = in_process(capsys, "plan", "no-such-model")
    assert r.returncode == 2 and "unknown model" in r.stderr.lower()
    r = in_process(capsys, "plan", "mlp", "--memory-budget", "0.0000001")
    assert r.returncode == 2 and "least any plan needs" in r.stderr
    r = in_process(capsys, "plan", "mlp", "--memory-budget", "-1")
    assert r.returncode == 2 and "must be a positive number of GiB" in r.stderr
    r = in_process(capsys, "plan", "mlp", "--cluster", "missing.json")
    assert r.returncode == 2 and "cluster file missing.json does not exist" in r.stderr
    r = in_process(capsys, "train", "--mesh", "2x2x1")
    assert r.returncode == 2 and "mesh shape must look like" in r.stderr
    r = in_process(capsys, "train", "--plan", "/nonexistent/plan.json")
    assert r.returncode == 2 and "cannot read plan file" in r.stderr
    r = in_process(capsys, "plan", "mlp", "--explain", "linear_9")
    assert r.returncode == 2 and "close: linear" in r.stderr and "step time" not in r.stdout
    r = in_process(capsys, "plan", "mlp", "--json", "/nonexistent/dir/plan.json")  # refused before planning
    assert r.returncode == 2 and "/nonexistent/dir does not exist" in r.stderr and "step time" not in r.stdout
    r = in_process(capsys, "plan", "mlp", "--json", "/tmp")  # a directory: refused before planning
    assert r.returncode == 2 and "it is a directory" in r.stderr and "step time" not in r.stdout
    r = in_process(capsys, "plan", "mlp", "--schedule", "gpipe", "--microbatches", "4")  # were ignored
    assert r.returncode == 2 and "--schedule, --microbatches apply to a pipeline" in r.stderr


def test_train_main_job(tmp_path):
    r = alpa_lite("train", "--nproc", "4", "--mesh", "2x2", "--steps", "30", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["first_loss"] == pytest.approx(4.17, abs=0.15)  # ln(65) at init
    assert summary["final_loss_avg"] < summary["first_loss"] - 0.8  # it learns
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert len(log) == 30
    Plan.from_json(str(tmp_path / "plan.json"))


def test_train_mixed_precision_and_remat_flags(tmp_path):
    r = alpa_lite("train", "--nproc", "4", "--mesh", "2x2", "--steps", "2", "--mixed-precision", "bf16",
                  "--remat", "all", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    plan = Plan.from_json(str(tmp_path / "plan.json"))
    assert plan.options["mixed_precision"] == "bf16" and plan.remat  # every layer recomputed
    assert json.loads((tmp_path / "summary.json").read_text())["first_loss"] == pytest.approx(4.17, abs=0.15)


def test_explain_lists_candidates_and_marks_the_choice():
    r = alpa_lite("plan", "mlp", "--mesh", "1x4", "--cluster", "unit", "--memory-budget", "0.002",
                  "--explain", "linear_1")
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if "│" in line and ":S1" in line]
    chosen = [line for line in rows if "│ * │" in line]
    assert len(rows) >= 3 and len(chosen) == 1
    assert "k:S1" in chosen[0]  # Megatron's row-parallel second layer: split the contraction


def test_explain_marks_a_zero_strategy_and_prices_the_operands():
    """The candidates are the ILP's (``intra_op.strategy_table``): a ZeRO-2 parameter's chosen
    strategy is among them and marked (no row was: the table lacked the ZeRO variants); the title
    names the parameter; "operands in" is 0 where the producers' specs are what the strategy
    reads, and prices the all-gather of a row-split activation for the replicated strategy."""
    from alpa_lite import LogicalMesh, plan
    from alpa_lite.tools.explain import node_table
    from alpa_lite.zoo.models import build_model

    def seconds(cell: str) -> float:
        if cell == "forbidden":  # a ZeRO-2 weight read by a use that cannot reduce-scatter its gradient
            return float("inf")
        value, unit = cell.split()
        return float(value) * {"s": 1, "ms": 1e-3, "us": 1e-6}[unit]

    model, example = build_model("mlp", 8, hidden=32, num_layers=2)
    p = plan(model, example, LogicalMesh((2, 2), cluster="cpu-gloo"), batch_axis=0, zero_stage=2)
    t = node_table(p, "layers.0.weight")
    cells = {c.header: list(c._cells) for c in t.columns}
    marked = [i for i, m in enumerate(cells[""]) if m == "*"]
    assert len(marked) == 1 and cells["ZeRO"][marked[0]] == "2 @ axis 0" and "(layers.0.weight)" in t.title
    linear = next(n for n, np_ in p.nodes.items() if "layers_0_weight" in "".join(np_.inputs))
    cells = {c.header: list(c._cells) for c in node_table(p, linear).columns}
    moved = [seconds(c) for c in cells["operands in"]]  # the weight's reduce-scatter at least
    assert len(moved) > 1 and 0 < moved[cells[""].index("*")] < max(moved)


def test_run_launches_a_script_on_every_rank():
    from pathlib import Path

    script = Path(__file__).parent.parent / "examples" / "parallel_mlp.py"
    r = alpa_lite("run", "--nproc", "4", str(script), "--steps", "3", "--hidden", "64")
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in r.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and 0.5 < losses[0] < 2  # rank 0 only; MSE of unit-variance data
    assert losses[2] < losses[0]  # the same batch every step: the loss falls


def test_plan_pipeline_prints_stages_and_saves_a_chart(tmp_path):
    chart = tmp_path / "chart.png"
    r = alpa_lite("plan", "gpt-tiny", "--mesh", "1x4", "--batch", "16", "--cluster", "cpu-gloo", "--pipeline", "2",
                  "--schedule", "gpipe", "--schedule-chart", str(chart))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "pipeline: 2 stages, gpipe" in r.stdout and "bubble" in r.stdout
    # the summary gives the pipeline's step (stages overlap: no compute + communication sum)
    assert "2 stages, 4 microbatches (gpipe), bubble" in r.stdout and "communication" not in r.stdout
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_of_one_stage_says_stage():
    r = alpa_lite("plan", "mlp", "--mesh", "1x2", "--batch", "8", "--cluster", "cpu-gloo", "--pipeline", "1",
                  "--microbatches", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "pipeline: 1 stage, 1f1b, 1 microbatch " in r.stdout and "1 stage, 1 microbatch (1f1b)" in r.stdout


def test_train_saves_and_resumes_on_another_mesh(tmp_path):
    """The main job with --accumulate and --max-grad-norm, saved at step 2 on a 1x2 mesh and
    resumed on 2x1 (another plan), logs the losses of the uninterrupted run (fp32, 1e-5 relative)."""
    flags = ["--nproc", "2", "--seq", "16", "--batch", "8", "--layers", "1", "--hidden", "32", "--accumulate", "2",
             "--max-grad-norm", "0.5"]
    runs = {"whole": ["--mesh", "1x2", "--steps", "4"],
            "first": ["--mesh", "1x2", "--steps", "2", "--save", str(tmp_path / "ckpt")],
            "resumed": ["--mesh", "2x1", "--steps", "4", "--resume", str(tmp_path / "ckpt")]}
    logs = {}
    for name, extra in runs.items():
        r = alpa_lite("train", *flags, *extra, "--out", str(tmp_path / name))
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        logs[name] = [json.loads(line) for line in (tmp_path / name / "log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in logs["resumed"]] == [2, 3]
    assert [x["loss"] for x in logs["first"] + logs["resumed"]] == pytest.approx([x["loss"] for x in logs["whole"]],
                                                                              rel=1e-5)
    assert all(x["grad_norm"] > 0 for x in logs["whole"])
    r = alpa_lite("train", "--resume", str(tmp_path / "nothing"))
    assert r.returncode == 2 and "no checkpoint there" in " ".join(r.stderr.split())


def test_plan_cache_replans_another_batch_from_the_graph(capsys, tmp_path):
    """``--cache DIR``: a second run at another batch reads the captured graph (said in the summary)
    and writes the plan a run without the cache writes."""
    cache, plans = tmp_path / "cache", {}
    for name, batch, extra in (("first", "8", ["--cache", str(cache)]), ("again", "16", ["--cache", str(cache)]),
                               ("fresh", "16", [])):
        r = in_process(capsys, "plan", "gpt-tiny", "--mesh", "2x2", "--batch", batch, "--json",
                       str(tmp_path / f"{name}.json"), *extra)
        assert r.returncode == 0, r.stderr
        plans[name] = ((tmp_path / f"{name}.json").read_text(), "captured graph read from the cache" in r.stdout)
    assert [read for _, read in plans.values()] == [False, True, False]
    assert plans["again"][0] == plans["fresh"][0]
    for f in cache.rglob("*"):  # one byte changed in every cache file: each is rebuilt, said on stderr
        if f.is_file():
            blob = bytearray(f.read_bytes())
            blob[-2] ^= 1
            f.write_bytes(bytes(blob))
    r = in_process(capsys, "plan", "gpt-tiny", "--mesh", "2x2", "--batch", "16", "--json",
                   str(tmp_path / "rebuilt.json"), "--cache", str(cache))
    assert r.returncode == 0, r.stderr
    assert "ignored and rebuilt" in r.stderr and "ignored and rebuilt" not in r.stdout
    assert (tmp_path / "rebuilt.json").read_text() == plans["fresh"][0]


def _no_batch():
    return torch.nn.Linear(2, 1), (torch.zeros(2, 2),)


def _not_a_pair(batch, seq):
    return torch.nn.Linear(2, 1)


def test_plan_module_callable_bad_signature_is_one_clear_line(capsys):
    # a callable without batch / seq died with a raw "got an unexpected keyword argument 'batch'"
    # traceback, one returning a bare model with a raw TypeError traceback
    r = in_process(capsys, "plan", f"{__name__}:_no_batch", "--mesh", "1x2")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    err = " ".join(r.stderr.split())  # rich wraps long lines
    assert "_no_batch(batch=, seq=, ...)" in err and "does not accept batch, seq" in err, err
    r = in_process(capsys, "plan", f"{__name__}:_not_a_pair", "--mesh", "1x2")
    err = " ".join(r.stderr.split())
    assert r.returncode == 2 and "must return (model, example_inputs), got Linear" in err, err


def test_train_runs_a_pipelined_plan_file(tmp_path):
    """``alpa-lite train --plan`` with a plan ``alpa-lite plan --pipeline`` wrote (2 stages x 1
    device, 2 microbatches): its stage table, the SPMD run's losses and validation loss (the
    pipeline's forward-only ``PipelineTrainer.loss``). Before, rank 0 died printing the SPMD
    collective table ('PipelinePlan' object has no attribute 'collectives'), and the pipeline
    trainer had no ``loss`` for the validation."""
    flags = ["--nproc", "2", "--mesh", "1x2", "--seq", "16", "--batch", "8", "--steps", "2"]
    plan = tmp_path / "pipe.json"
    r = alpa_lite("plan", "gpt-tiny", "--mesh", "1x2", "--batch", "8", "--seq", "16", "--cluster", "cpu-gloo",
                  "--pipeline", "2", "--microbatches", "2", "--json", str(plan))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    out = {}
    for name, extra in {"spmd": [], "pipe": ["--plan", str(plan)]}.items():
        r = alpa_lite("train", *flags, *extra, "--out", str(tmp_path / name))
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        out[name] = (r.stdout, [json.loads(x)["loss"] for x in (tmp_path / name / "log.jsonl").read_text().splitlines()],
                     json.loads((tmp_path / name / "summary.json").read_text())["val_loss"])
    assert "microbatches" in out["pipe"][0] and "collectives per training step" not in out["pipe"][0]
    assert out["pipe"][1] == pytest.approx(out["spmd"][1], rel=1e-5)
    assert out["pipe"][2] == pytest.approx(out["spmd"][2], rel=1e-5)
