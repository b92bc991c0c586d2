"""Bucketed data-parallel gradient synchronization, overlapped with backward.

The plan's deferred gradients (``Plan.grad_sync``) are all-reduced in buckets
(``core.plan.gradient_buckets``). As PyTorch DDP does (Li et al., "PyTorch Distributed", VLDB
2020, section 3.2.3), a bucket's all-reduce starts asynchronously as soon as the last of its
gradients has been accumulated during backward (a post-accumulate-grad hook on every parameter
counts them), and every handle is waited on before the optimizer step. Buckets are launched in
one fixed order on every rank, the reverse of graph order (backward produces the last layers'
gradients first): a bucket that is ready waits for the ones before it in that order, so every
rank issues the same collectives in the same order on each process group. A bucket whose
gradients a backward never reached (unused parameters) is launched when the sync finishes, its
missing gradients as zeros.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from .collectives import MeshGroups, all_reduce_async, failed


class BucketSync:
    """The gradient buckets of one rank and their all-reduces in flight.

    Args:
        buckets: ``(mesh axes, [parameter placeholders])`` in graph order
            (``core.plan.gradient_buckets``).
        params: placeholder -> this rank's parameter shard (an ``nn.Parameter``).
        mesh: this rank's ``MeshGroups``.
        dtype: the dtype the buckets are all-reduced in (None: the gradients'; the sums are cast
            back into the gradients).

    Attributes:
        launched_in_backward: buckets of the last synchronization whose all-reduce started from a
            hook, while backward was still running (the others started in ``finish``).
    """

    def __init__(self, buckets: list[tuple[tuple[int, ...], list[str]]], params: dict[str, torch.Tensor],
                 mesh: MeshGroups, dtype: torch.dtype | None = None):
        self.mesh, self.dtype = mesh, dtype
        self.buckets = [(axes, [params[ph] for ph in members]) for axes, members in reversed(buckets)]
        self.armed = False
        self.launched_in_backward = 0
        self._missing: list[int] = []
        self._next = 0
        self._works: list[tuple[int, object, torch.Tensor]] = []
        for k, (_, members) in enumerate(self.buckets):
            for p in (p for p in members if p.requires_grad):
                p.register_post_accumulate_grad_hook(partial(self._accumulated, k))

    def arm(self) -> None:
        """Launch each bucket from the hooks as its gradients become ready in the next backward
        (call right before the backward that completes the step's gradients)."""
        self._missing = [len(members) for _, members in self.buckets]
        self._next, self._works, self.launched_in_backward = 0, [], 0
        self.armed = True

    def _accumulated(self, k: int, _param: torch.Tensor) -> None:
        if not self.armed:
            return
        self._missing[k] -= 1
        while self._next < len(self.buckets) and self._missing[self._next] == 0:
            self._launch()
            self.launched_in_backward += 1

    def _launch(self) -> None:
        k = self._next
        axes, members = self.buckets[k]
        for p in members:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in members])
        flat = flat.to(self.dtype) if self.dtype is not None else flat
        self._works.append((k, all_reduce_async(flat, axes, self.mesh), flat))
        self._next += 1

    def finish(self) -> None:
        """Launch the buckets not launched yet, wait for every all-reduce and write the sums into
        the gradients.

        Raises:
            RuntimeError: an all-reduce failed or timed out (a peer died); the message names
                this rank, the bucket and its mesh axes.
        """
        if not self.armed:
            self._next, self._works, self.launched_in_backward = 0, [], 0
        self.armed = False
        while self._next < len(self.buckets):
            self._launch()
        works, self._works = self._works, []
        for k, work, flat in works:
            axes, members = self.buckets[k]
            try:
                work.wait()
            except RuntimeError as e:
                raise failed(f"the all-reduce of gradient bucket {len(self.buckets) - 1 - k} over mesh axes {axes}",
                             e) from e
            offset = 0
            for p in members:
                p.grad.copy_(flat[offset: offset + p.numel()].view_as(p))
                offset += p.numel()
