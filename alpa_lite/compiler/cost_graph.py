"""The intra-op ILP's cost graph: one variable per node (or per group of nodes), edges priced
by resharding (Alpa, OSDI'22, section 4.2).

Building the cost graph shrinks the ILP two ways (docs/planner.md, "The ILP ... and its size"):
- a *follower* (view, transpose, unary elementwise, getitem) joins its operand's variable when
  every operand strategy has a matching follower strategy (Alpa's merged nodes);
- nodes at the same place in identical repeated blocks (``h.0.attn`` ... ``h.31.attn``, same
  shapes and strategies, at least ``MIN_SHARED_LAYER_NODES`` nodes per block) share one
  variable, so every block gets the same solution.
Both restrict the search space, never the accounting: each node's costs and each edge's
resharding matrix still enter the objective and the memory sum once per node.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..core.capture import CapturedGraph
from ..core.mesh import LogicalMesh
from ..core.options import PlanOptions
from ..core.resharding import reshard_costs
from ..core.spec import ShardingSpec
from .ilp import CostGraph
from .strategies import NodeStrategies


@dataclass
class Var:
    """Where a node's strategy comes from: ILP variable ``var``, and per variable strategy
    index the node's own strategy index."""

    var: int
    index: list[int]


_LAYER = re.compile(r"^(.*?)\.(\d+)(\..*)?$")
MIN_SHARED_LAYER_NODES = 8  # a repeated "layer" smaller than this (one Linear) is not a block


def _layer_of(node: torch.fx.Node):
    if node.op == "placeholder":  # a parameter belongs to the layer of its first consumer
        node = next(iter(node.users), None)
        if node is None:
            return None
    stack = node.meta.get("nn_module_stack")
    m = _LAYER.match(list(stack.values())[-1][0]) if stack else None
    return (m.group(1), m.group(2), m.group(3) or "") if m else None


def _layer_key(node: torch.fx.Node, counters: dict, sizes: dict) -> tuple | None:
    layer = _layer_of(node)
    if layer is None or sizes[layer[:2]] < MIN_SHARED_LAYER_NODES:
        return None
    prefix, index, rest = layer
    kind = "placeholder" if node.op == "placeholder" else str(node.target)
    slot = (prefix, index, rest, kind)
    counters[slot] = counters.get(slot, -1) + 1
    return prefix, rest, kind, counters[slot]


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
                     nodes: set[str] | None = None,
                     options: PlanOptions | None = None) -> tuple[CostGraph, dict[str, Var]]:
    """The ILP's cost graph and, per node, its variable and strategy mapping.

    ``nodes`` restricts the graph to those nodes (a pipeline stage): an operand produced outside
    them arrives free, in whatever spec its consumer wants (the stage DP costs its transfer).
    ``options``: its switches forbid moves (``resharding.ReshardCosts``).
    """
    if nodes is not None:
        table = {k: v for k, v in table.items() if k in nodes}
    graph = CostGraph(costs=[], memory=[])
    where: dict[str, Var] = {}
    shared: dict[tuple, tuple[int, tuple]] = {}
    counters: dict = {}
    sizes: dict = {}
    for node in cg.graph.nodes:
        layer = _layer_of(node) if node.name in table else None
        if layer is not None:
            sizes[layer[:2]] = sizes.get(layer[:2], 0) + 1
    reshard = reshard_costs(mesh, options)
    prefer_rs = options is not None and options.prefer_reduce_scatter

    def new_var(name, ns):
        graph.costs.append([0.0] * len(ns.strategies))
        graph.memory.append([0.0] * len(ns.strategies))
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
        if placed is None and share_layers:
            key = _layer_key(node, counters, sizes)
            if key is not None:
                sig = _strategy_signature(ns)
                if key in shared and shared[key][1] == sig:
                    placed = Var(shared[key][0], list(range(len(ns.strategies))))
                elif key not in shared:
                    placed = new_var(node.name, ns)
                    shared[key] = (placed.var, sig)
        if placed is None:
            placed = new_var(node.name, ns)
        where[node.name] = placed
        for p, q in enumerate(placed.index):
            s = ns.strategies[q]
            graph.costs[placed.var][p] += s.cost
            graph.memory[placed.var][p] += s.memory
            # a ZeRO-1/2 parameter joins a bucketed all-gather (and reduce-scatter): its latency, once
            for kind in ("all-gather", "reduce-scatter")[:s.zero_stage]:
                graph.add_fixed((kind, s.zero_axes), mesh.collective_cost(kind, 0, s.zero_axes), (placed.var, p))
        for i, (src_name, r) in enumerate(zip(ns.inputs, ns.input_results)):
            if src_name not in where:  # produced outside ``nodes``
                continue
            src, src_ns = where[src_name], table[src_name]
            val = cg.node(src_name).meta["val"]
            val = val[r] if isinstance(val, (tuple, list)) else val
            shape, itemsize = tuple(val.shape), val.element_size()
            outs = tuple(src_ns.strategies[p].out_specs[r] for p in src.index)
            zeros = tuple((src_ns.strategies[p].zero_stage, src_ns.strategies[p].zero_axes) for p in src.index)
            ins = tuple((ns.strategies[q].in_specs[i], ns.strategies[q].grad_partial[i]) for q in placed.index)
            reduced = tuple(_reduced_in_op(src_ns, p, r) for p in src.index) if prefer_rs else None
            graph.add_edge(src.var, placed.var,
                           reshard.matrix(outs, ins, shape, itemsize, src_name in cg.param_fqns, zeros, reduced))
    return graph, where
