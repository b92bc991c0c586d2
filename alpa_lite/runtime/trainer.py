"""The trainers: run a plan on the ranks of a job, one process per device.

``Trainer`` is what both plan kinds offer (``step``, ``state_dict``, ``load_state_dict``,
``gradients``, ``report``) and the code they share; ``ParallelTrainer`` runs an SPMD ``Plan``:
each rank builds only its own parameter shards, runs the captured graph on local shards with the
planned collectives (``executor.py``), back-propagates through them (each collective's dual is
explicit, ``collectives.py``), synchronizes the deferred data-parallel gradients in buckets and
updates its shards with a standard ``torch.optim`` optimizer. ``PipelineTrainer``
(``pipeline.py``) runs a ``PipelinePlan``. Launch with ``torchrun`` (or ``alpa-lite run``); gloo
on CPU, NCCL on CUDA, same code.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from ..core.capture import CapturedGraph
from ..core.options import compute_dtype_of, reduce_dtype_of
from ..core.plan import Plan, PlanError, gradient_buckets
from ..core.spec import ShardingSpec
from .collectives import COUNTS, MeshGroups, all_reduce_bucket, gather_full, local_slice
from .executor import LocalExecutor
from .init import local_constants, local_shards, store_buffer_mutations
from .launch import default_device
from .precision import LossScaler
from .report import REPORT_JSON_ENV, StepTimer, print_report, write_record


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
    return init_device_mesh(default_device().type, shape, mesh_dim_names=("axis0", "axis1"))


class Trainer:
    """Training on the ranks of a job under a plan; the interface every plan kind's trainer has.

    Attributes:
        plan: the plan executed. cg: the captured graph it runs (one microbatch's for a pipeline).
        view: the part of ``cg`` this rank holds (its stage's for a pipeline).
        params: parameter FQN -> this rank's shard (an ``nn.Parameter``); buffers: the same for
            buffers and frozen parameters.
        optimizer: the ``torch.optim`` optimizer over the local shards (None: nothing to train here).
        groups: this rank's ``MeshGroups``; buckets: its deferred gradient buckets, all-reduced
            in ``reduce_dtype`` (the plan's ``PlanOptions.reduce_dtype``; None: fp32).
        scaler: the fp16 ``LossScaler`` (``mixed_precision="fp16"``), else None.
        timer: a ``StepTimer`` when the trainer reports (``parallelize(..., report=True)``).
    """

    plan: object
    cg: CapturedGraph
    view: CapturedGraph
    groups: MeshGroups
    num_microbatches: int = 1
    timer: StepTimer | None = None

    def _build(self, model, plan: Plan, optimizer: Callable, seed: int, init_fn) -> None:
        """The state of this rank for the SPMD ``plan`` of ``self.view``: shards, constants,
        gradient buckets, the optimizer."""
        self.device = default_device()
        self.executor = LocalExecutor(self.view, plan, self.groups, self.device, seed)
        self.params, self.buffers = local_shards(model, self.view, plan, self.groups, self.device, seed, init_fn)
        self.constants = local_constants(self.cg, plan, self.groups, self.device)
        self.buckets = gradient_buckets(self.view, plan.nodes, plan.grad_sync, self.groups.shape, plan.bucket_bytes)
        self.optimizer = optimizer(list(self.params.values())) if self.params else None
        self.reduce_dtype = reduce_dtype_of(self.plan.options)
        self.scaler = LossScaler() if compute_dtype_of(self.plan.options) is torch.float16 else None

    def _local_plan(self) -> Plan:
        """This rank's SPMD plan (the whole plan, or its stage's)."""
        raise NotImplementedError

    def _spec(self, placeholder: str) -> ShardingSpec:
        return self._local_plan().nodes[placeholder].out_specs[0]

    # ---------------------------------------------------------------- a step
    def step(self, *batch, **kwargs) -> float:
        """Forward, backward and optimizer update on a global batch (the same on every rank).

        Args:
            batch: the model inputs then the targets, structured as the example inputs were
                (tensors, nested tuples / lists / dicts of them), with global shapes.
            kwargs: the model's keyword inputs, as ``example_kwargs`` were given.

        Returns:
            the loss of the whole batch (float, equal on all ranks).

        Raises:
            ValueError: the batch's structure or a tensor's shape is not the captured one.
        """
        flat = self._flat_batch(batch, kwargs)
        with self.timer.step() if self.timer is not None else nullcontext():
            for p in self.params.values():
                p.grad = None
            loss = self._train_step(flat)
            if self.scaler is not None:  # fp16: every rank skips the step on an inf / nan anywhere
                finite = self.scaler.unscale([p.grad for p in self.params.values() if p.grad is not None])
            if self.optimizer is not None and (self.scaler is None or finite):
                self.optimizer.step()
        if self.timer is not None and self.timer.report_due():
            self.report(os.environ.get(REPORT_JSON_ENV) or None)
        return loss

    def _train_step(self, flat: list[torch.Tensor]) -> float:
        """Forward and backward of the flat batch, gradients synchronized; returns the loss."""
        raise NotImplementedError

    def _flat_batch(self, batch: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The batch's tensors in ``cg.input_names`` order, checked against the captured shapes
        (a pipeline's batch dim holds ``num_microbatches`` microbatches)."""
        flat = self.cg.flat_inputs(batch, kwargs)
        for name, x in zip(self.cg.input_names, flat):
            expect = tuple(self.cg.node(name).meta["val"].shape)
            want = (expect[0] * self.num_microbatches, *expect[1:]) if expect else expect
            if tuple(x.shape) != want:
                per = f" ({self.num_microbatches} microbatches of {expect})" if self.num_microbatches > 1 else ""
                raise ValueError(f"input {name} has shape {tuple(x.shape)}, the plan was made for {want}{per}")
        return flat

    def _sync_buckets(self) -> None:
        """All-reduce the deferred data-parallel gradients, one bucket at a time (``Plan.grad_sync``)."""
        for axes, members in self.buckets:
            params = [self.params[self.view.param_fqns[ph]] for ph in members]
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            all_reduce_bucket([p.grad for p in params], axes, self.groups, self.reduce_dtype)

    def _full(self, x: torch.Tensor, placeholder: str) -> torch.Tensor:
        """The full tensor of ``placeholder`` from this rank's shard ``x``."""
        shape = tuple(self.cg.node(placeholder).meta["val"].shape)
        return gather_full(x.detach(), self._spec(placeholder), shape, self.groups)

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full (gathered) parameters and buffers by FQN, tied names included; on every rank."""
        return self._gather({**self.params, **self.buffers}, {**self.cg.param_fqns, **self.cg.buffer_fqns})

    def gradients(self) -> dict[str, torch.Tensor]:
        """Full gradients of the last step by parameter FQN (tied names included; zeros where a
        parameter got none), after their synchronization; on every rank."""
        grads = {fqn: p.grad if p.grad is not None else torch.zeros_like(p) for fqn, p in self.params.items()}
        return self._gather(grads, self.cg.param_fqns)

    def _gather(self, local: dict[str, torch.Tensor], placeholders: dict[str, str]) -> dict[str, torch.Tensor]:
        """Placeholder -> FQN of ``placeholders``: each full tensor, on every rank (``local``:
        this rank's shards by FQN)."""
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load full tensors (as ``model.state_dict()`` gives); each rank keeps its shards.

        Raises:
            KeyError: a parameter is missing (buffers missing from ``state`` keep their values:
                non-persistent buffers are not in a state dict).
        """
        with torch.no_grad():
            for ph, fqn in {**self.view.param_fqns, **self.view.buffer_fqns}.items():
                if fqn not in state and ph in self.view.buffer_fqns:
                    continue
                if fqn not in state:
                    raise KeyError(f"state dict has no {fqn!r}")
                target = self.params.get(fqn, self.buffers.get(fqn))
                target.copy_(local_slice(state[fqn], self._spec(ph), self.groups))

    # ---------------------------------------------------------------- report
    def report(self, json_path: str | Path | None = None, name: str = "", console=None, show: bool = True) -> dict:
        """Predicted vs measured step and collective times (``alpa_lite.runtime.report``); call on every rank.

        Rank 0 prints the tables (to ``console``, a rich ``Console``) unless ``show`` is False, and
        writes the record to ``json_path`` when given. ``step()`` calls this by itself once
        ``report_steps`` steps have been timed (``json_path`` from ``ALPA_LITE_REPORT_JSON``).

        Returns:
            the record of ``alpa_lite.runtime.report.make_record`` (JSON-able), on every rank.

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


class ParallelTrainer(Trainer):
    """The SPMD trainer: ``step(*batch)`` trains one step of an SPMD ``Plan`` on every rank.

    Args:
        model: the module (meta or real parameters; ``runtime.init`` semantics).
        device_mesh: the 2D torch ``DeviceMesh`` of the plan's shape.
        captured: the ``CapturedGraph`` of the model (the plan's fingerprint).
        plan: the ``Plan``.
        optimizer: ``params -> torch.optim.Optimizer`` over this rank's shards.

    Raises:
        PlanError: the plan was made for another model, other input shapes or another mesh.
    """

    def __init__(self, model, device_mesh, captured: CapturedGraph, plan: Plan, optimizer: Callable, seed: int = 0,
                 init_fn=None):
        if plan.fingerprint != captured.fingerprint():
            raise PlanError("the plan was made for another model or other input shapes "
                            f"(plan graph {plan.fingerprint}, this model {captured.fingerprint()})")
        shape = tuple(device_mesh.mesh.shape)
        if tuple(plan.mesh.shape) != shape:
            raise PlanError(f"the plan is for a {plan.mesh.shape[0]}x{plan.mesh.shape[1]} mesh, the device mesh is "
                            f"{shape[0]}x{shape[1]}")
        self.plan, self.mesh, self.cg, self.view = plan, device_mesh, captured, captured
        coord = tuple(device_mesh.get_coordinate())
        groups = tuple(device_mesh.get_group(a) for a in range(2))
        ranks = sorted(int(r) for r in device_mesh.mesh.flatten())
        flat = dist.group.WORLD if len(ranks) == dist.get_world_size() else dist.new_group(ranks)
        self.groups = MeshGroups(shape, coord, groups, flat)
        self._build(model, plan, optimizer, seed, init_fn)

    def _local_plan(self) -> Plan:
        return self.plan

    def placeholder_values(self, flat: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every placeholder's local value for the flat batch ``flat`` (``cg.input_names`` order)."""
        env = {ph: self.params[fqn] for ph, fqn in self.cg.param_fqns.items()}
        env |= {ph: self.buffers[fqn] for ph, fqn in self.cg.buffer_fqns.items()}
        env |= self.constants
        for name, x in zip(self.cg.input_names, flat):
            env[name] = local_slice(x.to(self.device), self.plan.input_specs[name], self.groups)
        return env

    def loss(self, *batch, **kwargs) -> torch.Tensor:
        """The (replicated) loss of a global batch, with the autograd graph for backward (no
        update; buffers such as batch-norm statistics are updated as in a forward)."""
        return self._loss(self._flat_batch(batch, kwargs))

    def _loss(self, flat: list[torch.Tensor]) -> torch.Tensor:
        values = self.executor.run(self.placeholder_values(flat))
        store_buffer_mutations(self.cg, self.plan, values, self.buffers, self.groups)
        return values[self.cg.loss_name]

    def _train_step(self, flat: list[torch.Tensor]) -> float:
        loss = self._loss(flat)
        (loss if self.scaler is None else loss * self.scaler.scale).backward()
        self._sync_buckets()
        return float(loss.detach())

    def _gather(self, local: dict[str, torch.Tensor], placeholders: dict[str, str]) -> dict[str, torch.Tensor]:
        out = {}
        for ph, fqn in placeholders.items():
            if fqn in local:
                out[fqn] = self._full(local[fqn], ph).cpu()
                for alias in self.cg.tied.get(fqn, []):
                    out[alias] = out[fqn]
        return out


def collective_counts() -> dict[tuple[str, str], int]:
    """Collectives issued so far in this process, by (kind, phase)."""
    return dict(COUNTS)
