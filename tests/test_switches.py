"""Alpa's planning switches (``PlanOptions``) change the plan as they say (the all-gather and
all-to-all switches on the Ulysses-shaped plan: test_ulysses.py)."""
import pytest
import torch
import torch.nn as nn

from alpa_lite import LogicalMesh, plan
from alpa_lite.compiler.ilp import SolverError
from alpa_lite.compiler.ops import HEAVY_TARGETS
from alpa_lite.core.resharding import forward_steps
from alpa_lite.zoo.models import build_model


def _heavy_axes(p):
    """Per compute-heavy node, the mesh axes its chosen strategy splits its work along."""
    return {n.name: set(p.nodes[n.name].partial_axes).union(*(s.axes() for s in p.nodes[n.name].out_specs))
            for n in p.captured.graph.nodes if n.target in HEAVY_TARGETS}


def test_forbidding_replicated_heavy_ops_splits_every_matmul_on_both_axes():
    # a small MLP on the latency-bound CPU cluster: the free plan computes the matmuls replicated
    model, example = build_model("mlp", 8, device="meta", num_layers=2, hidden=64)
    mesh = LogicalMesh((2, 2), cluster="cpu-gloo")
    free = plan(model, example, mesh)
    alpa = plan(model, example, mesh, allow_replicated_heavy_ops=False)
    assert any(axes != {0, 1} for axes in _heavy_axes(free).values())
    assert list(_heavy_axes(alpa).values()) == [{0, 1}] * 2
    assert alpa.step_seconds >= free.step_seconds  # the constraint costs here, as the ILP is exact
    assert alpa.options["allow_replicated_heavy_ops"] is False


class TwoReaders(nn.Module):
    """A row-parallel linear (a partial sum along mesh axis 1) read whole by ``tanh`` and split
    along axis 1 by a product with a large forced-split input (gathering that input costs more)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64, bias=False)

    def forward(self, x, z):
        h = self.fc(x)
        return (h * z).sum() + torch.tanh(h).sum()


def _slices_of_all_reduced(p):
    """(producer, consumer) edges slicing a result along an axis its op all-reduced it on."""
    found = []
    for name, np_ in p.nodes.items():
        for i, (src, r) in enumerate(zip(np_.inputs, np_.input_results)):
            reduced = set(p.nodes[src].partial_axes) - set(p.nodes[src].out_specs[r].partial)
            shape = tuple(p.captured.node(src).meta["val"].shape)
            steps = forward_steps(p.nodes[src].out_specs[r], np_.in_specs[i], shape, 4, p.mesh.shape)
            found += [(src, name)] if any(s.kind == "slice" and s.axis in reduced for s in steps) else []
    return found


def test_preferring_reduce_scatter_replaces_all_reduce_and_slice():
    example = (torch.zeros(32, 64), torch.zeros(16, 32, 64))
    forced = dict(param_specs={"fc.weight": "RS1"}, input_specs={"0": "RS1", "1": "RS1R"})
    mesh = LogicalMesh((1, 4), cluster="cpu-gloo")
    free = plan(TwoReaders(), example, mesh, **forced)
    rs = plan(TwoReaders(), example, mesh, prefer_reduce_scatter=True, **forced)
    # free: the linear all-reduces once, the product slices its share (latency-bound CPU cluster)
    assert _slices_of_all_reduced(free) == [("linear", "mul")]
    assert not [c for c in free.collectives if c.kind == "reduce-scatter"]
    # preferred: the linear leaves the sum partial, the product's edge reduce-scatters it
    assert _slices_of_all_reduced(rs) == [] and str(rs.nodes["linear"].out_specs[0]) == "RRP1"
    assert [(c.node, c.mesh_axes) for c in rs.collectives if c.kind == "reduce-scatter"] == [("mul", (1,))]
    assert rs.step_seconds > free.step_seconds  # a preference, not the optimum here
    assert rs.options["prefer_reduce_scatter"] is True


def test_a_switch_that_leaves_no_plan_is_named():
    # ZeRO-1 all-gathers every updated parameter: forbidden all-gathers leave no plan
    model, example = build_model("mlp", 8, device="meta", num_layers=2, hidden=64)
    with pytest.raises(SolverError, match="no plan satisfies allow_all_gather=False"):
        plan(model, example, LogicalMesh((2, 2), cluster="cpu-gloo"), zero_stage=1, batch_axis=0,
             allow_all_gather=False)
