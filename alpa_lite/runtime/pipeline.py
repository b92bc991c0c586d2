"""Run a ``PipelinePlan``: each rank executes its stage's part of the graph on its submesh.

Every stage is an SPMD program on its own submesh (``runtime/executor.py`` runs its nodes with
the stage's intra-op plan: resharding collectives inside the stage's process groups). Between
stages, values cross as full (replicated) tensors with point-to-point messages
(``torch.distributed.batch_isend_irecv``): the sender all-gathers the value to ``R`` on its
submesh (an autograd-aware ``Reshard``), receiving device ``j`` of the next stage takes it from
sending device ``j mod d_send``, and slices what its consumers want (free). Gradients go back the
same way: sending device ``i`` of the earlier stage takes the full gradient from receiving device
``i mod d_recv``. So stages may have different submesh and logical mesh shapes.

A step: the batch is cut into ``B`` microbatches (dim 0); the schedule (``core/schedules.py``) gives
each stage its order of forwards and backwards; gradients accumulate over microbatches. A schedule
that splits the backward (ZB-H1, Qi et al., ICLR'24) runs the input-gradient pass as
``torch.autograd.grad`` w.r.t. the received values only (the graph retained), sends those
gradients, and later the weight pass as ``torch.autograd.backward(..., inputs=parameters)``. The
deferred data-parallel gradient buckets of each stage are all-reduced, each started during the
stage's last backward (or weight pass) once its gradients are ready (``grad_sync.py``), the buckets of
its ZeRO-2 parameters reduce-scattered once after it (``zero.py``), a weight used by several
stages (tied embeddings) gets the sum of their gradients, and one optimizer step runs over every
chunk's shards and ZeRO-1/2 slices; then each chunk all-gathers its updated slices (phase
``"update"``).

Under interleaved 1F1B (Narayanan et al., SC'21, section 2.2.2) a rank holds ``v`` stages
(chunks): stages ``d, d + p, ..., d + (v - 1) p`` of device group ``d``. Each chunk keeps its own
stage state (stage plan, graph view, executor, process groups, gradient buckets; ``_CHUNK_STATE``),
made current before one of its actions runs; the parameters of all chunks form one dict under one
optimizer (a rank's chunks must hold disjoint parameters and buffers), and each chunk synchronizes
its own gradient buckets. Message tags carry the stage boundary they cross, so the two chunks a
pair of ranks exchange values for never mix.

The step's loss is the loss of the whole batch, ``sum_m w_m L_m / Z``, by how the loss reduces
over the batch (``PipelinePlan.loss_reduction``, ``core/losses.py``): a sum adds the microbatch losses
(``w_m = 1``, ``Z = 1``), a mean averages them (``w_m = 1``, ``Z = B``), and a token mean over
valid targets weighs each by its count (``w_m = D_m``, its denominator, ``Z = sum_m D_m``), so
it is the ratio of the summed numerators and denominators. The last stage back-propagates
``w_m L_m``; ``Z`` is known only after the last microbatch, so every rank divides its
synchronized gradients by it before the optimizer step (one broadcast carries loss and ``Z``).
Where its plan defers the loss's all-reduce (``Collective.deferred``), as the SPMD runtime does,
each microbatch back-propagates its local partial sum (of a token mean: its numerator) while
the all-reduce runs, waited for once the schedule is done.

``torch.distributed.pipelining`` is not used: its stages are one module per rank with one
process group, and its schedules drive ``PipelineStage`` objects that exchange tensors of fixed
shapes with one peer each; alpa-lite's stages are slices of one captured graph, each SPMD over a
submesh of its own shape, exchanging several values with several peers. What it shares with
that package is the 1F1B and GPipe orders, restated in ``core/schedules.py``.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ..core.aten import alias_root, op_args, written_args
from ..core.capture import stage_view
from ..core.plan import PipelinePlan, Plan, PlanError
from ..core.schedules import get_schedule
from ..core.spec import ShardingSpec
from .collectives import GatheredParameters, MeshGroups, local_slice, named, reshard, synchronize_device
from .executor import DeferredLoss
from .init import store_buffer_mutations
from .launch import job_timeout
from .program import StageProgram
from .trainer import Trainer
from .zero import build_optimizer

_CHUNK_STATE = ("stage", "sp", "index", "groups", "view", "_written", "executor", "constants", "buckets", "zero",
                "_placeholders", "bucket_sync", "program")


class _ActivationMeter:
    """Bytes autograd saves for backward, per (stage, microbatch) in flight; ``peak`` over the step.
    Tensors on the storage of a parameter in ``params`` (a weight, or a view of it, that an op
    saves) are not counted: they are held anyway, not by the microbatch."""

    def __init__(self, params):
        self.storages = {p.untyped_storage().data_ptr() for p in params}
        self.live = 0
        self.peak = 0
        self.per_mb: dict[tuple[int, int], int] = {}
        self._current = None

    def hooks(self, mb: tuple[int, int], gathered: GatheredParameters | None):
        """Saved-tensor hooks of microbatch ``mb``'s forward, counting what is saved after
        ``gathered`` replaced its ZeRO-3 parameter copies by their shards."""
        self._current = mb
        self.per_mb[mb] = 0

        def pack(t):
            t = t if gathered is None else gathered.pack(t)
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.storages:
                self.per_mb[self._current] += t.numel() * t.element_size()
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, GatheredParameters.unpack)

    def forward_done(self, mb: tuple[int, int]):
        self.live += self.per_mb[mb]
        self.peak = max(self.peak, self.live)

    def backward_done(self, mb: tuple[int, int]):
        self.live -= self.per_mb.pop(mb)


class PipelineTrainer(Trainer):
    """Pipelined training of a ``PipelinePlan``: the ``Trainer`` interface on every rank.

    Args:
        model: the module (meta or real parameters; ``runtime.init`` semantics).
        captured: the ``CapturedGraph`` of ONE microbatch (the plan's fingerprint).
        plan: a ``PipelinePlan``; its stages' ranks must tile the world (under interleaved 1F1B:
            the first ``p`` stages', stage ``s`` on the ranks of stage ``s mod p``).
        optimizer: ``params -> torch.optim.Optimizer`` over this rank's shards (not called on a
            stage without parameters: it has nothing to update).
        compile: run each chunk's forward of a microbatch, and its backward, as its
            ``StageProgram`` (``program.py``: AOT autograd's forward and backward graphs on local
            shapes, intra-stage collectives as functional collectives) under ``torch.compile``:
            True for the ``"inductor"`` backend, or a backend name (``"aot_eager"`` ...); the
            schedule, sends and receives stay here. False: the interpreter.

    Attributes:
        stages: this rank's stage indices (one per chunk); stage: the current chunk's;
        peak_activation_bytes: the most bytes of tensors saved for backward this rank held during
            the last step (all microbatches of all chunks in flight; its parameters not counted).
        program: the current chunk's ``StageProgram`` under ``compile``, else None.
        busy_seconds: seconds this rank spent in the last step's compute actions (forward,
            backward, weight passes; ``_compute``); schedule_seconds: seconds from the start of
            its schedule to its last transfer done. Its idle share of a step whose ranks start
            together is ``1 - busy_seconds / T``, ``T`` the ranks' largest ``schedule_seconds``
            (``report.idle_fractions``; the predicted share is ``PipelinePlan.bubble_fraction``).

    Raises:
        PlanError: the plan's stages do not tile the world, two of a rank's chunks share a
            parameter or buffer, or the plan was made for another model.
        ValueError: ``compile`` with a schedule that splits the backward (ZB-H1), or with a stage
            plan the lowering does not cover (``program.py``).
    """

    def __init__(self, model, captured, plan: PipelinePlan, optimizer: Callable, seed: int = 0, init_fn=None,
                 compile: bool | str = False):
        self.schedule = get_schedule(plan.schedule, plan.chunks)
        if compile and self.schedule.split_backward:
            raise ValueError(f"compile=True cannot run the {plan.schedule} schedule: a compiled stage's backward is "
                             "one graph (AOT autograd) that gives the input and the weight gradients together, and "
                             f"{plan.schedule} runs them as two passes at different times; use 1f1b, gpipe or "
                             "interleaved, or run without compile")
        world, rank = dist.get_world_size(), dist.get_rank()
        self.num_stages, self.num_microbatches = len(plan.stages), plan.num_microbatches
        self.num_devices = self.num_stages // self.schedule.chunks  # p device groups
        all_ranks = sorted(r for s in plan.stages[:self.num_devices] for r in s.ranks)
        if all_ranks != list(range(world)) or any(s.ranks != plan.stages[i % self.num_devices].ranks
                                                  for i, s in enumerate(plan.stages)):
            raise PlanError(f"the plan's stages use ranks {[s.ranks for s in plan.stages]}; they must tile the "
                            f"world's ranks 0 .. {world - 1} ({plan.schedule}: {self.schedule.chunks} stage(s) per "
                            "device group, stage s on the ranks of stage s mod the group count)")
        if plan.fingerprint != captured.fingerprint():
            raise PlanError("the plan was made for another model or other microbatch shapes "
                            f"(plan graph {plan.fingerprint}, this model {captured.fingerprint()}): plan and train "
                            "the same model at the same batch and sequence length (`alpa-lite plan` and `train` "
                            "take --batch and --seq; their default batches differ: 8 and 16)")
        self.plan, self.cg = plan, captured
        self._check_chunks_disjoint()
        self.timeout = job_timeout()  # the stage groups'; transfers run on the default group
        self.reduction = plan.loss_reduction
        self.stages = [i for i, s in enumerate(plan.stages) if rank in s.ranks]
        self.device_group = self.stages[0]
        stage_groups = self._make_groups(rank)
        self.chunks, params, buffers = [], {}, {}
        for stage in self.stages:
            self.stage, self.sp, self.groups = stage, plan.stages[stage], stage_groups[stage]
            self.index = self.sp.ranks.index(rank)  # position in the stage's logical mesh (row-major)
            self.view = stage_view(captured, list(self.sp.plan.nodes))
            self._written = {alias_root(op_args(node)[a]).name for node in map(self.cg.node, self.sp.nodes)
                             if isinstance(node.target, torch._ops.OpOverload) for a in written_args(node.target)}
            if (self.reduction.kind == "ratio" and stage == self.num_stages - 1
                    and self.reduction.denominator not in (*self.sp.nodes, *self.sp.recv)):
                raise PlanError(f"the loss's denominator {self.reduction.denominator} is not on the last stage")
            self._build(model, self.sp.plan, lambda _: None, seed, init_fn)
            self.program = StageProgram(self.executor, self._run_stage, self._kept(),
                                        "inductor" if compile is True else compile) if compile else None
            params |= self.params
            buffers |= self.buffers
            self.chunks.append({k: getattr(self, k) for k in _CHUNK_STATE})
        self.params, self.buffers = params, buffers
        # none on a stage with nothing to train
        self.optimizer = (build_optimizer(optimizer, self._zero_partitions(), model, self._local_state) if params
                          else None)
        self.tied_groups = self._tied_groups()
        self.peak_activation_bytes = 0
        self.busy_seconds = self.schedule_seconds = 0.0
        self._stage_meshes = None

    def _kept(self) -> list[str]:
        """What the current chunk's forward computes that the runtime reads besides the sent
        values: the mutated buffers' new values, and on the last stage the loss and its
        denominator (``_loss_term``)."""
        last = [self.cg.loss_name, self.reduction.denominator] if self.stage == self.num_stages - 1 else []
        return list(self.view.buffer_mutations) + [n for n in last if n in self.sp.nodes]

    def _check_chunks_disjoint(self) -> None:
        """The stages of one device group hold disjoint parameters and buffers (checked on every rank alike)."""
        state = {**self.cg.param_fqns, **self.cg.buffer_fqns}
        for d in range(self.num_devices):
            seen: dict[str, int] = {}
            for i in range(d, self.num_stages, self.num_devices):
                for ph in self.plan.stages[i].plan.nodes:
                    if ph in state and seen.setdefault(ph, i) != i:
                        raise PlanError(f"stages {seen[ph]} and {i} run on the same ranks and both hold {state[ph]}; "
                                        "use another layer split or a schedule with one stage per device group")

    def _zero_partitions(self) -> list:
        return [chunk["zero"] for chunk in self.chunks]

    def _enter(self, stage: int) -> None:
        """Make the chunk of ``stage`` (one of ``self.stages``) the current one."""
        vars(self).update(self.chunks[self.stages.index(stage)])

    # ---------------------------------------------------------------- process groups
    def _make_groups(self, rank: int) -> dict[int, MeshGroups]:
        """Every stage's axis and flat groups, created by all ranks in the same order; ours kept
        (by stage index)."""
        out = {}
        for stage, s in enumerate(self.plan.stages):
            mine = [None, None, None]
            coord = None
            a, b = s.plan.mesh.shape
            grid = [s.ranks[i * b:(i + 1) * b] for i in range(a)]
            for j in range(b):
                g = dist.new_group(timeout=self.timeout, ranks=[grid[i][j] for i in range(a)])
                if rank in [grid[i][j] for i in range(a)]:
                    mine[0] = g
            for i in range(a):
                g = dist.new_group(timeout=self.timeout, ranks=grid[i])
                if rank in grid[i]:
                    mine[1] = g
            g = dist.new_group(timeout=self.timeout, ranks=sorted(s.ranks))
            if rank in s.ranks:
                mine[2] = g
                k = s.ranks.index(rank)
                coord = (k // b, k % b)
                out[stage] = MeshGroups((a, b), coord, (mine[0], mine[1]), mine[2])
        return out

    def _tied_groups(self) -> dict[str, tuple[int, object]]:
        """Parameter placeholder -> (this rank's stage holding it, group of the ranks of every
        stage that holds it) (when > 1 stage)."""
        holders: dict[str, list[int]] = {}
        for i, s in enumerate(self.plan.stages):
            for ph in s.plan.nodes:
                if ph in self.cg.param_fqns:
                    holders.setdefault(ph, []).append(i)
        out = {}
        for ph in sorted(holders):
            if len(holders[ph]) > 1:
                ranks = sorted(r for i in holders[ph] for r in self.plan.stages[i].ranks)
                g = dist.new_group(timeout=self.timeout, ranks=ranks)
                mine = [i for i in holders[ph] if i in self.stages]
                zero = {self.plan.stages[i].plan.nodes[ph].zero_stage for i in holders[ph]} - {0}
                if zero:
                    raise PlanError(f"{self.cg.param_fqns[ph]} is held by stages {holders[ph]} and is ZeRO-{min(zero)} "
                                    "in one: a weight several stages hold cannot take ZeRO-1/2")
                if mine:
                    out[ph] = (mine[0], g)
        return out

    def _local_plan(self) -> Plan:
        return self.sp.plan

    def executors(self) -> list:
        return [chunk["executor"] for chunk in self.chunks]

    def _select(self, fqn: str) -> None:
        self._enter(next(stage for stage, chunk in zip(self.stages, self.chunks) if fqn in chunk["_placeholders"]))

    def owns(self, fqn: str) -> bool:
        self._select(fqn)
        ph = self._placeholders[fqn]
        return next(i for i, s in enumerate(self.plan.stages) if ph in s.plan.nodes) == self.stage

    def state_mesh(self, fqn: str):
        """The ``DeviceMesh`` of the stage holding ``fqn`` here (its ranks in its logical mesh's
        shape); every rank builds every stage's mesh in stage order the first time
        (``DeviceMesh`` creates process groups)."""
        if self._stage_meshes is None:
            from torch.distributed.device_mesh import DeviceMesh

            self._stage_meshes = [DeviceMesh(self.device.type, torch.tensor(s.ranks).view(*s.plan.mesh.shape))
                                  for s in self.plan.stages]
        self._select(fqn)
        return self._stage_meshes[self.stage]

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for stage in self.stages:  # each chunk loads its own parameters and buffers
            self._enter(stage)
            super().load_state_dict(state)

    # ---------------------------------------------------------------- point to point
    def _meta(self, name: str):
        val = self.cg.node(name).meta["val"]
        return tuple(val.shape), val.dtype

    def _p2p(self, ops: list) -> list:
        return dist.batch_isend_irecv(ops) if ops else []

    def _recv_acts(self, mb: int) -> dict[str, torch.Tensor]:
        prev = self.plan.stages[self.stage - 1]
        src = prev.ranks[self.index % len(prev.ranks)]
        bufs = {n: torch.empty(*self._meta(n)[:1], dtype=self._meta(n)[1], device=self.device) for n in self.sp.recv}
        works = self._p2p([dist.P2POp(dist.irecv, bufs[n], src, tag=_tag(self.stage, mb, 0, k))
                           for k, n in enumerate(self.sp.recv)])
        _wait(works, f"the receive of microbatch {mb}'s activations from rank {src}")
        return {n: (t.requires_grad_(True) if n in self.cg.requires_grad else t) for n, t in bufs.items()}

    def _send(self, tensors: list[torch.Tensor], peers: list[int], boundary: int, mb: int, kind: int) -> None:
        ops = [dist.P2POp(dist.isend, t.contiguous(), p, tag=_tag(boundary, mb, kind, k))
               for p in peers for k, t in enumerate(tensors)]
        values = ("activations", "gradients")[kind]
        what = f"the send of microbatch {mb}'s {values} to rank(s) {', '.join(map(str, peers))}"
        self._pending.append((self._p2p(ops), what))

    def _next_peers(self) -> list[int]:
        nxt = self.plan.stages[self.stage + 1]
        d = len(self.sp.ranks)
        return [r for j, r in enumerate(nxt.ranks) if j % d == self.index]

    def _prev_peers(self) -> list[int]:
        prev = self.plan.stages[self.stage - 1]
        d = len(self.sp.ranks)
        return [r for i, r in enumerate(prev.ranks) if i % d == self.index]

    # ---------------------------------------------------------------- one step
    @contextmanager
    def _compute(self, kind: str):
        """Around one compute action (``kind``: forward, backward or weight): its seconds add to
        ``busy_seconds``. When the trainer reports (``timer``), the device is synchronized before
        and after, so queued CUDA work counts where it runs (a no-op on CPU). Tests pad it with a
        sleep to give the stages known times (tests/workers/pipeline_idle.py)."""
        if self.timer is not None:
            synchronize_device()
        t0 = time.perf_counter()
        yield
        if self.timer is not None:
            synchronize_device()
        self.busy_seconds += time.perf_counter() - t0

    def _forward(self, mb: int, batch: list[torch.Tensor], received: dict[str, torch.Tensor],
                 gathered: GatheredParameters | None):
        """Run the stage's nodes on microbatch ``mb`` of the flat ``batch`` (``input_names`` order),
        its ZeRO-3 parameter copies recorded in ``gathered`` (``LocalExecutor.gathered_parameters``);
        returns (values sent, the microbatch's weighted loss ``w_m L_m`` on the last stage, else None)."""
        self.executor.calls += 1  # every microbatch draws new random numbers (dropout masks)
        values: dict[str, object] = {}
        values |= {ph: self.params[fqn] for ph, fqn in self.view.param_fqns.items()}
        values |= {ph: self.buffers[fqn] for ph, fqn in self.view.buffer_fqns.items()}
        values |= self.constants
        for name, part in zip(self.cg.input_names, self._microbatch(batch, mb)):  # a 0-dim input whole
            if name in self.view.input_names:
                values[name] = local_slice(part.to(self.device), self.sp.plan.input_specs[name], self.groups)
        # a received activation is an autograd leaf, which no op may write in place (relu_, +=):
        # the stage's in-place ops write a copy of it
        values |= {n: t.clone() if n in self._written else t for n, t in received.items()}
        if self.program is not None:  # the compiled stage (``program.StageProgram``)
            sent, kept = self.program(values)
            values |= kept
        else:
            with self.executor.deferring(self.stage == self.num_stages - 1):
                sent = self._run_stage(values, gathered)
        store_buffer_mutations(self.view, self.sp.plan, values, self.buffers, self.groups)
        if self.stage != self.num_stages - 1:
            return sent, None
        return sent, self._loss_term(values)

    def _run_stage(self, values: dict[str, object], gathered: GatheredParameters | None = None) -> list[torch.Tensor]:
        """The stage's nodes run on ``values`` (placeholders and received values by name; every
        computed value is added), then the values it sends, each it produced all-gathered to the
        replicated spec that crosses; returns those (``self.sp.send`` order)."""
        moved = {}  # operands resharded for this microbatch, once per value and wanted spec
        self.executor.run_nodes(map(self.cg.node, self.sp.nodes), values, moved, gathered)
        sent = []
        for name in self.sp.send:
            x = values[name]
            if name not in self.sp.recv:  # produced here: gather to the replicated spec that crosses
                spec = self._spec(name)
                shape = self._meta(name)[0]
                x = reshard(x, spec, ShardingSpec.replicated(spec.ndim), () if name in self.cg.requires_grad else None,
                            shape, self.groups)
            sent.append(x)
        return sent

    def _loss_term(self, values) -> torch.Tensor | None:
        """``w_m L_m`` of this microbatch (None when ``w_m = 0``: a token mean without a valid
        target adds nothing), recording ``(w_m L_m, w_m)`` for the step's loss. Where the stage
        plan defers the loss's all-reduce (``Collective.deferred``; ``LocalExecutor.defer_loss``)
        it is the local partial sum (of a token mean: of its numerator, ``w_m L_m`` with ``w_m``
        its denominator), recorded as the ``DeferredLoss``, waited for in ``_broadcast_loss``; a
        microbatch without a valid target then back-propagates a sum of nothing (zero gradients)."""
        if self.executor.pending_loss:
            deferred = self.executor.pending_loss.pop()
            self._terms.append(deferred)
            return deferred.local
        loss = values[self.cg.loss_name]
        weight = self._loss_weight(values).to(loss)
        if not weight:
            self._terms.append((torch.zeros_like(loss), weight))
            return None
        term = loss * weight
        self._terms.append((term.detach(), weight))
        return term

    def _train_step(self, batch: list[torch.Tensor]) -> float:
        """The schedule's forwards, transfers and backwards of every microbatch; the loss of the
        whole batch ``sum_m w_m L_m / Z`` (module docstring), gradients divided by ``Z`` and
        synchronized; the rank's ``busy_seconds`` and ``schedule_seconds`` of the step."""
        start, self.busy_seconds = time.perf_counter(), 0.0
        self._pending = []
        meter = _ActivationMeter(self.params.values())
        # by (stage, microbatch): forward results, a split backward's roots kept for its weight
        # pass, received activations
        saved: dict[tuple[int, int], tuple] = {}
        deferred: dict[tuple[int, int], tuple] = {}
        received: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._terms = []
        actions = list(self.schedule.actions(self.device_group, self.num_devices, self.num_microbatches))
        completes = "weight" if self.schedule.split_backward else "backward"
        last = {a.chunk: i for i, a in enumerate(actions) if a.kind == completes}  # a chunk's gradients complete
        for i, action in enumerate(actions):
            self._enter(self.stages[action.chunk])
            mb, key = action.microbatch, (self.stage, action.microbatch)
            if self.overlap and last.get(action.chunk) == i:
                self.bucket_sync.arm()
            if action.kind == "recv_act":
                received[key] = self._recv_acts(mb)
            elif action.kind == "forward":
                gathered = self.executor.gathered_parameters() if self.program is None else None
                with self._compute("forward"), meter.hooks(key, gathered):
                    saved[key] = self._forward(mb, batch, received.get(key, {}), gathered)
                meter.forward_done(key)
            elif action.kind == "send_act":
                self._send([t.detach() for t in saved[key][0]], self._next_peers(), self.stage + 1, mb, 0)
            elif action.kind == "recv_grad":
                saved[key] = saved[key] + (self._recv_grads(mb, saved[key][0]),)
            elif action.kind == "backward":
                outputs = self._backward_roots(*saved.pop(key))
                if not self.schedule.split_backward:
                    with self._compute("backward"):
                        if outputs[0]:
                            torch.autograd.backward(*outputs)
                    meter.backward_done(key)
                    continue
                leaves = [t for n, t in received.get(key, {}).items() if n in self.cg.requires_grad]
                with self._compute("backward"):
                    if outputs[0] and leaves:  # input gradients only; the graph stays for the weight pass
                        grads = torch.autograd.grad(outputs[0], leaves, outputs[1], retain_graph=True,
                                                    allow_unused=True)
                        for t, g in zip(leaves, grads):
                            t.grad = g
                deferred[key] = outputs
            elif action.kind == "weight":
                outputs, params = deferred.pop(key), [p for p in self.params.values() if p.requires_grad]
                with self._compute("weight"):
                    if outputs[0] and params:
                        torch.autograd.backward(*outputs, inputs=params)
                meter.backward_done(key)
            elif action.kind == "send_grad":
                leaves = received.pop(key)
                out = [(t.grad if t.grad is not None else torch.zeros_like(t)) for n, t in leaves.items()
                       if n in self.cg.requires_grad]
                self._send(out, self._prev_peers(), self.stage, mb, 1)
        for works, what in self._pending:
            _wait(works, what)
        self._pending = []
        self.schedule_seconds = time.perf_counter() - start
        if self.timer is not None:
            self.timer.add_schedule(self.busy_seconds, self.schedule_seconds)
        self.peak_activation_bytes = meter.peak
        loss, z = self._broadcast_loss()
        self._sync_gradients()
        if z not in (0.0, 1.0):
            for _, holder, _ in self._gradient_holders():
                if holder.grad is not None:
                    holder.grad.div_(z)
        return loss

    def loss(self, *batch, **kwargs) -> torch.Tensor:
        """The loss of a global batch (``num_microbatches`` microbatches, combined as ``step``
        combines them), forward only, on every rank: a 0-dim tensor without an autograd graph
        (a pipeline's backward runs only inside ``step``). Each rank runs its stages' forwards of
        every microbatch in stage order (GPipe's forward half), with the interpreter; buffers such
        as batch-norm statistics are updated as in a forward, once per microbatch. No update.

        Raises:
            ValueError: the batch's structure or a tensor's shape is not the captured one.
        """
        flat = self._flat_batch(batch, kwargs)
        self._pending, self._terms = [], []
        programs = [chunk["program"] for chunk in self.chunks]
        try:
            for chunk in self.chunks:  # the interpreter: a compiled stage's forward is traced for backward
                chunk["program"] = None
            with torch.no_grad():
                for stage in self.stages:  # ascending: a rank's earlier stage feeds a later stage of another rank
                    self._enter(stage)
                    for mb in range(self.num_microbatches):
                        received = self._recv_acts(mb) if stage > 0 else {}
                        gathered = self.executor.gathered_parameters()
                        with self.executor.deferring(False):
                            sent, _ = self._forward(mb, flat, received, gathered)
                        if stage < self.num_stages - 1:
                            self._send([t.detach() for t in sent], self._next_peers(), stage + 1, mb, 0)
            for works, what in self._pending:
                _wait(works, what)
        finally:
            for chunk, program in zip(self.chunks, programs):
                chunk["program"] = program
            self._pending = []
        loss, _ = self._broadcast_loss()
        self._terms = []
        return torch.tensor(loss, device=self.device)

    def _backward_roots(self, sent: list[torch.Tensor], term, grads=None) -> tuple[list, list]:
        """``(tensors, their gradients)`` a microbatch's backward starts from: the weighted loss on
        the last stage (none when it adds nothing), else the sent values that need a gradient."""
        if self.stage == self.num_stages - 1:
            if term is None:
                return [], []
            return [term if self.scaler is None else term * self.scaler.scale], [None]
        pairs = [(t, g) for t, g in zip(sent, grads) if t.requires_grad]
        return [t for t, _ in pairs], [g for _, g in pairs]

    def _recv_grads(self, mb: int, sent: list[torch.Tensor]) -> list[torch.Tensor | None]:
        nxt = self.plan.stages[self.stage + 1]
        src = nxt.ranks[self.index % len(nxt.ranks)]
        # contiguous buffers: a sent value may be a view (``x.transpose(1, 2)``), whose strides
        # ``empty_like`` would keep, and a receive needs a contiguous tensor
        bufs = [torch.empty(t.shape, dtype=t.dtype, device=t.device) if t.requires_grad else None for t in sent]
        ops, k = [], 0
        for n, b in zip(self.sp.send, bufs):
            if b is not None:
                ops.append(dist.P2POp(dist.irecv, b, src, tag=_tag(self.stage + 1, mb, 1, k)))
                k += 1
        _wait(self._p2p(ops), f"the receive of microbatch {mb}'s gradients from rank {src}")
        return bufs

    def _sync_gradients(self) -> None:
        for stage in self.stages:  # deferred data-parallel gradients inside each stage
            self._enter(stage)
            self._sync_buckets()
        for ph, (stage, group) in self.tied_groups.items():  # a weight several stages use: sum their gradients
            self._enter(stage)
            fqn = self.view.param_fqns[ph]
            p = self.params[fqn]
            spec = self._spec(ph)
            full = self._full(p.grad if p.grad is not None else torch.zeros_like(p), ph)
            if self.index != 0:  # every rank of a stage holds the same full gradient: count it once
                full = torch.zeros_like(full)
            with named(f"the all-reduce of tied weight {fqn}'s gradient over its stages"):
                dist.all_reduce(full, group=group)
            p.grad = local_slice(full, spec, self.groups).clone()

    def _broadcast_loss(self) -> tuple[float, float]:
        """``(loss, Z)`` of the step from the last stage (module docstring), on every rank."""
        value = torch.zeros(2, device=self.device)
        if self._terms:
            terms, weights = (torch.stack(x) for x in zip(*(t.weighted() if isinstance(t, DeferredLoss) else t
                                                              for t in self._terms)))
            z = torch.ones_like(weights[0]) if self.reduction.kind == "sum" else weights.sum()
            value = torch.stack([terms.sum() / z, z]).to(value)
        src = self.plan.stages[-1].ranks[0]
        with named(f"the broadcast of the step's loss from rank {src}"):
            dist.broadcast(value, src=src)
        return float(value[0]), float(value[1])

    def _gather(self, local: dict[str, torch.Tensor], placeholders: dict[str, str]) -> dict[str, torch.Tensor]:
        """``placeholder -> fqn`` of ``placeholders``: the full tensor of each from the first stage
        holding it (``local``: this stage's shards by FQN), broadcast to every rank."""
        out = {}
        owners = {}
        for i, s in enumerate(self.plan.stages):
            for ph in s.plan.nodes:
                if ph in placeholders:
                    owners.setdefault(ph, i)
        for ph in sorted(owners):
            fqn = placeholders[ph]
            shape, dtype = self._meta(ph)
            if owners[ph] in self.stages:
                self._enter(owners[ph])
                x = self._full(local[fqn], ph).contiguous()
            else:
                x = torch.empty(shape, dtype=dtype, device=self.device)
            src = self.plan.stages[owners[ph]].ranks[0]
            with named(f"the broadcast of {fqn} from rank {src}"):
                dist.broadcast(x, src=src)
            out[fqn] = x.cpu()
            for alias in self.cg.tied.get(fqn, []):
                out[alias] = out[fqn]
        return out


def _wait(works: list, what: str) -> None:
    """Wait for point-to-point ``works`` (``collectives.named``)."""
    with named(what):
        for w in works:
            w.wait()


def _tag(boundary: int, mb: int, kind: int, k: int) -> int:
    """Message tag: the stage boundary crossed (the receiving stage of an activation), microbatch,
    activation (0) or gradient (1), value index."""
    return ((boundary * 1024 + mb) * 2 + kind) * 1024 + k
