"""Collectives as autograd functions with explicit backward duals (docs/runtime.md).

``Reshard`` runs the forward steps of ``resharding.forward_steps`` and, in backward, the steps of
``resharding.backward_steps``: the same plan the cost model priced. ``AllReducePartial`` reduces
an op's partial result (forward all-reduce, backward identity). Every issued collective is
counted in ``COUNTS`` by (kind, phase), so a test can compare a step with the plan's list.
While :func:`set_timing` is on, each one is also timed into ``SECONDS`` (seconds by (kind,
phase)), from before its first buffer copy to the end of the call: gloo calls block; on CUDA the
device is synchronized before and after, so the time is the collective's alone (queued compute
excluded), waiting for the slowest peer included.

Inside :func:`functional_collectives` the same collectives are issued as
``torch.distributed._functional_collectives`` ops instead (out of place, traceable by
``make_fx`` / ``torch.compile``; ``runtime/program.py`` lowers a step to a graph with them), and
are not counted: tracing a step issues nothing.
"""
from __future__ import annotations

import math
import time
import weakref
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..core.resharding import Step, backward_steps, forward_steps
from . import launch
from ..core.spec import ShardingSpec

COUNTS: Counter = Counter()
SECONDS: Counter = Counter()
_timing = False
_functional = False  # collectives issued as functional collective ops (traceable), not counted
_recomputing = False  # inside a checkpointed layer's recomputation: its forward collectives count as "recompute"


def set_timing(enabled: bool) -> None:
    """Start (True) or stop (False) timing every issued collective into ``SECONDS``."""
    global _timing
    _timing = bool(enabled)


def synchronize_device() -> None:
    """Wait for the device's queued kernels (CUDA); a no-op on CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@contextmanager
def recomputing():
    """While open, collectives issued as ``"forward"`` count (and time) as ``"recompute"``: a
    checkpointed layer's forward run again in backward (the plan's ``"recompute"`` phase)."""
    global _recomputing
    before, _recomputing = _recomputing, True
    try:
        yield
    finally:
        _recomputing = before


@contextmanager
def functional_collectives():
    """While open, every collective is a ``torch.distributed._functional_collectives`` op (a
    ``_c10d_functional`` op and its ``wait_tensor`` in a traced graph), uncounted; the values
    are the same as the eager ``torch.distributed`` calls'."""
    global _functional
    before, _functional = _functional, True
    try:
        yield
    finally:
        _functional = before


def functional() -> bool:
    """Whether collectives are issued as functional collectives now (inside ``functional_collectives``)."""
    return _functional


@contextmanager
def _issued(kind: str, phase: str, axes: tuple[int, ...] | None = None, what: str = ""):
    """Count one collective of ``kind`` in ``phase`` (over mesh ``axes``, moving ``what``); time
    it into ``SECONDS`` while timing is on.

    Raises:
        RuntimeError: the collective failed or timed out (a peer died or stopped); the message
            names this rank, the collective and its mesh axes.
    """
    if _recomputing and phase == "forward":
        phase = "recompute"
    COUNTS[(kind, phase)] += 1
    try:
        if not _timing:
            yield
            return
        synchronize_device()
        t0 = time.perf_counter()
        yield
        synchronize_device()
        SECONDS[(kind, phase)] += time.perf_counter() - t0
    except RuntimeError as e:
        raise failed(f"the {kind} {what or 'in ' + phase} over mesh axes {axes}", e) from e


def failed(what: str, error: Exception) -> RuntimeError:
    """The error of a collective ``what`` that failed with ``error``: it names this rank and, by
    their heartbeats (``launch.silent_ranks``, a few seconds), the ranks that died or stopped."""
    silent = launch.silent_ranks()
    who = f"; silent (died or stopped): rank{'s'[:len(silent) > 1]} {', '.join(map(str, silent))}" if silent else ""
    return RuntimeError(f"rank {dist.get_rank()}: {what} failed (a peer died, stopped or timed out){who}: {error}")


@contextmanager
def named(what: str):
    """A communication's failure (a peer died, stopped or timed out) inside the block raised as
    a ``RuntimeError`` naming this rank and ``what`` it waited on (``failed``); memory errors are
    raised as they are."""
    try:
        yield
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as e:
        raise failed(what, e) from e


@dataclass(frozen=True)
class MeshGroups:
    """This rank's view of the 2D mesh: its coordinate, the process group of each axis (group
    rank = coordinate along that axis) and the group of the whole mesh."""

    shape: tuple[int, int]
    coord: tuple[int, int]
    groups: tuple[object, object]
    flat: object = None

    def group(self, axes: tuple[int, ...]):
        """The process group spanning ``axes`` (one axis, or both: the flattened mesh)."""
        return self.groups[axes[0]] if len(axes) == 1 else self.flat

    def shard_index(self, entry: tuple[int, ...]) -> int:
        """Which chunk of a dim split along ``entry`` (major axis first) this rank holds."""
        index = 0
        for axis in entry:
            index = index * self.shape[axis] + self.coord[axis]
        return index


def local_slice(x: torch.Tensor, spec: ShardingSpec, mesh: MeshGroups) -> torch.Tensor:
    """This rank's shard of a full tensor ``x`` under ``spec`` (no communication); of a partial
    ``spec``, the shard at coordinate 0 along its partial axes and zeros elsewhere."""
    for d, entry in enumerate(spec.dims):
        if entry:
            n = spec.shards(d, mesh.shape)
            x = x.chunk(n, dim=d)[mesh.shard_index(entry)]
    if any(mesh.coord[a] for a in spec.partial):
        x = torch.zeros_like(x)
    return x.contiguous()


def _chunks(x: torch.Tensor, n: int, dim: int) -> list[torch.Tensor]:
    return [c.contiguous() for c in x.chunk(n, dim=dim)]


def run_step(x: torch.Tensor, step: Step, mesh: MeshGroups, phase: str) -> torch.Tensor:
    """Execute one resharding step on the local tensor ``x``."""
    n, group = mesh.shape[step.axis], mesh.groups[step.axis]
    if step.kind == "slice":
        return _chunks(x, n, step.dim)[mesh.coord[step.axis]]
    if step.kind == "mask":
        return x if mesh.coord[step.axis] == 0 else torch.zeros_like(x)
    if step.kind not in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"):
        raise ValueError(f"unknown resharding step {step.kind}")
    if _functional:
        return _functional_step(x, step, n, group)
    with _issued(step.kind, phase, (step.axis,)):
        if step.kind == "all-reduce":
            x = x.contiguous().clone()
            dist.all_reduce(x, group=group)
            return x
        if step.kind == "all-gather":
            parts = [torch.empty_like(x) for _ in range(n)]
            dist.all_gather(parts, x.contiguous(), group=group)
            return torch.cat(parts, dim=step.dim)
        if step.kind == "reduce-scatter":
            parts = _chunks(x, n, step.dim)
            out = torch.empty_like(parts[0])
            dist.reduce_scatter(out, parts, group=group)
            return out
        send = _chunks(x, n, step.dim2)
        recv = [torch.empty_like(send[0]) for _ in range(n)]
        dist.all_to_all(recv, send, group=group)
        return torch.cat(recv, dim=step.dim)


def _functional_step(x: torch.Tensor, step: Step, n: int, group) -> torch.Tensor:
    """``run_step``'s collective as a functional collective op over ``group`` (``n`` devices)."""
    if step.kind == "all-reduce":
        return funcol.all_reduce(x, "sum", group)
    if step.kind == "all-gather":
        return funcol.all_gather_single(x.contiguous(), step.dim, group)
    if step.kind == "reduce-scatter":
        return funcol.reduce_scatter_single(x.contiguous(), "sum", step.dim, group)
    recv = funcol.all_to_all_single(torch.stack(_chunks(x, n, step.dim2)), None, None, group)
    return torch.cat(recv.unbind(0), dim=step.dim)


def gather_full(x: torch.Tensor, spec: ShardingSpec, shape: tuple[int, ...], mesh: MeshGroups) -> torch.Tensor:
    """The full tensor of global ``shape`` from this rank's shard ``x`` stored in ``spec``
    (all-gathers along the split axes; no autograd)."""
    with torch.no_grad():
        for step in forward_steps(spec, ShardingSpec.replicated(spec.ndim), shape, x.element_size(), mesh.shape):
            x = run_step(x, step, mesh, "gather")
    return x


def all_reduce_async(flat: torch.Tensor, axes: tuple[int, ...], mesh: MeshGroups, phase: str = "backward"):
    """Start summing ``flat`` in place over the devices of ``axes`` (a gradient bucket's
    concatenation, as DDP does; in ``phase`` "forward": a loss's, ``executor.LocalExecutor``);
    returns the work handle to ``wait()`` on. While timing is on it is waited on here, so
    ``SECONDS`` holds the all-reduce's own time (and backward does not overlap it)."""
    with _issued("all-reduce", phase):
        work = dist.all_reduce(flat, group=mesh.group(axes), async_op=True)
        if _timing:
            work.wait()
    return work


def reduce_scatter_async(flat: torch.Tensor, axes: tuple[int, ...], mesh: MeshGroups):
    """Start one reduce-scatter over the devices of ``axes`` (``async_op=True``): ``flat``
    (``n`` equal 1-D parts, one per group rank, concatenated) is what this rank contributes;
    returns ``(work, out)``, ``out`` holding the group's sum of the parts for this rank once
    ``work`` is waited on (ZeRO-2's gradient bucket). While timing is on it is waited on here,
    as ``all_reduce_async``."""
    out = flat.new_empty(flat.numel() // math.prod(mesh.shape[a] for a in axes))
    with _issued("reduce-scatter", "backward", axes, "of a gradient bucket"):
        work = dist.reduce_scatter_single(out, flat, group=mesh.group(axes), async_op=True)
        if _timing:
            work.wait()
    return work, out


def all_gather_async(x: torch.Tensor, dim: int, axes: tuple[int, ...], mesh: MeshGroups, phase: str):
    """Start all-gathering ``x`` along ``dim`` over the devices of ``axes`` (``async_op=True``);
    returns a function that waits and returns the concatenation. While timing is on it is waited
    on here, as ``all_reduce_async``."""
    parts = [torch.empty_like(x) for _ in range(math.prod(mesh.shape[a] for a in axes))]
    with _issued("all-gather", phase):
        work = dist.all_gather(parts, x.contiguous(), group=mesh.group(axes), async_op=True)
        if _timing:
            work.wait()
    _in_flight.append(work)

    def wait() -> torch.Tensor:
        _done(work, f"the all-gather ({phase}) over mesh axes {axes}")
        return torch.cat(parts, dim=dim)
    return wait


def _done(work, what: str) -> None:
    """Wait on an async all-gather ``what`` and forget its handle (and the buffers it holds).

    Raises:
        RuntimeError: it failed or timed out; the message names this rank.
    """
    try:
        work.wait()
    except RuntimeError as e:
        raise failed(what, e) from e
    if work in _in_flight:
        _in_flight.remove(work)


_in_flight: list = []  # the async all-gathers issued since the last ``wait_all_gathers``


def wait_all_gathers() -> None:
    """Wait on every async all-gather issued since the last call, at the end of a step: one whose
    use never came (a prefetched copy whose readers run no backward) is done before the step
    returns, not still in flight when the process exits (gloo aborts the process then)."""
    while _in_flight:
        _in_flight.pop().wait()


def all_gather_bucket(part: torch.Tensor, axes: tuple[int, ...], mesh: MeshGroups, phase: str = "update"
                      ) -> list[torch.Tensor]:
    """One all-gather over the devices of ``axes``: every group rank's ``part`` (equal 1-D
    tensors), in group-rank order (ZeRO-1/2's updated parameters after the optimizer step)."""
    parts = [torch.empty_like(part) for _ in range(math.prod(mesh.shape[a] for a in axes))]
    with _issued("all-gather", phase):
        dist.all_gather(parts, part.contiguous(), group=mesh.group(axes))
    return parts


class Reshard(torch.autograd.Function):
    """Move a local shard from spec ``src`` to ``dst``; backward reduces the gradient's partial
    sums along ``grad_partial`` and moves it back to ``src``. A ZeRO-3 use's ``copy`` runs the
    forward steps (its first may be prefetched) and is freed in backward: every reader's has run."""

    @staticmethod
    def forward(ctx, x, src, dst, grad_partial, shape, mesh, copy=None):
        ctx.args = (src, dst, grad_partial, shape, mesh, copy)
        if copy is not None:
            return copy.run(x, "forward")
        for step in forward_steps(src, dst, shape, x.element_size(), mesh.shape):
            x = run_step(x, step, mesh, "forward")
        return x

    @staticmethod
    def backward(ctx, grad):
        src, dst, grad_partial, shape, mesh, copy = ctx.args
        if copy is not None:
            copy.full = None
            if copy.group is not None:  # summed by the group's one reduce-scatter, into the parameter's .grad
                copy.group.gradient(copy.index, grad)
                return None, None, None, None, None, None, None
        for step in backward_steps(src, dst, grad_partial or (), shape, grad.element_size(), mesh.shape):
            grad = run_step(grad, step, mesh, "backward")
        return grad, None, None, None, None, None, None


class _Copy:
    """One ZeRO-3 move of a run: the shard, the move and its steps, a weak reference to the
    forward's gathered copy, the copy gathered again in backward (``full``, None outside
    backward), the first step's all-gather when prefetched (``pending``: wait, then the tensor),
    and the ``GatheredParameters`` whose next backward gather this one's prefetches."""

    __slots__ = ("shard", "move", "steps", "forward", "full", "pending", "owner", "regathered", "group", "index",
                 "__weakref__")

    def __init__(self, shard, move, owner, group: GatherGroup | None = None, index: int = 0):
        src, dst, shape, mesh = move
        self.shard, self.move, self.owner = shard.detach(), move, owner
        self.steps = forward_steps(src, dst, shape, shard.element_size(), mesh.shape)
        self.forward = self.full = self.pending = None
        self.regathered = False  # backward's gather issued
        self.group, self.index = group, index  # a member of a GatherGroup: its all-gather and reduce-scatter

    def prefetch(self, phase: str) -> None:
        """Issue the first step now when it is an all-gather (``async_op=True``), waited on by ``run``."""
        if self.group is not None:
            self.group.issue(phase)
        elif self.steps[0].kind == "all-gather":
            self.pending = all_gather_async(self.shard, self.steps[0].dim, (self.steps[0].axis,), self.move[3], phase)

    def run(self, x: torch.Tensor, phase: str) -> torch.Tensor:
        """``x`` (the shard) moved: the prefetched first step waited on, the others run now."""
        if self.group is not None:
            return self.group.full(self.index, phase)
        steps = self.steps
        if self.pending is not None:
            x, steps, self.pending = self.pending(), steps[1:], None
        for step in steps:
            x = run_step(x, step, self.move[3], phase)
        return x

    def gather(self) -> torch.Tensor:
        """The gathered copy in backward, gathered once; then the next one is prefetched."""
        if self.full is None:
            self.regathered = True
            with torch.no_grad():
                self.full = self.run(self.shard, "backward")
            self.owner.prefetch_backward()
        return self.full

    def prehook(self, grad_outputs):
        self.gather()


def _copy_out(flat: torch.Tensor, shapes: list, dims: list[int], n: int) -> list[torch.Tensor]:
    """The gathered copies of a ZeRO-3 group's members from its flat all-gather ``flat``
    (``n`` rows, one per group rank, each the members' shards of ``shapes`` concatenated, 1-D):
    member ``j``'s is its shard with dim ``dims[j]`` ``n`` times longer (FSDP's copy-out)."""
    rows = flat.view(n, -1)
    fulls, offset = [], 0
    for local, d in zip(shapes, dims):
        size = math.prod(local)
        part = rows[:, offset:offset + size].view(n, *local)
        fulls.append(part.movedim(0, d).reshape(*local[:d], n * local[d], *local[d + 1:]))
        offset += size
    return fulls


def _in_rank_order(grads: list, shards: list[torch.Tensor], dims: list[int], n: int) -> torch.Tensor:
    """The input ``(n, total)`` of a ZeRO-3 group's gradient reduce-scatter: row ``j`` holds
    every member's chunk ``j`` of its gradient (gathered shape, ``grads[i]``) along its gathered
    dim ``dims[i]``, flattened and concatenated in member order (a member whose readers' backward
    never came, None: zeros of its shard ``shards[i]``)."""
    parts = [torch.zeros(n, s.numel(), dtype=s.dtype, device=s.device) if g is None
             else g.unflatten(d, (n, g.shape[d] // n)).movedim(d, 0).reshape(n, -1)
             for g, s, d in zip(grads, shards, dims)]
    return torch.cat(parts, dim=1)


class GroupGather(torch.autograd.Function):
    """A ZeRO-3 group's flat collectives in a traced step (``functional_collectives``;
    ``runtime/program.py``): forward, the members' shards (the same dtype, 1-D concatenated)
    all-gathered by one functional ``all_gather_single`` over mesh ``axis`` and copied out
    (``_copy_out``); backward, their gradients summed by one functional ``reduce_scatter_single``
    (``_in_rank_order``), each member's part its shard's gradient. The collectives and layout of
    ``GatherGroup``, without its re-gather in backward: a traced step keeps the gathered copies."""

    @staticmethod
    def forward(ctx, dims, axis, mesh, *shards):
        ctx.args = (dims, axis, mesh)
        ctx.shards = [s.detach() for s in shards]
        flat = torch.cat([s.reshape(-1) for s in shards])
        out = funcol.all_gather_single(flat, 0, mesh.groups[axis])
        return tuple(_copy_out(out, [s.shape for s in shards], dims, mesh.shape[axis]))

    @staticmethod
    def backward(ctx, *grads):
        dims, axis, mesh = ctx.args
        flat = _in_rank_order(list(grads), ctx.shards, dims, mesh.shape[axis])
        out = funcol.reduce_scatter_single(flat.reshape(-1), "sum", 0, mesh.groups[axis])
        parts, offset = [], 0
        for s in ctx.shards:
            parts.append(out[offset:offset + s.numel()].view(s.shape))
            offset += s.numel()
        return (None, None, None, *parts)


class GatherGroup:
    """One run's flat collectives of a ZeRO-3 group (``core.plan.zero3_groups``): the members'
    shards (1-D concatenated, as FSDP's flat parameter: Zhao et al., VLDB 2023, section 3.2)
    all-gathered by one ``all_gather_single`` over mesh ``axis`` (forward, and again in backward),
    and their gradients summed by one ``reduce_scatter_single``, issued asynchronously once every
    member's gradient has arrived in backward and waited on by ``finish_gradients`` before the
    optimizer step, which adds each member's part to its parameter's ``.grad`` (cast to the
    parameter's dtype: the dual of a low-precision cast).

    Args:
        shards: each member's local shard (the same dtype); dims: the dim each is gathered along
            (its gathered copy is the shard with that dim ``n`` times longer, ``n`` the devices of
            ``axis``); params: the parameter (an autograd leaf) whose gradient each member's is;
            axis, mesh: the mesh axis and this rank's ``MeshGroups``.
    """

    def __init__(self, shards: list[torch.Tensor], dims: list[int], params: list[torch.Tensor], axis: int,
                 mesh: MeshGroups):
        self.shards, self.dims, self.params = [s.detach() for s in shards], dims, params
        self.axis, self.mesh, self.n = axis, mesh, mesh.shape[axis]
        self.sizes = [s.numel() for s in self.shards]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.total = sum(self.sizes)
        self.copies: list[_Copy | None] = [None] * len(shards)
        self._work = self._out = None
        self._phase = None  # the phase of the last all-gather issued
        self._fulls: list[torch.Tensor | None] = []  # the last gather's copies not taken yet
        self._grads: list[torch.Tensor | None] = [None] * len(shards)
        self._reduce = None  # (work, output) of the gradients' reduce-scatter
        self.done = False  # its gradients added into the parameters'

    def issue(self, phase: str) -> bool:
        """Start the all-gather of phase ``phase`` (``async_op=True``), once per phase; whether it
        started now."""
        if self._phase == phase:
            return False
        if phase == "backward":
            for c in self.copies:
                if c is not None:
                    c.regathered = True
        flat = torch.cat([s.reshape(-1) for s in self.shards])
        self._out = flat.new_empty(self.n * self.total)
        with _issued("all-gather", phase, (self.axis,), "of a ZeRO-3 group"):
            self._work = dist.all_gather_single(self._out, flat, group=self.mesh.groups[self.axis], async_op=True)
            if _timing:
                self._work.wait()
        _in_flight.append(self._work)
        self._phase, self._fulls = phase, []
        return True

    def full(self, i: int, phase: str) -> torch.Tensor:
        """Member ``i``'s gathered copy from the all-gather of ``phase`` (issued now if it was not
        prefetched). The first one waits, copies every member's out of the flat buffer and drops
        it (FSDP's copy-out); each member then takes its own."""
        self.issue(phase)
        if self._work is not None:
            _done(self._work, f"the all-gather of a ZeRO-3 group ({phase}) over mesh axes ({self.axis},)")
            self._work = None
            self._fulls = _copy_out(self._out, [s.shape for s in self.shards], self.dims, self.n)
            self._out = None
        full, self._fulls[i] = self._fulls[i], None
        return full

    def gradient(self, i: int, grad: torch.Tensor) -> None:
        """Member ``i``'s gradient (gathered shape) arrived in backward; the reduce-scatter starts
        with the last one."""
        if self not in _reducing:
            _reducing.append(self)
        self._grads[i] = grad
        if all(g is not None for g in self._grads):
            self._launch()

    def _launch(self) -> None:
        """Start the reduce-scatter, once the one started before it is done (its input freed: at
        most two groups' gradients in flight, as FSDP)."""
        for other in _reducing:
            if other is not self and other._reduce is not None:
                other.finish()
        g = self._grads[0]
        if len(self.shards) == 1 and self.dims[0] == 0 and g is not None and g.is_contiguous():
            flat = g.view(self.n, self.total)  # one member split on dim 0: already laid out by rank
        else:
            flat = _in_rank_order(self._grads, self.shards, self.dims, self.n)
        self._grads = [None] * len(self.shards)
        out = flat.new_empty(self.total)
        with _issued("reduce-scatter", "backward", (self.axis,), "of a ZeRO-3 group's gradients"):
            work = dist.reduce_scatter_single(out, flat.view(-1), group=self.mesh.groups[self.axis], async_op=True)
            if _timing:
                work.wait()
        self._reduce = (work, out)

    def finish(self) -> None:
        """Start the reduce-scatter if some member's gradient never came, wait, and add each
        member's part into its parameter's ``.grad``."""
        if self._reduce is None:
            self._launch()
        (work, out), self._reduce = self._reduce, None
        try:
            work.wait()
        except RuntimeError as e:
            raise failed(f"the reduce-scatter of a ZeRO-3 group's gradients over mesh axes ({self.axis},)", e) from e
        for i, p in enumerate(self.params):
            g = out[self.offsets[i]:self.offsets[i] + self.sizes[i]].view(self.shards[i].shape).to(p.dtype)
            p.grad = g if p.grad is None else p.grad + g
        self.done = True


_reducing: list[GatherGroup] = []  # groups of this step that received gradients, in the order they did


def finish_gradients() -> None:
    """Wait on the ZeRO-3 groups' gradient reduce-scatters of this step (``GatherGroup``),
    starting those some of whose gradients never came, in one order on every rank, and add the
    sums into the parameters' gradients; call after the last backward, before the optimizer."""
    groups = [g for g in _reducing if not g.done]
    _reducing.clear()
    for group in groups:
        group.finish()


@dataclass(frozen=True)
class _SavedView:
    """What autograd saves in place of a view of a gathered copy: the copy and the view's geometry."""

    copy: _Copy
    size: tuple
    stride: tuple
    offset: int


class GatheredParameters:
    """The ZeRO-3 parameter copies gathered in one forward run, not kept for backward
    (``resharding.regathers``; ZeRO-3, Rajbhandari et al., SC'20, section 5; FSDP's
    ``reshard_after_forward=True``). Under ``hooks()``, a tensor autograd saves that is (a view
    of) a live gathered copy is saved as its shard and the view's geometry instead. In backward
    the copy is gathered again once per move (phase ``"backward"``), when the first backward node
    of an op that read it (or a view of it) is about to run: a pre-hook on that op's result,
    whether or not its backward reads the copy (as FSDP's pre-backward unshard), so the count is
    the plan's; the move's own backward, which runs after every reader's, frees it.

    Prefetch (ZeRO-3's, section 5; FSDP's ``forward_prefetch`` / ``backward_prefetch``): the
    caller prefetches the next move's all-gather once a move is done in forward (``prefetch``),
    and each gather in backward prefetches the next one backward will want, taking the readers
    in the reverse of their forward order (each reader's copies in operand order, the order of
    its pre-hooks); a move waits on its prefetched all-gather before its first use. Same
    collectives, same values, one move early."""

    def __init__(self):
        self._copies: dict[int, _Copy] = {}  # storage address of a gathered copy -> its move
        self._prefetched: dict[tuple, _Copy] = {}  # key -> a move whose first all-gather is in flight
        self._order: list[_Copy] = []  # stack: the copies backward will gather, the next one last
        self.groups: dict[int, GatherGroup] = {}  # this run's ZeRO-3 groups by index, once started
        self.started: set[tuple] = set()  # keys of the uses moved alone whose move started (prefetched or run)

    def start_group(self, g: int, make) -> None:
        """Start group ``g``'s forward all-gather, once per run (``make()``: its ``GatherGroup``)."""
        if g not in self.groups:
            self.groups[g] = make()
            self.groups[g].issue("forward")

    def prefetch(self, key: tuple, x, src, dst, shape, mesh) -> None:
        """Start the move ``key`` of shard ``x`` (``src`` -> ``dst``) ahead of its ``move``."""
        copy = self._prefetched[key] = _Copy(x, (src, dst, tuple(shape), mesh), self)
        self.started.add(key)
        copy.prefetch("forward")

    def prefetch_backward(self) -> None:
        """Start the backward gather of the next copy on the stack not gathered again yet."""
        while self._order and self._order[-1].regathered:
            self._order.pop()
        if self._order:
            copy = self._order.pop()
            copy.regathered = True
            copy.prefetch("backward")

    def move(self, key: tuple, x, src, dst, grad_partial, shape, mesh, member=None) -> torch.Tensor:
        """``reshard`` of a ZeRO-3 use ``key`` (``x``: the shard in ``src``), its copy registered;
        ``member``: ``(group index, position)`` when the use is a member of a started group."""
        copy = self._prefetched.pop(key, None)
        self.started.add(key)
        if copy is None and member is not None:
            group = self.groups[member[0]]
            copy = group.copies[member[1]] = _Copy(x, (src, dst, tuple(shape), mesh), self, group, member[1])
        copy = copy or _Copy(x, (src, dst, tuple(shape), mesh), self)
        full = Reshard.apply(x, src, dst, tuple(grad_partial), tuple(shape), mesh, copy)
        if full.untyped_storage().nbytes():
            copy.forward = weakref.ref(full)
            self._copies[full.untyped_storage().data_ptr()] = copy
        return full

    def _copy_of(self, t) -> _Copy | None:
        if not isinstance(t, torch.Tensor) or not self._copies:
            return None
        copy = self._copies.get(t.untyped_storage().data_ptr())
        return copy if copy is not None and copy.forward() is not None else None  # not a freed copy's address

    def read(self, inputs, out) -> None:
        """An op read ``inputs`` and returned ``out`` (a tensor or a tuple): a pre-hook on each of
        its results' backward nodes gathers the copies it read again."""
        # in operand order (as on every rank), the order backward will gather them in
        copies = dict.fromkeys(c for c in map(self._copy_of, inputs) if c is not None)
        self._order.extend(reversed(copies))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if copies and isinstance(t, torch.Tensor) and t.grad_fn is not None:
                for copy in copies:
                    t.grad_fn.register_prehook(copy.prehook)

    def pack(self, t):
        copy = self._copy_of(t)
        return t if copy is None else _SavedView(copy, t.size(), t.stride(), t.storage_offset())

    @staticmethod
    def unpack(saved):
        if isinstance(saved, _SavedView):
            return saved.copy.gather().as_strided(saved.size, saved.stride, saved.offset)
        return saved

    def hooks(self):
        """The saved-tensor hooks of ``pack`` / ``unpack`` (``torch.autograd.graph.saved_tensors_hooks``)."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class AllReducePartial(torch.autograd.Function):
    """Sum a partial result over mesh ``axes`` (forward all-reduce; backward identity)."""

    @staticmethod
    def forward(ctx, x, axes, mesh):
        return _all_reduce(x, axes, mesh, "forward", dist.ReduceOp.SUM)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class AllReduceShared(torch.autograd.Function):
    """Sum a tensor over mesh ``axes`` where every device goes on to use the sum differently (a
    synchronized batch norm's statistics over a split batch): forward all-reduce, backward
    all-reduce of the gradient (each device's use contributes to it)."""

    @staticmethod
    def forward(ctx, x, axes, mesh):
        ctx.args = (axes, mesh)
        return _all_reduce(x, axes, mesh, "forward", dist.ReduceOp.SUM)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, *ctx.args, "backward", dist.ReduceOp.SUM), None, None


def _all_reduce(x: torch.Tensor, axes, mesh: MeshGroups, phase: str, op) -> torch.Tensor:
    """``x`` reduced by ``op`` over the devices of mesh ``axes``: one all-reduce on their group
    (``MeshGroups.group``; both axes: the flattened mesh), as the plan lists it."""
    if not axes:
        return x
    if _functional:
        return funcol.all_reduce(x, {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max"}[op], mesh.group(axes))
    x = x.contiguous().clone()
    with _issued("all-reduce", phase, tuple(axes)):
        dist.all_reduce(x, op=op, group=mesh.group(axes))
    return x


def all_reduce_sum(x: torch.Tensor, axes: tuple[int, ...], mesh: MeshGroups, phase: str = "backward") -> torch.Tensor:
    """The sum of ``x`` over the devices of mesh ``axes`` (no autograd), a new tensor: one
    all-reduce, a functional collective inside ``functional_collectives`` (a compiled program's
    gradient bucket, ``program.py``)."""
    with torch.no_grad():
        return _all_reduce(x, axes, mesh, phase, dist.ReduceOp.SUM)


def all_reduce_max(x: torch.Tensor, axes: tuple[int, ...], mesh: MeshGroups) -> torch.Tensor:
    """The elementwise max of ``x`` over the devices of mesh ``axes`` (no gradient)."""
    with torch.no_grad():
        return _all_reduce(x, axes, mesh, "forward", dist.ReduceOp.MAX)


def disagree(shape, needs_grad: bool) -> RuntimeError:
    """The error for an operand whose ``requires_grad`` is not the plan's (``needs_grad``)."""
    return RuntimeError(f"plan and autograd disagree on whether a {tuple(shape)} tensor needs a gradient "
                        f"(plan: {needs_grad}); was the plan made for this model?")


def reshard(x: torch.Tensor, src: ShardingSpec, dst: ShardingSpec, grad_partial, shape, mesh: MeshGroups):
    """``x`` (local shard in ``src``) in ``dst``; a no-op when nothing moves in either direction."""
    needs_grad = grad_partial is not None
    if needs_grad != x.requires_grad and torch.is_grad_enabled():
        raise disagree(shape, needs_grad)
    if src == dst and (not needs_grad or not grad_partial):
        return x
    if not needs_grad:
        with torch.no_grad():
            for step in forward_steps(src, dst, shape, x.element_size(), mesh.shape):
                x = run_step(x, step, mesh, "forward")
        return x
    return Reshard.apply(x, src, dst, tuple(grad_partial), tuple(shape), mesh)
