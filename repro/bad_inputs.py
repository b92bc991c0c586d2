"""Bad input to parallelize on 4 ranks: each case must raise a clear error on every rank, not
hang. Run: PYTHONPATH=$PWD OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone
--nproc-per-node 4 repro/bad_inputs.py"""
import time
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from alpa_lite import parallelize
from alpa_lite.runtime.launch import init_distributed


class Nonzero(nn.Module):  # data-dependent shape
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, y):
        h = self.fc(x)
        return h[h > 0].sum() + F.mse_loss(h, y)


class Item(nn.Module):  # .item() / data-dependent control flow
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, y):
        h = self.fc(x)
        if h.mean().item() > 0:
            h = h * 2
        return F.mse_loss(h, y)


class Odd(nn.Module):  # hidden 6: S1R over 4 devices does not divide
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 6), nn.Linear(6, 16)

    def forward(self, x, y):
        return F.mse_loss(self.fc2(torch.relu(self.fc1(x))), y)


def attempt(fn):
    t = time.time()
    try:
        tr = fn()
        return f"no error ({time.time() - t:.1f}s)", tr
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:250]} ({time.time() - t:.1f}s)", None


def main():
    init_distributed(20)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    cases = {
        "nonzero": lambda: parallelize(Nonzero(), (2, 2), (x, y), optimizer=sgd, force_data_parallel=True),
        "item": lambda: parallelize(Item(), (2, 2), (x, y), optimizer=sgd, force_data_parallel=True),
        "odd-spec-S01R": lambda: parallelize(Odd(), (2, 2), (x, y), optimizer=sgd, param_specs={"fc1.weight": "S01R"}),
        "odd-auto": lambda: parallelize(Odd(), (2, 2), (x, y), optimizer=sgd),
        "batch-6-dp": lambda: parallelize(Odd(), (2, 2), (x[:6], y[:6]), optimizer=sgd, force_data_parallel=True),
        "batch-6-accumulate-4": lambda: parallelize(Odd(), (1, 4), (x[:6], y[:6]), optimizer=sgd, accumulate=4),
        "mesh-3x2": lambda: parallelize(Odd(), (3, 2), (x, y), optimizer=sgd),
        "mesh-1x2": lambda: parallelize(Odd(), (1, 2), (x, y), optimizer=sgd),
        "pipeline-5-stages": lambda: parallelize(Odd(), (1, 4), (x, y), optimizer=sgd, pipeline=5, num_microbatches=2),
        "microbatches-3": lambda: parallelize(Odd(), (1, 4), (x, y), optimizer=sgd, pipeline=2, num_microbatches=3),
        "bad-spec-name": lambda: parallelize(Odd(), (2, 2), (x, y), optimizer=sgd, param_specs={"fc9.weight": "S1R"}),
        "bad-spec-text": lambda: parallelize(Odd(), (2, 2), (x, y), optimizer=sgd, param_specs={"fc1.weight": "S2R"}),
    }
    out = {}
    for name, fn in cases.items():
        msg, tr = attempt(fn)
        if tr is not None:  # it built: does a step with a wrong batch size fail cleanly?
            m2, _ = attempt(lambda: tr.step(x[:4], y[:4]))
            msg += f" | step with batch 4: {m2}"
        out[name] = msg
        dist.barrier()
    if dist.get_rank() == 0:
        for k, v in out.items():
            print(f"[bad] {k}: {v}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
