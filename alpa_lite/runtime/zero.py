"""ZeRO-1 and ZeRO-2 at run time: the optimizer states (and gradients) of this rank's parameter
shards partitioned over the devices of the zero axes (Rajbhandari et al., SC'20, section 5;
docs/runtime.md). ZeRO-3 needs nothing here: it is a split storage spec (``executor.py``).

A ZeRO-1/2 parameter (``NodePlan.zero_stage``) keeps its whole local shard (its tensor-parallel
spec). Group rank ``i`` of the ``n`` devices of its zero axes owns elements ``[i c, (i + 1) c)``
of the flattened shard, ``c = ceil(numel / n)`` (the last slices may be shorter or empty); the
optimizer holds that slice as a parameter sharing the shard's storage, so its in-place update
writes the shard and its states have the slice's size. The gradient bucket is
all-reduced (ZeRO-1: the slice's gradient is a view of the full one) or reduce-scattered
(ZeRO-2: the rank keeps only its slice, the full gradient is dropped), started during backward
once its gradients are ready (``grad_sync.BucketSync``); after the optimizer step
each bucket of updated slices is all-gathered into the shards (``Plan.collectives``, phase
``"update"``). The optimizer must update element by element (SGD, Adam, AdamW, ...), as ZeRO's.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from ..core.capture import CapturedGraph
from ..core.plan import Plan, update_buckets
from .collectives import MeshGroups, all_gather_bucket, reduce_scatter_async


class ZeroPartition:
    """The ZeRO-1/2 slices of one rank's parameters.

    Args:
        view: the captured graph this rank runs; plan: its SPMD plan.
        params: parameter FQN -> this rank's shard; groups: this rank's ``MeshGroups``.

    Attributes:
        slices: FQN -> the optimizer's parameter (a flat view of the shard) of every ZeRO-1/2 one.
        stages: FQN -> ``(stage, axes)`` of those.
    """

    def __init__(self, view: CapturedGraph, plan: Plan, params: dict[str, torch.nn.Parameter], groups: MeshGroups):
        self.params, self.groups = params, groups
        self.stages = {fqn: (plan.nodes[ph].zero_stage, plan.nodes[ph].zero_axes)
                       for ph, fqn in view.param_fqns.items() if plan.nodes[ph].zero_stage}
        self.slices: dict[str, torch.nn.Parameter] = {}
        self._range: dict[str, tuple[int, int, int]] = {}  # FQN -> (start, end, chunk)
        for fqn, (_, axes) in self.stages.items():
            p = params[fqn]
            c = -(-p.numel() // self._size(axes))
            start = min(groups.shard_index(axes) * c, p.numel())
            end = min(start + c, p.numel())
            self._range[fqn] = (start, end, c)
            self.slices[fqn] = torch.nn.Parameter(p.detach().view(-1)[start:end])
        self.buckets = [(axes, [view.param_fqns[ph] for ph in members])
                        for axes, members in update_buckets(view, plan.nodes, groups.shape, plan.bucket_bytes)]

    def _size(self, axes: tuple[int, ...]) -> int:
        return math.prod(self.groups.shape[a] for a in axes)

    def _padded(self, flat: torch.Tensor, fqn: str, j: int) -> torch.Tensor:
        """Chunk ``j`` of the flat tensor ``flat`` of parameter ``fqn``, zero-padded to the chunk size."""
        c = self._range[fqn][2]
        part = flat[j * c:(j + 1) * c]
        return torch.cat([part, part.new_zeros(c - part.numel())]) if part.numel() < c else part

    def start_reduce_scatter(self, fqns: list[str], axes: tuple[int, ...]):
        """ZeRO-2: start the one reduce-scatter of the gradients of the bucket ``fqns``
        (``async_op=True``): row ``j`` of the flat input holds every parameter's chunk ``j``,
        zero-padded; returns ``(work, out)`` for ``finish_reduce_scatter``."""
        n = self._size(axes)
        chunks = [self._range[f][2] for f in fqns]
        flat = self.params[fqns[0]].grad.new_empty(n, sum(chunks))
        offset = 0
        for f, c in zip(fqns, chunks):
            g, part = self.params[f].grad.reshape(-1), flat[:, offset:offset + c]
            rows, rest = divmod(g.numel(), c)
            part[:rows].copy_(g[:rows * c].view(rows, c))
            if rows < n:
                part[rows, :rest].copy_(g[rows * c:])
                part[rows, rest:].zero_()
                part[rows + 1:].zero_()
            offset += c
        return reduce_scatter_async(flat.view(-1), axes, self.groups)

    def finish_reduce_scatter(self, fqns: list[str], out: torch.Tensor) -> None:
        """ZeRO-2, after ``start_reduce_scatter``'s work is done: each slice gets its part of
        ``out``, the full gradients are dropped."""
        offset = 0
        for f in fqns:
            start, end, c = self._range[f]
            self.slices[f].grad = out[offset: offset + end - start]
            self.params[f].grad = None
            offset += c

    def slice_gradients(self) -> None:
        """ZeRO-1: each slice's gradient is the view of its part of the synchronized gradient."""
        for fqn, (stage, _) in self.stages.items():
            if stage == 1:
                start, end, _ = self._range[fqn]
                self.slices[fqn].grad = self.params[fqn].grad.view(-1)[start:end]

    def gather(self) -> None:
        """After the optimizer step: all-gather each bucket of updated slices into the shards."""
        with torch.no_grad():
            for axes, fqns in self.buckets:
                flats = [self.params[f].view(-1) for f in fqns]
                j = self.groups.shard_index(axes)
                parts = all_gather_bucket(torch.cat([self._padded(x, f, j) for f, x in zip(fqns, flats)]), axes,
                                          self.groups)
                offset = 0
                for f, x in zip(fqns, flats):
                    c = self._range[f][2]
                    x.copy_(torch.cat([part[offset: offset + c] for part in parts])[:x.numel()])
                    offset += c

    def unslice(self, fqn: str, value: torch.Tensor) -> torch.Tensor:
        """``value`` shaped like the slice of ZeRO-1/2 parameter ``fqn`` (its gradient, an
        optimizer state) all-gathered over the zero axes into the shape of the local shard; call
        on every rank of the zero group."""
        p = self.params[fqn]
        _, axes = self.stages[fqn]
        start, end, c = self._range[fqn]
        parts = all_gather_bucket(torch.cat([value.reshape(-1), value.new_zeros(c - value.numel())]), axes,
                                  self.groups, "gather")
        return torch.cat(parts)[:p.numel()].view(p.shape)

    def slice(self, fqn: str, value: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``value``, shaped like the local shard of ZeRO-1/2 parameter
        ``fqn`` (the inverse of ``unslice``; a copy)."""
        start, end, _ = self._range[fqn]
        return value.reshape(-1)[start:end].clone()

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """FQN -> the whole local gradient of every ZeRO-2 parameter (all-gathered from the
        slices; for inspection, ``Trainer.gradients``)."""
        out = {}
        for fqn, (stage, _) in self.stages.items():
            if stage == 2:
                g = self.slices[fqn].grad
                out[fqn] = self.unslice(fqn, g if g is not None else torch.zeros_like(self.slices[fqn]))
        return out


def build_optimizer(factory, partitions: list[ZeroPartition], model: torch.nn.Module | None = None,
                    localize: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> torch.optim.Optimizer:
    """``factory(params)`` on the parameters as this rank holds them (each shard, of its shape),
    then every ZeRO-1/2 one replaced in the optimizer's parameter groups by its flat slice
    (``ZeroPartition.slices``), with any state the optimizer made when built (Adagrad's
    ``sum``) sliced the same way. The factory sees the same tensors, shapes and order
    under every plan, so the groups it makes by shape or identity hold (nanoGPT's weight decay
    for ``p.dim() >= 2`` only: given the 1-D slices, it decayed no ZeRO-1/2 weight).

    A factory may also build its groups from ``model``'s own parameters (HF's and nanoGPT's
    ``no_decay`` groups by name, ``model.named_parameters()``): each is replaced by this rank's
    shard of it (state made when built: ``localize(fqn, value)``), or dropped from its group where
    this rank does not train it (a frozen one, another pipeline stage's). Before, the optimizer
    stepped the model's own tensors, which no gradient reaches: nothing trained, with no error.

    Raises:
        ValueError: a group holds a tensor that is neither one of ``params`` nor one of ``model``'s.
    """
    params = [p for z in partitions for p in z.params.values()]
    optimizer = factory(params)
    if optimizer is None:  # a pipeline chunk's placeholder factory (``lambda _: None``)
        return None
    _use_shards(optimizer, partitions, model, localize)
    swap = {id(z.params[fqn]): (z, fqn) for z in partitions for fqn in z.slices}
    for group in optimizer.param_groups:
        for i, p in enumerate(group["params"]):
            if id(p) in swap:
                z, fqn = swap[id(p)]
                group["params"][i] = z.slices[fqn]
                if p in optimizer.state:  # the shard's state would stay, unused, at the shard's size
                    optimizer.state[z.slices[fqn]] = {k: z.slice(fqn, v) if torch.is_tensor(v) and v.shape == p.shape
                                                      else v for k, v in optimizer.state.pop(p).items()}
    return optimizer


def _use_shards(optimizer: torch.optim.Optimizer, partitions: list[ZeroPartition], model: torch.nn.Module | None,
                localize: Callable[[str, torch.Tensor], torch.Tensor] | None) -> None:
    """Replace each of ``model``'s parameters in ``optimizer``'s groups by this rank's shard of it,
    or drop it where this rank holds none (``build_optimizer``)."""
    held = {id(p) for z in partitions for p in z.params.values()}
    if all(id(p) in held for group in optimizer.param_groups for p in group["params"]):
        return
    names: dict[int, list[str]] = {}
    for name, p in (model.named_parameters(remove_duplicate=False) if model is not None else ()):
        names.setdefault(id(p), []).append(name)
    where = {fqn: z for z in partitions for fqn in z.params}
    for group in optimizer.param_groups:
        kept = []
        for p in group["params"]:
            if id(p) in held:
                kept.append(p)
                continue
            if id(p) not in names:
                raise ValueError(f"the optimizer factory put a tensor of shape {tuple(p.shape)} in its parameter "
                                 "groups that is neither one of the parameters it was given (this rank's shards) "
                                 "nor one of the model's parameters: build the optimizer from the parameters "
                                 "passed to the factory, or from the model's own (model.named_parameters())")
            state = optimizer.state.pop(p, {})
            fqn = next((n for n in names[id(p)] if n in where), None)
            if fqn is None:  # frozen, or trained by another pipeline stage
                continue
            shard = where[fqn].params[fqn]
            if state:
                optimizer.state[shard] = {k: localize(fqn, v) if localize is not None and torch.is_tensor(v)
                                          and v.dim() > 0 and v.shape == p.shape else v for k, v in state.items()}
            if all(shard is not q for q in kept):
                kept.append(shard)
        group["params"] = kept
