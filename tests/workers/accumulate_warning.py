"""Run by torchrun (1 rank): ``parallelize(..., accumulate=K)`` of losses that K microbatches change
(in-batch negatives, a square of the batch mean, a step counter written in forward, a branch on the batch size) and of one they do not (a token mean); rank 0
writes the warnings each gave, and the error of position ids ``(T,)`` given as an input with ``T``
the batch size (``"cut"``: cut into the microbatches' rows too), and of a permutation of the
batch's rows given as an input (``"mixup"``)."""
import argparse
import json
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from alpa_lite import CaptureError, parallelize
from alpa_lite.runtime.launch import init_distributed
from single_process import finish


class Pairs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return F.cross_entropy(h @ x.t(), torch.arange(x.shape[0]))


class MeanSquared(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x).mean() ** 2


class TokenMean(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x).pow(2).mean()


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.steps += 1
        return self.fc(x).pow(2).mean()


class BatchBranch(nn.Module):
    """Python control flow on the batch size: export records the branch of the size it saw."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        if x.shape[0] >= 8:
            h = h * 0.5
        return h.pow(2).mean()


class Mixup(nn.Module):
    """Mixup with the batch's permutation given as an input: cut into microbatches, it indexes past them."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, perm):
        return self.fc(0.7 * x + 0.3 * x[perm]).pow(2).mean()


class PosInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.pos = nn.Linear(8, 8), nn.Embedding(8, 8)

    def forward(self, x, pos):
        return self.fc(x + self.pos(pos)).pow(2).mean()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    init_distributed(60)
    x = torch.randn(8, 8)
    out = {}
    for model in (Pairs(), MeanSquared(), TokenMean(), Counter(), BatchBranch()):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            parallelize(model, (1, 1), (x,), force_data_parallel=True, accumulate=2)
        out[type(model).__name__] = [str(w.message) for w in caught if "microbatches" in str(w.message)]
    try:
        parallelize(PosInput(), (1, 1), (torch.randn(8, 8, 8), torch.arange(8)), force_data_parallel=True, accumulate=2)
        out["cut"] = None
    except CaptureError as e:
        out["cut"] = str(e)
    try:
        parallelize(Mixup(), (1, 1), (x, torch.randperm(8)), force_data_parallel=True, accumulate=2)
        out["mixup"] = None
    except ValueError as e:
        out["mixup"] = str(e)
    finish(out, args.out)


if __name__ == "__main__":
    main()
