r"""The intra-operator ILP (Alpa, OSDI'22, section 4.2), solved with PuLP (CBC, or HiGHS in-process).

Given a cost graph with variables ``v`` (each a node, or a group of merged nodes) holding
``k_v`` candidate strategies and edges ``(u, v)`` with resharding cost matrices ``R_uv``:

    variables   s_v in {0,1}^{k_v},  1^T s_v = 1                    (one strategy per variable)
                e_uv in [0,1]^{k_u x k_v}
    linearize   sum_q e_uv[p, q] = s_u[p],   sum_p e_uv[p, q] = s_v[q]
                (with s one-hot these force e_uv = s_u s_v^T, so e may stay continuous)
    memory      sum_v m_v^T s_v <= M                                 (bytes per device)
    minimize    sum_v c_v^T s_v + sum_uv <e_uv, R_uv>                (seconds per step)
    forbid      e_uv[p, q] = 0 where R_uv[p, q] = inf                (a pair that cannot run
                together, e.g. a ZeRO-2 parameter and a use that does not sync its gradient)
    fixed       y_g >= s_v[p] for (v, p) in g,  cost f_g y_g          (paid once if any member is
                chosen: the latency of a bucketed collective that only some strategies need)

Strategies of ``u`` whose rows of ``R_uv`` are equal (the same output spec, seen from ``v``), and
strategies of ``v`` with equal columns (the same input spec), need not be told apart on that edge:
``e_uv`` runs over classes of equal rows and columns, with ``s_u[p]`` summed over a row class
(``s_v[q]`` over a column class) in the linearization. One row or column class makes the edge
linear in the other end's ``s``: no ``e`` at all. The optimum is unchanged; on GPT-3 39B's
per-layer stage ILPs the columns drop by about a quarter.

A *shared move* prices one value's resharding once however many readers want it in the same
spec (docs/planner.md, "One move per value"). Move ``g`` has a source variable ``u``, targets
``t`` with costs ``R_g[p, t]``, and readers ``c`` (a variable ``v_c`` and, per strategy of
``v_c``, the target it wants or none); ``y_c[t]`` is the sum of ``s_{v_c}[q]`` over the ``q``
wanting ``t``. Over the row classes ``a`` of ``R_g``:

    f_c[a, t] >= 0,   sum_a f_c[a, t] = y_c[t],   sum_t f_c[a, t] <= s_u[a]   (f_c = s_u y_c^T)
    m_g[a, t] >= f_c[a, t]  for every reader c                  (m_g = s_u OR_c y_c)
    minimize    ... + sum_g <m_g, R_g>

With one row class ``f_c`` is ``y_c`` itself (no ``f``).

This module knows nothing about torch: the planner builds the ``CostGraph``. Memory has no
edge terms, so the least memory any solution needs is ``sum_v min_p m_v[p]``; a budget below
it is reported with that figure instead of trusting a solver's "infeasible".

Overlap (docs/planner.md, "One price"): backward hides gradient synchronization. A *pool*
``P`` (ZeRO-3 gradient reduce-scatters; gradient buckets of one kind and mesh axes; the loss's
all-reduce the runtime defers, ``c_P = 0``) has seconds
``S_P(s) = sum_v x_Pv^T s_v + sum_uv <e_uv, H_Puv>``, of which the listing leaves its first
collective (group 0, the (kind, axes)'s first bucket) unhidden, at most ``c_P`` seconds; all of
them hide within ``D(s) = sum_v d_v^T s_v``, backward's share of the compute. With a binary
``z_P`` (hiding anything at all: ``S_P > c_P``) and ``U_P`` the largest ``S_P``:

    h_P <= S_P(s) - c_P z_P,   h_P <= (U_P - c_P) z_P,   h_P >= 0,   sum_P h_P <= D(s)
    minimize    ... - sum_P w_P h_P

so ``h_P = max(0, S_P - c_P)``, the pools of larger weight ``w_P`` first (a pipeline stage's
buckets, run once per step, weigh ``1 / B``) within ``D``, as ``core.plan.hidden_seconds``
fills its budget. Where ``c_P = 0`` there is no ``z_P``. A pool of gradient all-reduces also
pays its first bucket's latency ``a_P`` once if it has any member (``y_P >= x`` for every
variable ``x`` of ``S_P``, ``+ a_P y_P``; a fixed charge on edges), its members their share of
the other buckets' (``LogicalMesh.bucketed_cost``). A pool of ZeRO-3 group latencies
(``Pool.grouped``, weight 0) pays ``w_P = max(a_P y_P, S_P)``: one group's latencies once any
use is grouped, its members' shares of them (``S_P``) past that (``w_P >= a_P y_P``,
``w_P >= S_P``, minimized).

Activation checkpointing (rematerialization; Chen et al. 2016, "Training Deep Nets with
Sublinear Memory Cost"; Alpa's remat): a ``RematGroup`` ``l`` (a layer) holds the bytes
``A_l(s) = sum_v a_lv^T s_v`` of the activations only the layer reads, which are left out of
``m``, and the seconds ``E_l(s) = sum_v x_lv^T s_v + sum_uv <e_uv, F_luv>`` of recomputing its
forward: its ops' forward compute and collectives, and the forward moves ``F_luv`` of the values
its ops read (their own ``e_uv``, linearized as above). A binary ``r_l`` (fixed to 1 when
the group is forced) chooses: kept, ``A_l`` stays in memory; recomputed, ``A_l`` is freed and
only the largest recomputed layer is live at once (during its backward), at ``E_l`` seconds:

    memory      sum_v m_v^T s_v + sum_l k_l + z <= M
                k_l >= A_l(s) - U_l r_l,   z >= A_l(s) - U_l (1 - r_l),   k_l, z >= 0
    minimize    ... + sum_l w_l,           w_l >= E_l(s) - V_l (1 - r_l), w_l >= 0

with ``U_l`` / ``V_l`` the largest ``A_l`` / ``E_l`` over strategies (big-M linearization of
``r_l A_l(s)`` and ``r_l E_l(s)``). In a pipeline stage a kept layer's activations are held by
each of the ``c`` microbatches in flight (``RematGroup.keep_scale``): ``k_l >= c (A_l(s) - U_l
r_l)``, while ``z`` (one layer recomputed at a time) counts once.
"""
from __future__ import annotations

import ctypes
import functools
import itertools
import math
import os
import sys
from dataclasses import dataclass, field

import pulp


class MemoryBudgetError(ValueError):
    """No sharding plan fits the memory budget; ``minimum_bytes`` is the least any plan needs."""

    def __init__(self, budget: float, minimum: float):
        self.budget, self.minimum_bytes = budget, minimum
        super().__init__(f"no plan fits the memory budget of {budget / 2**30:.3f} GiB ({budget:.0f} bytes) per device; "
                         f"the least any plan needs is {minimum / 2**30:.3f} GiB ({minimum:.0f} bytes)")


class SolverError(RuntimeError):
    """The ILP solver returned no optimal solution (time limit with no incumbent, or failure).
    ``limit``: ``"nodes"`` / ``"time"`` when a solver limit stopped it before any feasible
    assignment was found (the ILP may still be feasible), else None."""

    def __init__(self, message: str, limit: str | None = None):
        super().__init__(message)
        self.limit = limit


@dataclass
class RematGroup:
    """A layer that may be recomputed (module docstring).

    Attributes:
        act: variable -> bytes per strategy of the activations only this layer reads (left out
            of ``CostGraph.memory``).
        extra: variable -> seconds per strategy of recomputing the layer's forward.
        edges: ``(u, v) -> matrix``: seconds of the forward moves the recomputation runs again,
            ``matrix[p][q]`` when u picks p and v picks q (``CostGraph.edges``).
        forced: recomputed whatever it costs (``remat="all"``); else the ILP chooses.
        keep_scale: how many times kept activations count (microbatches in flight of a pipeline
            stage, ``stage_costs.solve_stage``'s ``act_scale``); recomputed ones count once.
    """

    act: dict[int, list[float]] = field(default_factory=dict)
    extra: dict[int, list[float]] = field(default_factory=dict)
    edges: dict[tuple[int, int], list[list[float]]] = field(default_factory=dict)
    forced: bool = False
    keep_scale: float = 1.0

    def at(self, terms: dict[int, list[float]], choice) -> float:
        return sum(vec[choice[v]] for v, vec in terms.items())

    def recompute(self, choice) -> float:
        """``E_l``: seconds of recomputing the layer under ``choice``."""
        return self.at(self.extra, choice) + sum(m[choice[u]][choice[v]] for (u, v), m in self.edges.items())

    @staticmethod
    def bound(terms: dict[int, list[float]]) -> float:
        return sum(max(vec) for vec in terms.values())

    def add_edge(self, u: int, v: int, matrix: list[list[float]]) -> None:
        """Add (or accumulate into) the forward moves ``u -> v`` (``CostGraph.add_edge``)."""
        _add_linear_edge(self.extra, self.edges, u, v, matrix)


def _add_linear_edge(extra: dict, edges: dict, u: int, v: int, matrix: list[list[float]]) -> None:
    """Add ``matrix`` to the terms ``(extra, edges)``: a self edge's diagonal to ``extra[u]``."""
    if u == v:
        diag = [matrix[p][p] for p in range(len(matrix))]
        extra[u] = [a + b for a, b in zip(extra.get(u, [0.0] * len(diag)), diag)]
    else:
        _accumulate(edges, u, v, matrix)


@dataclass
class Pool:
    """Collectives backward may hide (module docstring, "Overlap"): ZeRO-3 gradient
    reduce-scatters, the gradient buckets of one kind and mesh axes, or the loss's all-reduce
    the runtime defers (``Collective.deferred``).

    Attributes:
        unhidden: ``c_P``, seconds: the most the listing leaves unhidden of them (its first group
            or bucket, of at most ``bucket_bytes``).
        weight: ``w_P``, the weight of a hidden second in the objective (1; a pipeline stage's
            buckets, run once per step: ``1 / B``).
        latency: seconds paid once when any member is chosen (``used``): the latency of the kind
            and axes' first bucket (its members pay their share of the others').
        extra: variable -> seconds per strategy.
        edges: ``(u, v) -> matrix``, seconds when u picks p and v picks q (``CostGraph.edges``).
        held_extra / held_edges: the same, of members that never hide (the parameters used first:
            their gradients complete when backward ends); they are no part of ``S_P`` but pay
            ``latency``.
        grouped: the latencies of ZeRO-3 groups (weight 0: they hide nothing): the pool pays
            ``max(latency, S_P)`` when any member is chosen, one group's latencies at least,
            else its members' shares of them (``S_P``), instead of ``latency`` once.
    """

    unhidden: float
    weight: float = 1.0
    latency: float = 0.0
    extra: dict[int, list[float]] = field(default_factory=dict)
    edges: dict[tuple[int, int], list[list[float]]] = field(default_factory=dict)
    held_extra: dict[int, list[float]] = field(default_factory=dict)
    held_edges: dict[tuple[int, int], list[list[float]]] = field(default_factory=dict)
    grouped: bool = False

    def add_edge(self, u: int, v: int, matrix: list[list[float]], hides: bool = True) -> None:
        """Add (or accumulate into) the pool's seconds on ``u -> v`` (``CostGraph.add_edge``);
        ``hides`` False: of members that never hide (``held_edges``)."""
        if hides:
            _add_linear_edge(self.extra, self.edges, u, v, matrix)
        else:
            _add_linear_edge(self.held_extra, self.held_edges, u, v, matrix)

    def used(self, choice) -> bool:
        """Whether ``choice`` chooses any member's seconds (all are non-negative)."""
        return self.seconds(choice) > 0 or (sum(vec[choice[v]] for v, vec in self.held_extra.items())
                                            + sum(m[choice[u]][choice[v]] for (u, v), m in self.held_edges.items())) > 0

    def seconds(self, choice) -> float:
        """``S_P``: the pool's seconds under ``choice``."""
        return (sum(vec[choice[v]] for v, vec in self.extra.items())
                + sum(m[choice[u]][choice[v]] for (u, v), m in self.edges.items()))

    def paid(self, choice) -> float:
        """Seconds the pool adds to the objective under ``choice`` before what it hides: its
        ``latency`` once when used, a grouped pool's ``max(latency, S_P)``."""
        if not (self.latency and self.used(choice)):
            return 0.0
        return max(self.latency, self.seconds(choice)) if self.grouped else self.latency

    def bound(self) -> float:
        """``U_P``: the largest ``S_P`` of any assignment, or more."""
        return sum(max(vec) for vec in self.extra.values()) + sum(max(map(max, m)) for m in self.edges.values())


def _accumulate(edges: dict, u: int, v: int, matrix: list[list[float]]) -> None:
    """Add ``matrix`` into ``edges``' entry of the pair ``{u, v}`` (stored once, either way round)."""
    if (v, u) in edges:
        u, v, matrix = v, u, [list(col) for col in zip(*matrix)]
    if (u, v) in edges:
        matrix = [[a + b for a, b in zip(r1, r2)] for r1, r2 in zip(edges[(u, v)], matrix)]
    edges[(u, v)] = matrix


@dataclass
class CostGraph:
    """Variables with per-strategy costs and memory, and edges with cost matrices.

    Attributes:
        costs: per variable, seconds for each strategy.
        memory: per variable, bytes per device for each strategy.
        edges: ``(u, v) -> matrix`` with ``matrix[p][q]`` seconds when u picks p and v picks q.
        names: per variable, a readable name (for LP files and debugging).
        fixed: ``key -> (seconds, {(variable, strategy), ...})``: paid once when any member is
            chosen.
        moves: shared moves, ``(u, readers) -> matrix`` with ``matrix[p][t]`` seconds of moving
            u's value, when u picks p, to target ``t``, paid once if any reader wants ``t``;
            ``readers`` is a tuple of ``(v, wants)``, ``wants[q]`` the target v's strategy ``q``
            wants (-1: none of them).
        remat: the layers that may be recomputed (``RematGroup``).
        pools: ``key -> Pool``: what backward may hide (module docstring, "Overlap").
        backward: variable -> ``d_v``, seconds of backward compute per strategy: what hides them.
    """

    costs: list[list[float]]
    memory: list[list[float]]
    edges: dict[tuple[int, int], list[list[float]]] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)
    fixed: dict[object, tuple[float, set[tuple[int, int]]]] = field(default_factory=dict)

    def add_fixed(self, key, seconds: float, member: tuple[int, int]) -> None:
        """Make strategy ``member = (variable, index)`` a member of the fixed charge ``key``."""
        self.fixed.setdefault(key, (seconds, set()))[1].add(member)

    moves: dict[tuple, list[list[float]]] = field(default_factory=dict)
    remat: list[RematGroup] = field(default_factory=list)
    pools: dict[object, Pool] = field(default_factory=dict)
    backward: dict[int, list[float]] = field(default_factory=dict)

    def add_edge(self, u: int, v: int, matrix: list[list[float]]) -> None:
        """Add (or accumulate into) the edge ``u -> v``; a self edge adds its diagonal to ``u``."""
        if u == v:
            for p in range(len(self.costs[u])):
                self.costs[u][p] += matrix[p][p]
            return
        _accumulate(self.edges, u, v, matrix)

    def add_move(self, u: int, readers, matrix: list[list[float]]) -> None:
        """Add (or accumulate into) the shared move of ``u``'s value to ``readers``' targets
        (``moves``); equal moves of repeated blocks accumulate into one."""
        key = (u, tuple(sorted({(v, tuple(wants)) for v, wants in readers})))
        if key in self.moves:
            matrix = [[a + b for a, b in zip(r1, r2)] for r1, r2 in zip(self.moves[key], matrix)]
        self.moves[key] = matrix

    def objective(self, choice: list[int], remat=()) -> float:
        """Seconds of a full assignment (one strategy index per variable; ``remat[l]``: group
        ``l`` recomputed, default none)."""
        return (sum(c[p] for c, p in zip(self.costs, choice))
                + sum(m[choice[u]][choice[v]] for (u, v), m in self.edges.items())
                + sum(f for f, members in self.fixed.values() if any(choice[v] == p for v, p in members))
                + sum(m[choice[u]][t] for (u, readers), m in self.moves.items()
                      for t in {wants[choice[v]] for v, wants in readers} if t >= 0)
                + sum(g.recompute(choice) for g, r in zip(self.remat, remat) if r)
                + sum(p.paid(choice) for p in self.pools.values())
                - self.hidden(choice))

    def hidden(self, choice: list[int]) -> float:
        """Weighted seconds backward hides under ``choice`` (module docstring, "Overlap"): each
        pool's ``max(0, S_P - c_P)``, larger weights first, within the backward compute."""
        budget = sum(vec[choice[v]] for v, vec in self.backward.items())
        total = 0.0
        for pool in sorted((p for p in self.pools.values() if p.weight), key=lambda p: -p.weight):
            h = max(0.0, min(pool.seconds(choice) - pool.unhidden, budget))
            budget -= h
            total += pool.weight * h
        return total

    def memory_of(self, choice: list[int], remat=()) -> float:
        """Bytes per device: kept activations, plus the largest recomputed layer's."""
        flags = list(remat) + [False] * (len(self.remat) - len(remat))
        acts = [(g.at(g.act, choice), r) for g, r in zip(self.remat, flags)]
        return (sum(m[p] for m, p in zip(self.memory, choice))
                + sum(g.keep_scale * a for g, (a, r) in zip(self.remat, acts) if not r)
                + max((a for a, r in acts if r), default=0.0))

    def min_memory(self) -> float:
        """The least memory of any assignment (a lower bound with remat groups: each at its least)."""
        least = [sum(min(vec) for vec in g.act.values()) for g in self.remat]
        return sum(min(m) for m in self.memory) + max(least, default=0.0)


@dataclass
class Solution:
    """An assignment and its figures. ``status``: ``"Optimal"`` (proven), ``"NodeLimit"`` (the
    solver explored its ``node_limit`` of branch-and-bound nodes first: the same input gives the
    same answer on every run) or ``"TimeLimit"`` (its wall-clock ``time_limit`` came first: the
    answer depends on the machine's speed and load). ``gap``: None when proven optimal, else the
    relative gap between it and the solver's lower bound (``math.inf`` where the solver reports
    none: CBC run as a process)."""

    choice: list[int]
    objective: float
    memory: float
    status: str
    remat: tuple[bool, ...] = ()
    gap: float | None = None


def _identical(vectors) -> list[list[int]]:
    """Indices of equal vectors, grouped in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for i, vec in enumerate(vectors):
        groups.setdefault(tuple(vec), []).append(i)
    return list(groups.values())


@functools.cache
def highs_available() -> bool:
    """Whether HiGHS can solve in this process (the ``highspy`` package, ``alpa-lite[highs]``).

    HiGHS prints a two-line banner to the process's standard output (file descriptor 1, below
    Python's ``sys.stdout``) when the first solver of a process is built. The first one is built
    here, with descriptor 1 pointed at ``/dev/null``, so that what alpa-lite prints (a plan, JSON)
    stays clean.
    """
    if not pulp.HiGHS().available():
        return False
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            _highspy().Highs()
            ctypes.CDLL(None).fflush(None)  # C's stdout buffer, written while descriptor 1 is null
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    return True


class _HiGHS(pulp.HiGHS):
    """PuLP's in-process HiGHS, reading a node limit reached (HiGHS's ``kSolutionLimit``, which
    PuLP's status table lacks) as a feasible, unproven answer. ``stopped``: ``"nodes"`` /
    ``"time"`` when a limit stopped the solve. No start is given (PuLP passes HiGHS none): given
    the least-memory start through ``Highs.setSolution``, HiGHS 1.16 returned that start as
    optimal on tests/test_zero.py's MLP (its presolve priced the start at 5.1e-6 s in the reduced
    space, 1.3e-4 s in truth, 20x the optimum; docs/planner.md, "Starts")."""

    stopped: str | None = None

    def findSolutionValues(self, lp):
        model, status = lp.solverModel, lp.solverModel.getModelStatus()
        kinds = _highspy().HighsModelStatus
        self.stopped = {kinds.kTimeLimit: "time", kinds.kSolutionLimit: "nodes"}.get(status)
        try:
            return super().findSolutionValues(lp)  # assigns the variables' values, then reads the status
        except KeyError:
            if status != kinds.kSolutionLimit:
                raise
            if model.getInfo().primal_solution_status != 2:  # kSolutionStatusFeasible
                return pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound
            return pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible


class _CBC(pulp.PULP_CBC_CMD):
    """PuLP's CBC, telling which limit stopped it (``stopped``, as ``_HiGHS``) from the first
    line of its solution file (``Stopped on time`` / ``Stopped on iterations``: nodes)."""

    stopped: str | None = None

    def get_status(self, filename):
        with open(filename) as f:
            first = f.readline()
        self.stopped = ("time" if first.startswith("Stopped on time")
                        else "nodes" if first.startswith("Stopped on iterations") else None)
        return super().get_status(filename)


def _highspy():
    """The highspy module PuLP's HiGHS interface imported (``highs_available()`` first)."""
    return pulp.apis.highs_api.highspy


def _solver(time_limit: float, name: str, node_limit: int | None):
    if name == "highs" and not highs_available():
        raise SolverError("solver='highs' needs the highspy package: pip install 'alpa-lite[highs]' "
                          "(or use solver='auto', which falls back to CBC)")
    if name == "highs" or (name == "auto" and highs_available()):
        # in-process: no model file and no solver process per ILP, as CBC needs; tight gaps, so
        # that a tie within HiGHS's defaults (1e-4 relative) is not an answer. No restart after
        # the root node: on GPT-3 2.6B / 2x4 HiGHS fixed a quarter of the binaries by reduced cost
        # there and presolved twice more, 40% of its time, for the same optimum. No probing
        # (presolve rule 15): it was 60% of that ILP's time (1.41 -> 0.52 s), and on 525 ILPs of
        # the planner (its tests, GPT-3 39B / 8x8 stages, Wide-ResNet 4B / V100 stages) it gave
        # the same objective every time in 42% of the time (docs/plan_time.md). No dominated-column
        # reduction (rule 5): on memory-tight MoE stage ILPs (V100 MoE 27B, a chain layer at 2-4
        # microbatches in flight) HiGHS 1.16 with it rejected the optimum after postsolve ("untransformed
        # violations: variable bound = 1") and returned a solution 1.85-2.26x worse as "Optimal" (or
        # called the ILP infeasible); without it, CBC's optimum on all 17 such ILPs, and the same or a
        # lower objective on 70 GPT-3 39B and Wide-ResNet 4B stage ILPs in the same time (docs/plan_time.md)
        nodes = {} if node_limit is None else {"mip_max_nodes": int(node_limit)}
        return _HiGHS(msg=False, timeLimit=time_limit, threads=1, random_seed=0, gapRel=1e-7, gapAbs=1e-12,
                      mip_allow_restart=False, presolve_rule_off=(1 << 15) | (1 << 5), **nodes)
    # CBC's primal heuristics cost more than they save on these small problems (3x on the
    # per-layer ILPs of GPT-3 39B): branch and bound from the feasible start ``solve`` gives.
    # No objective increment: the one CBC derives from the objective's coefficients pruned the
    # optimum of tests/test_ilp.py's Megatron MLP once ZeRO-3 groups' latencies came in
    # (``Pool.grouped``'s continuous ``w``): "optimal" 1.4e-5 above HiGHS's optimum
    return _CBC(msg=False, timeLimit=time_limit, threads=1, warmStart=True, maxNodes=node_limit,
                options=["randomSeed 1", "randomCbcSeed 1", "heuristicsOnOff off", "increment 1e-12"])


def solve(graph: CostGraph, memory_budget: float = math.inf, time_limit: float = 60.0,
          solver: str = "cbc", switches: tuple[str, ...] = (), node_limit: int | None = None) -> Solution:
    """Solve the ILP exactly (up to ``node_limit`` branch-and-bound nodes and ``time_limit``
    seconds).

    Args:
        graph: the cost graph.
        memory_budget: bytes per device.
        time_limit: wall-clock seconds given to the MILP solver, a backstop: the best incumbent
            is used when reached, and the answer then depends on the machine's speed and load.
        node_limit: branch-and-bound nodes the solver may explore (HiGHS ``mip_max_nodes``, CBC
            ``maxNodes``; None: no limit): the stopping rule that does not depend on the
            machine. With one thread and fixed seeds the same input explores the same nodes, so
            an answer it stops is the same on every run.
        solver: ``"cbc"`` (bundled with PuLP), ``"highs"`` (needs highspy) or ``"auto"`` (HiGHS
            when highspy is installed, else CBC).
        switches: the planning switches that made the forbidden (``inf``) entries
            (``PlanOptions.restrictions``), named by the error when nothing is feasible.

    Returns:
        the ``Solution``; its ``status`` says which limit, if any, stopped the solver, and ``gap``
        how far from proven it stopped (a time limit makes the answer depend on the machine's
        speed and load: ``api.parallelize`` plans on rank 0 only and broadcasts, so the ranks of a
        job still agree).

    Raises:
        MemoryBudgetError: the budget is below the least memory any plan needs.
        SolverError: the solver found no feasible assignment.
    """
    blame = f"; no plan satisfies {', '.join(switches)}: allow what it forbids" if switches else ""
    if graph.min_memory() > memory_budget:
        raise MemoryBudgetError(memory_budget, graph.min_memory())
    prob = pulp.LpProblem("alpa_intra_op", pulp.LpMinimize)
    # s[v]: the strategy variables of v, None when v has a single strategy (always chosen)
    s = [None if len(costs) == 1 else [prob.add_variable(f"s_{v}_{p}", cat=pulp.LpBinary) for p in range(len(costs))]
         for v, costs in enumerate(graph.costs)]
    if math.isfinite(memory_budget):
        _drop_strategies_over_budget(graph, s, memory_budget)
    objective: dict = {}
    constant = 0.0
    per = _seconds_unit(graph)

    def add(x, coef):  # coef in seconds; the solver sees it in units of ``per``
        nonlocal constant
        if math.isinf(coef):  # forbidden
            if x is None:
                raise SolverError(f"the only strategy of an ILP variable is forbidden "
                                  f"({len(graph.costs)} variables){blame}")
            x.upBound = 0
        elif x is None:
            constant += coef / per
        elif coef:
            objective[x] = objective.get(x, 0.0) + coef / per

    for v, xs in enumerate(s):
        if xs is None:
            add(None, graph.costs[v][0])
            continue
        prob.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression([(x, 1) for x in xs]), pulp.LpConstraintEQ,
                                             rhs=1), f"one_{v}")
        for x, c in zip(xs, graph.costs[v]):
            add(x, c)
    pools = _used_pools(graph)
    parts = {(k, hides): (pool.extra, pool.edges) if hides else (pool.held_extra, pool.held_edges)
             for k, pool in pools.items() for hides in ((True, False) if pool.latency else (True,))}
    pool_terms = {key: _vector_terms(s, extra) for key, (extra, _) in parts.items()}  # S_P's, the held members'
    on_edges: dict[tuple[int, int], list] = {}  # a pool's matrices on an edge of the graph share its e
    for key, (_, edges) in parts.items():
        for (u, v), matrix in sorted(edges.items()):
            if (v, u) in graph.edges:
                u, v, matrix = v, u, [list(col) for col in zip(*matrix)]
            if (u, v) in graph.edges:
                on_edges.setdefault((u, v), []).append((key, matrix))
            else:
                pool_terms[key] += _edge_terms(prob, f"h{key[0]}{'h' if key[1] else 'k'}", s, u, v, matrix)[0]
    for (u, v), matrix in sorted(graph.edges.items()):
        terms = _edge_terms(prob, "", s, u, v, matrix, *(m for _, m in on_edges.get((u, v), ())))
        for x, c in terms[0]:
            add(x, c)
        for (key, _), more in zip(on_edges.get((u, v), ()), terms[1:]):
            pool_terms[key] += more
    for k, (key, (seconds, members)) in enumerate(sorted(graph.fixed.items(), key=lambda kv: str(kv[0]))):
        if any(s[v] is None for v, _ in members):  # always paid
            add(None, seconds)
            continue
        y = prob.add_variable(f"y_{k}", lowBound=0, upBound=1)  # minimized: its largest member's value
        for v, p in sorted(members):
            prob.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression([(y, 1), (s[v][p], -1)]),
                                                 pulp.LpConstraintGE, rhs=0), f"fixed_{k}_{v}_{p}")
        add(y, seconds)
    for g, ((u, readers), matrix) in enumerate(sorted(graph.moves.items())):
        _shared_move(prob, g, s, u, readers, matrix, add)
    _overlap_terms(prob, graph, pools, pool_terms, s, add, per)
    unit = max(memory_budget, 1.0) if math.isfinite(memory_budget) else 1.0
    r, mem_terms = _remat_terms(prob, graph, s, add, unit, per)
    prob.setObjective(pulp.LpAffineExpression(list(objective.items()), constant=constant))
    if math.isfinite(memory_budget):
        # in units of the budget: byte counts near 1e10 leave the solver's tolerances meaningless
        fixed = sum(mem[0] for mem, xs in zip(graph.memory, s) if xs is None)
        terms = [(x, m / unit) for mem, xs in zip(graph.memory, s) if xs is not None for x, m in zip(xs, mem) if m]
        terms += mem_terms
        prob.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression(terms), pulp.LpConstraintLE,
                                             rhs=(memory_budget - fixed) / unit), "memory")
        # a feasible start: each variable's least-memory strategy (memory has no edge terms),
        # every layer recomputed
        for v, (mem, xs) in enumerate(zip(graph.memory, s)):
            if xs is not None:
                least = min((p for p in range(len(xs)) if xs[p].upBound != 0),
                            key=lambda p: mem[p] + sum(g.act[v][p] for g in graph.remat if v in g.act), default=None)
                for p, x in enumerate(xs):
                    x.setInitialValue(1 if p == least else 0)
        for x in r:
            if x is not True:
                x.setInitialValue(1)
    engine = _solver(time_limit, solver, node_limit)
    status = prob.solve(engine)
    if pulp.LpStatus[status] not in ("Optimal",) and prob.sol_status not in (pulp.LpSolutionIntegerFeasible,):
        hint = (f"; the {engine.stopped} limit stopped it: try a larger node_limit or time_limit" if engine.stopped
                else "; no assignment satisfies the forced specs and options")
        raise SolverError(f"ILP solver status {pulp.LpStatus[status]} ({len(graph.costs)} variables, "
                          f"{len(graph.edges)} edges){blame or hint}", engine.stopped)
    choice = [0 if xs is None else max(range(len(xs)), key=lambda p: xs[p].value() or 0.0) for xs in s]
    remat = tuple(x is True or (x is not True and (x.value() or 0.0) > 0.5) for x in r)
    gap, stopped = None, "Optimal"
    if prob.sol_status == pulp.LpSolutionIntegerFeasible:  # stopped by a limit with an incumbent
        model = getattr(prob, "solverModel", None)  # HiGHS in-process reports its gap; the CBC process does not
        gap = float(model.getInfo().mip_gap) if model is not None else math.inf
        stopped = "NodeLimit" if engine.stopped == "nodes" else "TimeLimit"
    return Solution(choice, graph.objective(choice, remat), graph.memory_of(choice, remat), stopped, remat, gap)


def _drop_strategies_over_budget(graph: CostGraph, s, memory_budget: float) -> None:
    """Fix to 0 each strategy ``p`` of a variable ``v`` that alone leaves no room in the memory
    row: with every other variable at its least memory, an assignment choosing it needs at least
    ``m_v[p] - min m_v + graph.min_memory()`` bytes (memory has no edge terms; a remat group
    holds at least its least either way), so ``m_v[p] - min m_v`` above the row's slack
    ``M - min_memory`` cannot fit. The solver cannot see this itself: its presolve bounds the
    row's activity binary by binary, without the one-strategy-per-variable rows. Near the least
    memory (a stage's per-layer rows in a memory split) many strategies go, and with them much
    of the branch and bound. A margin of ``1e-6 M`` keeps every strategy the solver's own
    feasibility tolerance would admit, so the optimum is the same."""
    slack = memory_budget - graph.min_memory() + 1e-6 * max(memory_budget, 1.0)
    for mem, xs in zip(graph.memory, s):
        if xs is not None:
            least = min(mem)
            for m, x in zip(mem, xs):
                if m - least > slack:
                    x.upBound = 0


def _seconds_unit(graph: CostGraph) -> float:
    """The largest finite seconds figure of ``graph``'s objective terms (1.0 when there is none).

    The ILP is solved in this unit (objective, remat cost rows, overlap rows): the solvers'
    tolerances are absolute (HiGHS's primal and dual feasibility 1e-7), and against costs in
    seconds (1e-9 .. 1e-3) they let an answer stop well above the optimum. Measured: gpt-tiny (2
    blocks, 2x2 A100s, 1.1x its least memory) solved in seconds gave objectives 5e-5 apart for the
    same ILP with its rows in another order, each reported optimal; the ZeRO-3 MLP of
    tests/test_zero.py (``bucket_bytes=17_000``) with its overlap rows came out 4% above its
    optimum, "optimal" in HiGHS and in CBC alike; in this unit both give the optimum
    (docs/planner.md, "Determinism")."""
    rows = [*graph.costs, [f for f, _ in graph.fixed.values()], *graph.backward.values()]
    for m in itertools.chain(graph.edges.values(), graph.moves.values(), *(g.edges.values() for g in graph.remat),
                             *(p.edges.values() for p in graph.pools.values())):
        rows += m
    for g in [*graph.remat, *graph.pools.values()]:
        rows += g.extra.values()
    largest = max((abs(c) for row in rows for c in row if math.isfinite(c)), default=0.0)
    return largest or 1.0


def _edge_terms(prob, tag: str, s, u: int, v: int, *matrices) -> list[list]:
    """Per matrix, the terms ``(x, coefficient)`` (x None: a constant) of ``<e_uv, matrix>``,
    adding ``e_uv`` and its linearization rows to ``prob`` where a cost depends on both ends
    (module docstring); the matrices of one pair share ``e_uv``, over the classes of rows (columns)
    equal in all of them. ``tag`` tells apart the variables of several calls on one pair."""
    rows = _identical([sum((tuple(m[p]) for m in matrices), ()) for p in range(len(matrices[0]))])
    cols = _identical([sum((tuple(row[q] for row in m) for m in matrices), ()) for q in range(len(matrices[0][0]))])
    if len(rows) == 1:  # the costs depend on v's choice only (always so when u has one strategy)
        return [[(None if s[v] is None else s[v][q], c) for q, c in enumerate(m[0])] for m in matrices]
    if len(cols) == 1:  # ... on u's choice only
        return [[(s[u][p], row[0]) for p, row in enumerate(m)] for m in matrices]
    if not any(any(row) for m in matrices for row in m):
        return [[] for _ in matrices]

    def equal(terms, name):
        prob.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression(terms), pulp.LpConstraintEQ, rhs=0), name)

    # e over (row class, column class): identical rows (columns) need not be told apart
    e = [[prob.add_variable(f"e{tag}_{u}_{v}_{a}_{b}", lowBound=0, upBound=1) for b in range(len(cols))]
         for a in range(len(rows))]
    for a, ps in enumerate(rows):
        equal([(x, 1) for x in e[a]] + [(s[u][p], -1) for p in ps], f"row{tag}_{u}_{v}_{a}")
    for b, qs in enumerate(cols):
        equal([(e[a][b], 1) for a in range(len(rows))] + [(s[v][q], -1) for q in qs], f"col{tag}_{u}_{v}_{b}")
    return [[(e[a][b], m[ps[0]][qs[0]]) for a, ps in enumerate(rows) for b, qs in enumerate(cols)] for m in matrices]


def _remat_terms(prob, graph: CostGraph, s, add, unit: float, seconds: float):
    """The remat variables and constraints of the module docstring: returns (per group ``r_l``,
    ``True`` when forced), and the memory constraint's extra terms (``k_l``, ``z``), in ``unit``
    bytes; the cost rows (``w_l``) are in ``seconds`` (``_seconds_unit``)."""
    if not graph.remat:
        return [], []
    z = prob.add_variable("remat_peak", lowBound=0)
    rs, terms = [], [(z, 1.0)]

    def expr(vectors: dict[int, list[float]], scale: float) -> list:
        return [(x, c / scale) for x, c in _vector_terms(s, vectors)]

    def at_least(lhs, rhs_terms, name):  # lhs >= sum(rhs_terms) (None: a constant)
        const = sum(c for x, c in rhs_terms if x is None)
        prob.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression([(lhs, 1.0)] + [(x, -c) for x, c in rhs_terms
                                                                                     if x is not None]),
                                             pulp.LpConstraintGE, rhs=const), name)

    for i, g in enumerate(graph.remat):
        r = True if g.forced else prob.add_variable(f"r_{i}", cat=pulp.LpBinary)
        rs.append(r)
        big_a = RematGroup.bound(g.act) / unit
        big_e = (RematGroup.bound(g.extra) + sum(max(map(max, m)) for m in g.edges.values())) / seconds
        a, e = expr(g.act, unit), expr(g.extra, seconds)
        for (u, v), matrix in sorted(g.edges.items()):
            e += [(x, c / seconds) for x, c in _edge_terms(prob, f"r{i}", s, u, v, matrix)[0]]
        w = prob.add_variable(f"remat_w_{i}", lowBound=0)
        add(w, seconds)
        if r is True:
            at_least(z, a, f"remat_peak_{i}")
            at_least(w, e, f"remat_cost_{i}")
            continue
        k = prob.add_variable(f"remat_keep_{i}", lowBound=0)
        terms.append((k, 1.0))
        c = g.keep_scale
        at_least(k, [(x, c * y) for x, y in a] + [(r, -c * big_a)], f"remat_keep_{i}")
        at_least(z, a + [(r, big_a), (None, -big_a)], f"remat_peak_{i}")
        at_least(w, e + [(r, big_e), (None, -big_e)], f"remat_cost_{i}")
    return rs, terms


def _vector_terms(s, vectors: dict[int, list[float]]) -> list:
    """The terms ``(x, coefficient)`` (x None: a constant) of ``sum_v vec_v^T s_v``."""
    out = []
    for v, vec in vectors.items():
        out += [(None, vec[0])] if s[v] is None else [(x, c) for x, c in zip(s[v], vec) if c]
    return out


def _at_most(prob, terms, name: str) -> None:
    """``sum(terms) <= 0`` (a term's x None: a constant)."""
    prob.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression([(x, c) for x, c in terms if x is not None]),
                                         pulp.LpConstraintLE, rhs=-sum(c for x, c in terms if x is None)), name)


def _hides(pool: Pool) -> bool:
    """Whether ``pool`` can hide anything: its largest ``S_P`` above ``c_P``, and a weight."""
    return pool.bound() > pool.unhidden and bool(pool.weight)


def _used_pools(graph: CostGraph) -> dict[int, Pool]:
    """The pools of ``graph`` that can hide something (``_hides``) or charge a latency, by their
    index in key order."""
    ordered = sorted(graph.pools.items(), key=lambda kv: str(kv[0]))
    return {k: pool for k, (_, pool) in enumerate(ordered) if _hides(pool) or pool.latency}


def _overlap_terms(prob, graph: CostGraph, pools: dict[int, Pool], pool_terms: dict[tuple, list], s, add,
                   seconds: float) -> None:
    """The variables ``h_P`` and ``z_P`` and the rows of the overlap (module docstring), and each
    pool's latency ``y_P >= x`` for every term ``x`` of its members (paid once if any is chosen),
    for ``pools`` (``_used_pools``), whose ``S_P`` has the terms ``pool_terms[k, True]`` and whose
    held members ``pool_terms[k, False]``, in units of ``seconds`` (``_seconds_unit``)."""
    hidden = []
    for k, pool in pools.items():
        if pool.latency:
            members = pool_terms[k, True] + pool_terms[k, False]
            if any(x is None and c > 0 for x, c in members):
                y = None
            else:
                y = prob.add_variable(f"pool_y_{k}", lowBound=0, upBound=1)
                for i, (x, c) in enumerate(members):
                    if c > 0:
                        _at_most(prob, [(x, 1.0), (y, -1.0)], f"pool_y_{k}_{i}")
            if pool.grouped:  # w >= latency y, w >= S_P: w = max(latency y, S_P), in units of ``seconds``
                w = prob.add_variable(f"pool_w_{k}", lowBound=0)
                add(w, seconds)
                _at_most(prob, [(y, pool.latency / seconds), (w, -1.0)], f"pool_w_{k}")
                _at_most(prob, [(x, c / seconds) for x, c in pool_terms[k, True]] + [(w, -1.0)], f"pool_ws_{k}")
            else:
                add(y, pool.latency)
        if not _hides(pool):
            continue
        terms = [(x, -c / seconds) for x, c in pool_terms[k, True]]
        h = prob.add_variable(f"hide_{k}", lowBound=0)
        add(h, -pool.weight * seconds)
        hidden.append((h, 1.0))
        if pool.unhidden > 0:
            z = prob.add_variable(f"hide_z_{k}", cat=pulp.LpBinary)
            _at_most(prob, [(h, 1.0), (z, pool.unhidden / seconds)] + terms, f"hide_{k}")
            _at_most(prob, [(h, 1.0), (z, (pool.unhidden - pool.bound()) / seconds)], f"hide_z_{k}")
        else:
            _at_most(prob, [(h, 1.0)] + terms, f"hide_{k}")
    if hidden:
        _at_most(prob, hidden + [(x, -c / seconds) for x, c in _vector_terms(s, graph.backward)], "hide_budget")


def _shared_move(prob, g: int, s, u: int, readers, matrix, add) -> None:
    """The variables and rows of shared move ``g`` (module docstring)."""
    targets = [t for t in range(len(matrix[0])) if any(row[t] for row in matrix)]
    rows = _identical(matrix)
    m = {(a, t): prob.add_variable(f"m_{g}_{a}_{t}", lowBound=0, upBound=1) for a in range(len(rows)) for t in targets}
    for (a, t), x in m.items():
        add(x, matrix[rows[a][0]][t])

    def row(terms, sense, rhs, name):
        prob.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression(terms), sense, rhs=rhs), name)

    for c, (v, wants) in enumerate(readers):
        per_class = [[] for _ in rows]  # f_c[a, t] over t
        for t in targets:
            # y_c[t] = sum(y) + always
            y = [] if s[v] is None else [(s[v][q], -1) for q, w in enumerate(wants) if w == t]
            always = int(s[v] is None and wants[0] == t)
            if not y and not always:
                continue
            if len(rows) == 1:  # f_c = y_c
                row([(m[0, t], 1)] + y, pulp.LpConstraintGE, always, f"or_{g}_{c}_{t}")
                continue
            f = [prob.add_variable(f"f_{g}_{c}_{a}_{t}", lowBound=0) for a in range(len(rows))]
            row([(x, 1) for x in f] + y, pulp.LpConstraintEQ, always, f"y_{g}_{c}_{t}")
            for a, x in enumerate(f):
                row([(m[a, t], 1), (x, -1)], pulp.LpConstraintGE, 0, f"or_{g}_{c}_{a}_{t}")
                per_class[a].append((x, 1))
        for a, terms in enumerate(per_class):
            if terms:
                row(terms + [(s[u][p], -1) for p in rows[a]], pulp.LpConstraintLE, 0, f"x_{g}_{c}_{a}")


LIMITS = {"NodeLimit": "nodes", "TimeLimit": "time"}
"""``Solution.status`` -> the ``"limit"`` of its ``Plan.solver_limits`` entry."""


def solver_limits(ilp: str, sol) -> list[dict]:
    """``Plan.solver_limits`` entries of one solve (``sol``: a ``Solution`` or anything with its
    ``status`` and ``gap``): ``[]`` when it was proven optimal, else ``{"ilp", "limit": "nodes" |
    "time", "gap"}`` (``"time"``: the wall-clock backstop stopped it, so a rerun may differ)."""
    if sol.status not in LIMITS:
        return []
    return [{"ilp": ilp, "limit": LIMITS[sol.status], "gap": sol.gap if math.isfinite(sol.gap) else None}]


def brute_force(graph: CostGraph, memory_budget: float = math.inf) -> Solution:
    """Exhaustive enumeration of every assignment (for tests on small graphs)."""
    best = None
    remats = list(itertools.product(*(((True,) if g.forced else (False, True)) for g in graph.remat)))
    for choice in itertools.product(*(range(len(c)) for c in graph.costs)):
        for remat in remats:
            if graph.memory_of(choice, remat) > memory_budget:
                continue
            obj = graph.objective(list(choice), remat)
            if math.isinf(obj):
                continue
            if best is None or obj < best.objective - 1e-12:
                best = Solution(list(choice), obj, graph.memory_of(choice, remat), "Optimal", remat)
    if best is None:
        raise MemoryBudgetError(memory_budget, graph.min_memory())
    return best
