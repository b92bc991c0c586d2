"""Pipeline schedules: per-device action lists, independent of how a stage runs them.

A schedule answers "what does device group ``d`` of ``p`` do, in which order, for ``B``
microbatches": a list of ``Action`` s. A device group holds ``chunks`` stages (``v``; 1 except
under the interleaved schedule): chunk ``c`` of group ``d`` is stage ``c p + d`` of ``S = v p``.
Compute actions are ``forward`` / ``backward`` of one microbatch on one chunk, and for a
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
- Interleaved 1F1B (Narayanan et al., SC21, section 2.2.2; the order of Megatron-LM): each of
  ``p`` device groups holds ``v`` non-adjacent stages (stage ``s`` on group ``s mod p``); ``B`` must
  be a multiple of ``p``. Group ``d``'s ``k``-th forward is of chunk ``(k // p) mod v`` and
  microbatch ``(k // (p v)) p + k mod p`` (``p`` microbatches through one chunk, then the next
  chunk), its backwards the same with the chunks reversed. It runs
  ``min(2 (p - d - 1) + (v - 1) p, v B)`` warm-up forwards, then alternates, then drains. With
  equal stages of time ``t`` the step is ``(v B + p - 1) t``: 1F1B's bubble divided by ``v``, for
  ``v`` times the point-to-point transfers. Group 0 holds ``p v + p - 1`` chunk-microbatches at
  its peak, i.e. ``p (1 + (p - 1) / (p v))`` microbatches of its layers (Korthikanti et al.,
  "Reducing Activation Recomputation in Large Transformer Models", MLSys 2023, section 4.2.3)
  against 1F1B's ``p``.

Step-time model (``Schedule.fill_ratio``): with per-microbatch device-group times ``T_d`` (forward
+ whole backward of its stages), a schedule's step is ``B max T_d + r (sum T_d - max T_d)``;
``r = 1`` for GPipe and 1F1B (Alpa's eq. 2), ``r = (F + B - W) / (F + B + W)`` for ZB-H1,
``r = 1 / v`` for interleaved. Exact for equal stages (``simulate`` checks it in the tests), the
stage DP's estimate otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass

BACKWARD_SHARE = 2 / 3  # backward's share of a stage's forward + backward time (2x the forward FLOPs)
WEIGHT_SHARE = 1 / 2  # the weight-gradient pass's share of the backward (a linear layer: equal FLOPs)


@dataclass(frozen=True)
class Action:
    """``kind`` in ``recv_act, forward, send_act, recv_grad, backward, send_grad, weight``;
    ``microbatch``; ``chunk``: which of the device group's stages (0 .. v-1)."""

    kind: str
    microbatch: int
    chunk: int = 0


class Schedule:
    """Base class: subclasses give the order of compute actions (``compute_order``), the
    microbatches a stage holds at its peak (``in_flight``) and the step-time model's ``fill_ratio``."""

    name = ""
    split_backward = False  # ``backward`` computes input gradients only; ``weight`` the weights'
    chunks = 1  # stages per device group (v)

    def compute_order(self, device: int, num_devices: int, num_microbatches: int) -> list[tuple[str, int, int]]:
        """``(kind, microbatch, chunk)`` of every compute action of group ``device`` of ``num_devices``."""
        raise NotImplementedError

    def in_flight(self, stage: int, num_stages: int, num_microbatches: int) -> int:
        """Microbatches whose activations ``stage`` (of all ``num_stages``) holds at its peak
        (``peak_in_flight`` in closed form for one chunk per group)."""
        raise NotImplementedError

    def fill_ratio(self) -> float:
        """``r`` of the step-time model (module docstring): the share of a stage's forward + backward
        time that each of the ``S - 1`` fill-and-drain steps costs."""
        return 1.0

    def actions(self, device: int, num_devices: int, num_microbatches: int) -> list[Action]:
        """The full action list of group ``device`` (0-based) with its transfers.

        Raises:
            ValueError: on a group index outside ``0 .. num_devices - 1`` or ``num_microbatches < 1``.
        """
        if not 0 <= device < num_devices or num_microbatches < 1:
            raise ValueError(f"stage {device} of {num_devices} with {num_microbatches} microbatches: need "
                             "0 <= stage < num_stages and num_microbatches >= 1")
        last = num_devices * self.chunks - 1
        out = []
        for kind, mb, c in self.compute_order(device, num_devices, num_microbatches):
            stage = c * num_devices + device
            if kind == "forward":
                if stage > 0:
                    out.append(Action("recv_act", mb, c))
                out.append(Action("forward", mb, c))
                if stage < last:
                    out.append(Action("send_act", mb, c))
            elif kind == "backward":
                if stage < last:
                    out.append(Action("recv_grad", mb, c))
                out.append(Action("backward", mb, c))
                if stage > 0:
                    out.append(Action("send_grad", mb, c))
            else:
                out.append(Action(kind, mb, c))
        return out

    def peak_in_flight(self, device: int, num_devices: int, num_microbatches: int, chunk: int | None = None) -> int:
        """Most (chunk, microbatch) pairs whose forward ran and whose last backward pass (``weight``
        when split) did not yet, on group ``device`` (only those of ``chunk`` when given), read
        from the action list."""
        last = "weight" if self.split_backward else "backward"
        live = peak = 0
        for kind, _, c in self.compute_order(device, num_devices, num_microbatches):
            if chunk is None or c == chunk:
                live += 1 if kind == "forward" else -1 if kind == last else 0
                peak = max(peak, live)
        return peak


class GPipe(Schedule):
    name = "gpipe"

    def compute_order(self, device, num_devices, num_microbatches):
        return [("forward", i, 0) for i in range(num_microbatches)] + \
               [("backward", i, 0) for i in reversed(range(num_microbatches))]

    def in_flight(self, stage, num_stages, num_microbatches):
        return num_microbatches


def _one_f_one_b(stage: int, num_stages: int, num_microbatches: int) -> list[tuple[str, int, int]]:
    warmup = min(num_stages - stage - 1, num_microbatches)
    order = [("forward", i, 0) for i in range(warmup)]
    for i in range(num_microbatches - warmup):
        order += [("forward", warmup + i, 0), ("backward", i, 0)]
    return order + [("backward", i, 0) for i in range(num_microbatches - warmup, num_microbatches)]


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
        for kind, mb, c in _one_f_one_b(stage, num_stages, num_microbatches):
            order.append((kind, mb, c))
            if kind == "backward":
                deferred.append(mb)
                if len(deferred) > stage:  # stage s keeps s weight passes waiting
                    order.append(("weight", deferred.pop(0), 0))
        return order + [("weight", mb, 0) for mb in deferred]

    def in_flight(self, stage, num_stages, num_microbatches):
        return min(num_stages, num_microbatches)

    def fill_ratio(self):
        w = BACKWARD_SHARE * WEIGHT_SHARE
        return 1.0 - 2 * w


class Interleaved(Schedule):
    """Interleaved 1F1B with ``chunks`` (v >= 2) stages per device group (module docstring)."""

    name = "interleaved"

    def __init__(self, chunks: int = 2):
        if not isinstance(chunks, int) or chunks < 2:
            raise ValueError(f"interleaved 1F1B needs chunks >= 2 stages per device group, got {chunks!r}")
        self.chunks = chunks

    def compute_order(self, device, num_devices, num_microbatches):
        p, v, m = num_devices, self.chunks, num_microbatches
        if m % p:
            raise ValueError(f"interleaved 1F1B needs the microbatch count ({m}) to be a multiple of the "
                             f"device groups ({p}); use num_microbatches={p * max(1, round(m / p))} or another schedule")
        total = m * v

        def unit(kind: str, k: int) -> tuple[str, int, int]:
            chunk = (k // p) % v
            return kind, (k // (p * v)) * p + k % p, (v - 1 - chunk if kind == "backward" else chunk)

        warmup = min(2 * (p - device - 1) + (v - 1) * p, total)
        order = [unit("forward", k) for k in range(warmup)]
        for i in range(total - warmup):
            order += [unit("forward", warmup + i), unit("backward", i)]
        return order + [unit("backward", k) for k in range(total - warmup, total)]

    def in_flight(self, stage, num_stages, num_microbatches):
        """The peak of stage ``stage``'s own microbatches (its chunk's), read from the order table."""
        p = num_stages // self.chunks
        return self.peak_in_flight(stage % p, p, num_microbatches, chunk=stage // p)

    def fill_ratio(self):
        return 1.0 / self.chunks


SCHEDULES = {"1f1b": OneFOneB, "gpipe": GPipe, "zb-h1": ZBH1, "interleaved": Interleaved}
# "auto" tries them in this order; ties go to the first


def get_schedule(name: str, chunks: int = 2) -> Schedule:
    """A schedule by name (``"gpipe"``, ``"1f1b"``, ``"zb-h1"``, ``"interleaved"`` with ``chunks``
    stages per device group; the others ignore ``chunks``).

    Raises:
        ValueError: for an unknown name, or ``chunks < 2`` for ``"interleaved"``.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}")
    return Interleaved(chunks) if name == "interleaved" else SCHEDULES[name]()


def device_seconds(schedule: Schedule, stage_seconds) -> list[float]:
    """Per device group, the sum of its stages' times (stage ``s`` on group ``s mod p``).

    Raises:
        ValueError: the stage count is not a multiple of the schedule's chunks.
    """
    if len(stage_seconds) % schedule.chunks:
        raise ValueError(f"{len(stage_seconds)} stages cannot make device groups of {schedule.chunks} chunks")
    p = len(stage_seconds) // schedule.chunks
    return [sum(stage_seconds[d::p]) for d in range(p)]


def step_seconds(schedule: Schedule, stage_seconds, num_microbatches: int) -> float:
    """Predicted pipeline time of one step, ``B max T_d + r (sum T_d - max T_d)`` seconds (module
    docstring), for per-microbatch stage times ``stage_seconds`` (forward + backward, seconds)
    summed per device group (``device_seconds``)."""
    t = device_seconds(schedule, stage_seconds)
    return num_microbatches * max(t) + schedule.fill_ratio() * (sum(t) - max(t))


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
    """Timeline of one step: each device group runs its compute actions in schedule order, a
    forward once the previous stage's forward of that microbatch is done, a backward once the
    next stage's backward of it is done, a weight pass after its stage's backward of it
    (transfers take no time here; they are in the stage times). A split schedule's ``backward``
    takes ``1 - WEIGHT_SHARE`` of ``backward_seconds`` and its ``weight`` the rest. Times are per
    stage (all ``S = v p`` of them); a slot's ``stage`` is the global stage, on group ``stage mod p``.

    Raises:
        RuntimeError: the schedule deadlocks (a bug in a schedule).
    """
    S, B = len(forward_seconds), num_microbatches
    P = len(device_seconds(schedule, forward_seconds))
    share = WEIGHT_SHARE if schedule.split_backward else 0.0
    seconds = {"forward": forward_seconds, "backward": [x * (1 - share) for x in backward_seconds],
               "weight": [x * share for x in backward_seconds]}
    orders = [schedule.compute_order(d, P, B) for d in range(P)]
    pos, free = [0] * P, [0.0] * P
    done: dict[tuple[int, str, int], float] = {}
    slots: list[Slot] = []
    while any(pos[d] < len(orders[d]) for d in range(P)):
        progressed = False
        for d in range(P):
            while pos[d] < len(orders[d]):
                kind, mb, c = orders[d][pos[d]]
                s = c * P + d
                dep = {"forward": (s - 1, "forward", mb) if s > 0 else None,
                       "backward": (s + 1, "backward", mb) if s < S - 1 else (s, "forward", mb),
                       "weight": (s, "backward", mb)}[kind]
                if dep is not None and dep not in done:
                    break
                start = max(free[d], done[dep] if dep is not None else 0.0)
                end = start + seconds[kind][s]
                done[(s, kind, mb)] = free[d] = end
                slots.append(Slot(s, kind, mb, start, end))
                pos[d] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule.name} deadlocks")
    return slots
