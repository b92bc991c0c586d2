"""The ``Plan``: everything the runtime needs, and everything a user asks about a plan.

One validated, serializable object (JSON round trip): per-parameter storage specs by FQN, the
strategy chosen for every node, the collectives a training step issues, and the predicted step
time (compute / communication) and memory per device.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .losses import LossReduction
from .mesh import LogicalMesh
from .spec import ShardingSpec

PLAN_VERSION = 1


class PlanError(ValueError):
    """A plan file is corrupt or does not belong to the model / mesh it is used with."""


@dataclass(frozen=True)
class NodePlan:
    """The strategy chosen for one graph node (specs as Alpa strings, e.g. ``"S0R"``)."""

    strategy: str
    in_specs: tuple[str, ...]
    out_specs: tuple[str, ...]
    partial_axes: tuple[int, ...] = ()
    reduce: str = "sum"
    grad_partial: tuple[tuple[int, ...] | None, ...] = ()
    inputs: tuple[str, ...] = ()
    input_results: tuple[int, ...] = ()


@dataclass(frozen=True)
class Collective:
    """One collective a training step issues.

    Attributes:
        kind: ``"all-reduce"``, ``"all-gather"``, ``"reduce-scatter"`` or ``"all-to-all"``.
        mesh_axes: the mesh axes whose devices take part (``(0, 1)``: the flattened mesh).
        nbytes: the per-device bytes of the cost formula (mesh.py).
        phase: ``"forward"`` or ``"backward"``.
        node: the consuming node (resharding) or the node reducing its partial result.
        tensor: the tensor moved (producer node name).
        seconds: predicted time.
    """

    kind: str
    mesh_axes: tuple[int, ...]
    nbytes: float
    phase: str
    node: str
    tensor: str
    seconds: float


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
        seconds: forward + backward of one microbatch, including its input transfer, seconds;
        once_seconds: paid once per step (gradient synchronization); transfer_seconds: the
            transfer part of ``seconds``.
        weight_bytes / act_bytes: per device: weights with gradients and optimizer state, and
            activations of one microbatch; in_flight: microbatches whose activations it holds.
    """

    layers: tuple[int, int]
    nodes: list[str]
    submesh: tuple[int, int]
    ranks: list[int]
    plan: "Plan"
    recv: list[str]
    send: list[str]
    seconds: float
    once_seconds: float
    transfer_seconds: float
    weight_bytes: float
    act_bytes: float
    in_flight: int

    @property
    def memory_bytes(self) -> float:
        """Predicted peak memory per device, bytes."""
        return self.weight_bytes + self.in_flight * self.act_bytes

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("layers", "nodes", "submesh", "ranks", "recv", "send", "seconds",
                                            "once_seconds", "transfer_seconds", "weight_bytes", "act_bytes",
                                            "in_flight")}
        floats = {k: float(d[k]) for k in ("seconds", "once_seconds", "transfer_seconds", "weight_bytes", "act_bytes")}
        return d | floats | {"layers": list(self.layers), "submesh": list(self.submesh), "plan": self.plan.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> "StagePlan":
        return cls(tuple(d["layers"]), list(d["nodes"]), tuple(d["submesh"]), [int(r) for r in d["ranks"]],
                   Plan.from_json(json.dumps(d["plan"])), list(d["recv"]), list(d["send"]), float(d["seconds"]),
                   float(d["once_seconds"]), float(d["transfer_seconds"]), float(d["weight_bytes"]),
                   float(d["act_bytes"]), int(d["in_flight"]))


@dataclass
class Plan:
    """An intra-operator sharding plan for one model on one logical mesh.

    Attributes:
        mesh: the logical mesh (shape and cost figures) planned for.
        param_specs: parameter FQN -> storage spec string (``"S1R"``); tied names share one.
        input_specs: user-input placeholder name -> spec string.
        nodes: node name -> ``NodePlan``.
        collectives: every collective of one training step, in execution order per phase.
        compute_seconds / comm_seconds: predicted step time split, seconds.
        memory_bytes: predicted peak memory per device, bytes.
        fingerprint: hash of the captured graph (``CapturedGraph.fingerprint``).
        stats: planning statistics (capture / strategy / ILP seconds, ILP size).
        grad_sync: parameter placeholder -> mesh axes whose gradient all-reduce is deferred to the
            end of backward and bucketed (data-parallel gradient synchronization, as DDP does).
        bucket_bytes: the largest gradient bucket, bytes.
        stages: pipeline stages (``StagePlan``), empty for an intra-op-only plan. A pipelined plan's
            ``mesh`` is the whole cluster, its ``nodes`` are empty (each stage has its own), and
            its ``fingerprint`` is the graph of one microbatch.
        schedule: ``"1f1b"`` or ``"gpipe"``; num_microbatches: B per training step.
        bubble_fraction: predicted idle share of the devices' time (``stages.bubble_fraction``).
        pipeline_seconds: predicted step time ``sum(t_i + o_i) + (B - 1) max t_i`` (stages.py).
        loss_reduction: how the loss reduces over the batch, so how microbatch losses combine
            (``losses.LossReduction``; pipelined plans).
    """

    mesh: LogicalMesh
    param_specs: dict[str, str]
    input_specs: dict[str, str]
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
    stages: list[StagePlan] = field(default_factory=list)
    schedule: str | None = None
    num_microbatches: int = 1
    bubble_fraction: float = 0.0
    pipeline_seconds: float = 0.0
    loss_reduction: LossReduction | None = None

    @property
    def step_seconds(self) -> float:
        """Predicted time of one training step, seconds."""
        if self.stages:
            return self.pipeline_seconds
        return self.compute_seconds + self.comm_seconds

    def collective_counts(self) -> dict[tuple[str, str], int]:
        """``(kind, phase) -> count`` over one training step."""
        counts: dict[tuple[str, str], int] = {}
        for c in self.collectives:
            counts[(c.kind, c.phase)] = counts.get((c.kind, c.phase), 0) + 1
        return counts

    def to_dict(self, stats: bool = False) -> dict:
        d = {
            "version": PLAN_VERSION,
            "fingerprint": self.fingerprint,
            "mesh": self.mesh.to_dict(),
            "options": self.options,
            "param_specs": dict(sorted(self.param_specs.items())),
            "input_specs": dict(sorted(self.input_specs.items())),
            "nodes": {k: asdict(v) for k, v in self.nodes.items()},
            "collectives": [asdict(c) for c in self.collectives],
            "compute_seconds": self.compute_seconds,
            "comm_seconds": self.comm_seconds,
            "memory_bytes": self.memory_bytes,
            "grad_sync": {k: list(v) for k, v in self.grad_sync.items()},
            "bucket_bytes": float(self.bucket_bytes),
        }
        if self.stages:
            d["pipeline"] = {"schedule": self.schedule, "num_microbatches": self.num_microbatches,
                             "bubble_fraction": self.bubble_fraction, "pipeline_seconds": self.pipeline_seconds,
                             "loss_reduction": self.loss_reduction.to_dict(),
                             "stages": [s.to_dict() for s in self.stages]}
        if stats:
            d["stats"] = self.stats
        return d

    def to_json(self, path: str | Path | None = None) -> str:
        """The plan as JSON (byte-identical for the same inputs); written to ``path`` if given.
        Timing statistics are left out so the text depends only on the inputs."""
        text = json.dumps(self.to_dict(), indent=1, sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "Plan":
        """Read a plan from JSON text or a file.

        Raises:
            PlanError: unreadable JSON, a missing field or a malformed spec.
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
            if d.get("version") != PLAN_VERSION:
                raise PlanError(f"{source}: unsupported plan version {d.get('version')!r}")
            nodes = {k: NodePlan(v["strategy"], tuple(v["in_specs"]), tuple(v["out_specs"]),
                                 tuple(v["partial_axes"]), v["reduce"], tuple(None if g is None else tuple(g) for g in v["grad_partial"]),
                                 tuple(v["inputs"]), tuple(v["input_results"])) for k, v in d["nodes"].items()}
            for spec in [*d["param_specs"].values(), *d["input_specs"].values(),
                         *(s for n in nodes.values() for s in n.in_specs + n.out_specs)]:
                ShardingSpec.parse(spec)
            return cls(LogicalMesh.from_dict(d["mesh"]), dict(d["param_specs"]), dict(d["input_specs"]), nodes,
                       [Collective(**(c | {"mesh_axes": tuple(c["mesh_axes"])})) for c in d["collectives"]],
                       float(d["compute_seconds"]), float(d["comm_seconds"]), float(d["memory_bytes"]),
                       str(d["fingerprint"]), dict(d.get("options", {})), dict(d.get("stats", {})),
                       {k: tuple(v) for k, v in d["grad_sync"].items()}, float(d["bucket_bytes"]),
                       *_pipeline_fields(d.get("pipeline")))
        except PlanError:
            raise
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise PlanError(f"{source} is corrupt: {type(e).__name__}: {e}") from None


def _pipeline_fields(d: dict | None) -> tuple:
    """``(stages, schedule, num_microbatches, bubble_fraction, pipeline_seconds, loss_reduction)``
    from a plan JSON's optional ``"pipeline"`` object (absent in intra-op plans)."""
    if d is None:
        return [], None, 1, 0.0, 0.0, None
    if "loss_reduction" not in d:
        raise PlanError("the pipelined plan does not say how its loss reduces over microbatches (made by an "
                        "older alpa-lite): plan it again")
    return ([StagePlan.from_dict(s) for s in d["stages"]], str(d["schedule"]), int(d["num_microbatches"]),
            float(d["bubble_fraction"]), float(d["pipeline_seconds"]), LossReduction.from_dict(d["loss_reduction"]))
