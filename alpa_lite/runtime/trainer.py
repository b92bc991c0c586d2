"""``parallelize``: run a ``Plan`` as SPMD training, one process per device.

Each rank builds only its own parameter shards, runs the captured graph on local shards with the
planned collectives (``executor.py``), back-propagates through them (each collective's dual is
explicit, ``collectives.py``) and updates its shards with a standard ``torch.optim`` optimizer.
Launch with ``torchrun`` (or ``alpa-lite run``); gloo on CPU, NCCL on CUDA, same code.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from ..capture import capture
from ..launch import init_distributed
from ..mesh import LogicalMesh
from ..plan import Plan, PlanError
from ..planner import gradient_buckets, plan as make_plan
from ..report import REPORT_JSON_ENV, StepTimer, print_report, report_requested, write_record
from ..resharding import forward_steps
from ..spec import ShardingSpec
from .collectives import COUNTS, MeshGroups, all_reduce_bucket, local_slice, run_step
from .executor import LocalExecutor
from .init import local_constants, local_shards, store_buffer_mutations


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def device_mesh(mesh, world_size: int | None = None):
    """A 2D ``DeviceMesh`` from a ``DeviceMesh`` or a shape such as ``(2, 2)`` (1D shapes get a
    leading 1).

    Raises:
        ValueError: when the mesh's size differs from the world size, or it is not 1D/2D.
    """
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    world_size = dist.get_world_size() if world_size is None else world_size
    if isinstance(mesh, DeviceMesh):
        shape = tuple(mesh.mesh.shape)
        if len(shape) == 1:
            raise ValueError("pass a 2D DeviceMesh (use shape (1, n) for a 1D mesh)")
    else:
        shape = tuple(int(x) for x in mesh)
        shape = (1,) + shape if len(shape) == 1 else shape
    if len(shape) != 2:
        raise ValueError(f"alpa-lite meshes are 2D, got shape {shape}")
    if math.prod(shape) != world_size:
        raise ValueError(f"mesh {shape[0]}x{shape[1]} has {math.prod(shape)} devices but the world size is "
                         f"{world_size}; launch {math.prod(shape)} processes or change the mesh")
    if isinstance(mesh, DeviceMesh):
        return mesh
    return init_device_mesh(_device().type, shape, mesh_dim_names=("axis0", "axis1"))


class ParallelTrainer:
    """The parallel model: ``step(*batch)`` trains one step on every rank.

    Attributes:
        plan: the ``Plan`` executed. mesh: the torch ``DeviceMesh``.
        params: parameter FQN -> this rank's shard (an ``nn.Parameter``).
        optimizer: the ``torch.optim`` optimizer over the local shards.
    """

    def __init__(self, model, device_mesh, captured, plan: Plan, optimizer: Callable, seed: int, init_fn):
        self.plan, self.mesh, self.cg = plan, device_mesh, captured
        self.device = _device()
        coord = tuple(device_mesh.get_coordinate())
        groups = tuple(device_mesh.get_group(a) for a in range(2))
        ranks = sorted(int(r) for r in device_mesh.mesh.flatten())
        flat = dist.group.WORLD if len(ranks) == dist.get_world_size() else dist.new_group(ranks)
        self.groups = MeshGroups(tuple(device_mesh.mesh.shape), coord, groups, flat)
        self.buckets = gradient_buckets(captured, plan.nodes, plan.grad_sync, self.groups.shape, plan.bucket_bytes)
        self.executor = LocalExecutor(captured, plan, self.groups, self.device, seed)
        self.params, self.buffers = local_shards(model, captured, plan, self.groups, self.device, seed, init_fn)
        self.constants = local_constants(captured, plan, self.groups, self.device)
        self.optimizer = optimizer(list(self.params.values()))
        self.timer: StepTimer | None = None  # set by parallelize(..., report=True)

    # ---------------------------------------------------------------- parameters
    def _spec(self, placeholder: str) -> ShardingSpec:
        return ShardingSpec.parse(self.plan.nodes[placeholder].out_specs[0])

    def _placeholder_values(self, batch: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
        env = {ph: self.params[fqn] for ph, fqn in self.cg.param_fqns.items()}
        env |= {ph: self.buffers[fqn] for ph, fqn in self.cg.buffer_fqns.items()}
        env |= self.constants
        for name, x in zip(self.cg.input_names, self.cg.flat_inputs(batch, kwargs)):
            expect = tuple(self.cg.node(name).meta["val"].shape)
            if tuple(x.shape) != expect:
                raise ValueError(f"input {name} has shape {tuple(x.shape)}, the plan was made for {expect}")
            env[name] = local_slice(x.to(self.device), ShardingSpec.parse(self.plan.input_specs[name]), self.groups)
        return env

    # ---------------------------------------------------------------- training
    def loss(self, *batch, **kwargs) -> torch.Tensor:
        """The (replicated) loss of a global batch, with the autograd graph for backward."""
        values = self.executor.run(self._placeholder_values(batch, kwargs))
        store_buffer_mutations(self.cg, self.plan, values, self.buffers, self.groups)
        return values[self.cg.loss_name]

    def step(self, *batch, **kwargs) -> float:
        """Forward, backward and optimizer update on a global batch (the same on every rank).

        Args:
            batch: the model inputs then the targets, structured as the example inputs were
                (tensors, nested tuples / lists / dicts of them), with global shapes.
            kwargs: the model's keyword inputs, as ``example_kwargs`` were given.

        Returns:
            the loss (float, equal on all ranks).

        Raises:
            ValueError: the batch's structure or a tensor's shape is not the captured one.
        """
        with self.timer.step() if self.timer is not None else nullcontext():
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.loss(*batch, **kwargs)
            loss.backward()
            self.sync_gradients()
            self.optimizer.step()
            loss = float(loss.detach())
        if self.timer is not None and self.timer.report_due():
            self.report(os.environ.get(REPORT_JSON_ENV) or None)
        return loss

    def report(self, json_path: str | Path | None = None, name: str = "", console=None, show: bool = True) -> dict:
        """Predicted vs measured step and collective times (``alpa_lite.report``); call on every rank.

        Rank 0 prints the tables (to ``console``, a rich ``Console``) unless ``show`` is False, and
        writes the record to ``json_path`` when given. ``step()`` calls this by itself once
        ``report_steps`` steps have been timed (``json_path`` from ``ALPA_LITE_REPORT_JSON``).

        Returns:
            the record of ``alpa_lite.report.make_record`` (JSON-able), on every rank.

        Raises:
            RuntimeError: the trainer was built without ``report=True`` / ``ALPA_LITE_REPORT=1``.
            ValueError: no step was timed yet (all taken steps were warm-up).
        """
        if self.timer is None:
            raise RuntimeError("timing is off: build the trainer with parallelize(..., report=True) "
                               "or set ALPA_LITE_REPORT=1")
        record = self.timer.record(self.plan, name=name)
        if dist.get_rank() == 0:
            if show:
                print_report(record, console)
            if json_path is not None:
                write_record(record, json_path)
        return record

    def _gather(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        with torch.no_grad():
            for ph, fqn in {**self.cg.param_fqns, **self.cg.buffer_fqns}.items():
                if fqn not in local:
                    continue
                x, spec = local[fqn].detach(), self._spec(ph)
                shape = tuple(self.cg.node(ph).meta["val"].shape)
                for step in forward_steps(spec, ShardingSpec.replicated(spec.ndim), shape, x.element_size(),
                                          self.groups.shape):
                    x = run_step(x, step, self.groups, "gather")
                out[fqn] = x.cpu()
                for alias in self.cg.tied.get(fqn, []):
                    out[alias] = out[fqn]
        return out

    def sync_gradients(self) -> None:
        """All-reduce the deferred data-parallel gradients, one bucket at a time (``Plan.grad_sync``)."""
        for axes, members in self.buckets:
            params = [self.params[self.cg.param_fqns[ph]] for ph in members]
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            all_reduce_bucket([p.grad for p in params], axes, self.groups)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full (gathered) parameters and buffers by FQN, tied names included; on every rank."""
        return self._gather({**self.params, **self.buffers})

    def gradients(self) -> dict[str, torch.Tensor]:
        """Full (gathered) gradients of the last step by parameter FQN; on every rank."""
        return self._gather({k: p.grad for k, p in self.params.items() if p.grad is not None})

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load full tensors (as ``model.state_dict()`` gives); each rank keeps its shards.

        Raises:
            KeyError: a parameter is missing (buffers missing from ``state`` keep their values:
                non-persistent buffers are not in a state dict).
        """
        with torch.no_grad():
            for ph, fqn in {**self.cg.param_fqns, **self.cg.buffer_fqns}.items():
                if fqn not in state and ph in self.cg.buffer_fqns:
                    continue
                if fqn not in state:
                    raise KeyError(f"state dict has no {fqn!r}")
                target = self.params.get(fqn, self.buffers.get(fqn))
                target.copy_(local_slice(state[fqn], self._spec(ph), self.groups))


def parallelize(model: torch.nn.Module, mesh, example_inputs=(), loss_fn=None, *, targets: tuple = (),
                example_kwargs: dict | None = None,
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
        example_inputs: model inputs with GLOBAL shapes (a tensor, a tuple of them, or nested
            tuples / lists / dicts); ``targets`` follow them in a batch, and ``step`` takes the
            same structure.
        example_kwargs: keyword inputs of the model (HuggingFace's ``input_ids=``, ``labels=``);
            ``step`` takes them as keywords too.
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
            and a plan with stages returns an ``alpa_lite.pipeline.PipelineTrainer``).

    Raises:
        ValueError: the mesh does not match the world size.
        PlanError: the plan is corrupt or was made for another model or mesh.
    """
    init_distributed(timeout_s)
    dmesh = device_mesh(mesh)
    shape = tuple(dmesh.mesh.shape)
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    captured = capture(model, tuple(example_inputs), loss_fn, targets, example_kwargs)
    if plan is None:
        box = [None]
        if dist.get_rank() == 0:
            lmesh = LogicalMesh(shape, cluster=cluster or ("a100" if torch.cuda.is_available() else "cpu-gloo"))
            box[0] = make_plan(model, tuple(example_inputs), lmesh, loss_fn, targets=targets,
                               example_kwargs=example_kwargs, **plan_options).to_json()
        dist.broadcast_object_list(box, src=0)
        plan = Plan.from_json(box[0])
    elif not isinstance(plan, Plan):
        plan = Plan.from_json(plan)
    if plan.stages:  # a pipelined plan: stages on submeshes (alpa_lite.pipeline)
        from ..pipeline.executor import pipeline_trainer
        return pipeline_trainer(model, tuple(example_inputs), loss_fn, targets, plan, optimizer, seed, init_fn,
                                timeout_s, example_kwargs)
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


def collective_counts() -> dict[tuple[str, str], int]:
    """Collectives issued so far in this process, by (kind, phase)."""
    return dict(COUNTS)
