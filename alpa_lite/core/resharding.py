"""Resharding between two sharding specs, and the collectives it takes (forward and backward).

One routine plans the steps; the cost model prices them and the runtime executes them, so the
plan's collective list is exactly what a training step issues.

Forward, ``src -> dst`` (the DTensor ``redistribute`` idea, restated for Alpa specs):
1. for each dim whose mesh axes differ, drop axes from its minor end until what is left is a
   prefix of the target entry: an axis the target puts on another dim (where it can be appended)
   moves there by one **all-to-all**, any other is **all-gathered**;
2. then split every dim further to its target entry by a local **slice** (no communication).

A partial sum (``ShardingSpec.partial``, DTensor's ``Partial``) is reduced first, along each axis
``dst`` does not keep partial: by a **reduce-scatter** when ``dst`` splits a dim along that axis
(and the dim's entry so far is a prefix of the target's), else by an **all-reduce**; the plain
routine above then finishes the move (all-gather, all-to-all and slice are linear, so they carry a
partial sum ``dst`` keeps unchanged). An axis ``dst`` holds partial that ``src`` does not is a
local **mask**: the device at coordinate 0 along it keeps the value, the others hold zeros.

Backward, the gradient arrives in ``dst`` and is a partial sum along the axes ``grad_partial``
(operand replicated there while the consuming op's result is split). Each such axis is reduced
first: by a **reduce-scatter** when ``src`` splits a dim along it (the ZeRO pattern: all-gather
forward, reduce-scatter backward), else by an **all-reduce** (data-parallel gradient sync).
What remains is the forward routine from the gradient's spec back to ``src``. The gradient of a
partial sum is the same on every device of its partial axes (the dual of all-reduce is the
identity), so the gradient lives in ``dst`` and returns to ``src`` without their partial axes:
an all-reduce of ``src`` costs nothing backward, a reduce-scatter's dual is an all-gather, and a
mask's dual is the identity.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from .mesh import LogicalMesh
from .options import PlanOptions
from .spec import ShardingSpec


@dataclass(frozen=True)
class Step:
    """One resharding step on one mesh axis.

    ``kind`` is ``all-gather`` (along ``dim``), ``all-to-all`` (gather ``dim``, split ``dim2``),
    ``reduce-scatter`` (scatter ``dim``), ``all-reduce``, ``slice`` (local, split ``dim``) or
    ``mask`` (local: zeros unless at coordinate 0 along ``axis``; the value becomes partial).
    ``nbytes`` is the per-device size the cost formula of ``kind`` takes (mesh.py).
    """

    kind: str
    axis: int
    dim: int | None
    dim2: int | None
    nbytes: float
    before: ShardingSpec
    after: ShardingSpec

    @property
    def is_collective(self) -> bool:
        return self.kind not in ("slice", "mask")


def _local_bytes(shape, itemsize, spec, mesh_shape) -> float:
    return float(itemsize * math.prod(spec.local_shape(shape, mesh_shape)))


@functools.lru_cache(maxsize=None)
def forward_steps(src: ShardingSpec, dst: ShardingSpec, shape, itemsize: int, mesh_shape) -> tuple[Step, ...]:
    """Steps that turn a tensor of global ``shape`` held in ``src`` into ``dst`` (memoized)."""
    steps: list[Step] = []
    cur = src
    for axis in src.partial:
        if axis in dst.partial:
            continue
        nbytes = _local_bytes(shape, itemsize, cur, mesh_shape)
        reduced = cur.with_partial(tuple(a for a in cur.partial if a != axis))
        d = dst.dim_of_axis(axis)
        if d is not None and dst.dims[d][: len(cur.dims[d]) + 1] == cur.dims[d] + (axis,):
            after = reduced.with_dim(d, cur.dims[d] + (axis,))
            if after.divides(shape, mesh_shape):
                steps.append(Step("reduce-scatter", axis, d, None, nbytes, cur, after))
                cur = after
                continue
        steps.append(Step("all-reduce", axis, None, None, nbytes, cur, reduced))
        cur = reduced
    for d in range(src.ndim):
        while cur.dims[d] != dst.dims[d][: len(cur.dims[d])]:
            axis = cur.dims[d][-1]
            dropped = cur.with_dim(d, cur.dims[d][:-1])
            d2 = dst.dim_of_axis(axis)
            if d2 is not None and d2 != d and dst.dims[d2][: len(cur.dims[d2]) + 1] == cur.dims[d2] + (axis,):
                after = dropped.with_dim(d2, cur.dims[d2] + (axis,))
                if after.divides(shape, mesh_shape):
                    steps.append(Step("all-to-all", axis, d, d2, _local_bytes(shape, itemsize, cur, mesh_shape), cur, after))
                    cur = after
                    continue
            steps.append(Step("all-gather", axis, d, None, _local_bytes(shape, itemsize, dropped, mesh_shape), cur, dropped))
            cur = dropped
    for d in range(src.ndim):
        for axis in dst.dims[d][len(cur.dims[d]):]:
            after = cur.with_dim(d, cur.dims[d] + (axis,))
            steps.append(Step("slice", axis, d, None, 0.0, cur, after))
            cur = after
    for axis in dst.partial:
        if axis not in cur.partial:
            after = cur.with_partial(cur.partial + (axis,))
            steps.append(Step("mask", axis, None, None, 0.0, cur, after))
            cur = after
    assert cur == dst, (src, dst, cur)
    return tuple(steps)


@functools.lru_cache(maxsize=None)
def backward_steps(src: ShardingSpec, dst: ShardingSpec, grad_partial, shape, itemsize, mesh_shape) -> tuple[Step, ...]:
    """Steps that turn the gradient (in ``dst``, partial along ``grad_partial``) into ``src`` (memoized).
    Both without their partial axes: the gradient of a partial sum is replicated along them."""
    steps: list[Step] = []
    src, cur = src.with_partial(()), dst.with_partial(())
    for axis in sorted(grad_partial):
        d = src.dim_of_axis(axis)
        nbytes = _local_bytes(shape, itemsize, cur, mesh_shape)
        if d is not None and cur.dim_of_axis(axis) is None and \
                src.dims[d][: len(cur.dims[d]) + 1] == cur.dims[d] + (axis,):
            after = cur.with_dim(d, cur.dims[d] + (axis,))
            steps.append(Step("reduce-scatter", axis, d, None, nbytes, cur, after))
            cur = after
        else:
            steps.append(Step("all-reduce", axis, None, None, nbytes, cur, cur))
    return tuple(steps) + forward_steps(cur, src, shape, itemsize, mesh_shape)


def regathers(src: ShardingSpec, dst: ShardingSpec, grad_partial, shape, itemsize: int, mesh_shape) -> bool:
    """Whether a parameter's move is a ZeRO-3 use whose gathered copy is not kept for backward:
    its forward all-gathers and it has a backward. Backward runs the forward steps again before
    the readers' backward (ZeRO-3, Rajbhandari et al., SC'20, section 5; FSDP's
    ``reshard_after_forward=True``), so only the shard is held between forward and backward."""
    return grad_partial is not None and any(s.kind == "all-gather"
                                            for s in forward_steps(src, dst, shape, itemsize, mesh_shape))


def grouped_steps(src: ShardingSpec, dst: ShardingSpec, grad_partial, shape, itemsize: int, mesh_shape
                  ) -> tuple[Step, Step] | None:
    """``(all-gather, reduce-scatter)`` of a ZeRO-3 use (``regathers``) that a ZeRO-3 group can
    take (``core.plan.zero3_groups``): its forward is one all-gather along a dim over one mesh
    axis and its gradient's backward one reduce-scatter along the same dim and axis; else None."""
    if grad_partial is None:
        return None
    fwd = forward_steps(src, dst, shape, itemsize, mesh_shape)
    bwd = backward_steps(src, dst, grad_partial, shape, itemsize, mesh_shape)
    if len(fwd) != 1 or len(bwd) != 1 or fwd[0].kind != "all-gather" or bwd[0].kind != "reduce-scatter" \
            or (fwd[0].axis, fwd[0].dim) != (bwd[0].axis, bwd[0].dim):
        return None
    return fwd[0], bwd[0]


def step_cost(step: Step, mesh: LogicalMesh) -> float:
    """Seconds of one step under the alpha-beta model (a slice or a mask is free)."""
    if not step.is_collective:
        return 0.0
    return mesh.collective_cost(step.kind, step.nbytes, (step.axis,))


def is_gradient_sync(src: ShardingSpec, dst: ShardingSpec, grad_partial) -> bool:
    """The edge moves nothing forward and only all-reduces the gradient backward: a parameter
    used replicated under a split batch. Such gradients are synchronized in buckets at the end
    of backward (one all-reduce over the flattened ``grad_partial`` axes per bucket)."""
    return src == dst and bool(grad_partial) and all(src.dim_of_axis(a) is None for a in grad_partial)


class ReshardCosts:
    """Memoized cost (seconds, forward + backward) of moving a tensor between specs.

    A parameter's gradient synchronization (``is_gradient_sync``) is bucketed: the ILP charges its
    bandwidth term over the flattened axes and its share of a bucket's latency
    (``LogicalMesh.bucketed_cost``; ``Plan`` pays one latency per bucket of at most
    ``bucket_bytes``); the first bucket's latency is the cost graph's: a pool's for all-reduces
    (``ilp.Pool.latency``), ZeRO-2's fixed charge for reduce-scatters.

    Alpa's switches (``PlanOptions``, docs/planner.md): a move with a step of a kind in ``forbid``
    (``"all-gather"``, ``"all-to-all"``; forward or backward, and the once-per-step all-gather of a
    ZeRO-1/2 parameter) costs ``math.inf``, which the ILP forbids; under
    ``prefer_reduce_scatter`` so does a move that slices a result its op all-reduced where the
    op could leave it partial and the move reduce-scatter it instead."""

    def __init__(self, mesh: LogicalMesh, forbid: frozenset[str] = frozenset(),
                 prefer_reduce_scatter: bool = False, bucket_bytes: float = 25 * 2**20):
        self.mesh = mesh
        self.bucket_bytes = bucket_bytes
        self.forbid = forbid
        self.prefer_reduce_scatter = prefer_reduce_scatter
        self._cache: dict[tuple, float] = {}
        self._matrices: dict[tuple, list[list[float]]] = {}

    def __call__(self, src: ShardingSpec, dst: ShardingSpec, grad_partial, shape, itemsize,
                 parameter: bool = False, zero: tuple[int, tuple[int, ...]] = (0, ()),
                 reduced: tuple[int, ...] = ()) -> float:
        """``grad_partial`` None: the tensor needs no gradient, so there is no backward.
        ``zero``: the ``(stage, axes)`` of a ZeRO-1/2 parameter: its use must be a gradient sync
        over exactly those axes (else ``math.inf``: the ILP forbids the pair); ZeRO-2 syncs by a
        reduce-scatter instead of an all-reduce. ``reduced``: the mesh axes along which the
        producing op all-reduced ``src`` though it could have left it partial. A parameter's
        ZeRO-3 use (``regathers``) pays its forward steps twice: backward gathers it again. One
        a ZeRO-3 group can take (``grouped_steps``) pays the bandwidth terms of its all-gather
        (twice) and its gradient's reduce-scatter (``LogicalMesh.marginal_cost``): the runtime
        moves the group by one flat collective each (``core.plan.zero3_groups``), whose latencies
        the cost graph charges per group (``compiler.cost_graph``)."""
        key = (src, dst, grad_partial, tuple(shape), itemsize, parameter, zero, reduced)
        cost = self._cache.get(key)
        sync = parameter and is_gradient_sync(src, dst, grad_partial)
        if cost is None and zero[0] and ("all-gather" in self.forbid
                                         or not (sync and tuple(sorted(grad_partial)) == zero[1])):
            cost = self._cache[key] = math.inf
        if cost is None and reduced and self.prefer_reduce_scatter:
            unreduced = src.with_partial(tuple(sorted(set(src.partial) | set(reduced))))
            if any(s.kind == "reduce-scatter" and s.axis in reduced
                   for s in forward_steps(unreduced, dst, shape, itemsize, self.mesh.shape)):
                cost = self._cache[key] = math.inf
        grouped = grouped_steps(src, dst, grad_partial, shape, itemsize, self.mesh.shape) \
            if cost is None and parameter else None
        if grouped is not None:  # a ZeRO-3 group's member: bandwidth (its latencies: the cost graph's)
            axes = (grouped[0].axis,)
            cost = self._cache[key] = math.inf if "all-gather" in self.forbid else (
                2 * self.mesh.marginal_cost("all-gather", grouped[0].nbytes, axes)
                + self.mesh.marginal_cost("reduce-scatter", grouped[1].nbytes, axes))
        if cost is None and sync:
            nbytes = itemsize * math.prod(src.local_shape(shape, self.mesh.shape))
            axes = tuple(sorted(grad_partial))
            kind = "reduce-scatter" if zero[0] == 2 else "all-reduce"
            cost = self._cache[key] = self.mesh.bucketed_cost(kind, nbytes, axes, self.bucket_bytes)
        if cost is None:
            steps = forward_steps(src, dst, shape, itemsize, self.mesh.shape)
            if grad_partial is not None:
                steps += backward_steps(src, dst, grad_partial, shape, itemsize, self.mesh.shape)
            if parameter and regathers(src, dst, grad_partial, shape, itemsize, self.mesh.shape):
                steps += forward_steps(src, dst, shape, itemsize, self.mesh.shape)  # gathered again in backward
            forbidden = any(s.kind in self.forbid for s in steps)
            cost = self._cache[key] = math.inf if forbidden else sum(step_cost(s, self.mesh) for s in steps)
        return cost

    def matrix(self, outs: tuple, ins: tuple, shape, itemsize, parameter: bool = False,
               zeros: tuple | None = None, reduced: tuple | None = None) -> list[list[float]]:
        """The cost matrix of an edge: ``[p][q]`` moves a tensor of ``shape`` from spec ``outs[p]``
        (a parameter of ZeRO ``zeros[p]``; all-reduced along ``reduced[p]`` by its op) to
        ``ins[q] = (spec, grad_partial)``; memoized (repeated blocks have identical edges)."""
        zeros = zeros or ((0, ()),) * len(outs)
        reduced = reduced or ((),) * len(outs)
        key = (outs, ins, tuple(shape), itemsize, parameter, zeros, reduced)
        m = self._matrices.get(key)
        if m is None:
            m = self._matrices[key] = [[self(o, spec, gp, shape, itemsize, parameter, z, r) for spec, gp in ins]
                                       for o, z, r in zip(outs, zeros, reduced)]
        return m

    def sync_matrix(self, outs: tuple, ins: tuple, shape, itemsize, zeros: tuple | None = None) -> list[list[float]]:
        """``matrix(..., parameter=True, zeros=zeros)`` where the edge is a gradient sync
        (``is_gradient_sync``) a ZeRO stage allows, 0 elsewhere: the part of a parameter edge that
        runs once per step, bucketed."""
        zeros = zeros or ((0, ()),) * len(outs)
        key = ("sync", outs, ins, tuple(shape), itemsize, zeros)
        m = self._matrices.get(key)
        if m is None:
            def once(o, spec, gp, z):
                cost = self(o, spec, gp, shape, itemsize, True, z) if is_gradient_sync(o, spec, gp) else 0.0
                return cost if math.isfinite(cost) else 0.0  # a pairing the ZeRO stage forbids stays forbidden

            m = self._matrices[key] = [[once(o, spec, gp, z) for spec, gp in ins] for o, z in zip(outs, zeros)]
        return m


def reshard_costs(mesh: LogicalMesh, options: PlanOptions | None = None) -> ReshardCosts:
    """The ``ReshardCosts`` of ``mesh`` under the switches of ``options``, shared by every cost
    graph built with them."""
    options = options or PlanOptions()
    forbid = frozenset(kind for kind, allowed in (("all-gather", options.allow_all_gather),
                                                  ("all-to-all", options.allow_all_to_all)) if not allowed)
    return _reshard_costs(mesh, forbid, options.prefer_reduce_scatter, options.bucket_bytes)


@functools.lru_cache(maxsize=64)
def _reshard_costs(mesh: LogicalMesh, forbid: frozenset[str], prefer_reduce_scatter: bool,
                   bucket_bytes: float) -> ReshardCosts:
    return ReshardCosts(mesh, forbid, prefer_reduce_scatter, bucket_bytes)
