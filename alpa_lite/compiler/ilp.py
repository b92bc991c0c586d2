r"""The intra-operator ILP (Alpa, OSDI'22, section 4.2), solved with PuLP (CBC, or HiGHS in-process).

Given a cost graph with variables ``v`` (each a node, or a group of merged nodes) holding
``k_v`` candidate strategies and edges ``(u, v)`` with resharding cost matrices ``R_uv``:

    variables   s_v in {0,1}^{k_v},  1^T s_v = 1                    (one strategy per variable)
                e_uv in [0,1]^{k_u x k_v}
    linearize   sum_q e_uv[p, q] = s_u[p],   sum_p e_uv[p, q] = s_v[q]
                (with s one-hot these force e_uv = s_u s_v^T, so e may stay continuous)
    memory      sum_v m_v^T s_v <= M                                 (bytes per device)
    minimize    sum_v c_v^T s_v + sum_uv <e_uv, R_uv>                (seconds per step)

Strategies of ``u`` whose rows of ``R_uv`` are equal (the same output spec, seen from ``v``), and
strategies of ``v`` with equal columns (the same input spec), need not be told apart on that edge:
``e_uv`` runs over classes of equal rows and columns, with ``s_u[p]`` summed over a row class
(``s_v[q]`` over a column class) in the linearization. One row or column class makes the edge
linear in the other end's ``s``: no ``e`` at all. The optimum is unchanged; on GPT-3 39B's
per-layer stage ILPs the columns drop by about a quarter.

This module knows nothing about torch: the planner builds the ``CostGraph``. Memory has no
edge terms, so the least memory any solution needs is ``sum_v min_p m_v[p]``; a budget below
it is reported with that figure instead of trusting a solver's "infeasible".
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import pulp


class MemoryBudgetError(ValueError):
    """No sharding plan fits the memory budget; ``minimum_bytes`` is the least any plan needs."""

    def __init__(self, budget: float, minimum: float):
        self.budget, self.minimum_bytes = budget, minimum
        super().__init__(f"no plan fits the memory budget of {budget / 2**30:.3f} GiB per device; "
                         f"the least any plan needs is {minimum / 2**30:.3f} GiB ({minimum:.0f} bytes)")


class SolverError(RuntimeError):
    """The ILP solver returned no optimal solution (time limit with no incumbent, or failure)."""


@dataclass
class CostGraph:
    """Variables with per-strategy costs and memory, and edges with cost matrices.

    Attributes:
        costs: per variable, seconds for each strategy.
        memory: per variable, bytes per device for each strategy.
        edges: ``(u, v) -> matrix`` with ``matrix[p][q]`` seconds when u picks p and v picks q.
        names: per variable, a readable name (for LP files and debugging).
    """

    costs: list[list[float]]
    memory: list[list[float]]
    edges: dict[tuple[int, int], list[list[float]]] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)

    def add_edge(self, u: int, v: int, matrix: list[list[float]]) -> None:
        """Add (or accumulate into) the edge ``u -> v``; a self edge adds its diagonal to ``u``."""
        if u == v:
            for p in range(len(self.costs[u])):
                self.costs[u][p] += matrix[p][p]
            return
        if (v, u) in self.edges:
            u, v, matrix = v, u, [list(col) for col in zip(*matrix)]
        if (u, v) in self.edges:
            old = self.edges[(u, v)]
            matrix = [[a + b for a, b in zip(r1, r2)] for r1, r2 in zip(old, matrix)]
        self.edges[(u, v)] = matrix

    def objective(self, choice: list[int]) -> float:
        """Seconds of a full assignment (one strategy index per variable)."""
        return sum(c[p] for c, p in zip(self.costs, choice)) + sum(
            m[choice[u]][choice[v]] for (u, v), m in self.edges.items())

    def memory_of(self, choice: list[int]) -> float:
        return sum(m[p] for m, p in zip(self.memory, choice))

    def min_memory(self) -> float:
        return sum(min(m) for m in self.memory)


@dataclass
class Solution:
    """An assignment and its figures. ``gap``: None when the solver proved it optimal; when the
    time limit was reached first, the relative gap between it and the solver's lower bound
    (``math.inf`` where the solver reports none: CBC run as a process)."""

    choice: list[int]
    objective: float
    memory: float
    status: str
    gap: float | None = None


def _identical(vectors) -> list[list[int]]:
    """Indices of equal vectors, grouped in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for i, vec in enumerate(vectors):
        groups.setdefault(tuple(vec), []).append(i)
    return list(groups.values())


def highs_available() -> bool:
    """Whether HiGHS can solve in this process (the ``highspy`` package, ``alpa-lite[highs]``)."""
    return pulp.HiGHS().available()


def _solver(time_limit: float, name: str):
    if name == "highs" and not highs_available():
        raise SolverError("solver='highs' needs the highspy package: pip install 'alpa-lite[highs]' "
                          "(or use solver='auto', which falls back to CBC)")
    if name == "highs" or (name == "auto" and highs_available()):
        # in-process: no model file and no solver process per ILP, as CBC needs
        return pulp.HiGHS(msg=False, timeLimit=time_limit, threads=1, random_seed=0)
    # CBC's primal heuristics cost more than they save on these small problems (3x on the
    # per-layer ILPs of GPT-3 39B): branch and bound from the feasible start ``solve`` gives
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, threads=1, warmStart=True,
                             options=["randomSeed 1", "randomCbcSeed 1", "heuristicsOnOff off"])


def solve(graph: CostGraph, memory_budget: float = math.inf, time_limit: float = 60.0,
          solver: str = "cbc") -> Solution:
    """Solve the ILP exactly (up to ``time_limit`` seconds of solver time).

    Args:
        graph: the cost graph.
        memory_budget: bytes per device.
        time_limit: seconds given to the MILP solver; the best incumbent is used when reached.
        solver: ``"cbc"`` (bundled with PuLP), ``"highs"`` (needs highspy) or ``"auto"`` (HiGHS
            when highspy is installed, else CBC).

    Returns:
        the ``Solution``; its ``gap`` says whether the time limit was reached (then the answer
        depends on the machine's speed and load: ``api.parallelize`` plans on rank 0 only and
        broadcasts, so the ranks of a job still agree).

    Raises:
        MemoryBudgetError: the budget is below the least memory any plan needs.
        SolverError: the solver found no feasible assignment.
    """
    if graph.min_memory() > memory_budget:
        raise MemoryBudgetError(memory_budget, graph.min_memory())
    prob = pulp.LpProblem("alpa_intra_op", pulp.LpMinimize)
    # s[v]: the strategy variables of v, None when v has a single strategy (always chosen)
    s = [None if len(costs) == 1 else [pulp.LpVariable(f"s_{v}_{p}", cat=pulp.LpBinary) for p in range(len(costs))]
         for v, costs in enumerate(graph.costs)]
    objective: dict = {}
    constant = 0.0

    def add(x, coef):
        nonlocal constant
        if x is None:
            constant += coef
        elif coef:
            objective[x] = objective.get(x, 0.0) + coef

    def equal(terms, name):
        prob.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression(terms), pulp.LpConstraintEQ, rhs=0), name)

    for v, xs in enumerate(s):
        if xs is None:
            add(None, graph.costs[v][0])
            continue
        prob.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression([(x, 1) for x in xs]), pulp.LpConstraintEQ,
                                             rhs=1), f"one_{v}")
        for x, c in zip(xs, graph.costs[v]):
            add(x, c)
    for (u, v), matrix in sorted(graph.edges.items()):
        rows, cols = _identical(matrix), _identical(list(zip(*matrix)))
        if len(rows) == 1:  # the cost depends on v's choice only (always so when u has one strategy)
            for q, c in enumerate(matrix[0]):
                add(None if s[v] is None else s[v][q], c)
            continue
        if len(cols) == 1:  # ... on u's choice only
            for p, row in enumerate(matrix):
                add(s[u][p], row[0])
            continue
        if not any(any(row) for row in matrix):
            continue
        # e over (row class, column class): identical rows (columns) need not be told apart
        e = [[pulp.LpVariable(f"e_{u}_{v}_{a}_{b}", lowBound=0, upBound=1) for b in range(len(cols))]
             for a in range(len(rows))]
        for a, ps in enumerate(rows):
            equal([(x, 1) for x in e[a]] + [(s[u][p], -1) for p in ps], f"row_{u}_{v}_{a}")
        for b, qs in enumerate(cols):
            equal([(e[a][b], 1) for a in range(len(rows))] + [(s[v][q], -1) for q in qs], f"col_{u}_{v}_{b}")
        for a, ps in enumerate(rows):
            for b, qs in enumerate(cols):
                add(e[a][b], matrix[ps[0]][qs[0]])
    prob.setObjective(pulp.LpAffineExpression(list(objective.items()), constant=constant))
    if math.isfinite(memory_budget):
        # in units of the budget: byte counts near 1e10 leave the solver's tolerances meaningless
        unit = max(memory_budget, 1.0)
        fixed = sum(mem[0] for mem, xs in zip(graph.memory, s) if xs is None)
        terms = [(x, m / unit) for mem, xs in zip(graph.memory, s) if xs is not None for x, m in zip(xs, mem) if m]
        prob.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression(terms), pulp.LpConstraintLE,
                                             rhs=(memory_budget - fixed) / unit), "memory")
        # a feasible start: each variable's least-memory strategy (memory has no edge terms)
        for mem, xs in zip(graph.memory, s):
            if xs is not None:
                least = min(range(len(xs)), key=mem.__getitem__)
                for p, x in enumerate(xs):
                    x.setInitialValue(1 if p == least else 0)
    status = prob.solve(_solver(time_limit, solver))
    if pulp.LpStatus[status] not in ("Optimal",) and prob.sol_status not in (pulp.LpSolutionIntegerFeasible,):
        raise SolverError(f"ILP solver status {pulp.LpStatus[status]} ({len(graph.costs)} variables, "
                          f"{len(graph.edges)} edges); try a longer time_limit")
    choice = [0 if xs is None else max(range(len(xs)), key=lambda p: xs[p].value() or 0.0) for xs in s]
    gap = None
    if prob.sol_status == pulp.LpSolutionIntegerFeasible:  # stopped by the time limit with an incumbent
        model = getattr(prob, "solverModel", None)  # HiGHS in-process reports its gap; the CBC process does not
        gap = float(model.getInfo().mip_gap) if model is not None else math.inf
    return Solution(choice, graph.objective(choice), graph.memory_of(choice),
                    "Optimal" if gap is None else "TimeLimit", gap)


def solver_limits(ilp: str, gap: float | None) -> list[dict]:
    """``Plan.solver_limits`` entries of one solve: ``[]`` when it was proven optimal."""
    return [] if gap is None else [{"ilp": ilp, "gap": gap if math.isfinite(gap) else None}]


def brute_force(graph: CostGraph, memory_budget: float = math.inf) -> Solution:
    """Exhaustive enumeration of every assignment (for tests on small graphs)."""
    best = None
    for choice in itertools.product(*(range(len(c)) for c in graph.costs)):
        if graph.memory_of(choice) > memory_budget:
            continue
        obj = graph.objective(list(choice))
        if best is None or obj < best.objective - 1e-12:
            best = Solution(list(choice), obj, graph.memory_of(choice), "Optimal")
    if best is None:
        raise MemoryBudgetError(memory_budget, graph.min_memory())
    return best
