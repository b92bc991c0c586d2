"""Typed planning options, carried unchanged from ``alpa_lite.plan`` / ``parallelize`` to every pass.

``PlanOptions`` holds what the intra-operator pass (Alpa, OSDI'22, section 4) reads, and every
stage of a pipelined plan reads the same object; ``PipelineOptions`` holds what the inter-operator
pass (section 5) reads. Both are frozen dataclasses: a pass that needs another value makes a copy
with ``dataclasses.replace``, so what the user asked for is what the plan records.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

SCHEDULES = ("1f1b", "gpipe")
SOLVERS = ("auto", "cbc", "highs")


@dataclass(frozen=True)
class PlanOptions:
    """Options of the intra-operator pass (one ILP per mesh, or per pipeline stage)."""

    memory_budget: float | None = None
    """Bytes per device the plan may use; None: the cluster's device memory."""
    force_data_parallel: bool = False
    """Every parameter replicated and every batch split over all mesh axes (the DDP baseline);
    forced ``param_specs`` still apply (e.g. ``S01R`` parameters: ZeRO-3 storage)."""
    replicate_params: bool = False
    """Every parameter without a forced spec is stored replicated (hand-tuned baselines such as
    Megatron's tensor parallelism, which replicates what it does not split)."""
    batch_axis: int | None = None
    """Force the batch dim (dim 0) of the inputs and activations to be split along this mesh axis
    (0 or 1); forcing onto an axis of size 1 is a no-op."""
    param_specs: dict[str, str] = field(default_factory=dict)
    """Parameter FQN -> spec string to force (Megatron's ``{"fc1.weight": "S1R"}``); every key must
    name a parameter (a tied weight by any of its names)."""
    input_specs: dict[str, str] = field(default_factory=dict)
    """User-input placeholder name (or position ``"0"``, ``"1"`` ...) -> spec string to force."""
    share_layers: bool = True
    """Identical repeated layers share one ILP solution (a smaller ILP, the same optimum when the
    layers really are identical)."""
    time_limit: float = 60.0
    """Seconds the ILP solver may take per solve; the best feasible answer found is used after it."""
    solver: str = "auto"
    """``"auto"`` (HiGHS in-process when ``highspy`` is installed, else CBC), ``"cbc"`` (ships
    with PuLP, one solver process per ILP) or ``"highs"`` (needs ``highspy``)."""
    bucket_bytes: float = 25 * 2**20
    """Largest bucket of deferred data-parallel gradients synchronized together, bytes."""

    def __post_init__(self):
        if self.memory_budget is not None and not self.memory_budget > 0:
            raise ValueError(f"memory_budget must be a positive number of bytes, got {self.memory_budget}")
        if self.batch_axis not in (None, 0, 1):
            raise ValueError(f"batch_axis must be 0, 1 or None, got {self.batch_axis!r}")
        if self.solver not in SOLVERS:
            raise ValueError(f"unknown solver {self.solver!r}; use one of {', '.join(SOLVERS)}")
        if not self.time_limit > 0:
            raise ValueError(f"time_limit must be > 0 seconds, got {self.time_limit}")
        if not self.bucket_bytes > 0:
            raise ValueError(f"bucket_bytes must be > 0, got {self.bucket_bytes}")
        object.__setattr__(self, "param_specs", dict(self.param_specs or {}))
        object.__setattr__(self, "input_specs", {str(k): v for k, v in (self.input_specs or {}).items()})

    def to_dict(self) -> dict:
        """JSON-able fields (an infinite budget as None)."""
        d = dataclasses.asdict(self)
        if d["memory_budget"] is not None and not math.isfinite(d["memory_budget"]):
            d["memory_budget"] = None
        return d


@dataclass(frozen=True)
class PipelineOptions:
    """Options of the inter-operator pass: layer clustering, stages, submeshes, microbatches."""

    num_stages: int | None = None
    """S, the number of pipeline stages; None: the stage DP chooses."""
    schedule: str = "1f1b"
    """``"1f1b"`` (PipeDream-flush, Narayanan et al. 2021) or ``"gpipe"`` (Huang et al. 2019)."""
    num_microbatches: int | None = None
    """B, microbatches per training step (must divide the batch); None: the best of
    ``microbatch_candidates``."""
    num_layers: int | None = None
    """L, layers of the clustering (Alpa section 5.2); None: ``min(module boundaries, 16)``."""
    microbatch_candidates: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    """The B values tried when ``num_microbatches`` is None (those that divide the batch). With 1
    among them the search holds the plan without pipelining (one stage on the whole mesh,
    ``compiler/stage_costs.py``), so ``pipeline="auto"`` predicts no slower a step than it."""
    imbalance: float = 4.0
    """Skip a (layer range, submesh) pair whose share of the devices differs from its share of the
    FLOPs by more than this factor (both ways); ``math.inf`` keeps all. Retried without when it
    leaves no way to make ``num_stages``."""
    power_of_two: bool = True
    """Only ``(k, M)`` submeshes with ``k`` a power of two, as Alpa's implementation does."""
    workers: int | None = None
    """Processes computing stage costs; None: one per CPU core (1 inside a distributed job)."""
    stage_solve: str = "chain"
    """How a stage's intra-op plan is solved: ``"chain"`` (one ILP per layer, in order; the
    planning time grows with the distinct layers) or ``"exact"`` (one ILP per stage);
    ``compiler/stage_costs.py``."""

    def __post_init__(self):
        if self.stage_solve not in ("chain", "exact"):
            raise ValueError(f"stage_solve must be 'chain' or 'exact', got {self.stage_solve!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; use one of {', '.join(SCHEDULES)}")
        for name in ("num_stages", "num_microbatches", "num_layers", "workers"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        candidates = tuple(self.microbatch_candidates)
        if not candidates or any(not isinstance(b, int) or b < 1 for b in candidates):
            raise ValueError(f"microbatch_candidates must be positive integers, got {self.microbatch_candidates!r}")
        object.__setattr__(self, "microbatch_candidates", candidates)

    @classmethod
    def parse(cls, pipeline) -> "PipelineOptions | None":
        """``None`` (no pipeline), ``"auto"``, a stage count (``4`` or ``"4"``) or ``PipelineOptions``.

        Raises:
            ValueError: anything else.
        """
        if pipeline is None or isinstance(pipeline, PipelineOptions):
            return pipeline
        if pipeline == "auto":
            return cls()
        if isinstance(pipeline, int) or (isinstance(pipeline, str) and pipeline.isdigit()):
            return cls(num_stages=int(pipeline))
        raise ValueError(f"pipeline must be 'auto', a number of stages or PipelineOptions, got {pipeline!r}")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["microbatch_candidates"] = list(d["microbatch_candidates"])
        return d


def split_options(options: PlanOptions | None, pipeline, keywords: dict) -> tuple[PlanOptions, PipelineOptions | None]:
    """The typed options of a call that may also give their fields as keywords
    (``plan(..., force_data_parallel=True, num_microbatches=4)``).

    Raises:
        TypeError: a keyword that is no field of either (the message lists the fields).
    """
    plan_fields = {f.name for f in dataclasses.fields(PlanOptions)}
    pipe_fields = {f.name for f in dataclasses.fields(PipelineOptions)}
    unknown = sorted(set(keywords) - plan_fields - pipe_fields)
    if unknown:
        raise TypeError(f"unknown planning option(s) {', '.join(unknown)}; PlanOptions has "
                        f"{', '.join(sorted(plan_fields))}; PipelineOptions has {', '.join(sorted(pipe_fields))}")
    plan_kw = {k: v for k, v in keywords.items() if k in plan_fields}
    pipe_kw = {k: v for k, v in keywords.items() if k in pipe_fields}
    options = dataclasses.replace(options or PlanOptions(), **plan_kw)
    pipe = PipelineOptions.parse(pipeline)
    if pipe_kw:
        pipe = dataclasses.replace(pipe or PipelineOptions(), **pipe_kw)
    return options, pipe
