"""What a user asks about a pipelined plan: its stages as a table, one step as a Gantt chart."""
from __future__ import annotations

from pathlib import Path

from ..core.plan import PipelinePlan
from ..core.schedules import BACKWARD_SHARE, get_schedule, simulate


def _require_stages(plan) -> None:
    if not isinstance(plan, PipelinePlan):
        raise ValueError("this plan has no pipeline stages; plan with pipeline='auto' or num_stages=K")


def count(n: int, one: str, many: str) -> str:
    """``count(1, "stage", "stages")`` is ``"1 stage"``, ``count(2, ...)`` ``"2 stages"``."""
    return f"{n} {one if n == 1 else many}"


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


def _ms(x: float) -> str:
    return f"{x * 1e3:.3f} ms"


def stages_table(plan: PipelinePlan):
    """A ``rich.table.Table`` of the plan's stages: layers, modules, submesh and ranks, logical
    mesh, time per microbatch (of which transfer), once-per-step time, memory, microbatches in
    flight; the caption gives the schedule, B, the bubble fraction and the step time.

    Raises:
        ValueError: the plan has no stages.
    """
    from rich.table import Table

    _require_stages(plan)
    layers = plan.layers or None
    n = len(plan.stages)
    t = Table(title=f"pipeline: {count(n, 'stage', 'stages')}, {plan.schedule}, "
                    f"{count(plan.num_microbatches, 'microbatch', 'microbatches')}",
              caption=f"predicted step {_ms(plan.step_seconds)}, bubble {plan.bubble_fraction:.1%}")
    for col in ("stage", "layers", "modules", "submesh", "ranks", "logical mesh", "t / microbatch", "transfer",
                "once / step", "memory", "in flight"):
        t.add_column(col, justify="right" if col in ("t / microbatch", "transfer", "once / step", "memory") else "left")
    for i, s in enumerate(plan.stages):
        mods = ""
        if layers is not None:
            names = [m for layer in layers[s.layers[0]:s.layers[1]] for m in layer.modules]
            mods = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}" if names else ""
        ranks = s.ranks if len(s.ranks) <= 4 else f"{s.ranks[0]} .. {s.ranks[-1]}"
        t.add_row(str(i), f"{s.layers[0]} .. {s.layers[1] - 1}", mods, f"{s.submesh[0]}x{s.submesh[1]}", str(ranks),
                  "x".join(map(str, s.plan.mesh.shape)), _ms(s.seconds), _ms(s.transfer_seconds), _ms(s.once_seconds),
                  _gib(s.memory_bytes), str(s.in_flight))
    return t


def schedule_chart(plan: PipelinePlan, path: str | Path, title: str | None = None) -> Path:
    """Save a Gantt chart (matplotlib, PNG by the suffix) of one training step: per device group
    (one stage each, or ``v`` under interleaved 1F1B: boxes ``F3.1`` are microbatch 3 on chunk 1,
    later chunks with a thicker edge), the forward (light, ``F``), backward (dark, ``B``) and,
    under a split backward (ZB-H1), weight pass (dark, hatched, ``W``) of every microbatch,
    simulated from the predicted stage times
    (forward = 1/3 of a stage's time, backward = 2/3: backward costs 2x the forward FLOPs; a
    split backward's weight pass is half of it).

    Raises:
        ValueError: the plan has no stages.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _require_stages(plan)
    t = [s.seconds for s in plan.stages]
    schedule = get_schedule(plan.schedule, plan.chunks)
    slots = simulate(schedule, [x * (1 - BACKWARD_SHARE) for x in t], [x * BACKWARD_SHARE for x in t],
                     plan.num_microbatches)
    S = len(plan.stages)
    P = S // schedule.chunks
    fig, ax = plt.subplots(figsize=(10, 0.6 * P + 1.5))
    colors = plt.get_cmap("tab20")
    for sl in slots:
        c = colors((2 * sl.microbatch) % 20 + (1 if sl.kind == "forward" else 0))
        row, chunk = P - 1 - sl.stage % P, sl.stage // P
        ax.broken_barh([(sl.start * 1e3, (sl.end - sl.start) * 1e3)], (row - 0.4, 0.8), facecolors=c,
                       edgecolor="black", linewidth=0.3 + 1.2 * chunk, hatch="//" if sl.kind == "weight" else None)
        if (sl.end - sl.start) * 1e3 > 0.02 * max(x.end for x in slots) * 1e3:
            ax.text((sl.start + sl.end) / 2 * 1e3, row, f"{sl.kind[0].upper()}{sl.microbatch}"
                    + (f".{chunk}" if schedule.chunks > 1 else ""), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(P))
    ax.set_yticklabels([f"stage {P - 1 - i}" if schedule.chunks == 1 else
                        "stages " + ", ".join(map(str, range(P - 1 - i, S, P))) for i in range(P)])
    ax.set_xlabel("time (ms)")
    ax.set_title(title or f"{plan.schedule}, {count(S, 'stage', 'stages')}, "
                          f"{count(plan.num_microbatches, 'microbatch', 'microbatches')}: "
                          f"step {plan.step_seconds * 1e3:.2f} ms, bubble {plan.bubble_fraction:.0%}")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
