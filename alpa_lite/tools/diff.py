"""``alpa-lite diff a.json b.json``: what changed between two plans, SPMD or pipelined.

Parameters whose storage spec or ZeRO stage changed (or that only one plan holds), collectives added or
removed (per stage for a pipeline; a collective is its stage, kind, phase, mesh axes, bytes,
node and tensor), and the predicted step time and memory per device of both.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from rich.table import Table

from ..core.plan import PipelinePlan, Plan


@dataclass
class PlanDiff:
    """Attributes:
        params: FQN -> (spec in a, spec in b), for every parameter whose spec or ZeRO stage
            differs (None: the plan does not hold it); a spec with a ZeRO stage reads
            ``"RR ZeRO-2 over 0"`` (stage 2 over mesh axis 0), a pipelined plan's ``"stage i: SPEC"``.
        added / removed: collectives of b not in a / of a not in b, as
            ``(stage, kind, phase, mesh axes, bytes, node, tensor)`` (stage None for an SPMD plan),
            with multiplicity.
        step_seconds / memory_bytes: (a, b), seconds and bytes per device.
        layout: (a, b) one line each: the mesh, and for a pipeline its stages, submeshes and B.
    """

    params: dict[str, tuple[str | None, str | None]]
    added: list[tuple]
    removed: list[tuple]
    step_seconds: tuple[float, float]
    memory_bytes: tuple[float, float]
    layout: tuple[str, str]


def _storage(plan: Plan) -> dict[str, str]:
    """FQN -> storage spec, with its ZeRO stage and mesh axes when it has one (``"RR ZeRO-2 over 0"``)."""
    out = {}
    for fqn, spec in plan.param_specs.items():
        stage, axes = plan.zero_stages.get(fqn, (0, ()))
        out[fqn] = f"{spec} ZeRO-{stage} over {','.join(map(str, axes))}" if stage else str(spec)
    return out


def _specs(plan: Plan | PipelinePlan) -> dict[str, str]:
    if isinstance(plan, PipelinePlan):
        out: dict[str, str] = {}
        for i, s in reversed(list(enumerate(plan.stages))):  # a weight two stages hold: the first's
            out |= {fqn: f"stage {i}: {spec}" for fqn, spec in _storage(s.plan).items()}
        return out
    return _storage(plan)


def _collectives(plan: Plan | PipelinePlan) -> Counter:
    stages = [(i, s.plan) for i, s in enumerate(plan.stages)] if isinstance(plan, PipelinePlan) else [(None, plan)]
    return Counter((i, c.kind, c.phase, tuple(c.mesh_axes), float(c.nbytes), c.node, c.tensor)
                   for i, p in stages for c in p.collectives)


def _layout(plan: Plan | PipelinePlan) -> str:
    mesh = "x".join(map(str, plan.mesh.shape))
    if not isinstance(plan, PipelinePlan):
        return f"SPMD on {mesh}"
    stages = ", ".join(f"layers {s.layers[0]}-{s.layers[1] - 1} on {s.submesh[0]}x{s.submesh[1]}" for s in plan.stages)
    return f"pipeline on {mesh}: {stages}; B={plan.num_microbatches} ({plan.schedule})"


def diff_plans(a: Plan | PipelinePlan, b: Plan | PipelinePlan) -> PlanDiff:
    """What changed from plan ``a`` to plan ``b`` (``PlanDiff``)."""
    sa, sb = _specs(a), _specs(b)
    params = {f: (sa.get(f), sb.get(f)) for f in list(sa) + [f for f in sb if f not in sa] if sa.get(f) != sb.get(f)}
    ca, cb = _collectives(a), _collectives(b)
    return PlanDiff(params, sorted((cb - ca).elements(), key=str), sorted((ca - cb).elements(), key=str),
                    (a.step_seconds, b.step_seconds), (a.memory_bytes, b.memory_bytes), (_layout(a), _layout(b)))


def diff_tables(d: PlanDiff, names: tuple[str, str] = ("a", "b")) -> list[Table]:
    """The diff as ``rich`` tables: summary, changed parameters, collectives added / removed."""
    summary = Table(title=f"{names[0]} -> {names[1]}")
    for col in ("", names[0], names[1], "change"):
        summary.add_column(col, justify="left" if not col else "right")
    (ta, tb), (ma, mb) = d.step_seconds, d.memory_bytes
    summary.add_row("step time (predicted)", f"{ta * 1e3:.3f} ms", f"{tb * 1e3:.3f} ms",
                    f"{(tb - ta) * 1e3:+.3f} ms ({(tb / ta - 1) if ta else 0:+.2%})")
    summary.add_row("memory per device", f"{ma / 2**30:.3f} GiB", f"{mb / 2**30:.3f} GiB",
                    f"{(mb - ma) / 2**30:+.3f} GiB")
    summary.add_row("layout", d.layout[0], d.layout[1], "same" if d.layout[0] == d.layout[1] else "changed")
    params = Table(title=f"{len(d.params)} parameter spec{'s' if len(d.params) != 1 else ''} changed")
    for col in ("parameter", names[0], names[1]):
        params.add_column(col)
    for fqn, (x, y) in d.params.items():
        params.add_row(fqn, x or "-", y or "-")
    colls = Table(title=f"collectives: {len(d.added)} added, {len(d.removed)} removed")
    for col in ("", "stage", "kind", "phase", "mesh axes", "bytes", "node", "tensor"):
        colls.add_column(col)
    for sign, rows in (("+", d.added), ("-", d.removed)):
        for stage, kind, phase, axes, nbytes, node, tensor in rows:
            colls.add_row(sign, "-" if stage is None else str(stage), kind, phase, ",".join(map(str, axes)),
                          f"{nbytes:.0f}", node, tensor)
    return [summary, params, colls]
