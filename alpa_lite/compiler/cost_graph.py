"""The intra-op ILP's cost graph: one variable per node (or per group of nodes), edges priced
by resharding (Alpa, OSDI'22, section 4.2).

Building the cost graph shrinks the ILP two ways (docs/planner.md, "The ILP ... and its size"):
- a *follower* (view, transpose, unary elementwise, getitem) joins its operand's variable when
  every operand strategy has a matching follower strategy (Alpa's merged nodes);
- nodes at the same place in identical repeated blocks (``h.0.attn`` ... ``h.31.attn``, same
  shapes and strategies, at least ``MIN_SHARED_LAYER_NODES`` nodes per block) share one
  variable, so every block gets the same solution. Numbered modules inside numbered modules
  (a Wide-ResNet's ``stages.i.j``) are tried outermost first: a node joins the first copy of
  its place with the same strategies at any level (``stages.1.2.conv1`` the variable of
  ``stages.1.1.conv1``, as the stages themselves differ in width).
Both restrict the search space, never the accounting: each node's costs and each edge's
resharding matrix still enter the objective and the memory sum once per node.

A value read by several consumers is moved once per spec they want (the runtime reshards it
once and sums the readers' gradients before the move's backward): a target spec two or more
of its reader edges can want is priced by one shared move (``CostGraph.moves``), not per edge.

What backward hides (``CostGraph.pools``, ``ilp.Pool``; docs/planner.md, "One price"): a
parameter edge's gradient sync joins the pool of its bucket's kind and mesh axes (its marginal
seconds, as the edge pays them; so does the sync of a lookup's output where its weight's
gradient is bucketed instead, ``CapturedGraph.param_lookups``, priced at the weight's bytes), and a ZeRO-3 use a group can take (``resharding.grouped_steps``)
its reduce-scatter's seconds to the ZeRO-3 pool; each node's compute times ``BACKWARD_SHARE``
is what hides them (``CostGraph.backward``; a parameter's, its optimizer update, hides nothing),
as ``core.plan.hidden_seconds`` prices a listing. The loss's all-reduce the runtime defers
(``training_step.deferred_loss_axes``; an SPMD plan's, or a pipeline's last stage, per
microbatch) is the pool ``"deferred loss"``, nothing of it unhidden (the listing's
``Collective.deferred``).
"""
from __future__ import annotations

import functools
import math
import re
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from ..core.capture import CapturedGraph
from ..core.mesh import LogicalMesh
from ..core.options import PlanOptions
from ..core.plan import BACKWARD_SHARE, first_use_positions, local_bytes
from ..core.resharding import ReshardCosts, grouped_steps, is_gradient_sync, regathers, reshard_costs
from ..core.spec import ShardingSpec
from .ilp import CostGraph, Pool, RematGroup
from .strategies import BACKWARD_FLOPS_FACTOR, NodeStrategies, kept_for_backward
from .training_step import deferred_loss_axes


@dataclass
class Var:
    """Where a node's strategy comes from: ILP variable ``var``, and per variable strategy
    index the node's own strategy index."""

    var: int
    index: list[int]


class _EdgeSums:
    """Edge matrices summed as numpy arrays before they enter the cost graph (``flush``). The
    copies of a repeated block share variables, so every edge of theirs is added into one matrix
    once per copy (32 times on GPT-3 2.6B), which ``ilp._accumulate``'s list arithmetic paid entry
    by entry. The sums run in the order of the adds, as ``_accumulate``'s would (a pair stored
    once, either way round), so the flushed matrices are the same floats and enter each owner's
    edges in the same order."""

    def __init__(self):
        self.sums: dict[tuple, np.ndarray] = {}  # (id of the owner, u, v, add_edge's extra args) -> sum
        self.owners: dict[int, object] = {}  # id -> the CostGraph, Pool or RematGroup

    def add(self, owner, u: int, v: int, matrix, *args) -> None:
        """``owner.add_edge(u, v, matrix, *args)``, deferred (a self edge at once: it adds into
        the owner's per-strategy costs)."""
        if u == v:
            owner.add_edge(u, v, matrix, *args)
            return
        k = id(owner)
        self.owners[k] = owner
        if (k, v, u, args) in self.sums:
            self.sums[k, v, u, args] += np.asarray(matrix).T
        elif (k, u, v, args) in self.sums:
            self.sums[k, u, v, args] += matrix
        else:
            self.sums[k, u, v, args] = np.array(matrix, dtype=np.float64)

    def flush(self) -> None:
        """Add every sum to its owner."""
        for (k, u, v, args), total in self.sums.items():
            self.owners[k].add_edge(u, v, total.tolist(), *args)
        self.sums.clear()


_INDEX = re.compile(r"\.(\d+)(?=\.|$)")
MIN_SHARED_LAYER_NODES = 8  # a repeated "layer" smaller than this (one Linear) is not a block


def _layer_levels(node: torch.fx.Node) -> list[tuple[str, str, str]]:
    """``(prefix, index, rest)`` of each numbered module on the node's module path, innermost
    first: ``model.stages.1.2.conv1`` is block 2 of ``model.stages.1`` and block 1 of
    ``model.stages``."""
    if node.op == "placeholder":  # a parameter belongs to the layer of its first consumer
        node = next(iter(node.users), None)
        if node is None:
            return []
    stack = node.meta.get("nn_module_stack")
    path = list(stack.values())[-1][0] if stack else ""
    return [(path[:m.start()], m.group(1), path[m.end():]) for m in reversed(list(_INDEX.finditer(path)))]


def _layer_keys(node: torch.fx.Node, counters: dict, sizes: dict) -> list[tuple]:
    """The node's place in each numbered block it lies in that holds at least
    ``MIN_SHARED_LAYER_NODES`` nodes (``sizes``: nodes per ``(prefix, index)``), outermost first,
    each as ``(prefix, rest, kind, occurrence)``."""
    kind = "placeholder" if node.op == "placeholder" else str(node.target)
    keys = []
    for prefix, index, rest in reversed(_layer_levels(node)):
        if sizes[prefix, index] >= MIN_SHARED_LAYER_NODES:
            slot = (prefix, index, rest, kind)
            counters[slot] = counters.get(slot, -1) + 1
            keys.append((prefix, rest, kind, counters[slot]))
    return keys


def _strategy_signature(ns: NodeStrategies) -> tuple:
    return tuple((s.name, s.in_specs, s.out_specs, s.grad_partial, round(s.cost, 15), round(s.memory, 3),
                  s.zero_stage, s.zero_axes) for s in ns.strategies)


def _reduced_in_op(ns: NodeStrategies, q: int, r: int) -> tuple[int, ...]:
    """The mesh axes along which strategy ``q`` all-reduces its result ``r`` while another
    strategy of the same inputs leaves it partial there (``PlanOptions.prefer_reduce_scatter``)."""
    s = ns.strategies[q]
    axes = tuple(a for a in s.partial_axes if a not in s.out_specs[r].partial)
    twin = axes and any(t.in_specs == s.in_specs and t.out_specs[r].dims == s.out_specs[r].dims
                        and set(axes) <= set(t.out_specs[r].partial) for t in ns.strategies)
    return axes if twin else ()


def build_cost_graph(cg: CapturedGraph, table: dict[str, NodeStrategies], mesh: LogicalMesh,
                     share_layers: bool = True, merge_followers: bool = True,
                     nodes: set[str] | None = None, remat: list[tuple[str, ...]] = (),
                     remat_forced: bool = False, options: PlanOptions | None = None) -> tuple[CostGraph, dict[str, Var]]:
    """The ILP's cost graph and, per node, its variable and strategy mapping.

    ``nodes`` restricts the graph to those nodes (a pipeline stage): an operand produced outside
    them arrives free, in whatever spec its consumer wants (the stage DP costs its transfer).
    ``remat``: layers (node names) that may be recomputed, each a ``RematGroup`` (forced with
    ``remat_forced``): the activations only the layer reads move from ``memory`` to the group,
    and recomputing costs each node's forward (a third of its compute), forward collectives and
    the forward moves of its operands (``RematGroup.edges``; a value read in one spec by several
    of the layer's variables is charged per variable, where the runtime moves it once; a ZeRO-3
    parameter's gather nothing: its edge already pays the backward's gather, which
    recomputation replaces).
    ``options``: its switches forbid moves (``resharding.ReshardCosts``); its ``bucket_bytes``
    bound what stays unhidden of each overlap pool (``ilp.Pool.unhidden``).
    """
    if nodes is not None:
        table = {k: v for k, v in table.items() if k in nodes}
    graph = CostGraph(costs=[], memory=[])
    where: dict[str, Var] = {}
    shared: dict[tuple, int] = {}  # (place in a block, strategies) -> its variable
    counters: dict = {}
    sizes: dict = {}
    for node in cg.graph.nodes:
        for level in _layer_levels(node) if node.name in table else ():
            sizes[level[:2]] = sizes.get(level[:2], 0) + 1
    layer_of = {n: i for i, layer in enumerate(remat) for n in layer}
    graph.remat = [RematGroup(forced=remat_forced) for _ in remat]
    reshard = reshard_costs(mesh, options)
    prefer_rs = options is not None and options.prefer_reduce_scatter
    pool_memo: dict = {}  # _pool_parameter's matrices
    sums = _EdgeSums()
    readers: dict[tuple[str, int], list[tuple[int, tuple]]] = {}  # value -> reader edges (var, wanted per strategy)
    scopes: dict[tuple[str, int], list[int | None]] = {}  # value -> per reader edge, the recomputed layer grouping it
    recomputed: dict[tuple[str, int], dict] = {}  # value -> {(var, wanted, group index)} read inside remat layers
    casts = cg.param_casts  # a parameter's low-precision copy: its gradient sync is bucketed too
    lookups = cg.param_lookups  # a lookup of a weight read by nothing else: its output's sync is the weight's
    position = first_use_positions(cg)
    first = min((position[ph] for ph in cg.param_fqns if ph in table), default=None)

    def new_var(name, ns):
        graph.costs.append([0.0] * len(ns.strategies))
        graph.memory.append([0.0] * len(ns.strategies))
        graph.backward[len(graph.names)] = [0.0] * len(ns.strategies)
        graph.names.append(name)
        return Var(len(graph.costs) - 1, list(range(len(ns.strategies))))

    for node in cg.graph.nodes:
        ns = table.get(node.name)
        if ns is None:
            continue
        placed = None
        if merge_followers and ns.follower and len(ns.inputs) == 1 and ns.inputs[0] in where:
            src = where[ns.inputs[0]]
            src_ns = table[ns.inputs[0]]
            r = ns.input_results[0]
            cheapest: dict[ShardingSpec, int] = {}  # per input spec, the cheapest strategy taking it
            for q, s in enumerate(ns.strategies):
                if s.in_specs[0] not in cheapest or s.cost < ns.strategies[cheapest[s.in_specs[0]]].cost:
                    cheapest[s.in_specs[0]] = q
            index = [cheapest.get(src_ns.strategies[p].out_specs[r]) for p in src.index]
            if None not in index:
                placed = Var(src.var, index)
        if placed is None and share_layers:  # the outermost block with a copy of the same strategies
            keys = _layer_keys(node, counters, sizes)
            if keys:
                sig = _strategy_signature(ns)
                owner = next((shared[k, sig] for k in keys if (k, sig) in shared), None)
                placed = new_var(node.name, ns) if owner is None else Var(owner, list(range(len(ns.strategies))))
                for k in keys:
                    shared.setdefault((k, sig), placed.var)
        if placed is None:
            placed = new_var(node.name, ns)
        where[node.name] = placed
        group = graph.remat[layer_of[node.name]] if node.name in layer_of else None
        internal = group is not None and all(layer_of.get(u.name) == layer_of[node.name] for u in node.users)
        width = len(graph.costs[placed.var])
        kept = kept_for_backward(node)
        for p, q in enumerate(placed.index):
            s = ns.strategies[q]
            graph.costs[placed.var][p] += s.cost
            if node.name not in cg.param_fqns:  # a parameter's compute is its optimizer update
                graph.backward[placed.var][p] += BACKWARD_SHARE * s.compute
            (group.act.setdefault(placed.var, [0.0] * width) if internal else graph.memory[placed.var])[p] += s.memory * kept
            if group is not None:
                group.extra.setdefault(placed.var, [0.0] * width)[p] += s.compute / (1 + BACKWARD_FLOPS_FACTOR) + s.comm
            # a ZeRO-1/2 parameter joins a bucketed all-gather (and reduce-scatter): its latency, once
            for kind in ("all-gather", "reduce-scatter")[:s.zero_stage]:
                graph.add_fixed((kind, s.zero_axes), mesh.collective_cost(kind, 0, s.zero_axes), (placed.var, p))
            axes = deferred_loss_axes(cg, node.name, s.in_specs, s.out_specs[0], s.partial_axes,
                                      node.name in layer_of)
            if axes:  # the listing's deferred all-reduce of the loss (plan_collectives), hidden behind backward
                local = local_bytes(node.meta["val"], s.out_specs[0], mesh.shape)
                pool = graph.pools.setdefault("deferred loss", Pool(0.0))
                pool.extra.setdefault(placed.var, [0.0] * width)[p] += mesh.all_reduce_cost(local, axes)
        for i, (src_name, r) in enumerate(zip(ns.inputs, ns.input_results)):
            if src_name in where:  # else produced outside ``nodes``
                ins = tuple((ns.strategies[q].in_specs[i], ns.strategies[q].grad_partial[i]) for q in placed.index)
                if node.name != src_name and carried_parameter(cg, table, where, node.name) == src_name:
                    continue  # a read that costs nothing (no move, no sync): not an edge
                readers.setdefault((src_name, r), []).append((placed.var, ins))
                scopes.setdefault((src_name, r), []).append(layer_of[node.name] if remat_forced and group is not None else None)
                if group is not None:
                    recomputed.setdefault((src_name, r), {})[(placed.var, ins, layer_of[node.name])] = None
    for (src_name, r), edges in readers.items():
        src, src_ns = where[src_name], table[src_name]
        val = cg.node(src_name).meta["val"]
        val = val[r] if isinstance(val, (tuple, list)) else val
        outs = tuple(src_ns.strategies[p].out_specs[r] for p in src.index)
        zeros = value_zeros(cg, table, where, src_name)
        reduced = tuple(_reduced_in_op(src_ns, p, r) for p in src.index) if prefer_rs else None
        parameter = src_name in cg.param_fqns or src_name in casts
        weight = lookups.get(src_name)  # a lookup's output: its gradient sync is its weight's, bucketed
        sync_bytes = None if weight is None else tuple(  # the weight as the lookup reads it (a cast: its dtype)
            local_bytes(cg.node(src_name).args[0].meta["val"], src_ns.strategies[p].in_specs[0], mesh.shape)
            for p in src.index)
        _price_value(graph, sums, reshard, src.var, outs, zeros, reduced, edges, tuple(val.shape),
                     val.element_size(), parameter, sync_bytes)
        if parameter or weight is not None:  # the parameters used first complete their gradients when backward ends
            _pool_parameter(graph, sums, reshard, src.var, outs, zeros, edges, scopes[(src_name, r)],
                            tuple(val.shape), val.dtype, (options or PlanOptions()).bucket_bytes,
                            position[weight or casts.get(src_name, src_name)] != first, pool_memo, sync_bytes)
        # forward only (no gradient); a forbidden pair: not chosen; a ZeRO-3 use: free, the
        # recomputation's gather replaces the backward's (``resharding.regathers``)
        for v, ins, i in recomputed.get((src_name, r), ()):
            matrix = reshard.matrix(outs, tuple((spec, None) for spec, _ in ins), tuple(val.shape), val.element_size(),
                                    parameter, None, reduced)
            sums.add(graph.remat[i], src.var, v, [
                [0.0 if not math.isfinite(c) or parameter and regathers(o, *t, tuple(val.shape), val.element_size(),
                                                                         mesh.shape) else c
                 for t, c in zip(ins, row)] for o, row in zip(outs, matrix)])
    sums.flush()
    return graph, where


def carried_parameter(cg: CapturedGraph, table: dict[str, NodeStrategies], where: dict[str, Var],
                      name: str) -> str | None:
    """The parameter whose ZeRO-1/2 requirement (each use a gradient sync over its axes,
    ``compiler.zero``) value ``name`` carries to its readers: a parameter's own; a cast's of a
    parameter (``CapturedGraph.param_casts``: mixed precision's low-precision copy) on the
    parameter's variable that reads it as stored, without a gradient sync, under every strategy
    (the cast is linear, so a partial gradient passes through it to the parameter: its readers are
    the parameter's uses, as ``training_step.defer_gradient_sync`` treats them); else None."""
    if name in cg.param_fqns:
        return name
    ph = cg.param_casts.get(name)
    if ph is None or ph not in where or name not in where or where[ph].var != where[name].var:
        return None
    strategies = [table[name].strategies[q] for q in where[name].index]
    if all(s.in_specs[0] == s.out_specs[0] and not s.grad_partial[0] for s in strategies):
        return ph
    return None


def value_zeros(cg: CapturedGraph, table: dict[str, NodeStrategies], where: dict[str, Var], name: str) -> tuple:
    """Per strategy of ``name``'s variable, the ZeRO ``(stage, axes)`` its value's readers must
    meet: those of the parameter it carries (``carried_parameter``), else ``(0, ())``."""
    owner = carried_parameter(cg, table, where, name)
    if owner is None:
        return ((0, ()),) * len(where[name].index)
    return tuple((table[owner].strategies[p].zero_stage, table[owner].strategies[p].zero_axes)
                 for p in where[owner].index)


def _price_value(graph: CostGraph, sums: _EdgeSums, reshard: ReshardCosts, u: int, outs: tuple, zeros: tuple,
                 reduced: tuple | None, edges: list, shape, itemsize: int, parameter: bool,
                 sync_bytes: tuple | None = None) -> None:
    """Price the moves of one value (variable ``u``, ``outs[p]`` its spec under u's strategy p,
    ``zeros[p]`` its ZeRO ``(stage, axes)`` when it is a parameter, ``reduced[p]`` the axes its op
    all-reduced, ``ReshardCosts.matrix``) to its reader ``edges`` (``(v, ins)``,
    ``ins[q] = (spec, grad_partial)`` wanted under v's strategy q): a target two or more edges
    can want, where moving to it costs something, by one shared move; every other entry on its
    edge. A parameter's gradient sync stays on its edge (bucketed per use; ``ReshardCosts``), and
    so does a move a switch forbids (``inf``). ``sync_bytes[p]``: the value is a weight's lookup
    (``CapturedGraph.param_lookups``) whose gradient sync is its weight's, of these local bytes
    under u's strategy p, bucketed (``_lookup_sync``)."""
    wanted = Counter(t for _, ins in edges for t in dict.fromkeys(ins))  # first-use order, not hash order

    @functools.cache
    def once(o, t):  # the seconds of moving to t once, or 0 where it stays on the edge
        if (parameter or sync_bytes is not None) and is_gradient_sync(o, *t):
            return 0.0
        cost = reshard(o, *t, shape, itemsize, parameter)
        return cost if math.isfinite(cost) else 0.0

    shared = [t for t, k in wanted.items() if k > 1 and any(once(o, t) for o in outs)]
    index = {t: k for k, t in enumerate(shared)}
    for v, ins in edges:
        matrix = reshard.matrix(outs, ins, shape, itemsize, parameter, zeros, reduced)
        if sync_bytes is not None:
            sync = _lookup_sync(reshard, outs, ins, sync_bytes)
            matrix = [[s if is_gradient_sync(o, *t) else c for t, c, s in zip(ins, row, srow)]
                      for o, row, srow in zip(outs, matrix, sync)]
        if any(t in index for t in ins):
            matrix = [[c - once(o, t) if t in index else c for t, c in zip(ins, row)] for o, row in zip(outs, matrix)]
        sums.add(graph, u, v, matrix)
    if shared:
        graph.add_move(u, [(v, [index.get(t, -1) for t in ins]) for v, ins in edges if any(t in index for t in ins)],
                       [[once(o, t) for t in shared] for o in outs])


def _group_latency(mesh: LogicalMesh, axis: tuple[int]) -> float:
    """Seconds of a ZeRO-3 group's latencies over mesh ``axis``: its all-gather, again in
    backward (or in a recomputation), and its gradients' reduce-scatter."""
    return 2 * mesh.collective_cost("all-gather", 0, axis) + mesh.collective_cost("reduce-scatter", 0, axis)


def _lookup_sync(reshard: ReshardCosts, outs: tuple, ins: tuple, sync_bytes: tuple) -> list[list[float]]:
    """``[p][q]``: seconds of a lookup's output edge (``_price_value``) that syncs its gradient
    (``is_gradient_sync``), as its weight's bucketed all-reduce of ``sync_bytes[p]`` over the
    edge's gradient axes (``LogicalMesh.bucketed_cost``); 0 elsewhere."""
    return [[reshard.mesh.bucketed_cost("all-reduce", b, tuple(sorted(gp)), reshard.bucket_bytes)
             if is_gradient_sync(o, spec, gp) else 0.0 for spec, gp in ins] for o, b in zip(outs, sync_bytes)]


def _pool_parameter(graph: CostGraph, sums: _EdgeSums, reshard: ReshardCosts, u: int, outs: tuple, zeros: tuple,
                    edges: list, scopes: list, shape, dtype: torch.dtype, bucket_bytes: float, hides: bool,
                    memo: dict, sync_bytes: tuple | None = None) -> None:
    """Add what backward may hide of one parameter's uses (``outs``, ``zeros``, ``edges`` as
    ``_price_value``) to the cost graph's pools: each gradient sync's seconds on its edge to the
    pool of its bucket's (kind, mesh axes), and each groupable ZeRO-3 use's reduce-scatter (its
    bandwidth term and latency share, as ``ReshardCosts`` prices it) to the ZeRO-3 pool. A pool
    leaves at most its first bucket (group) of ``bucket_bytes`` unhidden (a bucket priced as its
    members, ``LogicalMesh.bucketed_cost``); an all-reduce pool pays one latency when any
    parameter syncs in it (a reduce-scatter's: ZeRO-2's fixed charge). ``hides`` False: a
    parameter used first, in the bucket (group) completed last, whatever its size: a member that
    pays the pool's latency, not part of what hides. ``sync_bytes``: of a weight's lookup, as
    ``_price_value``'s (its output is no ZeRO-3 use).

    ZeRO-3 groups (``core.plan.zero3_groups``) gather uses of one mesh axis and dtype, those of a
    recomputed layer apart (``scopes[i]``: the layer of edge ``i`` when the layers are forced,
    else None): each such (axis, dtype, layer) pays a group's latencies (``_group_latency``) by
    a grouped pool (``ilp.Pool.grouped``): ``max(1, sum of shares)`` of them, a use's share
    ``min(1, b / bucket_bytes)`` (``b`` its gathered bytes), where the listing pays one per
    group: groups of at most ``bucket_bytes`` hold at most one latency's shares, so ``n`` groups
    pay at most ``n``, exactly ``n`` when they are full or one; fewer where groups end early (the
    axis or dtype alternates between consecutive uses, which no linear term sees).

    ``memo``: the matrices per (outs, zeros, ins, shape, dtype, scope, sync_bytes), kept across
    the calls of one cost graph (the same for each copy of a layer), as arrays (never mutated:
    ``_EdgeSums`` copies the first it is given). ``sums``: where the matrices are added."""
    mesh = reshard.mesh
    for (v, ins), scope in zip(edges, scopes):
        key_of = (outs, zeros, ins, shape, dtype, scope, sync_bytes)
        parts = memo.get(key_of)
        if parts is None:
            parts = {}
            sync = (reshard.sync_matrix(outs, ins, shape, dtype.itemsize, zeros) if sync_bytes is None
                    else _lookup_sync(reshard, outs, ins, sync_bytes))
            for p, (row, (stage, _)) in enumerate(zip(sync, zeros)):
                for q, (c, (_, gp)) in enumerate(zip(row, ins)):
                    if c:
                        key = ("bucket", "reduce-scatter" if stage == 2 else "all-reduce", tuple(sorted(gp)))
                        parts.setdefault(key, [[0.0] * len(ins) for _ in outs])[p][q] = c
                    steps = None if sync_bytes is not None else grouped_steps(outs[p], *ins[q], shape,
                                                                              dtype.itemsize, mesh.shape)
                    if steps is not None:
                        axis = (steps[1].axis,)
                        share = min(1.0, steps[0].nbytes / bucket_bytes) * _group_latency(mesh, axis)
                        parts.setdefault(("groups",), [[0.0] * len(ins) for _ in outs])[p][q] = mesh.bucketed_cost(
                            "reduce-scatter", steps[1].nbytes, axis, bucket_bytes)
                        parts.setdefault(("group latency", axis, str(dtype), scope),
                                         [[0.0] * len(ins) for _ in outs])[p][q] = share
            parts = memo[key_of] = {key: np.array(matrix) for key, matrix in parts.items()}
        for key, matrix in parts.items():
            if key not in graph.pools:
                axes = [(a,) for a in (0, 1) if mesh.shape[a] > 1]
                if key[0] == "groups":
                    graph.pools[key] = Pool(min(mesh.collective_cost("reduce-scatter", bucket_bytes, a) for a in axes))
                elif key[0] == "group latency":
                    graph.pools[key] = Pool(0.0, weight=0.0, latency=_group_latency(mesh, key[1]), grouped=True)
                else:  # a reduce-scatter's latency is ZeRO-2's fixed charge
                    latency = mesh.collective_cost("all-reduce", 0, key[2]) if key[1] == "all-reduce" else 0.0
                    graph.pools[key] = Pool(mesh.bucketed_cost(key[1], bucket_bytes, key[2], bucket_bytes),
                                            latency=latency)
            if key[0] == "group latency":  # every use's share, the one used first's too
                sums.add(graph.pools[key], u, v, matrix, True)
            elif hides or graph.pools[key].latency:
                sums.add(graph.pools[key], u, v, matrix, hides)
