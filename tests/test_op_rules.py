"""Op rules checked against dense math: every strategy of an op, simulated on a 2x2 mesh of
in-memory devices (each device runs the op on its shards, with the executor's local arguments;
a partial result is summed over its group), gives the shards of the dense result.

The rules whose local variants communicate (vocab-parallel cross-entropy, synchronized batch
norm) are checked here for their strategies and prices; their numerics run on 4 gloo ranks in
``test_op_rules_ranks.py``.
"""
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from alpa_lite import LogicalMesh
from alpa_lite.compiler.ops import signature
from alpa_lite.compiler.strategies import build_strategies
from alpa_lite.core.aten import written_args
from alpa_lite.core.capture import capture
from alpa_lite.core.spec import ShardingSpec
from alpa_lite.runtime.collectives import MeshGroups, local_slice
from alpa_lite.runtime.executor import _SHAPE_ARG, Dispatch, local_arguments

aten = torch.ops.aten
MESH = LogicalMesh((2, 2), mesh_alpha=(1e-5, 1e-5), mesh_beta=(1e-9, 2e-9), peak_flops=1e12,
                   mem_bandwidth=1e15, memory_bytes=1e12)
DEVICES = list(itertools.product(range(2), range(2)))


def _captured(fn, inputs):
    class Wrap(torch.nn.Module):
        def forward(self, *xs):
            return fn(*xs).float().sum()
    return capture(Wrap(), inputs)


def _values(cg, inputs, stop):
    """Every value of the graph up to node ``stop``, computed densely."""
    values = dict(zip(cg.input_names, inputs))
    for node in cg.graph.nodes:
        if node.op == "call_function":  # an in-place op writes a copy: its operand keeps its value
            read = (lambda n: values[n.name].clone()) if written_args(node.target) else (lambda n: values[n.name])
            values[node.name] = node.target(*torch.fx.node.map_arg(node.args, read),
                                            **torch.fx.node.map_arg(node.kwargs, read))
        if node is stop:
            return values


def simulate(fn, inputs, target):
    """Per strategy of the ``target`` node: (strategy, dense result, per device its local result
    after the partial sum, per device the dense result's shard). Returns the strategies' list."""
    cg = _captured(fn, inputs)
    node = next(n for n in cg.graph.nodes if n.target == target)
    values = _values(cg, inputs, node)
    full = values[node.name]
    table = build_strategies(cg, MESH)
    out = []
    for s in table[node.name].strategies:
        local = {}
        for c in DEVICES:
            view = MeshGroups(MESH.shape, c, (None, None))
            operands = {n.name: local_slice(values[n.name], spec, view).clone()  # an in-place op writes it
                        for n, spec in zip(node.all_input_nodes, s.in_specs)}
            summed = set(s.partial_axes) | set(s.out_spec.partial)
            for i in signature(node).post_reduce if any(c[a] for a in summed) else ():
                bias = node.all_input_nodes[i].name  # added once, after the reduction (executor._partial)
                operands[bias] = torch.zeros_like(operands[bias])
            target, args, kwargs = node.target, node.args, node.kwargs
            if target in _SHAPE_ARG:  # shape arguments: the local shape, as the executor writes them
                d = Dispatch(node, s, [], list(s.out_spec.local_shape(tuple(full.shape), MESH.shape)), "cpu", None, False)
                target, args, kwargs = d.target, d.args, d.kwargs
            args = torch.fx.node.map_arg(args, lambda n: operands[n.name])
            kwargs = torch.fx.node.map_arg(kwargs, lambda n: operands[n.name])
            args, kwargs = local_arguments(target, args, kwargs, s.in_specs, MESH.shape)
            local[c] = target(*args, **kwargs)
        summed = set(s.partial_axes) | set(s.out_spec.partial)  # reduced in the op, or left partial
        if summed:
            scale = 1 / math.prod(MESH.shape[a] for a in summed) if s.reduce == "mean" else 1
            local = {c: scale * sum(local[p] for p in DEVICES if all(p[a] == c[a] for a in (0, 1) if a not in summed))
                     for c in DEVICES}
        want = {c: [local_slice(f, ShardingSpec(spec.dims), MeshGroups(MESH.shape, c, (None, None)))
                    for f, spec in zip(_results(full), s.out_specs)] for c in DEVICES}
        out.append((s, {c: _results(v) for c, v in local.items()}, want))
    return out


def _results(value) -> list[torch.Tensor]:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def check(fn, inputs, target, expect_split=(), values=True):
    """Every strategy equals dense math in every result (only in shape where ``values`` is False:
    ``empty_like``); ``expect_split``: specs (of the first result) some strategy must have (the
    rule's point)."""
    results = simulate(fn, inputs, target)
    for s, got, want in results:
        for c in DEVICES:
            assert len(got[c]) == len(want[c]), (s.name, c)
            for g, w in zip(got[c], want[c]):
                assert g.shape == w.shape, (s.name, c)
                assert not values or torch.allclose(g.float(), w.float(), atol=1e-5), (s.name, c)
    specs = {str(s.out_spec) for s, _, _ in results}
    assert set(expect_split) <= specs, specs
    return results


def test_one_hot_splits_its_input_not_the_classes():
    ids = torch.arange(32).reshape(4, 8) % 7
    results = check(lambda x: F.one_hot(x, 7), (ids,), aten.one_hot.default, {"S0S1R", "S01RR", "RS01R"})
    assert all(not s.out_spec.dims[2] for s, _, _ in results)


def test_cumsum_keeps_its_dim_whole():
    results = check(lambda x: x.cumsum(1), (torch.randn(4, 8, 6),), aten.cumsum.default, {"S0RS1", "S01RR"})
    assert all(not s.out_spec.dims[1] for s, _, _ in results)


@pytest.mark.parametrize("make,target", [
    (torch.ones_like, aten.ones_like.default), (torch.zeros_like, aten.zeros_like.default),
    (lambda x: torch.full_like(x, 3.0), aten.full_like.default),
    (lambda x: torch.empty_like(x).fill_(1.0), aten.empty_like.default)], ids=["ones", "zeros", "full", "empty"])
def test_like_ops_follow_a_split_input(make, target):
    check(lambda x: make(x * 2), (torch.randn(4, 8),), target, {"S0S1", "S01R", "RS01"},
          values=target is not aten.empty_like.default)


def test_index_gathers_along_a_whole_dim_of_a_split_tensor():
    idx = torch.tensor([[5, 0], [2, 2], [7, 1], [3, 6]])
    results = check(lambda x, i: x[:, i], (torch.randn(4, 8, 6), idx), aten.index.Tensor,
                    {"S0RRS1", "RS0RS1", "RRS1S0", "S01RRR"})
    assert all(s.in_specs[0].dims[1] == () for s, _, _ in results)  # the gathered dim stays whole


@pytest.mark.parametrize("pad,target", [
    (lambda x: F.pad(x, (1, 2)), aten.pad.default),
    (lambda x: F.pad(x, (0, 0, 2, 1), value=0.5), aten.pad.default),
    (lambda x: aten.constant_pad_nd(x, [1, 1]), aten.constant_pad_nd.default)], ids=["last", "middle", "nd"])
def test_pad_splits_the_dims_it_does_not_pad(pad, target):
    results = check(pad, (torch.randn(4, 6, 8),), target, {"S0S1R" if pad(torch.zeros(1, 1, 1)).shape[2] > 1
                                                            else "S0RS1"})
    for s, _, _ in results:
        padded = [d for d in range(3) if pad(torch.zeros(4, 6, 8)).shape[d] != (4, 6, 8)[d]]
        assert all(s.out_spec.dims[d] == () for d in padded)


@pytest.mark.parametrize("shapes,expect", [
    (((8,), (8, 12)), {"S0", "S1", "S01"}),       # vector @ matrix: n split, or k (partial sums)
    (((12, 8), (8,)), {"S0", "S01"}),             # matrix @ vector
    (((4, 12, 8), (8,)), {"S0S1", "RS01"}),       # batched matrix @ vector
    (((8,), (8,)), {""}),                         # dot product: k split, partial sums
], ids=["vm", "mv", "bmv", "dot"])
def test_vector_matmul(shapes, expect):
    results = check(lambda a, b: torch.matmul(a, b), tuple(torch.randn(s) for s in shapes), aten.matmul.default,
                    expect)
    assert any(s.partial_axes for s, _, _ in results)  # the contraction splits too


@pytest.mark.parametrize("channels,groups", [(8, 2), (8, 8)], ids=["grouped", "depthwise"])
def test_grouped_convolution_splits_by_groups(channels, groups):
    x, w, b = torch.randn(2, channels, 6, 6), torch.randn(8, channels // groups, 3, 3), torch.randn(8)
    results = check(lambda x, w, b: F.conv2d(x, w, b, groups=groups, padding=1), (x, w, b), aten.conv2d.default,
                    {"RS0RR", "S0S1RR", "RS01RR"} if groups == 8 else {"RS0RR", "S0S1RR"})
    split = {s.out_spec.shards(1, MESH.shape) for s, _, _ in results}
    assert max(split) == min(4, groups)  # 2 groups split over 2 devices at most


def test_vocab_parallel_cross_entropy_strategies_and_price():
    cg = _captured(lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1), (torch.randn(8, 16), torch.arange(8)))
    node = next(n for n in cg.graph.nodes if n.target == aten.cross_entropy_loss.default)
    by_in = {tuple(map(str, s.in_specs)): s for s in build_strategies(cg, MESH)[node.name].strategies}
    vocab = by_in[("S0S1", "S0")]  # samples on axis 0, classes on axis 1
    assert vocab.partial_axes == (0,)  # the loss sums over the samples only: the classes are done
    # per sample (4 local): max, sum-exp, target logit and the smoothing sum, all-reduced on axis 1;
    # then the (loss, count) of the mean on axis 0
    stats = 4 * MESH.all_reduce_cost(4 * 4, (1,))
    assert vocab.comm == pytest.approx(MESH.all_reduce_cost(4, (0,)) + stats)
    assert ("RS01", "R") in by_in  # classes over the whole mesh
    weighted = _captured(lambda x, t, w: F.cross_entropy(x, t, weight=w), (torch.randn(8, 16), torch.arange(8),
                                                                           torch.rand(16)))
    node = next(n for n in weighted.graph.nodes if n.target == aten.cross_entropy_loss.default)
    assert signature(node).fixed == {"c"}  # class weights: the classes stay whole


def test_synchronized_batch_norm_splits_the_batch():
    bn = torch.nn.BatchNorm2d(4)
    cg = capture(bn, (torch.randn(8, 4, 3, 3),), lambda y: y.sum())
    node = next(n for n in cg.graph.nodes if n.target == aten._native_batch_norm_legit_functional.default)
    strategies = build_strategies(cg, MESH)[node.name].strategies
    split = [s for s in strategies if s.in_specs[0] == "S0S1RR"]
    assert len(split) == 1 and split[0].partial_axes == ()
    # mean and variance forward, two gradient sums backward: 4 all-reduces of 2 channels (axis 0)
    assert split[0].comm == pytest.approx(4 * MESH.all_reduce_cost(2 * 4, (0,)))
    assert split[0].grad_partial[1] == (0,)  # the weight's gradient sums over the batch shards


X = torch.randn(4, 8, 6)
WHOLE = [  # op, its node, specs some strategy must give, the input dims no strategy splits
    (lambda x: torch.logsumexp(x, -1), aten.logsumexp.default, {"S0S1", "S01R"}, [2]),
    (lambda x: torch.special.logsumexp(x, 1, keepdim=True), aten.special_logsumexp.default, {"S0RS1"}, [1]),
    (lambda x: x.amin(1), aten.amin.default, {"S0S1"}, [1]),
    (lambda x: x.argmin(-1), aten.argmin.default, {"S0S1"}, [2]),
    (lambda x: x.min(dim=1).values, aten.min.dim, {"S0S1"}, [1]),
    (lambda x: x.prod(1), aten.prod.dim_int, {"S0S1"}, [1]),
    (lambda x: torch.linalg.vector_norm(x, dim=-1), aten.linalg_vector_norm.default, {"S0S1"}, [2]),
    (lambda x: torch.linalg.vector_norm(x), aten.linalg_vector_norm.default, {""}, [0, 1, 2]),
    (lambda x: x.cumprod(1), aten.cumprod.default, {"S0RS1"}, [1]),
    (lambda x: x.logcumsumexp(1), aten.logcumsumexp.default, {"S0RS1"}, [1]),
    (lambda x: x.flip(1), aten.flip.default, {"S0RS1"}, [1]),
    (lambda x: x.roll(2, 1), aten.roll.default, {"S0RS1"}, [1]),
    (lambda x: x.roll(3), aten.roll.default, {"RRR"}, [0, 1, 2]),  # the flattened tensor
    (lambda x: x.sort(1).values, aten.sort.default, {"S0RS1"}, [1]),
    (lambda x: x.sort(dim=-1, stable=True).indices, aten.sort.stable, {"S0S1R"}, [2]),
    (lambda x: x.topk(3, 1).indices, aten.topk.default, {"S0RS1"}, [1]),
    (lambda x: x.argsort(1), aten.argsort.default, {"S0RS1"}, [1]),
    (lambda x: x.argsort(dim=-1, stable=True, descending=True), aten.argsort.stable, {"S0S1R"}, [2]),
    (lambda x: x.repeat_interleave(2, dim=1), aten.repeat_interleave.self_int, {"S0S1R", "S1S0R", "RS01R"}, []),
    (lambda x: (x > 0).any(1), aten.any.dim, {"S0S1"}, [1]),
    (lambda x: (x > 0).all(-1), aten.all.dim, {"S0S1"}, [2]),
]


@pytest.mark.parametrize("fn,target,expect,whole", WHOLE, ids=[
    "logsumexp", "special_logsumexp", "amin", "argmin", "min_dim", "prod", "vector_norm_dim", "vector_norm_all",
    "cumprod", "logcumsumexp", "flip", "roll", "roll_flat", "sort", "sort_stable", "topk", "argsort", "argsort_stable",
    "repeat_interleave", "any", "all"])
def test_reductions_scans_and_sorts_keep_their_dims_whole(fn, target, expect, whole):
    results = check(fn, (X,), target, expect)
    assert all(s.in_specs[0].dims[d] == () for s, _, _ in results for d in whole)


@pytest.mark.parametrize("groups", [4, 2])
def test_group_norm_splits_the_batch_and_whole_groups(groups):
    w, b = torch.randn(8), torch.randn(8)
    results = check(lambda x, w, b: F.group_norm(x, groups, w, b), (X, w, b), aten.group_norm.default,
                    {"S0S1R", "RS01R"} if groups == 4 else {"S0S1R"})
    assert max(s.in_specs[0].shards(1, MESH.shape) for s, _, _ in results) == groups
    assert all(s.in_specs[0].dims[2] == () for s, _, _ in results)


def test_instance_norm_splits_batch_and_channels_without_running_statistics():
    w, b = torch.randn(8), torch.randn(8)
    results = check(lambda x, w, b: F.instance_norm(x, weight=w, bias=b), (X, w, b), aten.instance_norm.default,
                    {"S0S1R", "S01RR", "RS01R"})
    assert all(s.in_specs[0].dims[2] == () for s, _, _ in results)
    running = capture(torch.nn.InstanceNorm1d(8, track_running_stats=True), (X,), lambda y: y.sum())
    node = next(n for n in running.graph.nodes if n.target == aten.instance_norm.default)
    # the batch's mean updates the running statistics inside the op: every dim whole, replicated
    assert set(signature(node).labels) == signature(node).fixed
    assert [str(s.out_spec) for s in build_strategies(running, MESH)[node.name].strategies] == ["RRR"]


@pytest.mark.parametrize("other", [(4, 8, 6), (8, 6)], ids=["same", "broadcast"])
def test_cosine_similarity_keeps_its_dim_whole(other):
    results = check(lambda a, b: F.cosine_similarity(a, b, dim=-1), (X, torch.randn(other)),
                    aten.cosine_similarity.default, {"S0S1", "S01R", "RS01"})
    assert all(s.in_specs[0].dims[2] == () for s, _, _ in results)


def test_cdist_splits_batch_and_rows_of_each_side():
    results = check(lambda a, b: torch.cdist(a, b), (X, torch.randn(4, 4, 6)), aten.cdist.default,
                    {"S0S1R", "S0RS1", "RS0S1"})
    assert all(s.in_specs[0].dims[2] == () == s.in_specs[1].dims[2] for s, _, _ in results)
    same = _captured(lambda a: torch.cdist(a, a), (X,))
    assert signature(next(n for n in same.graph.nodes if n.target == aten.cdist.default)) is None


@pytest.mark.parametrize("op,target", [(lambda a, b: a & b, aten.__and__.Tensor),
                                       (lambda a, b: a | b, aten.__or__.Tensor)], ids=["and", "or"])
def test_bool_mask_and_or_are_pointwise(op, target):
    """``keep[:, None, :] & keep[:, :, None]`` (a padding mask's pairs): ``&`` / ``|`` of bool tensors
    carry no pointwise tag, so they ran replicated with a warning (and microbatches were reported
    to change the loss: "and_1 has no sharding rule")."""
    check(lambda a, b: op(a > 0, b > 0), (X, torch.randn(4, 1, 6)), target, {"S0S1R", "S01RR"})


def test_expand_as_follows_the_split_of_its_target():
    check(lambda a, b: a.expand_as(b) * b, (torch.randn(4, 1, 6), torch.randn(4, 8, 6)), aten.expand_as.default,
          {"S0S1R", "RS01R"})


CONVS = [  # op, (input, weight, bias) shapes, groups, the node, specs some strategy must give
    (lambda x, w, b: F.conv1d(x, w, b, padding="same", groups=2, dilation=2), ((4, 8, 10), (8, 4, 3), (8,)), 2,
     aten.conv1d.padding, {"S0S1R", "RS0R", "S01RR"}),
    (lambda x, w, b: F.conv2d(x, w, b, padding="same"), ((4, 8, 6, 6), (4, 8, 3, 3), (4,)), 1,
     aten.conv2d.padding, {"S0S1RR", "RS01RR", "S01RRR"}),
    (lambda x, w, b: F.conv3d(x, w, b, stride=2, padding=1, dilation=(1, 2, 1)),
     ((4, 8, 5, 6, 5), (4, 8, 3, 3, 3), (4,)), 1, aten.conv3d.default, {"S0S1RRR", "RS01RRR"}),
    (lambda x, w, b: F.conv3d(x, w, b, padding="same", groups=4), ((4, 8, 4, 4, 4), (8, 2, 3, 3, 3), (8,)), 4,
     aten.conv3d.padding, {"RS01RRR", "S0S1RRR"}),
    (lambda x, w, b: F.conv_transpose1d(x, w, b, stride=2, padding=1, output_padding=1, groups=2, dilation=2),
     ((4, 8, 7), (8, 3, 3), (6,)), 2, aten.conv_transpose1d.default, {"S0S1R", "S01RR"}),
    (lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, padding=1, output_padding=1),
     ((4, 8, 5, 5), (8, 4, 3, 3), (4,)), 1, aten.conv_transpose2d.input, {"S0S1RR", "RS01RR", "S01RRR"}),
    (lambda x, w, b: F.conv_transpose2d(x, w, b, stride=(2, 1), groups=8), ((4, 8, 5, 5), (8, 1, 2, 3), (8,)), 8,
     aten.conv_transpose2d.input, {"RS01RR", "S0S1RR"}),
    (lambda x, w, b: F.conv_transpose3d(x, w, b, stride=2, dilation=(2, 1, 1)),
     ((4, 4, 3, 3, 3), (4, 4, 2, 2, 2), (4,)), 1, aten.conv_transpose3d.input, {"S0S1RRR", "RS01RRR"}),
    # unbatched (C, *spatial) inputs: the channels are dim 0 (H was split as the channels)
    (lambda x, w, b: F.conv2d(x, w, b, padding=1), ((8, 6, 6), (4, 8, 3, 3), (4,)), 1, aten.conv2d.default,
     {"S01RR"}),
    (lambda x, w, b: F.conv1d(x, w, b, groups=2), ((8, 10), (8, 4, 3), (8,)), 2, aten.conv1d.default,
     {"S0R", "S1R"}),
    (lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2), ((8, 5, 5), (8, 4, 3, 3), (4,)), 1,
     aten.conv_transpose2d.input, {"S01RR"}),
]


@pytest.mark.parametrize("fn,shapes,groups,target,expect", CONVS, ids=[
    "conv1d_same_grouped_dilated", "conv2d_same", "conv3d_strided", "conv3d_same_grouped", "conv_transpose1d_grouped",
    "conv_transpose2d_output_padding", "conv_transpose2d_depthwise", "conv_transpose3d", "conv2d_unbatched",
    "conv1d_grouped_unbatched", "conv_transpose2d_unbatched"])
def test_every_convolution_splits_batch_and_channels(fn, shapes, groups, target, expect):
    """conv1d/2d/3d with a string padding ("same"), conv3d, conv_transpose1d/2d/3d: batch and
    channels split (a transposed weight is (in, out / groups, kernel); groups split whole), the
    input channels of an ungrouped one as a contraction (partial sums, the bias added once), the
    spatial dims never (they ran replicated with a warning)."""
    results = check(fn, tuple(torch.randn(s) for s in shapes), target, expect)
    channels = len(shapes[0]) - len(shapes[1]) + 1  # dim 1, or 0 of an unbatched input
    spatial = range(channels + 1, len(shapes[0]))
    assert all(s.in_specs[0].dims[d] == () == s.out_spec.dims[d] for s, _, _ in results for d in spatial)
    contracted = [s for s, _, _ in results if s.partial_axes]
    assert bool(contracted) == (groups == 1)  # a sum over the input channels, unless grouped
    assert all(set(s.partial_axes) == set(s.in_specs[0].dims[channels]) for s in contracted)
    assert max(s.in_specs[0].shards(channels, MESH.shape) for s, _, _ in results) == min(
        4, shapes[0][channels] if groups == 1 else groups)


UPSAMPLES = [  # op, input shape, node
    (lambda x: F.interpolate(x, scale_factor=2), (4, 8, 5), aten.upsample_nearest1d.vec),
    (lambda x: F.interpolate(x, scale_factor=(2, 3)), (4, 8, 5, 3), aten.upsample_nearest2d.vec),
    (lambda x: F.interpolate(x, size=(7, 4, 6)), (4, 8, 3, 2, 4), aten.upsample_nearest3d.vec),
    (lambda x: F.interpolate(x, scale_factor=3, mode="nearest-exact"), (4, 8, 3), aten._upsample_nearest_exact1d.vec),
    (lambda x: F.interpolate(x, scale_factor=1.5, mode="nearest-exact"), (4, 8, 4, 6),
     aten._upsample_nearest_exact2d.vec),
    (lambda x: F.interpolate(x, size=(3, 5, 2), mode="nearest-exact"), (4, 8, 2, 2, 3),
     aten._upsample_nearest_exact3d.vec),
    (lambda x: F.interpolate(x, scale_factor=2, mode="linear"), (4, 8, 5), aten.upsample_linear1d.vec),
    (lambda x: F.interpolate(x, size=(5, 7), mode="bilinear", align_corners=True), (4, 8, 3, 4),
     aten.upsample_bilinear2d.vec),
    (lambda x: F.interpolate(x, scale_factor=0.5, mode="bilinear", antialias=True), (4, 8, 6, 6),
     aten._upsample_bilinear2d_aa.vec),
    (lambda x: F.interpolate(x, scale_factor=2, mode="trilinear"), (4, 8, 2, 3, 2), aten.upsample_trilinear3d.vec),
    (lambda x: F.interpolate(x, scale_factor=2, mode="bicubic"), (4, 8, 3, 3), aten.upsample_bicubic2d.vec),
    (lambda x: F.interpolate(x, size=(3, 2), mode="bicubic", antialias=True), (4, 8, 7, 5),
     aten._upsample_bicubic2d_aa.vec),
]


@pytest.mark.parametrize("fn,shape,target", UPSAMPLES, ids=[
    "nearest1d", "nearest2d", "nearest3d_size", "nearest_exact1d", "nearest_exact2d", "nearest_exact3d", "linear1d",
    "bilinear2d_align_corners", "bilinear2d_antialias", "trilinear3d", "bicubic2d", "bicubic2d_antialias"])
def test_upsample_splits_batch_and_channels(fn, shape, target):
    """nn.Upsample / interpolate: each sample's channel is interpolated on its own, so batch and
    channels split; the spatial dims stay whole (they ran replicated with a warning)."""
    spatial = "R" * (len(shape) - 2)
    results = check(lambda x: fn(x * 2), (torch.randn(shape),), target,
                    {"S0S1" + spatial, "RS01" + spatial, "S01R" + spatial})
    assert all(s.in_specs[0].dims[d] == () for s, _, _ in results for d in range(2, len(shape)))


GATHERS = [  # op, inputs, node, specs some strategy must give, the input dims of self no strategy splits
    (lambda x, i: x.gather(-1, i), (X, torch.randint(0, 6, (4, 8, 1))), aten.gather.default,
     {"S0S1R", "S01RR", "RS01R"}, [2]),
    (lambda x, i: x.gather(1, i), (X, torch.randint(0, 8, (4, 2, 6))), aten.gather.default,
     {"S0S1R", "S0RS1", "RS0S1"}, [1]),  # the index splits along the gathered dim too
    (lambda x, i: x.gather(2, i), (X, torch.randint(0, 6, (2, 8, 3))), aten.gather.default,
     {"RS01R"}, [0, 2]),  # fewer rows in the index: a prefix of self's, neither splits
    (lambda x, i: x.gather(0, i), (X, torch.randint(0, 4, (4, 8, 6))), aten.gather.default,
     {"S0S1R", "RS0S1"}, [0]),
    (lambda x, i: x.index_select(1, i), (X, torch.tensor([7, 0, 3, 3])), aten.index_select.default,
     {"S0S1R", "RS01R", "S0RS1"}, [1]),
    (lambda x, i: x.index_select(0, i), (torch.randn(10, 8), torch.tensor(4)), aten.index_select.default,
     {"RS01"}, [0]),  # a 0-dim index: the selected dim keeps size 1
]


@pytest.mark.parametrize("fn,inputs,target,expect,whole", GATHERS, ids=[
    "gather_last", "gather_middle", "gather_smaller_index", "gather_batch", "index_select", "index_select_0d"])
def test_gather_and_index_select_keep_the_gathered_dim_whole(fn, inputs, target, expect, whole):
    """``h.gather(-1, idx[..., None])`` and ``table.index_select(0, rows)`` ran replicated with a
    warning; the gather's result lost the batch dim, so a 2-stage pipeline reported the masks
    pattern's ``(picked ** 2).mean()`` as "pow_1 ... is not a sum, mean or ratio of batch reductions"."""
    results = check(lambda x, i: fn(x * 2, i), inputs, target, expect)
    assert all(s.in_specs[0].dims[d] == () for s, _, _ in results for d in whole)


POOLS = [  # op, input shape, node: batched and unbatched inputs, 1-3 spatial dims
    (lambda x: F.max_pool2d(x, 2), (4, 8, 6, 4), aten.max_pool2d.default),
    (lambda x: F.max_pool2d(x, 2), (8, 6, 4), aten.max_pool2d.default),  # unbatched (C, H, W)
    (lambda x: F.avg_pool2d(x, 3, stride=2, ceil_mode=True), (8, 5, 7), aten.avg_pool2d.default),
    (lambda x: F.adaptive_avg_pool2d(x, (2, 3)), (8, 6, 7), aten.adaptive_avg_pool2d.default),
    (lambda x: F.max_pool1d(x, 2), (4, 8, 6), aten.max_pool1d.default),
    (lambda x: F.avg_pool1d(x, 2), (4, 8, 6), aten.avg_pool1d.default),
    (lambda x: F.adaptive_avg_pool1d(x, 3), (4, 8, 6), aten.adaptive_avg_pool1d.default),
    (lambda x: F.max_pool3d(x, 2), (4, 8, 2, 4, 2), aten.max_pool3d.default),
    (lambda x: F.avg_pool3d(x, 2), (4, 8, 2, 4, 2), aten.avg_pool3d.default),
    (lambda x: F.adaptive_avg_pool3d(x, 1), (4, 8, 2, 4, 2), aten.adaptive_avg_pool3d.default),
    (lambda x: F.adaptive_max_pool2d(x, 2), (4, 8, 4, 4), aten.adaptive_max_pool2d.default),
]


@pytest.mark.parametrize("fn,shape,target", POOLS, ids=[
    "max2d", "max2d_unbatched", "avg2d_unbatched_ceil", "adaptive2d_unbatched", "max1d", "avg1d", "adaptive1d",
    "max3d", "avg3d", "adaptive3d", "adaptive_max2d"])
def test_pooling_keeps_its_window_dims_whole(fn, shape, target):
    """A pooling op splits the dims before its window (batch and channels, or channels alone of an
    unbatched input) and keeps the window's dims whole: an unbatched ``(C, H, W)`` input to
    ``max_pool2d`` had ``H`` taken for the channels and split, pooling each half apart."""
    nd = int(target._schema.name[-2])  # max_pool2d -> 2
    lead = "S0S1" if len(shape) - nd == 2 else "S01"
    results = check(lambda x: fn(x * 2), (torch.randn(shape),), target, {lead + "R" * nd})
    assert all(s.in_specs[0].dims[d] == () for s, _, _ in results for d in range(len(shape) - nd, len(shape)))


@pytest.mark.parametrize("fn,inputs,target,expect", [
    (lambda x, s: torch.slice_scatter(x, s, 1, 2, 6), (torch.randn(4, 8, 6), torch.randn(4, 4, 6)),
     aten.slice_scatter.default, {"S0RS1", "S01RR", "S1RS0"}),
    (lambda x, s: torch.select_scatter(x, s, 1, 3), (torch.randn(4, 8, 6), torch.randn(4, 6)),
     aten.select_scatter.default, {"S0RS1", "S01RR", "S1RS0"})], ids=["slice_scatter", "select_scatter"])
def test_scatters_keep_the_scattered_dim_whole(fn, inputs, target, expect):
    """T5's shifted decoder inputs (``slice_scatter`` / ``select_scatter`` of the first position):
    the other dims split with ``src``'s, the scattered one stays whole."""
    results = check(fn, inputs, target, expect)
    assert all(not s.out_spec.dims[1] for s, _, _ in results)


def test_fill_with_a_tensor_value_follows_its_input():
    """``aten.fill.Tensor`` (T5's decoder start token written into the shifted inputs on a CPU
    capture) ran replicated and lost the batch dim: a false microbatch warning."""
    check(lambda x, v: torch.ops.aten.fill.Tensor(x * 2, v), (torch.randn(4, 8), torch.tensor(3.0)),
          aten.fill.Tensor, {"S0S1", "S01R", "RS01"})


@pytest.mark.parametrize("fn,shape,expect", [
    (lambda x: x.unflatten(1, (2, 4)), (4, 8, 6), {"S0S1RR", "S01RRR", "S0RRS1"}),
    (lambda x: x.unflatten(-1, (3, 2)), (4, 8, 6), {"S0S1RR", "S01RRR"}),
    (lambda x: x.unflatten(0, (2, 2)), (4, 8, 6), {"S0RS1R", "RRS01R"})], ids=["middle", "last", "batch"])
def test_unflatten_follows_the_reshape_rule(fn, shape, expect):
    """``unflatten`` (``nn.MultiheadAttention(batch_first=True)``'s packed q/k/v projection) is a
    reshape: its split dim keeps its split on the major dim it unflattens into, and runs as a
    reshape to the local shape (its ``sizes`` are the whole dim's). It ran replicated, and a
    pipeline reported that microbatches change the loss ("unflatten has no sharding rule")."""
    check(lambda x: fn(x * 2), (torch.randn(shape),), aten.unflatten.int, expect)


INPLACE = [  # in-place ops torch tags ``inplace`` but not ``pointwise``: their functional op's rule
    (lambda x, m: (x * 2).masked_fill_(m > 0, -1.0), aten.masked_fill_.Scalar, {"S0S1R", "S01RR", "RS01R"}),
    (lambda x, m: (x * 2).masked_fill_(m > 0, m[0, 0, 0]), aten.masked_fill_.Tensor, {"S0S1R", "S01RR"}),
    (lambda x, m: (x * 2).masked_fill(m > 0, m[0, 0, 0]), aten.masked_fill.Tensor, {"S0S1R", "S01RR"}),
    (lambda x, m: aten.gelu_(x * m), aten.gelu_.default, {"S0S1R", "S01RR"}),
    (lambda x, m: F.threshold(x * m, 0.1, 0.0, inplace=True), aten.threshold_.default, {"S0S1R", "S01RR"}),
    (lambda x, m: (x * m).tril_(), aten.tril_.default, {"S0RR", "S01RR"}),
    (lambda x, m: (x * m).cumsum_(1), aten.cumsum_.default, {"S0RS1", "S01RR"}),
    (lambda x, m: (x * m).fill_(2.0), aten.fill_.Scalar, {"S0S1R", "RS01R"}),
]


@pytest.mark.parametrize("fn,target,expect", INPLACE, ids=[
    "masked_fill_", "masked_fill_tensor_", "masked_fill_tensor", "gelu_", "threshold_", "tril_", "cumsum_", "fill_"])
def test_inplace_ops_take_their_functional_rule(fn, target, expect):
    """``zeros_like(mask).masked_fill_(mask, -inf)`` (``nn.MultiheadAttention``'s ``key_padding_mask``)
    and other in-place variants carry torch's ``inplace`` tag but not ``pointwise``: they ran
    replicated with a warning and lost the batch dim (a false "microbatches change the loss")."""
    results = check(fn, (torch.randn(4, 8, 6), torch.randn(4, 1, 6)), target, expect)
    if target in (aten.tril_.default, aten.cumsum_.default):
        whole = (1, 2) if target is aten.tril_.default else (1,)
        assert all(s.out_spec.dims[d] == () for s, _, _ in results for d in whole)


def test_inplace_views_and_addmm_keep_no_rule():
    """An in-place view (``t_``) or ``addmm_`` (its ``self`` is the bias added after the reduction)
    does not take its functional op's rule."""
    from alpa_lite.compiler.ops import _rule
    assert _rule(aten.t_.default) is None and _rule(aten.squeeze_.dim) is None and _rule(aten.addmm_.default) is None


@pytest.mark.parametrize("fn,shapes,target,expect", [
    (lambda a, b: torch.mv(a, b), ((8, 12), (12,)), aten.mv.default, {"S0", "S01", "R"}),
    (lambda a, b: torch.vdot(a, b), ((12,), (12,)), aten.vdot.default, {""}),
    (lambda a, b: torch.dot(a, b), ((12,), (12,)), aten.dot.default, {""})], ids=["mv", "vdot", "dot"])
def test_matrix_vector_and_dot_products(fn, shapes, target, expect):
    """``spectral_norm``'s power iteration (``mv``) and ``sigma`` (``vdot``): the contraction splits as
    a partial sum, ``mv``'s rows split."""
    results = check(lambda a, b: fn(a * 2, b * 2), tuple(torch.randn(s) for s in shapes), target, expect)
    assert any(s.partial_axes for s, _, _ in results)


@pytest.mark.parametrize("v,g,dim,split", [((8, 6), (8, 1), 0, {"S0R", "S01R"}), ((4, 8, 6), (1, 8, 1), 1,
                                                                                      {"RS01R", "RS0R"}),
                                           ((8, 6), (), -1, {"RR"})], ids=["dim0", "dim1", "whole"])
def test_weight_norm_splits_its_dim_only(v, g, dim, split):
    """``weight_norm``'s ``_weight_norm(v, g, dim)``: the norm over every other dim keeps them whole;
    ``dim=-1`` (``weight_norm(dim=None)``) norms the whole tensor."""
    results = check(lambda v, g: torch._weight_norm(v * 2, g * 2, dim), (torch.randn(v), torch.rand(g) + 0.5),
                    aten._weight_norm.default, split)
    assert all(s.out_spec.dims[d] == () for s, _, _ in results for d in range(len(v)) if dim == -1 or d != dim)


SCATTER, INDEX_ADD = aten.scatter_add.default, aten.index_add.default
ACCUMULATES = [  # op, inputs, node, specs some strategy must give, the dims of self no strategy splits
    (lambda h, i, s: h.scatter_add(1, i, s), (X, torch.randint(0, 8, (4, 8, 6)), X), SCATTER,
     {"S0RS1", "S01RR", "S1RS0"}, [1]),
    (lambda h, i, s: h.scatter_add(2, i, s), (X, torch.randint(0, 6, (4, 8, 3)), X), SCATTER, {"S0S1R", "S01RR"}, [2]),
    (lambda h, i, s: h.scatter_add(0, i, s), (X, torch.randint(0, 4, (2, 8, 3)), X), SCATTER, {"RS01R"}, [0, 2]),
    (lambda h, i, s: h.index_add(1, i, s), (X, torch.tensor([7, 0, 3]), torch.randn(4, 3, 6)), INDEX_ADD,
     {"S0RS1", "S01RR", "S1RS0"}, [1]),
    (lambda h, i, s: h.index_add(0, i, s, alpha=-0.5), (X, torch.tensor([3, 0, 3, 1, 2]), torch.randn(5, 8, 6)),
     INDEX_ADD, {"RS0S1", "RS01R"}, [0])]


@pytest.mark.parametrize("fn,inputs,target,expect,whole", ACCUMULATES, ids=[
    "scatter_add_middle", "scatter_add_last_smaller", "scatter_add_batch_prefix", "index_add_middle",
    "index_add_batch_alpha"])
def test_scatter_add_and_index_add_keep_the_accumulated_dim_whole(fn, inputs, target, expect, whole):
    """``scatter_add`` / ``index_add`` (a top-2 MoE's combine weights and tokens put back) ran
    replicated with "no sharding strategy", and their results lost the batch dim. The dim they add
    into stays whole in every operand; the others split with the added rows (a smaller index
    keeps its dims whole)."""
    results = check(lambda h, i, s: fn(h * 2, i, s * 2), inputs, target, expect)
    assert all(s.in_specs[0].dims[d] == () for s, _, _ in results for d in whole)


def test_addmv_adds_its_bias_once_to_a_split_contraction():
    """``addmv(bias, mat, vec, beta, alpha)`` ran replicated: it splits as ``mv`` with the bias
    following the rows, and a split contraction (a partial sum) adds the bias once."""
    results = check(lambda b, m, v: torch.addmv(b * 2, m * 2, v * 2, beta=0.7, alpha=-1.2),
                    (torch.randn(8), torch.randn(8, 12), torch.randn(12)), aten.addmv.default, {"S0", "S01", "R"})
    assert any(s.partial_axes for s, _, _ in results)


def test_grouped_query_attention_splits_batch_and_heads():
    """sdpa with ``enable_gqa=True`` (4 query heads over 2 key/value heads) ran replicated: a block
    of query heads reads the matching block of key/value heads, so heads split by up to 2."""
    q, kv = torch.randn(4, 4, 6, 8), torch.randn(4, 2, 6, 8)
    results = check(lambda q, k, v: F.scaled_dot_product_attention(q * 2, k * 2, v * 2, is_causal=True, scale=0.3,
                                                                   enable_gqa=True),
                    (q, kv, kv.flip(-1)), aten.scaled_dot_product_attention.default, {"S0S1RR", "S01RRR", "RS0RR"})
    assert max(s.in_specs[0].shards(1, MESH.shape) for s, _, _ in results) == 2


ELEMENTWISE_LOSSES = [  # loss (x, y, reduction), its node
    (lambda x, y, r: F.mse_loss(x, y, reduction=r), aten.mse_loss.default),
    (lambda x, y, r: F.smooth_l1_loss(x, y, reduction=r, beta=0.5), aten.smooth_l1_loss.default),
    (lambda x, y, r: F.huber_loss(x, y, reduction=r, delta=0.3), aten.huber_loss.default),
    (lambda x, y, r: F.soft_margin_loss(x, y.sign(), reduction=r), aten.soft_margin_loss.default),
    (lambda x, y, r: F.binary_cross_entropy(x.sigmoid(), y.sigmoid(), reduction=r), aten.binary_cross_entropy.default),
    (lambda x, y, r: F.binary_cross_entropy_with_logits(x, y.sigmoid(), reduction=r,
                                                      pos_weight=y[0, 0].abs() + 0.5),
     aten.binary_cross_entropy_with_logits.default),
    (lambda x, y, r: F.binary_cross_entropy_with_logits(x, y.sigmoid(), y[0].abs(), reduction=r),
     aten.binary_cross_entropy_with_logits.default),
    (lambda x, y, r: F.hinge_embedding_loss(x, y.sign(), margin=0.5, reduction=r), aten.hinge_embedding_loss.default),
    (lambda x, y, r: F.margin_ranking_loss(x, y, (x - y).sign(), margin=0.1, reduction=r),
     aten.margin_ranking_loss.default),
    (lambda x, y, r: F.kl_div(x, y.softmax(-1), reduction=r), aten.kl_div.default),
    (lambda x, y, r: F.kl_div(x, y, reduction=r, log_target=True), aten.kl_div.default)]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("fn,target", ELEMENTWISE_LOSSES,
                         ids=["mse", "smooth_l1", "huber", "soft_margin", "bce", "bce_logits_pos_weight",
                              "bce_logits_weight", "hinge_embedding", "margin_ranking", "kl_div", "kl_div_log_target"])
def test_elementwise_losses_split_every_dim(fn, target, reduction):
    """Losses of one term per element (sweep 8b: smooth L1, Huber, BCE with ``pos_weight`` ran
    replicated, warning "no sharding strategy"): every dim of the input splits, a mean or sum of
    split dims as partial means or sums, ``pos_weight`` / ``weight`` split with the dims they
    broadcast along."""
    results = check(lambda x, y: fn(x * 2, y * 2, reduction), (torch.randn(4, 8, 6), torch.randn(4, 8, 6)), target)
    splits = {str(s.in_specs[0]) for s, _, _ in results}
    assert {"S0S1R", "RS0S1", "S01RR"} <= splits, splits
    assert all(s.partial_axes for s, _, _ in results if "S" in str(s.in_specs[0])) == (reduction != "none")


@pytest.mark.parametrize("fn,target", [
    (lambda c, x: torch.where(c > 0, 1.0, 0.0) * x, aten.where.Scalar),
    (lambda c, x: torch.where(c > 0, 1.0, x), aten.where.ScalarSelf),
    (lambda c, x: torch.where(c > 0, x, 0.5), aten.where.ScalarOther)], ids=["scalars", "scalar_self", "scalar_other"])
def test_where_with_numbers_is_pointwise(fn, target):
    """``torch.where`` with a Python number for a branch has no pointwise tag (sweep 8b: it ran
    replicated): it splits as its tensor operands do."""
    check(fn, (torch.randn(4, 8), torch.randn(4, 8)), target, {"S0S1", "S01R"})
