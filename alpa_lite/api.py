"""The public entry points: ``plan`` (compiler only) and ``parallelize`` (compiler, then runtime).

This module is the one place that joins the compiler (``alpa_lite.compiler``: plan a captured
model) and the runtime (``alpa_lite.runtime``: execute a plan on the ranks of a job); neither
imports the other (docs/architecture.md).
"""
from __future__ import annotations

import datetime
import gc
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from .compiler.ilp import MemoryBudgetError
from .compiler.inter_op import plan_pipeline
from .compiler.intra_op import plan_intra_op
from .compiler.loss_reduction import check_batch_indices, whole_batch_problems
from .compiler.plan_cache import PlanCache, capture_cached
from .compiler.stage_dp import PipelinePlanError
from .core.capture import CaptureError, CapturedGraph, batch_size, capture, check_microbatch_rows, rows
from .core.mesh import LogicalMesh
from .core.options import PipelineOptions, PlanOptions, compute_dtype_of, split_options
from .core.plan import PipelinePlan, Plan, PlanError, load_plan
from .runtime.launch import init_distributed
from .runtime.pipeline import PipelineTrainer
from .runtime.report import StepTimer, report_requested
from .runtime.trainer import ParallelTrainer, device_mesh


@contextmanager
def _fewer_gc_passes(young_objects: int = 100_000, full_after: int = 100):
    """Planning allocates millions of short-lived objects (export's fx nodes and fake tensors,
    strategy tables, ILP rows) that reference counting frees; CPython's cyclic collector would
    also scan the young generation every 700 allocations: ~9 % of the CPU time of planning GPT-3
    2.6B on 2x4 (docs/plan_time.md). Inside, a young-generation pass waits for ``young_objects``
    allocations, and a full pass for ``full_after`` passes of the middle generation (CPython's
    default: 10). A full pass scans every object of the process (330,000 before GPT-3 2.6B's plan:
    torch's modules, the model): one ran in each plan of it measured, 0.22-0.29 s, and freed 20
    objects; the garbage cycles planning makes (export's) die young, in the middle generation's
    passes. The thresholds are restored after."""
    before = gc.get_threshold()
    gc.set_threshold(young_objects, before[1], full_after)
    try:
        yield
    finally:
        gc.set_threshold(*before)


@_fewer_gc_passes()
def plan(model: torch.nn.Module, example_inputs, mesh: LogicalMesh, loss_fn=None, *, targets: tuple = (),
         example_kwargs: dict | None = None, options: PlanOptions | None = None,
         pipeline: PipelineOptions | str | int | None = None, progress=None, cache: str | Path | None = None,
         **option_fields) -> Plan | PipelinePlan:
    """Plan the training step of ``model`` on ``mesh``: the intra-operator sharding plan that
    minimizes the predicted step time (Alpa, OSDI'22, section 4), or with ``pipeline`` a
    pipelined plan: stages on submeshes of the cluster ``mesh`` (N nodes x M devices), each with
    its own intra-op plan (section 5).

    Args:
        model: the module (parameters may be on the meta device).
        example_inputs: model inputs with GLOBAL shapes: a tensor, a tuple of them, or nested
            tuples / lists / dicts (flattened as ``torch.export`` flattens them).
        mesh: the logical mesh (``LogicalMesh``), real or only described.
        loss_fn: ``loss_fn(output, *targets) -> scalar``; None when the model returns its loss.
        targets: tensors passed to ``loss_fn`` after the output.
        example_kwargs: keyword inputs of the model (``input_ids=``, ``labels=`` ...).
        options: ``PlanOptions`` (memory budget, forced specs, batch axis, solver ...); they apply
            to every stage of a pipelined plan too.
        pipeline: ``None`` (no pipeline), ``"auto"``, a stage count ``K`` or ``PipelineOptions``.
        progress: ``progress(stage: str)`` called as planning advances.
        cache: a directory (created if missing) keeping ILP answers and the captured graph between
            runs: planning the same model again with other pipeline options reuses the answers, at
            another batch size or microbatch count the graph (no torch.export), and the plan is the
            one planned without it (docs/planner.md, "Re-planning"); ``plan.stats["disk_hits"]``
            counts the answers read, ``plan.stats["graph_hits"]`` the graphs.
        option_fields: fields of ``PlanOptions`` or ``PipelineOptions`` given as keywords
            (``force_data_parallel=True``, ``param_specs={...}``, ``num_microbatches=4`` ...);
            a ``PipelineOptions`` field turns the pipeline on.

    Returns:
        a ``Plan``, or a ``PipelinePlan`` when pipelined; its ``captured`` is the graph planned.

    Raises:
        CaptureError: the model could not be captured (the message names the construct or op).
        TypeError: an unknown option keyword (the message lists the fields).
        ValueError: an option out of range, or naming something the model does not have (a forced
            spec that does not divide its tensor, an input spec for no input ...); with a pipeline, a
            tensor input whose dim 0 is not the batch (``check_microbatch_rows``), or an index into
            the batch's rows read from an input (``compiler.loss_reduction.check_batch_indices``).
        MemoryBudgetError / PipelinePlanError: nothing fits (the message gives the minimum needed
            or the limits).
    """
    options, pipe = split_options(options, pipeline, option_fields)
    say = progress or (lambda stage: None)
    cache = PlanCache(cache) if cache is not None else None
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    targets = tuple(targets)
    if pipe is not None:
        check_microbatch_rows(inputs, targets, example_kwargs, "a pipeline's microbatches")
        batch = batch_size((inputs, example_kwargs))
        def whole() -> CapturedGraph | None:  # None: the cache's graph for any batch answered (the same ops)
            return None if cache is not None and cache.graph_hits else \
                capture(model, inputs, loss_fn, targets, example_kwargs, options.compute_dtype)

        result = plan_pipeline(lambda n: _capture_rows(model, inputs, loss_fn, targets, example_kwargs, n,
                                                       options.compute_dtype, cache), batch, mesh,
                               options, pipe, progress=progress, cache=cache, capture_batch=whole)
    else:
        t0 = time.perf_counter()
        say("capture")
        cg = capture_cached(cache, model, inputs, loss_fn, targets, example_kwargs, options.compute_dtype)
        capture_s = time.perf_counter() - t0
        result = plan_intra_op(cg, mesh, options, progress, cache)
        result.stats |= {"capture_s": capture_s, "total_s": time.perf_counter() - t0}
    result.stats["graph_hits"] = cache.graph_hits if cache is not None else 0
    return result


def parallelize(model: torch.nn.Module, mesh, example_inputs=(), loss_fn=None, *, targets: tuple = (),
                example_kwargs: dict | None = None, optimizer: Callable | None = None,
                plan: Plan | PipelinePlan | str | Path | None = None, seed: int = 0, init_fn: Callable | None = None,
                cluster: str | None = None, timeout_s: float | None = None, report: bool | None = None,
                report_warmup: int = 2, report_steps: int | None = 5, options: PlanOptions | None = None,
                pipeline: PipelineOptions | str | int | None = None, accumulate: int = 1,
                max_grad_norm: float | None = None, compile: bool | str = False,
                **option_fields) -> ParallelTrainer | PipelineTrainer:
    """Parallelize training of ``model`` over ``mesh`` (call on every rank).

    Rank 0 plans (unless ``plan`` is given) and broadcasts the plan; a planning error on rank 0
    is raised on every rank. Each rank captures the model once (rank 0 executes the graph it
    planned).

    Args:
        model: the module. On the meta device its parameters are initialized shard by shard
            (``init_parameters`` semantics: ``reset_parameters`` or ``init_fn``, seeded by
            ``seed`` and module name); otherwise its weights are sliced.
        mesh: a 2D torch ``DeviceMesh``, or a shape such as ``(2, 2)`` for the current world.
        example_inputs: model inputs with GLOBAL shapes (a tensor, a tuple of them, or nested
            tuples / lists / dicts); ``targets`` follow them in a batch, and ``step`` takes the
            same structure.
        example_kwargs: keyword inputs of the model (HuggingFace's ``input_ids=``, ``labels=``);
            ``step`` takes them as keywords too.
        loss_fn: ``loss_fn(output, *targets)``; None when the model returns its loss.
        optimizer: ``params -> torch.optim.Optimizer``; default AdamW(lr=1e-3).
        plan: a ``Plan`` / ``PipelinePlan``, a plan JSON path, or None to plan here.
        cluster: preset or cluster file for planning (default ``cpu-gloo`` on CPU, ``a100`` on CUDA).
        timeout_s: collective timeout, seconds (a dead peer fails the step instead of hanging), of
            the default process group and of every group the trainer makes; None: the default
            group's (120 s when ``parallelize`` creates it: ``init_distributed``).
        report: time every step after ``report_warmup`` warm-up steps, and the collectives in it,
            for ``trainer.report()`` (predicted vs measured); None: on when the environment
            variable ``ALPA_LITE_REPORT`` is ``1`` (``alpa-lite run --report``). The report
            prints by itself after ``report_steps`` timed steps (None: only when asked).
        options, pipeline, option_fields: as ``alpa_lite.plan``; a pipelined plan returns a
            ``PipelineTrainer`` (the same interface).
        accumulate: gradient accumulation over ``K`` microbatches (SPMD plans): the plan is made
            for one microbatch (the first ``batch / K`` rows of the example), and ``step`` takes
            the whole batch, runs its ``K`` microbatches one after the other, then synchronizes
            the gradients once and updates once; the loss and gradients are the whole batch's
            (a token mean over valid targets weighs each microbatch by its count). A pipelined
            plan accumulates over its own microbatches: raise ``num_microbatches`` instead.
        max_grad_norm: clip the gradients to this global L2 norm before every update
            (``Trainer.clip_grad_norm_``); None: no clipping.
        compile: run each rank's step as its plan lowered to ``torch.fx.GraphModule`` s (local
            shapes, functional collectives) under ``torch.compile``: True for the ``"inductor"``
            backend, or a backend name such as ``"aot_eager"`` (``runtime/program.py``). An SPMD
            plan's microbatch is one graph; a pipeline stage's forward and backward are two (AOT
            autograd), the schedule and the transfers between stages staying in the runtime.
            False: the interpreter.

    Raises:
        ValueError: the mesh does not match the world size, or an option is invalid (``accumulate``
            with a pipelined plan, or one that does not divide the batch, or microbatches with a
            tensor input whose dim 0 is not the batch: ``check_microbatch_rows``, or with an index into
            the batch's rows read from an input: ``check_batch_indices``; ``compile`` with the
            ZB-H1 schedule, or a plan with in-place writes to stored tensors).
        PlanError: the plan is corrupt or was made for another model or mesh.
    """
    if plan is not None and not isinstance(plan, (Plan, PipelinePlan)):
        plan = load_plan(plan)
    init_distributed(120.0 if timeout_s is None else timeout_s)
    if timeout_s is not None:  # the default group existed before, with a timeout of its own
        dist.group.WORLD.set_timeout(datetime.timedelta(seconds=timeout_s))
    dmesh = device_mesh(mesh)
    shape = tuple(dmesh.mesh.shape)
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    targets = tuple(targets)
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be a positive norm, got {max_grad_norm!r}")
    cut = nullcontext()
    if accumulate != 1:
        planned, pipe = split_options(options, pipeline, option_fields)
        whole = (inputs, targets, example_kwargs)
        inputs, targets, example_kwargs = _accumulation_rows(inputs, targets, example_kwargs, accumulate, plan, pipe)
        cut = _microbatch_capture(model, whole[0], loss_fn, whole[1], whole[2], batch_size((inputs, example_kwargs)),
                                  planned.compute_dtype if plan is None else compute_dtype_of(plan.options))
    with cut:
        if plan is None:
            plan = _plan_on_rank_zero(model, inputs, shape, loss_fn, targets, example_kwargs, cluster, options,
                                      pipeline, option_fields)
        compute_dtype = compute_dtype_of(plan.options)  # what the plan was captured with
        if not isinstance(plan, PipelinePlan):
            captured = plan.captured or capture(model, inputs, loss_fn, targets, example_kwargs, compute_dtype)
            if accumulate != 1:  # a branch on the batch size: each microbatch runs the branch of its own size
                check_batch_indices(captured, f"accumulate={accumulate}")
                full = capture(model, whole[0], loss_fn, whole[1], whole[2], compute_dtype)
                more = whole_batch_problems(full, captured, batch_size((whole[0], whole[2])),
                                            batch_size((inputs, example_kwargs)), plan.loss_reduction.problems)
                if more:  # (the trainer warns with the plan's own)
                    warnings.warn(f"accumulating {accumulate} microbatches changes the loss: {'; '.join(more)}",
                                  stacklevel=2)
    optimizer = optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-3))
    if isinstance(plan, PipelinePlan):
        check_microbatch_rows(inputs, targets, example_kwargs, "a pipeline's microbatches")
        batch = batch_size((inputs, example_kwargs))
        if batch % plan.num_microbatches:
            raise PlanError(f"the plan splits the batch into {plan.num_microbatches} microbatches; the example "
                            f"batch is {batch}")
        n = batch // plan.num_microbatches
        captured = plan.captured or _capture_rows(model, inputs, loss_fn, targets, example_kwargs, n, compute_dtype)
        if plan.num_microbatches > 1:  # a plan made elsewhere: planning refuses these
            check_batch_indices(captured, f"{plan.num_microbatches} microbatches")
        trainer = PipelineTrainer(model, captured, plan, optimizer, seed, init_fn, compile)
    else:
        trainer = ParallelTrainer(model, dmesh, captured, plan, optimizer, seed, init_fn, accumulate, compile)
    if report_requested(report):
        trainer.timer = StepTimer(report_warmup, report_steps)
    trainer.max_grad_norm = max_grad_norm
    return trainer


def _accumulation_rows(inputs: tuple, targets: tuple, example_kwargs, accumulate, plan, pipe) -> tuple:
    """The example's first microbatch ``(inputs, targets, example_kwargs)`` for gradient
    accumulation over ``accumulate`` microbatches.

    Raises:
        ValueError: ``accumulate`` is not a positive integer dividing the batch, the plan is
            pipelined (given, or asked for by ``pipe``), or a tensor input's dim 0 is not the batch.
    """
    if not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"accumulate must be a positive number of microbatches, got {accumulate!r}")
    if isinstance(plan, PipelinePlan) or pipe is not None:
        raise ValueError("accumulate applies to SPMD plans; a pipelined plan already accumulates gradients over "
                         "its microbatches: raise num_microbatches instead")
    check_microbatch_rows(inputs, targets, example_kwargs, f"accumulate={accumulate}")
    batch = batch_size((inputs, example_kwargs))
    if batch % accumulate:
        raise ValueError(f"accumulate={accumulate} does not divide the example batch of {batch}")
    n = batch // accumulate
    return rows(inputs, 0, n), rows(targets, 0, n), rows(example_kwargs, 0, n)


def _capture_rows(model, inputs: tuple, loss_fn, targets: tuple, example_kwargs, n: int,
                  compute_dtype: torch.dtype | None, cache: PlanCache | None = None) -> CapturedGraph:
    """The captured graph of a microbatch: the first ``n`` samples of every batched input (from
    ``cache`` when it keeps the model's graph for any batch size).

    Raises:
        CaptureError: as ``capture``; naming the cut (``_microbatch_capture``) when only the
            microbatch fails."""
    with _microbatch_capture(model, inputs, loss_fn, targets, example_kwargs, n, compute_dtype):
        return capture_cached(cache, model, rows(inputs, 0, n), loss_fn, rows(targets, 0, n),
                              rows(example_kwargs, 0, n), compute_dtype)


@contextmanager
def _microbatch_capture(model, inputs: tuple, loss_fn, targets: tuple, example_kwargs, n: int,
                        compute_dtype: torch.dtype | None):
    """Around capturing (or planning) the microbatch of the first ``n`` rows of the batch
    ``inputs`` / ``targets`` / ``example_kwargs``: a ``CaptureError`` raised inside, when the whole
    batch captures, is raised as one that names the cut. Microbatches cut dim 0 of every tensor
    input (``rows``), also one that is not batched but whose dim 0 equals the batch by chance
    (position ids of shape ``(T,)``, one ``(T, T)`` mask, with ``T`` the batch size), which
    ``check_microbatch_rows`` cannot tell from a batched one; the microbatch's capture then died
    deep in torch ("Attempting to broadcast a dimension of length 4")."""
    try:
        yield
    except CaptureError as e:
        batch = batch_size((inputs, example_kwargs))
        try:
            capture(model, inputs, loss_fn, targets, example_kwargs, compute_dtype)
        except Exception:  # noqa: BLE001 - the whole batch fails too: not the cut's doing
            whole = False
        else:
            whole = True
        if not whole or n == batch:
            raise
        raise CaptureError(f"the model captures with the whole batch of {batch} but not with a microbatch of its "
                           f"first {n} rows: microbatches cut dim 0 of every tensor input, also of an input that is "
                           f"not batched whose dim 0 is {batch} by chance (position ids of shape (T,), one (T, T) "
                           f"mask, with T = {batch}); give such a tensor to the model as a buffer or attribute, or "
                           f"expand it to the batch. The microbatch's capture said: {e}") from e


_ERRORS = (ValueError, TypeError, PlanError, CaptureError, MemoryBudgetError, PipelinePlanError)


def _plan_on_rank_zero(model, inputs, mesh_shape, loss_fn, targets, example_kwargs, cluster, options, pipeline,
                       option_fields) -> Plan | PipelinePlan:
    """Rank 0 plans on the job's mesh and broadcasts the plan (JSON) or its error; every rank
    returns the plan (rank 0's keeps its captured graph) or raises the error."""
    box: list = [None]
    result = None
    if dist.get_rank() == 0:
        try:
            lmesh = LogicalMesh(mesh_shape, cluster=cluster or ("a100" if torch.cuda.is_available() else "cpu-gloo"))
            result = plan(model, inputs, lmesh, loss_fn, targets=targets, example_kwargs=example_kwargs,
                          options=options, pipeline=pipeline, **option_fields)
            box[0] = ("plan", result.to_json())
        except Exception as e:  # noqa: BLE001 - every rank raises it below
            box[0] = ("error", type(e).__name__, str(e))
            dist.broadcast_object_list(box, src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    if box[0][0] == "error":
        _, kind, message = box[0]
        error = {e.__name__: e for e in _ERRORS}.get(kind, RuntimeError)
        raise error(f"planning on rank 0 failed: {kind}: {message}")
    return result if result is not None else load_plan(box[0][1])
