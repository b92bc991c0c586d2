"""Train Alpa's MLP with alpa-lite on every rank: `alpa-lite run --nproc 4 examples/parallel_mlp.py`.

The planner picks the sharding (here for a 2x2 mesh of CPU processes); every rank runs the same
script, gets the same loss, and rank 0 prints it with the chosen parameter specs. With
`alpa-lite run --report ...` the trainer also prints predicted vs measured step and collective
times after 2 warm-up and 5 timed steps (the default 10 steps cover them).
"""
import argparse

import torch
import torch.distributed as dist

import alpa_lite
from alpa_lite.zoo.models import build_model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mesh", default="2x2")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=256)
    args = ap.parse_args()
    mesh = tuple(int(x) for x in args.mesh.split("x"))
    model, example = build_model("mlp", batch=64, device="cpu", hidden=args.hidden)  # forward(x, y) -> MSE loss
    trainer = alpa_lite.parallelize(model, mesh, example, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    batch = build_model("mlp", batch=64, device="cpu", hidden=args.hidden, seed=1)[1]  # one batch: loss falls
    for step in range(args.steps):
        loss = trainer.step(*batch)
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss:.5f}")
    if dist.get_rank() == 0:
        print("specs", {k: v for k, v in trainer.plan.param_specs.items() if k.endswith("weight")})


if __name__ == "__main__":
    main()
