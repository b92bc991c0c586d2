"""Repro (single process, planning only): force_data_parallel + zero_stage=1/2 on a model whose
parameter is read through an op before the batch-split matmul (w.t(), p.pow(2) of an L2 penalty,
CLIP's logit_scale.exp()). Before: SolverError "the only strategy of an ILP variable is forbidden
(N variables)"; after: a SolverError naming each parameter and op, suggesting zero_stage=3.
(Making such plans feasible would need ZeRO-1/2 gradient syncs on the op's output edge: not done.)

    cd /work/wt-bugs && PYTHONPATH=$PWD OMP_NUM_THREADS=1 /work/main/.venv/bin/python repro/zero12_read_through_op.py
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import alpa_lite
from alpa_lite import LogicalMesh


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.logit_scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, x, y):
        l2 = self.fc.weight.pow(2).sum()
        return F.mse_loss(self.fc(x) * self.logit_scale.exp(), y) + 1e-3 * l2


x, y = torch.randn(8, 16), torch.randn(8, 16)
for stage in (1, 2, 3):
    try:
        alpa_lite.plan(Model(), (x, y), LogicalMesh((2, 2), cluster="cpu-gloo"), force_data_parallel=True,
                       zero_stage=stage)
        print(f"zero_stage={stage}: planned")
    except Exception as e:  # noqa: BLE001
        print(f"zero_stage={stage}: {type(e).__name__}: {e}")
