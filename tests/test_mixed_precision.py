"""Mixed precision (``PlanOptions.mixed_precision``): the cost model's bytes follow the dtypes,
and 4 gloo ranks train as one process does with the same recipe (fp32 master weights)."""
import json
from pathlib import Path

import pytest
import torch

import alpa_lite
from alpa_lite.core.capture import capture
from alpa_lite.core.mesh import LogicalMesh
from alpa_lite.runtime.launch import torchrun
from alpa_lite.zoo.models import build_model
from test_runtime import megatron

WORKER = str(Path(__file__).parent / "workers" / "mixed_precision.py")
MEGATRON = {"batch_axis": 0, "param_specs": megatron("blocks.", 2)}
PLANS = {"dp": {"mixed_precision": "bf16", "force_data_parallel": True},
         "dp-fp32-reduce": {"mixed_precision": "bf16", "force_data_parallel": True, "reduce_dtype": "fp32"},
         "megatron": {"mixed_precision": "bf16", **MEGATRON},
         "megatron-fp16": {"mixed_precision": "fp16", **MEGATRON},
         "pipeline": {"mixed_precision": "bf16", "pipeline": 2, "num_microbatches": 2}}


def test_capture_casts_each_parameter_use_and_keeps_fp32_placeholders():
    model, example = build_model("gpt-tiny", 4, 16, device="meta")
    cg = capture(model, example, compute_dtype=torch.bfloat16)
    uses = sum(len(cg.node(ph).users) for ph in cg.param_fqns)
    assert len(cg.param_casts) == uses  # one cast per use, each read by one op
    assert all(len(cg.node(c).users) == 1 for c in cg.param_casts)
    assert {str(cg.node(ph).meta["val"].dtype) for ph in cg.param_fqns} == {"torch.float32"}
    linears = [n for n in cg.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert linears and {n.meta["val"].dtype for n in linears} == {torch.bfloat16}
    assert cg.node(cg.loss_name).meta["val"].dtype == torch.float32
    # every cast sits in its user's module (layer clustering and layer sharing see the same layers)
    assert all(cg.node(c).meta["nn_module_stack"] == next(iter(cg.node(c).users)).meta["nn_module_stack"]
               for c in cg.param_casts)


def test_cost_model_bytes_follow_the_dtypes():
    model, example = build_model("gpt-tiny", 8, 16, device="meta")
    mesh = LogicalMesh((2, 2), cluster="cpu-gloo")
    plans = {(mp, rd): alpa_lite.plan(model, example, mesh, force_data_parallel=True, mixed_precision=mp,
                                      reduce_dtype=rd)
             for mp, rd in ((None, None), ("bf16", None), ("bf16", "fp32"))}
    buckets = {k: sum(c.nbytes for c in p.collectives if c.node.startswith("gradient bucket"))
               for k, p in plans.items()}
    assert buckets[("bf16", None)] == buckets[(None, None)] / 2  # bf16 gradients reduced
    assert buckets[("bf16", "fp32")] == buckets[(None, None)]
    fp32, bf16 = plans[(None, None)], plans[("bf16", None)]
    assert set(bf16.grad_sync) == set(fp32.grad_sync)  # the casts do not stop bucketing
    params = sum(4 * v.numel() for v in model.parameters()) * 4  # fp32 param + grad + 2 Adam moments
    acts = lambda p: p.memory_bytes - params  # noqa: E731 - replicated parameters under DP
    # within 10%: what keeps its dtype (int64 token ids and positions, the fp32 loss) is left
    assert acts(bf16) == pytest.approx(acts(fp32) / 2, rel=0.10)  # 160706 vs 152066 B
    with pytest.raises(ValueError, match="mixed_precision"):
        alpa_lite.plan(model, example, mesh, mixed_precision="fp8")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("mp") / "results.json"
    code = torchrun([WORKER, "--plans", json.dumps(PLANS), "--out", str(out)], nproc=4, timeout_s=600)
    assert code == 0, f"torchrun exited with {code}"
    return json.loads(out.read_text())


def test_mixed_precision_training_equals_one_process(results):
    for name, r in results.items():
        # bf16 keeps 8 mantissa bits (relative rounding 2^-9, a loss near 4 moves in steps of
        # 2^-5): the ranks compute partial sums over shards and reduce them in bf16 in another
        # order than one process's matmuls, so values differ by a few bf16 ulps (measured: 1 ulp
        # of the loss, gradients within ~1% of their largest element)
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=2e-2), name
        assert r["grad_err"] <= 2e-2 * r["grad_scale"], (name, r["grad_err"], r["grad_scale"])
        # SGD (lr 0.1, momentum 0.9): a parameter moves by lr x its gradients, so the gradient
        # tolerance carries over (AdamW would turn bf16 noise in near-zero gradients into lr-sized steps)
        assert r["param_err"] <= 1e-3, (name, r["param_err"])
        assert r["master_dtypes"] == ["torch.float32"] and r["state_dtypes"] == ["torch.float32"], name


def test_gradients_are_reduced_in_the_chosen_dtype(results):
    for name in ("dp", "pipeline"):
        assert results[name]["bucket_dtypes"] == ["torch.bfloat16"], name
    assert results["dp"]["bucket_bytes_plan"] == results["dp"]["param_bytes"] / 2
    assert results["dp-fp32-reduce"]["bucket_dtypes"] == ["torch.float32"]
    assert results["dp-fp32-reduce"]["bucket_bytes_plan"] == results["dp-fp32-reduce"]["param_bytes"]


def test_fp16_loss_scaler_skips_an_overflow_on_every_rank(results):
    r = results["megatron-fp16"]
    assert r["skipped"] == [True]  # rank 0's inf shard: no rank stepped (rank 0 wrote the record)
    assert r["scale_after_skip"] == 2.0**15
