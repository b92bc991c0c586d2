"""Bucketed data-parallel gradient synchronization, overlapped with backward.

The plan's deferred gradients (``Plan.grad_sync``) are all-reduced in buckets, or reduce-scattered
for ZeRO-2 parameters (``core.plan.gradient_buckets``). As PyTorch DDP does (Li et al., "PyTorch
Distributed", VLDB 2020, section 3.2.3), a bucket's collective starts asynchronously as soon as
the last of its gradients has been accumulated during backward (a post-accumulate-grad hook on
every parameter counts them), and every handle is waited on before the optimizer step. Buckets
are launched in one fixed order on every rank, the reverse of graph order (backward produces the
last layers' gradients first): a bucket that is ready waits for the ones before it in that order,
so every rank issues the same collectives in the same order on each process group. A bucket
whose gradients a backward never reached (unused parameters) is launched when the sync finishes,
its missing gradients as zeros.

An all-reduce bucket owns one flat buffer, allocated once (DDP's persistent buckets): the
gradients are copied into it, it is all-reduced in place, and the sums are copied back into the
gradients (cast, when the bucket is reduced in another dtype; a copy, so a gradient kept past the
step is not overwritten by the next one's, as DDP's default ``gradient_as_bucket_view=False``).
A ZeRO-2 bucket is reduce-scattered into the rank's slices (``zero.ZeroPartition``).

Under ``compile`` (``program.py``) a one-microbatch step's all-reduce buckets are summed inside
the program's graph instead, each launched where backward completes it, in this order
(``BucketSync.in_program``); the sync writes the sums the graph returns into the gradients as it
writes its own (``summed``), so the values are the same: as views of the sums, which are new
tensors every step (DDP's ``gradient_as_bucket_view``: no second copy of the gradients), where
the bucket is reduced in the gradients' dtype.
"""
from __future__ import annotations

from functools import partial

import torch

from .collectives import MeshGroups, all_reduce_async, failed


def bucket_dtype(reduce: torch.dtype | None, own: torch.dtype) -> torch.dtype:
    """The dtype a bucket of gradients of dtype ``own`` is summed in: ``reduce`` (the plan's
    reduce dtype) when given, but a complex bucket keeps its own (a real ``reduce`` would drop the
    imaginary parts)."""
    return own if reduce is None or own.is_complex else reduce


class BucketSync:
    """The gradient buckets of one rank and their collectives in flight.

    Args:
        buckets: ``(kind, mesh axes, [parameter placeholders])`` in graph order
            (``core.plan.gradient_buckets``; kind ``"all-reduce"`` or ``"reduce-scatter"``).
        params: placeholder -> this rank's parameter shard (an ``nn.Parameter``).
        mesh: this rank's ``MeshGroups``.
        dtype: the dtype the all-reduce buckets are reduced in (None: the gradients'; the sums
            are cast back into the gradients).
        zero: the ``ZeroPartition`` whose slices the reduce-scatter buckets fill, and
            ``fqns``: placeholder -> FQN (both needed only with reduce-scatter buckets).
        in_program: the all-reduce buckets are summed by a compiled program (``summed``), not
            launched here.

    Attributes:
        launched_in_backward: buckets of the last synchronization whose collective started from
            a hook, while backward was still running (the others started in ``finish``).
        in_program: launch-order indices of the buckets a compiled program sums (``in_program``
            given: every all-reduce bucket), else empty.
    """

    def __init__(self, buckets: list[tuple[str, tuple[int, ...], list[str]]], params: dict[str, torch.Tensor],
                 mesh: MeshGroups, dtype: torch.dtype | None = None, zero=None, fqns: dict[str, str] | None = None,
                 in_program: bool = False):
        self.mesh, self.dtype, self.zero = mesh, dtype, zero
        self.buckets = [(kind, axes, [params[ph] for ph in members], [fqns[ph] for ph in members] if zero else [])
                        for kind, axes, members in reversed(buckets)]
        self.in_program = [k for k, (kind, *_) in enumerate(self.buckets) if in_program and kind == "all-reduce"]
        self._summed: dict[int, torch.Tensor] = {}
        self._flat: list[torch.Tensor | None] = [  # each all-reduce bucket's persistent buffer
            torch.empty(sum(p.numel() for p in members), dtype=bucket_dtype(dtype, members[0].dtype),
                        device=members[0].device)
            if kind == "all-reduce" and k not in self.in_program else None
            for k, (kind, _, members, _) in enumerate(self.buckets)]
        self.armed = False
        self.launched_in_backward = 0
        self._missing: list[int] = []
        self._next = 0
        self._works: list[tuple[int, object, torch.Tensor]] = []
        for k, (_, _, members, _) in enumerate(self.buckets):
            for p in (p for p in members if p.requires_grad and k not in self.in_program):
                p.register_post_accumulate_grad_hook(partial(self._accumulated, k))

    def arm(self) -> None:
        """Launch each bucket from the hooks as its gradients become ready in the next backward
        (call right before the backward that completes the step's gradients)."""
        self._missing = [len(members) for _, _, members, _ in self.buckets]
        self._next, self._works, self.launched_in_backward = 0, [], 0
        self.armed = True

    def _accumulated(self, k: int, _param: torch.Tensor) -> None:
        if not self.armed:
            return
        self._missing[k] -= 1
        while self._next < len(self.buckets) and self._missing[self._next] == 0:
            self._launch()
            self.launched_in_backward += 1

    def summed(self, flats: list[torch.Tensor]) -> None:
        """The sums of the ``in_program`` buckets (in that order; each its members' gradients
        flattened and concatenated in the bucket's dtype, summed over its mesh axes), computed by
        the compiled program's graph: the next ``finish`` writes them into the gradients."""
        self._summed = dict(zip(self.in_program, flats, strict=True))

    def _launch(self) -> None:
        k = self._next
        kind, axes, members, fqns = self.buckets[k]
        if k in self.in_program:  # summed by the program
            if k not in self._summed:
                raise RuntimeError(f"gradient bucket {len(self.buckets) - 1 - k} is summed by the compiled "
                                   "program, which has not run since the last synchronization")
            self._works.append((k, None, self._summed.pop(k)))
            self._next += 1
            return
        for p in members:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if kind == "reduce-scatter":
            self._works.append((k, *self.zero.start_reduce_scatter(fqns, axes)))
        else:
            flat, offset = self._flat[k], 0
            for p in members:
                flat[offset: offset + p.numel()].copy_(p.grad.reshape(-1))
                offset += p.numel()
            self._works.append((k, all_reduce_async(flat, axes, self.mesh), flat))
        self._next += 1

    def finish(self, divisor: torch.Tensor | None = None) -> set[int]:
        """Launch the buckets not launched yet, wait for every collective and write the sums into
        the gradients (ZeRO-2: into the slices' gradients, the full ones dropped); an all-reduce
        bucket's divided by ``divisor`` (0-dim) when given, in the same pass (a token-mean loss's
        denominator, ``ParallelTrainer._train_step``). Returns the ``id`` s of the parameters
        whose gradients were divided.

        Raises:
            RuntimeError: a collective failed or timed out (a peer died or stopped); the message
                names this rank, the bucket and its mesh axes.
        """
        if not self.armed:
            self._next, self._works, self.launched_in_backward = 0, [], 0
        self.armed = False
        while self._next < len(self.buckets):
            self._launch()
        works, self._works = self._works, []
        divided = set()
        for k, work, flat in works:
            kind, axes, members, fqns = self.buckets[k]
            try:
                if work is not None:  # None: summed by the program
                    work.wait()
            except RuntimeError as e:
                raise failed(f"the {kind} of gradient bucket {len(self.buckets) - 1 - k} over mesh axes {axes}",
                             e) from e
            if kind == "reduce-scatter":
                self.zero.finish_reduce_scatter(fqns, flat)
                continue
            offset = 0
            for p in members:
                part = flat[offset: offset + p.numel()].view_as(p)
                offset += p.numel()
                if divisor is not None:
                    divided.add(id(p))
                if work is None and part.dtype == p.dtype:  # the program's sum, a new tensor every step: viewed
                    p.grad = part if divisor is None else part.div_(divisor)
                    continue
                if p.grad is None:  # summed by the program, in another dtype
                    p.grad = torch.empty_like(p)
                if divisor is None:  # a copy, not a view: a gradient read after the step outlives the buffer's reuse
                    p.grad.copy_(part)
                else:
                    torch.div(part, divisor, out=p.grad)
        return divided
