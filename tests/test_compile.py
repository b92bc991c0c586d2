"""The compiled per-rank program (``parallelize(..., compile=...)``, ``runtime/program.py``): on
4 gloo ranks, 3 AdamW steps of the plan lowered to one ``torch.fx.GraphModule`` per rank (a
pipeline stage: a forward and a backward one, AOT autograd) and run under ``torch.compile`` give
the interpreter's losses and parameters, and each rank's graphs hold the plan's forward and
backward collectives; what the lowering does not cover is refused."""
import json
from pathlib import Path

import pytest
import torch

from alpa_lite.runtime.launch import torchrun
from test_overlap import SMALL, megatron

WORKERS = Path(__file__).parent / "workers"
PLANS = {  # test_overlap's plans, of a one-block GPT (tracing and compiling take most of the time)
    "dp": {"force_data_parallel": True, "bucket_bytes": SMALL},
    "megatron": {"batch_axis": 0, "param_specs": megatron(1), "bucket_bytes": SMALL},
    "2d": {"param_specs": megatron(1, "S01"), "bucket_bytes": SMALL},
    "zero3": {"force_data_parallel": True, "bucket_bytes": SMALL,
              "param_specs": {k: "S01R" for k, v in megatron(1).items() if v == "S1R"}},
    # 2 stages of one block each (model_layers: the worker's GPT), 2 devices each, Megatron inside a stage
    "pipeline": {"model_layers": 2, "num_stages": 2, "num_layers": 2, "num_microbatches": 2, "schedule": "1f1b",
                 "param_specs": megatron(2), "bucket_bytes": SMALL},
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile") / "results.json"
    assert torchrun([str(WORKERS / "compiled.py"), "--plans", json.dumps(PLANS), "--backend", "aot_eager",
                     "--out", str(out)], nproc=4, timeout_s=600) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", list(PLANS))
def test_compiled_step_equals_interpreted_step(results, name):
    r = results[name]
    assert r["graph_module"]  # every rank traced its torch.fx.GraphModule(s)
    assert r["losses"] == r["plain_losses"]
    assert r["param_diff"] == 0.0  # the same ops on the same shards, the same collectives in the same order
    assert all(r["plan_collectives"])  # each rank's plan communicates in forward / backward (dp: its loss's all-reduces)
    # per rank: its graph(s) hold its plan's collectives (a stage's forward and backward graph each its phase's)
    assert r["graph_collectives"] == r["plan_collectives"]
    # outside the program, only the plan's gradient buckets ran (through the interpreter's counted collectives)
    assert r["interpreted_during_compiled"] == r["buckets_3_steps"]


def test_compiled_pipeline_has_two_stages_of_two_devices_and_overlaps_its_buckets(results):
    r = results["pipeline"]
    assert r["stage_devices"] == [2, 2] and r["schedule"] == "1f1b"
    stage0 = r["graph_collectives"][0]  # rank 0's: stage 0 communicates inside both of its graphs
    assert any(k.endswith("|forward") for k in stage0) and any(k.endswith("|backward") for k in stage0), stage0
    # the compiled backward accumulates into .grad as autograd does: each bucket's all-reduce starts
    # from its hook during the stage's last backward (rank 0's stage synchronizes a bucket)
    assert all(n == t for n, t in r["early_buckets"]) and r["early_buckets"][0][1] >= 1, r["early_buckets"]


def test_compile_refuses_a_split_backward_schedule():
    from alpa_lite import LogicalMesh, plan
    from alpa_lite.runtime.pipeline import PipelineTrainer

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    pl = plan(model, torch.randn(8, 8), LogicalMesh((1, 2), cluster="cpu-gloo"), lambda y: y.mean(), num_stages=2,
              num_microbatches=2, num_layers=2, schedule="zb-h1", workers=1)
    with pytest.raises(ValueError, match="compile=True cannot run the zb-h1 schedule: a compiled stage's backward is "
                                         "one graph"):
        PipelineTrainer(model, pl.captured, pl, None, compile="aot_eager")


@pytest.mark.parametrize("p, refused", [(0.5, True), (0.0, False)])
def test_lowering_refuses_random_draws_only(p, refused):
    from alpa_lite import LogicalMesh, plan
    from alpa_lite.runtime.collectives import MeshGroups
    from alpa_lite.runtime.executor import LocalExecutor
    from alpa_lite.runtime.program import RankProgram

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(p), torch.nn.Linear(8, 1))
    pl = plan(model, torch.randn(8, 8), LogicalMesh((2, 2), cluster="cpu-gloo"), lambda y: y.mean(),
              force_data_parallel=True)
    executor = LocalExecutor(pl.captured, pl, MeshGroups((2, 2), (0, 0), (None, None)), torch.device("cpu"))
    if refused:
        with pytest.raises(ValueError, match="cannot lower this plan .*random op"):
            RankProgram(executor, None, [], None)
    else:
        assert RankProgram(executor, None, [], None).graph_module is None  # traced on its first call
