"""The compiled per-rank program (``parallelize(..., compile=...)``, ``runtime/program.py``): on
4 gloo ranks, 3 AdamW steps of the plan lowered to one ``torch.fx.GraphModule`` per rank and run
under ``torch.compile`` give the interpreter's losses and parameters, and each rank's graph holds
the plan's forward and backward collectives; what the lowering does not cover is refused."""
import json
from pathlib import Path

import pytest
import torch

from alpa_lite import parallelize
from alpa_lite.runtime.launch import torchrun
from test_overlap import SMALL, megatron

WORKERS = Path(__file__).parent / "workers"
SPMD = {  # test_overlap's plans, of a one-block GPT (tracing and compiling take most of the time)
    "dp": {"force_data_parallel": True, "bucket_bytes": SMALL},
    "megatron": {"batch_axis": 0, "param_specs": megatron(1), "bucket_bytes": SMALL},
    "2d": {"param_specs": megatron(1, "S01"), "bucket_bytes": SMALL},
    "zero3": {"force_data_parallel": True, "bucket_bytes": SMALL,
              "param_specs": {k: "S01R" for k, v in megatron(1).items() if v == "S1R"}},
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile") / "results.json"
    assert torchrun([str(WORKERS / "compiled.py"), "--plans", json.dumps(SPMD), "--backend", "aot_eager",
                     "--out", str(out)], nproc=4, timeout_s=600) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", list(SPMD))
def test_compiled_step_equals_interpreted_step(results, name):
    r = results[name]
    assert r["graph_module"]  # every rank traced a torch.fx.GraphModule
    assert r["losses"] == r["plain_losses"]
    assert r["param_diff"] == 0.0  # the same ops on the same shards, the same collectives in the same order
    assert r["plan_collectives"]  # each plan communicates in forward / backward (dp: its loss's all-reduces)
    assert all(g == r["plan_collectives"] for g in r["graph_collectives"]), r["graph_collectives"]
    # outside the program, only the plan's gradient buckets ran (through the interpreter's counted collectives)
    assert r["interpreted_during_compiled"] == r["buckets_3_steps"]


def test_compile_refuses_a_pipelined_plan():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    with pytest.raises(ValueError, match="compile=True runs SPMD plans"):
        parallelize(model, (2, 2), torch.randn(8, 4), compile=True, pipeline=2)


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
