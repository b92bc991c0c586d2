"""How a training loss reduces over the batch, so that a split batch or microbatches give the
loss of the whole batch (docs/runtime.md, docs/pipeline.md).

Two places cut the batch: the SPMD runtime splits it over devices, a pipeline over microbatches.
Sums stay sums and a mean over equal parts is the mean of the part means, but a mean whose count
depends on the data is not: cross-entropy / nll with ``ignore_index`` (or class weights) divides
by the number (weight) of valid targets, which differs from part to part. Such a *ratio* is
reduced as numerator and denominator separately, each summed over the parts, then divided.

- Per op (``ratio_parts``): a mean cross-entropy / nll is computed as the sum of its losses over
  the valid targets and their count (or their class-weight sum), torch's own definition of the
  mean (``torch.nn.functional.cross_entropy``, ``reduction="mean"``).
The per-loss reading of a captured graph is ``compiler/loss_reduction.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from .aten import bind_args

aten = torch.ops.aten
MEAN, SUM = 1, 2  # torch's reduction enum (at::Reduction): none=0, mean=1, sum=2

RATIO_OPS = {aten.cross_entropy_loss.default, aten.nll_loss_nd.default, aten.nll_loss.default,
             aten.nll_loss2d.default}


def is_ratio(target, args: tuple, kwargs: dict) -> bool:
    """A mean cross-entropy / nll: its count depends on the targets (``ignore_index``, weights)."""
    return target in RATIO_OPS and bind_args(target, args, kwargs)["reduction"] == MEAN


def ratio_parts(target, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(numerator, denominator)`` of a mean cross-entropy / nll call (``is_ratio``): the sum of
    the losses and the count of targets other than ``ignore_index`` (the sum of their class
    weights when ``weight`` is given; ``N x d1 x ...`` for class-probability targets), as torch
    defines the mean. Both are 0-dim tensors of the input's dtype; the mean is their quotient.
    """
    a = bind_args(target, args, kwargs)
    a["reduction"] = SUM
    num = target(*a.values())
    x, t, w = a["self"], a["target"], a["weight"]
    if t.is_floating_point():  # class probabilities: every sample counts once
        den = torch.tensor(x.numel() // (x.shape[1] if x.dim() > 1 else x.shape[0]), dtype=x.dtype, device=x.device)
        return num, den
    valid = t != a["ignore_index"]
    if w is None:
        return num, valid.sum().to(num.dtype)
    return num, (w[t.masked_fill(~valid, 0)] * valid).sum().to(num.dtype)


@dataclass(frozen=True)
class LossReduction:
    """How the loss reduces over the batch.

    Attributes:
        kind: ``"sum"`` (microbatch losses add), ``"mean"`` (they average) or ``"ratio"`` (each
            weighs by its denominator: a token mean over valid targets).
        denominator: for ``"ratio"``, the node whose denominator weighs a microbatch: a mean
            cross-entropy / nll node (``ratio_parts``) or the divisor node of a quotient of sums.
        problems: why microbatches would change the objective, one line each naming the node
            (empty when the loss over microbatches equals the loss over the batch).
    """

    kind: str = "mean"
    denominator: str | None = None
    problems: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {"kind": self.kind, "denominator": self.denominator, "problems": list(self.problems)}

    @classmethod
    def from_dict(cls, d: dict) -> "LossReduction":
        return cls(str(d["kind"]), d["denominator"], tuple(d["problems"]))
