"""The intra-operator pass (Alpa, OSDI'22, section 4): strategies -> constraints -> cost graph ->
ILP -> ``Plan``, for a captured graph on one logical mesh."""
from __future__ import annotations

import math
import time
import warnings

from ..core.aten import stats_written, written_args
from ..core.capture import CapturedGraph
from ..core.mesh import LogicalMesh
from ..core.options import PlanOptions
from ..core.plan import Plan
from .clustering import cluster_layers
from .constraints import apply_constraints, zero_stage_blockers
from .cost_graph import build_cost_graph
from .ilp import SolverError, solve, solver_limits
from .loss_reduction import loss_reduction
from .plan_cache import solve_cached
from .strategies import BACKWARD_FLOPS_FACTOR, build_strategies
from .training_step import node_plan, param_specs_of, training_step
from .zero import add_zero_strategies, zero_stages


def recomputable(cg: CapturedGraph, nodes) -> bool:
    """Whether a layer of ``nodes`` may be recomputed: none writes in place (recomputing would
    write twice), running statistics included (``stats_written``)."""
    return not any(n in cg.param_mutations or written_args(cg.node(n).target) or stats_written(cg.node(n))
                   for n in nodes)


def remat_candidates(cg: CapturedGraph) -> list[tuple[str, ...]]:
    """The layers of the layer clustering (``clustering.cluster_layers``) that may be recomputed
    (``recomputable``)."""
    return [layer.nodes for layer in cluster_layers(cg) if recomputable(cg, layer.nodes)]


def strategy_table(cg: CapturedGraph, mesh: LogicalMesh, options: PlanOptions, warn=None) -> dict:
    """Per node, the strategies the intra-op ILP chooses among: ``build_strategies`` (``warn``:
    called once per op without a sharding rule), with the ZeRO-1/2 variants of the parameters
    (``zero.add_zero_strategies``), restricted as ``options`` ask (``constraints.apply_constraints``).

    Raises:
        ValueError: a forced spec does not divide its tensor or names nothing in the model.
    """
    table = build_strategies(cg, mesh, warn=warn)
    add_zero_strategies(cg, table, mesh, options.bucket_bytes)
    apply_constraints(cg, table, mesh, options)
    return table


def plan_intra_op(cg: CapturedGraph, mesh: LogicalMesh, options: PlanOptions, progress=None, cache=None) -> Plan:
    """Find the sharding plan of ``cg`` on ``mesh`` that minimizes the predicted step time.

    Args:
        cg: the captured training loss (global shapes).
        mesh: the logical mesh (``LogicalMesh``), real or only described.
        options: the planning options (``PlanOptions``), recorded in the plan.
        progress: ``progress(stage: str)`` called as planning advances.
        cache: a ``plan_cache.PlanCache``: the ILP's answer for this very cost graph is read from
            it or added to it (``stats["disk_hits"]``: 1 when read).

    Returns:
        the ``Plan`` (its ``captured`` is ``cg``).

    Raises:
        ValueError: a forced spec does not divide its tensor or names nothing in the model.
        MemoryBudgetError: nothing fits the budget (the message gives the minimum needed).
    """
    say = progress or (lambda stage: None)
    stats = {}
    t1 = time.perf_counter()
    say("strategies")
    table = strategy_table(cg, mesh, options, warn=lambda msg: warnings.warn(msg, stacklevel=5))
    reduction = loss_reduction(cg, table)  # recorded for the runtime (it reads the batch dims only)
    layers = remat_candidates(cg) if options.remat else []
    graph, where = build_cost_graph(cg, table, mesh, share_layers=options.share_layers, remat=layers,
                                    remat_forced=options.remat == "all", options=options)
    stats["strategy_s"] = time.perf_counter() - t1
    stats["nodes"] = len(table)
    stats["ilp_variables"] = len(graph.costs)
    stats["ilp_edges"] = len(graph.edges)
    stats["ilp_strategy_vars"] = sum(len(c) for c in graph.costs if len(c) > 1)
    stats["ilp_edge_vars"] = sum(len(m) * len(m[0]) for m in graph.edges.values())
    stats["ilp_moves"] = len(graph.moves)
    t2 = time.perf_counter()
    say("ilp")
    budget = mesh.memory_bytes if options.memory_budget is None else options.memory_budget
    try:
        sol, hit = solve_cached(cache, graph, budget, solve, time_limit=options.time_limit, solver=options.solver,
                                switches=tuple(options.restrictions()), node_limit=options.node_limit)
    except SolverError as e:
        blockers = zero_stage_blockers(cg, table, mesh, options)
        if not blockers:
            raise
        raise SolverError(f"zero_stage={options.zero_stage} has no plan: {'; '.join(blockers)}. ZeRO-1/2 needs "
                          "each use of a parameter to take its gradient partial over the data-parallel axes: use "
                          f"zero_stage=3 or leave zero_stage out ({e})") from e
    stats["disk_hits"] = int(hit)
    stats["ilp_s"] = time.perf_counter() - t2
    stats["ilp_objective"] = sol.objective
    stats["ilp_hidden"] = graph.hidden(sol.choice)  # what the objective subtracts for overlap, seconds
    chosen = {name: table[name].strategies[w.index[sol.choice[w.var]]] for name, w in where.items()}
    remat = [list(layer) for layer, r in zip(layers, sol.remat) if r]
    nodes, grad_sync, collectives = training_step(cg, {name: node_plan(s, table[name]) for name, s in chosen.items()},
                                                  mesh, options.bucket_bytes,
                                                  options.gradient_reduce_dtype, remat)
    recomputed = {n for layer in remat for n in layer}
    result = Plan(mesh=mesh, param_specs=param_specs_of(cg, nodes),
                  input_specs={n: nodes[n].out_specs[0] for n in cg.input_names}, nodes=nodes,
                  collectives=collectives,
                  compute_seconds=sum(s.compute * (1 + (n in recomputed) / (1 + BACKWARD_FLOPS_FACTOR))
                                      for n, s in chosen.items()),  # + recomputed forwards
                  comm_seconds=sum(c.seconds for c in collectives), memory_bytes=sol.memory,
                  fingerprint=cg.fingerprint(), options=options.to_dict() | {"memory_budget": budget if math.isfinite(budget) else None},
                  stats=stats, grad_sync=grad_sync, bucket_bytes=options.bucket_bytes,
                  loss_reduction=reduction,
                  zero_stages=zero_stages(cg, nodes), captured=cg,
                  remat=remat,
                  solver_limits=solver_limits("intra-op", sol),
                  update_seconds=sum(s.compute for n, s in chosen.items() if n in cg.param_fqns))
    stats["total_s"] = time.perf_counter() - t1
    return result
