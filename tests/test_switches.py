"""Alpa's planning switches (``PlanOptions``) change the plan as they say."""
from alpa_lite import LogicalMesh, plan
from alpa_lite.compiler.ops import HEAVY_TARGETS
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
