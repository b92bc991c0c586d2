"""Pipeline schedules: per-stage action lists, independent of how a stage runs them.

A schedule answers "what does stage ``s`` of ``S`` do, in which order, for ``B`` microbatches":
a list of ``Action`` s. Compute actions are ``forward`` / ``backward`` of one microbatch; around
them the schedule places the point-to-point transfers they need: ``recv_act`` before a forward
on every stage but the first, ``send_act`` after it on every stage but the last, ``recv_grad``
before a backward on every stage but the last and ``send_grad`` after it on every stage but the
first. The stage executor (``executor.py``) interprets the list; adding a schedule (interleaved
1F1B, zero-bubble) means adding a class here.

- GPipe (Huang et al., NeurIPS 2019): all forwards, then all backwards (last microbatch first).
  Every stage holds all B microbatches' activations at its peak.
- 1F1B (PipeDream-Flush; Narayanan et al., SC21, section 2.2): stage ``s`` runs
  ``min(S - s - 1, B)`` warm-up forwards, then alternates one forward and one backward, then
  drains the remaining backwards. It holds at most ``min(S - s, B)`` microbatches in flight.
"""
from __future__ import annotations

from dataclasses import dataclass

COMPUTE = ("forward", "backward")


@dataclass(frozen=True)
class Action:
    """``kind`` in ``recv_act, forward, send_act, recv_grad, backward, send_grad``; ``microbatch``."""

    kind: str
    microbatch: int


class Schedule:
    """Base class: subclasses give the order of compute actions (``compute_order``)."""

    name = ""

    def compute_order(self, stage: int, num_stages: int, num_microbatches: int) -> list[tuple[str, int]]:
        raise NotImplementedError

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
            else:
                if stage < num_stages - 1:
                    out.append(Action("recv_grad", mb))
                out.append(Action("backward", mb))
                if stage > 0:
                    out.append(Action("send_grad", mb))
        return out

    def peak_in_flight(self, stage: int, num_stages: int, num_microbatches: int) -> int:
        """Most microbatches whose forward ran and backward did not yet, on ``stage``."""
        live = peak = 0
        for kind, _ in self.compute_order(stage, num_stages, num_microbatches):
            live += 1 if kind == "forward" else -1
            peak = max(peak, live)
        return peak


class GPipe(Schedule):
    name = "gpipe"

    def compute_order(self, stage, num_stages, num_microbatches):
        return [("forward", i) for i in range(num_microbatches)] + \
               [("backward", i) for i in reversed(range(num_microbatches))]


class OneFOneB(Schedule):
    name = "1f1b"

    def compute_order(self, stage, num_stages, num_microbatches):
        warmup = min(num_stages - stage - 1, num_microbatches)
        order = [("forward", i) for i in range(warmup)]
        for i in range(num_microbatches - warmup):
            order += [("forward", warmup + i), ("backward", i)]
        order += [("backward", i) for i in range(num_microbatches - warmup, num_microbatches)]
        return order


SCHEDULES = {"gpipe": GPipe, "1f1b": OneFOneB}


def get_schedule(name: str) -> Schedule:
    """A schedule by name (``"gpipe"``, ``"1f1b"``).

    Raises:
        ValueError: for an unknown name.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name]()


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
    stage's backward of it is done (transfers take no time here; they are in the stage times).

    Raises:
        RuntimeError: the schedule deadlocks (a bug in a schedule).
    """
    S, B = len(forward_seconds), num_microbatches
    orders = [schedule.compute_order(s, S, B) for s in range(S)]
    pos, free = [0] * S, [0.0] * S
    done: dict[tuple[int, str, int], float] = {}
    slots: list[Slot] = []
    while any(pos[s] < len(orders[s]) for s in range(S)):
        progressed = False
        for s in range(S):
            while pos[s] < len(orders[s]):
                kind, mb = orders[s][pos[s]]
                dep = (s - 1, "forward", mb) if kind == "forward" else (s + 1, "backward", mb)
                if kind == "forward" and s == 0 or kind == "backward" and s == S - 1:
                    dep = (s, "forward", mb) if kind == "backward" else None
                if dep is not None and dep not in done:
                    break
                start = max(free[s], done[dep] if dep is not None else 0.0)
                end = start + (forward_seconds[s] if kind == "forward" else backward_seconds[s])
                done[(s, kind, mb)] = free[s] = end
                slots.append(Slot(s, kind, mb, start, end))
                pos[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule.name} deadlocks")
    return slots
