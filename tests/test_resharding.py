"""Resharding steps, simulated on a 2x2 mesh of in-memory "devices": every forward conversion
between any two specs yields the right shards, every backward conversion of a partial gradient
yields the summed gradient's shards, and the cost of each step follows the alpha-beta formulas."""
import itertools
import math

import pytest
import torch

from alpa_lite import LogicalMesh, ShardingSpec
from alpa_lite.core.resharding import ReshardCosts, backward_steps, forward_steps
from alpa_lite.runtime.collectives import MeshGroups, local_slice

MESH = (2, 2)
DEVICES = list(itertools.product(range(2), range(2)))
SHAPE = (8, 12)
ENTRIES = [(), (0,), (1,), (0, 1)]
SPECS = [ShardingSpec((a, b)) for a, b in itertools.product(ENTRIES, ENTRIES) if not set(a) & set(b)]


def view(coord):
    return MeshGroups(MESH, coord, (None, None))


def peers(coord, axis):
    """Devices of ``coord``'s group along ``axis``, in group-rank order."""
    return [c for c in DEVICES if all(c[a] == coord[a] for a in (0, 1) if a != axis)]


def simulate(local: dict, steps) -> dict:
    for s in steps:
        out = {}
        for c in DEVICES:
            group = peers(c, s.axis)
            n = len(group)
            if s.kind == "slice":
                out[c] = local[c].chunk(n, s.dim)[c[s.axis]]
            elif s.kind == "all-gather":
                out[c] = torch.cat([local[p] for p in group], s.dim)
            elif s.kind == "all-reduce":
                out[c] = sum(local[p] for p in group)
            elif s.kind == "reduce-scatter":
                out[c] = sum(local[p] for p in group).chunk(n, s.dim)[c[s.axis]]
            elif s.kind == "all-to-all":
                out[c] = torch.cat([local[p].chunk(n, s.dim2)[c[s.axis]] for p in group], s.dim)
        local = out
    return local


@pytest.mark.parametrize("src,dst", list(itertools.product(SPECS, SPECS)), ids=str)
def test_forward_resharding_gives_the_target_shards(src, dst):
    full = torch.arange(math.prod(SHAPE), dtype=torch.float32).reshape(SHAPE)
    local = {c: local_slice(full, src, view(c)) for c in DEVICES}
    got = simulate(local, forward_steps(src, dst, SHAPE, 4, MESH))
    for c in DEVICES:
        assert torch.equal(got[c], local_slice(full, dst, view(c))), c


@pytest.mark.parametrize("src,dst", list(itertools.product(SPECS, SPECS)), ids=str)
def test_backward_reduces_partial_gradients(src, dst):
    partial = tuple(a for a in (0, 1) if a not in dst.axes())  # the consumer's result varies there
    torch.manual_seed(0)
    grad = torch.randn(SHAPE)
    # each device holds its share of the gradient: random weights summing to 1 over the partial axes
    weight = {c: torch.rand(()) + 0.1 for c in DEVICES}
    total = {c: sum(weight[p] for p in DEVICES if all(p[a] == c[a] for a in (0, 1) if a not in partial))
             for c in DEVICES}
    local = {c: local_slice(grad * (weight[c] / total[c]), dst, view(c)) for c in DEVICES}
    got = simulate(local, backward_steps(src, dst, partial, SHAPE, 4, MESH))
    for c in DEVICES:
        assert torch.allclose(got[c], local_slice(grad, src, view(c)), atol=1e-5), c


def test_zero_pattern_and_costs():
    mesh = LogicalMesh(MESH, mesh_alpha=(1e-5, 2e-5), mesh_beta=(1e-9, 2e-9))
    s0, rr = ShardingSpec.parse("S0R"), ShardingSpec.parse("RR")
    fwd = forward_steps(s0, rr, SHAPE, 4, MESH)
    bwd = backward_steps(s0, rr, (0,), SHAPE, 4, MESH)
    assert [s.kind for s in fwd] == ["all-gather"] and [s.kind for s in bwd] == ["reduce-scatter"]
    full = math.prod(SHAPE) * 4
    cost = ReshardCosts(mesh)(s0, rr, (0,), SHAPE, 4)
    assert cost == pytest.approx(2 * (1e-5 + 0.5 * full * 1e-9))
    # data-parallel gradient sync: nothing forward, an all-reduce backward (2 (n-1)/n B beta + alpha)
    assert ReshardCosts(mesh)(rr, rr, (1,), SHAPE, 4) == pytest.approx(2e-5 + 2 * 0.5 * full * 2e-9)
    # ... bucketed for parameters: the latency is paid per bucket, not per tensor
    assert ReshardCosts(mesh)(rr, rr, (1,), SHAPE, 4, parameter=True) == pytest.approx(2 * 0.5 * full * 2e-9)
    # S0R -> RS0 is one all-to-all of the local bytes
    a2a = forward_steps(s0, ShardingSpec.parse("RS0"), SHAPE, 4, MESH)
    assert [(s.kind, s.nbytes) for s in a2a] == [("all-to-all", full / 2)]
