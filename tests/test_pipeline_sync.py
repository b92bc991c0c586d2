"""Pipelined plans with several devices per stage train equal to one process (4 gloo ranks).

Inside a stage the devices split the batch (or the weights); its gradients must be synchronized
as the stage's specs say, once per step after the last microbatch, and a weight two stages use
(tied embeddings) gets the sum of both stages' gradients. The matrix: {2 stages x 2 devices,
1 stage x 4 devices} x {GPipe, 1F1B} x {B = 1, 2, 4} x {data parallel, Megatron, ZeRO-3 (S01R),
auto}, then tied embeddings across 2 stages x 2 devices and inside one stage of 4, every layer
recomputed (``remat="all"``) on 2 stages x 2 devices, and some (``remat="auto"`` under a memory
budget, 1F1B), and a stage without parameters, and
ZB-H1 (split backward) on 4 stages x 1 device (B = 2 < S and B = 4)
and 2 stages x 2 devices (Megatron inside, and the tied embedding), and interleaved 1F1B with
2 chunks per device group (``interleaved_cases``). Every plan is trained with SGD (exact zeros stay zero, errors stay linear)
and with AdamW. Tolerances as tests/test_runtime.py: losses 1e-5 relative, gradients 1e-4 of the
largest, parameters 1e-5 (SGD) / 2e-4 (AdamW: rounding of near-zero gradients becomes a step);
a missing all-reduce is off by O(gradient) and O(lr) = 1e-2 per step.
"""
import json
from pathlib import Path

import pytest

from alpa_lite.runtime.launch import torchrun
from test_remat import PIPELINE_AUTO

WORKER = str(Path(__file__).parent / "workers" / "pipeline_sync.py")
SCHEDULES = ["gpipe", "1f1b"]
MLP = {"model": "mlp", "batch": 128, "build": {"num_layers": 4, "hidden": 16}}
W = [f"layers.{i}.weight" for i in range(4)]
SPECS = {
    "dp": {"force_data_parallel": True},
    "megatron": {"param_specs": {w: ("S1R" if i % 2 == 0 else "RS1") for i, w in enumerate(W)}},
    "zero3": {"force_data_parallel": True, "param_specs": {w: "S01R" for w in W}},
    "auto": {},
}
LAYOUTS = {"2x2": 2, "1x4": 1}  # stages of 2 devices / one stage of 4


def cases() -> dict:
    out = {}
    for layout, stages in LAYOUTS.items():
        for b in (1, 2, 4):
            for spec, options in SPECS.items():
                plan = {"num_stages": stages, "num_microbatches": b, "num_layers": 4} | options
                out[f"mlp/{layout}/B{b}/{spec}"] = MLP | {"plan": plan, "schedules": SCHEDULES}
    gpt = {"model": "gpt-tiny", "batch": 8, "seq": 16, "schedules": SCHEDULES}
    out["tied/2x2/dp"] = gpt | {"plan": {"num_stages": 2, "num_microbatches": 2, "force_data_parallel": True}}
    out["tied/1x4/dp"] = gpt | {"plan": {"num_stages": 1, "num_microbatches": 2, "force_data_parallel": True}}
    out["remat/2x2/all"] = gpt | {"plan": {"num_stages": 2, "num_microbatches": 2, "remat": "all"}}
    out["remat/2x2/none"] = gpt | {"schedules": ["1f1b"], "plan": {"num_stages": 2, "num_microbatches": 2}}
    out["remat/2x2/auto"] = {"model": "gpt-tiny", "batch": 16, "seq": 64, "schedules": ["1f1b"],
                             "plan": PIPELINE_AUTO | {"remat": "auto"}}
    out["parameter-free/2x2"] = {"model": "parameter-free-tail", "batch": 8, "schedules": SCHEDULES, "plan": {
        "num_stages": 2, "num_layers": 2, "num_microbatches": 2, "force_data_parallel": True}}
    zb = {"schedules": ["zb-h1"]}
    for b in (2, 4):
        out[f"zb/mlp/4x1/B{b}"] = MLP | zb | {"plan": {"num_stages": 4, "num_microbatches": b, "num_layers": 4}}
    out["zb/mlp/2x2/megatron"] = MLP | zb | {"plan": {"num_stages": 2, "num_microbatches": 4, "num_layers": 4}
                                             | SPECS["megatron"]}
    out["zb/tied/2x2/dp"] = gpt | zb | {"plan": {"num_stages": 2, "num_microbatches": 2, "force_data_parallel": True}}
    out.update(interleaved_cases())
    return out


def interleaved_cases() -> dict:
    """Interleaved 1F1B, 2 chunks per device group: 4 groups of 1 device (8 stages, B = 4),
    2 groups of 2 devices (4 stages; data parallel and Megatron inside, B = 2 and 4), and the
    tied embedding on the first and the last of 4 stages."""
    il = {"schedules": ["interleaved"]}
    mlp8 = MLP | {"build": {"num_layers": 8, "hidden": 16}}
    out = {"il/mlp/4x1x2/B4": mlp8 | il | {"plan": {"num_stages": 8, "num_microbatches": 4, "num_layers": 8,
                                                    "schedule": "interleaved"}}}
    four = {"num_stages": 4, "num_layers": 4, "schedule": "interleaved"}
    out["il/mlp/2x2x2/B4/dp"] = MLP | il | {"plan": four | {"num_microbatches": 4} | SPECS["dp"]}
    out["il/mlp/2x2x2/B2/megatron"] = MLP | il | {"plan": four | {"num_microbatches": 2} | SPECS["megatron"]}
    out["il/tied/2x2x2/dp"] = {"model": "gpt-tiny", "batch": 8, "seq": 16, "build": {"num_layers": 4}} | il | {
        "plan": four | {"num_microbatches": 2, "force_data_parallel": True}}
    return out


def test_interleaved_layouts(results):
    # stage s runs on the ranks of stage s mod p: p = 4 groups of 1, p = 2 groups of 2
    assert [s["ranks"] for s in results["il/mlp/4x1x2/B4/interleaved"]["stages"]] == [[r] for r in range(4)] * 2
    for name in ("il/mlp/2x2x2/B4/dp", "il/mlp/2x2x2/B2/megatron", "il/tied/2x2x2/dp"):
        stages = results[f"{name}/interleaved"]["stages"]
        assert [s["ranks"] for s in stages] == [[0, 1], [2, 3], [0, 1], [2, 3]], name
    stages = results["il/tied/2x2x2/dp/interleaved"]["stages"]  # the embedding on stage 0, the head on 3
    assert "wte.weight" in stages[0]["params"] and "lm_head.weight" in stages[3]["params"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline_sync") / "results.json"
    rc = torchrun([WORKER, "--cases", json.dumps(cases()), "--out", str(out)], nproc=4, timeout_s=900)
    assert rc == 0, f"torchrun exited with {rc}"
    return json.loads(out.read_text())


def test_every_plan_trains_equal_to_one_process(results):
    assert len(results) == sum(len(c["schedules"]) for c in cases().values())
    for name, r in results.items():
        for opt, param_tol in (("sgd", 1e-5), ("adamw", 2e-4)):
            got = r[opt]
            assert got["losses"] == pytest.approx(got["ref_losses"], rel=1e-5), (name, opt)
            err, scale = got["grad_err"]
            assert err <= 1e-4 * scale, (name, opt, err, scale)
            assert got["param_err"][0] <= param_tol, (name, opt, got["param_err"])


def test_stages_carry_their_gradient_syncs(results):
    for name, r in results.items():
        if not name.startswith("mlp/"):
            continue
        layout, b = name.split("/")[1], int(name.split("/")[2][1:])
        assert r["num_microbatches"] == b, name
        assert [len(s["ranks"]) for s in r["stages"]] == ([2, 2] if layout == "2x2" else [4]), name
        for s in r["stages"]:  # the batch is split inside every stage: replicated weights are synced
            if "/dp/" in name:
                assert s["grad_sync"] == s["params"], (name, s)
            if "/zero3/" in name:  # the S01R weights' gradients are reduce-scattered in backward
                assert s["grad_sync"] == [p for p in s["params"] if p.endswith("bias")], (name, s)


def test_tied_embedding_across_stages(results):
    for schedule in SCHEDULES:
        stages = results[f"tied/2x2/dp/{schedule}"]["stages"]
        assert all({"wte.weight", "lm_head.weight"} <= set(s["params"]) for s in stages), stages


def test_stage_without_parameters_trains(results):
    for schedule in SCHEDULES:
        stages = results[f"parameter-free/2x2/{schedule}"]["stages"]
        assert [len(s["ranks"]) for s in stages] == [2, 2]
        assert stages[0]["params"] == ["lin.bias", "lin.weight"] and stages[1]["params"] == []


def test_stages_recompute_their_layers(results):
    """Every layer of both stages under torch.utils.checkpoint: the stages' plans list them, and
    what autograd saves for backward (the stage's activation meter) is a fraction of what the same
    pipeline saves without remat (only the layers' inputs are kept)."""
    peak = lambda name: {stage: b for stage, b in results[name]["sgd"]["peak_activation_bytes"]}
    kept = peak("remat/2x2/none/1f1b")
    for schedule in SCHEDULES:
        assert all(s["remat_layers"] > 0 for s in results[f"remat/2x2/all/{schedule}"]["stages"])
        assert all(s["remat_layers"] == 0 for s in results[f"tied/2x2/dp/{schedule}"]["stages"])
        recomputed = peak(f"remat/2x2/all/{schedule}")
        assert all(0 < recomputed[s] < kept[s] / 2 for s in kept), (schedule, recomputed, kept)


def test_stages_recompute_the_layers_chosen(results):
    # remat="auto": the first stage recomputes some of its layers under the budget, not all
    stages = results["remat/2x2/auto/1f1b"]["stages"]
    assert stages[0]["remat_layers"] > 0 and sum(s["remat_layers"] for s in stages) < 9


def test_zb_h1_layouts(results):
    assert [len(s["ranks"]) for s in results["zb/mlp/4x1/B2/zb-h1"]["stages"]] == [1, 1, 1, 1]
    assert [len(s["ranks"]) for s in results["zb/mlp/2x2/megatron/zb-h1"]["stages"]] == [2, 2]
