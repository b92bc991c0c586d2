"""The public entry points: ``plan`` (compiler only) and ``parallelize`` (compiler, then runtime).

This module is the one place that joins the compiler (``alpa_lite.compiler``: capture a model and
plan it) and the runtime (``alpa_lite.runtime``: execute a plan on the ranks of a job); neither
imports the other (``docs/architecture.md``).
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from .compiler.planner import plan as intra_op_plan
from .compiler.stages import plan_pipeline
from .core.capture import capture
from .core.mesh import LogicalMesh
from .core.plan import Plan, PlanError
from .runtime.launch import init_distributed
from .runtime.pipeline import pipeline_trainer
from .runtime.report import StepTimer, report_requested
from .runtime.trainer import ParallelTrainer, device_mesh


def plan(model: torch.nn.Module, example_inputs, mesh: LogicalMesh, loss_fn=None, *, targets: tuple = (),
         memory_budget: float | None = None, force_data_parallel: bool = False, batch_axis: int | None = None,
         param_specs: dict[str, str] | None = None, input_specs: dict[str, str] | None = None,
         share_layers: bool = True, time_limit: float = 60.0, solver: str = "cbc", bucket_bytes: float = 25 * 2**20,
         progress=None, pipeline: str | int | None = None, num_stages: int | None = None, schedule: str = "1f1b",
         num_microbatches: int | None = None, num_layers: int | None = None) -> Plan:
    """Find the intra-operator sharding plan that minimizes the predicted training-step time.

    With ``pipeline="auto"`` (or a stage count ``K``, or ``num_stages=K``) the plan is pipelined
    instead: stages on submeshes of the cluster ``mesh`` (N nodes x M devices), each with its own
    intra-op plan (``stages.plan_pipeline``; Alpa, section 5); ``memory_budget``,
    ``progress``, ``time_limit``, ``param_specs``, ``batch_axis`` and ``force_data_parallel``
    apply to every stage, ``schedule`` is ``"1f1b"`` or ``"gpipe"``, ``num_microbatches`` B
    (None: chosen), ``num_layers`` L for the layer clustering (None: chosen).

    Args:
        model: the module (parameters may be on the meta device).
        example_inputs: tuple of model inputs with GLOBAL shapes.
        mesh: the logical mesh (``LogicalMesh``), real or only described.
        loss_fn: ``loss_fn(output, *targets) -> scalar``; None when the model returns its loss.
        targets: tensors passed to ``loss_fn`` after the output.
        memory_budget: bytes per device (default: ``mesh.memory_bytes``).
        force_data_parallel: every parameter replicated, inputs split by batch over the mesh.
        batch_axis: force the inputs' batch dim (dim 0) to be split along this mesh axis.
        param_specs: FQN -> spec string to force (e.g. Megatron's ``{"fc1.weight": "S1R"}``).
        input_specs: user-input placeholder name (or position ``"0"``, ``"1"``...) -> spec string.
        share_layers: identical repeated layers share one solution (smaller ILP).
        time_limit: ILP solver seconds.
        bucket_bytes: the largest bucket of data-parallel gradients all-reduced together, bytes.
        progress: callable ``progress(stage: str)`` called as planning advances.

    Returns:
        the ``Plan``.

    Raises:
        CaptureError: the model could not be captured.
        ValueError: a forced spec does not divide its tensor, or names no parameter.
        MemoryBudgetError: nothing fits the budget (the message gives the minimum needed).
    """
    if pipeline is not None or num_stages is not None:
        if pipeline not in (None, "auto") and num_stages is None:
            if not str(pipeline).isdigit():
                raise ValueError(f"pipeline must be 'auto' or a number of stages, got {pipeline!r}")
            num_stages = int(pipeline)
        constraints = {"param_specs": param_specs, "batch_axis": "all" if force_data_parallel else batch_axis,
                       "replicate_params": force_data_parallel}
        return plan_pipeline(model, example_inputs, mesh, loss_fn, targets=targets, num_stages=num_stages,
                             schedule=schedule, num_microbatches=num_microbatches, num_layers=num_layers,
                             memory_budget=memory_budget, progress=progress, time_limit=time_limit,
                             constraints={k: v for k, v in constraints.items() if v is not None and v is not False})
    return intra_op_plan(model, example_inputs, mesh, loss_fn, targets=targets, memory_budget=memory_budget,
                     force_data_parallel=force_data_parallel, batch_axis=batch_axis, param_specs=param_specs,
                     input_specs=input_specs, share_layers=share_layers, time_limit=time_limit, solver=solver,
                     bucket_bytes=bucket_bytes, progress=progress)


def parallelize(model: torch.nn.Module, mesh, example_inputs, loss_fn=None, *, targets: tuple = (),
                optimizer: Callable | None = None, plan: Plan | str | Path | None = None, seed: int = 0,
                init_fn: Callable | None = None, cluster: str | None = None, timeout_s: float = 120.0,
                report: bool | None = None, report_warmup: int = 2, report_steps: int | None = 5,
                **plan_options) -> ParallelTrainer:
    """Parallelize training of ``model`` over ``mesh`` (call on every rank).

    Args:
        model: the module. On the meta device its parameters are initialized shard by shard
            (``init_parameters`` semantics: ``reset_parameters`` or ``init_fn``, seeded by
            ``seed`` and module name); otherwise its weights are sliced.
        mesh: a 2D torch ``DeviceMesh``, or a shape such as ``(2, 2)`` for the current world.
        example_inputs: model inputs with GLOBAL shapes; ``targets`` follow them in a batch.
        loss_fn: ``loss_fn(output, *targets)``; None when the model returns its loss.
        optimizer: ``params -> torch.optim.Optimizer``; default AdamW(lr=1e-3).
        plan: a ``Plan``, a plan JSON path, or None to plan here (rank 0 plans and broadcasts).
        cluster: preset or cluster file for planning (default ``cpu-gloo`` on CPU, ``a100`` on CUDA).
        timeout_s: collective timeout, seconds (a dead peer fails the step instead of hanging).
        report: time every step after ``report_warmup`` warm-up steps, and the collectives in it,
            for ``trainer.report()`` (predicted vs measured); None: on when the environment
            variable ``ALPA_LITE_REPORT`` is ``1`` (``alpa-lite run --report``). The report
            prints by itself after ``report_steps`` timed steps (None: only when asked).
        plan_options: passed to ``alpa_lite.plan`` (``force_data_parallel``, ``param_specs`` ...;
            ``pipeline="auto" | K``, ``num_stages``, ``schedule``, ``num_microbatches`` plan a pipeline,
            and a plan with stages returns an ``alpa_lite.runtime.pipeline.PipelineTrainer``).

    Raises:
        ValueError: the mesh does not match the world size.
        PlanError: the plan is corrupt or was made for another model or mesh.
    """
    init_distributed(timeout_s)
    dmesh = device_mesh(mesh)
    shape = tuple(dmesh.mesh.shape)
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    captured = capture(model, tuple(example_inputs), loss_fn, targets)
    if plan is None:
        box = [None]
        if dist.get_rank() == 0:
            lmesh = LogicalMesh(shape, cluster=cluster or ("a100" if torch.cuda.is_available() else "cpu-gloo"))
            box[0] = _plan(model, tuple(example_inputs), lmesh, loss_fn, targets=targets, **plan_options).to_json()
        dist.broadcast_object_list(box, src=0)
        plan = Plan.from_json(box[0])
    elif not isinstance(plan, Plan):
        plan = Plan.from_json(plan)
    if plan.stages:  # a pipelined plan: stages on submeshes (alpa_lite.runtime.pipeline)
        return pipeline_trainer(model, tuple(example_inputs), loss_fn, targets, plan, optimizer, seed, init_fn,
                                timeout_s)
    if plan.fingerprint != captured.fingerprint():
        raise PlanError("the plan was made for another model or other input shapes "
                        f"(plan graph {plan.fingerprint}, this model {captured.fingerprint()})")
    if tuple(plan.mesh.shape) != shape:
        raise PlanError(f"the plan is for a {plan.mesh.shape[0]}x{plan.mesh.shape[1]} mesh, the device mesh is "
                        f"{shape[0]}x{shape[1]}")
    optimizer = optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-3))
    trainer = ParallelTrainer(model, dmesh, captured, plan, optimizer, seed, init_fn)
    if report_requested(report):
        trainer.timer = StepTimer(report_warmup, report_steps)
    return trainer


_plan = plan  # ``parallelize``'s argument ``plan`` shadows the function
