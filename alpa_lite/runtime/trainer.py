"""The trainers: run a plan on the ranks of a job, one process per device.

``Trainer`` is what both plan kinds offer (``step``, ``state_dict``, ``load_state_dict``,
``gradients``, ``clip_grad_norm_``, ``save`` / ``load`` / ``save_full``, ``report``) and the code
they share; ``ParallelTrainer`` runs an SPMD ``Plan``:
each rank builds only its own parameter shards, runs the captured graph on local shards with the
planned collectives (``executor.py``), back-propagates through them (each collective's dual is
explicit, ``collectives.py``), synchronizes the deferred data-parallel gradients in buckets (each started during backward once
its gradients are ready, ``grad_sync.py``) and
updates its shards with a standard ``torch.optim`` optimizer. ``PipelineTrainer``
(``pipeline.py``) runs a ``PipelinePlan``. Launch with ``torchrun`` (or ``alpa-lite run``); gloo
on CPU, NCCL on CUDA, same code.
"""
from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from ..core.capture import CapturedGraph
from ..core.options import compute_dtype_of, reduce_dtype_of
from ..core.plan import Plan, PlanError, gradient_buckets
from ..core.spec import ShardingSpec
from . import checkpoint
from .collectives import COUNTS, MeshGroups, finish_gradients, gather_full, local_slice, wait_all_gathers
from .executor import DeferredLoss, LocalExecutor
from .grad_sync import BucketSync
from .init import local_constants, local_shards, store_buffer_mutations
from .launch import default_device, job_timeout
from .precision import LossScaler
from .program import RankProgram
from .report import REPORT_JSON_ENV, StepTimer, print_report, write_record
from .zero import ZeroPartition, build_optimizer


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
            in ``reduce_dtype`` (the plan's ``PlanOptions.reduce_dtype``; None: fp32);
            bucket_sync: their all-reduces and ZeRO-2 reduce-scatters (``grad_sync.BucketSync``).
        zero: its ``ZeroPartition`` (the optimizer's slices of ZeRO-1/2 parameters).
        overlap: start each bucket's all-reduce during backward as soon as its gradients are
            ready (default); False: all of them after backward (the plain step, for debugging).
        scaler: the fp16 ``LossScaler`` (``mixed_precision="fp16"``), else None.
        timer: a ``StepTimer`` when the trainer reports (``parallelize(..., report=True)``).
        max_grad_norm: when set, ``step`` clips the gradients to this global norm
            (``clip_grad_norm_``) before the optimizer update; last_grad_norm: then the global
            norm of the last step's gradients before clipping (float; None before).
        num_microbatches: microbatches of a step's batch along dim 0 (a pipeline's, or the
            gradient accumulation steps of an SPMD plan); the plan is made for one of them.
    """

    plan: object
    cg: CapturedGraph
    view: CapturedGraph
    groups: MeshGroups
    num_microbatches: int = 1
    timer: StepTimer | None = None
    max_grad_norm: float | None = None
    last_grad_norm: float | None = None
    overlap: bool = True
    buckets_in_program: bool = False  # the all-reduce buckets are summed by the compiled program

    def _build(self, model, plan: Plan, optimizer: Callable, seed: int, init_fn) -> None:
        """The state of this rank for the SPMD ``plan`` of ``self.view``: shards, constants,
        gradient buckets, the optimizer."""
        self.device = default_device()
        self.executor = LocalExecutor(self.view, plan, self.groups, self.device, seed)
        self.params, self.buffers = local_shards(model, self.view, plan, self.groups, self.device, seed, init_fn)
        self.constants = local_constants(self.cg, plan, self.groups, self.device)
        self.buckets = gradient_buckets(self.view, plan.nodes, plan.grad_sync, self.groups.shape, plan.bucket_bytes)
        self.reduce_dtype = reduce_dtype_of(self.plan.options)
        self.scaler = LossScaler() if compute_dtype_of(self.plan.options) is torch.float16 else None
        self.zero = ZeroPartition(self.view, plan, self.params, self.groups)
        self.bucket_sync = BucketSync(self.buckets, {ph: self.params[fqn] for ph, fqn in self.view.param_fqns.items()},
                                      self.groups, self.reduce_dtype, self.zero, self.view.param_fqns,
                                      in_program=self.buckets_in_program)
        self._placeholders = {fqn: ph for ph, fqn in {**self.view.param_fqns, **self.view.buffer_fqns}.items()}
        self.optimizer = build_optimizer(optimizer, [self.zero], model, self._local_state) if self.params else None
        # the buffers the model's own state_dict() leaves out (register_buffer(..., persistent=False): LLaMA's RoPE
        # inv_freq): state_dict() and save_full leave them out too, or the model refuses its own export
        self.non_persistent = ({k for k, _ in model.named_buffers(remove_duplicate=False)}
                               - set(model.state_dict(keep_vars=True)))

    def _local_plan(self) -> Plan:
        """This rank's SPMD plan (the whole plan, or its stage's)."""
        raise NotImplementedError

    def _spec(self, placeholder: str) -> ShardingSpec:
        return self._local_plan().nodes[placeholder].out_specs[0]

    def _local_state(self, fqn: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of ``full``, a tensor shaped like parameter ``fqn`` (an optimizer state
        made for the model's own parameter: ``build_optimizer``)."""
        self._select(fqn)
        return local_slice(full.detach(), self._spec(self._placeholders[fqn]), self.groups).to(self.device).clone()

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
            # a backward run outside ``step`` (``self.loss(...).backward()``) may have left ZeRO-3
            # group reduce-scatters in flight: they land in the gradients dropped here, not in this step's
            finish_gradients()
            for p in self.params.values():
                p.grad = None
            loss = self._train_step(flat)
            wait_all_gathers()
            finite = True
            if self.scaler is not None:  # fp16: every rank skips the step on an inf / nan anywhere
                finite = self.scaler.unscale([h.grad for _, h, _ in self._gradient_holders() if h.grad is not None])
            if self.max_grad_norm is not None:
                self.last_grad_norm = float(self.clip_grad_norm_(self.max_grad_norm))
            if self.optimizer is not None and finite:
                self.optimizer.step()
                for zero in self._zero_partitions():
                    zero.gather()
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

    def _microbatch(self, flat: list[torch.Tensor], mb: int) -> list[torch.Tensor]:
        """Microbatch ``mb`` of the flat batch: rows ``[mb n, (mb + 1) n)`` of every batched input."""
        return [x[mb * (x.shape[0] // self.num_microbatches):(mb + 1) * (x.shape[0] // self.num_microbatches)]
                if x.dim() else x for x in flat]

    def _loss_weight(self, values: dict) -> torch.Tensor:
        """``w_m`` of a microbatch's loss (``pipeline.py``'s module docstring): the denominator of a
        token mean over valid targets (``LossReduction`` kind ``"ratio"``), else 1; 0-dim, detached."""
        reduction = self.plan.loss_reduction
        if reduction.kind != "ratio":
            return torch.ones(())
        name = reduction.denominator
        return self.executor.denominators.get(name, values.get(name)).detach()

    def _sync_buckets(self, divisor: torch.Tensor | None = None) -> set[int]:
        """Finish the gradients' synchronization: the ZeRO-3 groups' reduce-scatters started
        during backward (``collectives.finish_gradients``), then the deferred data-parallel
        buckets (``Plan.grad_sync``): the all-reduces / ZeRO-2 reduce-scatters the hooks started
        during backward, then the rest (``grad_sync.BucketSync``); the all-reduce buckets' sums
        written into the gradients divided by ``divisor`` (0-dim) when given. Returns the
        ``id`` s of the parameters whose gradients were so divided."""
        finish_gradients()
        divided = self.bucket_sync.finish(divisor)
        self.zero.slice_gradients()
        return divided

    def _zero_partitions(self) -> list[ZeroPartition]:
        """This rank's ``ZeroPartition`` of each of its SPMD plans (a pipeline rank's: one per chunk)."""
        return [self.zero]

    def zero_of(self, fqn: str) -> ZeroPartition:
        """The ``ZeroPartition`` holding parameter ``fqn`` of this rank."""
        self._select(fqn)
        return self.zero

    def _full(self, x: torch.Tensor, placeholder: str) -> torch.Tensor:
        """The full tensor of ``placeholder`` from this rank's shard ``x``: a new tensor, also where
        the shard is whole (a replicated weight, whose state dict entry was the weight itself and
        moved with every later step)."""
        shape = tuple(self.cg.node(placeholder).meta["val"].shape)
        full = gather_full(x.detach(), self._spec(placeholder), shape, self.groups)
        return full.clone() if full.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() else full

    def executors(self) -> list:
        """This rank's ``LocalExecutor`` objects (a pipeline rank's: one per stage it holds); their
        ``seed`` and ``calls`` place the random ops' stream (``LocalExecutor.shard_seed``)."""
        return [self.executor]

    # ---------------------------------------------------------------- clipping
    def _select(self, fqn: str) -> None:
        """Make the state that holds parameter / buffer ``fqn`` the current one (a pipeline rank's
        chunk; nothing for an SPMD plan)."""

    def owns(self, fqn: str) -> bool:
        """Whether this rank's copy of parameter / buffer ``fqn`` is the one counted in the global
        gradient norm and written to a checkpoint (a pipeline's weight held by several stages:
        the first stage's)."""
        return True

    def _job_group(self):
        """The process group of every rank of the plan."""
        return dist.group.WORLD

    def _gradient_holders(self) -> list[tuple[str, torch.Tensor, set[int]]]:
        """``(fqn, tensor, copies)`` of every parameter whose ``tensor.grad`` holds its gradient
        after the synchronization: the local shard, or for a ZeRO-2 parameter the optimizer's
        slice; ``copies``: how many ranks of its mesh hold the same one (the product of the mesh
        axes that neither split nor partition it)."""
        holders = []
        for fqn, param in self.params.items():
            zero = self.zero_of(fqn)  # the chunk holding fqn made current
            split = self._spec(self._placeholders[fqn]).axes()
            stage, zero_axes = zero.stages.get(fqn, (0, ()))
            if stage == 2:
                param, split = zero.slices[fqn], split | set(zero_axes)
            holders.append((fqn, param, math.prod(s for a, s in enumerate(self.groups.shape) if a not in split)))
        return holders

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The global ``norm_type``-norm of the gradients of every parameter, as one process
        computes it over the full gradients (``torch.nn.utils.get_total_norm``); on every rank.

        Each rank takes the norm of its gradient shards (a ZeRO-2 parameter's: its slice); a
        shard held by ``r`` ranks (replicated along the mesh axes that neither split nor
        partition it) counts ``1 / r`` of its ``p``-th power, so each element counts once; one
        all-reduce over the plan's ranks sums the powers (the maximum for ``inf``). Parameters
        without a gradient are skipped, as torch does.

        Returns:
            a 0-dim float32 tensor on this rank's device.
        """
        p = float(norm_type)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for fqn, holder, copies in self._gradient_holders():
            if holder.grad is None or not self.owns(fqn):
                continue
            n = torch.linalg.vector_norm(holder.grad.detach(), p).to(total)
            total = torch.maximum(total, n) if math.isinf(p) else total + n ** p / copies
        dist.all_reduce(total, op=dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM, group=self._job_group())
        return (total if math.isinf(p) else total ** (1 / p)).to(torch.float32)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the gradients so their global norm (``grad_norm``) is at most ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_`` does in one process (the same coefficient
        ``max_norm / (norm + 1e-6)``, capped at 1, on every rank). Call on every rank after the
        gradients are synchronized (``step`` does, with ``max_grad_norm``).

        Returns:
            the global norm before clipping (0-dim float32 tensor), equal on every rank.
        """
        norm = self.grad_norm(norm_type)
        holders = [h for _, h, _ in self._gradient_holders() if h.grad is not None]
        torch.nn.utils.clip_grads_with_norm_(holders, max_norm, norm)
        return norm

    # ---------------------------------------------------------------- checkpoints
    def state_mesh(self, fqn: str):
        """The ``DeviceMesh`` this rank's shard of ``fqn`` lives on (the plan's; a pipeline
        stage's own)."""
        raise NotImplementedError

    def placements(self, fqn: str) -> tuple:
        """DTensor placements of parameter / buffer ``fqn`` on ``state_mesh(fqn)``."""
        self._select(fqn)
        return self._spec(self._placeholders[fqn]).placements(2)

    def global_shape(self, fqn: str) -> tuple[int, ...]:
        """The full shape of parameter / buffer ``fqn``."""
        self._select(fqn)  # a pipeline rank's placeholders are its chunks' (interleaved: several)
        return tuple(self.cg.node(self._placeholders[fqn]).meta["val"].shape)

    def save(self, path: str | Path, extra: dict | None = None) -> None:
        """Write a sharded checkpoint (``runtime/checkpoint.py``): call on every rank."""
        checkpoint.save(self, path, extra)

    def load(self, path: str | Path) -> dict:
        """Read a checkpoint written by ``save`` under any plan (``runtime/checkpoint.py``; a
        model-only one too: a warning, and a fresh optimizer state); call on every rank. Returns
        the ``extra`` dict it was saved with."""
        return checkpoint.load(self, path)

    def save_full(self, path: str | Path) -> None:
        """Write the full state dict for inference (``runtime/checkpoint.py``); call on every rank."""
        checkpoint.save_full(self, path)

    # ---------------------------------------------------------------- state
    def state_dict(self, non_persistent: bool = False) -> dict[str, torch.Tensor]:
        """Full (gathered) copies of the parameters and buffers by FQN, tied names included: the keys
        of the model's own ``state_dict()``, and its non-persistent buffers too with
        ``non_persistent``; on every rank. Copies: later steps do not change them (a snapshot to
        return to with ``load_state_dict``)."""
        state = self._gather({**self.params, **self.buffers}, {**self.cg.param_fqns, **self.cg.buffer_fqns})
        return state if non_persistent else {k: v for k, v in state.items() if k not in self.non_persistent}

    def gradients(self) -> dict[str, torch.Tensor]:
        """Full gradients of the last step by parameter FQN (tied names included; zeros where a
        parameter got none), after their synchronization; on every rank."""
        grads = {fqn: p.grad if p.grad is not None else torch.zeros_like(p) for fqn, p in self.params.items()}
        for zero in self._zero_partitions():
            grads |= zero.full_gradients()
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
        device_mesh: the 2D torch ``DeviceMesh`` of the plan's shape; its axis groups get the
            default group's collective timeout (``launch.job_timeout``).
        captured: the ``CapturedGraph`` of the model (the plan's fingerprint).
        plan: the ``Plan``.
        optimizer: ``params -> torch.optim.Optimizer`` over this rank's shards.
        accumulate: gradient accumulation steps ``K``: a step's batch is ``K`` microbatches of the
            plan's batch along dim 0, run one after the other with one gradient synchronization
            and one optimizer update (``_accumulate``).
        compile: run each microbatch's forward and backward as this rank's ``RankProgram``
            (``program.py``: the plan lowered to a ``torch.fx.GraphModule`` with functional
            collectives) under ``torch.compile``: True for the ``"inductor"`` backend, or a
            backend name (``"aot_eager"`` ...). With ``accumulate`` 1 the gradient all-reduce
            buckets are summed in the graph, each launched where backward completes it
            (``RankProgram.buckets``); with more microbatches, and ZeRO-2's reduce-scatter
            buckets, they start after the last microbatch's backward, after a deferred loss's
            all-reduce. ``overlap`` has no effect; the program's own ``RankProgram.overlap``
            reorders its graph's collectives to overlap compute (``overlap.py``). False: the
            interpreter (``executor.py``).

    Attributes:
        program: the ``RankProgram`` under ``compile``, else None.

    Raises:
        PlanError: the plan was made for another model, other input shapes or another mesh.
        ValueError: ``accumulate`` is not a positive integer, or ``compile`` is asked for a plan
            the lowering does not cover (in-place writes to stored tensors).
    """

    program: RankProgram | None = None

    def __init__(self, model, device_mesh, captured: CapturedGraph, plan: Plan, optimizer: Callable, seed: int = 0,
                 init_fn=None, accumulate: int = 1, compile: bool | str = False):
        if not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(f"accumulate must be a positive number of microbatches, got {accumulate!r}")
        if plan.fingerprint != captured.fingerprint():
            raise PlanError("the plan was made for another model or other input shapes "
                            f"(plan graph {plan.fingerprint}, this model {captured.fingerprint()}): plan and train "
                            "the same model at the same batch and sequence length (`alpa-lite plan` and `train` "
                            "take --batch and --seq; their default batches differ: 8 and 16)")
        shape = tuple(device_mesh.mesh.shape)
        if tuple(plan.mesh.shape) != shape:
            raise PlanError(f"the plan is for a {plan.mesh.shape[0]}x{plan.mesh.shape[1]} mesh, the device mesh is "
                            f"{shape[0]}x{shape[1]}")
        self.plan, self.mesh, self.cg, self.view = plan, device_mesh, captured, captured
        coord = tuple(device_mesh.get_coordinate())
        groups = tuple(device_mesh.get_group(a) for a in range(2))
        ranks = sorted(int(r) for r in device_mesh.mesh.flatten())
        flat = dist.group.WORLD if len(ranks) == dist.get_world_size() else dist.new_group(ranks)
        for g in {*groups, flat}:  # the job's timeout: a collective whose peer stopped fails as the job's do
            g.set_timeout(job_timeout())
        self.groups = MeshGroups(shape, coord, groups, flat)
        self.num_microbatches = accumulate
        if accumulate > 1 and plan.loss_reduction.problems:
            warnings.warn(f"accumulating {accumulate} microbatches changes the loss: "
                          + "; ".join(plan.loss_reduction.problems), stacklevel=2)
        self.buckets_in_program = bool(compile) and accumulate == 1
        self._build(model, plan, optimizer, seed, init_fn)
        if compile:
            in_graph = [(axes, members) for kind, axes, members in reversed(self.buckets)
                        if self.buckets_in_program and kind == "all-reduce"]  # BucketSync.in_program's order
            self.program = RankProgram(self.executor, self._weight, list(captured.buffer_mutations),
                                       "inductor" if compile is True else compile, in_graph, self.reduce_dtype)

    def _local_plan(self) -> Plan:
        return self.plan

    def _job_group(self):
        return self.groups.flat

    def state_mesh(self, fqn: str):
        return self.mesh

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
        return self._accumulate(self._flat_batch(batch, kwargs), backward=False)()[0]

    def _run(self, flat: list[torch.Tensor]) -> dict[str, object]:
        values = self.executor.run(self.placeholder_values(flat))
        store_buffer_mutations(self.cg, self.plan, values, self.buffers, self.groups)
        return values

    def _accumulate(self, flat: list[torch.Tensor], backward: bool) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """A function giving ``(loss, Z)``: the loss of the whole batch over its ``K``
        microbatches, ``sum_m w_m L_m / Z``, as a pipeline combines its microbatches
        (``pipeline.py``'s module docstring): a mean averages them, a sum adds them, a token mean
        over valid targets weighs each by its count. With ``backward``, each ``w_m L_m`` is
        back-propagated as soon as it is computed (one microbatch's activations live at a time;
        the gradient buckets are armed for the last one, ``overlap``), the gradients are left to
        be divided by ``Z`` after their synchronization, and the loss is detached. ``K = 1`` is
        the plain loss.

        With ``backward`` the interpreter defers the loss's all-reduce of every microbatch
        (``LocalExecutor.defer_loss``): backward runs from the local partial sum (of a token
        mean: of its numerator, ``w_m L_m`` with ``w_m`` its denominator), and the function
        waits for the all-reduces (each started in its microbatch's forward, before any bucket),
        so call it after backward. A deferred microbatch without a valid target (``w_m = 0``,
        known only once the count is all-reduced) back-propagates its local numerator, a sum of
        nothing: zero gradients. Where the plan does not defer the loss (``Collective.deferred``),
        such a microbatch runs no backward (its ``L_m`` is 0/0)."""
        losses, weights, pending = [], [], []
        for mb in range(self.num_microbatches):
            if backward and self.program is not None:
                term, weight, deferred = self._run_program(self._microbatch(flat, mb))
                pending.append(deferred)
                losses.append(term)
                weights.append(weight)
                continue
            with self.executor.deferring(backward):
                values = self._run(self._microbatch(flat, mb))
            loss = values[self.cg.loss_name]
            deferred = self.executor.pending_loss.pop() if self.executor.pending_loss else None
            weight = None if deferred is not None else self._weight(values, loss)
            del values  # the forward values backward does not read are freed before it runs (autograd keeps the rest)
            if deferred is not None:
                term = deferred.local
            else:
                term = loss * weight if weight else torch.zeros_like(loss)  # w_m = 0: no valid target, L_m is 0/0
            if backward and (deferred is not None or weight):
                if self.overlap and mb == self.num_microbatches - 1:
                    self.bucket_sync.arm()
                (term if self.scaler is None else term * self.scaler.scale).backward()
            pending.append(deferred)
            losses.append(term.detach() if backward else term)
            weights.append(weight)

        def total() -> tuple[torch.Tensor, torch.Tensor]:
            for m, deferred in enumerate(pending):
                if deferred is not None:
                    losses[m], weights[m] = deferred.weighted()
            z = torch.ones_like(weights[0]) if self.plan.loss_reduction.kind == "sum" else torch.stack(weights).sum()
            return torch.stack(losses).sum() / z, z
        return total

    def _weight(self, values: dict, loss: torch.Tensor) -> torch.Tensor:
        """``w_m`` of a microbatch of ``K`` (1 when ``K = 1``), in the loss's dtype."""
        return (self._loss_weight(values) if self.num_microbatches > 1 else torch.ones(())).to(loss)

    def _run_program(self, flat: list[torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor | None, DeferredLoss | None]:
        """``(w_m L_m, w_m, None)`` of a microbatch run by the compiled program (``program.py``),
        or where the plan defers the loss's all-reduce ``(local partial sum, None, its
        DeferredLoss)`` (started after the program's backward, waited for by ``_accumulate``'s
        ``total``), its gradients accumulated into the parameters' ``.grad`` (none when ``w_m =
        0``: no valid target), its buckets' sums handed to the sync (``BucketSync.summed``) and
        its buffer updates stored."""
        loss, grads, values, summed = self.program(self.placeholder_values(flat),
                                                   1.0 if self.scaler is None else self.scaler.scale)
        self.bucket_sync.summed(summed)
        store_buffer_mutations(self.cg, self.plan, values, self.buffers, self.groups)
        deferred = loss if isinstance(loss, DeferredLoss) else None
        term, weight = (deferred.local, None) if deferred is not None else loss
        if deferred is None and not weight:
            return torch.zeros_like(term), weight, None
        for ph, g in grads.items():
            p = self.params[self.cg.param_fqns[ph]]
            p.grad = g if p.grad is None else p.grad + g
        return term, weight, deferred

    def _train_step(self, flat: list[torch.Tensor]) -> float:
        total = self._accumulate(flat, backward=True)
        loss, z = total()  # the loss's all-reduces were started in forward, before every bucket
        divide = float(z) not in (0.0, 1.0)  # after the sync: both are linear, and no all-reduce is in flight
        divided = self._sync_buckets(z if divide else None)
        if divide:
            for _, holder, _ in self._gradient_holders():
                if holder.grad is not None and id(holder) not in divided:
                    holder.grad.div_(z)
        return float(loss)

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
