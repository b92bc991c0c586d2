"""The rules whose local variants communicate train equal to one process on 4 gloo ranks (2x2
mesh, 2 SGD steps, ``alpa_lite.tools.verify``; one torchrun launch for every case):
vocab-parallel cross-entropy (mean with ``ignore_index`` and label smoothing, and sum), a
synchronized batch norm over a batch split on both axes, grouped / depthwise convolutions and a
group norm split by groups (with an instance norm), and sorts, scans and reductions along a whole
dim of a batch split over the mesh (top-k, sort, cumprod, flip, roll, logsumexp, vector norm,
cosine similarity). Each case's plan is checked to use the rule (the planner is deterministic, so
the ranks run the plan checked here). Models: ``tests/workers/op_models.py``."""
import json
import sys
from pathlib import Path

import pytest
import torch

from alpa_lite import LogicalMesh, plan
from alpa_lite.runtime.launch import torchrun
from alpa_lite.zoo.models import build_model

WORKERS = Path(__file__).parent / "workers"
sys.path.insert(0, str(WORKERS))
aten = torch.ops.aten
# all-to-alls off: the sum's cheapest plan moves the logits to S01R by an all-to-all and reduces the
# loss over the whole mesh (deferred) instead of using the vocab-parallel rule
VOCAB = {"batch_axis": 0, "param_specs": {"head.weight": "S1R"}, "allow_all_to_all": False}
CASES = {
    "vocab-mean": {"model": "op_models:vocab_mean", "batch": 4, "seq": 8, "options": VOCAB},
    "vocab-sum": {"model": "op_models:vocab_sum", "batch": 4, "seq": 8, "options": VOCAB},
    "sync-bn": {"model": "op_models:conv_bn", "batch": 8, "options": {"force_data_parallel": True}},
    "groups": {"model": "op_models:conv_bn", "batch": 8,
               "options": {"batch_axis": 0, "param_specs": {"conv.weight": "S1RRR", "dw.weight": "S1RRR"}}},
    "group-norm": {"model": "op_models:conv_gn", "batch": 8,
                   "options": {"batch_axis": 0, "param_specs": {"conv.weight": "S1RRR"}}},
    "sorts": {"model": "op_models:sorts", "batch": 8, "options": {"force_data_parallel": True}},
}
# per case: (op, operand, dim) that the plan must split: the rule in use
USES = {"vocab-mean": (aten.cross_entropy_loss.default, 0, 1), "vocab-sum": (aten.cross_entropy_loss.default, 0, 1),
        "sync-bn": (aten._native_batch_norm_legit_functional.default, 0, 0),
        "groups": (aten.conv2d.default, 0, 1), "group-norm": (aten.group_norm.default, 0, 1),
        "sorts": (aten.topk.default, 0, 0)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("op_rules") / "results.json"
    code = torchrun([str(WORKERS / "verify_cases.py"), "--cases", json.dumps(CASES), "--out", str(out)],
                    nproc=4, timeout_s=600)
    assert code == 0, f"torchrun exited with {code}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", list(CASES))
def test_rule_trains_equal_to_one_process(results, name):
    case = CASES[name]
    model, example = build_model(case["model"], case["batch"], case.get("seq"), device="cpu")
    p = plan(model, example, LogicalMesh((2, 2), cluster="cpu-gloo"), **case["options"])
    target, operand, dim = USES[name]
    nodes = [n for n in p.captured.graph.nodes if n.target is target]
    assert all(p.nodes[n.name].in_specs[operand].dims[dim] for n in nodes), [p.nodes[n.name].in_specs for n in nodes]
    r = results[name]
    assert "error" not in r, r["error"]
    bad = [(x["kind"], x["name"], x["step"], x["max_diff"], x["bound"]) for x in r["rows"] if not x["ok"]]
    assert r["verdict"] == "equal", bad[:5]
    assert {x["kind"] for x in r["rows"]} >= {"loss", "grad", "param"}
