"""Plans: everything the runtime needs, and everything a user asks about a plan.

Two kinds, one validated serializable object each (JSON round trip, ``load_plan`` reads either):

- ``Plan``: an SPMD plan for one logical mesh (Alpa, OSDI'22, section 4): per-parameter storage
  specs by FQN, the strategy chosen for every node, the collectives a training step issues, the
  deferred gradient buckets, and the predicted step time (compute / communication) and memory
  per device;
- ``PipelinePlan``: a pipelined plan (section 5): stages, each a layer range on a submesh of the
  cluster with its own ``Plan``, the schedule and the microbatch count, and the predicted
  pipeline step time and bubble.

Specs are ``ShardingSpec`` objects in memory and strings (``"S0R"``) only in JSON.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .losses import LossReduction
from .mesh import LogicalMesh
from .resharding import grouped_steps, regathers
from .schedules import get_schedule
from .schedules import step_seconds as schedule_step_seconds
from .spec import ShardingSpec

PLAN_VERSION = 2  # 2: "kind" ("spmd" | "pipeline"); version 1 files still load


class PlanError(ValueError):
    """A plan file is corrupt or does not belong to the model / mesh it is used with."""


@dataclass(frozen=True)
class NodePlan:
    """The strategy chosen for one graph node.

    Attributes:
        strategy: the strategy's name (``"S0R = S0R x RR"``; ``"boundary"`` for a value a
            pipeline stage receives).
        in_specs / out_specs: the spec each operand is resharded to / each result is produced in.
        partial_axes: mesh axes along which the local result is a partial sum (all-reduced in the op
            along those ``out_specs`` do not keep partial).
        reduce: ``"sum"`` or ``"mean"``: how those partial results combine.
        grad_partial: per operand, the mesh axes its gradient is a partial sum along (None: the
            operand needs no gradient).
        inputs / input_results: per operand, the producing node and which of its results.
        zero_stage / zero_axes: a parameter's ZeRO-1/2 partitioning, the mesh axes its optimizer
            states (and gradients) are split over (0 and ``()``: none; ``Plan.zero_stages``
            names ZeRO-3 too).
    """

    strategy: str
    in_specs: tuple[ShardingSpec, ...]
    out_specs: tuple[ShardingSpec, ...]
    partial_axes: tuple[int, ...] = ()
    reduce: str = "sum"
    grad_partial: tuple[tuple[int, ...] | None, ...] = ()
    inputs: tuple[str, ...] = ()
    input_results: tuple[int, ...] = ()
    zero_stage: int = 0
    zero_axes: tuple[int, ...] = ()

    def to_dict(self) -> dict:
        d = {"strategy": self.strategy, "in_specs": [str(s) for s in self.in_specs],
             "out_specs": [str(s) for s in self.out_specs], "partial_axes": list(self.partial_axes),
             "reduce": self.reduce, "grad_partial": [None if g is None else list(g) for g in self.grad_partial],
             "inputs": list(self.inputs), "input_results": list(self.input_results)}
        return d | ({"zero_stage": self.zero_stage, "zero_axes": list(self.zero_axes)} if self.zero_stage else {})

    @classmethod
    def from_dict(cls, d: dict) -> "NodePlan":
        return cls(d["strategy"], tuple(map(ShardingSpec.parse, d["in_specs"])),
                   tuple(map(ShardingSpec.parse, d["out_specs"])), tuple(d["partial_axes"]), d["reduce"],
                   tuple(None if g is None else tuple(g) for g in d["grad_partial"]), tuple(d["inputs"]),
                   tuple(d["input_results"]), int(d.get("zero_stage", 0)), tuple(d.get("zero_axes", ())))


@dataclass(frozen=True)
class Collective:
    """One collective a training step issues.

    Attributes:
        kind: ``"all-reduce"``, ``"all-gather"``, ``"reduce-scatter"`` or ``"all-to-all"``.
        mesh_axes: the mesh axes whose devices take part (``(0, 1)``: the flattened mesh).
        nbytes: the per-device bytes of the cost formula (mesh.py).
        phase: ``"forward"``, ``"recompute"`` (a checkpointed layer's forward run again in
            backward, ``Plan.remat``), ``"backward"`` or ``"update"`` (after the optimizer step:
            the all-gather of ZeRO-1/2 parameters).
        node: the consuming node (resharding) or the node reducing its partial result.
        tensor: the tensor moved (producer node name).
        seconds: predicted time.
        deferred: the loss's all-reduce that the runtime (SPMD, or a pipeline's last stage, per
            microbatch) starts in forward and waits for only after backward (``training_step.deferred_loss_axes``; phase ``"forward"``):
            hidden behind backward (``hidden_seconds``).
    """

    kind: str
    mesh_axes: tuple[int, ...]
    nbytes: float
    phase: str
    node: str
    tensor: str
    seconds: float
    deferred: bool = False

    def to_dict(self) -> dict:
        return {"kind": self.kind, "mesh_axes": list(self.mesh_axes), "nbytes": self.nbytes, "phase": self.phase,
                "node": self.node, "tensor": self.tensor, "seconds": self.seconds, "deferred": self.deferred}


def _specs_to_json(specs: dict[str, ShardingSpec]) -> dict[str, str]:
    return {k: str(v) for k, v in sorted(specs.items())}


def _specs_from_json(d: dict[str, str]) -> dict[str, ShardingSpec]:
    return {k: ShardingSpec.parse(v) for k, v in d.items()}


@dataclass
class Plan:
    """An SPMD (intra-operator) sharding plan for one model on one logical mesh.

    Attributes:
        mesh: the logical mesh (shape and cost figures) planned for.
        param_specs: parameter FQN -> storage spec (``ShardingSpec``); tied names share one.
        input_specs: user-input placeholder name -> spec.
        nodes: node name -> ``NodePlan``.
        collectives: every collective of one training step, in execution order per phase.
        compute_seconds / comm_seconds: predicted step time split, seconds.
        memory_bytes: predicted peak memory per device, bytes.
        fingerprint: hash of the captured graph (``CapturedGraph.fingerprint``).
        options: the planning options (``PlanOptions.to_dict``, the budget resolved).
        stats: planning statistics (capture / strategy / ILP seconds, ILP size; not in JSON).
        grad_sync: parameter placeholder -> mesh axes whose gradient all-reduce is deferred to the
            end of backward and bucketed (data-parallel gradient synchronization, as DDP does).
        bucket_bytes: the largest gradient bucket, bytes.
        loss_reduction: how the loss reduces over the batch (``LossReduction``).
        zero_stages: parameter FQN -> ``(ZeRO stage, mesh axes)``, every trainable parameter
            (``(0, ())``: replicated over the data-parallel axes, or split for tensor parallelism).
        remat: the layers (node names, graph order) whose activations are recomputed in backward
            instead of kept (activation checkpointing, ``PlanOptions.remat``).
        captured: the ``CapturedGraph`` planned (in memory only: the runtime of the planning
            process executes it instead of capturing again; None after ``load_plan``).
        solver_limits: the ILPs of this plan whose solver stopped at its time limit, each
            ``{"ilp": which, "gap": relative gap to the solver's bound or None (unknown)}``; such a
            plan may come out otherwise on a rerun or another machine (empty: every ILP optimal).
        update_seconds: the optimizer step's part of ``compute_seconds`` (each parameter's AdamW
            update), seconds: it runs after backward and hides no gradient synchronization
            (``overlap_seconds``; 0 in plans written before it was recorded).
    """

    mesh: LogicalMesh
    param_specs: dict[str, ShardingSpec]
    input_specs: dict[str, ShardingSpec]
    nodes: dict[str, NodePlan]
    collectives: list[Collective]
    compute_seconds: float
    comm_seconds: float
    memory_bytes: float
    fingerprint: str
    options: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    grad_sync: dict[str, tuple[int, ...]] = field(default_factory=dict)
    bucket_bytes: float = 25 * 2**20
    loss_reduction: LossReduction = field(default_factory=lambda: LossReduction("mean", None))
    zero_stages: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    captured: object = field(default=None, compare=False, repr=False)
    remat: list[list[str]] = field(default_factory=list)
    solver_limits: list[dict] = field(default_factory=list)
    update_seconds: float = 0.0

    kind = "spmd"

    @property
    def step_seconds(self) -> float:
        """Predicted time of one training step, seconds: compute and communication, less the
        gradient synchronization hidden behind backward (``overlap_seconds``); also
        ``microbatch_seconds + once_seconds``."""
        return self.compute_seconds + self.comm_seconds - self.overlap_seconds

    @property
    def overlap_seconds(self) -> float:
        """Predicted gradient-synchronization time hidden behind backward compute, seconds.

        The runtime starts each gradient bucket's all-reduce (ZeRO-2: reduce-scatter) as soon as
        backward has produced its gradients, last layers first (``runtime/grad_sync.py``, as DDP:
        Li et al., VLDB 2020, section 3.2.3), and each ZeRO-3 group's gradient reduce-scatter
        once the group's last gradient has arrived (``collectives.GatherGroup``, as FSDP). Every
        one but the last to become ready (group 0, and the first bucket of each kind and mesh
        axes: their parameters used first, often the first layer's, complete only when backward
        ends) can run under the remaining backward compute, which is 2/3 of the step's compute
        but the optimizer update's (backward is 2x forward FLOPs). The loss's deferred all-reduce
        (``Collective.deferred``), started in forward and waited for after backward, runs under
        the whole backward too: hidden = min(their time - group 0's and those buckets', 2/3
        (compute - update)) (``hidden_seconds``).
        """
        return sum(hidden_seconds(self.collectives, self.compute_seconds - self.update_seconds))

    @property
    def once_seconds(self) -> float:
        """The part of ``step_seconds`` a pipeline stage pays once per step, seconds (``step_parts``)."""
        return step_parts(self.collectives, self.compute_seconds, self.update_seconds)[1]

    @property
    def microbatch_seconds(self) -> float:
        """The part of ``step_seconds`` a pipeline stage pays per microbatch, seconds (``step_parts``)."""
        return step_parts(self.collectives, self.compute_seconds, self.update_seconds)[0]

    def collective_counts(self) -> dict[tuple[str, str], int]:
        """``(kind, phase) -> count`` over one training step."""
        counts: dict[tuple[str, str], int] = {}
        for c in self.collectives:
            counts[(c.kind, c.phase)] = counts.get((c.kind, c.phase), 0) + 1
        return counts

    def placements(self, fqn: str) -> tuple:
        """DTensor placements of parameter ``fqn``'s storage on a 2D ``DeviceMesh`` of this plan's
        shape (``ShardingSpec.placements``): ``distribute_tensor(full, device_mesh, plan.placements(fqn))``
        holds on every rank the shard this plan's runtime holds.

        Raises:
            KeyError: ``fqn`` is not a parameter of the plan.
        """
        return self.param_specs[fqn].placements(len(self.mesh.shape))

    def to_dict(self, stats: bool = False) -> dict:
        d = {
            "version": PLAN_VERSION,
            "kind": self.kind,
            "fingerprint": self.fingerprint,
            "mesh": self.mesh.to_dict(),
            "options": self.options,
            "param_specs": _specs_to_json(self.param_specs),
            "input_specs": _specs_to_json(self.input_specs),
            "nodes": {k: v.to_dict() for k, v in self.nodes.items()},
            "collectives": [c.to_dict() for c in self.collectives],
            "step_seconds": self.step_seconds,  # derived (read back from the parts), as a pipeline plan's
            "compute_seconds": self.compute_seconds,
            "comm_seconds": self.comm_seconds,
            "memory_bytes": self.memory_bytes,
            "grad_sync": {k: list(v) for k, v in self.grad_sync.items()},
            "bucket_bytes": float(self.bucket_bytes),
            "loss_reduction": self.loss_reduction.to_dict(),
            "zero_stages": {k: {"stage": z, "axes": list(a)} for k, (z, a) in sorted(self.zero_stages.items())},
            "remat": self.remat,
            "update_seconds": self.update_seconds,
        }
        if self.solver_limits:
            d["solver_limits"] = self.solver_limits
        if stats:
            d["stats"] = self.stats
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        return cls(LogicalMesh.from_dict(d["mesh"]), _specs_from_json(d["param_specs"]),
                   _specs_from_json(d["input_specs"]), {k: NodePlan.from_dict(v) for k, v in d["nodes"].items()},
                   [Collective(**(c | {"mesh_axes": tuple(c["mesh_axes"])})) for c in d["collectives"]],
                   float(d["compute_seconds"]), float(d["comm_seconds"]), float(d["memory_bytes"]),
                   str(d["fingerprint"]), dict(d.get("options", {})), dict(d.get("stats", {})),
                   {k: tuple(v) for k, v in d["grad_sync"].items()}, float(d["bucket_bytes"]),
                   LossReduction.from_dict(d["loss_reduction"]) if "loss_reduction" in d else LossReduction("mean", None),
                   {k: (int(v["stage"]), tuple(v["axes"])) for k, v in d.get("zero_stages", {}).items()},
                   remat=[list(layer) for layer in d.get("remat", [])],
                   solver_limits=list(d.get("solver_limits", [])),
                   update_seconds=float(d.get("update_seconds", 0.0)))

    def to_json(self, path: str | Path | None = None) -> str:
        """The plan as JSON (byte-identical for the same inputs); written to ``path`` if given.
        Timing statistics are left out so the text depends only on the inputs."""
        return _write(self.to_dict(), path)

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "Plan":
        """Read an SPMD plan from JSON text or a file (``load_plan`` reads either kind).

        Raises:
            PlanError: unreadable or corrupt JSON, an unknown version, or a pipelined plan.
        """
        plan = load_plan(text_or_path)
        if not isinstance(plan, cls):
            raise PlanError("this is a pipelined plan (stages on submeshes): read it with alpa_lite.load_plan")
        return plan


@dataclass
class StagePlan:
    """One pipeline stage (Alpa, OSDI'22, section 5): a layer range on a submesh, with its own
    intra-op plan.

    Attributes:
        layers: ``(start, end)``: the stage computes layers ``start .. end - 1``.
        nodes: the graph nodes it computes, in topological order.
        submesh: ``(rows, cols)`` of its physical submesh; ranks: the devices (world ranks,
            row-major ``node * devices_per_node + column``) in logical-mesh order.
        plan: its intra-op ``Plan`` (its ``mesh`` is the stage's logical mesh). Values received
            from the previous stage appear in ``plan.nodes`` as ``"boundary"`` nodes, replicated.
        recv / send: names of the values received from the previous / sent to the next stage.
        seconds: forward + backward of one microbatch, including its input transfer and the
            all-gathers that send its outputs on replicated, seconds: ``plan.microbatch_seconds``
            plus those; once_seconds: paid once per step (gradient synchronization,
            ``plan.once_seconds``); transfer_seconds: the transfer part of ``seconds``.
        weight_bytes / act_bytes: per device: weights with gradients and optimizer state, and
            activations of one microbatch; in_flight: microbatches whose activations it holds;
            remat_bytes: the largest recomputed layer's activations (``plan.remat``), live once.
    """

    layers: tuple[int, int]
    nodes: list[str]
    submesh: tuple[int, int]
    ranks: list[int]
    plan: Plan
    recv: list[str]
    send: list[str]
    seconds: float
    once_seconds: float
    transfer_seconds: float
    weight_bytes: float
    act_bytes: float
    in_flight: int
    remat_bytes: float = 0.0

    @property
    def memory_bytes(self) -> float:
        """Predicted peak memory per device, bytes."""
        return self.weight_bytes + self.in_flight * self.act_bytes + self.remat_bytes

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("layers", "nodes", "submesh", "ranks", "recv", "send", "seconds",
                                            "once_seconds", "transfer_seconds", "weight_bytes", "act_bytes",
                                            "in_flight", "remat_bytes")}
        floats = {k: float(d[k]) for k in ("seconds", "once_seconds", "transfer_seconds", "weight_bytes", "act_bytes",
                                           "remat_bytes")}
        return d | floats | {"layers": list(self.layers), "submesh": list(self.submesh), "plan": self.plan.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> "StagePlan":
        return cls(tuple(d["layers"]), list(d["nodes"]), tuple(d["submesh"]), [int(r) for r in d["ranks"]],
                   Plan.from_dict(d["plan"]), list(d["recv"]), list(d["send"]), float(d["seconds"]),
                   float(d["once_seconds"]), float(d["transfer_seconds"]), float(d["weight_bytes"]),
                   float(d["act_bytes"]), int(d["in_flight"]), float(d.get("remat_bytes", 0.0)))


@dataclass
class PipelinePlan:
    """A pipelined plan: stages on disjoint submeshes of the cluster (Alpa, OSDI'22, section 5).

    Attributes:
        mesh: the cluster as a ``LogicalMesh`` of shape ``(N nodes, M devices per node)``.
        stages: the ``StagePlan`` of every stage, in pipeline order (under ``"interleaved"``,
            stage ``s`` runs on the ranks of stage ``s mod p``, ``p`` the distinct rank sets).
        schedule: a name of ``core/schedules.py``; num_microbatches: B per training step.
        step_seconds: predicted step time ``sum(t_i + o_i) + (B - 1) max t_i`` (GPipe, 1F1B;
            ``core/schedules.py``'s model for the others), seconds, of the stages' ``seconds``
            ``t_i`` and ``once_seconds`` ``o_i`` (docs/pipeline.md): one stage with B = 1 is
            priced as the SPMD plan of its mesh (``Plan.step_seconds``).
        compute_seconds: B times the stages' forward and backward compute per microbatch, plus
            their optimizer updates (once), seconds (the rest of the step is communication and
            bubble).
        bubble_fraction: predicted idle share of the devices' time.
        memory_bytes: the largest stage's predicted peak memory per device, bytes.
        fingerprint: hash of the captured graph of ONE microbatch.
        param_specs / input_specs: every stage's storage specs (on its own logical mesh).
        options: the planning and pipeline options (``PlanOptions`` / ``PipelineOptions``).
        stats: planning statistics (not in JSON).
        loss_reduction: how the loss reduces over the batch, so how microbatch losses combine.
        captured: the microbatch ``CapturedGraph`` (in memory only); layers: the layer clustering.
        pricing_limits: the stage-pricing ILPs of the search (every microbatch count tried) whose
            solver stopped at a limit (``stage_costs.GraphStageCosts.limits``): the DP chose among
            figures they priced, so another run may choose otherwise (empty: all proven optimal).
    """

    mesh: LogicalMesh
    stages: list[StagePlan]
    schedule: str
    num_microbatches: int
    step_seconds: float
    compute_seconds: float
    bubble_fraction: float
    memory_bytes: float
    fingerprint: str
    loss_reduction: LossReduction
    options: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    captured: object = field(default=None, compare=False, repr=False)
    layers: list = field(default_factory=list, compare=False, repr=False)
    pricing_limits: list[dict] = field(default_factory=list)

    kind = "pipeline"

    @property
    def overlap_seconds(self) -> float:
        """What the stages hide behind backward (``hidden_seconds`` of each stage's plan), in the
        step time, seconds: ``step_seconds`` with it added back is the step of a run that waits on
        every collective where it is issued (``report=True``)."""
        sched = get_schedule(self.schedule, self.chunks)
        hidden = [hidden_seconds(s.plan.collectives, s.plan.compute_seconds - s.plan.update_seconds)
                  for s in self.stages]
        waited = (sum(s.once_seconds + h[1] for s, h in zip(self.stages, hidden))
                  + schedule_step_seconds(sched, [s.seconds + h[0] + h[2] for s, h in zip(self.stages, hidden)],
                                          self.num_microbatches))
        return waited - self.step_seconds

    @property
    def chunks(self) -> int:
        """Stages per device group (``v`` of interleaved 1F1B; 1 when every stage has its own ranks)."""
        return len(self.stages) // len({tuple(s.ranks) for s in self.stages})

    @property
    def param_specs(self) -> dict[str, ShardingSpec]:
        """Parameter FQN -> storage spec on its stage's logical mesh (a weight held by two stages:
        the first's)."""
        return self._merged("param_specs")

    @property
    def input_specs(self) -> dict[str, ShardingSpec]:
        """User input -> its spec in the stage that reads it (the first such stage)."""
        return self._merged("input_specs")

    @property
    def zero_stages(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """Parameter FQN -> ``(ZeRO stage, mesh axes of its stage's logical mesh)``
        (``Plan.zero_stages``; a weight held by two stages: the first's)."""
        return self._merged("zero_stages")

    def _merged(self, attribute: str) -> dict:
        out: dict = {}
        for s in reversed(self.stages):  # earlier stages win
            out |= getattr(s.plan, attribute)
        return out

    @property
    def solver_limits(self) -> list[dict]:
        """Every stage's ``Plan.solver_limits``, each with its ``"stage"`` index, then the search's
        ``pricing_limits``."""
        return [{"stage": i} | e for i, s in enumerate(self.stages) for e in s.plan.solver_limits] + self.pricing_limits

    def collective_counts(self) -> dict[tuple[str, str], int]:
        """``(kind, phase) -> count`` over one training step, all stages (per microbatch ones x B)."""
        counts: dict[tuple[str, str], int] = {}
        for s in self.stages:
            for c in s.plan.collectives:
                n = 1 if is_once_per_step(c) else self.num_microbatches
                counts[(c.kind, c.phase)] = counts.get((c.kind, c.phase), 0) + n
        return counts

    def to_dict(self, stats: bool = False) -> dict:
        d = {"version": PLAN_VERSION, "kind": self.kind, "fingerprint": self.fingerprint, "mesh": self.mesh.to_dict(),
             "options": self.options, "schedule": self.schedule, "num_microbatches": self.num_microbatches,
             "step_seconds": self.step_seconds, "compute_seconds": self.compute_seconds,
             "bubble_fraction": self.bubble_fraction, "memory_bytes": self.memory_bytes,
             "loss_reduction": self.loss_reduction.to_dict(), "stages": [s.to_dict() for s in self.stages]}
        if self.pricing_limits:
            d["pricing_limits"] = self.pricing_limits
        if stats:
            d["stats"] = self.stats
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "PipelinePlan":
        return cls(LogicalMesh.from_dict(d["mesh"]), [StagePlan.from_dict(s) for s in d["stages"]], str(d["schedule"]),
                   int(d["num_microbatches"]), float(d["step_seconds"]), float(d["compute_seconds"]),
                   float(d["bubble_fraction"]), float(d["memory_bytes"]), str(d["fingerprint"]),
                   LossReduction.from_dict(d["loss_reduction"]), dict(d.get("options", {})), dict(d.get("stats", {})),
                   pricing_limits=list(d.get("pricing_limits", [])))

    def to_json(self, path: str | Path | None = None) -> str:
        """The plan as JSON; written to ``path`` if given (``Plan.to_json``)."""
        return _write(self.to_dict(), path)


def _write(d: dict, path) -> str:
    text = json.dumps(d, indent=1, sort_keys=False)
    if path is not None:
        Path(path).write_text(text)
    return text


def _from_version_1(d: dict) -> dict:
    """A version-1 plan dict in version 2's layout (version 1 had one type, with an optional
    ``"pipeline"`` object)."""
    p = d.get("pipeline")
    if p is None:
        return d | {"kind": "spmd"}
    if "loss_reduction" not in p:
        raise PlanError("the pipelined plan does not say how its loss reduces over microbatches (made by an "
                        "older alpa-lite): plan it again")
    stages = [s | {"plan": _from_version_1(s["plan"])} for s in p["stages"]]
    return {"kind": "pipeline", "fingerprint": d["fingerprint"], "mesh": d["mesh"], "options": d.get("options", {}),
            "schedule": p["schedule"], "num_microbatches": p["num_microbatches"], "step_seconds": p["pipeline_seconds"],
            "compute_seconds": d["compute_seconds"], "bubble_fraction": p["bubble_fraction"],
            "memory_bytes": d["memory_bytes"], "loss_reduction": p["loss_reduction"], "stages": stages}


def load_plan(text_or_path: str | Path) -> Plan | PipelinePlan:
    """Read a plan of either kind from JSON text or a file (version 2, or version 1).

    Raises:
        PlanError: unreadable JSON, an unknown version or kind, a missing field or a malformed spec.
    """
    source = "plan JSON"
    text = str(text_or_path)
    if not text.lstrip().startswith("{"):
        source = f"plan file {text}"
        try:
            text = Path(text).read_text()
        except OSError as e:
            raise PlanError(f"cannot read {source}: {e}") from None
    try:
        d = json.loads(text)
        if not isinstance(d, dict) or "version" not in d:
            raise PlanError(f"{source} is not an alpa-lite plan (a JSON object with a 'version', as Plan.to_json "
                            f"writes)")
        version = d["version"]
        if version == 1:
            d = _from_version_1(d)
        elif version != PLAN_VERSION:
            raise PlanError(f"{source}: unsupported plan version {version!r} (this alpa-lite reads versions 1 and "
                            f"{PLAN_VERSION}); plan it again")
        kinds = {"spmd": Plan, "pipeline": PipelinePlan}
        if d.get("kind") not in kinds:
            raise PlanError(f"{source}: unknown plan kind {d.get('kind')!r} (expected 'spmd' or 'pipeline')")
        return kinds[d["kind"]].from_dict(d)
    except PlanError:
        raise
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise PlanError(f"{source} is corrupt: {type(e).__name__}: {e}") from None


def is_once_per_step(c: Collective) -> bool:
    """Whether collective ``c`` runs once per step in a pipeline stage (after its last microbatch's
    backward: a gradient bucket; after the update: a ZeRO-1/2 parameter bucket), not per microbatch."""
    return c.node.startswith(("gradient bucket", "parameter bucket"))


BACKWARD_SHARE = 2 / 3
"""The share of a step's compute that backward runs (backward is 2x forward FLOPs): what can
hide the gradient synchronization (``hidden_seconds``)."""


def hidden_seconds(collectives, compute_seconds: float) -> tuple[float, float, float]:
    """``(ZeRO-3 reduce-scatters, gradient buckets, deferred loss all-reduce)`` hidden behind
    backward, seconds, of a step
    (or a pipeline stage's last microbatch) that computes ``compute_seconds`` forward and
    backward (the optimizer update not included) and issues
    ``collectives`` (``Plan.overlap_seconds``): every ZeRO-3 group's reduce-scatter but group 0's
    first, then the loss all-reduce the runtime defers (``Collective.deferred``: started in
    forward, waited for after backward), then every gradient bucket but the first listed of each
    (kind, mesh axes), within the backward's share of the compute (``BACKWARD_SHARE``). The
    first bucket of a (kind, axes) holds its parameters used first (``gradient_buckets``), often
    the first layer's, whose gradients are complete only when backward ends. A pipeline stage
    hides its groups' reduce-scatters and (the last stage) its loss's all-reduce behind each
    microbatch's backward, and its buckets behind the last one's, in what those leave of it (the
    order of the ILP's pool weights, ``ilp.Pool.weight``)."""
    budget = BACKWARD_SHARE * compute_seconds
    groups = min(budget, sum(c.seconds for c in collectives if c.kind == "reduce-scatter"
                             and c.tensor.startswith("ZeRO-3 group ") and not c.tensor.startswith("ZeRO-3 group 0 ")))
    loss = min(budget - groups, sum(c.seconds for c in collectives if c.deferred))
    first, buckets = set(), 0.0
    for c in collectives:
        if c.node.startswith("gradient bucket"):
            if (c.kind, c.mesh_axes) in first:
                buckets += c.seconds
            first.add((c.kind, c.mesh_axes))
    buckets = min(budget - groups - loss, buckets)
    return groups, buckets, loss


def step_parts(collectives, compute_seconds: float, update_seconds: float = 0.0) -> tuple[float, float]:
    """``(per microbatch, once per step)`` seconds of a step (a pipeline stage's: per microbatch)
    that computes ``compute_seconds`` (``update_seconds`` of it the optimizer update, which hides
    nothing) and issues ``collectives``: per microbatch, the forward and backward compute and the
    collectives of every microbatch less the ZeRO-3 reduce-scatters and the deferred loss
    all-reduce hidden behind its backward;
    once per step, the optimizer update and the gradient and parameter buckets
    (``is_once_per_step``) less those hidden behind the last microbatch's backward
    (``hidden_seconds``). Their sum is ``Plan.step_seconds``."""
    compute = compute_seconds - update_seconds
    groups, buckets, loss = hidden_seconds(collectives, compute)
    once = sum(c.seconds for c in collectives if is_once_per_step(c))
    return compute + sum(c.seconds for c in collectives) - once - groups - loss, update_seconds + once - buckets


def gradient_buckets(cg, nodes: dict[str, NodePlan], grad_sync: dict[str, tuple[int, ...]],
                     mesh_shape, bucket_bytes: float) -> list[tuple[str, tuple[int, ...], list[str]]]:
    """Buckets of deferred gradients: ``(kind, axes, [parameter placeholders])``, each at most
    ``bucket_bytes`` of local gradient (a larger single gradient is its own bucket) of one
    ``kind`` (``"reduce-scatter"`` for ZeRO-2 parameters, ``NodePlan.zero_stage``, else
    ``"all-reduce"``) and axes. Ordered by their earliest member's first use
    (``first_use_positions``; ties by kind and axes): backward completes a bucket when it reaches
    that use, so the runtime, launching them in reverse, launches each as soon as it is complete,
    and bucket 0 is completed last. In key order instead, a (kind, axes) sorting later held its
    first layer's gradients at the head of the launch order and every other bucket waited for
    the end of backward behind it."""
    kinds = {ph: ("reduce-scatter" if nodes[ph].zero_stage == 2 else "all-reduce", axes)
             for ph, axes in grad_sync.items()}
    first = first_use_positions(cg)
    buckets = sorted(_buckets(cg, nodes, kinds, mesh_shape, bucket_bytes), key=lambda b: first[b[1][0]])
    return [(kind, axes, members) for (kind, axes), members in buckets]


def update_buckets(cg, nodes: dict[str, NodePlan], mesh_shape, bucket_bytes: float
                   ) -> list[tuple[tuple[int, ...], list[str]]]:
    """Buckets of ZeRO-1/2 parameters all-gathered after the optimizer step: ``(axes,
    [placeholders])``, in the order of their first uses, each at most ``bucket_bytes`` of local
    parameter."""
    axes = {ph: nodes[ph].zero_axes for ph in cg.param_fqns if ph in nodes and nodes[ph].zero_stage in (1, 2)}
    return _buckets(cg, nodes, axes, mesh_shape, bucket_bytes)


def first_use_positions(cg) -> dict[str, int]:
    """Parameter placeholder -> graph position of its first use (through a mixed-precision
    cast, ``CapturedGraph.param_casts``: its first reader); unused ones: the graph's length."""
    position = {n.name: i for i, n in enumerate(cg.graph.nodes)}
    casts = cg.param_casts

    def first(ph: str) -> int:
        return min((min((position[w.name] for w in u.users), default=position[u.name]) if u.name in casts
                    else position[u.name] for u in cg.node(ph).users), default=len(position))

    return {ph: first(ph) for ph in cg.param_fqns}


def first_use_order(cg) -> list[str]:
    """The parameter placeholders of ``cg`` in the order of their first uses in the graph
    (``first_use_positions``); unused ones last.

    Backward completes a parameter's gradient when it reaches the first use, so buckets filled in
    this order and launched in reverse become ready one after the other, last layers first (as
    DDP's buckets, rebuilt in the order gradients arrive: Li et al., VLDB 2020, section 3.2.3).
    Placeholder order is not that order: a tied weight (GPT's ``wte`` / ``lm_head``) sits where its
    module is registered or last used, but its gradient is complete only at its first use."""
    first = first_use_positions(cg)
    return sorted(cg.param_fqns, key=first.__getitem__)


def _buckets(cg, nodes, keys: dict, mesh_shape, bucket_bytes: float) -> list[tuple[object, list[str]]]:
    """Per key (sorted), its parameters in buckets of at most ``bucket_bytes``, in first-use order.
    They are filled from the last parameter back, the order backward completes them, so the
    bucket of a key it completes last (launched after backward, not hidden behind it) holds
    the remainder, as DDP's last bucket does. A bucket holds parameters of one dtype: the runtime
    concatenates its members into one flat tensor of one dtype (sweep 12: a complex parameter, an
    FNO's Fourier weights, shared a bucket with fp32 ones and lost the imaginary part of its
    gradient to the fp32 buffer under data parallelism and ZeRO, silently; a float64 head's
    gradients were rounded to fp32)."""
    buckets: list[tuple[object, list[str]]] = []
    order = first_use_order(cg)
    dtype = {ph: str(cg.node(ph).meta["val"].dtype) for ph in order}
    for key, dt in sorted({(k, dtype[ph]) for ph, k in keys.items() if ph in dtype}):
        size, filled = math.inf, []
        for ph in reversed([p for p in order if keys.get(p) == key and dtype[p] == dt]):
            nbytes = local_bytes(cg.node(ph).meta["val"], nodes[ph].out_specs[0], mesh_shape)
            if size + nbytes > bucket_bytes:
                filled.append([])
                size = 0
            filled[-1].append(ph)
            size += nbytes
        buckets += [(key, members[::-1]) for members in filled[::-1]]
    return buckets


def local_bytes(val, spec: ShardingSpec, mesh_shape, dtype: torch.dtype | None = None) -> int:
    """Bytes of one device's shard of tensor ``val`` (a FakeTensor) stored in ``spec``, in
    ``dtype`` (None: its own)."""
    itemsize = val.element_size() if dtype is None else dtype.itemsize
    return itemsize * math.prod(spec.local_shape(tuple(val.shape), mesh_shape))


def zero3_uses(cg, nodes: dict[str, NodePlan], mesh_shape, remat: list[list[str]] = (), layer: int | None = None
               ) -> dict[tuple, tuple]:
    """The ZeRO-3 uses outside recomputed layers (``layer`` None), or inside recomputed layer
    ``remat[layer]`` (which moves its operands itself, again in its recomputation): a parameter
    (or its low-precision cast) stored split and all-gathered for an op, whose gathered copy is
    not kept for backward (``resharding.regathers``; in a recomputed layer the recomputation
    gathers it again instead). ``(value, its spec, wanted spec, gradient partial axes) -> global
    shape``, in graph order of the first reader (the order every rank moves them in).

    Raises:
        IndexError: ``layer`` is not an index of ``remat``."""
    if layer is None:
        inside, wanted = {n for nodes_ in remat for n in nodes_}, False
    else:
        inside, wanted = set(remat[layer]), True
    parameters = set(cg.param_fqns) | set(cg.param_casts)
    uses: dict[tuple, tuple] = {}
    for node in cg.graph.nodes:
        np_ = nodes.get(node.name)
        if np_ is None or (node.name in inside) != wanted:
            continue
        for src, dst, gp in zip(np_.inputs, np_.in_specs, np_.grad_partial):
            val = cg.node(src).meta["val"] if src in parameters else None
            if val is not None and regathers(nodes[src].out_specs[0], dst, gp, tuple(val.shape), val.element_size(),
                                             mesh_shape):
                uses.setdefault((src, nodes[src].out_specs[0], dst, gp), tuple(val.shape))
    return uses


def zero3_groups(cg, nodes: dict[str, NodePlan], mesh_shape, bucket_bytes: float, remat: list[list[str]] = (),
                 layer: int | None = None) -> list[list[tuple]]:
    """ZeRO-3 uses (``zero3_uses`` keys, outside recomputed layers or inside ``remat[layer]``)
    gathered by one flat all-gather, forward and again in backward (in a recomputed layer: again
    in its recomputation), and whose gradients are summed by one flat reduce-scatter: FSDP's parameter groups
    (Zhao et al., "PyTorch FSDP", VLDB 2023, section 3.2; one collective per group instead of one
    per parameter). A use qualifies when its move is one all-gather along a dim over one mesh axis,
    its gradient's one reduce-scatter along the same dim and axis, and its value is a parameter
    or a cast of one that keeps its spec; consecutive qualifying uses (graph order) of the same
    axis and dtype form a group of at most ``bucket_bytes`` gathered (a larger single one is its
    own group; ``resharding.grouped_steps``). Other uses are moved one by one (not listed here)."""
    casts = cg.param_casts
    groups: list[list[tuple]] = []
    last, size = None, math.inf
    for key, shape in zero3_uses(cg, nodes, mesh_shape, remat, layer).items():
        src, spec, dst, gp = key
        val = cg.node(src).meta["val"]
        if src in casts and (nodes[src].in_specs[0] != spec or nodes[src].grad_partial[0]):
            continue
        steps = grouped_steps(spec, dst, gp, shape, val.element_size(), mesh_shape)
        if steps is None:
            continue
        kind = (steps[0].axis, val.dtype)
        if kind != last or size + steps[0].nbytes > bucket_bytes:
            groups.append([])
            last, size = kind, 0.0
        groups[-1].append(key)
        size += steps[0].nbytes
    return groups
