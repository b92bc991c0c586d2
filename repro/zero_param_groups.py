"""Repro: ZeRO-1/2 handed the user's optimizer factory the flat 1-D slices, so parameter groups
chosen by shape (nanoGPT's configure_optimizers: weight decay for p.dim() >= 2) put every weight
in the no-decay group: silently no weight decay.

    cd /work/wt-bugs && PYTHONPATH=$PWD OMP_NUM_THREADS=1 /work/main/.venv/bin/python \\
        -m torch.distributed.run --standalone --nproc-per-node 2 repro/zero_param_groups.py

Before the fix: DIFFERS (loss 2nd step ~1e-4 relative, weights off by the missing decay); after: equal.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import alpa_lite
from alpa_lite.runtime.launch import init_distributed


def adamw_groups(params):
    params = list(params)
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.5},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=1e-2)


def main():
    init_distributed(30)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    r = alpa_lite.verify(model, (x,), (1, 2), loss_fn=F.mse_loss, targets=(y,), steps=3, show=False,
                         optimizer=adamw_groups, force_data_parallel=True, zero_stage=2)
    if torch.distributed.get_rank() == 0:
        print("equal" if r.equal else "DIFFERS", "losses", r.losses, "one process", r.ref_losses)
        print([(x.kind, x.name, f"{x.max_diff:.1e}", f"{x.bound:.1e}") for x in r.differing][:4])


if __name__ == "__main__":
    main()
