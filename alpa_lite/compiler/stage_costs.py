"""The stage DP's costs from the intra-op ILP (Zheng et al., OSDI'22, sections 4 and 5).

Stage costs (``GraphStageCosts``) come from the intra-op ILP (section 4) on the stage's
subgraph (``cost_graph.build_cost_graph(..., nodes=...)``), for every logical shape of the submesh;
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
  layer gets ``M / 2^m`` for ``m = 1 .. ceil(log2 (i - k))`` until it does, then its own least
  memory and an equal share of the rest (``split_budgets``); when no split fits although every
  layer fits alone, the stage falls back to one ILP (the exact mode). The stage
  of all layers also gets that one ILP (the intra-op pass's, identical blocks sharing a
  variable): with ``B = 1`` the search then holds the plan without pipelining.

Data-parallel gradient all-reduces run once per step: the stage ILP, whose objective is per
microbatch, weighs them ``1 / B``. So are a ZeRO-1/2 parameter's
reduce-scatter and its all-gather after the update (``compiler/zero.py``; offered to a parameter
that one layer consumes, and to a weight several layers share in one ILP over all of them; in a
chain such a weight keeps the spec, not the ZeRO stage, an earlier layer placed it in). An option's ``t`` and ``o`` are not the ILP's
objective: they are read from the collectives the stage's plan lists (``solve_stage``), priced as
``Plan.step_seconds`` prices an SPMD plan (ZeRO-3 groups, one latency per bucket, what backward
hides), per microbatch and once per step (``core.plan.step_parts``).

Planning time. The memory sweeps above re-ask the same per-layer ILP under other constraints
``w + s a <= M``; an answer found under a looser one that satisfies the tighter one is its
optimum too, and an infeasible one stays infeasible, so those are reused (``_solve``). The
ILPs of different logical shapes share nothing (the shape is in every ILP's key): ``prefetch``
solves them in forked worker processes, one (submesh, logical shape) per task. No ILP is built for a range whose least
weights and ``s`` times its least activations exceed the memory (``_may_fit``: no options for ``s``
or more microbatches in flight, though each layer alone may fit), nor for a stage ILP whose
nodes' least memory exceeds its row (``_check_memory``); ``lower_bound`` bounds every option's time for the
pipeline search's floors (``inter_op._pipeline_floors``). Figures: docs/plan_time.md.
"""
from __future__ import annotations

import math
import multiprocessing
import operator
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace

import torch
import torch.fx

from ..core.aten import op_args
from ..core.capture import nbytes_of, shape_of, stage_view
from ..core.mesh import LogicalMesh
from ..core.options import PlanOptions
from ..core.plan import NodePlan, step_parts
from ..core.resharding import reshard_costs
from ..core.spec import ShardingSpec
from .clustering import crossing_values
from .constraints import apply_constraints, restrict, zero_stage_blockers
from .cost_graph import build_cost_graph, value_zeros
from .ilp import MemoryBudgetError, SolverError, solve, solver_limits
from .intra_op import recomputable
from .stage_dp import StageOption
from .ops import FOLLOWER_TARGETS, flops, signature
from .strategies import (ADAM_UPDATE_BYTES_FACTOR, BACKWARD_FLOPS_FACTOR, build_strategies, kept_for_backward,
                         tensor_values, kernel_class, training_state_bytes)
from .training_step import node_plan, training_step
from .zero import add_zero_strategies


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
        options: the ``PlanOptions`` every stage is planned with (forced specs, data parallelism,
            batch axis, solver, time limit, layer sharing); the constraints are forced on
            every stage (baselines), or None.
        shapes: ``submesh -> [logical shapes]`` override (baselines pin one).
        time_limit: ILP seconds per solve.
        mode: ``"chain"`` or ``"exact"`` (module docstring).
        num_microbatches: B; data-parallel gradient syncs weigh ``1 / B`` in the ILP.
        schedule: the schedule, or a tuple of them, whose DPs use the options: options stop at
            the most microbatches a stage of the pair holds under any of them (``in_flight_need``).
        cache: a ``plan_cache.PlanCache``: ILP answers of earlier runs are read from it, and
            ``save_cache()`` adds this run's (``stats["disk_hits"]`` counts the answers read).

    A range whose weights alone, split over all the submesh's devices, exceed ``memory_bytes``
    (``least_weight_bytes``) gets no options and no ILP.

    ``refusals``: the reasons (in the order met, each once) a range got no options because the
    plan's options leave one of its nodes no strategy there, e.g. ZeRO-1/2 asked of a weight that
    two stages hold; a pipeline search that finds no plan names them.

    ``limits``: every stage-pricing ILP whose solver stopped at a limit before proving its optimum
    (solved here or read from the cache; ``"gap": None`` when it stopped before finding any feasible
    assignment, which then counts as no answer), in the order solved: ``{"ilp", "layers": [first, last],
    "submesh", "logical_mesh", "microbatches", "activation_scale", "gap"}`` (``ilp.solver_limits``).
    The DP chose among options priced by them, so ``PipelinePlan.solver_limits`` lists them too.
    """

    def __init__(self, cg, layers: list, cluster, memory_bytes: float, max_in_flight: int = 1,
                 options: PlanOptions | None = None, shapes: Callable | None = None,
                 mode: str = "chain", num_microbatches: int = 1, schedule: str = "1f1b", cache=None):
        if mode not in ("chain", "exact"):
            raise ValueError(f"mode must be 'chain' or 'exact', got {mode!r}")
        self.cg, self.layers, self.cluster, self.mode = cg, layers, cluster, mode
        self.sync_weight = 1.0 / num_microbatches
        self.num_microbatches = num_microbatches
        self.limits: list[dict] = []
        self.refusals: dict[str, None] = {}
        self.schedules = (schedule,) if isinstance(schedule, str) else tuple(schedule)
        self._chains: dict[tuple, dict] = {}  # (start, logical shape, in flight, budget) -> the chain so far
        self._shaped: dict[tuple, list] = {}  # (start, end, submesh, shape, 1) -> a worker's ``_shape_options``
        self.memory_bytes, self.max_in_flight = memory_bytes, max_in_flight
        self.options = options or PlanOptions()
        self.shapes = shapes or (lambda submesh: logical_shapes(submesh, cluster.devices_per_node))
        self._order = {n.name: i for i, n in enumerate(cg.graph.nodes)}
        self._node_sig = {n.name: _node_signature(n, cg) for n in cg.graph.nodes}
        self.crossing = crossing_values(cg, layers)
        holders = {ph: [j for j, layer in enumerate(layers) if ph in layer.placeholders] for ph in cg.param_fqns}
        self._zero_params = [ph for ph, js in holders.items() if len(js) == 1]
        self._shared = {ph: (js[0], js[-1] + 1) for ph, js in holders.items() if len(js) > 1}  # tied weights
        last: dict[str, int] = {}
        self._held_before: list[list[tuple[str, int]]] = []  # per layer: (placeholder, the last layer before
        for j, layer in enumerate(layers):                   # it holding it, or -1), graph order
            held = sorted(set(layer.placeholders), key=self._order.__getitem__)
            self._held_before.append([(ph, last.get(ph, -1)) for ph in held])
            last.update(dict.fromkeys(held, j))
        self._cache: dict[tuple, list] = {}  # ILP key -> [(scale, budget, result, memory terms)]
        self._tables: dict[tuple, dict] = {}
        self._context = None
        self._memo: dict[tuple, list[StageOption]] = {}
        self._least: dict[tuple, object] = {}  # ("act", node, devices) -> least_activation_bytes, ("compute", start,
        # end, devices) -> _range_compute, ("rooflines", layer) -> op_rooflines of its nodes
        self._bounds: dict[tuple, float] = {}  # (start, end, submesh) -> lower_bound
        self._fit: dict[tuple, float] = {}  # (start, end, submesh, in flight) -> _may_fit; the least bytes (kind first)
        self.stats = {"ilp_solves": 0, "cache_hits": 0, "disk_hits": 0, "ilp_s": 0.0, "memory_skips": 0}
        self._disk = cache and cache.file("stage", cg.fingerprint(), cluster, self.options.to_dict(), memory_bytes,
                                          self.sync_weight)

    def save_cache(self) -> None:
        """Write the ILP answers this run added to the plan cache (if any)."""
        if self._disk is not None:
            self._disk.save()

    def subset(self, start: int, end: int) -> list[str]:
        """Node names of layers ``[start, end)``: placeholders first, then nodes, graph order."""
        ph = {p for layer in self.layers[start:end] for p in layer.placeholders}
        nodes = [n for layer in self.layers[start:end] for n in layer.nodes]
        return sorted(ph, key=self._order.__getitem__) + nodes

    def transfer_seconds(self, start: int, submesh: tuple[int, int]) -> float:
        """Receiving the stage's inputs and returning their gradients, ``2 (alpha + bytes beta)``
        over the inter-node link (intra-node on a one-node cluster): every receiving device gets
        the full values from its own sender (``pipeline/executor.py``)."""
        nbytes = sum(nbytes_of(self.cg.node(n).meta["val"]) for n, _ in self.crossing[start])
        if nbytes == 0:
            return 0.0
        link = self.cluster.inter_node if self.cluster.num_nodes > 1 else self.cluster.intra_node
        return 2 * (link.alpha + nbytes * link.beta)

    def remat(self, start: int, end: int) -> list[tuple[str, ...]]:
        """The layers of ``[start, end)`` a stage may recompute: every recomputable one
        (``intra_op.recomputable``) under ``remat="all"`` (all recomputed) or ``"auto"`` (the
        stage ILP chooses each), none otherwise."""
        if not self.options.remat:
            return []
        return [layer.nodes for layer in self.layers[start:end] if recomputable(self.cg, layer.nodes)]

    def lower_bound(self, start: int, end: int, submesh: tuple[int, int]) -> float:
        """A lower bound on the ``seconds`` of every option of layers ``[start, end)`` on ``submesh``
        (no ILP): the least compute of each of their nodes (not the parameters' updates, paid once
        per step: ``core.plan.step_parts``) over the submesh's
        ``d`` devices (``least_compute_seconds`` / ``d``, the same on every logical mesh of the
        submesh), plus the input transfer every option pays. An option's per-microbatch
        ``seconds`` is its compute plus collectives less hidden ZeRO-3 reduce-scatters (at most
        those collectives: ``core.plan.step_parts``), plus sends, so no option is faster; a chain
        prices each layer on its own, counting a weight two layers share twice, one ILP once.
        inf where no option can fit the memory (``_may_fit``)."""
        key = (start, end, submesh)
        if key not in self._bounds and not self._may_fit(*key):  # no option: no time bounds it
            self._bounds[key] = math.inf
        if key not in self._bounds:
            devices = submesh[0] * submesh[1]
            self._bounds[key] = self._range_compute(start, end, devices) / devices + self.transfer_seconds(start, submesh)
        return self._bounds[key]

    def _range_compute(self, start: int, end: int, devices: int) -> float:
        """The sum of ``least_compute_seconds`` over the nodes of layers ``[start, end)`` on
        ``devices`` (not their placeholders: the optimizer update is once per step, an input or
        buffer computes nothing), summed on from ``[start, end - 1)``'s: each range costs one
        layer's nodes, not all of them; each node's rooflines (``op_rooflines``) are read once."""
        if start == end:
            return 0.0
        key = ("compute", start, end, devices)
        if key not in self._least:
            before = self._range_compute(start, end - 1, devices)
            if ("rooflines", end - 1) not in self._least:
                mesh = self.cluster.logical_mesh((1, 1))  # the cluster's rates: any logical mesh's
                self._least["rooflines", end - 1] = [op_rooflines(self.cg.node(n), mesh) for n in self.layers[end - 1].nodes]
            self._least[key] = sum(((1 + BACKWARD_FLOPS_FACTOR) * min(devices * replicated, split)
                                    for replicated, split in self._least["rooflines", end - 1]), before)
        return self._least[key]

    def least_weight_bytes(self, start: int, end: int, submesh: tuple[int, int]) -> float:
        """A lower bound on the ``weight_bytes`` of every option of layers ``[start, end)`` on
        ``submesh`` (no ILP): each parameter's weight, gradient and Adam states
        (``strategies.training_state_bytes``) and each buffer split over all the submesh's
        devices. No strategy (a split spec, ZeRO-1/2/3) stores less of any of them per device, so
        a range above the memory budget by this alone has no option that fits."""
        key = ("weights", start, end, submesh)
        if key not in self._fit:
            devices = submesh[0] * submesh[1]
            total = self.least_weight_bytes(start, end - 1, submesh) if end - 1 > start else 0.0
            for ph in self._first_holds(start, end - 1):
                share = nbytes_of(self.cg.node(ph).meta["val"]) / devices
                if ph in self.cg.param_fqns:
                    total += sum(training_state_bytes(share))
                elif ph in self.cg.buffer_fqns:
                    total += share
            self._fit[key] = total
        return self._fit[key]

    def least_act_bytes(self, start: int, end: int, submesh: tuple[int, int]) -> float:
        """A lower bound on the ``act_bytes`` of every option of layers ``[start, end)`` on
        ``submesh`` (no ILP): ``least_activation_bytes`` of each node the stage keeps for backward,
        leaving out the layers it may recompute (``remat``: only the largest counts, once)."""
        key = ("activations", start, end, submesh)
        if key not in self._fit:
            d = submesh[0] * submesh[1]
            total = self.least_act_bytes(start, end - 1, submesh) if end - 1 > start else 0.0
            total += sum(self._least_act(ph, d) for ph in self._first_holds(start, end - 1))
            if not self.remat(end - 1, end):
                total += sum(self._least_act(n, d) for n in self.layers[end - 1].nodes)
            self._fit[key] = total
        return self._fit[key]

    def _first_holds(self, start: int, j: int) -> list[str]:
        """The placeholders of layer ``j`` that no layer of ``[start, j)`` holds (graph order): a
        range's sums over its placeholders add each once, layer by layer."""
        return [ph for ph, before in self._held_before[j] if before < start]

    def _least_act(self, name: str, devices: int) -> float:
        key = ("act", name, devices)  # a node is in O(L^2) ranges: its bound is computed once
        if key not in self._least:
            self._least[key] = least_activation_bytes(self.cg, self.cg.node(name), devices)
        return self._least[key]

    def _may_fit(self, start: int, end: int, submesh: tuple[int, int], in_flight: int = 1) -> bool:
        """Whether an option of the range can fit ``in_flight`` microbatches by the bounds above
        (every option the ILPs give for ``s`` in flight meets ``weight + s act <= memory_bytes``:
        ``_options``)."""
        key = (start, end, submesh, in_flight)
        if key not in self._fit:
            least = self.least_weight_bytes(*key[:3]) + in_flight * self.least_act_bytes(*key[:3])
            self._fit[key] = least <= self.memory_bytes * (1 + 1e-9)
        return self._fit[key]

    def sends(self, start: int, end: int) -> list[str]:
        """Values produced by layers ``[start, end)`` that later stages consume."""
        return [n for n, j in self.crossing[end] if j >= start]

    def __call__(self, start: int, end: int, submesh: tuple[int, int]) -> list[StageOption]:
        key = (start, end, submesh)
        if key not in self._memo:  # no ILP for a range whose weights and activations cannot fit
            self._memo[key] = self._options(start, end, submesh) if self._may_fit(*key) else []
        return self._memo[key]

    def priced(self, start: int, end: int, submesh: tuple[int, int]) -> list[StageOption] | None:
        """The options of layers ``[start, end)`` on ``submesh`` if already priced, else None."""
        return self._memo.get((start, end, submesh))

    def prefetch(self, keys: Sequence[tuple[int, int, tuple[int, int]]], workers: int = 1,
                 progress: Callable[[str], None] | None = None) -> None:
        """Compute ``self(start, end, submesh)`` for every key of ``keys``, the stage ILPs in up to
        ``workers`` forked processes, one task per (submesh, logical shape) and number of
        microbatches in flight: each solves its shape's ILPs (``_shape_options``) for the keys at
        that scale, which no other shape's depend on, and sends back its answers. All keys start at
        one microbatch; a key goes on to twice as many in flight when its answers from every shape
        say so (``_next_scale``, as ``_options`` decides), in the next round of tasks. This process
        then computes the options from the answers. The ILPs of two tasks of a round never share a
        key (the logical shape is in it), so each is solved as a serial run solves it.
        ``progress(message)`` is called as the tasks start."""
        say = progress or (lambda message: None)
        pending = {key: 1 for key in dict.fromkeys(keys) if key not in self._memo and self._may_fit(*key)}
        if workers > 1 and "fork" in multiprocessing.get_all_start_methods():
            while pending:
                groups: dict[tuple, list] = {}
                for key, scale in pending.items():
                    groups.setdefault((key[2], scale), []).append(key)
                tasks = [(shape, scale, task) for (submesh, scale), task in
                         sorted(groups.items(), key=lambda g: len(g[1]), reverse=True) for shape in self.shapes(submesh)]
                if len(tasks) < 2:
                    break
                self._fork(tasks, workers, say)
                pending = {key: nxt for key, scale in pending.items()
                           if (nxt := self._next_scale(*key, scale, [o for shape in self.shapes(key[2])
                                                                      for o in self._shaped[(*key, shape, scale)]]))}
        for submesh in dict.fromkeys(key[2] for key in keys):
            task = [key for key in keys if key[2] == submesh and key not in self._memo]
            if task:
                say(f"stage costs on submesh {submesh[0]}x{submesh[1]} ({len(task)} layer ranges)")
            for key in task:
                self(*key)

    def _fork(self, tasks: list, workers: int, say: Callable[[str], None]) -> None:
        """Run ``tasks`` (``_prefetch_task``) in up to ``workers`` forked processes and take in what
        they add: the options per (key, shape, scale), chains, ILP answers, stats, limits, refusals."""
        global _PREFETCHING
        _PREFETCHING = self  # what the forked workers inherit
        try:
            with ProcessPoolExecutor(min(workers, len(tasks)), mp_context=multiprocessing.get_context("fork")) as pool:
                scales = sorted({scale for _, scale, _ in tasks})
                say(f"stage costs on submeshes {', '.join(dict.fromkeys(f'{k[2][0]}x{k[2][1]}' for *_, t in tasks for k in t))} "
                    f"({len(tasks)} logical meshes, {'/'.join(map(str, scales))} microbatches in flight) "
                    f"in {min(workers, len(tasks))} processes")
                for shaped, chains, answers, stats, disk, limits, refusals in pool.map(_prefetch_task, tasks):
                    self._shaped |= shaped
                    self._chains |= chains
                    for key, entries in answers.items():
                        self._cache.setdefault(key, []).extend(entries)
                    self.limits += limits
                    self.refusals |= refusals
                    for key, answer in disk.items():
                        self._disk.put(key, answer)
                    for k, v in stats.items():
                        self.stats[k] += v
        finally:
            _PREFETCHING = None

    def _options(self, start, end, submesh) -> list[StageOption]:
        transfer = self.transfer_seconds(start, submesh)
        options: list[StageOption] = []
        scale = 1  # (its ``_may_fit``: ``__call__`` checked)
        while scale:
            found = []
            for shape in self.shapes(submesh):
                shaped = self._shaped.pop((start, end, submesh, shape, scale), None)  # a worker's (``prefetch``)
                found += self._shape_options(start, end, submesh, shape, scale) if shaped is None else shaped
            options += [o for o in found if o not in options]
            scale = self._next_scale(start, end, submesh, scale, found)
        kept = [o for o in options if not any(_dominates(p, o) for p in options if p is not o)]
        return [replace(o, seconds=o.seconds + transfer) for o in kept]

    def _next_scale(self, start, end, submesh, scale, found) -> int | None:
        """After the options ``found`` at ``scale`` microbatches in flight: ``2 * scale`` when the
        fastest of them does not hold the stage's ``in_flight_need`` and twice as many may fit,
        else None (the options stop)."""
        best = min(found, key=lambda o: o.seconds + o.once_seconds, default=None)
        need = self.in_flight_need(start, end, submesh)
        if best is not None and best.fits(need, self.memory_bytes) or scale >= need \
                or not self._may_fit(start, end, submesh, 2 * scale):
            return None
        return 2 * scale

    def _shape_options(self, start, end, submesh, shape, scale) -> list[StageOption]:
        """The options of layers ``[start, end)`` on logical ``shape`` of ``submesh`` for ``scale``
        microbatches in flight (``mode``): the chain, and the one ILP over the range where the
        chain's memory split failed. For the whole model, the one ILP (the intra-op pass's: the
        search holds the plan without pipelining), and the chain only where it has no answer: on
        the whole model the chain never priced a step below it (22 cases: GPT-3 2.6B / 2x4 A100,
        MoE 1.3B and Wide-ResNet 1B / 1x4 V100, B = 1 .. 32, each logical shape: 1.001x to 1.057x
        its step) and cost two thirds of the whole model's pricing (GPT-3 39B / 8x8, B = 1),
        while no other stage range on the whole mesh reuses its layers' ILPs."""
        names = self.subset(start, end)
        if self.mode == "exact" or (start, end) == (0, len(self.layers)):
            opt = self._solve_cached(self._signature(names), names, shape, scale, start, end, submesh)
            if opt is None and self.mode != "exact":
                opt = self._chained(start, end, shape, scale, submesh)[0]
            tried = [opt]
        else:
            opt, layers_fit = self._chained(start, end, shape, scale, submesh)
            tried = [opt]
            if opt is None and layers_fit:
                tried.append(self._solve_cached(self._signature(names), names, shape, scale, start, end, submesh))
        return [opt for opt in tried if opt is not None]

    def in_flight_need(self, start: int, end: int, submesh: tuple[int, int]) -> int:
        """The most microbatches a stage of layers ``[start, end)`` on ``submesh`` holds in any
        pipeline of ``L`` layers on ``D`` devices under any of ``schedules``, at most
        ``max_in_flight`` (``core/schedules.py``): GPipe ``B``; 1F1B ``min(s, B)`` with ``s`` its
        place from the end, at most ``min(L - end, D - |q| - [start > 0]) + 1`` (a layer and a
        device per stage after it, a device for those before); ZB-H1 ``min(S, B)`` with the
        stage count ``S`` at most ``min(start + L - end, D - |q|) + 1`` (a stage per layer and per
        device); interleaved up to ``B`` where the pair can be a stage of one (``p = D / |q| >= 2``
        device groups: ``2 |q| <= D``), else 1 (the options start there)."""
        size, devices, L = submesh[0] * submesh[1], self.cluster.num_devices, len(self.layers)
        need = {"gpipe": self.max_in_flight,
                "1f1b": min(L - end, devices - size - (start > 0)) + 1,
                "zb-h1": min(start + L - end, devices - size) + 1,
                "interleaved": self.max_in_flight if 2 * size <= devices else 1}
        return min(self.max_in_flight, max(need[s] for s in self.schedules))

    def _signature(self, names: list[str]) -> tuple:
        index = {n: i for i, n in enumerate(names)}
        forced = self.options.param_specs
        out = []
        for i, name in enumerate(names):
            node = self.cg.node(name)
            refs = tuple(index[a.name] - i if a.name in index else "ext" for a in node.all_input_nodes)
            out.append((self._node_sig[name], refs, forced.get(self.cg.param_fqns.get(name))))
        return tuple(out)

    def table(self, shape: tuple[int, int], start: int = 0, end: int | None = None) -> dict:
        """``build_strategies`` on logical mesh ``shape`` of the nodes of layers ``[start, end)``
        (default all), with the ZeRO-1/2 strategies (``zero.add_zero_strategies``) of the
        parameters one layer consumes, built once per layer, and of those several layers consume
        (a tied weight) when they all lie in ``[start, end)``: one ILP over the range may pick
        them, as the SPMD pass does (a chain of per-layer ILPs may not: each layer would pick its
        own). Without the latter, the whole model on the whole mesh with B = 1 was priced above
        the SPMD plan (gpt-tiny / 2x2 cpu-gloo: 7.884 ms against 7.766 ms, the tied embedding
        not ZeRO-2)."""
        if self._context is None:  # batch dims of every node, on a trivial mesh
            self._context = build_strategies(self.cg, LogicalMesh((1, 1), cluster=self.cluster))
        end = len(self.layers) if end is None else end
        out: dict = {}
        for j in range(start, end):
            key = (shape, j)
            if key not in self._tables:
                names = set(self.subset(j, j + 1))
                mesh = self.cluster.logical_mesh(shape)
                self._tables[key] = build_strategies(self.cg, mesh, nodes=names, context=self._context)
                add_zero_strategies(self.cg, self._tables[key], mesh, self.options.bucket_bytes, self._zero_params)
            out |= self._tables[key]
        for ph, (first, last) in self._shared.items():
            if start <= first and last <= end:
                key = (shape, ph)
                if key not in self._tables:
                    self._tables[key] = {ph: replace(out[ph], strategies=list(out[ph].strategies))}
                    add_zero_strategies(self.cg, self._tables[key], self.cluster.logical_mesh(shape),
                                        self.options.bucket_bytes, [ph])
                out |= self._tables[key]
        return out

    def _chained(self, start, end, shape, scale, submesh) -> tuple[StageOption | None, bool]:
        """Layers ``[start, end)`` as a chain of per-layer ILPs, each given the specs its operands
        from earlier layers of the stage were produced in (their resharding is in its objective).
        Each layer may use the whole memory budget; when the sum does not fit, every layer gets
        ``M / 2^j`` for ``j = 1 .. ceil(log2 n)`` until it does, then (``split_budgets``) its own
        least memory and an equal share of the rest. Returns the option (None: no split fits) and
        whether every layer fits the whole budget on its own."""
        n = end - start
        first = None
        for j in range(math.ceil(math.log2(n)) + 1 if n > 1 else 1):
            best = self._chain_option(start, end, shape, scale, self.memory_bytes / 2 ** j, submesh)
            first = best if j == 0 else first
            if best is not None and best.fits(scale, self.memory_bytes):
                return best, True
        if first is not None and n > 1:
            best = self._chain_option(start, end, shape, scale, self.split_budgets(start, end, submesh, scale), submesh)
            if best is not None and best.fits(scale, self.memory_bytes):
                return best, True
        return None, first is not None

    def split_budgets(self, start: int, end: int, submesh: tuple[int, int], scale: int) -> tuple[float, ...]:
        """Per-layer memory rows for a chain of layers ``[start, end)`` whose equal splits did
        not fit: layer ``j`` gets its least memory ``w_j + scale a_j`` (``least_weight_bytes``,
        ``least_act_bytes``) and ``1 / n`` of what the stage's memory leaves above their sum, so
        a layer with large weights is not held to the share of one with small ones. The layers
        may miss these rows (the least is a bound, not an ILP's optimum); then the stage is one
        ILP."""
        least = [self.least_weight_bytes(j, j + 1, submesh) + scale * self.least_act_bytes(j, j + 1, submesh)
                 for j in range(start, end)]
        slack = max(0.0, self.memory_bytes - sum(least)) / len(least)
        return tuple(m + slack for m in least)

    def _chain_option(self, start, end, shape, scale, budget, submesh) -> StageOption | None:
        """The chain of layers ``[start, end)`` under per-layer memory rows ``budget``: one figure
        for every layer (a chain from ``start`` shared by every ``end``) or one per layer."""
        key = (start, shape, scale, budget)
        chain = self._chains.setdefault(key, {"parts": [], "fixed": {}, "dead": False})
        while len(chain["parts"]) < end - start and not chain["dead"]:
            j = start + len(chain["parts"])
            names = self.subset(j, j + 1)
            part = self._layer_part(j, names, shape, scale, layer_budget(budget, j - start), chain["fixed"], submesh)
            if part is None:
                chain["dead"] = True
                break
            chain["parts"].append(part)
            chain["fixed"].update({n: s for n, s in zip(names, part[4]) if s is not None})
        if len(chain["parts"]) < end - start:
            return None
        parts = chain["parts"][:end - start]
        mesh = self.cluster.logical_mesh(shape)
        gather = sum(send_gather_seconds(self.cg, n, chain["fixed"][n][0], mesh)
                     for n in self.sends(start, end))
        return StageOption(sum(p[0] for p in parts) + gather, sum(p[2] for p in parts), sum(p[3] for p in parts),
                           sum(p[1] for p in parts), payload=(shape, scale, budget),
                           remat_bytes=max(p[5] for p in parts), remat=tuple(i for i, p in enumerate(parts) if p[6]))

    def _layer_part(self, layer, names, shape, scale, budget, fixed, submesh=None) -> tuple | None:
        """``(seconds, once, weight, act, out specs by position, recompute peak, recomputed)`` of one
        layer given ``fixed`` (``submesh``: the one being priced, named by ``limits``)."""
        ext = [a.name for n in names for a in self.cg.node(n).all_input_nodes if a.name not in names]
        given = {n: fixed[n] for n in dict.fromkeys(ext + names) if n in fixed}
        key = (self._signature(names), tuple(given.get(n) for n in dict.fromkeys(ext + names)), shape)

        def part():
            self._check_memory(names, shape, layer, layer + 1, scale, budget, given)
            sol = solve_stage(self.cg, names, self.cluster.logical_mesh(shape), budget, scale,
                              self.table(shape, layer, layer + 1), self.options, fixed=given,
                              sync_weight=self.sync_weight, remat=self.remat(layer, layer + 1),
                              remat_forced=self.options.remat == "all")
            return (sol.seconds, sol.once_seconds, sol.weight_bytes, sol.act_bytes,
                    [sol.nodes[n].out_specs if n in sol.nodes else None for n in names], sol.remat_peak,
                    bool(sol.remat)), sol.ilp_memory, solver_limits("", sol)

        return self._solve(key, scale, budget, part, (layer, layer + 1, submesh, shape))

    def _solve_cached(self, sig, names, shape, scale, start, end, submesh=None) -> StageOption | None:
        sends = self.sends(start, end)

        def option():
            self._check_memory(names, shape, start, end, scale, self.memory_bytes)
            mesh = self.cluster.logical_mesh(shape)
            sol = solve_stage(self.cg, names, mesh, self.memory_bytes, scale, self.table(shape, start, end),
                              self.options, sync_weight=self.sync_weight, sends=sends, remat=self.remat(start, end),
                              remat_forced=self.options.remat == "all")
            again = tuple(j - start for j in range(start, end) if self.layers[j].nodes in sol.remat)
            return (StageOption(sol.seconds, sol.weight_bytes, sol.act_bytes, sol.once_seconds,
                                payload=(shape, scale), remat_bytes=sol.remat_peak, remat=again), sol.ilp_memory,
                    solver_limits("", sol))

        return self._solve((sig, tuple(names.index(n) for n in sends), shape), scale, self.memory_bytes, option,
                           (start, end, submesh, shape))

    def _check_memory(self, names, shape, start, end, scale, budget, fixed=()) -> None:
        """Raise ``_Infeasible`` (no ILP built) when the stage ILP of ``names`` (layers ``[start,
        end)``) on logical mesh ``shape`` cannot meet its memory row ``w + scale a <= budget``: the
        least ``memory`` of each node's strategies (as ``cost_graph`` counts it: kept for backward,
        activations ``scale`` times) summed is at most the row's least (``CostGraph.min_memory``,
        whose variables sum several nodes' rows), leaving out what an ILP may count otherwise:
        ``fixed`` placeholders (placed by an earlier layer) and the nodes of layers it may
        recompute. Forced specs only remove strategies, so they raise the least."""
        table = self.table(shape, start, end)
        skip = set(fixed) | {n for layer in self.remat(start, end) for n in layer}
        total = 0.0
        for n in names:
            if n in table and n not in skip:
                least = min(st.memory for st in table[n].strategies) * kept_for_backward(self.cg.node(n))
                total += least if n in self.cg.param_fqns or n in self.cg.buffer_fqns else scale * least
        if total > budget * (1 + 1e-9):  # margin: the ILP's own sum may round otherwise
            self.stats["memory_skips"] += 1
            raise _Infeasible(f"no plan fits {budget:.0f} bytes: the least is {total:.0f}")

    def _solve(self, key, scale, budget, solve, where=None):
        """``solve()`` for the ILP ``key`` whose memory constraint is ``w + scale a <= budget``, or
        an earlier answer that is provably the same: an ILP solved under a looser constraint
        (``scale' <= scale``, ``budget' >= budget``) whose optimum satisfies this one is optimal
        here too (same objective, smaller feasible set); one that was infeasible stays so.

        ``solve()`` returns ``(result, (w, a), limits)``, ``limits`` the ILP's ``ilp.solver_limits``;
        an answer solved (or read from the cache) with a limit reached is added to ``self.limits``
        as layers ``[start, end)`` on ``submesh`` (logical ``shape``), ``where = (start, end,
        submesh, shape)``."""
        entries = self._cache.setdefault(key, [])
        for s, m, result, (w, a) in entries:
            if s <= scale and m >= budget and (result is None or w + scale * a <= budget):
                self.stats["cache_hits"] += 1
                return result
        answer = self._disk and self._disk.get((key, scale, budget))  # the same ILP, solved by an earlier run
        if answer:
            self.stats["disk_hits"] += 1
        else:
            t0 = time.perf_counter()
            try:
                answer = solve()
            except _Infeasible as e:  # a stop before any feasible answer is listed as a limit reached
                answer = None, (0.0, 0.0), [{"ilp": "", "limit": e.limit, "gap": None}] if e.limit else []
                if e.refused:
                    self.refusals.setdefault(str(e))
            self.stats["ilp_solves"] += 1
            self.stats["ilp_s"] += time.perf_counter() - t0
            if self._disk is not None:
                self._disk.put((key, scale, budget), answer)
        result, terms, limits = answer
        if limits and where is not None:
            start, end, submesh, shape = where
            span = f"layer {start}" if end == start + 1 else f"layers {start}-{end - 1}"
            sub = "" if submesh is None else f" on submesh {submesh[0]}x{submesh[1]}"
            self.limits += [{"ilp": f"stage pricing B={self.num_microbatches}: {span}{sub} (logical "
                                    f"{shape[0]}x{shape[1]}, activations x{scale})",
                             "layers": [start, end - 1], "submesh": None if submesh is None else list(submesh),
                             "logical_mesh": list(shape), "microbatches": self.num_microbatches,
                             "activation_scale": scale} | {k: v for k, v in e.items() if k != "ilp"}
                            for e in limits]
        entries.append((scale, budget, result, terms))
        return result


def layer_budget(budget: float | tuple[float, ...], i: int) -> float:
    """The memory row of a chain's ``i``-th layer: ``budget`` itself, or its ``i``-th entry."""
    return budget[i] if isinstance(budget, tuple) else budget


_PREFETCHING: GraphStageCosts | None = None


def _prefetch_task(task):
    """A worker of ``GraphStageCosts.prefetch``: the options of ``task = (shape, scale, keys)`` on
    that logical shape at ``scale`` microbatches in flight, with the chains, ILP answers, stats,
    limits and refusals they added."""
    shape, scale, keys = task
    costs = _PREFETCHING
    stats, limits, refusals = dict(costs.stats), len(costs.limits), set(costs.refusals)
    known = {key: len(entries) for key, entries in costs._cache.items()}
    shaped = {(*key, shape, scale): costs._shape_options(*key, shape, scale) for key in keys}
    answers = {key: entries[known.get(key, 0):] for key, entries in costs._cache.items()
               if len(entries) > known.get(key, 0)}
    chains = {key: chain for key, chain in costs._chains.items() if key[1] == shape and key[2] == scale}
    return (shaped, chains, answers, {k: v - stats[k] for k, v in costs.stats.items()},
            costs._disk.new if costs._disk else {}, costs.limits[limits:],
            {r: None for r in costs.refusals if r not in refusals})


def least_activation_bytes(cg, node: torch.fx.Node, devices: int) -> float:
    """A lower bound, bytes per device, on the ``memory`` a stage counts for ``node``'s result over
    ``devices`` (``cost_graph``: a strategy's ``memory`` if ``kept_for_backward``): an input's or an
    op's local result is at least ``1 / devices`` of it (the replicated fallback keeps all of it);
    a ``FOLLOWER_TARGETS`` op's strategy, a ``getitem``, a parameter and a buffer count nothing here
    (weights: ``GraphStageCosts.least_weight_bytes``)."""
    val = node.meta.get("val")
    if node.name in cg.param_fqns or node.name in cg.buffer_fqns or not kept_for_backward(node):
        return 0.0
    if node.op == "placeholder":
        return nbytes_of(val) / devices
    if node.op != "call_function" or node.target is operator.getitem or not tensor_values(val):
        return 0.0
    sig = signature(node)
    if sig is None:
        return float(nbytes_of(val))
    if node.target in FOLLOWER_TARGETS:
        return 0.0
    tensors = [n.meta["val"] for n in node.all_input_nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    tensors += tensor_values(val)  # enumerate_strategies pairs them with the label lists: results after inputs
    results = tensors[len(sig.inputs):len(sig.inputs) + len(sig.outputs)]
    return min(float(nbytes_of(val)), sum(map(nbytes_of, results)) / devices)


def least_compute_seconds(cg, node: torch.fx.Node, mesh: LogicalMesh) -> float:
    """``d`` times a lower bound on the ``compute`` (seconds, forward + backward) of every strategy
    of ``node`` on ``mesh`` of ``d`` devices, from the roofline of ``strategies``: an op's strategy
    computes ``F / shards`` FLOPs and moves its operands' and results' local bytes, each at least
    ``1 / d`` of the whole (``F``: ``ops.flops`` with the op's signature); the replicated fallback
    runs all of its FLOPs (``ops.flops`` without a signature) and moves whole tensors on each device; a
    parameter's AdamW update (any storage or ZeRO stage) reads and writes at least ``1 / d`` of
    ``ADAM_UPDATE_BYTES_FACTOR`` x its bytes; a ``getitem``, an input or a buffer computes nothing.
    Recomputing a layer only adds compute."""
    if node.op == "placeholder":
        val = node.meta.get("val")
        return mesh.compute_cost(0.0, ADAM_UPDATE_BYTES_FACTOR * nbytes_of(val)) if node.name in cg.param_fqns else 0.0
    replicated, split = op_rooflines(node, mesh)
    return (1 + BACKWARD_FLOPS_FACTOR) * min(mesh.num_devices * replicated, split)


def op_rooflines(node: torch.fx.Node, mesh: LogicalMesh) -> tuple[float, float]:
    """The two forward rooflines, seconds, whose least ``least_compute_seconds`` takes for an op:
    replicated (all its FLOPs, whole tensors) on one device, and split over every device (``F``
    and the bytes of the signature's tensors, ``d`` times ``1 / d`` of each); inf without a
    signature, ``(0, 0)`` for what computes nothing. Neither depends on the mesh's shape or size
    (the rates are the cluster's), so a stage search computes them once per node."""
    val = node.meta.get("val")
    if node.op != "call_function" or node.target is operator.getitem or not tensor_values(val):
        return 0.0, 0.0
    ins = [n.meta["val"] for n in node.all_input_nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    kernel = kernel_class(node)
    replicated = mesh.compute_cost(flops(node, None), sum(map(nbytes_of, ins)) + nbytes_of(val), kernel)
    sig = signature(node)
    if sig is None:
        return replicated, math.inf
    tensors = (ins + tensor_values(val))[:len(sig.inputs) + len(sig.outputs)]  # paired as enumerate_strategies does
    return replicated, mesh.compute_cost(flops(node, sig), sum(map(nbytes_of, tensors)), kernel)


def _dominates(a: StageOption, b: StageOption) -> bool:
    """``a`` is at least as good as ``b`` in every figure and better in one."""
    fa = (a.seconds, a.once_seconds, a.weight_bytes, a.act_bytes, a.remat_bytes)
    fb = (b.seconds, b.once_seconds, b.weight_bytes, b.act_bytes, b.remat_bytes)
    return all(x <= y for x, y in zip(fa, fb)) and fa != fb


class _Infeasible(Exception):
    """No answer: nothing fits, (``limit``: ``"nodes"`` / ``"time"``) the solver stopped at a
    limit before it found a feasible assignment, or (``refused``) the plan's options leave a node
    of the range no strategy (a forced spec or ZeRO stage it cannot take there)."""

    def __init__(self, message: str, limit: str | None = None, refused: bool = False):
        super().__init__(message)
        self.limit, self.refused = limit, refused


def _node_signature(node, cg) -> tuple:
    """What makes two nodes interchangeable in an ILP: role, op, shape, dtype, whether autograd
    tracks it, and every non-tensor argument by its schema name with the schema's defaults
    (``core.aten.op_args``), so an argument given by keyword (sdpa's ``scale=``, ``is_causal=``)
    or left at its default counts as the same argument written positionally."""
    val = node.meta.get("val")
    dtype = str(getattr(val, "dtype", type(val).__name__))
    kind = ("param" if node.name in cg.param_fqns else "buffer" if node.name in cg.buffer_fqns
            else "input" if node.name in cg.input_names else node.op)
    bound = op_args(node) if isinstance(node.target, torch._ops.OpOverload) else dict(enumerate(node.args))
    args = tuple((k, _arg_key(a)) for k, a in bound.items())
    target = "placeholder" if node.op == "placeholder" else str(node.target)
    return (kind, target, shape_of(node), dtype, args, node.name in cg.requires_grad)


def _arg_key(a):
    """A hashable stand-in of an argument: a graph operand is ``"n"`` (its producer has its own
    signature), scalars, dtypes and devices are themselves, sequences element by element."""
    if isinstance(a, torch.fx.Node):
        return "n"
    if isinstance(a, (list, tuple)):
        return tuple(_arg_key(x) for x in a)
    if isinstance(a, (int, float, bool, str, type(None))):
        return a
    return str(a)  # torch.dtype, torch.device, torch.layout, torch.memory_format


def send_gather_seconds(cg, name: str, spec, mesh) -> float:
    """A stage sends ``name`` on replicated: all-gathering it from ``spec`` on the stage's mesh,
    forward (its gradient comes back whole: the backward is a slice)."""
    val = cg.node(name).meta["val"]
    return reshard_costs(mesh)(spec, ShardingSpec.replicated(len(shape_of(cg.node(name)))),
                               () if name in cg.requires_grad else None, tuple(val.shape), val.element_size())


@dataclass
class StageSolution:
    """The intra-op solution of one stage: its node strategies and cost figures (seconds per
    microbatch, bytes per device). ``nodes``: as chosen, every gradient sync still on its edge
    (``training_step.training_step`` defers them once the whole stage is known). ``ilp_memory``: the
    two parts of the ILP's memory constraint at the optimum, ``(w, a)`` with
    ``w + act_scale a <= memory_bytes`` (``w`` includes weights an earlier layer placed, which
    ``weight_bytes`` leaves out, and ``remat_peak``). ``act_bytes``: kept per microbatch (of
    recomputed layers, only the values they do not read alone); ``remat_peak``: the largest
    recomputed layer's activations, live once (one layer is recomputed at a time); ``remat``: the
    layers recomputed (node names). ``status`` / ``gap``: ``ilp.Solution``'s (``"Optimal"``, None:
    proven optimal). ``update_seconds``: the optimizer update's part of ``compute_seconds``
    (``Plan.update_seconds``)."""

    seconds: float
    once_seconds: float
    weight_bytes: float
    act_bytes: float
    nodes: dict
    compute_seconds: float
    ilp_memory: tuple[float, float]
    gap: float | None = None
    remat_peak: float = 0.0
    remat: list[tuple[str, ...]] = field(default_factory=list)
    status: str = "Optimal"
    update_seconds: float = 0.0


def solve_stage(cg, names: list[str], mesh, memory_bytes: float, act_scale: int = 1, table=None,
                options: PlanOptions | None = None,
                fixed: dict[str, tuple[ShardingSpec, ...]] | None = None, sync_weight: float = 1.0,
                sends: Sequence[str] = (), remat: Sequence[tuple[str, ...]] = (),
                remat_forced: bool = True) -> StageSolution:
    """Solve the intra-op ILP (section 4) of the subgraph ``names`` on ``mesh``.

    The memory constraint counts activations ``act_scale`` times (microbatches in flight).
    Values produced outside ``names`` arrive free in the ILP, unless ``fixed`` gives the specs
    they were produced in (earlier layers of a chained stage): then their resharding into each
    consumer's spec is charged, and a placeholder in ``fixed`` (a weight an earlier layer already
    placed, e.g. a tied embedding) keeps that spec and its memory is not counted again. At run
    time a value from another stage crosses replicated (``boundary_spec``). ``table``:
    ``build_strategies(cg, mesh)`` of the whole graph, reused. A data-parallel gradient
    all-reduce runs once per step, after the last of ``B`` microbatches: the objective, which is
    per microbatch, weighs it ``sync_weight = 1 / B``, and so each parameter's optimizer update,
    the all-gather of a ZeRO-1/2 parameter after the update, the latency of its buckets and what the last microbatch's
    backward hides of the buckets (their ``ilp.Pool`` weight; the ZeRO-3 reduce-scatters hidden
    behind every microbatch's backward weigh 1, as ``step_parts`` splits them). The returned ``seconds`` and
    ``once_seconds`` are not the objective's: they price the stage as its plan lists it
    (``training_step``; ``core.plan.step_parts``: per microbatch, and the update and buckets once per step,
    less what backward hides), so a stage and an SPMD plan are priced alike. ``sends``: values
    later stages consume; the all-gather that sends them on replicated (``send_gather_seconds``)
    is in the objective and in ``seconds``.
    ``remat``: layers the stage may recompute (``ilp.RematGroup``), all of them with
    ``remat_forced`` (``PlanOptions.remat="all"``, or the layers a plan chose), else the ILP
    chooses each (``"auto"``): a recomputed layer's activations count once, not per microbatch
    (one layer is recomputed at a time), and its recomputed forward is in the objective; a kept
    one's count ``act_scale`` times. ``StageSolution.remat``: the layers recomputed.

    Raises:
        _Infeasible: nothing fits ``memory_bytes``, or a forced spec leaves no strategy.
    """
    options = options or PlanOptions()
    subset = set(names)
    fixed = fixed or {}
    full = table if table is not None else build_strategies(cg, mesh)
    table = {n: replace(full[n], strategies=list(full[n].strategies)) for n in names if n in full}
    try:
        apply_constraints(cg, table, mesh, options)
        for n in names:
            if n in fixed and n in table:
                restrict(table[n], lambda s, spec=fixed[n][0]: s.out_spec == spec)
    except ValueError as e:
        raise _Infeasible(str(e), refused=True) from None
    graph, where = build_cost_graph(cg, table, mesh, share_layers=options.share_layers, nodes=subset,
                                    remat=list(remat), remat_forced=remat_forced, options=options)
    reshard = reshard_costs(mesh, options)
    casts = cg.param_casts
    for n in names:  # operands produced in a known spec by an earlier layer: charge their resharding
        if n not in where:
            continue
        ns = table[n]
        for i, (src, r) in enumerate(zip(ns.inputs, ns.input_results)):
            if src in subset or src not in fixed:
                continue
            val = cg.node(src).meta["val"]
            val = val[r] if isinstance(val, (tuple, list)) else val
            have = fixed[src][r]
            for p, q in enumerate(where[n].index):
                s = ns.strategies[q]
                graph.costs[where[n].var][p] += reshard(have, s.in_specs[i], s.grad_partial[i], tuple(val.shape),
                                                        val.element_size(), src in cg.param_fqns or src in casts)
    for n in sends:
        for p, q in enumerate(where[n].index):
            graph.costs[where[n].var][p] += send_gather_seconds(cg, n, table[n].strategies[q].out_specs[0], mesh)
    if sync_weight != 1.0:
        _discount_gradient_sync(cg, table, where, graph, names, reshard, sync_weight)
        _discount_updates(cg, table, where, graph, names, sync_weight)
        for key, pool in graph.pools.items():  # buckets run, and hide behind the last microbatch's backward, once per step
            if key[0] == "bucket":
                pool.weight, pool.latency = sync_weight, pool.latency * sync_weight
    weight_vars = {where[p].var for p in names if p in cg.param_fqns or p in cg.buffer_fqns}
    unscaled = graph.memory
    if act_scale != 1:
        graph.memory = [m if v in weight_vars else [x * act_scale for x in m] for v, m in enumerate(graph.memory)]
        for g in graph.remat:
            g.keep_scale = act_scale
    try:
        sol = solve(graph, memory_bytes, time_limit=options.time_limit, solver=options.solver,
                    switches=tuple(options.restrictions()), node_limit=options.node_limit)
    except MemoryBudgetError as e:
        raise _Infeasible(str(e)) from None
    except SolverError as e:  # ZeRO-1/2 over a parameter use that takes its gradient complete: refused, named
        blockers = [] if e.limit else zero_stage_blockers(cg, table, mesh, options)
        if blockers:  # (it read "no pipeline fits 4.00 GiB per device": an nn.EmbeddingBag, no rule, in a stage)
            raise _Infeasible(f"zero_stage={options.zero_stage}: {'; '.join(blockers)} (use zero_stage=3 or leave "
                              "zero_stage out)", refused=True) from None
        raise _Infeasible(str(e), e.limit) from None
    chosen = {n: table[n].strategies[w.index[sol.choice[w.var]]] for n, w in where.items()}
    nodes = {n: node_plan(s, table[n]) for n, s in chosen.items()}
    weights = sum(s.memory for n, s in chosen.items() if (n in cg.param_fqns or n in cg.buffer_fqns) and n not in fixed)
    recomputed = [g.at(g.act, sol.choice) for g, r in zip(graph.remat, sol.remat) if r]
    kept_groups = sum(g.at(g.act, sol.choice) for g, r in zip(graph.remat, sol.remat) if not r)
    remat = [layer for layer, r in zip(remat, sol.remat) if r]
    peak = max(recomputed, default=0.0)
    acts = sum(s.memory for n, s in chosen.items() if not (n in cg.param_fqns or n in cg.buffer_fqns)
               and kept_for_backward(cg.node(n))) - sum(recomputed)
    # boundary values: replicated NodePlans so the collectives of the stage can be listed
    for n in list(nodes):
        for src in nodes[n].inputs:
            if src not in nodes:
                nodes[src] = boundary_node_plan(cg, src, fixed.get(src))
    _, _, collectives = training_step(stage_view(cg, subset), nodes, mesh, options.bucket_bytes,
                                            options.gradient_reduce_dtype, remat)
    again = {n for layer in remat for n in layer}
    compute = sum(s.compute * (1 + (n in again) / (1 + BACKWARD_FLOPS_FACTOR)) for n, s in chosen.items())
    update = sum(s.compute for n, s in chosen.items() if n in cg.param_fqns)
    # priced as the stage's plan lists it (core.plan.step_parts), not by the ILP's objective
    seconds, once = step_parts(collectives, compute, update)
    seconds += sum(send_gather_seconds(cg, n, nodes[n].out_specs[0], mesh) for n in sends)
    terms = [peak, kept_groups]  # the ILP's memory: weight variables, the others (unscaled)
    for v, m in enumerate(unscaled):
        terms[v not in weight_vars] += m[sol.choice[v]]
    return StageSolution(seconds, once, weights, acts, nodes, compute, tuple(terms), sol.gap, peak,
                         [tuple(layer) for layer in remat], sol.status, update)


def _discount_gradient_sync(cg, table, where, graph, names, reshard, weight: float) -> None:
    """Scale the gradient-sync part of every parameter edge of the cost graph (a parameter's read,
    or its low-precision cast's) by ``weight``."""
    for n in names:
        if n not in where or n not in table:
            continue
        ns = table[n]
        for i, src in enumerate(ns.inputs):
            if src not in where or src not in cg.param_fqns and src not in cg.param_casts:
                continue
            val = cg.node(src).meta["val"]
            sv, dv = where[src], where[n]
            outs = tuple(table[src].strategies[p].out_specs[0] for p in sv.index)
            ins = tuple((ns.strategies[q].in_specs[i], ns.strategies[q].grad_partial[i]) for q in dv.index)
            sync = reshard.sync_matrix(outs, ins, tuple(val.shape), val.element_size(),
                                       value_zeros(cg, table, where, src))
            if any(any(row) for row in sync):
                graph.add_edge(sv.var, dv.var, [[-(1 - weight) * c for c in row] for row in sync])


def _discount_updates(cg, table, where, graph, names, weight: float) -> None:
    """Scale the once-per-step parts of the parameters' strategies in the cost graph by
    ``weight``: each one's optimizer update (its ``compute``), a ZeRO-1/2 one's all-gather after
    the update (its ``comm``) and the buckets' latency (the graph's fixed charges)."""
    for n in names:
        if n in where and n in cg.param_fqns:
            for p, q in enumerate(where[n].index):
                s = table[n].strategies[q]
                graph.costs[where[n].var][p] -= (1 - weight) * (s.compute + (s.comm if s.zero_stage else 0.0))
    graph.fixed = {key: (f * weight, members) for key, (f, members) in graph.fixed.items()}


def boundary_spec(cg, name: str) -> ShardingSpec:
    """The spec a value crossing between stages travels in: replicated."""
    return ShardingSpec.replicated(len(shape_of(cg.node(name)) or ()))


def boundary_node_plan(cg, name: str, specs: tuple[ShardingSpec, ...] | None = None) -> NodePlan:
    """The ``NodePlan`` of a value a stage receives: in ``specs`` (default ``boundary_spec``)."""
    return NodePlan("boundary", (), tuple(specs) if specs else (boundary_spec(cg, name),))
