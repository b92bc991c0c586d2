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
from ..core.resharding import reshard_costs
from ..core.spec import ShardingSpec
from .ilp import CostGraph, RematGroup
from .strategies import BACKWARD_FLOPS_FACTOR, NodeStrategies


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
    return tuple((s.name, s.in_specs, s.out_specs, s.grad_partial, round(s.cost, 15), round(s.memory, 3))
                 for s in ns.strategies)


def build_cost_graph(cg: CapturedGraph, table: dict[str, NodeStrategies], mesh: LogicalMesh,
                     share_layers: bool = True, merge_followers: bool = True,
                     nodes: set[str] | None = None, remat: list[tuple[str, ...]] = (),
                     remat_forced: bool = False) -> tuple[CostGraph, dict[str, Var]]:
    """The ILP's cost graph and, per node, its variable and strategy mapping.

    ``nodes`` restricts the graph to those nodes (a pipeline stage): an operand produced outside
    them arrives free, in whatever spec its consumer wants (the stage DP costs its transfer).
    ``remat``: layers (node names) that may be recomputed, each a ``RematGroup`` (forced with
    ``remat_forced``): the activations only the layer reads move from ``memory`` to the group,
    and recomputing costs each node's forward (a third of its compute) and forward collectives.
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
    layer_of = {n: i for i, layer in enumerate(remat) for n in layer}
    graph.remat = [RematGroup(forced=remat_forced) for _ in remat]
    reshard = reshard_costs(mesh)
    casts = cg.param_casts  # a parameter's low-precision copy: its gradient sync is bucketed too

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
        group = graph.remat[layer_of[node.name]] if node.name in layer_of else None
        internal = group is not None and all(layer_of.get(u.name) == layer_of[node.name] for u in node.users)
        width = len(graph.costs[placed.var])
        for p, q in enumerate(placed.index):
            st = ns.strategies[q]
            graph.costs[placed.var][p] += st.cost
            (group.act.setdefault(placed.var, [0.0] * width) if internal else graph.memory[placed.var])[p] += st.memory
            if group is not None:
                group.extra.setdefault(placed.var, [0.0] * width)[p] += st.compute / (1 + BACKWARD_FLOPS_FACTOR) + st.comm
        for i, (src_name, r) in enumerate(zip(ns.inputs, ns.input_results)):
            if src_name not in where:  # produced outside ``nodes``
                continue
            src, src_ns = where[src_name], table[src_name]
            val = cg.node(src_name).meta["val"]
            val = val[r] if isinstance(val, (tuple, list)) else val
            shape, itemsize = tuple(val.shape), val.element_size()
            outs = tuple(src_ns.strategies[p].out_specs[r] for p in src.index)
            ins = tuple((ns.strategies[q].in_specs[i], ns.strategies[q].grad_partial[i]) for q in placed.index)
            graph.add_edge(src.var, placed.var, reshard.matrix(outs, ins, shape, itemsize,
                                                                  src_name in cg.param_fqns or src_name in casts))
    return graph, where
