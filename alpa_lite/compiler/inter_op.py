"""The inter-operator pass (Zheng et al., "Alpa", OSDI'22, section 5): stages, submeshes,
microbatches.

The captured forward graph is cut into ``L`` layers
(section 5.2), consecutive layers are grouped into ``S`` pipeline stages, each stage runs on a
submesh of the ``N x M`` cluster with its own intra-op plan (section 4, ``intra_op.py``), and a
training step pushes ``B`` microbatches through the stages (GPipe, 1F1B or ZB-H1,
``core/schedules.py``, run by ``runtime/pipeline.py``).

``plan_pipeline`` tries each microbatch count B, clusters the microbatch graph into layers
(``clustering.py``), prices every (layer range, submesh) with the stage ILPs
(``stage_costs.py``), runs the stage DP (``stage_dp.py``) under the schedule asked for (under each
of them for ``schedule="auto"``: the least predicted step time wins), places the chosen submeshes
on the cluster and re-solves each chosen stage into its own ``Plan``.
"""
from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from ..core.capture import CapturedGraph, stage_view
from ..core.mesh import LogicalMesh
from ..core.options import PipelineOptions, PlanOptions
from ..core.plan import PipelinePlan, Plan, StagePlan
from ..core.schedules import SCHEDULES, get_schedule, step_seconds
from .clustering import cluster_layers
from .constraints import check_names
from .ilp import solver_limits
from .loss_reduction import check_batch_indices, loss_reduction, whole_batch_problems
from .stage_costs import GraphStageCosts, layer_budget, send_gather_seconds, solve_stage
from .strategies import build_strategies
from .stage_dp import (CostFn, PipelinePlanError, StageChoice, StageOption, bubble_fraction, check_stage_count,
                       in_flight, stage_dp, submesh_shapes)
from .training_step import param_specs_of, training_step
from .zero import zero_stages


def place_submeshes(submeshes: Sequence[tuple[int, int]], cluster_shape: tuple[int, int]) -> list[list[int]]:
    """Device ranks (``node * M + column``) of each submesh, tiling the ``N x M`` cluster: whole-node
    submeshes take whole nodes, ``(1, m)`` ones pack into nodes first-fit by decreasing ``m``.

    Raises:
        PipelinePlanError: the shapes do not tile the cluster.
    """
    n, m = cluster_shape
    free = [m] * n
    ranks: list[list[int] | None] = [None] * len(submeshes)
    order = sorted(range(len(submeshes)), key=lambda i: (-(submeshes[i][0] > 1 or submeshes[i][1] == m),
                                                          -submeshes[i][0] * submeshes[i][1], i))
    for i in order:
        rows, cols = submeshes[i]
        if rows > 1 or cols == m:
            nodes = [j for j in range(n) if free[j] == m][:rows]
            if len(nodes) < rows:
                break
            for j in nodes:
                free[j] = 0
            ranks[i] = [j * m + c for j in nodes for c in range(cols)]
        else:
            node = next((j for j in range(n) if free[j] >= cols), None)
            if node is None:
                break
            start = m - free[node]
            free[node] -= cols
            ranks[i] = [node * m + c for c in range(start, start + cols)]
    if any(r is None for r in ranks):
        raise PipelinePlanError(f"submeshes {list(submeshes)} do not tile a {n}x{m} cluster")
    return ranks


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def plan_pipeline(capture_rows: Callable[[int], CapturedGraph], batch: int, mesh: LogicalMesh,
                  options: PlanOptions, pipeline: PipelineOptions, progress=None, cache=None,
                  capture_batch: Callable[[], CapturedGraph | None] | None = None) -> PipelinePlan:
    """Plan stages, submeshes, microbatches and every stage's intra-op plan (Alpa, section 5).

    Args:
        capture_rows: ``capture_rows(rows)`` -> the ``CapturedGraph`` of a microbatch of ``rows``
            samples (called once per microbatch count tried).
        batch: the global batch, samples.
        mesh: the cluster as a ``LogicalMesh`` of shape ``(N nodes, M devices per node)``; its
            calibrated figures reach every stage (``LogicalMesh.as_cluster``).
        options: the ``PlanOptions`` every stage's intra-op plan is made with.
        pipeline: the ``PipelineOptions`` (stages, schedule, microbatches, layers, pruning).
        progress: ``progress(message)`` as planning advances.
        cache: a ``plan_cache.PlanCache`` the stage ILP answers are read from and added to.
        capture_batch: ``capture_batch()`` -> the ``CapturedGraph`` of the whole batch, whose ops a
            microbatch's must repeat (``core.capture.batch_specialization``: a branch on the batch
            size is a problem for microbatches), or None where they are known to (export's graph
            for any batch size answered); default ``capture_rows(batch)``.

    Returns:
        the ``PipelinePlan``.

    Raises:
        PipelinePlanError: impossible stage counts (the message gives the limits), a batch that
            ``num_microbatches`` does not divide, or nothing fits memory.
        ValueError: an option names something the model does not have.
    """
    say = progress or (lambda message: None)
    t0 = time.perf_counter()
    if pipeline.num_microbatches is not None:
        if batch % pipeline.num_microbatches:
            raise PipelinePlanError(f"num_microbatches={pipeline.num_microbatches} must divide the batch of {batch}")
        candidates = [pipeline.num_microbatches]
    else:
        candidates = [b for b in pipeline.microbatch_candidates if batch % b == 0] or [1]
    cluster = mesh.as_cluster()
    devices = mesh.num_devices
    budget = mesh.memory_bytes if options.memory_budget is None else options.memory_budget
    workers = pipeline.workers
    if workers is None:  # ranks of a job plan at once: they fork no workers (nor copy live process groups)
        import torch.distributed as dist
        workers = 1 if dist.is_available() and dist.is_initialized() else _cpu_count()
    schedules = dp_schedules(pipeline.schedule)
    best = None
    tried = {}
    disk_hits = 0
    pricing_limits: list[dict] = []  # every B's: the choice among them was made on their figures
    refusals: dict[str, None] = {}  # every B's ``GraphStageCosts.refusals``
    for b in candidates:
        say(f"capture (microbatch {batch // b}, B={b})")
        cg = capture_rows(batch // b)
        check_names(cg, options)
        layers = cluster_layers(cg, pipeline.num_layers)
        # interleaved: up to ``chunks`` stages per device, each holding up to B microbatches
        chunked = pipeline.chunks if "interleaved" in schedules else 1
        check_stage_count(pipeline.num_stages, len(layers), devices * chunked)
        costs = GraphStageCosts(cg, layers, cluster, budget,
                                max_in_flight=b, options=options, num_microbatches=b, schedule=tuple(schedules),
                                mode=pipeline.stage_solve, cache=cache)
        shapes = submesh_shapes(mesh.shape, pipeline.power_of_two)
        cells = [(k, i, q) for k in range(len(layers)) for i in range(k + 1, len(layers) + 1) for q in shapes]
        # the DPs of GPipe, 1F1B and ZB-H1 (their objective is the step time) see the pairs that can
        # be a stage of a pipeline below the step time of a plan the search holds; the interleaved
        # DP (its recursion is a proxy of its step time) sees every pair it can place, unbounded
        linear = [s for s in schedules if s != "interleaved"]
        bound = best[0].objective if best else math.inf
        whole = (0, len(layers), mesh.shape)  # the one-stage pipeline bounds this B's search once priced:
        one_stage = bool(linear) and pipeline.num_stages in (None, 1) and mesh.shape in shapes
        if one_stage and math.isinf(bound):  # first when no plan is held, else with the other pairs
            say(f"stage costs on submesh {mesh.shape[0]}x{mesh.shape[1]} (the whole model, one stage)")
            costs.prefetch([whole], workers)  # its logical meshes in parallel
            bound = _one_stage_seconds(costs(*whole), b, budget, linear)
        floors = _pipeline_floors(costs, len(layers), shapes, devices, b, linear, pipeline.num_stages, budget)
        within, pruned = _within(costs, layers, floors, bound, devices, b, pipeline, "interleaved" in schedules)
        out = sum(not any(w.kept(*c) for w in within.values()) for c in cells)
        say(f"stage costs (B={b}, {len(layers)} layers, {len(shapes)} submesh shapes, {workers} workers, "
            f"{out} of {len(cells)} (range, submesh) pairs bounded out)")
        if out == len(cells) and math.isfinite(bound):  # no pipeline of this B beats the plan held: no ILP, no DP
            tried[b] = f"bounded out: no pipeline can step under the {bound:.6g} s of the plan held"
            continue
        # price the pairs kept, ``workers`` submeshes at a time, those holding the least floor first;
        # each time, the floors again with every priced pair's least option time for its bound (inf:
        # no option), until the stage DPs over the priced options and the others' bounds say that
        # no pipeline of this B can step under the plan held (``_beaten``)
        beaten = False
        while todo := [c for c in cells if any(w.kept(*c) for w in pruned.values()) and costs.priced(*c) is None]:
            if beaten := _beaten(costs, within, len(layers), mesh.shape, shapes, budget, b, bound, schedules,
                                 pipeline, cg):
                say(f"stage costs (B={b}): no pipeline of the priced pairs and the others' bounds steps under "
                    f"the {bound:.6g} s of the plan held; {len(todo)} pairs left unpriced")
                tried[b] = (f"bounded out: no pipeline of the priced pairs and the others' bounds steps under the "
                            f"{bound:.6g} s of the plan held")
                break
            order = sorted({c[2] for c in todo}, key=lambda q: (min(floors[c] for c in todo if c[2] == q), q))
            costs.prefetch([c for c in todo if c[2] in order[:workers]], workers, say)
            if one_stage and costs.priced(*whole) is not None:
                bound = min(bound, _one_stage_seconds(costs.priced(*whole), b, budget, linear))
            if linear:  # with no plan held, pairs no pipeline of priced-feasible pairs can hold still go
                floors = _pipeline_floors(_Priced(costs), len(layers), shapes, devices, b, linear, pipeline.num_stages,
                                          budget)
                within, pruned = _within(costs, layers, floors, bound, devices, b, pipeline, "interleaved" in schedules)
        refined = sum(not any(w.kept(*c) for w in within.values()) for c in cells) - out
        if refined:
            say(f"stage costs (B={b}): {refined} more pairs bounded out by the priced pairs' times")
        res = None
        if not beaten:
            say(f"stage DP (B={b})")
        for schedule in schedules if not beaten else ():
            kind = "interleaved" if schedule == "interleaved" else "linear"
            for cost in (pruned[kind], within[kind]):  # the FLOPs-balance pruning may leave no way to make num_stages
                try:
                    found = stage_dp(len(layers), mesh.shape, cost, budget, b, num_stages=pipeline.num_stages,
                                     schedule=schedule, submeshes=shapes, chunks=pipeline.chunks,
                                     shared=_shared_layers(cg, costs, len(layers)) if kind == "interleaved" else None)
                    if res is None or found.objective < res.objective:
                        res = found
                    break
                except PipelinePlanError as e:  # among the pairs kept: none under the plan held may fit
                    tried[b] = str(e) if math.isinf(bound) else f"bounded out: {e} (of the pipelines that may " \
                                                                  f"step under the {bound:.6g} s of the plan held)"
        costs.save_cache()
        disk_hits += costs.stats["disk_hits"]
        pricing_limits += costs.limits
        refusals |= costs.refusals
        if res is None:
            continue
        tried[b] = res.objective
        if best is None or res.objective < best[0].objective:
            best = (res, cg, layers, costs)
    if best is None:
        refused = f"; some layer ranges have no stage plan under these options: {' | '.join(refusals)}" if refusals else ""
        raise PipelinePlanError("no pipeline plan: " + "; ".join(f"B={k}: {v}" for k, v in tried.items()) + refused)
    res, cg, layers, costs = best
    table = build_strategies(cg, LogicalMesh((1, 1)))  # the batch dims both readers follow, built once
    reduction = loss_reduction(cg, table)
    if res.num_microbatches > 1:  # what the microbatch's graph cannot show: the whole batch's (a branch, row groups)
        check_batch_indices(cg, f"{res.num_microbatches} microbatches", table)
        whole = capture_batch() if capture_batch is not None else capture_rows(batch)
        if whole is not None:
            more = whole_batch_problems(whole, cg, batch, batch // res.num_microbatches, reduction.problems)
            reduction = replace(reduction, problems=(*reduction.problems, *more))
    if res.num_microbatches > 1 and reduction.problems:
        warnings.warn(f"{res.num_microbatches} microbatches change the loss: " + "; ".join(reduction.problems),
                      stacklevel=3)
    say("stage plans")
    groups = len(res.stages) // (pipeline.chunks if res.schedule == "interleaved" else 1)
    ranks = place_submeshes([s.submesh for s in res.stages[:groups]], mesh.shape)  # stage s on group s mod p
    ranks = [ranks[i % groups] for i in range(len(res.stages))]
    stage_plans = [_stage_plan(cg, costs, layers, st, rk, budget, options) for st, rk in zip(res.stages, ranks)]
    sched = get_schedule(res.schedule, pipeline.chunks)
    step = (sum(s.once_seconds for s in stage_plans)  # the DP's objective, of the stages as planned
            + step_seconds(sched, [s.seconds for s in stage_plans], res.num_microbatches))
    stats = {"total_s": time.perf_counter() - t0, "microbatch_objectives": {str(k): v for k, v in tried.items()},
             "layers": len(layers), "ilp_solves": costs.stats["ilp_solves"], "cache_hits": costs.stats["cache_hits"],
             "disk_hits": disk_hits,
             "ilp_s": costs.stats["ilp_s"], "t_max_tried": res.t_max_tried}
    recorded = {"plan": options.to_dict() | {"memory_budget": budget}, "pipeline": pipeline.to_dict(),
                "num_layers": len(layers)}
    return PipelinePlan(mesh=mesh, stages=stage_plans, schedule=res.schedule,
                        num_microbatches=res.num_microbatches, step_seconds=step,
                        compute_seconds=sum(res.num_microbatches * (s.plan.compute_seconds - s.plan.update_seconds)
                                            + s.plan.update_seconds for s in stage_plans),
                        bubble_fraction=bubble_fraction([s.seconds for s in stage_plans], res.num_microbatches,
                                                        res.schedule, pipeline.chunks),
                        memory_bytes=max(sum(s.memory_bytes for s in stage_plans[d::groups]) for d in range(groups)),
                        fingerprint=cg.fingerprint(),
                        loss_reduction=reduction, options=recorded, stats=stats, captured=cg, layers=layers,
                        pricing_limits=pricing_limits)


def dp_schedules(schedule: str) -> list[str]:
    """The schedules whose stage DPs the search runs for ``PipelineOptions.schedule``: the one
    named, or for ``"auto"`` every one of ``SCHEDULES`` but GPipe, which 1F1B dominates. Both
    step ``sum o + B t_max + (sum t - t_max)`` (fill ratio 1, ``core/schedules.py``) on the same
    stage options, and a GPipe stage holds ``B`` microbatches where a 1F1B stage holds
    ``min(s, B)``, so every pipeline that fits under GPipe fits under 1F1B with the same step:
    1F1B's DP optimum is at most GPipe's, and on a tie the search keeps the first schedule of
    ``SCHEDULES``, 1F1B. Without GPipe the stage options stop at the in-flight counts the other
    schedules need (``GraphStageCosts.in_flight_need``: 1 for the whole model on the whole mesh,
    where GPipe needed ``B``); docs/plan_time.md says where the plan can differ."""
    return [s for s in SCHEDULES if s != "gpipe"] if schedule == "auto" else [schedule]


def _shared_layers(cg, costs: GraphStageCosts, num_layers: int) -> dict[str, tuple[int, ...]]:
    """FQN -> the layers holding it, in order, of each parameter or buffer several layers hold (a
    tied weight): the interleaved DP keeps them off two stages of one device group, which the
    runtime refuses (``runtime/pipeline.py``: a rank's chunks hold disjoint state)."""
    state = {**cg.param_fqns, **cg.buffer_fqns}
    holders: dict[str, list[int]] = {}
    for j in range(num_layers):
        for ph in costs.subset(j, j + 1):
            if ph in state:
                holders.setdefault(state[ph], []).append(j)
    return {fqn: tuple(h) for fqn, h in holders.items() if len(h) > 1}


def _one_stage_seconds(options, b: int, budget: float, schedules) -> float:
    """The step seconds of the best one-stage pipeline among ``options`` (the whole model on the
    whole mesh) that fits ``budget`` under every schedule of ``schedules``, ``B t + o``; inf if none."""
    fit = [o for o in options if all(o.fits(in_flight(1, 1, b, s), budget) for s in schedules)]
    return min((b * o.seconds + o.once_seconds for o in fit), default=math.inf)


def _within(costs: GraphStageCosts, layers, floors, bound: float, devices: int, b: int, pipeline: PipelineOptions,
            interleaved: bool) -> tuple[dict[str, CostFn], dict[str, CostFn]]:
    """Per DP kind (``"linear"``: GPipe, 1F1B, ZB-H1; ``"interleaved"``), the pairs it sees: a
    linear DP those whose ``floors`` are at most ``bound`` (the step of a plan the search holds),
    the interleaved one those it can place (``_interleaved_fits``, unbounded: its recursion is a
    proxy of its step); and the same without the pairs off their FLOPs share (``_balanced``)."""
    within = {"linear": _kept(costs, lambda k, i, q: floors[k, i, q] < math.inf
                              and floors[k, i, q] <= bound * (1 + 1e-9))}  # margin: float rounding
    if interleaved:
        within["interleaved"] = _kept(costs, lambda k, i, q: _interleaved_fits(k, i, q, len(layers), devices, b,
                                                                               pipeline.chunks, pipeline.num_stages))
    return within, {kind: _balanced(w, costs, layers, devices, pipeline.imbalance) for kind, w in within.items()}


def _relaxed(costs: GraphStageCosts, within: CostFn) -> CostFn:
    """``within``'s pairs (``_kept``) with their options where priced and, where not, one option
    no option of theirs beats: none is faster (``GraphStageCosts.lower_bound``) or holds fewer
    weight or activation bytes (``least_weight_bytes``, ``least_act_bytes``), and it pays nothing
    once per step. No stage ILP is solved."""

    def cost(k, i, q):
        if not within.kept(k, i, q):
            return []
        options = costs.priced(k, i, q)
        if options is not None:
            return options
        t = costs.lower_bound(k, i, q)
        return [] if math.isinf(t) else [StageOption(t, costs.least_weight_bytes(k, i, q),
                                                     costs.least_act_bytes(k, i, q))]

    return cost


def _beaten(costs: GraphStageCosts, within: dict[str, CostFn], num_layers: int, cluster_shape, shapes,
            budget: float, b: int, bound: float, schedules, pipeline: PipelineOptions, cg) -> bool:
    """Whether no pipeline of ``b`` microbatches of the pairs ``within`` keeps can step under
    ``bound`` (the plan held) under any of ``schedules``, however the pairs not priced yet are
    priced: each schedule's stage DP over ``_relaxed`` options finds no pipeline, or its least
    recursion value (``DPResult.floor``: at most the step of every pipeline it considers; equal to
    the least step but under interleaved 1F1B) is above ``bound``. The priced options can only be
    slower and larger than the relaxed ones, so the DPs over them would find none under ``bound``
    either (Alpa's bound on the step, section 5.1, before every pair is priced)."""
    if math.isinf(bound):
        return False
    for schedule in schedules:
        kind = "interleaved" if schedule == "interleaved" else "linear"
        try:
            found = stage_dp(num_layers, cluster_shape, _relaxed(costs, within[kind]), budget, b,
                             num_stages=pipeline.num_stages, schedule=schedule, submeshes=shapes,
                             chunks=pipeline.chunks,
                             shared=_shared_layers(cg, costs, num_layers) if kind == "interleaved" else None)
        except PipelinePlanError:
            continue
        if found.floor <= bound * (1 + 1e-9):  # margin: float rounding
            return False
    return True


class _Priced:
    """``GraphStageCosts.lower_bound`` raised, for every pair priced so far, to its least option
    time (inf when it has no option): each is at most the time of every option the DP may pick."""

    def __init__(self, costs: GraphStageCosts):
        self.costs = costs

    def least_weight_bytes(self, k: int, i: int, q: tuple[int, int]) -> float:
        return self.costs.least_weight_bytes(k, i, q)

    def least_act_bytes(self, k: int, i: int, q: tuple[int, int]) -> float:
        return self.costs.least_act_bytes(k, i, q)

    def lower_bound(self, k: int, i: int, q: tuple[int, int]) -> float:
        options = self.costs.priced(k, i, q)
        bound = self.costs.lower_bound(k, i, q)
        return bound if options is None else max(bound, min((o.seconds for o in options), default=math.inf))


def _pipeline_floors(costs: GraphStageCosts, num_layers: int, shapes, devices: int, b: int, schedules,
                     num_stages: int | None, memory_bytes: float = math.inf) -> dict[tuple, float]:
    """Per (layer range, submesh) pair ``(k, i, q)``: a lower bound on the step seconds of every
    pipeline of the stage DP (under each of ``schedules``, not ``"interleaved"``) holding it as a
    stage; inf when none can (the other layers cannot make stages on exactly the other devices,
    e.g. part of the model on the whole cluster). The step is ``(B - r) t_max + r sum t`` plus
    once-per-step terms (``core/schedules.py``; ``r`` the fill ratio, <= 1, ``b`` is B), which
    grows with every stage time, so it is at least that of the stages' ``GraphStageCosts.lower_bound``
    values: with ``t`` the pair's bound, ``M`` the least largest and ``S`` the least sum of the
    other stages' bounds over the ways to cut the other layers into stages on exactly the other
    devices (each least found on its own, by DPs over the layers before the range and after it,
    ``num_stages`` stages in all when given), the floor is ``(B - r) max(t, M) + r (t + S)``; with
    ``memory_bytes``, only over the stage counts before and after at which the pair's least weights
    and activations (``GraphStageCosts.least_weight_bytes``, ``least_act_bytes``) fit the
    microbatches it holds in flight there under some schedule (``Schedule.in_flight``). A
    pipeline whose step exceeds a plan the search holds is not chosen, so dropping the pairs whose
    floor is above that plan's step leaves the DP's answer (when below it) as it was (Alpa's
    ``B t_max >= T*`` pruning, section 5.1, applied before the stage ILPs)."""
    L, sizes = num_layers, {q: q[0] * q[1] for q in shapes}
    if not schedules:
        return dict.fromkeys(((k, i, q) for k in range(L) for i in range(k + 1, L + 1) for q in shapes), math.inf)
    r = min(get_schedule(s).fill_ratio() for s in schedules)
    lb = {(k, i, q): costs.lower_bound(k, i, q) for k in range(L) for i in range(k + 1, L + 1) for q in shapes}
    # before[c][k, n, d]: over the ways to cut layers [0, k) into n stages on exactly d devices, the
    # least sum (c = 0) and the least largest (c = 1) of their bounds; after[c][i, n, d]: layers [i, L)
    before = np.full((2, L + 1, L + 1, devices + 1), np.inf)
    after = np.full((2, L + 1, L + 1, devices + 1), np.inf)
    before[:, 0, 0, 0] = after[:, L, 0, 0] = 0.0

    def extend(table, to, frm, q, t):
        sz = sizes[q]
        np.minimum(table[0, to, 1:, sz:], table[0, frm, :-1, :devices + 1 - sz] + t, out=table[0, to, 1:, sz:])
        np.minimum(table[1, to, 1:, sz:], np.maximum(table[1, frm, :-1, :devices + 1 - sz], t),
                   out=table[1, to, 1:, sz:])

    for k in range(1, L + 1):
        for j in range(k):
            for q in shapes:
                extend(before, k, j, q, lb[j, k, q])
    for i in range(L - 1, -1, -1):
        for e in range(i + 1, L + 1):
            for q in shapes:
                extend(after, i, e, q, lb[i, e, q])
    counts = np.add.outer(np.arange(L + 1), np.arange(L + 1)) + 1  # stages in all: before + this + after
    held = np.array([[min(get_schedule(s).in_flight(n1, n1 + n2 + 1, b) for s in schedules) for n2 in range(L + 1)]
                     for n1 in range(L + 1)])  # the least microbatches in flight of a stage after n1, before n2
    floors = {}
    for (k, i, q), t in lb.items():
        rest = devices - sizes[q]
        if rest < 0:
            floors[k, i, q] = math.inf
            continue
        # over n1 stages before on d devices and n2 after on rest - d: the least sum and largest
        pre, post = before[:, k, :, None, :rest + 1], after[:, i, None, :, rest::-1]
        total = (pre[0] + post[0]).min(axis=2)
        largest = np.maximum(pre[1], post[1]).min(axis=2)
        feasible = np.isfinite(total) if num_stages is None else np.isfinite(total) & (counts == num_stages)
        if math.isfinite(memory_bytes):
            feasible &= costs.least_weight_bytes(k, i, q) + held * costs.least_act_bytes(k, i, q) \
                <= memory_bytes * (1 + 1e-9)
        step = np.where(feasible, (b - r) * np.where(feasible, np.maximum(largest, t), 0.0) + r * (t + total), np.inf)
        floors[k, i, q] = float(step.min())
    return floors


def _interleaved_fits(k: int, i: int, q: tuple[int, int], num_layers: int, devices: int, b: int, chunks: int,
                      num_stages: int | None) -> bool:
    """Whether layers ``[k, i)`` on submesh ``q`` can be a stage of an interleaved pipeline
    (``stage_dp.interleaved_dp``): ``p = devices / |q| >= 2`` groups dividing ``b``, ``p chunks``
    stages (``num_stages`` when given, at most the layers), the other layers cut into the other
    ``p chunks - 1`` stages, before and after the range."""
    size = q[0] * q[1]
    p = devices // size
    stages = p * chunks
    if devices % size or p < 2 or b % p or stages > num_layers or num_stages not in (None, stages):
        return False
    return (k > 0) + (i < num_layers) <= stages - 1 <= k + num_layers - i


def _kept(costs: GraphStageCosts, kept) -> CostFn:
    """``costs`` on the (range, submesh) pairs ``kept(k, i, shape)`` says, ``[]`` elsewhere."""

    def cost(k, i, shape):
        return costs(k, i, shape) if kept(k, i, shape) else []

    cost.kept = kept
    return cost


def _balanced(within: CostFn, costs: GraphStageCosts, layers, devices: int, imbalance: float) -> CostFn:
    """``within`` (``_kept``) without the (range, submesh) pairs whose device share is off its
    FLOPs share by more than ``imbalance`` (a single stage on every device is always kept)."""
    total = sum(layer.flops for layer in layers) or 1.0

    def kept(k, i, shape):
        share = max(sum(layer.flops for layer in layers[k:i]) / total, 1e-12)
        ratio = shape[0] * shape[1] / devices / share
        return within.kept(k, i, shape) and ((k, i) == (0, len(layers)) or 1 / imbalance <= ratio <= imbalance)

    def cost(k, i, shape):
        return costs(k, i, shape) if kept(k, i, shape) else []

    cost.kept = kept
    return cost


def _stage_plan(cg, costs: GraphStageCosts, layers, st: StageChoice, ranks, budget: float,
                options: PlanOptions) -> StagePlan:
    """Re-solve a chosen stage on its own nodes and wrap it as a ``StagePlan``, its times priced
    from its plan's collectives (``Plan.microbatch_seconds`` and ``once_seconds``: in chain mode
    the whole stage's buckets and ZeRO-3 groups, where the DP's option added its layers')."""
    names = costs.subset(st.start, st.end)
    shape, scale = st.option.payload[:2]
    mesh = costs.cluster.logical_mesh(shape)
    view = stage_view(cg, names)
    remat = [layers[st.start + i].nodes for i in st.option.remat]  # the option's choice, forced
    if len(st.option.payload) == 2:  # one ILP for the stage (exact mode, or the chain's fallback)
        sol = solve_stage(cg, names, mesh, budget, scale, costs.table(shape, st.start, st.end), options,
                          sync_weight=costs.sync_weight, sends=costs.sends(st.start, st.end), remat=remat)
        nodes, compute, update = sol.nodes, sol.compute_seconds, sol.update_seconds
        limits = solver_limits(f"layers {st.start}-{st.end - 1}", sol)
    else:  # the chain of per-layer solutions the DP priced, on this stage's own layers
        fixed: dict = {}
        real: dict = {}
        boundary: dict = {}
        compute = update = 0.0
        limits = []
        for j in range(st.start, st.end):
            part = costs.subset(j, j + 1)
            sol = solve_stage(cg, part, mesh, layer_budget(st.option.payload[2], j - st.start), scale,
                              costs.table(shape, j, j + 1), options, fixed=dict(fixed), sync_weight=costs.sync_weight,
                              remat=[layers[j].nodes] if j - st.start in st.option.remat else [])
            compute += sol.compute_seconds
            update += sol.update_seconds
            limits += solver_limits(f"layer {j}", sol)
            for n, np_ in sol.nodes.items():
                (boundary if np_.strategy == "boundary" else real)[n] = np_
            fixed.update({n: real[n].out_specs for n in part if n in real})
        nodes = {n: np_ for n, np_ in boundary.items() if n not in real} | real
    remat = [list(layer) for layer in remat]
    nodes, grad_sync, collectives = training_step(view, nodes, mesh, options.bucket_bytes,
                                                  options.gradient_reduce_dtype, remat)  # the whole stage's syncs
    plan = Plan(mesh=mesh, param_specs=param_specs_of(view, nodes),
                input_specs={n: nodes[n].out_specs[0] for n in view.input_names}, nodes=nodes,
                collectives=collectives, compute_seconds=compute, comm_seconds=sum(c.seconds for c in collectives),
                memory_bytes=st.option.weight_bytes + st.in_flight * st.option.act_bytes + st.option.remat_bytes,
                fingerprint=cg.fingerprint(),
                options={"memory_budget": budget, "activation_scale": scale, "mode": costs.mode}, grad_sync=grad_sync,
                bucket_bytes=options.bucket_bytes, zero_stages=zero_stages(view, nodes), solver_limits=limits,
                remat=remat, update_seconds=update)
    transfer = costs.transfer_seconds(st.start, st.submesh)
    sends = sum(send_gather_seconds(cg, n, nodes[n].out_specs[0], mesh) for n in costs.sends(st.start, st.end))
    return StagePlan((st.start, st.end), [n for layer in layers[st.start:st.end] for n in layer.nodes],
                     st.submesh, list(ranks), plan, [n for n, _ in costs.crossing[st.start]],
                     [n for n, _ in costs.crossing[st.end]], plan.microbatch_seconds + sends + transfer,
                     plan.once_seconds, transfer, st.option.weight_bytes, st.option.act_bytes,
                     st.in_flight, st.option.remat_bytes)
