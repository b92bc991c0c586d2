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

import torch

from .schedules import SCHEDULES
SOLVERS = ("auto", "cbc", "highs")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""The dtype names of ``mixed_precision`` and ``reduce_dtype``."""


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
    """Identical repeated layers share one ILP solution, also blocks numbered inside numbered
    blocks (a smaller ILP; it restricts the search, so the optimum can be a little slower where
    mixing specs across copies pays: docs/planner.md, "Shrinking")."""
    node_limit: int | None = 1000
    """Branch-and-bound nodes the ILP solver may explore per solve (HiGHS ``mip_max_nodes``, CBC
    ``maxNodes``), the primary stopping rule: with one thread and fixed seeds the same input
    explores the same nodes on any machine, so a plan it stops is reproducible. None: no limit.
    The best feasible answer found is used after it (``Plan.solver_limits`` says so)."""
    time_limit: float = 60.0
    """Wall-clock seconds the ILP solver may take per solve, a backstop behind ``node_limit``: the
    best feasible answer found is used after it, and then depends on the machine's speed and load
    (``Plan.solver_limits`` says ``"limit": "time"``)."""
    solver: str = "auto"
    """``"auto"`` (HiGHS in-process when ``highspy`` is installed, else CBC), ``"cbc"`` (ships
    with PuLP, one solver process per ILP) or ``"highs"`` (needs ``highspy``)."""
    bucket_bytes: float = 25 * 2**20
    """Largest bucket of deferred data-parallel gradients synchronized together, bytes."""
    zero_stage: int | None = None
    """Force every trainable parameter to one ZeRO stage (Rajbhandari et al., SC'20) over the
    data-parallel mesh axes (all axes under ``force_data_parallel``, else ``batch_axis``, one of
    which must be given): ``1`` optimizer states split, ``2`` gradients too (reduce-scatter),
    ``3`` parameters too (all-gathered before use). None: the ILP chooses per parameter among
    replicated, ZeRO-1, ZeRO-2 and ZeRO-3 storage, jointly with its tensor-parallel spec
    (docs/planner.md, "ZeRO stages")."""
    allow_replicated_heavy_ops: bool = True
    """False: every compute-heavy op (matmul, convolution, einsum, attention) splits its work along
    every mesh axis of more than one device, never computing the same product twice (Alpa's
    default, Zheng et al. 2022, section 4.2); an op whose shapes allow no such strategy keeps all
    of its strategies."""
    mixed_precision: str | None = None
    """``"bf16"`` / ``"fp16"``: parameters, gradients and optimizer states stay fp32 (master
    weights); the model computes with its floating parameters and inputs cast to this dtype, its
    floating outputs cast back to fp32 before ``loss_fn`` (``core/capture.py``, ``TrainingLoss``);
    ``"fp16"`` adds a dynamic loss scaler. None: every tensor in its own dtype."""
    remat: str | None = None
    """Activation checkpointing per layer of the layer clustering (``compiler/clustering.py``):
    ``"auto"``: the ILP chooses per layer to keep its activations or recompute them in backward
    (extra forward compute against freed memory, ``compiler/ilp.py``); ``"all"``: every layer
    recomputed; None: every activation kept."""
    reduce_dtype: str | None = None
    """dtype of the deferred data-parallel gradient all-reduces (``"bf16"``, ``"fp16"``,
    ``"fp32"``); None: the compute dtype under ``mixed_precision`` (the dtype the gradient has
    where autograd produces it), else the parameter's."""
    allow_all_gather: bool = True
    """False: no resharding may all-gather (forward, or backward as a reduce-scatter's dual), and
    no parameter takes ZeRO-1/2 (the all-gather of its update); Alpa's ``allow_all_gather``."""
    allow_all_to_all: bool = True
    """False: no resharding may move a mesh axis between dims by an all-to-all (so no Ulysses
    attention); Alpa's ``allow_all_to_all``."""
    prefer_reduce_scatter: bool = False
    """True: a partial sum that reaches a split along its mesh axis is reduce-scattered there,
    never all-reduced by its op and then sliced, whenever the op can leave it partial (Alpa's
    ``prefer_reduce_scatter``; Megatron-SP's pattern, Korthikanti et al. 2022)."""

    def __post_init__(self):
        if self.memory_budget is not None and not self.memory_budget > 0:
            raise ValueError(f"memory_budget must be a positive number of bytes, got {self.memory_budget}")
        if self.batch_axis not in (None, 0, 1):
            raise ValueError(f"batch_axis must be 0, 1 or None, got {self.batch_axis!r}")
        if self.solver not in SOLVERS:
            raise ValueError(f"unknown solver {self.solver!r}; use one of {', '.join(SOLVERS)}")
        if self.node_limit is not None and not (isinstance(self.node_limit, int) and self.node_limit > 0):
            raise ValueError(f"node_limit must be a positive integer or None, got {self.node_limit!r}")
        if not self.time_limit > 0:
            raise ValueError(f"time_limit must be > 0 seconds, got {self.time_limit}")
        if self.zero_stage not in (None, 1, 2, 3):
            raise ValueError(f"zero_stage must be 1, 2, 3 or None, got {self.zero_stage!r}")
        if self.zero_stage is not None and not self.force_data_parallel and self.batch_axis is None:
            raise ValueError("zero_stage needs the data-parallel mesh axes: give force_data_parallel=True or batch_axis")
        if not self.bucket_bytes > 0:
            raise ValueError(f"bucket_bytes must be > 0, got {self.bucket_bytes}")
        if self.mixed_precision not in (None, "bf16", "fp16"):
            raise ValueError(f"mixed_precision must be 'bf16', 'fp16' or None, got {self.mixed_precision!r}")
        if self.remat not in (None, "auto", "all"):
            raise ValueError(f"remat must be 'auto', 'all' or None, got {self.remat!r}")
        if self.reduce_dtype not in (None, *DTYPES):
            raise ValueError(f"reduce_dtype must be one of {', '.join(DTYPES)} or None, got {self.reduce_dtype!r}")
        object.__setattr__(self, "param_specs", dict(self.param_specs or {}))
        object.__setattr__(self, "input_specs", {str(k): v for k, v in (self.input_specs or {}).items()})

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype the model computes in under ``mixed_precision`` (None without)."""
        return DTYPES.get(self.mixed_precision)

    @property
    def gradient_reduce_dtype(self) -> torch.dtype | None:
        """The dtype of the deferred gradient all-reduces (None: the gradient's own, fp32)."""
        return reduce_dtype_of(self.to_dict())

    def restrictions(self) -> list[str]:
        """The switches set to forbid plans, as ``name=value`` (``["allow_all_gather=False"]``)."""
        defaults = PlanOptions()
        return [f"{name}={getattr(self, name)}" for name in ("allow_replicated_heavy_ops", "allow_all_gather",
                                                             "allow_all_to_all", "prefer_reduce_scatter")
                if getattr(self, name) != getattr(defaults, name)]

    @classmethod
    def from_dict(cls, d: dict) -> PlanOptions:
        """The options ``to_dict`` (a plan's ``options``) recorded; keys of no field are left out."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

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
    """S, the number of pipeline stages (under ``"interleaved"``: all ``p * chunks`` of them);
    None: the stage DP chooses."""
    schedule: str = "1f1b"
    """``"1f1b"`` (PipeDream-flush, Narayanan et al. 2021), ``"gpipe"`` (Huang et al. 2019),
    ``"zb-h1"`` (zero-bubble, Qi et al. 2024), ``"interleaved"`` (interleaved 1F1B, Narayanan et
    al. 2021, section 2.2.2; ``core/schedules.py``) or ``"auto"``: the one of these with the
    least predicted step time within the memory budget (GPipe's DP is not run: 1F1B's optimum
    is at most its, ``compiler.inter_op.dp_schedules``)."""
    chunks: int = 2
    """v, stages per device group under ``"interleaved"`` (stage ``s`` on group ``s mod p``);
    the other schedules ignore it."""
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
        if self.schedule not in (*SCHEDULES, "auto"):
            raise ValueError(f"unknown schedule {self.schedule!r}; use one of {', '.join(SCHEDULES)} or auto")
        if not isinstance(self.chunks, int) or self.chunks < 2:
            raise ValueError(f"chunks must be an integer >= 2 (stages per device group), got {self.chunks!r}")
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


def compute_dtype_of(options: dict) -> torch.dtype | None:
    """The compute dtype recorded in a plan's ``options`` (``PlanOptions.to_dict``, or a
    pipelined plan's ``{"plan": ...}``); None: no mixed precision."""
    return DTYPES.get(options.get("plan", options).get("mixed_precision"))


def reduce_dtype_of(options: dict) -> torch.dtype | None:
    """The dtype of the deferred gradient all-reduces recorded in a plan's ``options``
    (``PlanOptions.to_dict``, or a pipelined plan's ``{"plan": ...}``); None: the gradient's own."""
    options = options.get("plan", options)
    name = options.get("reduce_dtype") or options.get("mixed_precision")
    return DTYPES.get(name)


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
