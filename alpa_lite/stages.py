r"""The inter-operator pass: layer clustering and Alpa's stage/submesh dynamic program.

Zheng et al., "Alpa", OSDI'22, section 5. The captured forward graph is cut into ``L`` layers
(section 5.2), consecutive layers are grouped into ``S`` pipeline stages, each stage runs on a
submesh of the ``N x M`` cluster with its own intra-op plan (section 4, ``planner.py``), and a
training step pushes ``B`` microbatches through the stages (GPipe or 1F1B, ``pipeline/``).

Layer clustering (section 5.2). The non-placeholder nodes, in topological order, are first
grouped into *atoms*: maximal runs of nodes of the same module (``blocks.3``, or a top-level
module such as ``wte``), read from ``nn_module_stack``, so layer boundaries fall on module
boundaries. With ``f_a`` the forward FLOPs of atom ``a`` and ``c_p`` the bytes of values
produced at or before atom ``p`` and consumed after it, a DP over atoms picks ``L - 1`` cuts

    minimize  sum_{cuts p} c_p    subject to   avg / (1 + delta) <= FLOPs(layer) <= (1 + delta) avg,
                                               avg = sum_a f_a / L,

with ``delta`` the smallest of 0.1, 0.25, 0.5, 1, 2, inf that is feasible. A parameter belongs
to the layer of its first consumer (a tied weight used by two layers is held by both).

Stage DP (section 5.1). Submesh shapes are ``(1, 1), (1, 2), (1, 4) ... (1, M)`` and ``(k, M)``
for ``k = 2 .. N``. For layers ``[k, i)`` on submesh ``q`` the cost model gives options
``(t, o, w, a)``: ``t`` seconds of forward + backward of one microbatch (its best logical mesh
and intra-op plan, plus receiving its inputs and sending their gradients back), ``o`` seconds
paid once per step (the bucketed data-parallel gradient all-reduce), ``w`` bytes of weights,
gradients and optimizer state, ``a`` bytes of activations per microbatch in flight. Counting
stages from the end (``s = 1`` is the last stage), a stage keeps ``n(s)`` microbatches in flight:
``min(s, B)`` under 1F1B, ``B`` under GPipe; an option is feasible when ``w + n(s) a <= M_dev``.
For a bound ``t_max`` on the per-microbatch time of every stage,

    F(0, L, 0) = 0
    F(s, k, d) = min_{k < i <= L, q : |q| <= d, t <= t_max, feasible(s)}  t + o + F(s - 1, i, d - |q|)

and the pipeline step time (Alpa's eq. 2, with the once-per-step terms added) is

    T* = min_{t_max} min_s  F(s, 0, N M) + (B - 1) t_max.

``t_max`` runs over the distinct option times in increasing order; since every solution whose
largest stage time is ``t_max`` costs at least ``B t_max``, the loop stops once
``B t_max >= T*`` (the paper's pruning). ``stage_dp`` takes the cost model as a function, so it
is tested against ``exhaustive_stage_search`` on fixed tables without torch.

Stage costs (``GraphStageCosts``) come from the intra-op ILP (section 4) on the stage's
subgraph (``planner.build_cost_graph(..., nodes=...)``), for every logical shape of the submesh;
the fastest wins. Values cross between stages as the runtime moves them (``pipeline/``): the
sending stage all-gathers each value it produced to ``R`` on its mesh (priced from the spec it
produced the value in), every device of the receiving stage gets the whole value from one
sender, ``2 (alpha + bytes beta)`` forward and backward on the inter-node link, and slices the
spec its consumers want (free: a received value enters the stage ILP in any spec).
Two ways to solve a stage of layers ``[k, i)``:

- ``mode="exact"``: one ILP over all its nodes; identical ranges (same node signature) share it.
- ``mode="chain"`` (default): one ILP per layer, in order; layer ``j``'s ILP is charged the
  resharding of each operand from the spec an earlier layer of the stage produced it in, and a
  weight an earlier layer placed keeps its spec. Chains from every start share one cache keyed
  by (layer signature, incoming specs, logical mesh), so the ILP count grows with the distinct
  layers, not with the ``L^2`` ranges. The result is an executable plan (the runtime runs exactly
  these specs) priced exactly; it may miss what a whole-range ILP finds (on GPT-3 2.6B over
  2x4 A100s the pipeline's step time came out 0.006% above the exact mode's, in a fifth of
  the planning time). Layer ``j`` may use the whole memory; if the stage then does not fit, every
  layer gets ``M / 2^m`` for ``m = 1 .. ceil(log2 (i - k))`` until it does; when no split fits
  although every layer fits alone, the stage falls back to one ILP (the exact mode).

Data-parallel gradient all-reduces run once per step: the stage ILP, whose objective is per
microbatch, weighs them ``1 / B`` and reports them as ``o``.

Planning time. The memory sweeps above re-ask the same per-layer ILP under other constraints
``w + s a <= M``; an answer found under a looser one that satisfies the tighter one is its
optimum too, and an infeasible one stays infeasible, so those are reused (``_solve``). The
options of different submeshes share no ILP (their logical shapes differ): ``prefetch`` computes
them in forked worker processes, one submesh per task. On 2 cores GPT-3 39B on 8x8 A100s plans
in ~30 s at B = 128 and ~60 s at B = 32 (docs/plan_quality.md).
"""
from __future__ import annotations

import itertools
import math
import multiprocessing
import operator
import os
import re
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np

from .resharding import is_gradient_sync, reshard_costs
from .spec import ShardingSpec

SCHEDULES = ("1f1b", "gpipe")
BACKWARD_SHARE = 2 / 3  # backward's share of a stage's forward + backward time (2x the forward FLOPs)


class PipelinePlanError(ValueError):
    """No pipeline plan exists for the request (too many stages, nothing fits memory ...)."""


# ----------------------------------------------------------------------------- the stage DP


@dataclass(frozen=True)
class StageOption:
    """One way to run a layer range on a submesh (units: seconds, bytes per device).

    Attributes:
        seconds: forward + backward of one microbatch, including its input transfer.
        weight_bytes: parameters, gradients and optimizer state.
        act_bytes: activations kept for backward per microbatch in flight.
        once_seconds: paid once per training step (gradient synchronization).
        payload: what the cost model needs to rebuild this option (not compared).
    """

    seconds: float
    weight_bytes: float = 0.0
    act_bytes: float = 0.0
    once_seconds: float = 0.0
    payload: object = field(default=None, compare=False)

    def fits(self, in_flight: int, memory_bytes: float) -> bool:
        return self.weight_bytes + in_flight * self.act_bytes <= memory_bytes


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
    """The DP's answer: ``objective`` = predicted step seconds = ``sum(t + o) + (B - 1) t_max``."""

    objective: float
    t_max: float
    stages: list[StageChoice]
    num_microbatches: int
    schedule: str
    t_max_tried: int = 0


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


def in_flight(stage_from_end: int, num_microbatches: int, schedule: str) -> int:
    """Microbatches whose activations a stage holds at its peak: stage ``i`` of ``S`` is
    ``S - i`` from the end and keeps ``min(S - i, B)`` under 1F1B, ``B`` under GPipe."""
    if schedule == "gpipe":
        return num_microbatches
    return min(stage_from_end, num_microbatches)


def _check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")


def _check_stage_count(num_stages: int | None, num_layers: int, num_devices: int) -> int:
    limit = min(num_layers, num_devices)
    if num_stages is not None and not 1 <= num_stages <= limit:
        raise PipelinePlanError(f"num_stages={num_stages} is impossible: each stage needs at least one layer and "
                                f"one device; there are {num_layers} layers and {num_devices} devices "
                                f"(so 1 <= num_stages <= {limit})")
    return limit


def _objective(stages: Sequence[StageChoice], b: int) -> float:
    return sum(s.option.seconds + s.option.once_seconds for s in stages) + (b - 1) * max(s.option.seconds for s in stages)


def stage_dp(num_layers: int, cluster_shape: tuple[int, int], cost: CostFn, memory_bytes: float,
             num_microbatches: int, *, num_stages: int | None = None, schedule: str = "1f1b",
             submeshes: Sequence[tuple[int, int]] | None = None) -> DPResult:
    """Alpa's stage/submesh DP (module docstring; OSDI'22 section 5.1, Algorithm 1).

    Args:
        num_layers: L, the layers ``0 .. L-1`` in pipeline order.
        cluster_shape: ``(N, M)``: N nodes of M devices; every device is used.
        cost: ``cost(start, end, submesh) -> [StageOption]`` for layers ``[start, end)``.
        memory_bytes: device memory, bytes.
        num_microbatches: B.
        num_stages: fix S (None: any).
        schedule: ``"1f1b"`` or ``"gpipe"`` (the activations each stage keeps in flight).
        submeshes: the submesh shapes to use (default ``submesh_shapes(cluster_shape)``).

    Returns:
        the optimal ``DPResult``.

    Raises:
        PipelinePlanError: ``num_stages`` out of range, or no assignment fits memory.
    """
    _check_schedule(schedule)
    n, m = cluster_shape
    devices, b = n * m, int(num_microbatches)
    if b < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    s_max = _check_stage_count(num_stages, num_layers, devices)
    if num_stages is not None:
        s_max = num_stages
    shapes = list(submeshes or submesh_shapes(cluster_shape))
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
            for j, o in enumerate(options):
                if o.fits(in_flight(s, b, schedule), memory_bytes):
                    t_arr[k, i, q, s - 1, j], o_arr[k, i, q, s - 1, j] = o.seconds, o.once_seconds
    candidates = np.unique(t_arr[np.isfinite(t_arr)])
    best_obj, best_t, tried = math.inf, None, 0
    for t_max in candidates:
        if t_max * b >= best_obj:
            break
        tried += 1
        f, _ = _dp_table(t_arr, o_arr, t_max, sizes, devices, s_max, record=False)
        totals = f[1:, 0, devices] if num_stages is None else f[num_stages:num_stages + 1, 0, devices]
        obj = float(totals.min()) + (b - 1) * float(t_max)
        if obj < best_obj:
            best_obj, best_t = obj, float(t_max)
    if best_t is None:
        raise PipelinePlanError(f"no pipeline fits {memory_bytes / 2**30:.2f} GiB per device on a {n}x{m} cluster "
                                f"with {b} microbatches ({schedule}); use more devices, more microbatches or "
                                "a smaller batch")
    f, choice = _dp_table(t_arr, o_arr, best_t, sizes, devices, s_max, record=True)
    totals = f[:, 0, devices].copy()
    totals[0] = np.inf
    if num_stages is not None:
        totals[np.arange(s_max + 1) != num_stages] = np.inf
    s = int(np.argmin(totals))
    stages, k, d = [], 0, devices
    while s > 0:
        i, q = choice[s, k, d]
        masked = np.where(t_arr[k, i, q, s - 1] <= best_t, t_arr[k, i, q, s - 1] + o_arr[k, i, q, s - 1], np.inf)
        option = table[(k, int(i), int(q))][int(np.argmin(masked))]
        stages.append(StageChoice(k, int(i), shapes[q], option, in_flight(s, b, schedule)))
        k, d, s = int(i), d - sizes[q], s - 1
    return DPResult(_objective(stages, b), max(st.option.seconds for st in stages), stages, b, schedule, tried)


def _dp_table(t_arr, o_arr, t_max, sizes, devices, s_max, record):
    """``F[s, k, d]`` of the module docstring for one ``t_max`` (vectorized over ``s`` and ``d``)."""
    L, Q = t_arr.shape[0], t_arr.shape[2]
    f = np.full((s_max + 1, L + 1, devices + 1), np.inf)
    f[0, L, 0] = 0.0
    choice = np.zeros((s_max + 1, L + 1, devices + 1, 2), dtype=np.int64) if record else None
    total = np.where(t_arr <= t_max, t_arr + o_arr, np.inf).min(axis=4)  # best option per stage position
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
                            submeshes: Sequence[tuple[int, int]] | None = None) -> DPResult:
    """Every partition of the layers into stages and every submesh sequence using all devices
    (the reference ``stage_dp`` is tested against; exponential, small cases only)."""
    _check_schedule(schedule)
    n, m = cluster_shape
    devices, b = n * m, num_microbatches
    _check_stage_count(num_stages, num_layers, devices)
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
            n_fl = in_flight(total_s - idx, b, schedule)
            per_stage.append([StageChoice(k, i, shape, o, n_fl) for o in cost(k, i, shape) if o.fits(n_fl, memory_bytes)])
        if not all(per_stage):
            return
        for combo in _product(per_stage):
            obj = _objective(combo, b)
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


def bubble_fraction(stage_seconds: Sequence[float], num_microbatches: int) -> float:
    """Idle share of the devices' time in one pipelined step: ``1 - B sum_i t_i / (S T)`` with
    ``T = sum_i t_i + (B - 1) max_i t_i`` (equal stages: ``(S - 1) / (B + S - 1)``)."""
    s, b = len(stage_seconds), num_microbatches
    total = sum(stage_seconds) + (b - 1) * max(stage_seconds)
    return 1.0 - b * sum(stage_seconds) / (s * total) if total > 0 else 0.0


# ----------------------------------------------------------------------------- layer clustering


@dataclass(frozen=True)
class Layer:
    """A contiguous run of graph nodes.

    Attributes:
        nodes: non-placeholder node names in topological order.
        placeholders: parameter / buffer / input placeholders its nodes consume.
        flops: forward FLOPs (``ops.flops``).
        modules: the module names of its atoms (``blocks.3``, ``wte`` ...), for display.
    """

    nodes: tuple[str, ...]
    placeholders: tuple[str, ...]
    flops: float
    modules: tuple[str, ...]


_NUMBERED = re.compile(r"^(.*?\.\d+)(\.|$)")
LAYER_DELTAS = (0.1, 0.25, 0.5, 1.0, 2.0, math.inf)


def _module_key(node) -> str:
    stack = node.meta.get("nn_module_stack")
    path = list(stack.values())[-1][0] if stack else ""
    path = path[len("model."):] if path.startswith("model.") else ("" if path == "model" else path)
    m = _NUMBERED.match(path)
    return m.group(1) if m else path.split(".")[0]


def _node_flops(node) -> float:
    from .ops import flops, signature
    return flops(node, signature(node))


def cluster_layers(cg, num_layers: int | None = None, max_layers: int = 16) -> list:
    """Cut the captured graph into layers of balanced FLOPs with few cross-layer bytes.

    Args:
        cg: a ``CapturedGraph``.
        num_layers: L; None: ``min(atoms, max_layers)``.

    Returns:
        ``L`` ``Layer`` objects in pipeline order.

    Raises:
        PipelinePlanError: ``num_layers`` exceeds the number of possible cuts (the message gives it).
    """
    import torch

    from .capture import nbytes_of

    nodes = [n for n in cg.graph.nodes if n.op == "call_function"]
    position = {n.name: i for i, n in enumerate(nodes)}
    atoms: list[list] = []
    keys: list[str] = []
    for n in nodes:
        key = _module_key(n)
        if not atoms or key != keys[-1]:
            atoms.append([])
            keys.append(key)
        atoms[-1].append(n)
    atom_of = {n.name: a for a, group in enumerate(atoms) for n in group}
    A = len(atoms)
    # cut after atom p is allowed unless a non-tensor value or a getitem's parent crosses it
    cut_bytes = np.zeros(A)
    blocked = np.zeros(A, dtype=bool)
    for n in nodes:
        users = [u for u in n.users if u.name in position]
        if not users:
            continue
        first, last = atom_of[n.name], max(atom_of[u.name] for u in users)
        if last == first:
            continue
        val = n.meta.get("val")
        crossing_ok = isinstance(val, torch.Tensor) and not any(u.target is operator.getitem for u in users)
        if crossing_ok:
            cut_bytes[first:last] += nbytes_of(val)
        else:
            blocked[first:last] = True
    blocked[A - 1] = False
    f = np.array([sum(_node_flops(n) for n in group) for group in atoms])
    allowed = [p for p in range(A - 1) if not blocked[p]]
    limit = len(allowed) + 1
    L = min(limit, max_layers) if num_layers is None else num_layers
    if not 1 <= L <= limit:
        raise PipelinePlanError(f"num_layers={num_layers}: this graph has {limit} possible layers at module "
                                f"boundaries (1 <= num_layers <= {limit})")
    prefix = np.concatenate([[0.0], np.cumsum(f)])
    ends = allowed + [A - 1]  # layer may end after these atoms
    cuts = None
    for delta in LAYER_DELTAS:
        avg = prefix[-1] / L
        cuts = _cluster_dp(ends, prefix, cut_bytes, L, (1 + delta) * avg, avg / (1 + delta))
        if cuts is not None:
            break
    bounds = [0] + [c + 1 for c in cuts] + [A]
    layers = []
    for a, z in itertools.pairwise(bounds):
        group = [n for atom in atoms[a:z] for n in atom]
        ph = []
        for n in group:
            for inp in n.all_input_nodes:
                if inp.op == "placeholder" and inp.name not in ph:
                    ph.append(inp.name)
        layers.append(Layer(tuple(n.name for n in group), tuple(ph), float(prefix[z] - prefix[a]),
                            tuple(dict.fromkeys(k for k in keys[a:z] if k))))
    return layers


def _cluster_dp(ends, prefix, cut_bytes, L, cap, floor):
    """Cuts (atom indices a layer ends after, last one excluded) minimizing the summed cut bytes
    with every layer's FLOPs in ``[floor, cap]``; None when infeasible."""
    E = len(ends)
    INF = math.inf
    best = np.full((L + 1, E), INF)  # best[l, e]: l layers covering atoms up to ends[e]
    back = np.full((L + 1, E), -1, dtype=np.int64)
    for e in range(E):
        if floor <= prefix[ends[e] + 1] <= cap:
            best[1, e] = 0.0 if e == E - 1 else cut_bytes[ends[e]]
    for l in range(2, L + 1):
        for e in range(E):
            own = 0.0 if e == E - 1 else cut_bytes[ends[e]]
            for p in range(e):
                if best[l - 1, p] < INF and floor <= prefix[ends[e] + 1] - prefix[ends[p] + 1] <= cap:
                    v = best[l - 1, p] + own
                    if v < best[l, e]:
                        best[l, e], back[l, e] = v, p
    if best[L, E - 1] == INF:
        return None
    cuts, e, l = [], E - 1, L
    while l > 1:
        e = int(back[l, e])
        cuts.append(ends[e])
        l -= 1
    return cuts[::-1]


# ----------------------------------------------------------------------------- stage costs from the ILP


def logical_shapes(submesh: tuple[int, int], devices_per_node: int) -> list[tuple[int, int]]:
    """Logical meshes ``(d / w, w)`` of a submesh of ``d`` devices, ``w`` a power of two up to a
    node's width. Inside one node ``(a, b)`` and ``(b, a)`` cost the same, so only ``a <= b``;
    across nodes ``w >= 2`` (``(d, 1)``, pure data parallelism, is the batch split ``S01`` of
    ``(k, M)``)."""
    d = submesh[0] * submesh[1]
    out, w = [], 2 if submesh[0] > 1 else 1
    while w <= min(d, devices_per_node):
        if d % w == 0 and (submesh[0] > 1 or d // w <= w):
            out.append((d // w, w))
        w *= 2
    return out or [(1, d)]


class GraphStageCosts:
    """The DP's cost function for a captured graph (one microbatch): intra-op ILP per stage.

    ``__call__(start, end, submesh)`` solves layers ``[start, end)`` (``mode``, module docstring)
    on every logical shape of the submesh (``logical_shapes``); when the fastest does not fit the
    in-flight activations a pipeline may need, it re-solves with the activation memory weighed
    2x, 4x ... . It returns every option no other beats in all of time, once-per-step time,
    weight and activation bytes: the DP picks per stage position (a lower ``t`` can be worth a
    higher ``o`` when ``(B - 1) t_max`` dominates).

    Args:
        cg: the ``CapturedGraph`` at microbatch size.
        layers: from ``cluster_layers``.
        cluster: the ``ClusterSpec`` (figures, devices per node) the submeshes are laid on.
        memory_bytes: device memory, bytes.
        max_in_flight: the most microbatches a stage may hold (options stop there).
        constraints: ``dict(batch_axis=0, param_specs={fqn: spec}, replicate_params=bool)`` forced on
            every stage (baselines), or None.
        shapes: ``submesh -> [logical shapes]`` override (baselines pin one).
        time_limit: ILP seconds per solve.
        mode: ``"chain"`` or ``"exact"`` (module docstring).
        num_microbatches: B; data-parallel gradient syncs weigh ``1 / B`` in the ILP.
        schedule: under 1F1B a stage ending at layer ``i`` on ``d`` devices is at most
            ``min(L - i, D - d) + 1`` stages from the end: options stop at that many in flight.
    """

    def __init__(self, cg, layers: list, cluster, memory_bytes: float, max_in_flight: int = 1,
                 constraints: dict | None = None, shapes: Callable | None = None, time_limit: float = 30.0,
                 mode: str = "chain", num_microbatches: int = 1, schedule: str = "1f1b"):
        if mode not in ("chain", "exact"):
            raise ValueError(f"mode must be 'chain' or 'exact', got {mode!r}")
        self.cg, self.layers, self.cluster, self.mode = cg, layers, cluster, mode
        self.sync_weight = 1.0 / num_microbatches
        self.schedule = schedule
        self._chains: dict[tuple, dict] = {}
        self.memory_bytes, self.max_in_flight = memory_bytes, max_in_flight
        self.constraints = constraints or {}
        self.shapes = shapes or (lambda submesh: logical_shapes(submesh, cluster.devices_per_node))
        self.time_limit = time_limit
        self._order = {n.name: i for i, n in enumerate(cg.graph.nodes)}
        self._node_sig = {n.name: _node_signature(n, cg) for n in cg.graph.nodes}
        self.crossing = crossing_values(cg, layers)
        self._cache: dict[tuple, list] = {}  # ILP key -> [(scale, budget, result, memory terms)]
        self._tables: dict[tuple, dict] = {}
        self._context = None
        self._memo: dict[tuple, list[StageOption]] = {}
        self.stats = {"ilp_solves": 0, "cache_hits": 0, "ilp_s": 0.0}

    def subset(self, start: int, end: int) -> list[str]:
        """Node names of layers ``[start, end)``: placeholders first, then nodes, graph order."""
        ph = {p for layer in self.layers[start:end] for p in layer.placeholders}
        nodes = [n for layer in self.layers[start:end] for n in layer.nodes]
        return sorted(ph, key=self._order.__getitem__) + nodes

    def transfer_seconds(self, start: int, submesh: tuple[int, int]) -> float:
        """Receiving the stage's inputs and returning their gradients, ``2 (alpha + bytes beta)``
        over the inter-node link (intra-node on a one-node cluster): every receiving device gets
        the full values from its own sender (``pipeline/executor.py``)."""
        from .capture import nbytes_of
        nbytes = sum(nbytes_of(self.cg.node(n).meta["val"]) for n, _ in self.crossing[start])
        if nbytes == 0:
            return 0.0
        link = self.cluster.inter_node if self.cluster.num_nodes > 1 else self.cluster.intra_node
        return 2 * (link.alpha + nbytes * link.beta)

    def sends(self, start: int, end: int) -> list[str]:
        """Values produced by layers ``[start, end)`` that later stages consume."""
        return [n for n, j in self.crossing[end] if j >= start]

    def __call__(self, start: int, end: int, submesh: tuple[int, int]) -> list[StageOption]:
        key = (start, end, submesh)
        if key not in self._memo:
            self._memo[key] = self._options(start, end, submesh)
        return self._memo[key]

    def prefetch(self, keys: Sequence[tuple[int, int, tuple[int, int]]], workers: int = 1) -> None:
        """Compute ``self(start, end, submesh)`` for every key of ``keys``, in up to ``workers``
        forked processes, one task per submesh. Submeshes of different sizes have disjoint
        logical shapes, so the tasks share no ILP and the options equal a serial run's."""
        groups: dict[tuple[int, int], list] = {}
        for key in keys:
            if key not in self._memo:
                groups.setdefault(key[2], []).append(key)
        tasks = sorted(groups.values(), key=len, reverse=True)
        if workers <= 1 or len(tasks) <= 1 or "fork" not in multiprocessing.get_all_start_methods():
            for key in itertools.chain(*tasks):
                self(*key)
            return
        global _PREFETCHING
        _PREFETCHING = self  # what the forked workers inherit
        try:
            with ProcessPoolExecutor(min(workers, len(tasks)), mp_context=multiprocessing.get_context("fork")) as pool:
                for memo, stats in pool.map(_prefetch_task, tasks):
                    self._memo.update(memo)
                    for k, v in stats.items():
                        self.stats[k] += v
        finally:
            _PREFETCHING = None

    def _options(self, start, end, submesh) -> list[StageOption]:
        names = self.subset(start, end) if self.mode == "exact" else None
        sig = self._signature(names) if self.mode == "exact" else None
        transfer = self.transfer_seconds(start, submesh)
        options: list[StageOption] = []
        scale = 1
        while True:
            best = None
            found = []
            for shape in self.shapes(submesh):
                if self.mode == "exact":
                    opt = self._solve_cached(sig, names, shape, scale, start, end)
                else:
                    opt, layers_fit = self._chained(start, end, shape, scale)
                    if opt is None and layers_fit:  # the memory split between layers failed: one ILP
                        subset = self.subset(start, end)
                        opt = self._solve_cached(self._signature(subset), subset, shape, scale, start, end)
                if opt is not None:
                    found.append(opt)
                if opt is not None and (best is None or opt.seconds + opt.once_seconds < best.seconds + best.once_seconds):
                    best = opt
            options += [o for o in found if o not in options]
            need = self.max_in_flight
            if self.schedule == "1f1b":
                need = min(need, len(self.layers) - end + 1, self.cluster.num_devices - submesh[0] * submesh[1] + 1)
            if best is not None and best.fits(need, self.memory_bytes) or scale >= need:
                break
            scale *= 2
        kept = [o for o in options if not any(_dominates(p, o) for p in options if p is not o)]
        return [replace(o, seconds=o.seconds + transfer) for o in kept]

    def _signature(self, names: list[str]) -> tuple:
        index = {n: i for i, n in enumerate(names)}
        forced = self.constraints.get("param_specs") or {}
        out = []
        for i, name in enumerate(names):
            node = self.cg.node(name)
            refs = tuple(index[a.name] - i if a.name in index else "ext" for a in node.all_input_nodes)
            out.append((self._node_sig[name], refs, forced.get(self.cg.param_fqns.get(name))))
        return tuple(out)

    def table(self, shape: tuple[int, int], start: int = 0, end: int | None = None) -> dict:
        """``build_strategies`` on logical mesh ``shape`` of the nodes of layers ``[start, end)``
        (default all), built once per layer."""
        from .mesh import LogicalMesh
        from .strategies import build_strategies

        if self._context is None:  # batch dims of every node, on a trivial mesh
            self._context = build_strategies(self.cg, LogicalMesh((1, 1), cluster=self.cluster))
        end = len(self.layers) if end is None else end
        out: dict = {}
        for j in range(start, end):
            key = (shape, j)
            if key not in self._tables:
                names = set(self.subset(j, j + 1))
                self._tables[key] = build_strategies(self.cg, self.cluster.logical_mesh(shape), nodes=names,
                                                     context=self._context)
            out |= self._tables[key]
        return out

    def _chained(self, start, end, shape, scale) -> tuple[StageOption | None, bool]:
        """Layers ``[start, end)`` as a chain of per-layer ILPs, each given the specs its operands
        from earlier layers of the stage were produced in (their resharding is in its objective).
        Each layer may use the whole memory budget; when the sum does not fit, every layer gets
        ``M / 2^j`` for ``j = 1 .. ceil(log2 n)`` until it does. Returns the option (None: no
        split fits) and whether every layer fits the whole budget on its own."""
        n = end - start
        first = None
        for j in range(math.ceil(math.log2(n)) + 1 if n > 1 else 1):
            best = self._chain_option(start, end, shape, scale, self.memory_bytes / 2 ** j)
            first = best if j == 0 else first
            if best is not None and best.fits(scale, self.memory_bytes):
                return best, True
        return None, first is not None

    def _chain_option(self, start, end, shape, scale, budget) -> StageOption | None:
        key = (start, shape, scale, budget)
        chain = self._chains.setdefault(key, {"parts": [], "fixed": {}, "dead": False})
        while len(chain["parts"]) < end - start and not chain["dead"]:
            j = start + len(chain["parts"])
            names = self.subset(j, j + 1)
            part = self._layer_part(j, names, shape, scale, budget, chain["fixed"])
            if part is None:
                chain["dead"] = True
                break
            chain["parts"].append(part)
            chain["fixed"].update({n: s for n, s in zip(names, part[4]) if s is not None})
        if len(chain["parts"]) < end - start:
            return None
        parts = chain["parts"][:end - start]
        mesh = self.cluster.logical_mesh(shape)
        gather = sum(send_gather_seconds(self.cg, n, ShardingSpec.parse(chain["fixed"][n][0]), mesh)
                     for n in self.sends(start, end))
        return StageOption(sum(p[0] for p in parts) + gather, sum(p[2] for p in parts), sum(p[3] for p in parts),
                           sum(p[1] for p in parts), payload=(shape, scale, budget))

    def _layer_part(self, layer, names, shape, scale, budget, fixed) -> tuple | None:
        """``(seconds, once, weight, act, out specs by position)`` of one layer given ``fixed``."""
        ext = [a.name for n in names for a in self.cg.node(n).all_input_nodes if a.name not in names]
        given = {n: fixed[n] for n in dict.fromkeys(ext + names) if n in fixed}
        key = (self._signature(names), tuple(given.get(n) for n in dict.fromkeys(ext + names)), shape)

        def part():
            sol = solve_stage(self.cg, names, self.cluster.logical_mesh(shape), budget, scale,
                              self.table(shape, layer, layer + 1), self.constraints, self.time_limit, fixed=given,
                              sync_weight=self.sync_weight)
            return (sol.seconds, sol.once_seconds, sol.weight_bytes, sol.act_bytes,
                    [sol.nodes[n].out_specs if n in sol.nodes else None for n in names]), sol.ilp_memory

        return self._solve(key, scale, budget, part)

    def _solve_cached(self, sig, names, shape, scale, start, end) -> StageOption | None:
        sends = self.sends(start, end)

        def option():
            mesh = self.cluster.logical_mesh(shape)
            sol = solve_stage(self.cg, names, mesh, self.memory_bytes, scale, self.table(shape, start, end),
                              self.constraints, self.time_limit, sync_weight=self.sync_weight, sends=sends)
            return StageOption(sol.seconds, sol.weight_bytes, sol.act_bytes, sol.once_seconds,
                               payload=(shape, scale)), sol.ilp_memory

        return self._solve((sig, tuple(names.index(n) for n in sends), shape), scale, self.memory_bytes, option)

    def _solve(self, key, scale, budget, solve):
        """``solve()`` for the ILP ``key`` whose memory constraint is ``w + scale a <= budget``, or
        an earlier answer that is provably the same: an ILP solved under a looser constraint
        (``scale' <= scale``, ``budget' >= budget``) whose optimum satisfies this one is optimal
        here too (same objective, smaller feasible set); one that was infeasible stays so."""
        entries = self._cache.setdefault(key, [])
        for s, m, result, (w, a) in entries:
            if s <= scale and m >= budget and (result is None or w + scale * a <= budget):
                self.stats["cache_hits"] += 1
                return result
        t0 = time.perf_counter()
        try:
            result, terms = solve()
        except _Infeasible:
            result, terms = None, (0.0, 0.0)
        self.stats["ilp_solves"] += 1
        self.stats["ilp_s"] += time.perf_counter() - t0
        entries.append((scale, budget, result, terms))
        return result


_PREFETCHING: GraphStageCosts | None = None


def _prefetch_task(keys):
    costs = _PREFETCHING
    before = dict(costs.stats)
    memo = {key: costs(*key) for key in keys}
    return memo, {k: v - before[k] for k, v in costs.stats.items()}


def _dominates(a: StageOption, b: StageOption) -> bool:
    """``a`` is at least as good as ``b`` in every figure and better in one."""
    fa = (a.seconds, a.once_seconds, a.weight_bytes, a.act_bytes)
    fb = (b.seconds, b.once_seconds, b.weight_bytes, b.act_bytes)
    return all(x <= y for x, y in zip(fa, fb)) and fa != fb


class _Infeasible(Exception):
    pass


def _node_signature(node, cg) -> tuple:
    from .capture import shape_of
    val = node.meta.get("val")
    dtype = str(getattr(val, "dtype", type(val).__name__))
    kind = ("param" if node.name in cg.param_fqns else "buffer" if node.name in cg.buffer_fqns
            else "input" if node.name in cg.input_names else node.op)
    args = tuple(a if isinstance(a, (int, float, bool, str, type(None))) else
                 tuple(x for x in a if isinstance(x, (int, float))) if isinstance(a, (list, tuple)) else "n"
                 for a in node.args)
    target = "placeholder" if node.op == "placeholder" else str(node.target)
    return (kind, target, shape_of(node), dtype, args, node.name in cg.requires_grad)


def crossing_values(cg, layers) -> list[list[tuple[str, int]]]:
    """Per cut ``c`` (before layer ``c``, ``0 .. L``): ``(name, layer)`` of every value produced by
    a layer before ``c`` and consumed at or after it (placeholders excluded), graph order."""
    layer_of = {n: i for i, layer in enumerate(layers) for n in layer.nodes}
    out: list[list[tuple[str, int]]] = [[] for _ in range(len(layers) + 1)]
    for name, i in layer_of.items():
        users = [layer_of[u.name] for u in cg.node(name).users if u.name in layer_of]
        for c in range(i + 1, max(users, default=i) + 1):
            out[c].append((name, i))
    return out


def send_gather_seconds(cg, name: str, spec, mesh) -> float:
    """A stage sends ``name`` on replicated: all-gathering it from ``spec`` on the stage's mesh,
    forward (its gradient comes back whole: the backward is a slice)."""
    from .capture import shape_of
    val = cg.node(name).meta["val"]
    return reshard_costs(mesh)(spec, ShardingSpec.replicated(len(shape_of(cg.node(name)))),
                               () if name in cg.requires_grad else None, tuple(val.shape), val.element_size())


@dataclass
class StageSolution:
    """The intra-op solution of one stage: its node strategies and cost figures (seconds per
    microbatch, bytes per device). ``nodes``: as chosen, every gradient sync still on its edge
    (``planner.training_step`` defers them once the whole stage is known). ``ilp_memory``: the
    two parts of the ILP's memory constraint at the optimum, ``(w, a)`` with
    ``w + act_scale a <= memory_bytes`` (``w`` includes weights an earlier layer placed, which
    ``weight_bytes`` leaves out)."""

    seconds: float
    once_seconds: float
    weight_bytes: float
    act_bytes: float
    nodes: dict
    compute_seconds: float
    ilp_memory: tuple[float, float]


def solve_stage(cg, names: list[str], mesh, memory_bytes: float, act_scale: int = 1, table=None,
                constraints: dict | None = None, time_limit: float = 30.0,
                fixed: dict[str, tuple[str, ...]] | None = None, sync_weight: float = 1.0,
                sends: Sequence[str] = ()) -> StageSolution:
    """Solve the intra-op ILP (section 4) of the subgraph ``names`` on ``mesh``.

    The memory constraint counts activations ``act_scale`` times (microbatches in flight).
    Values produced outside ``names`` arrive free in the ILP, unless ``fixed`` gives the specs
    they were produced in (earlier layers of a chained stage): then their resharding into each
    consumer's spec is charged, and a placeholder in ``fixed`` (a weight an earlier layer already
    placed, e.g. a tied embedding) keeps that spec and its memory is not counted again. At run
    time a value from another stage crosses replicated (``boundary_spec``). ``table``:
    ``build_strategies(cg, mesh)`` of the whole graph, reused. A data-parallel gradient
    all-reduce runs once per step, after the last of ``B`` microbatches: the objective, which is
    per microbatch, weighs it ``sync_weight = 1 / B``; the returned ``seconds`` leave it out and
    ``once_seconds`` holds the bucketed all-reduces. ``sends``: values later stages consume; the
    all-gather that sends them on replicated (``send_gather_seconds``) is in the objective.

    Raises:
        _Infeasible: nothing fits ``memory_bytes``, or a forced spec leaves no strategy.
    """
    from . import planner
    from .ilp import MemoryBudgetError, SolverError, solve
    from .strategies import build_strategies

    subset = set(names)
    fixed = fixed or {}
    full = table if table is not None else build_strategies(cg, mesh)
    table = {n: replace(full[n], strategies=list(full[n].strategies)) for n in names if n in full}
    try:
        _constrain(cg, table, mesh, constraints or {})
        for n in names:
            if n in fixed and n in table:
                planner._restrict(table[n], lambda s, spec=fixed[n][0]: str(s.out_spec) == spec)
    except ValueError as e:
        raise _Infeasible(str(e)) from None
    graph, where = planner.build_cost_graph(cg, table, mesh, nodes=subset)
    reshard = reshard_costs(mesh)
    for n in names:  # operands produced in a known spec by an earlier layer: charge their resharding
        if n not in where:
            continue
        ns = table[n]
        for i, (src, r) in enumerate(zip(ns.inputs, ns.input_results)):
            if src in subset or src not in fixed:
                continue
            val = cg.node(src).meta["val"]
            val = val[r] if isinstance(val, (tuple, list)) else val
            have = ShardingSpec.parse(fixed[src][r])
            for p, q in enumerate(where[n].index):
                s = ns.strategies[q]
                graph.costs[where[n].var][p] += reshard(have, s.in_specs[i], s.grad_partial[i], tuple(val.shape),
                                                        val.element_size(), src in cg.param_fqns)
    for n in sends:
        for p, q in enumerate(where[n].index):
            graph.costs[where[n].var][p] += send_gather_seconds(cg, n, table[n].strategies[q].out_specs[0], mesh)
    if sync_weight != 1.0:
        _discount_gradient_sync(cg, table, where, graph, names, reshard, sync_weight)
    weight_vars = {where[p].var for p in names if p in cg.param_fqns or p in cg.buffer_fqns}
    unscaled = graph.memory
    if act_scale != 1:
        graph.memory = [m if v in weight_vars else [x * act_scale for x in m] for v, m in enumerate(graph.memory)]
    try:
        sol = solve(graph, memory_bytes, time_limit=time_limit)
    except (MemoryBudgetError, SolverError) as e:
        raise _Infeasible(str(e)) from None
    chosen = {n: table[n].strategies[w.index[sol.choice[w.var]]] for n, w in where.items()}
    nodes = {n: planner._node_plan(s, table[n]) for n, s in chosen.items()}
    weights = sum(s.memory for n, s in chosen.items() if (n in cg.param_fqns or n in cg.buffer_fqns) and n not in fixed)
    acts = sum(s.memory for n, s in chosen.items() if not (n in cg.param_fqns or n in cg.buffer_fqns))
    # boundary values: replicated NodePlans so the collectives of the stage can be listed
    for n in list(nodes):
        for src in nodes[n].inputs:
            if src not in nodes:
                nodes[src] = boundary_node_plan(cg, src, fixed.get(src))
    _, grad_sync, collectives = planner.training_step(stage_view(cg, subset), nodes, mesh)
    # the objective holds sync_weight x every gradient sync; per microbatch the deferred ones
    # (bucketed, once per step) do not run and the others run in full
    sync_all = sync_deferred = 0.0
    for n, np_ in nodes.items():
        if n not in chosen:
            continue
        for i, src in enumerate(np_.inputs):
            if src in cg.param_fqns and src in chosen:
                s = chosen[n]
                val = cg.node(src).meta["val"]
                src_spec = chosen[src].out_specs[0]
                if is_gradient_sync(src_spec, s.in_specs[i], s.grad_partial[i]):
                    cost = reshard(src_spec, s.in_specs[i], s.grad_partial[i], tuple(val.shape), val.element_size(), True)
                    sync_all += cost
                    sync_deferred += cost if src in grad_sync else 0.0
    once = sum(c.seconds for c in collectives if c.node.startswith("gradient bucket"))
    compute = sum(s.compute for s in chosen.values())
    seconds = sol.objective + (1 - sync_weight) * sync_all - sync_deferred
    terms = [0.0, 0.0]  # the ILP's memory: sum over weight variables, sum over the others (unscaled)
    for v, m in enumerate(unscaled):
        terms[v not in weight_vars] += m[sol.choice[v]]
    return StageSolution(max(seconds, 0.0), once, weights, acts, nodes, compute,
                         tuple(terms))


def _discount_gradient_sync(cg, table, where, graph, names, reshard, weight: float) -> None:
    """Scale the gradient-sync part of every parameter edge of the cost graph by ``weight``."""
    for n in names:
        if n not in where or n not in table:
            continue
        ns = table[n]
        for i, src in enumerate(ns.inputs):
            if src not in where or src not in cg.param_fqns:
                continue
            val = cg.node(src).meta["val"]
            sv, dv = where[src], where[n]
            outs = tuple(table[src].strategies[p].out_specs[0] for p in sv.index)
            ins = tuple((ns.strategies[q].in_specs[i], ns.strategies[q].grad_partial[i]) for q in dv.index)
            sync = reshard.sync_matrix(outs, ins, tuple(val.shape), val.element_size())
            if any(any(row) for row in sync):
                graph.add_edge(sv.var, dv.var, [[-(1 - weight) * c for c in row] for row in sync])


def stage_view(cg, names):
    """``cg`` with only the parameters, buffers and inputs among ``names`` (one stage's share)."""
    keep = set(names)
    return replace(cg, param_fqns={k: v for k, v in cg.param_fqns.items() if k in keep},
                   buffer_fqns={k: v for k, v in cg.buffer_fqns.items() if k in keep},
                   input_names=[n for n in cg.input_names if n in keep],
                   buffer_mutations={k: v for k, v in cg.buffer_mutations.items() if k in keep})


def boundary_spec(cg, name: str) -> str:
    """The spec a value crossing between stages travels in: replicated."""
    from .capture import shape_of
    return "R" * len(shape_of(cg.node(name)) or ())


def boundary_node_plan(cg, name: str, specs: tuple[str, ...] | None = None):
    """The ``NodePlan`` of a value a stage receives: in ``specs`` (default ``boundary_spec``)."""
    from .plan import NodePlan
    return NodePlan("boundary", (), tuple(specs) if specs else (boundary_spec(cg, name),))


def _constrain(cg, table, mesh, constraints: dict) -> None:
    """Force the baselines' choices on a stage's strategy table (``planner.plan`` semantics). A
    forced spec is written for the cluster; on the stage's logical mesh a split along an axis of
    size 1 is no split (``S01R`` on a ``1 x 2`` stage is ``S1R``: ZeRO over the stage's devices)."""
    from . import planner

    by_fqn = {fqn: ph for ph, fqn in cg.param_fqns.items()}
    forced = set()
    for fqn, text in (constraints.get("param_specs") or {}).items():
        ph = by_fqn.get(fqn)
        if ph in table:
            forced.add(ph)
            spec = ShardingSpec.parse(text)
            spec = ShardingSpec(tuple(tuple(a for a in entry if mesh.shape[a] > 1) for entry in spec.dims))
            planner._force(table[ph], spec, f"parameter {fqn}", cg, mesh)
    if constraints.get("replicate_params"):
        for ph in cg.param_fqns:
            if ph in table and ph not in forced:
                planner._restrict(table[ph], lambda s: not s.out_spec.axes())
    axis = constraints.get("batch_axis")
    if axis is not None:
        want = tuple(a for a in (0, 1) if mesh.shape[a] > 1) if axis == "all" else (axis,)
        if mesh.num_devices > 1 and all(mesh.shape[a] == 1 for a in want):
            want = ()
        for name, ns in table.items():
            d = ns.batch_dims[0]
            if d is None or name in cg.param_fqns or not want:
                continue
            ok = [s for s in ns.strategies if (s.out_spec.dims[d] == want if axis == "all" else axis in s.out_spec.dims[d])]
            if ok:
                ns.strategies[:] = ok
            elif name in cg.input_names:
                raise ValueError(f"batch of {name} does not divide over mesh axes {want}")


# ----------------------------------------------------------------------------- the pipelined plan

DEFAULT_MICROBATCHES = (4, 8, 16, 32, 64)


def cluster_of(mesh):
    """The ``ClusterSpec`` an ``N x M`` ``LogicalMesh`` describes: N nodes (axis 0 links between
    them) of M devices (axis 1 links inside)."""
    from .mesh import ClusterSpec, Link
    return ClusterSpec(mesh.cluster, mesh.shape[0], mesh.shape[1], mesh.peak_flops, mesh.mem_bandwidth,
                       mesh.memory_bytes, intra_node=Link(mesh.mesh_alpha[1], max(mesh.mesh_beta[1], 1e-30)),
                       inter_node=Link(mesh.mesh_alpha[0], max(mesh.mesh_beta[0], 1e-30)))


def place_submeshes(submeshes: Sequence[tuple[int, int]], cluster_shape: tuple[int, int]) -> list[list[int]]:
    """Device ranks (``node * M + column``) of each submesh, tiling the ``N x M`` cluster: whole-node
    submeshes take whole nodes, ``(1, m)`` ones pack into nodes first-fit by decreasing ``m``.

    Raises:
        PipelinePlanError: the shapes do not tile the cluster.
    """
    n, m = cluster_shape
    free = [m] * n
    ranks: list[list[int] | None] = [None] * len(submeshes)
    order = sorted(range(len(submeshes)), key=lambda i: (-(submeshes[i][0] > 1 or submeshes[i][1] == m),
                                                          -submeshes[i][0] * submeshes[i][1], i))
    for i in order:
        rows, cols = submeshes[i]
        if rows > 1 or cols == m:
            nodes = [j for j in range(n) if free[j] == m][:rows]
            if len(nodes) < rows:
                break
            for j in nodes:
                free[j] = 0
            ranks[i] = [j * m + c for j in nodes for c in range(cols)]
        else:
            node = next((j for j in range(n) if free[j] >= cols), None)
            if node is None:
                break
            start = m - free[node]
            free[node] -= cols
            ranks[i] = [node * m + c for c in range(start, start + cols)]
    if any(r is None for r in ranks):
        raise PipelinePlanError(f"submeshes {list(submeshes)} do not tile a {n}x{m} cluster")
    return ranks


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def plan_pipeline(model, example_inputs, mesh, loss_fn=None, *, targets: tuple = (), num_stages: int | None = None,
                  schedule: str = "1f1b", num_microbatches: int | None = None, num_layers: int | None = None,
                  memory_budget: float | None = None, microbatch_candidates: Sequence[int] | None = None,
                  imbalance: float = 4.0, constraints: dict | None = None, time_limit: float = 30.0,
                  power_of_two: bool = True, workers: int | None = None, progress=None,
                  example_kwargs: dict | None = None, mode: str = "chain"):
    """Plan stages, submeshes, microbatches and every stage's intra-op plan (Alpa, section 5).

    Args:
        model, example_inputs, loss_fn, targets: as ``alpa_lite.plan``; inputs and targets carry
            the GLOBAL batch in dim 0.
        mesh: the cluster as a ``LogicalMesh`` of shape ``(N nodes, M devices per node)``.
        num_stages: S (None: the DP chooses).
        schedule: ``"1f1b"`` or ``"gpipe"``.
        num_microbatches: B (None: the best of ``microbatch_candidates``, default
            ``DEFAULT_MICROBATCHES`` that divide the batch).
        num_layers: L for the layer clustering (None: ``cluster_layers`` default).
        memory_budget: bytes per device (default ``mesh.memory_bytes``).
        imbalance: skip a (layer range, submesh) pair whose share of the devices differs from its
            share of the FLOPs by more than this factor (both ways); ``math.inf`` keeps all.
        constraints: forced choices for every stage (``GraphStageCosts``), for baselines.
        power_of_two: only ``(k, M)`` submeshes with ``k`` a power of two (``submesh_shapes``).
        time_limit: ILP seconds per stage solve.
        workers: processes that compute the stage costs (``GraphStageCosts.prefetch``); None: one
            per CPU core available (1 inside a ``torch.distributed`` job), 1: in this process.
        progress: ``progress(message)`` as planning advances.
        mode: ``"chain"`` (per-layer ILPs) or ``"exact"`` (one ILP per stage), ``GraphStageCosts``.

    Returns:
        a ``Plan`` with ``stages``.

    Raises:
        PipelinePlanError: impossible stage counts (the message gives the limits), a batch that
            ``num_microbatches`` does not divide, or nothing fits memory.
    """
    from .capture import batch_size, capture, rows
    from .losses import loss_reduction
    from .plan import Plan

    say = progress or (lambda message: None)
    _check_schedule(schedule)
    t0 = time.perf_counter()
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    batch = batch_size((inputs, example_kwargs))
    if num_microbatches is not None:
        if num_microbatches < 1 or batch % num_microbatches:
            raise PipelinePlanError(f"num_microbatches={num_microbatches} must divide the batch of {batch}")
        candidates = [num_microbatches]
    else:
        candidates = [b for b in (microbatch_candidates or DEFAULT_MICROBATCHES) if batch % b == 0] or [1]
    cluster = cluster_of(mesh)
    devices = mesh.num_devices
    budget = mesh.memory_bytes if memory_budget is None else memory_budget
    if workers is None:  # ranks of a job plan at once: they fork no workers (nor copy live process groups)
        import torch.distributed as dist
        workers = 1 if dist.is_available() and dist.is_initialized() else _cpu_count()
    best = None
    tried = {}
    for b in candidates:
        say(f"capture (microbatch {batch // b}, B={b})")
        cg = capture(model, rows(inputs, 0, batch // b), loss_fn, rows(tuple(targets), 0, batch // b),
                     rows(example_kwargs, 0, batch // b))
        layers = cluster_layers(cg, num_layers)
        _check_stage_count(num_stages, len(layers), devices)
        costs = GraphStageCosts(cg, layers, cluster, budget,
                                max_in_flight=b if schedule == "gpipe" else min(b, len(layers), devices),
                                constraints=constraints, time_limit=time_limit, num_microbatches=b, schedule=schedule,
                                mode=mode)
        pruned = _balanced(costs, layers, devices, imbalance)
        shapes = submesh_shapes(mesh.shape, power_of_two)
        say(f"stage costs (B={b}, {len(layers)} layers, {len(shapes)} submesh shapes, {workers} workers)")
        costs.prefetch([(k, i, q) for k in range(len(layers)) for i in range(k + 1, len(layers) + 1) for q in shapes
                        if pruned.kept(k, i, q)], workers)
        say(f"stage DP (B={b})")
        res = None
        for cost in (pruned, costs):  # the FLOPs-balance pruning may leave no way to make num_stages
            try:
                res = stage_dp(len(layers), mesh.shape, cost, budget, b, num_stages=num_stages, schedule=schedule,
                               submeshes=shapes)
                break
            except PipelinePlanError as e:
                tried[b] = str(e)
        if res is None:
            continue
        tried[b] = res.objective
        if best is None or res.objective < best[0].objective:
            best = (res, cg, layers, costs)
    if best is None:
        raise PipelinePlanError("no pipeline plan: " + "; ".join(f"B={k}: {v}" for k, v in tried.items()))
    res, cg, layers, costs = best
    reduction = loss_reduction(cg)
    if res.num_microbatches > 1 and reduction.problems:
        warnings.warn(f"{res.num_microbatches} microbatches change the loss: " + "; ".join(reduction.problems),
                      stacklevel=3)
    say("stage plans")
    ranks = place_submeshes([s.submesh for s in res.stages], mesh.shape)
    stage_plans = []
    for st, rk in zip(res.stages, ranks):
        stage_plans.append(_stage_plan(cg, costs, layers, st, rk, budget, time_limit, constraints))
    seconds = [s.seconds for s in stage_plans]
    param_specs: dict[str, str] = {}
    input_specs: dict[str, str] = {}
    for s in stage_plans:
        param_specs = s.plan.param_specs | param_specs
        input_specs = s.plan.input_specs | input_specs
    stats = {"total_s": time.perf_counter() - t0, "microbatch_objectives": {str(k): v for k, v in tried.items()},
             "layers": len(layers), "ilp_solves": costs.stats["ilp_solves"], "cache_hits": costs.stats["cache_hits"],
             "ilp_s": costs.stats["ilp_s"], "t_max_tried": res.t_max_tried}
    options = {"memory_budget": budget, "schedule": schedule, "num_stages": num_stages,
               "num_microbatches": res.num_microbatches, "num_layers": len(layers)}
    result = Plan(mesh=mesh, param_specs=param_specs, input_specs=input_specs, nodes={}, collectives=[],
                  compute_seconds=res.num_microbatches * sum(s.plan.compute_seconds for s in stage_plans),
                  comm_seconds=res.objective - res.num_microbatches * sum(s.plan.compute_seconds for s in stage_plans),
                  memory_bytes=max(s.memory_bytes for s in stage_plans), fingerprint=cg.fingerprint(),
                  options=options, stats=stats, stages=stage_plans, schedule=schedule,
                  num_microbatches=res.num_microbatches, bubble_fraction=bubble_fraction(seconds, res.num_microbatches),
                  pipeline_seconds=res.objective, loss_reduction=reduction)
    result.captured = cg  # the microbatch graph, for the runtime; not serialized
    result.layers = layers
    return result


def _balanced(costs: GraphStageCosts, layers, devices: int, imbalance: float) -> CostFn:
    """``costs`` without the (range, submesh) pairs whose device share is off its FLOPs share by
    more than ``imbalance`` (a single stage on every device is always kept)."""
    total = sum(layer.flops for layer in layers) or 1.0

    def kept(k, i, shape):
        share = max(sum(layer.flops for layer in layers[k:i]) / total, 1e-12)
        ratio = shape[0] * shape[1] / devices / share
        return (k, i) == (0, len(layers)) or 1 / imbalance <= ratio <= imbalance

    def cost(k, i, shape):
        return costs(k, i, shape) if kept(k, i, shape) else []

    cost.kept = kept
    return cost


def _stage_plan(cg, costs: GraphStageCosts, layers, st: StageChoice, ranks, budget, time_limit, constraints):
    """Re-solve a chosen stage on its own nodes and wrap it as a ``StagePlan``."""
    from . import planner
    from .plan import Plan, StagePlan

    names = costs.subset(st.start, st.end)
    shape, scale = st.option.payload[:2]
    mesh = costs.cluster.logical_mesh(shape)
    view = stage_view(cg, names)
    if len(st.option.payload) == 2:  # one ILP for the stage (exact mode, or the chain's fallback)
        sol = solve_stage(cg, names, mesh, budget, scale, costs.table(shape, st.start, st.end), constraints,
                          time_limit, sync_weight=costs.sync_weight, sends=costs.sends(st.start, st.end))
        nodes, compute = sol.nodes, sol.compute_seconds
    else:  # the chain of per-layer solutions the DP priced, on this stage's own layers
        fixed: dict[str, tuple[str, ...]] = {}
        real: dict = {}
        boundary: dict = {}
        compute = 0.0
        for j in range(st.start, st.end):
            part = costs.subset(j, j + 1)
            sol = solve_stage(cg, part, mesh, st.option.payload[2], scale, costs.table(shape, j, j + 1), constraints,
                              time_limit, fixed={n: fixed[n] for n in fixed}, sync_weight=costs.sync_weight)
            compute += sol.compute_seconds
            for n, np_ in sol.nodes.items():
                (boundary if np_.strategy == "boundary" else real)[n] = np_
            fixed.update({n: real[n].out_specs for n in part if n in real})
        nodes = {n: np_ for n, np_ in boundary.items() if n not in real} | real
    nodes, grad_sync, collectives = planner.training_step(view, nodes, mesh)  # the syncs of the whole stage
    plan = Plan(mesh=mesh, param_specs=planner.param_specs_of(view, nodes), input_specs={n: nodes[n].out_specs[0] for n in view.input_names},
                nodes=nodes, collectives=collectives, compute_seconds=compute,
                comm_seconds=sum(c.seconds for c in collectives),
                memory_bytes=st.option.weight_bytes + st.in_flight * st.option.act_bytes, fingerprint=cg.fingerprint(),
                options={"memory_budget": budget, "activation_scale": scale, "mode": costs.mode}, grad_sync=grad_sync)
    return StagePlan((st.start, st.end), [n for layer in layers[st.start:st.end] for n in layer.nodes],
                     st.submesh, list(ranks), plan, [n for n, _ in costs.crossing[st.start]],
                     [n for n, _ in costs.crossing[st.end]], st.option.seconds, st.option.once_seconds,
                     costs.transfer_seconds(st.start, st.submesh), st.option.weight_bytes, st.option.act_bytes,
                     st.in_flight)
