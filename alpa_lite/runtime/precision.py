"""fp16's dynamic loss scaling on sharded gradients (Micikevicius et al. 2018, "Mixed Precision
Training", section 3.2; the update rule of ``torch.amp.GradScaler``).

The loss is multiplied by ``scale`` before backward, so small fp16 gradients do not flush to zero.
After backward (and the gradient synchronization) every rank checks its own gradient shards for
inf / nan and the flags are max-reduced over the whole mesh, so every rank takes the same
decision: skip the optimizer step and halve the scale on an overflow anywhere, else unscale the
gradients (divide by ``scale``), step, and double the scale after ``growth_interval`` clean steps.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class LossScaler:
    """The dynamic loss scale of one trainer (``torch.amp.GradScaler``'s defaults).

    Attributes:
        scale: the current factor (float). skipped: optimizer steps skipped so far.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        self.scale, self.growth_factor, self.backoff_factor = init_scale, growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.skipped = 0
        self._clean = 0  # consecutive steps without an overflow

    def unscale(self, grads: list[torch.Tensor], group=None) -> bool:
        """Check ``grads`` (this rank's shards) for inf / nan on every rank of ``group`` (one
        all-reduce of a flag), then update the scale. Call on every rank.

        Returns:
            True (gradients divided by the old scale: take the step) when no rank saw inf / nan,
            False (gradients untouched: skip the step) otherwise; the same on every rank.
        """
        bad = torch.zeros(1, dtype=torch.float32, device=grads[0].device if grads else "cpu")
        for g in grads:
            bad += (~torch.isfinite(g)).any()
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
        if bad.item() > 0:
            self.scale *= self.backoff_factor
            self.skipped += 1
            self._clean = 0
            return False
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)
        self._clean += 1
        if self._clean == self.growth_interval:
            self.scale *= self.growth_factor
            self._clean = 0
        return True
