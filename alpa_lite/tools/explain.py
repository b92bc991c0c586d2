"""Readable views of a ``Plan``: summary, parameter specs, collectives (rich tables).

Answers a user's first question about a plan, "why this?", from the data the plan holds.
"""
from __future__ import annotations

import difflib
import math
import re
from collections import defaultdict

from rich.table import Table

from ..core.plan import PipelinePlan, Plan
from .display import count, stages_table


def _seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} us"


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.3g} GB/s"


def _budget(b: float) -> str:
    return "an unlimited budget" if b >= 2**70 else f"a {_bytes(b)} budget"


def _bytes(b: float) -> str:
    if b >= 2**70:
        return "unlimited"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def summary_table(plan: Plan, title: str = "plan") -> Table:
    """Predicted step time (compute / communication), memory per device, planning statistics."""
    t = Table(title=title, show_header=False)
    t.add_column("", style="bold")
    t.add_column("")
    m = plan.mesh
    t.add_row("mesh", f"{m.shape[0]}x{m.shape[1]} ({m.cluster}): alpha "
                      f"{', '.join(_seconds(a) for a in m.mesh_alpha)}; bandwidth "
                      f"{', '.join(_rate(1 / b) for b in m.mesh_beta)} (axis 0, axis 1)")
    budget = plan.options.get("memory_budget") or m.memory_bytes
    st = plan.stats
    if plan.solver_limits:  # never silent: not proven optimal, and after a time limit not reproducible
        chosen = plan.options.get("plan", plan.options)
        limit = lambda e: e.get("limit", "time")  # noqa: E731 (plans made before node limits: time)
        timed = any(limit(e) == "time" for e in plan.solver_limits)
        t.add_row("[yellow]solver limit reached[/]", "; ".join(
            ("" if "stage" not in e else f"stage {e['stage']} ") + f"{e['ilp']}: {'node' if limit(e) == 'nodes' else 'time'} limit, gap "
            + ("unknown" if e["gap"] is None else f"{e['gap']:.2%}") for e in plan.solver_limits)
            + (f" (wall-clock limit of {chosen.get('time_limit')} s reached: not proven optimal, a rerun may plan "
               "otherwise)" if timed else f" (node limit of {chosen.get('node_limit')}: not proven optimal; the same "
                                          "input plans the same)"))
    if isinstance(plan, PipelinePlan):  # stages overlap in time: the step is the pipeline formula, not a sum
        stages, microbatches = count(len(plan.stages), "stage", "stages"), count(plan.num_microbatches, "microbatch",
                                                                                  "microbatches")
        t.add_row("step time (predicted)", f"{_seconds(plan.step_seconds)}: {stages}, {microbatches} "
                                           f"({plan.schedule}), bubble {plan.bubble_fraction:.1%}")
        t.add_row("memory per device", f"{_bytes(plan.memory_bytes)} (the fullest stage) of {_budget(budget)}")
        t.add_row("collectives (stage plans)", str(sum(len(s.plan.collectives) for s in plan.stages)))
        if st:
            t.add_row("planning time", f"{st.get('total_s', 0):.2f} s ({st.get('ilp_solves')} stage ILPs solved, "
                                       f"{st.get('cache_hits')} answers reused, {st.get('layers')} layers"
                                       f"{_graph_read(st)})")
        return t
    t.add_row("step time (predicted)", f"{_seconds(plan.step_seconds)} = compute {_seconds(plan.compute_seconds)}"
                                       f" + communication {_seconds(plan.comm_seconds)}"
                                       f" - hidden behind backward {_seconds(plan.overlap_seconds)}")
    t.add_row("memory per device", f"{_bytes(plan.memory_bytes)} of {_budget(budget)}")
    t.add_row("collectives per step", str(len(plan.collectives)))
    if st:
        t.add_row("graph / ILP", f"{st.get('nodes')} nodes -> {st.get('ilp_variables')} variables, "
                                 f"{st.get('ilp_edges')} edges ({st.get('ilp_strategy_vars')} + "
                                 f"{st.get('ilp_edge_vars')} ILP columns)")
        t.add_row("planning time", f"capture {st.get('capture_s', 0):.2f} s, strategies {st.get('strategy_s', 0):.2f} s, "
                                   f"ILP {st.get('ilp_s', 0):.2f} s{_graph_read(st)}")
    return t


def _graph_read(stats: dict) -> str:
    """How many captured graphs a plan read from its cache (none: nothing to say)."""
    hits = stats.get("graph_hits", 0)
    return f"; {hits} captured graph{'s' if hits > 1 else ''} read from the cache" if hits else ""


def param_table(plan: Plan, max_rows: int = 40) -> Table:
    """Parameter specs and ZeRO stages (``Plan.zero_stages``: ``"2 @ axis 1"``); parameters of
    repeated layers (``blocks.3.``) with the same as another layer are folded into one row
    (``blocks.*``)."""
    t = Table(title="parameter sharding specs")
    t.add_column("parameter")
    t.add_column("spec")
    t.add_column("ZeRO")
    groups: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    zero = plan.zero_stages
    for fqn, spec in plan.param_specs.items():
        stage, axes = zero.get(fqn, (0, ()))
        where = _zero(stage, axes)
        groups[(re.sub(r"\.(\d+)\.", ".*.", fqn), spec, where)].append(fqn)
    rows = sorted(groups.items(), key=lambda kv: min(plan_order(plan, f) for f in kv[1]))
    for (pattern, spec, where), members in rows[:max_rows]:
        t.add_row(pattern if len(members) > 1 else members[0], spec, where)
    if len(rows) > max_rows:
        t.add_row(f"... {len(rows) - max_rows} more", "", "")
    return t


def _zero(stage: int, axes) -> str:
    """A ZeRO stage and its mesh axes as the tables show them: ``"2 @ axis 0,1"``, ``"-"`` for none."""
    return f"{stage} @ axis {','.join(map(str, axes))}" if stage else "-"


def plan_order(plan: Plan, fqn: str) -> int:
    return list(plan.param_specs).index(fqn)


def collective_table(plan: Plan) -> Table:
    """Collectives of one step by kind, phase and mesh axis: count, bytes, predicted time."""
    t = Table(title="collectives per training step")
    for col in ("kind", "phase", "mesh axes", "count", "bytes", "predicted time"):
        t.add_column(col, justify="right" if col in ("count", "bytes", "predicted time") else "left")
    agg: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for c in plan.collectives:
        a = agg[(c.kind, c.phase, ''.join(map(str, c.mesh_axes)))]
        a[0] += 1
        a[1] += c.nbytes
        a[2] += c.seconds
    for (kind, phase, axis), (n, b, s) in sorted(agg.items()):
        t.add_row(kind, phase, axis, str(n), _bytes(b), _seconds(s))
    return t


def plan_tables(plan: Plan | PipelinePlan, title: str, max_rows: int = 40) -> list[Table]:
    """What ``alpa-lite plan`` and ``alpa-lite train`` print of a plan: its summary, parameter
    specs (at most ``max_rows`` rows), and its stages (``display.stages_table``) for a pipelined
    plan, else its collectives."""
    last = stages_table(plan) if isinstance(plan, PipelinePlan) else collective_table(plan)
    return [summary_table(plan, title), param_table(plan, max_rows), last]


def node_table(plan: Plan, node: str) -> Table:
    """Every candidate strategy of one graph node (or parameter FQN) the ILP chose among
    (``intra_op.strategy_table`` under the plan's options: ZeRO-1/2 variants included, forced
    specs applied) with its cost terms, the chosen one marked: "why this?" for a single op. The
    "operands in" column prices moving each operand from its producer's chosen spec to the
    strategy's (the graph edge's ``ReshardCosts``, forward and backward, a parameter's gradient
    sync included), the other nodes held as chosen. Needs a plan made in this process.

    Raises:
        ValueError: no captured graph (a plan read from a file), or no such node or parameter
            (the message lists close names).
    """
    from ..compiler.intra_op import strategy_table
    from ..core.options import PlanOptions
    from ..core.resharding import reshard_costs

    cg = plan.captured
    if cg is None:
        raise ValueError("explaining a node needs the captured graph: use a plan made by alpa_lite.plan() here")
    by_fqn = {fqn: ph for ph, fqn in cg.param_fqns.items()}
    name = by_fqn.get(node, node)
    if name not in plan.nodes:
        close = difflib.get_close_matches(node, [*plan.nodes, *by_fqn], n=5, cutoff=0.5)
        raise ValueError(f"no node or parameter {node!r}" + (f"; close: {', '.join(close)}" if close else ""))
    chosen = plan.nodes[name]
    options = PlanOptions.from_dict(plan.options)
    ns = strategy_table(cg, plan.mesh, options)[name]
    reshard = reshard_costs(plan.mesh, options)

    def moved_in(s) -> float:
        total = 0.0
        for src, i, dst, gp in zip(chosen.inputs, chosen.input_results, s.in_specs, s.grad_partial):
            val = cg.node(src).meta["val"]
            val = val[i] if isinstance(val, (tuple, list)) else val
            made = plan.nodes[src]
            total += reshard(made.out_specs[i], dst, gp, tuple(val.shape), val.element_size(),
                             src in cg.param_fqns, (made.zero_stage, tuple(made.zero_axes)))
        return total

    what = cg.param_fqns.get(name) or cg.buffer_fqns.get(name) or str(cg.node(name).target)
    t = Table(title=f"strategies of {name} ({what})")
    for col in ("", "strategy", "ZeRO", "operand specs", "result", "partial", "compute", "all-reduce",
                "operands in", "memory"):
        t.add_column(col)
    key = lambda s: (s.name, tuple(s.out_specs), s.zero_stage, tuple(s.zero_axes))  # noqa: E731
    mine = (chosen.strategy, tuple(chosen.out_specs), chosen.zero_stage, tuple(chosen.zero_axes))
    for s in sorted(ns.strategies, key=lambda s: s.cost):
        moved = moved_in(s)
        t.add_row("*" if key(s) == mine else "", s.name, _zero(s.zero_stage, s.zero_axes),
                  " ".join(map(str, s.in_specs)), " ".join(map(str, s.out_specs)),
                  "".join(map(str, s.partial_axes)) or "-", _seconds(s.compute), _seconds(s.comm),
                  "forbidden" if math.isinf(moved) else _seconds(moved), _bytes(s.memory))
    t.caption = ("* chosen; operands in: resharding each operand from its producer's chosen spec; moving the result "
                 "to its consumers is priced on their rows")
    return t
