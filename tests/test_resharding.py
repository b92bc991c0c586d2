"""Resharding steps, simulated on a 2x2 mesh of in-memory "devices": every forward conversion
between any two specs yields the right shards, every backward conversion of a partial gradient
yields the summed gradient's shards, the same for every conversion from or to a partial sum
(``S0RP1``), and the cost of each step follows the alpha-beta formulas."""
import itertools
import math

import pytest
import torch

from alpa_lite import LogicalMesh, ShardingSpec
from alpa_lite.core.resharding import ReshardCosts, backward_steps, forward_steps, grouped_steps, regathers
from alpa_lite.runtime.collectives import MeshGroups, local_slice

MESH = (2, 2)
DEVICES = list(itertools.product(range(2), range(2)))
SHAPE = (8, 12)
ENTRIES = [(), (0,), (1,), (0, 1)]
SPECS = [ShardingSpec((a, b)) for a, b in itertools.product(ENTRIES, ENTRIES) if not set(a) & set(b)]
PARTIAL = [s.with_partial(p) for s in SPECS for p in [(0,), (1,), (0, 1)] if not s.axes() & set(p)]


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
            elif s.kind == "mask":
                out[c] = local[c] if c[s.axis] == 0 else torch.zeros_like(local[c])
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


def shares(full, spec, seed=0):
    """Per device, its shard of ``full`` in ``spec``; along ``spec.partial``, random shares that
    sum to the shard."""
    g = torch.Generator().manual_seed(seed)
    weight = {c: torch.rand((), generator=g) + 0.1 for c in DEVICES}
    group = lambda c: [p for p in DEVICES if all(p[a] == c[a] for a in (0, 1) if a not in spec.partial)]  # noqa: E731
    return {c: local_slice(full, spec.with_partial(()), view(c)) * (weight[c] / sum(weight[p] for p in group(c)))
            for c in DEVICES}


def summed(local, spec):
    """Per device, the sum of ``local`` over its peers along ``spec.partial``."""
    return {c: sum(local[p] for p in DEVICES if all(p[a] == c[a] for a in (0, 1) if a not in spec.partial))
            for c in DEVICES}


@pytest.mark.parametrize("src,dst", [(s, d) for s in PARTIAL for d in SPECS + PARTIAL], ids=str)
def test_partial_sums_reshard_forward_and_backward(src, dst):
    """Forward: the shares of a partial ``src`` become ``dst``'s shards (summed over ``dst``'s own
    partial axes). Backward: the gradient, in ``dst`` without its partial axes and a partial sum
    along the axes the consumer's result varies over, returns as ``src``'s plain shards."""
    full = torch.arange(math.prod(SHAPE), dtype=torch.float32).reshape(SHAPE)
    got = summed(simulate(shares(full, src), forward_steps(src, dst, SHAPE, 4, MESH)), dst)
    for c in DEVICES:
        assert torch.allclose(got[c], local_slice(full, dst.with_partial(()), view(c))), c
    plain = dst.with_partial(())
    grad_partial = tuple(a for a in (0, 1) if a not in plain.axes() and a not in dst.partial)
    grad = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    local = shares(grad, plain.with_partial(grad_partial), seed=2)
    got = simulate(local, backward_steps(src, dst, grad_partial, SHAPE, 4, MESH))
    for c in DEVICES:
        assert torch.allclose(got[c], local_slice(grad, src.with_partial(()), view(c)), atol=1e-5), c


def test_partial_sum_edges_and_costs():
    """``RRP1 -> RS1R`` ... : a reduce-scatter where the target splits along the partial axis
    (Megatron-SP), all-reduce + slice where it splits along another, pass-through to a partial
    target; backward: all-gather, nothing, nothing."""
    mesh = LogicalMesh(MESH, mesh_alpha=(1e-5, 2e-5), mesh_beta=(1e-9, 2e-9))
    p1 = ShardingSpec.parse("RRP1")
    assert p1.partial == (1,) and ShardingSpec(((), ()), partial=(1,)) == p1 and str(p1.with_dim(0, (0,))) == "S0RP1"
    with pytest.raises(ValueError, match="partial"):
        ShardingSpec.parse("S1RP1")
    full = math.prod(SHAPE) * 4

    def kinds(dst, gp=()):
        dst = ShardingSpec.parse(dst)
        return ([(s.kind, s.axis) for s in forward_steps(p1, dst, SHAPE, 4, MESH)],
                [(s.kind, s.axis) for s in backward_steps(p1, dst, gp, SHAPE, 4, MESH)])

    assert kinds("S1R") == ([("reduce-scatter", 1)], [("all-gather", 1)])
    assert kinds("RR") == ([("all-reduce", 1)], [])
    assert kinds("S0R") == ([("all-reduce", 1), ("slice", 0)], [("all-gather", 0)])
    assert kinds("S0RP1") == ([("slice", 0)], [("all-gather", 0)])
    assert kinds("RRP01") == ([("mask", 0)], [])
    cost = ReshardCosts(mesh)
    assert cost(p1, ShardingSpec.parse("S1R"), (), SHAPE, 4) == pytest.approx(2 * (2e-5 + 0.5 * full * 2e-9))
    assert cost(p1, ShardingSpec.parse("RR"), (), SHAPE, 4) == pytest.approx(2e-5 + 2 * 0.5 * full * 2e-9)
    assert cost(p1, p1, (), SHAPE, 4) == 0.0


def test_zero_pattern_and_costs():
    mesh = LogicalMesh(MESH, mesh_alpha=(1e-5, 2e-5), mesh_beta=(1e-9, 2e-9))
    s0, rr = ShardingSpec.parse("S0R"), ShardingSpec.parse("RR")
    fwd = forward_steps(s0, rr, SHAPE, 4, MESH)
    bwd = backward_steps(s0, rr, (0,), SHAPE, 4, MESH)
    assert [s.kind for s in fwd] == ["all-gather"] and [s.kind for s in bwd] == ["reduce-scatter"]
    full = math.prod(SHAPE) * 4
    cost = ReshardCosts(mesh)(s0, rr, (0,), SHAPE, 4)
    assert cost == pytest.approx(2 * (1e-5 + 0.5 * full * 1e-9))
    # a parameter's (ZeRO-3) use is all-gathered again in backward: a third step of the same
    # bandwidth; a ZeRO-3 group takes it (one all-gather, one reduce-scatter over axis 0), so its
    # edge pays the bandwidth only, whatever the group size (the cost graph charges the group's
    # latencies, tests/test_ilp_overlap.py)
    assert regathers(s0, rr, (0,), SHAPE, 4, MESH) and not regathers(s0, rr, None, SHAPE, 4, MESH)
    assert grouped_steps(s0, rr, (0,), SHAPE, 4, MESH) == (fwd[0], bwd[0])
    for bucket in (25 * 2**20, full / 4):
        assert ReshardCosts(mesh, bucket_bytes=bucket)(s0, rr, (0,), SHAPE, 4, parameter=True) == pytest.approx(
            3 * 0.5 * full * 1e-9)
    # data-parallel gradient sync: nothing forward, an all-reduce backward (2 (n-1)/n B beta + alpha)
    assert ReshardCosts(mesh)(rr, rr, (1,), SHAPE, 4) == pytest.approx(2e-5 + 2 * 0.5 * full * 2e-9)
    # ... bucketed for parameters: the latency is paid per bucket of at most bucket_bytes, so a
    # tensor pays its bandwidth and its share full / bucket_bytes of the latency (at most one)
    assert ReshardCosts(mesh)(rr, rr, (1,), SHAPE, 4, parameter=True) == pytest.approx(
        2 * 0.5 * full * 2e-9 + 2e-5 * full / (25 * 2**20))
    assert ReshardCosts(mesh, bucket_bytes=full / 4)(rr, rr, (1,), SHAPE, 4, parameter=True) == pytest.approx(
        2 * 0.5 * full * 2e-9 + 2e-5)
    # S0R -> RS0 is one all-to-all of the local bytes
    a2a = forward_steps(s0, ShardingSpec.parse("RS0"), SHAPE, 4, MESH)
    assert [(s.kind, s.nbytes) for s in a2a] == [("all-to-all", full / 2)]
