"""Repro: a pipeline stage that sends a non-contiguous activation (a transposed view) crashes in
backward: the gradient's receive buffer is ``torch.empty_like(sent)``, which keeps the view's
strides, and gloo's irecv refuses it ("input tensor has to be contiguous"); the other ranks then
wait until the collective timeout.

    cd /work/wt-bugs && PYTHONPATH=$PWD OMP_NUM_THREADS=1 /work/main/.venv/bin/python \
        -m torch.distributed.run --standalone --nproc-per-node 2 repro/pipe_noncontiguous.py
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import alpa_lite
from alpa_lite.runtime.launch import init_distributed


class Model(nn.Module):
    """Stage 0 ends in ``h.transpose(1, 2)`` (a non-contiguous view) that stage 1 reads."""

    def __init__(self):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(16, 16) * 0.2)
        self.w_out = nn.Parameter(torch.randn(16, 16) * 0.2)
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 16)

    def forward(self, x, y):
        h = torch.einsum("btd,de->bte", torch.tanh(x @ self.w_in), self.w_out)
        h = h.transpose(1, 2).reshape(h.shape[0], -1).view(h.shape[0], 16, -1).transpose(1, 2)
        h = h + self.fc2(F.relu(self.fc1(h)))
        return F.mse_loss(F.linear(h, self.w_out.t()), y)


def main():
    init_distributed(30)
    torch.manual_seed(0)
    model = Model()
    x, y = torch.randn(8, 8, 16), torch.randn(8, 8, 16)
    report = alpa_lite.verify(model, (x, y), (1, 2), steps=2, pipeline=2, num_microbatches=2, num_layers=2,
                              show=False)
    if torch.distributed.get_rank() == 0:
        print("plan:", report.plan, "equal:", report.equal)
        for r in report.rows:
            print(f"  {r.kind:6s} {r.name:12s} diff {r.max_diff:.2e} bound {r.bound:.2e}")


if __name__ == "__main__":
    main()
