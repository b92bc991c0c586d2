"""Predicted vs measured: how close a ``Plan``'s cost model comes to the real training step.

``parallelize(..., report=True)`` (or the environment variable ``ALPA_LITE_REPORT=1``) makes the
trainer time its steps after ``report_warmup`` warm-up steps with a :class:`StepTimer`, and
``trainer.report()`` returns the record of :func:`make_record` (JSON-able) and prints it as a
table beside the plan's predictions:

- the step: predicted ``compute_seconds + comm_seconds`` vs the measured wall time of one
  training step (forward, backward, optimizer), and ``relative_error = predicted / measured - 1``.
  While timing, every collective is waited on where it is issued (so each is timed alone), the
  gradient buckets and the deferred loss all-reduce included: backward hides none of them, so
  the overlap an untimed step gains
  (``Plan.overlap_seconds``, recorded as ``predicted_overlap_s``) is not subtracted here;
- per collective kind and phase: the plan's count and predicted seconds (its ``collectives``
  list) vs the count issued and the seconds spent inside those calls per step (the timing
  hook of :mod:`alpa_lite.runtime.collectives`);
- a pipelined plan's bubble: its ``bubble_fraction`` vs the measured idle share of the ranks'
  time (:func:`idle_fractions`): rank ``r`` is busy ``b_r`` seconds in its forward, backward and
  weight passes of a step (``PipelineTrainer._compute``; time blocked in receives and waits
  excluded) whose schedule takes ``T = max_r t_r`` (``t_r``: from the rank's start of the step's
  schedule to its last transfer done; the timed step's barrier starts the ranks together), and
  idles ``1 - b_r / T``; the step's bubble is the mean over ranks, the reported one the median
  over timed steps.

Measurement conventions (all times in seconds):
- every timed step starts after a world barrier, so all ranks start it together; its time is
  the slowest rank's, and the reported step time is the median over timed steps;
- the seconds of a collective kind are per step, averaged over timed steps and ranks; they
  include waiting for a late peer (on 2 CPU cores shared by 4 ranks that can be much);
- the counts are per step (identical on every rank in SPMD).

The module also has the statistics of ``benchmarks/cost_fidelity.py``: :func:`relative_error` and
the Spearman rank correlation :func:`spearman`.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

from ..core.mesh import COLLECTIVES
from ..core.plan import PipelinePlan, Plan

REPORT_ENV = "ALPA_LITE_REPORT"
REPORT_JSON_ENV = "ALPA_LITE_REPORT_JSON"
PHASES = ("forward", "recompute", "backward", "update")


def report_requested(report: bool | None) -> bool:
    """``report`` when given, else whether ``ALPA_LITE_REPORT`` is set to ``1``/``true``/``yes``/``on``.

    Raises:
        ValueError: the variable holds anything else (``0``/``false``/``no``/``off``/empty read as off).
    """
    if report is not None:
        return bool(report)
    value = os.environ.get(REPORT_ENV, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"{REPORT_ENV}={os.environ[REPORT_ENV]!r}: use 1 (report) or 0 (no report)")


# ------------------------------------------------------------------------------- statistics


def relative_error(predicted: float, measured: float) -> float:
    """``predicted / measured - 1`` (0.1: predicted 10 % too slow; -0.1: 10 % too fast).

    Raises:
        ValueError: ``measured`` is not a positive finite number of seconds.
    """
    if not (measured > 0 and math.isfinite(measured)):
        raise ValueError(f"a measured time must be positive and finite, got {measured!r}")
    return predicted / measured - 1.0


def _ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing the mean of their positions."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rank correlation of ``x`` and ``y``: the Pearson correlation of their ranks
    (ties get mean ranks, as ``scipy.stats.spearmanr`` does). 1 = same order, -1 = reversed.

    Raises:
        ValueError: lengths differ, fewer than 2 points, a non-finite value, or one sequence
            is constant (the correlation is undefined).
    """
    x, y = [float(v) for v in x], [float(v) for v in y]
    if len(x) != len(y):
        raise ValueError(f"spearman needs equally many x and y, got {len(x)} and {len(y)}")
    if len(x) < 2:
        raise ValueError(f"spearman needs at least 2 points, got {len(x)}")
    if not all(math.isfinite(v) for v in x + y):
        raise ValueError("spearman: values must be finite")
    rx, ry = _ranks(x), _ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        raise ValueError("spearman: one sequence is constant, the rank correlation is undefined")
    return sxy / math.sqrt(sxx * syy)


# ------------------------------------------------------------------------------- the record


def predicted_collectives(plan: Plan) -> dict[tuple[str, str], tuple[int, float]]:
    """``(kind, phase) -> (count, seconds)`` of one training step under an SPMD ``plan`` (none
    for a ``PipelinePlan``: its stages' collectives overlap in the schedule)."""
    out: dict[tuple[str, str], tuple[int, float]] = {}
    for c in [] if isinstance(plan, PipelinePlan) else plan.collectives:
        n, s = out.get((c.kind, c.phase), (0, 0.0))
        out[(c.kind, c.phase)] = (n + 1, s + c.seconds)
    return out


def _order(key: tuple[str, str]) -> tuple:
    kind, phase = key
    return (PHASES.index(phase) if phase in PHASES else 9, COLLECTIVES.index(kind) if kind in COLLECTIVES else 9, kind)


def timed_prediction(plan: Plan | PipelinePlan) -> float:
    """The predicted time of a step timed by ``report=True``, seconds: ``step_seconds``, with the
    gradient buckets, ZeRO-3 reduce-scatters and deferred loss all-reduce backward would hide
    (``overlap_seconds``) added
    back, as the timed step waits on every collective where it is issued."""
    if isinstance(plan, PipelinePlan):
        return plan.step_seconds + plan.overlap_seconds
    return plan.compute_seconds + plan.comm_seconds


def idle_fractions(schedule_seconds: Sequence[Sequence[tuple[float, float]]]) -> list[list[float]]:
    """Per rank and timed step, the idle share ``1 - b_r / max_q t_q`` of the step's schedule
    (module docstring).

    Args:
        schedule_seconds: per rank, per timed step, ``(busy, schedule)`` seconds (``b_r``, ``t_r``).

    Raises:
        ValueError: no rank, no timed step, ranks with different step counts, or a step whose
            schedule took no time.
    """
    if not schedule_seconds or len({len(r) for r in schedule_seconds}) != 1 or not schedule_seconds[0]:
        raise ValueError(f"need the same number of timed steps (at least one) on every rank, got "
                         f"{[len(r) for r in schedule_seconds]}")
    spans = [max(r[i][1] for r in schedule_seconds) for i in range(len(schedule_seconds[0]))]
    if not all(t > 0 for t in spans):
        raise ValueError(f"a step's schedule must take a positive time, got {spans}")
    return [[1.0 - busy / t for (busy, _), t in zip(r, spans)] for r in schedule_seconds]


def make_record(plan: Plan, step_seconds: Sequence[float], collective_seconds: dict[tuple[str, str], float],
                collective_counts: dict[tuple[str, str], float], *, warmup_steps: int, world_size: int,
                backend: str = "", name: str = "",
                schedule_seconds: Sequence[Sequence[tuple[float, float]]] | None = None) -> dict:
    """The JSON-able predicted-vs-measured record of one run.

    Args:
        plan: the plan that ran (its predictions).
        step_seconds: measured time of each timed step, seconds (slowest rank).
        collective_seconds: ``(kind, phase) -> seconds per step`` spent in collectives (mean over ranks).
        collective_counts: ``(kind, phase) -> collectives issued per step``.
        warmup_steps: untimed steps before the timed ones. world_size: ranks. backend: ``gloo``/``nccl``.
        name: a label for the run (e.g. the plan's name in a benchmark).
        schedule_seconds: a pipelined plan's ``(busy, schedule)`` seconds per rank and timed step
            (:func:`idle_fractions`).

    Returns:
        ``{"name", "mesh", "world_size", "backend", "warmup_steps", "timed_steps", "step": {...},
        "collectives": [{"kind", "phase", "predicted_count", "measured_count", "predicted_s",
        "measured_s"}, ...]}``; the step has ``predicted_s``, ``predicted_compute_s``,
        ``predicted_comm_s``, ``predicted_overlap_s``, ``measured_s`` (median of ``samples_s``), ``fastest_s``, ``samples_s``,
        ``measured_collective_s`` (all kinds), ``relative_error``. A pipelined plan (``stages``)
        predicts only its step (``PipelinePlan.step_seconds``): its compute / comm split is None and its
        collectives rows list what ran inside the stages (predicted counts 0), and its record has
        ``"bubble"``: ``predicted`` (``bubble_fraction``), ``measured`` (median over timed steps of
        the mean over ranks of :func:`idle_fractions`), ``samples`` (that mean per step),
        ``by_rank`` (per rank, the median over steps), ``busy_s`` (per rank, median busy seconds)
        and ``schedule_s`` (median ``T``); None for an SPMD plan or without ``schedule_seconds`` (or with
        none timed: a ``StepTimer`` wrapped around the trainer instead of the trainer's own).

    Raises:
        ValueError: no timed step, or a step time that is not positive.
    """
    if not step_seconds:
        raise ValueError("no timed step: run more steps than report_warmup before asking for the report")
    measured = statistics.median(step_seconds)
    pipelined = isinstance(plan, PipelinePlan)  # its step is the stage DP's, not compute + comm
    predicted = timed_prediction(plan)
    pred = predicted_collectives(plan)
    rows = []
    for key in sorted(set(pred) | set(collective_counts) | set(collective_seconds), key=_order):
        n, s = pred.get(key, (0, 0.0))
        rows.append({"kind": key[0], "phase": key[1], "predicted_count": n,
                     "measured_count": collective_counts.get(key, 0), "predicted_s": s,
                     "measured_s": collective_seconds.get(key, 0.0)})
    return {
        "name": name,
        "mesh": list(plan.mesh.shape),
        "world_size": world_size,
        "backend": backend,
        "warmup_steps": warmup_steps,
        "timed_steps": len(step_seconds),
        "step": {"predicted_s": predicted,
                 "predicted_overlap_s": plan.overlap_seconds,
                 "predicted_compute_s": None if pipelined else plan.compute_seconds,
                 "predicted_comm_s": None if pipelined else plan.comm_seconds,
                 "measured_s": measured, "fastest_s": min(step_seconds), "samples_s": list(step_seconds),
                 "measured_collective_s": sum(collective_seconds.values()),
                 "relative_error": relative_error(predicted, measured)},
        "collectives": rows,
        "bubble": _bubble(plan, schedule_seconds) if pipelined and schedule_seconds and any(schedule_seconds) else None,
    }


def _bubble(plan: PipelinePlan, schedule_seconds: Sequence[Sequence[tuple[float, float]]]) -> dict:
    idle = idle_fractions(schedule_seconds)
    samples = [statistics.fmean(step) for step in zip(*idle)]
    return {"predicted": plan.bubble_fraction, "measured": statistics.median(samples), "samples": samples,
            "by_rank": [statistics.median(r) for r in idle],
            "busy_s": [statistics.median(b for b, _ in r) for r in schedule_seconds],
            "schedule_s": statistics.median(max(r[i][1] for r in schedule_seconds) for i in range(len(samples)))}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def print_report(record: dict, console=None) -> None:
    """Print ``record`` (from :func:`make_record`) as two rich tables: the step, and the collectives."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    s = record["step"]
    mesh = "x".join(map(str, record["mesh"]))
    title = f"predicted vs measured{' ' + record['name'] if record['name'] else ''}: mesh {mesh}, " \
            f"{record['timed_steps']} timed steps after {record['warmup_steps']} warm-up"
    step = Table(title=title)
    for col in ("", "predicted (ms)", "measured (ms)", "error"):
        step.add_column(col, justify="left" if not col else "right")
    step.add_row("step", _ms(s["predicted_s"]), _ms(s["measured_s"]), f"{s['relative_error']:+.1%}")
    if record.get("bubble"):
        b = record["bubble"]
        step.add_row("bubble (% of the ranks' time)", f"{b['predicted']:.1%}", f"{b['measured']:.1%}",
                     f"{(b['measured'] - b['predicted']) * 100:+.1f} pt")
    if s["predicted_compute_s"] is not None:
        step.add_row("  compute", _ms(s["predicted_compute_s"]), "", "")
        step.add_row("  collectives", _ms(s["predicted_comm_s"]), _ms(s["measured_collective_s"]),
                     f"{relative_error(s['predicted_comm_s'], s['measured_collective_s']):+.1%}"
                     if s["measured_collective_s"] > 0 else "")
    console.print(step)
    if record["collectives"]:
        table = Table(title="collectives per step")
        for col in ("kind", "phase", "count (plan)", "count (run)", "predicted (ms)", "measured (ms)"):
            table.add_column(col, justify="left" if col in ("kind", "phase") else "right")
        for r in record["collectives"]:
            mismatch = r["predicted_count"] != r["measured_count"]
            count = f"[red]{r['measured_count']:g}[/red]" if mismatch else f"{r['measured_count']:g}"
            table.add_row(r["kind"], r["phase"], str(r["predicted_count"]), count, _ms(r["predicted_s"]),
                          _ms(r["measured_s"]))
        console.print(table)


# ------------------------------------------------------------------------------- measuring


class StepTimer:
    """Times training steps after ``warmup`` untimed ones, and the collectives inside them.

    Used by ``ParallelTrainer.step`` (``with timer.step(): ...``); every rank must take the same
    steps, as a timed step starts with a world barrier. ``report_steps``: after this many timed
    steps :meth:`report_due` says True, once (None: never).

    Raises:
        ValueError: ``warmup`` < 0 or ``report_steps`` < 1.
    """

    def __init__(self, warmup: int = 2, report_steps: int | None = None):
        if int(warmup) < 0:
            raise ValueError(f"report_warmup must be >= 0 steps, got {warmup}")
        if report_steps is not None and int(report_steps) < 1:
            raise ValueError(f"report_steps must be >= 1 step or None, got {report_steps}")
        self.warmup, self.steps = int(warmup), 0
        self.report_steps = None if report_steps is None else int(report_steps)
        self.step_seconds: list[float] = []
        self.collective_seconds: Counter = Counter()
        self.collective_counts: Counter = Counter()
        self.schedule_seconds: list[tuple[float, float]] = []  # a pipeline rank's (busy, schedule) per timed step
        self._timed = False

    @contextmanager
    def step(self):
        """Wrap one training step; it is timed once ``warmup`` steps have passed."""
        import torch.distributed as dist

        from . import collectives

        self.steps += 1
        if self.steps <= self.warmup:
            yield
            return
        dist.barrier()
        collectives.synchronize_device()
        seconds0, counts0 = Counter(collectives.SECONDS), Counter(collectives.COUNTS)
        collectives.set_timing(True)
        self._timed = True
        t0 = time.perf_counter()
        try:
            yield
            collectives.synchronize_device()
            self.step_seconds.append(time.perf_counter() - t0)
        finally:
            collectives.set_timing(False)
            self._timed = False
        self.collective_seconds.update(Counter(collectives.SECONDS) - seconds0)
        self.collective_counts.update(Counter(collectives.COUNTS) - counts0)

    def add_schedule(self, busy_s: float, schedule_s: float) -> None:
        """A pipeline rank's busy and schedule seconds of the current step (``PipelineTrainer``);
        kept when the step is timed."""
        if self._timed:
            self.schedule_seconds.append((busy_s, schedule_s))

    def report_due(self) -> bool:
        """True right after the ``report_steps``-th timed step (the same step on every rank)."""
        return self.report_steps is not None and self.steps == self.warmup + self.report_steps

    def record(self, plan: Plan, name: str = "") -> dict:
        """The :func:`make_record` of the timed steps, combined over ranks (call on every rank).

        Raises:
            ValueError: no step was timed yet.
        """
        import torch.distributed as dist

        if not self.step_seconds:
            raise ValueError(f"no timed step yet: {self.steps} step(s) taken, the first {self.warmup} are "
                             "warm-up (parallelize(..., report_warmup=...))")
        world = dist.get_world_size()
        mine = {"steps": self.step_seconds, "seconds": dict(self.collective_seconds),
                "counts": dict(self.collective_counts), "schedule": self.schedule_seconds}
        every: list = [None] * world
        dist.all_gather_object(every, mine)
        n = len(self.step_seconds)
        steps = [max(r["steps"][i] for r in every) for i in range(n)]
        keys = set().union(*(r["seconds"] for r in every), *(r["counts"] for r in every))
        seconds = {k: sum(r["seconds"].get(k, 0.0) for r in every) / world / n for k in keys}
        counts = {k: every[0]["counts"].get(k, 0) / n for k in keys}
        return make_record(plan, steps, seconds, counts, warmup_steps=self.warmup, world_size=world,
                           backend=str(dist.get_backend()), name=name,
                           schedule_seconds=[r["schedule"] for r in every])


def write_record(record: dict, path: str | Path) -> None:
    """Write ``record`` as indented JSON to ``path`` (parents created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
