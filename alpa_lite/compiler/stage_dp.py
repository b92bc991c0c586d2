"""Alpa's stage/submesh dynamic program (Zheng et al., OSDI'22, section 5.1).

Submesh shapes are ``(1, 1), (1, 2), (1, 4) ... (1, M)`` and ``(k, M)``
for ``k = 2 .. N``. For layers ``[k, i)`` on submesh ``q`` the cost model gives options
``(t, o, w, a)``: ``t`` seconds of forward + backward of one microbatch (its best logical mesh
and intra-op plan, plus receiving its inputs and sending their gradients back), ``o`` seconds
paid once per step (the bucketed data-parallel gradient all-reduce), ``w`` bytes of weights,
gradients and optimizer state, ``a`` bytes of activations per microbatch in flight. Counting
stages from the end (``s = 1`` is the last stage), a stage keeps ``n(s)`` microbatches in flight
as its schedule says (``core/schedules.py``): ``min(s, B)`` under 1F1B, ``B`` under GPipe,
``min(S, B)`` under ZB-H1 (``S`` the stage count: the DP then runs once per ``S``); an option is
feasible when ``w + n(s) a <= M_dev``. With the schedule's fill ratio ``r`` (1 for GPipe and
1F1B, 1/3 for ZB-H1: its weight passes fill the drain) and a bound ``t_max`` on the
per-microbatch time of every stage,

    F(0, L, 0) = 0
    F(s, k, d) = min_{k < i <= L, q : |q| <= d, t <= t_max, feasible(s)}  r t + o + F(s - 1, i, d - |q|)

and the pipeline step time (Alpa's eq. 2 for ``r = 1``, with the once-per-step terms added) is

    T* = min_{t_max} min_s  F(s, 0, N M) + (B - r) t_max.

``t_max`` runs over the distinct option times in increasing order; since every solution whose
largest stage time is ``t_max`` costs at least ``B t_max``, the loop stops once
``B t_max >= T*`` (the paper's pruning). ``stage_dp`` takes the cost model as a function, so it
is tested against ``exhaustive_stage_search`` on fixed tables without torch.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..core.schedules import Schedule, device_seconds, get_schedule, step_seconds


class PipelinePlanError(ValueError):
    """No pipeline plan exists for the request (too many stages, nothing fits memory ...)."""


@dataclass(frozen=True)
class StageOption:
    """One way to run a layer range on a submesh (units: seconds, bytes per device).

    Attributes:
        seconds: forward + backward of one microbatch, including its input transfer.
        weight_bytes: parameters, gradients and optimizer state.
        act_bytes: activations kept for backward per microbatch in flight.
        once_seconds: paid once per training step (gradient synchronization, the optimizer update).
        payload: what the cost model needs to rebuild this option (not compared).
        remat_bytes: activations of the largest recomputed layer, live once whatever the number
            of microbatches in flight (``PlanOptions.remat``: one layer is recomputed at a time).
        remat: the layers recomputed, as offsets from the range's first layer (``remat="all"``:
            every recomputable one; ``"auto"``: the stage ILP's choice under the memory budget).
    """

    seconds: float
    weight_bytes: float = 0.0
    act_bytes: float = 0.0
    once_seconds: float = 0.0
    payload: object = field(default=None, compare=False)
    remat_bytes: float = 0.0
    remat: tuple[int, ...] = ()

    def fits(self, in_flight: int, memory_bytes: float) -> bool:
        return self.weight_bytes + in_flight * self.act_bytes + self.remat_bytes <= memory_bytes


CostFn = Callable[[int, int, tuple[int, int]], Sequence[StageOption]]


@dataclass(frozen=True)
class StageChoice:
    """Stage ``[start, end)`` of the layers on a submesh of shape ``submesh`` with ``option``."""

    start: int
    end: int
    submesh: tuple[int, int]
    option: StageOption
    in_flight: int


@dataclass
class DPResult:
    """The DP's answer: ``objective`` = predicted step seconds = ``sum(o) + r sum(t) + (B - r) t_max``
    (``r``: the schedule's fill ratio; ``sum(t + o) + (B - 1) t_max`` under GPipe and 1F1B).
    ``floor``: the least value of the DP's own recursion over every pipeline it considered, at
    most the step of each (equal to ``objective`` but under interleaved 1F1B, whose step sums
    stage times per device group: ``interleaved_dp``); None where not recorded."""

    objective: float
    t_max: float
    stages: list[StageChoice]
    num_microbatches: int
    schedule: str
    t_max_tried: int = 0
    floor: float | None = None


def submesh_shapes(cluster_shape: tuple[int, int], power_of_two: bool = False) -> list[tuple[int, int]]:
    """Alpa's submesh shapes for an ``N x M`` cluster: ``(1, 2^j)`` up to ``(1, M)``, then ``(k, M)``
    for ``k = 2 .. N`` (only powers of two with ``power_of_two``, as Alpa's implementation does)."""
    n, m = cluster_shape
    shapes = []
    w = 1
    while w < m:
        shapes.append((1, w))
        w *= 2
    shapes.append((1, m))
    shapes += [(k, m) for k in range(2, n + 1) if not power_of_two or k & (k - 1) == 0]
    return shapes


def in_flight(stage_from_end: int, num_stages: int, num_microbatches: int, schedule: str) -> int:
    """Microbatches whose activations a stage holds at its peak: stage ``i`` of ``S`` is
    ``S - i`` from the end and keeps ``min(S - i, B)`` under 1F1B, ``B`` under GPipe, ``min(S, B)``
    under ZB-H1 (``Schedule.in_flight``).

    Raises:
        ValueError: an unknown schedule."""
    return get_schedule(schedule).in_flight(num_stages - stage_from_end, num_stages, num_microbatches)


def _by_position(schedule: Schedule, s_max: int, b: int) -> bool:
    """Whether a stage's in-flight count depends only on its position from the end (not on ``S``)."""
    return all(schedule.in_flight(n - s, n, b) == schedule.in_flight(s_max - s, s_max, b)
               for n in range(1, s_max + 1) for s in range(1, n + 1))


def check_stage_count(num_stages: int | None, num_layers: int, num_devices: int) -> int:
    """The most stages possible, ``min(num_layers, num_devices)``.

    Raises:
        PipelinePlanError: ``num_stages`` is given and outside ``1 .. that``.
    """
    limit = min(num_layers, num_devices)
    if num_stages is not None and not 1 <= num_stages <= limit:
        raise PipelinePlanError(f"num_stages={num_stages} is impossible: each stage needs at least one layer and "
                                f"one device; there are {num_layers} layers and {num_devices} devices "
                                f"(so 1 <= num_stages <= {limit})")
    return limit


def _objective(stages: Sequence[StageChoice], b: int, schedule: Schedule) -> float:
    return sum(s.option.once_seconds for s in stages) + step_seconds(schedule, [s.option.seconds for s in stages], b)


def stage_dp(num_layers: int, cluster_shape: tuple[int, int], cost: CostFn, memory_bytes: float,
             num_microbatches: int, *, num_stages: int | None = None, schedule: str = "1f1b",
             submeshes: Sequence[tuple[int, int]] | None = None, chunks: int = 2,
             shared: Mapping[str, Sequence[int]] | None = None) -> DPResult:
    """Alpa's stage/submesh DP (module docstring; OSDI'22 section 5.1, Algorithm 1).

    Args:
        num_layers: L, the layers ``0 .. L-1`` in pipeline order.
        cluster_shape: ``(N, M)``: N nodes of M devices; every device is used.
        cost: ``cost(start, end, submesh) -> [StageOption]`` for layers ``[start, end)``.
        memory_bytes: device memory, bytes.
        num_microbatches: B.
        num_stages: fix S (None: any).
        schedule: ``"1f1b"``, ``"gpipe"``, ``"zb-h1"`` or ``"interleaved"`` (the activations each
            stage keeps in flight and the fill ratio; ``interleaved_dp`` for the last).
        submeshes: the submesh shapes to use (default ``submesh_shapes(cluster_shape)``).
        chunks: v, stages per device group under ``"interleaved"``.
        shared: under ``"interleaved"``, name -> the layers holding it, of each piece of state
            several layers hold (a tied weight), which two stages of one device group must not
            both hold (``interleaved_dp``).

    Returns:
        the optimal ``DPResult``.

    Raises:
        PipelinePlanError: ``num_stages`` out of range, or no assignment fits memory.
        ValueError: an unknown schedule.
    """
    sched = get_schedule(schedule, chunks)
    n, m = cluster_shape
    devices, b = n * m, int(num_microbatches)
    if b < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if sched.chunks > 1:
        return interleaved_dp(num_layers, cluster_shape, cost, memory_bytes, b, sched, num_stages=num_stages,
                              submeshes=submeshes, shared=shared)
    s_max = check_stage_count(num_stages, num_layers, devices)
    if num_stages is None and not _by_position(sched, s_max, b):  # in flight depends on S: one DP per S
        results, errors = [], []
        for count in range(1, s_max + 1):
            try:
                results.append(stage_dp(num_layers, cluster_shape, cost, memory_bytes, b, num_stages=count,
                                        schedule=schedule, submeshes=submeshes))
            except PipelinePlanError as e:
                errors.append(str(e))
        if not results:
            raise PipelinePlanError(errors[-1])
        best = min(results, key=lambda r: r.objective)
        best.t_max_tried = sum(r.t_max_tried for r in results)
        best.floor = min(r.floor for r in results)
        return best
    if num_stages is not None:
        s_max = num_stages
    return _solve(num_layers, devices, cost, memory_bytes, b, s_max, num_stages, sched,
                  list(submeshes or submesh_shapes(cluster_shape)), f"on a {n}x{m} cluster")


def interleaved_dp(num_layers: int, cluster_shape: tuple[int, int], cost: CostFn, memory_bytes: float,
                   num_microbatches: int, schedule: Schedule, *, num_stages: int | None = None,
                   submeshes: Sequence[tuple[int, int]] | None = None,
                   shared: Mapping[str, Sequence[int]] | None = None) -> DPResult:
    """The stage DP for interleaved 1F1B (Narayanan et al., SC'21, section 2.2.2): ``p`` equal
    device groups of one submesh shape ``q`` (``p |q|`` = all devices, ``p >= 2``, ``p`` dividing
    B) and ``S = v p`` stages, stage ``s`` on group ``s mod p``. For each such ``q`` the DP above
    runs with ``S`` stages all on ``q`` over ``v`` copies of the devices, each stage within
    ``M_dev / v`` (its chunk's share of the device; in flight: its chunk's own peak,
    ``Interleaved.in_flight``); its recursion balances stage times with the fill ratio ``1 / v``,
    and the answer's objective is the interleaved step model (``core/schedules.py``, stage
    times summed per device group). Limits: one submesh shape for all stages, and a conservative
    memory split (each chunk's peak, within an even share).

    ``shared``: name -> the layers holding it, per piece of state held by several layers (a tied
    embedding and ``lm_head``). The runtime keeps a rank's chunks disjoint, so two stages of one
    group must not both hold it: for each way to give those layers stage indices that keep them
    in one stage or on distinct groups (``_placements``), the DP runs with every range holding
    such a layer allowed only at its index (a constraint per (layer range, stage index), so each
    DP stays exact), and the least of those answers is returned.

    Raises:
        PipelinePlanError: no submesh shape makes a valid interleaved pipeline, or none fits memory.
    """
    n, m = cluster_shape
    devices, v, b = n * m, schedule.chunks, num_microbatches
    best, why, shared, least = None, [], shared or {}, math.inf
    for q in submeshes or submesh_shapes(cluster_shape):
        size = q[0] * q[1]
        p = devices // size
        if devices % size or p < 2 or b % p or p * v > num_layers or num_stages not in (None, p * v):
            continue
        where = f"on {p} groups of {q[0]}x{q[1]} devices with {v} chunks each"
        found = []
        for at in _placements(list(shared.values()), p * v, p) if shared else [None]:
            allowed = None if at is None else (
                lambda k, i, j, at=at: all(j == s_h for h, s_h in at.items() if k <= h < i))
            try:
                found.append(_solve(num_layers, v * devices, cost, memory_bytes / v, b, p * v, p * v, schedule, [q],
                                    where, allowed))
            except PipelinePlanError:
                continue
        if not found:
            try:  # why: memory alone, or the shared state
                _solve(num_layers, v * devices, cost, memory_bytes / v, b, p * v, p * v, schedule, [q], where)
                why.append(f"every pipeline {where} that fits puts two stages of one device group on layers "
                           f"holding {', '.join(shared)} (a rank's chunks must hold disjoint state)")
            except PipelinePlanError as e:
                why.append(str(e))
            continue
        res = min(found, key=lambda r: r.objective)
        least = min([least, *(r.floor for r in found)])
        if best is None or res.objective < best.objective:
            best = res
    if best is None:
        raise PipelinePlanError("; ".join(why) or (
            f"interleaved 1F1B with {v} chunks has no layout on a {n}x{m} cluster for {num_layers} layers and "
            f"{b} microbatches: it needs p >= 2 equal device groups (p divides the devices and B) and "
            f"p * {v} <= {num_layers} stages" + (f" = num_stages={num_stages}" if num_stages else "")))
    best.floor = least
    return best


def _placements(shared: Sequence[Sequence[int]], num_stages: int, p: int) -> list[dict[int, int]]:
    """Every way to give each layer of ``shared`` a stage index (from the start) such that the
    stages holding one piece of state are one stage or on distinct device groups (index mod
    ``p``): ``{layer: stage index}``, non-decreasing along the layers, as pipeline stages are."""
    out = []
    layers = sorted({h for held in shared for h in held})
    for idx in itertools.combinations_with_replacement(range(num_stages), len(layers)):
        at = dict(zip(layers, idx))
        if all(len({at[h] % p for h in held}) == len({at[h] for h in held}) for held in shared):
            out.append(at)
    return out


def _solve(num_layers: int, devices: int, cost: CostFn, memory_bytes: float, b: int, s_max: int,
           num_stages: int | None, sched: Schedule, shapes: list[tuple[int, int]], where: str,
           allowed=None) -> DPResult:
    """The DP for stage counts up to ``s_max`` (exactly ``num_stages`` when given) on ``devices``;
    ``allowed(k, i, j)``: may layers ``[k, i)`` be stage ``j`` from the start (of exactly
    ``num_stages``; None: any)."""
    r = sched.fill_ratio()
    sizes = [a * c for a, c in shapes]
    L, Q = num_layers, len(shapes)
    # per (k, i, q, s-1, option): the option's times where it fits a stage s-th from the end
    table = {(k, i, q): list(cost(k, i, shape)) for k in range(L) for i in range(k + 1, L + 1)
             for q, shape in enumerate(shapes) if sizes[q] <= devices}
    P = max((len(v) for v in table.values()), default=1) or 1
    t_arr = np.full((L, L + 1, Q, s_max, P), np.inf)
    o_arr = np.zeros((L, L + 1, Q, s_max, P))
    for (k, i, q), options in table.items():
        for s in range(1, s_max + 1):
            if allowed is not None and not allowed(k, i, num_stages - s):
                continue
            for j, o in enumerate(options):
                if o.fits(sched.in_flight(s_max - s, s_max, b), memory_bytes):
                    t_arr[k, i, q, s - 1, j], o_arr[k, i, q, s - 1, j] = o.seconds, o.once_seconds
    candidates = np.unique(t_arr[np.isfinite(t_arr)])
    best_obj, best_t, tried = math.inf, None, 0
    for t_max in candidates:
        if t_max * b >= best_obj:
            break
        tried += 1
        f, _ = _dp_table(t_arr, o_arr, t_max, r, sizes, devices, s_max, record=False)
        totals = f[1:, 0, devices] if num_stages is None else f[num_stages:num_stages + 1, 0, devices]
        obj = float(totals.min()) + (b - r) * float(t_max)
        if obj < best_obj:
            best_obj, best_t = obj, float(t_max)
    if best_t is None:
        raise PipelinePlanError(f"no pipeline fits {memory_bytes / 2**30:.2f} GiB per device {where} "
                                f"with {b} microbatches ({sched.name}); use more devices, more microbatches or "
                                "a smaller batch")
    f, choice = _dp_table(t_arr, o_arr, best_t, r, sizes, devices, s_max, record=True)
    totals = f[:, 0, devices].copy()
    totals[0] = np.inf
    if num_stages is not None:
        totals[np.arange(s_max + 1) != num_stages] = np.inf
    s = int(np.argmin(totals))
    stages, k, d = [], 0, devices
    while s > 0:
        i, q = choice[s, k, d]
        masked = np.where(t_arr[k, i, q, s - 1] <= best_t, r * t_arr[k, i, q, s - 1] + o_arr[k, i, q, s - 1], np.inf)
        option = table[(k, int(i), int(q))][int(np.argmin(masked))]
        stages.append(StageChoice(k, int(i), shapes[q], option, sched.in_flight(s_max - s, s_max, b)))
        k, d, s = int(i), d - sizes[q], s - 1
    return DPResult(_objective(stages, b, sched), max(st.option.seconds for st in stages), stages, b, sched.name, tried,
                    best_obj)


def _dp_table(t_arr, o_arr, t_max, r, sizes, devices, s_max, record):
    """``F[s, k, d]`` of the module docstring for one ``t_max`` (vectorized over ``s`` and ``d``)."""
    L, Q = t_arr.shape[0], t_arr.shape[2]
    f = np.full((s_max + 1, L + 1, devices + 1), np.inf)
    f[0, L, 0] = 0.0
    choice = np.zeros((s_max + 1, L + 1, devices + 1, 2), dtype=np.int64) if record else None
    total = np.where(t_arr <= t_max, r * t_arr + o_arr, np.inf).min(axis=4)  # best option per stage position
    usable = np.isfinite(total).any(axis=3)
    for k in range(L - 1, -1, -1):
        for i in range(k + 1, L + 1):
            for q in range(Q):
                if not usable[k, i, q]:
                    continue
                sz = sizes[q]
                cand = total[k, i, q][:, None] + f[:s_max, i, :devices + 1 - sz]
                cur = f[1:, k, sz:]
                better = cand < cur
                if better.any():
                    f[1:, k, sz:] = np.where(better, cand, cur)
                    if record:
                        view = choice[1:, k, sz:]
                        view[better] = (i, q)
    return f, choice


def exhaustive_stage_search(num_layers: int, cluster_shape: tuple[int, int], cost: CostFn, memory_bytes: float,
                            num_microbatches: int, *, num_stages: int | None = None, schedule: str = "1f1b",
                            submeshes: Sequence[tuple[int, int]] | None = None,
                   shared: Mapping[str, Sequence[int]] | None = None) -> DPResult:
    """Every partition of the layers into stages and every submesh sequence using all devices
    (the reference ``stage_dp`` is tested against; exponential, small cases only; one stage per
    device group, so not ``"interleaved"``)."""
    sched = get_schedule(schedule)
    if sched.chunks > 1:
        raise ValueError("exhaustive_stage_search gives every stage its own devices; interleaved has no reference here")
    n, m = cluster_shape
    devices, b = n * m, num_microbatches
    check_stage_count(num_stages, num_layers, devices)
    shapes = list(submeshes or submesh_shapes(cluster_shape))
    best: list = [math.inf, None]

    def rec(k: int, d: int, prefix: list[tuple[int, int, tuple[int, int]]]):
        if k == num_layers:
            if d == 0 and (num_stages is None or len(prefix) == num_stages):
                evaluate(prefix)
            return
        for i in range(k + 1, num_layers + 1):
            for shape in shapes:
                if shape[0] * shape[1] <= d:
                    rec(i, d - shape[0] * shape[1], prefix + [(k, i, shape)])

    def evaluate(prefix):
        total_s = len(prefix)
        per_stage = []
        for idx, (k, i, shape) in enumerate(prefix):
            n_fl = sched.in_flight(idx, total_s, b)
            per_stage.append([StageChoice(k, i, shape, o, n_fl) for o in cost(k, i, shape) if o.fits(n_fl, memory_bytes)])
        if not all(per_stage):
            return
        for combo in _product(per_stage):
            obj = _objective(combo, b, sched)
            if obj < best[0] - 1e-12:
                best[:] = [obj, list(combo)]

    rec(0, devices, [])
    if best[1] is None:
        raise PipelinePlanError("no pipeline fits memory")
    return DPResult(best[0], max(s.option.seconds for s in best[1]), best[1], b, schedule)


def _product(lists):
    if not lists:
        yield ()
        return
    for head in lists[0]:
        for tail in _product(lists[1:]):
            yield (head,) + tail


def bubble_fraction(stage_seconds: Sequence[float], num_microbatches: int, schedule: str = "1f1b",
                    chunks: int = 2) -> float:
    """Idle share of the devices' time in one pipelined step: ``1 - B sum_d T_d / (p T)`` with
    ``T = B max_d T_d + r (sum_d T_d - max_d T_d)`` (``core/schedules.py``; ``T_d`` the stage times
    summed per device group, ``p`` groups; equal stages: ``r (p - 1) / (B + r (p - 1))``,
    ``(S - 1) / (B + S - 1)`` under GPipe and 1F1B, ``(p - 1) / (v B + p - 1)`` interleaved)."""
    sched = get_schedule(schedule, chunks)
    b, t = num_microbatches, device_seconds(sched, stage_seconds)
    total = step_seconds(sched, stage_seconds, b)
    return 1.0 - b * sum(t) / (len(t) * total) if total > 0 else 0.0
