"""Run a pipelined ``Plan``: each rank executes its stage's part of the graph on its submesh.

Every stage is an SPMD program on its own submesh (``runtime/executor.py`` runs its nodes with
the stage's intra-op plan: resharding collectives inside the stage's process groups). Between
stages, values cross as full (replicated) tensors with point-to-point messages
(``torch.distributed.batch_isend_irecv``): the sender all-gathers the value to ``R`` on its
submesh (an autograd-aware ``Reshard``), receiving device ``j`` of the next stage takes it from
sending device ``j mod d_send``, and slices what its consumers want (free). Gradients go back the
same way: sending device ``i`` of the earlier stage takes the full gradient from receiving device
``i mod d_recv``. So stages may have different submesh and logical mesh shapes.

A step: the batch is cut into ``B`` microbatches (dim 0); the schedule (``schedules.py``) gives
each stage its order of forwards and backwards; gradients accumulate over microbatches; then the
deferred data-parallel gradient buckets of each stage are all-reduced, a weight used by several
stages (tied embeddings) gets the sum of their gradients, and one optimizer step runs.

The step's loss is the loss of the whole batch, ``sum_m w_m L_m / Z``, by how the loss reduces
over the batch (``Plan.loss_reduction``, ``losses.py``): a sum adds the microbatch losses
(``w_m = 1``, ``Z = 1``), a mean averages them (``w_m = 1``, ``Z = B``), and a token mean over
valid targets weighs each by its count (``w_m = D_m``, its denominator, ``Z = sum_m D_m``), so
it is the ratio of the summed numerators and denominators. The last stage back-propagates
``w_m L_m``; ``Z`` is known only after the last microbatch, so every rank divides its
accumulated gradients by it before the optimizer step (one broadcast carries loss and ``Z``).

``torch.distributed.pipelining`` is not used: its stages are one module per rank with one
process group, and its schedules drive ``PipelineStage`` objects that exchange tensors of fixed
shapes with one peer each; alpa-lite's stages are slices of one captured graph, each SPMD over a
submesh of its own shape, exchanging several values with several peers. What it shares with
that package is the 1F1B and GPipe orders, restated in ``schedules.py``.
"""
from __future__ import annotations

import datetime
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..plan import Plan, PlanError
from ..planner import gradient_buckets
from ..resharding import forward_steps
from ..runtime.collectives import (
    MeshGroups,
    all_reduce_bucket,
    local_slice,
    reshard,
    run_step,
)
from ..runtime.executor import LocalExecutor
from ..runtime.init import local_constants, local_shards, store_buffer_mutations
from ..spec import ShardingSpec
from ..stages import stage_view
from .schedules import get_schedule


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class _ActivationMeter:
    """Bytes autograd saves for backward, per microbatch in flight; ``peak`` over the step."""

    def __init__(self):
        self.live = 0
        self.peak = 0
        self.per_mb: dict[int, int] = {}
        self._current = None

    def hooks(self, mb: int):
        self._current = mb
        self.per_mb[mb] = 0

        def pack(t):
            self.per_mb[self._current] += t.numel() * t.element_size()
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def forward_done(self, mb: int):
        self.live += self.per_mb[mb]
        self.peak = max(self.peak, self.live)

    def backward_done(self, mb: int):
        self.live -= self.per_mb.pop(mb)


class PipelineTrainer:
    """Pipelined training: ``step(*batch) -> float`` and ``state_dict()`` on every rank.

    Args:
        model: the module (meta or real parameters; ``runtime.init`` semantics).
        captured: the ``CapturedGraph`` of ONE microbatch (the plan's fingerprint).
        plan: a ``Plan`` with ``stages``; their ranks must tile the world.
        optimizer: ``params -> torch.optim.Optimizer`` over this rank's shards (not called on a
            stage without parameters: it has nothing to update).
        timeout_s: timeout of the stage process groups' collectives, seconds (point-to-point
            transfers run on the default group, whose timeout ``init_distributed`` set).

    Attributes:
        stage: this rank's stage index; peak_activation_bytes: the most bytes of tensors saved for
            backward this rank held during the last step (all microbatches in flight).

    Raises:
        PlanError: the plan's stages do not tile the world, or it was made for another model.
    """

    def __init__(self, model, captured, plan: Plan, optimizer: Callable, seed: int = 0, init_fn=None,
                 timeout_s: float = 120.0):
        world, rank = dist.get_world_size(), dist.get_rank()
        all_ranks = sorted(r for s in plan.stages for r in s.ranks)
        if all_ranks != list(range(world)):
            raise PlanError(f"the plan's stages use ranks {all_ranks}; the world has ranks 0 .. {world - 1}")
        if plan.fingerprint != captured.fingerprint():
            raise PlanError("the plan was made for another model or other microbatch shapes "
                            f"(plan graph {plan.fingerprint}, this model {captured.fingerprint()})")
        self.plan, self.cg, self.device = plan, captured, _device()
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.schedule = get_schedule(plan.schedule)
        self.num_stages, self.num_microbatches = len(plan.stages), plan.num_microbatches
        self.stage = next(i for i, s in enumerate(plan.stages) if rank in s.ranks)
        self.sp = plan.stages[self.stage]
        self.reduction = plan.loss_reduction
        if (self.reduction.kind == "ratio" and self.stage == self.num_stages - 1
                and self.reduction.denominator not in (*self.sp.nodes, *self.sp.recv)):
            raise PlanError(f"the loss's denominator {self.reduction.denominator} is not on the last stage")
        self.index = self.sp.ranks.index(rank)  # position in the stage's logical mesh (row-major)
        self.groups = self._make_groups(rank)
        self.view = stage_view(captured, list(self.sp.plan.nodes))
        self.executor = LocalExecutor(self.view, self.sp.plan, self.groups, self.device)
        self.tied_groups = self._tied_groups(rank)
        self.params, self.buffers = local_shards(model, self.view, self.sp.plan, self.groups, self.device, seed,
                                                 init_fn)
        self.constants = local_constants(captured, self.sp.plan, self.groups, self.device)
        self.buckets = gradient_buckets(self.view, self.sp.plan.nodes, self.sp.plan.grad_sync, self.groups.shape,
                                        self.sp.plan.bucket_bytes)
        # a stage holding no trainable parameter (frozen ones only, or none) has no optimizer
        self.optimizer = optimizer(list(self.params.values())) if self.params else None
        self.peak_activation_bytes = 0

    # ---------------------------------------------------------------- process groups
    def _make_groups(self, rank: int) -> MeshGroups:
        """Every stage's axis and flat groups, created by all ranks in the same order; ours kept."""
        mine = [None, None, None]
        coord = None
        for s in self.plan.stages:
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
        return MeshGroups(tuple(self.sp.plan.mesh.shape), coord, (mine[0], mine[1]), mine[2])

    def _tied_groups(self, rank: int) -> dict[str, object]:
        """Parameter placeholder -> group of the ranks of every stage that holds it (when > 1 stage)."""
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
                if self.stage in holders[ph]:
                    out[ph] = g
        return out

    # ---------------------------------------------------------------- parameters
    def _spec(self, placeholder: str) -> ShardingSpec:
        return ShardingSpec.parse(self.sp.plan.nodes[placeholder].out_specs[0])

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
        works = self._p2p([dist.P2POp(dist.irecv, bufs[n], src, tag=_tag(mb, 0, k)) for k, n in enumerate(self.sp.recv)])
        for w in works:
            w.wait()
        return {n: (t.requires_grad_(True) if n in self.cg.requires_grad else t) for n, t in bufs.items()}

    def _send(self, tensors: list[torch.Tensor], peers: list[int], mb: int, kind: int) -> None:
        ops = [dist.P2POp(dist.isend, t.contiguous(), p, tag=_tag(mb, kind, k))
               for p in peers for k, t in enumerate(tensors)]
        self._pending += self._p2p(ops)

    def _next_peers(self) -> list[int]:
        nxt = self.plan.stages[self.stage + 1]
        d = len(self.sp.ranks)
        return [r for j, r in enumerate(nxt.ranks) if j % d == self.index]

    def _prev_peers(self) -> list[int]:
        prev = self.plan.stages[self.stage - 1]
        d = len(self.sp.ranks)
        return [r for i, r in enumerate(prev.ranks) if i % d == self.index]

    # ---------------------------------------------------------------- one step
    def _forward(self, mb: int, batch: list[torch.Tensor], received: dict[str, torch.Tensor]):
        """Run the stage's nodes on microbatch ``mb`` of the flat ``batch`` (``input_names`` order);
        returns (values sent, the microbatch's weighted loss ``w_m L_m`` on the last stage, else None)."""
        size = batch[0].shape[0] // self.num_microbatches
        values: dict[str, object] = {}
        values |= {ph: self.params[fqn] for ph, fqn in self.view.param_fqns.items()}
        values |= {ph: self.buffers[fqn] for ph, fqn in self.view.buffer_fqns.items()}
        values |= self.constants
        for name, x in zip(self.cg.input_names, batch):
            if name in self.view.input_names:
                part = x[mb * size:(mb + 1) * size].to(self.device)
                values[name] = local_slice(part, ShardingSpec.parse(self.sp.plan.input_specs[name]), self.groups)
        values |= received
        for name in self.sp.nodes:
            values[name] = self.executor._call(self.cg.node(name), values)
        store_buffer_mutations(self.view, self.sp.plan, values, self.buffers, self.groups)
        sent = []
        for name in self.sp.send:
            x = values[name]
            if name not in received:  # produced here: gather to the replicated spec that crosses
                spec = self._spec(name)
                shape = self._meta(name)[0]
                x = reshard(x, spec, ShardingSpec.replicated(spec.ndim), () if name in self.cg.requires_grad else None,
                            shape, self.groups)
            sent.append(x)
        if self.stage != self.num_stages - 1:
            return sent, None
        return sent, self._loss_term(values)

    def _loss_term(self, values) -> torch.Tensor | None:
        """``w_m L_m`` of this microbatch (None when ``w_m = 0``: a token mean without a valid
        target adds nothing), recording ``(w_m L_m, w_m)`` for the step's loss."""
        loss = values[self.cg.loss_name]
        name = self.reduction.denominator
        weight = (self.executor.denominators.get(name, values.get(name)) if self.reduction.kind == "ratio"
                  else torch.ones(())).detach().to(loss)
        if not weight:
            self._terms.append((torch.zeros_like(loss), weight))
            return None
        term = loss * weight
        self._terms.append((term.detach(), weight))
        return term

    def step(self, *batch, **kwargs) -> float:
        """One training step on the global ``batch`` (inputs then targets, then the model's keyword
        inputs ``kwargs``; structured as the example inputs, the same on every rank).

        Returns:
            the loss of the whole batch (float, equal on all ranks): ``sum_m w_m L_m / Z``
            (module docstring).

        Raises:
            ValueError: the batch's structure is not the captured one, or it does not split into
                the plan's microbatches.
        """
        batch = self.cg.flat_inputs(batch, kwargs)
        for name, x in zip(self.cg.input_names, batch):
            expect = tuple(self.cg.node(name).meta["val"].shape)
            if (x.shape[0] != expect[0] * self.num_microbatches) or tuple(x.shape[1:]) != expect[1:]:
                raise ValueError(f"input {name} has shape {tuple(x.shape)}; the plan takes {self.num_microbatches} "
                                 f"microbatches of {expect}")
        for p in self.params.values():
            p.grad = None
        self._pending = []
        meter = _ActivationMeter()
        saved: dict[int, tuple] = {}
        self._terms = []
        received: dict[int, dict[str, torch.Tensor]] = {}
        for action in self.schedule.actions(self.stage, self.num_stages, self.num_microbatches):
            mb = action.microbatch
            if action.kind == "recv_act":
                received[mb] = self._recv_acts(mb)
            elif action.kind == "forward":
                with meter.hooks(mb):
                    saved[mb] = self._forward(mb, batch, received.get(mb, {}))
                meter.forward_done(mb)
            elif action.kind == "send_act":
                self._send([t.detach() for t in saved[mb][0]], self._next_peers(), mb, 0)
            elif action.kind == "recv_grad":
                saved[mb] = saved[mb] + (self._recv_grads(mb, saved[mb][0]),)
            elif action.kind == "backward":
                sent, term, *grads = saved.pop(mb)
                if self.stage == self.num_stages - 1:
                    if term is not None:
                        term.backward()
                else:
                    pairs = [(t, g) for t, g in zip(sent, grads[0]) if t.requires_grad]
                    if pairs:
                        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
                meter.backward_done(mb)
            elif action.kind == "send_grad":
                leaves = received.pop(mb)
                out = [(t.grad if t.grad is not None else torch.zeros_like(t)) for n, t in leaves.items()
                       if n in self.cg.requires_grad]
                self._send(out, self._prev_peers(), mb, 1)
        for w in self._pending:
            w.wait()
        self._pending = []
        self.peak_activation_bytes = meter.peak
        loss, z = self._broadcast_loss()
        if z not in (0.0, 1.0):
            for p in self.params.values():
                if p.grad is not None:
                    p.grad.div_(z)
        self._sync_gradients()
        if self.optimizer is not None:
            self.optimizer.step()
        return loss

    def _recv_grads(self, mb: int, sent: list[torch.Tensor]) -> list[torch.Tensor | None]:
        nxt = self.plan.stages[self.stage + 1]
        src = nxt.ranks[self.index % len(nxt.ranks)]
        bufs = [torch.empty_like(t) if t.requires_grad else None for t in sent]
        ops, k = [], 0
        for n, b in zip(self.sp.send, bufs):
            if b is not None:
                ops.append(dist.P2POp(dist.irecv, b, src, tag=_tag(mb, 1, k)))
                k += 1
        for w in self._p2p(ops):
            w.wait()
        return bufs

    def _sync_gradients(self) -> None:
        for axes, members in self.buckets:  # deferred data-parallel gradients inside the stage
            params = [self.params[self.view.param_fqns[ph]] for ph in members]
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            all_reduce_bucket([p.grad for p in params], axes, self.groups)
        for ph, group in self.tied_groups.items():  # a weight several stages use: sum their gradients
            p = self.params[self.view.param_fqns[ph]]
            spec = self._spec(ph)
            full = self._full(p.grad if p.grad is not None else torch.zeros_like(p), spec, ph)
            if self.index != 0:  # every rank of a stage holds the same full gradient: count it once
                full = torch.zeros_like(full)
            dist.all_reduce(full, group=group)
            p.grad = local_slice(full, spec, self.groups).clone()

    def _full(self, x: torch.Tensor, spec: ShardingSpec, placeholder: str) -> torch.Tensor:
        shape = tuple(self.cg.node(placeholder).meta["val"].shape)
        with torch.no_grad():
            for st in forward_steps(spec, ShardingSpec.replicated(spec.ndim), shape, x.element_size(), self.groups.shape):
                x = run_step(x, st, self.groups, "gather")
        return x

    def _broadcast_loss(self) -> tuple[float, float]:
        """``(loss, Z)`` of the step from the last stage (module docstring), on every rank."""
        value = torch.zeros(2, device=self.device)
        if self._terms:
            terms, weights = (torch.stack(x) for x in zip(*self._terms))
            z = torch.ones_like(weights[0]) if self.reduction.kind == "sum" else weights.sum()
            value = torch.stack([terms.sum() / z, z]).to(value)
        dist.broadcast(value, src=self.plan.stages[-1].ranks[0])
        return float(value[0]), float(value[1])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters and buffers by FQN (tied names included), on every rank."""
        return self._gather({**self.params, **self.buffers}, {**self.cg.param_fqns, **self.cg.buffer_fqns})

    def gradients(self) -> dict[str, torch.Tensor]:
        """Full gradients of the last step by parameter FQN (tied names included; zeros where a
        parameter got none), after their synchronization; on every rank."""
        grads = {fqn: p.grad if p.grad is not None else torch.zeros_like(p) for fqn, p in self.params.items()}
        return self._gather(grads, self.cg.param_fqns)

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
            if owners[ph] == self.stage:
                x = self._full(local[fqn].detach(), self._spec(ph), ph).contiguous()
            else:
                x = torch.empty(shape, dtype=dtype, device=self.device)
            dist.broadcast(x, src=self.plan.stages[owners[ph]].ranks[0])
            out[fqn] = x.cpu()
            for alias in self.cg.tied.get(fqn, []):
                out[alias] = out[fqn]
        return out


def _tag(mb: int, kind: int, k: int) -> int:
    """Message tag: microbatch, activation (0) or gradient (1), value index."""
    return (mb * 2 + kind) * 1024 + k


def pipeline_trainer(model, example_inputs: tuple, loss_fn, targets: tuple, plan: Plan, optimizer, seed: int,
                     init_fn, timeout_s: float = 120.0, example_kwargs: dict | None = None) -> PipelineTrainer:
    """``parallelize``'s path for a plan with stages: capture one microbatch and build the trainer
    (``optimizer`` None: AdamW(lr=1e-3))."""
    from ..capture import batch_size, capture, rows

    b = plan.num_microbatches
    batch = batch_size((example_inputs, example_kwargs))
    if batch % b:
        raise PlanError(f"the plan splits the batch into {b} microbatches; the example batch is {batch}")
    captured = capture(model, rows(tuple(example_inputs), 0, batch // b), loss_fn, rows(tuple(targets), 0, batch // b),
                       rows(example_kwargs, 0, batch // b))
    optimizer = optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-3))
    return PipelineTrainer(model, captured, plan, optimizer, seed, init_fn, timeout_s)
