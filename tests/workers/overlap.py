"""Run on every rank by torchrun: each plan trains 3 AdamW steps twice from the same weights,
once with the gradient buckets' all-reduces overlapped with backward (``trainer.overlap``, the
default) and once after backward (the plain step). Rank 0 writes, per plan: both runs' losses,
the largest parameter difference, the buckets each rank started during backward, and the
overlapped step's runtime collective counts next to the plan's."""
import argparse
import copy
import json

import torch
import torch.distributed as dist

from alpa_lite import parallelize
from alpa_lite.runtime import collective_counts
from alpa_lite.runtime.launch import init_distributed
from alpa_lite.zoo.models import build_model
from single_process import finish

STEPS = 3


def train(model, example, batches, overlap: bool, options: dict):
    trainer = parallelize(copy.deepcopy(model), (2, 2), example, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
                          **options)
    trainer.overlap = overlap
    before = collective_counts()
    losses = [trainer.step(*batches[0])]
    after = collective_counts()
    losses += [trainer.step(*b) for b in batches[1:]]
    counts = {f"{k}|{ph}": after[(k, ph)] - before.get((k, ph), 0) for (k, ph) in after
              if after[(k, ph)] != before.get((k, ph), 0)}
    early = [None] * dist.get_world_size()
    dist.all_gather_object(early, (trainer.bucket_sync.launched_in_backward, len(trainer.bucket_sync.buckets)))
    return trainer, losses, counts, early


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plans", required=True, help="JSON object: plan name -> parallelize options")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    init_distributed(60)
    model, example = build_model("gpt-tiny", 8, 16, device="cpu", num_layers=2)
    batches = [build_model("gpt-tiny", 8, 16, device="cpu", seed=100 + s, num_layers=2)[1] for s in range(STEPS)]
    results = {}
    for name, options in json.loads(args.plans).items():
        trainer, losses, counts, early = train(model, example, batches, True, options)
        plain, plain_losses, _, _ = train(model, example, batches, False, {"plan": trainer.plan})
        got, want = trainer.state_dict(), plain.state_dict()
        results[name] = {"losses": losses, "plain_losses": plain_losses,
                         "param_diff": max(float((got[k] - v).abs().max()) for k, v in want.items()),
                         "buckets": early, "runtime_counts": counts,
                         "plan_counts": {f"{k}|{ph}": n for (k, ph), n in trainer.plan.collective_counts().items()}}
    finish(results, args.out)


if __name__ == "__main__":
    main()
