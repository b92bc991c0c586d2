"""``plan()``: capture -> strategies -> cost graph -> ILP -> ``Plan``.

Building the cost graph shrinks the ILP two ways (DESIGN.md, "Shrink it"):
- a *follower* (view, transpose, unary elementwise, getitem) joins its operand's variable when
  every operand strategy has a matching follower strategy (Alpa's merged nodes);
- nodes at the same place in identical repeated blocks (``h.0.attn`` ... ``h.31.attn``, same
  shapes and strategies, at least ``MIN_SHARED_LAYER_NODES`` nodes per block) share one
  variable, so every block gets the same solution.
Both restrict the search space, never the accounting: each node's costs and each edge's
resharding matrix still enter the objective and the memory sum once per node.
"""
from __future__ import annotations

import math
import re
import time
import warnings
from dataclasses import dataclass, replace

import torch

from .capture import CapturedGraph, capture
from .ilp import CostGraph, solve
from .mesh import LogicalMesh
from .plan import Collective, NodePlan, Plan
from .resharding import backward_steps, forward_steps, is_gradient_sync, reshard_costs, step_cost
from .spec import ShardingSpec
from .strategies import NodeStrategies, Strategy, build_strategies


@dataclass
class _Var:
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
                     nodes: set[str] | None = None) -> tuple[CostGraph, dict[str, _Var]]:
    """The ILP's cost graph and, per node, its variable and strategy mapping.

    ``nodes`` restricts the graph to those nodes (a pipeline stage): an operand produced outside
    them arrives free, in whatever spec its consumer wants (the stage DP costs its transfer).
    """
    if nodes is not None:
        table = {k: v for k, v in table.items() if k in nodes}
    graph = CostGraph(costs=[], memory=[])
    where: dict[str, _Var] = {}
    shared: dict[tuple, tuple[int, tuple]] = {}
    counters: dict = {}
    sizes: dict = {}
    for node in cg.graph.nodes:
        layer = _layer_of(node) if node.name in table else None
        if layer is not None:
            sizes[layer[:2]] = sizes.get(layer[:2], 0) + 1
    reshard = reshard_costs(mesh)

    def new_var(name, ns):
        graph.costs.append([0.0] * len(ns.strategies))
        graph.memory.append([0.0] * len(ns.strategies))
        graph.names.append(name)
        return _Var(len(graph.costs) - 1, list(range(len(ns.strategies))))

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
                placed = _Var(src.var, index)
        if placed is None and share_layers:
            key = _layer_key(node, counters, sizes)
            if key is not None:
                sig = _strategy_signature(ns)
                if key in shared and shared[key][1] == sig:
                    placed = _Var(shared[key][0], list(range(len(ns.strategies))))
                elif key not in shared:
                    placed = new_var(node.name, ns)
                    shared[key] = (placed.var, sig)
        if placed is None:
            placed = new_var(node.name, ns)
        where[node.name] = placed
        for p, q in enumerate(placed.index):
            graph.costs[placed.var][p] += ns.strategies[q].cost
            graph.memory[placed.var][p] += ns.strategies[q].memory
        for i, (src_name, r) in enumerate(zip(ns.inputs, ns.input_results)):
            if src_name not in where:  # produced outside ``nodes``
                continue
            src, src_ns = where[src_name], table[src_name]
            val = cg.node(src_name).meta["val"]
            val = val[r] if isinstance(val, (tuple, list)) else val
            shape, itemsize = tuple(val.shape), val.element_size()
            outs = tuple(src_ns.strategies[p].out_specs[r] for p in src.index)
            ins = tuple((ns.strategies[q].in_specs[i], ns.strategies[q].grad_partial[i]) for q in placed.index)
            graph.add_edge(src.var, placed.var, reshard.matrix(outs, ins, shape, itemsize, src_name in cg.param_fqns))
    return graph, where


def defer_gradient_sync(cg: CapturedGraph, nodes: dict[str, NodePlan]
                        ) -> tuple[dict[str, NodePlan], dict[str, tuple[int, ...]]]:
    """Move data-parallel gradient all-reduces out of the graph: a parameter whose every use is a
    gradient sync over the same axes (``is_gradient_sync``) gets its gradient reduced once, in a
    bucket, after backward (after the last microbatch of a pipeline).

    ``nodes`` are the strategies as chosen, every gradient sync still on its edge (an ILP's
    ``_node_plan``s, or the union of a chained stage's per-layer solutions); they are not edited.
    Deciding on the whole program at once is what makes it right: a parameter used by two layers
    is deferred only if both uses are syncs over the same axes.

    Returns:
        ``(nodes with those uses' grad_partial emptied, parameter placeholder -> axes)``.
    """
    uses: dict[str, list[tuple[str, int]]] = {ph: [] for ph in cg.param_fqns}
    for name, np_ in nodes.items():
        for i, src in enumerate(np_.inputs):
            if src in uses:
                uses[src].append((name, i))
    out, deferred = dict(nodes), {}
    for ph, edges in uses.items():
        spec = nodes[ph].out_specs[0]
        parts = {nodes[n].grad_partial[i] for n, i in edges}
        if len(parts) != 1 or not all(
                is_gradient_sync(ShardingSpec.parse(spec), ShardingSpec.parse(nodes[n].in_specs[i]), nodes[n].grad_partial[i])
                for n, i in edges):
            continue
        deferred[ph] = tuple(sorted(parts.pop()))
        for n, i in edges:
            gp = list(out[n].grad_partial)
            gp[i] = ()
            out[n] = replace(out[n], grad_partial=tuple(gp))
    return out, deferred


def training_step(cg: CapturedGraph, nodes: dict[str, NodePlan], mesh: LogicalMesh, bucket_bytes: float = 25 * 2**20
                  ) -> tuple[dict[str, NodePlan], dict[str, tuple[int, ...]], list[Collective]]:
    """What a ``Plan`` (an SPMD plan or one pipeline stage's) stores for the chosen strategies
    ``nodes`` (gradient syncs on their edges): ``(nodes, grad_sync, collectives)`` with the
    data-parallel gradient syncs deferred to buckets (``defer_gradient_sync``) and every
    collective of one training step (``plan_collectives``). The one place both plan kinds derive
    their gradient synchronization."""
    nodes, grad_sync = defer_gradient_sync(cg, nodes)
    return nodes, grad_sync, plan_collectives(cg, nodes, mesh, grad_sync, bucket_bytes)


def gradient_buckets(cg: CapturedGraph, nodes: dict[str, NodePlan], grad_sync: dict[str, tuple[int, ...]],
                     mesh_shape, bucket_bytes: float) -> list[tuple[tuple[int, ...], list[str]]]:
    """Buckets of deferred gradients: ``(axes, [parameter placeholders])`` in graph order, each at
    most ``bucket_bytes`` of local gradient (a larger single gradient is its own bucket)."""
    buckets: list[tuple[tuple[int, ...], list[str]]] = []
    for axes in sorted(set(grad_sync.values())):
        size = math.inf
        for ph in (p for p in cg.param_fqns if grad_sync.get(p) == axes):
            nbytes = _local_bytes(cg.node(ph).meta["val"], nodes[ph].out_specs[0], mesh_shape)
            if size + nbytes > bucket_bytes:
                buckets.append((axes, []))
                size = 0
            buckets[-1][1].append(ph)
            size += nbytes
    return buckets


def _local_bytes(val, spec: str, mesh_shape) -> int:
    return val.element_size() * math.prod(ShardingSpec.parse(spec).local_shape(tuple(val.shape), mesh_shape))


def plan_collectives(cg: CapturedGraph, nodes: dict[str, NodePlan], mesh: LogicalMesh,
                     grad_sync: dict[str, tuple[int, ...]] | None = None,
                     bucket_bytes: float = 25 * 2**20) -> list[Collective]:
    """Every collective of one training step for the chosen strategies: partial-sum all-reduces
    inside ops, the resharding of every edge (forward, then backward in reverse), then the
    bucketed gradient all-reduces."""
    forward, backward = [], []
    for name, np_ in nodes.items():
        node = cg.node(name)
        for i, (src_name, r) in enumerate(zip(np_.inputs, np_.input_results)):
            val = cg.node(src_name).meta["val"]
            val = val[r] if isinstance(val, (tuple, list)) else val
            src = ShardingSpec.parse(nodes[src_name].out_specs[r])
            dst = ShardingSpec.parse(np_.in_specs[i])
            args = (tuple(val.shape), val.element_size(), mesh.shape)
            gp = np_.grad_partial[i]
            for phase, steps, out in (("forward", forward_steps(src, dst, *args), forward),
                                      ("backward", [] if gp is None else backward_steps(src, dst, gp, *args), backward)):
                out.extend(Collective(s.kind, (s.axis,), s.nbytes, phase, name, src_name, step_cost(s, mesh))
                           for s in steps if s.is_collective)
        if np_.partial_axes:
            vals = node.meta["val"] if isinstance(node.meta["val"], (tuple, list)) else [node.meta["val"]]
            for spec, val in zip(np_.out_specs, vals):
                local = _local_bytes(val, spec, mesh.shape)
                for axis in np_.partial_axes:
                    forward.append(Collective("all-reduce", (axis,), float(local), "forward", name, name,
                                              mesh.all_reduce_cost(local, (axis,))))
    buckets = []
    for k, (axes, members) in enumerate(gradient_buckets(cg, nodes, grad_sync or {}, mesh.shape, bucket_bytes)):
        nbytes = float(sum(_local_bytes(cg.node(ph).meta["val"], nodes[ph].out_specs[0], mesh.shape) for ph in members))
        buckets.append(Collective("all-reduce", axes, nbytes, "backward", f"gradient bucket {k}",
                                  f"{len(members)} parameters", mesh.all_reduce_cost(nbytes, axes)))
    return forward + backward[::-1] + buckets


def _restrict(ns: NodeStrategies, keep) -> None:
    kept = [s for s in ns.strategies if keep(s)]
    if not kept:
        raise ValueError(f"the forced specs leave no strategy for {ns.node}")
    ns.strategies[:] = kept


def plan(model: torch.nn.Module, example_inputs, mesh: LogicalMesh, loss_fn=None, *, targets: tuple = (),
         memory_budget: float | None = None, force_data_parallel: bool = False, batch_axis: int | None = None,
         param_specs: dict[str, str] | None = None, input_specs: dict[str, str] | None = None,
         share_layers: bool = True, time_limit: float = 60.0, solver: str = "cbc", bucket_bytes: float = 25 * 2**20,
         progress=None, pipeline: str | int | None = None, num_stages: int | None = None, schedule: str = "1f1b",
         num_microbatches: int | None = None, num_layers: int | None = None,
         example_kwargs: dict | None = None) -> Plan:
    """Find the intra-operator sharding plan that minimizes the predicted training-step time.

    With ``pipeline="auto"`` (or a stage count ``K``, or ``num_stages=K``) the plan is pipelined
    instead: stages on submeshes of the cluster ``mesh`` (N nodes x M devices), each with its own
    intra-op plan (``stages.plan_pipeline``; Alpa, section 5); ``memory_budget``,
    ``progress``, ``time_limit``, ``param_specs``, ``batch_axis`` and ``force_data_parallel``
    apply to every stage, ``schedule`` is ``"1f1b"`` or ``"gpipe"``, ``num_microbatches`` B
    (None: chosen), ``num_layers`` L for the layer clustering (None: chosen).

    Args:
        model: the module (parameters may be on the meta device).
        example_inputs: model inputs with GLOBAL shapes: a tensor, a tuple of them, or nested
            tuples / lists / dicts (flattened as ``torch.export`` flattens them).
        mesh: the logical mesh (``LogicalMesh``), real or only described.
        loss_fn: ``loss_fn(output, *targets) -> scalar``; None when the model returns its loss.
        targets: tensors passed to ``loss_fn`` after the output.
        memory_budget: bytes per device (default: ``mesh.memory_bytes``).
        force_data_parallel: every parameter replicated, inputs split by batch over the mesh.
        batch_axis: force the inputs' batch dim (dim 0) to be split along this mesh axis (0 or 1);
            on an axis of size 1 nothing is split along it, so it forces nothing.
        param_specs: FQN -> spec string to force (e.g. Megatron's ``{"fc1.weight": "S1R"}``).
        input_specs: user-input placeholder name (or position ``"0"``, ``"1"``...) -> spec string.
        share_layers: identical repeated layers share one solution (smaller ILP).
        time_limit: ILP solver seconds.
        bucket_bytes: the largest bucket of data-parallel gradients all-reduced together, bytes.
        progress: callable ``progress(stage: str)`` called as planning advances.
        example_kwargs: keyword inputs of the model (``input_ids=``, ``labels=`` ...).

    Returns:
        the ``Plan``.

    Raises:
        CaptureError: the model could not be captured.
        ValueError: an option is out of range or does not apply (a forced spec that does not
            divide its tensor or names no parameter, an input spec for no input, a batch axis
            other than 0 or 1, an option a pipelined plan does not take ...).
        MemoryBudgetError: nothing fits the budget (the message gives the minimum needed).
    """
    pipelined = pipeline is not None or num_stages is not None
    _check_options(mesh, pipelined, memory_budget=memory_budget, batch_axis=batch_axis, time_limit=time_limit,
                   solver=solver, bucket_bytes=bucket_bytes, input_specs=input_specs, share_layers=share_layers,
                   schedule=schedule, num_microbatches=num_microbatches, num_layers=num_layers)
    if pipelined:
        from .stages import plan_pipeline
        if pipeline not in (None, "auto") and num_stages is None:
            if not str(pipeline).isdigit():
                raise ValueError(f"pipeline must be 'auto' or a number of stages, got {pipeline!r}")
            num_stages = int(pipeline)
        constraints = {"param_specs": param_specs, "batch_axis": "all" if force_data_parallel else batch_axis,
                       "replicate_params": force_data_parallel}
        return plan_pipeline(model, example_inputs, mesh, loss_fn, targets=targets, num_stages=num_stages,
                             schedule=schedule, num_microbatches=num_microbatches, num_layers=num_layers,
                             memory_budget=memory_budget, progress=progress, time_limit=time_limit,
                             example_kwargs=example_kwargs, constraints={k: v for k, v in constraints.items() if v is not None and v is not False})
    say = progress or (lambda stage: None)
    stats = {}
    t0 = time.perf_counter()
    say("capture")
    cg = capture(model, example_inputs, loss_fn, targets, example_kwargs)
    stats["capture_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    say("strategies")
    table = build_strategies(cg, mesh, warn=lambda msg: warnings.warn(msg, stacklevel=3))
    _apply_constraints(cg, table, mesh, force_data_parallel, batch_axis, param_specs or {}, input_specs or {})
    graph, where = build_cost_graph(cg, table, mesh, share_layers=share_layers)
    stats["strategy_s"] = time.perf_counter() - t1
    stats["nodes"] = len(table)
    stats["ilp_variables"] = len(graph.costs)
    stats["ilp_edges"] = len(graph.edges)
    stats["ilp_strategy_vars"] = sum(len(c) for c in graph.costs if len(c) > 1)
    stats["ilp_edge_vars"] = sum(len(m) * len(m[0]) for m in graph.edges.values())
    t2 = time.perf_counter()
    say("ilp")
    budget = mesh.memory_bytes if memory_budget is None else memory_budget
    sol = solve(graph, budget, time_limit=time_limit, solver=solver)
    stats["ilp_s"] = time.perf_counter() - t2
    chosen = {name: table[name].strategies[w.index[sol.choice[w.var]]] for name, w in where.items()}
    nodes, grad_sync, collectives = training_step(cg, {name: _node_plan(s, table[name]) for name, s in chosen.items()},
                                                  mesh, bucket_bytes)
    compute = sum(s.compute for s in chosen.values())
    options = {"memory_budget": budget if math.isfinite(budget) else None, "force_data_parallel": force_data_parallel,
               "batch_axis": batch_axis, "share_layers": share_layers}
    result = Plan(mesh=mesh, param_specs=param_specs_of(cg, nodes), input_specs={n: nodes[n].out_specs[0] for n in cg.input_names},
                  nodes=nodes, collectives=collectives, compute_seconds=compute,
                  comm_seconds=sum(c.seconds for c in collectives), memory_bytes=sol.memory,
                  fingerprint=cg.fingerprint(), options=options, stats=stats, grad_sync=grad_sync,
                  bucket_bytes=bucket_bytes)
    stats["total_s"] = time.perf_counter() - t0
    result.captured = cg  # for the runtime and for explanations; not serialized
    return result


def param_specs_of(cg: CapturedGraph, nodes: dict[str, NodePlan]) -> dict[str, str]:
    """Parameter FQN (every name of a tied weight) -> its storage spec string."""
    specs = {}
    for ph, fqn in cg.param_fqns.items():
        for name in [fqn, *cg.tied.get(fqn, [])]:
            specs[name] = nodes[ph].out_specs[0]
    return specs


def _node_plan(s: Strategy, ns: NodeStrategies) -> NodePlan:
    return NodePlan(s.name, tuple(map(str, s.in_specs)), tuple(map(str, s.out_specs)), s.partial_axes, s.reduce,
                    s.grad_partial, tuple(ns.inputs), tuple(ns.input_results))


_SPMD_ONLY = {"input_specs": None, "solver": "cbc", "bucket_bytes": 25 * 2**20, "share_layers": True}
_PIPELINE_ONLY = {"schedule": "1f1b", "num_microbatches": None, "num_layers": None}


def _check_options(mesh: LogicalMesh, pipelined: bool, **options) -> None:
    """Every ``plan`` option that can be checked before capture, once (``plan``'s Raises)."""
    if options["batch_axis"] not in (None, 0, 1):
        raise ValueError(f"batch_axis must be 0 or 1 (a mesh axis), got {options['batch_axis']!r}")
    for name in ("memory_budget", "time_limit", "bucket_bytes"):
        value = options[name]
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    if options["solver"] not in ("cbc", "highs", "auto"):
        raise ValueError(f"solver must be 'cbc', 'highs' or 'auto', got {options['solver']!r}")
    for key in options["input_specs"] or {}:
        if not isinstance(key, str):
            raise ValueError(f"input_specs keys are input names or positions as strings ('0'), got {key!r}")
    given = [k for k, default in (_SPMD_ONLY if pipelined else _PIPELINE_ONLY).items() if options[k] not in (default, {})]
    if given and pipelined:
        raise ValueError(f"a pipelined plan does not take {', '.join(given)} (each stage is planned with the "
                         "defaults); drop them or plan without pipeline= / num_stages=")
    if given:
        raise ValueError(f"{', '.join(given)} apply to pipelined plans only; add pipeline='auto' (or num_stages=K)")


def _apply_constraints(cg, table, mesh, force_dp, batch_axis, param_specs, input_specs) -> None:
    by_fqn = {fqn: ph for ph, fqn in {**cg.param_fqns, **cg.buffer_fqns}.items()}
    for ph, fqn in {**cg.param_fqns, **cg.buffer_fqns}.items():
        for alias in cg.tied.get(fqn, []):
            by_fqn[alias] = ph
    for fqn, text in param_specs.items():
        if fqn not in by_fqn:
            raise ValueError(f"param_specs names {fqn!r}, which is not a parameter (or buffer) of the model")
        _force(table[by_fqn[fqn]], ShardingSpec.parse(text), f"parameter {fqn}", cg, mesh)
    for key, text in input_specs.items():
        if key.isdigit() and int(key) >= len(cg.input_names):
            raise ValueError(f"input_specs names input {key}; the model takes {len(cg.input_names)} tensors "
                             f"({', '.join(cg.input_names)})")
        name = cg.input_names[int(key)] if key.isdigit() else key
        if name not in cg.input_names:
            raise ValueError(f"input_specs names {key!r}, which is not an input of the model "
                             f"({', '.join(cg.input_names)})")
        _force(table[name], ShardingSpec.parse(text), f"input {name}", cg, mesh)
    if force_dp:  # parameters replicated, except those given a storage spec (ZeRO-style data parallel)
        forced = {by_fqn[fqn] for fqn in param_specs}
        for ph in cg.param_fqns:
            if ph not in forced:
                _restrict(table[ph], lambda s: not s.out_spec.axes())
    if batch_axis is not None and mesh.shape[batch_axis] == 1:
        batch_axis = None  # nothing is split along an axis of one device
    if force_dp or batch_axis is not None:
        want = tuple(a for a in (0, 1) if mesh.shape[a] > 1) if force_dp else (batch_axis,)
        keep = (lambda entry: entry == want) if force_dp else (lambda entry: batch_axis in entry)
        for name, ns in table.items():
            d = ns.batch_dims[0]
            if d is None or name in cg.param_fqns:
                continue
            ok = [s for s in ns.strategies if keep(s.out_spec.dims[d])]
            if ok:
                ns.strategies[:] = ok
            elif name in cg.input_names:
                shape = tuple(cg.node(name).meta["val"].shape)
                raise ValueError(f"batch dim of input {name} (shape {shape}) does not divide over mesh axes "
                                 f"{list(want)} of mesh {mesh.shape}")


def _force(ns: NodeStrategies, spec: ShardingSpec, what: str, cg, mesh) -> None:
    shape = tuple(cg.node(ns.node).meta["val"].shape)
    if spec.ndim != len(shape) or not spec.divides(shape, mesh.shape):
        raise ValueError(f"spec {spec} for {what} does not divide its shape {shape} on mesh {mesh.shape}")
    _restrict(ns, lambda s: s.out_spec == spec)
