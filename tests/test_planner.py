"""Known regimes of the intra-op planner (Alpa's own MLP tests) and plan invariants."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from alpa_lite import LogicalMesh, Plan, plan
from alpa_lite.core.capture import CaptureError
from alpa_lite.compiler.ilp import MemoryBudgetError
from alpa_lite.core.plan import PlanError

UNIT = dict(mesh_alpha=(1, 1), mesh_beta=(1, 1), cluster="unit")


class MLP(nn.Module):
    def __init__(self, hidden, layers=6):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))

    def forward(self, x, y):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return F.mse_loss(x, y)


def mlp_plan(hidden, batch, **options):
    with torch.device("meta"):
        model = MLP(hidden)
    x = torch.zeros(batch, hidden, device="meta")
    y = torch.zeros(batch, hidden, device="meta")
    return plan(model, (x, y), LogicalMesh((1, 4), **UNIT), **options)


def test_megatron_mlp_when_weights_dominate():
    # hidden 256, batch 32: replicated weights (6.8 MB with Adam) do not fit 2 MB per device; the
    # cheapest way to shard them is Megatron's column-then-row pairs: one all-reduce per pair.
    p = mlp_plan(256, 32, memory_budget=2e6)
    for i in range(6):
        assert p.param_specs[f"layers.{i}.weight"] == ("S1R" if i % 2 == 0 else "RS1"), i
    counts = p.collective_counts()
    assert counts[("all-reduce", "forward")] == 3
    assert counts[("all-reduce", "backward")] == 2  # the first layer's input is data: no gradient
    assert set(counts) == {("all-reduce", "forward"), ("all-reduce", "backward")}
    act = 32 * 256 * 4
    assert all(c.nbytes == act and c.mesh_axes == (1,) for c in p.collectives)
    assert p.comm_seconds == pytest.approx(5 * (1 + 2 * 3 / 4 * act), rel=1e-6)


def test_data_parallel_mlp_when_activations_dominate():
    # hidden 32, batch 256: activations dominate memory; splitting the batch and all-reducing the
    # small weight gradients is cheapest: pure data parallel.
    p = mlp_plan(32, 256, memory_budget=2.4e5)
    assert all(spec in ("RR", "R") for spec in p.param_specs.values())
    assert p.input_specs == {"args_0": "S1R", "args_1": "S1R"}
    counts = p.collective_counts()
    assert counts[("all-reduce", "backward")] == 1  # all 12 gradients in one bucket, as DDP does
    assert counts[("all-reduce", "forward")] == 1   # the loss' partial mean
    assert len(p.grad_sync) == 12 and set(p.grad_sync.values()) == {(1,)}
    bucket = [c for c in p.collectives if c.phase == "backward"][0]
    assert bucket.nbytes == 6 * (32 * 32 + 32) * 4


def test_forced_plans():
    dp = mlp_plan(32, 64, force_data_parallel=True)
    assert set(dp.param_specs.values()) <= {"RR", "R"}
    assert all(s.startswith("S1") for s in dp.input_specs.values())
    tp = mlp_plan(32, 64, param_specs={"layers.0.weight": "S1R", "layers.1.weight": "RS1"})
    assert tp.param_specs["layers.0.weight"] == "S1R" and tp.param_specs["layers.1.weight"] == "RS1"
    with pytest.raises(ValueError, match="does not divide"):
        mlp_plan(30, 64, param_specs={"layers.0.weight": "S1R"})
    with pytest.raises(ValueError, match="not a parameter"):
        mlp_plan(32, 64, param_specs={"nope.weight": "S1R"})
    with pytest.raises(ValueError, match=r"batch dim 0 of input 0 \(args_0, shape \(6, 32\)\) does not divide over "
                                         r"mesh axes \[1\] of mesh \(1, 4\), 4 devices: give a batch that is a "
                                         r"multiple of 4"):
        mlp_plan(32, 6, force_data_parallel=True)
    # an input spec that keeps the batch whole against batch_axis: the spec is named (the error
    # said the batch of 64 "does not divide over mesh axes [1]")
    with pytest.raises(ValueError, match=r"input_specs gives input args_0 \(shape \(64, 32\)\) the spec RS1, which "
                                         r"does not split its batch dim 0 along mesh axes \[1\] as batch_axis asks"):
        mlp_plan(32, 64, batch_axis=1, input_specs={"0": "RS1"})


def test_memory_budget_error_names_minimum():
    with pytest.raises(MemoryBudgetError, match="least any plan needs") as err:
        mlp_plan(256, 32, memory_budget=1e5)
    assert 1e5 < err.value.minimum_bytes < 2e6
    # a budget under a GiB is also given in bytes (it printed as "0.000 GiB")
    assert "budget of 0.000 GiB (100000 bytes) per device" in str(err.value)
    assert f"({err.value.minimum_bytes:.0f} bytes)" in str(err.value)


def test_plan_json_round_trip_and_determinism():
    a = mlp_plan(64, 64, memory_budget=3e5)
    b = mlp_plan(64, 64, memory_budget=3e5)
    assert a.to_json() == b.to_json()
    back = Plan.from_json(a.to_json())
    assert back.to_json() == a.to_json()
    assert back.param_specs == a.param_specs and back.collective_counts() == a.collective_counts()


def test_corrupt_plan_is_a_clear_error(tmp_path):
    with pytest.raises(PlanError, match="corrupt"):
        Plan.from_json('{"version": 1, "nodes": 3}')
    bad = tmp_path / "plan.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="corrupt"):
        Plan.from_json(str(bad))
    with pytest.raises(PlanError, match="cannot read"):
        Plan.from_json(str(tmp_path / "missing.json"))


def test_uncapturable_model_names_the_construct():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            if y.sum() > 0:  # data-dependent control flow
                y = y * 2
            return y.sum()

    with pytest.raises(CaptureError, match="DataDependent"):
        plan(DataDependent(), (torch.randn(2, 4),), LogicalMesh((1, 2)))


def test_a_value_read_from_a_tensor_names_the_line_and_what_to_do():
    """``nn.BatchNorm1d(momentum=None)`` takes ``1 / float(num_batches_tracked)`` in Python: export
    stopped with "Could not extract specialized integer from data-dependent expression u0" and
    nothing else; the message now names the model's line and the fix."""
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6, momentum=None))
    with pytest.raises(CaptureError, match=r"taken from a tensor's values .* at File .*, line \d+, in forward: .*"
                                           r"BatchNorm with momentum=None .* give it a momentum"):
        plan(model, (torch.randn(4, 4),), LogicalMesh((1, 2)), loss_fn=lambda out: out.pow(2).mean())


def test_a_tuple_output_says_how_to_pick_the_loss():
    """A ``(loss, logits)`` tuple (HF's ``return_dict=False``) was refused with "the model returned
    2 outputs" only; the message says how to pick the loss, and ``loss_fn=lambda out: out[0]`` plans."""
    class LossAndLogits(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            return y.pow(2).mean(), y

    with pytest.raises(CaptureError, match=r"returned 2 outputs: return the loss alone or a dict with a 'loss' entry, or "
                                           r"pass loss_fn= .*out\[0\]"):
        plan(LossAndLogits(), (torch.randn(2, 4),), LogicalMesh((1, 2)))
    p = plan(LossAndLogits(), (torch.randn(2, 4),), LogicalMesh((1, 2)), loss_fn=lambda out: out[0])
    assert set(p.param_specs) == {"fc.weight", "fc.bias"}


def test_non_scalar_output_needs_loss_fn():
    with pytest.raises(CaptureError, match="loss_fn"):
        plan(nn.Linear(4, 4), (torch.randn(2, 4),), LogicalMesh((1, 2)))
    p = plan(nn.Linear(4, 4), (torch.randn(2, 4),), LogicalMesh((1, 2)), loss_fn=lambda out: out.pow(2).mean())
    assert set(p.param_specs) == {"weight", "bias"}


def test_a_tied_weight_written_in_place_is_named():
    """An ``Embedding(max_norm=)`` whose weight is also the output layer's: functionalizing its
    in-place renorm died inside torch's AOT export ("AssertionError: expected compiled_fn to be
    GraphModule"); capture names the written weight and the fix."""
    class TiedMaxNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(8, 4, max_norm=1.0)
            self.head = nn.Linear(4, 8, bias=False)
            self.head.weight = self.tok.weight

        def forward(self, ids):
            return self.head(self.tok(ids)).logsumexp(-1).mean()

    with pytest.raises(CaptureError, match=r"writes head\.weight in place .* tied weight written in place .* untie"):
        plan(TiedMaxNorm(), (torch.randint(0, 8, (2, 3)),), LogicalMesh((1, 2)))


def test_mixed_precision_refuses_a_weight_written_in_place():
    """Under bf16 the model runs on low-precision copies of its weights, one cast per reader: an
    ``Embedding(max_norm=)``'s renorm of its copy reached no reader, and the plan trained silently
    wrong (gradients 534 x their verify bound under data parallelism); now refused by name."""
    class MaxNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(8, 4, max_norm=1.0)
            self.head = nn.Linear(4, 8)

        def forward(self, ids):
            return self.head(self.tok(ids)).logsumexp(-1).mean()

    with pytest.raises(CaptureError, match=r"low-precision copy of tok\.weight in place"):
        plan(MaxNorm(), (torch.randint(0, 8, (2, 3)),), LogicalMesh((1, 2)), mixed_precision="bf16")
    plan(MaxNorm(), (torch.randint(0, 8, (2, 3)),), LogicalMesh((1, 2)))  # fp32: the weight itself is renormalized


def test_op_without_generator_runs_replicated_with_warning():
    class Rot90(nn.Module):  # aten.rot90 has no strategy rule
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return torch.rot90(self.fc(x), 1, (0, 1)).mean()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = plan(Rot90(), (torch.randn(8, 8),), LogicalMesh((2, 2), **UNIT))
    assert any("rot90" in str(w.message) for w in caught)
    assert p.nodes["rot90"].out_specs == ("RR",)
