"""Pipeline schedules: per-stage action lists, independent of how a stage runs them.

A schedule answers "what does stage ``s`` of ``S`` do, in which order, for ``B`` microbatches":
a list of ``Action`` s. Compute actions are ``forward`` / ``backward`` of one microbatch, and for a
schedule that splits the backward (``split_backward``) ``backward`` is the input-gradient pass
and ``weight`` the weight-gradient pass of it. Around them the schedule places the point-to-point
transfers they need: ``recv_act`` before a forward on every stage but the first, ``send_act``
after it on every stage but the last, ``recv_grad`` before a backward on every stage but the last
and ``send_grad`` after it on every stage but the first. The pipeline trainer
(``runtime/pipeline.py``) interprets the list; adding a schedule means adding a class here.

- GPipe (Huang et al., NeurIPS 2019): all forwards, then all backwards (last microbatch first).
  Every stage holds all B microbatches' activations at its peak.
- 1F1B (PipeDream-Flush; Narayanan et al., SC21, section 2.2): stage ``s`` runs
  ``min(S - s - 1, B)`` warm-up forwards, then alternates one forward and one backward, then
  drains the remaining backwards. It holds at most ``min(S - s, B)`` microbatches in flight.
- ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 3.1): 1F1B's order of
  forwards and input-gradient passes ``B``; stage ``s`` defers each weight-gradient pass ``W`` until
  ``s`` more ``B`` s have run, so the ``W`` s fill the drain phase where 1F1B waits. Every stage
  holds ``min(S, B)`` microbatches (1F1B's first-stage peak); with equal stages and ``B >= S``
  the step is ``B (F + B + W) + (S - 1)(F + B - W)`` instead of 1F1B's
  ``(B + S - 1)(F + B + W)`` (times ``F``, ``B``, ``W`` of one stage and microbatch).

Step-time model (``Schedule.fill_ratio``): with per-microbatch stage times ``t_i`` (forward +
whole backward), a schedule's step is ``B max t_i + r (sum t_i - max t_i)``; ``r = 1`` for GPipe
and 1F1B (Alpa's eq. 2), ``r = (F + B - W) / (F + B + W)`` for ZB-H1. Exact for equal stages
(``simulate`` checks it in the tests), the stage DP's estimate otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass

BACKWARD_SHARE = 2 / 3  # backward's share of a stage's forward + backward time (2x the forward FLOPs)
WEIGHT_SHARE = 1 / 2  # the weight-gradient pass's share of the backward (a linear layer: equal FLOPs)


@dataclass(frozen=True)
class Action:
    """``kind`` in ``recv_act, forward, send_act, recv_grad, backward, send_grad, weight``; ``microbatch``."""

    kind: str
    microbatch: int


class Schedule:
    """Base class: subclasses give the order of compute actions (``compute_order``), the
    microbatches a stage holds at its peak (``in_flight``) and the step-time model's ``fill_ratio``."""

    name = ""
    split_backward = False  # ``backward`` computes input gradients only; ``weight`` the weights'

    def compute_order(self, stage: int, num_stages: int, num_microbatches: int) -> list[tuple[str, int]]:
        raise NotImplementedError

    def in_flight(self, stage: int, num_stages: int, num_microbatches: int) -> int:
        """Microbatches whose activations ``stage`` holds at its peak (``peak_in_flight`` in closed form)."""
        raise NotImplementedError

    def fill_ratio(self) -> float:
        """``r`` of the step-time model (module docstring): the share of a stage's forward + backward
        time that each of the ``S - 1`` fill-and-drain steps costs."""
        return 1.0

    def actions(self, stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
        """The full action list of ``stage`` (0-based) with its transfers.

        Raises:
            ValueError: on a stage index outside ``0 .. num_stages - 1`` or ``num_microbatches < 1``.
        """
        if not 0 <= stage < num_stages or num_microbatches < 1:
            raise ValueError(f"stage {stage} of {num_stages} with {num_microbatches} microbatches: need "
                             "0 <= stage < num_stages and num_microbatches >= 1")
        out = []
        for kind, mb in self.compute_order(stage, num_stages, num_microbatches):
            if kind == "forward":
                if stage > 0:
                    out.append(Action("recv_act", mb))
                out.append(Action("forward", mb))
                if stage < num_stages - 1:
                    out.append(Action("send_act", mb))
            elif kind == "backward":
                if stage < num_stages - 1:
                    out.append(Action("recv_grad", mb))
                out.append(Action("backward", mb))
                if stage > 0:
                    out.append(Action("send_grad", mb))
            else:
                out.append(Action(kind, mb))
        return out

    def peak_in_flight(self, stage: int, num_stages: int, num_microbatches: int) -> int:
        """Most microbatches whose forward ran and whose last backward pass (``weight`` when split)
        did not yet, on ``stage``, read from the action list."""
        last = "weight" if self.split_backward else "backward"
        live = peak = 0
        for kind, _ in self.compute_order(stage, num_stages, num_microbatches):
            live += 1 if kind == "forward" else -1 if kind == last else 0
            peak = max(peak, live)
        return peak


class GPipe(Schedule):
    name = "gpipe"

    def compute_order(self, stage, num_stages, num_microbatches):
        return [("forward", i) for i in range(num_microbatches)] + \
               [("backward", i) for i in reversed(range(num_microbatches))]

    def in_flight(self, stage, num_stages, num_microbatches):
        return num_microbatches


def _one_f_one_b(stage: int, num_stages: int, num_microbatches: int) -> list[tuple[str, int]]:
    warmup = min(num_stages - stage - 1, num_microbatches)
    order = [("forward", i) for i in range(warmup)]
    for i in range(num_microbatches - warmup):
        order += [("forward", warmup + i), ("backward", i)]
    return order + [("backward", i) for i in range(num_microbatches - warmup, num_microbatches)]


class OneFOneB(Schedule):
    name = "1f1b"

    def compute_order(self, stage, num_stages, num_microbatches):
        return _one_f_one_b(stage, num_stages, num_microbatches)

    def in_flight(self, stage, num_stages, num_microbatches):
        return min(num_stages - stage, num_microbatches)


class ZBH1(Schedule):
    name = "zb-h1"
    split_backward = True

    def compute_order(self, stage, num_stages, num_microbatches):
        order, deferred = [], []
        for kind, mb in _one_f_one_b(stage, num_stages, num_microbatches):
            order.append((kind, mb))
            if kind == "backward":
                deferred.append(mb)
                if len(deferred) > stage:  # stage s keeps s weight passes waiting
                    order.append(("weight", deferred.pop(0)))
        return order + [("weight", mb) for mb in deferred]

    def in_flight(self, stage, num_stages, num_microbatches):
        return min(num_stages, num_microbatches)

    def fill_ratio(self):
        w = BACKWARD_SHARE * WEIGHT_SHARE
        return 1.0 - 2 * w


SCHEDULES = {"1f1b": OneFOneB, "gpipe": GPipe, "zb-h1": ZBH1}  # "auto" tries them in this order; ties go to the first


def get_schedule(name: str) -> Schedule:
    """A schedule by name (``"gpipe"``, ``"1f1b"``, ``"zb-h1"``).

    Raises:
        ValueError: for an unknown name.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name]()


def step_seconds(schedule: Schedule, stage_seconds, num_microbatches: int) -> float:
    """Predicted pipeline time of one step, ``B max t_i + r (sum t_i - max t_i)`` seconds (module
    docstring), for per-microbatch stage times ``stage_seconds`` (forward + backward, seconds)."""
    t_max = max(stage_seconds)
    return num_microbatches * t_max + schedule.fill_ratio() * (sum(stage_seconds) - t_max)


@dataclass(frozen=True)
class Slot:
    """One compute action placed in time (seconds from the step's start)."""

    stage: int
    kind: str
    microbatch: int
    start: float
    end: float


def simulate(schedule: Schedule, forward_seconds: list[float], backward_seconds: list[float],
             num_microbatches: int) -> list[Slot]:
    """Timeline of one step: each stage runs its compute actions in schedule order, a forward
    once the previous stage's forward of that microbatch is done, a backward once the next
    stage's backward of it is done, a weight pass after its stage's backward of it (transfers
    take no time here; they are in the stage times). A split schedule's ``backward`` takes
    ``1 - WEIGHT_SHARE`` of ``backward_seconds`` and its ``weight`` the rest.

    Raises:
        RuntimeError: the schedule deadlocks (a bug in a schedule).
    """
    S, B = len(forward_seconds), num_microbatches
    share = WEIGHT_SHARE if schedule.split_backward else 0.0
    seconds = {"forward": forward_seconds, "backward": [x * (1 - share) for x in backward_seconds],
               "weight": [x * share for x in backward_seconds]}
    orders = [schedule.compute_order(s, S, B) for s in range(S)]
    pos, free = [0] * S, [0.0] * S
    done: dict[tuple[int, str, int], float] = {}
    slots: list[Slot] = []
    while any(pos[s] < len(orders[s]) for s in range(S)):
        progressed = False
        for s in range(S):
            while pos[s] < len(orders[s]):
                kind, mb = orders[s][pos[s]]
                dep = {"forward": (s - 1, "forward", mb) if s > 0 else None,
                       "backward": (s + 1, "backward", mb) if s < S - 1 else (s, "forward", mb),
                       "weight": (s, "backward", mb)}[kind]
                if dep is not None and dep not in done:
                    break
                start = max(free[s], done[dep] if dep is not None else 0.0)
                end = start + seconds[kind][s]
                done[(s, kind, mb)] = free[s] = end
                slots.append(Slot(s, kind, mb, start, end))
                pos[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule.name} deadlocks")
    return slots
