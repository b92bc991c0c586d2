"""Repro: a loss written as ``sum / y.numel()`` (a token mean) was read as a *sum* by
``compiler/loss_reduction.py`` (``_quotient`` knew only ``sum / x.size(0)``): export bakes the
microbatch's ``B x T`` into the graph, so K microbatches (accumulate=K, or a pipeline's
num_microbatches) were added instead of averaged: the loss and gradients came out K times larger,
silently (no warning).

    cd /work/wt-bugs && PYTHONPATH=$PWD OMP_NUM_THREADS=1 /work/main/.venv/bin/python \\
        -m torch.distributed.run --standalone --nproc-per-node 2 repro/sum_over_numel.py

Before the fix: DP accumulate=2 loss 2.0x the one-process loss; after: equal.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import alpa_lite
from alpa_lite.runtime.launch import init_distributed


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(32, 16), nn.Linear(16, 32)

    def forward(self, ids, targets):
        logits = self.fc(torch.tanh(self.emb(ids)))
        return F.cross_entropy(logits.transpose(1, 2), targets, reduction="sum") / targets.numel()


def main():
    init_distributed(30)
    torch.manual_seed(0)
    ids, t = torch.randint(0, 32, (8, 8)), torch.randint(0, 32, (8, 8))
    for options in ({"force_data_parallel": True, "accumulate": 2},
                    {"pipeline": 2, "num_microbatches": 2, "num_layers": 2}):
        r = alpa_lite.verify(LM(), (ids, t), (1, 2), steps=2, show=False, **options)
        if torch.distributed.get_rank() == 0:
            print(options, "equal" if r.equal else "DIFFERS", "losses", r.losses, "one process", r.ref_losses)


if __name__ == "__main__":
    main()
