"""Run on every rank by torchrun: parallel training under several plans vs the single-process
run of the same model, same seed, same batches. Writes one JSON result per plan from rank 0."""
import argparse
import copy
import json
import sys

import torch
import torch.distributed as dist

from alpa_lite.launch import init_distributed
from alpa_lite.models import build_model
from alpa_lite.runtime import collective_counts, parallelize

STEPS = 3


def reference(model, batches, lr):
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = model(*batch)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses, {k: v.detach() for k, v in model.named_parameters(remove_duplicate=False)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--mesh", default="2x2")
    ap.add_argument("--plans", default="auto")  # name=json-options;...
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    init_distributed(60)
    torch.manual_seed(0)
    model, example = build_model(args.model, args.batch, args.seq, device="cpu")
    batches = []
    for s in range(STEPS):
        _, b = build_model(args.model, args.batch, args.seq, device="cpu", seed=100 + s)
        batches.append(b)
    lr = 1e-2
    ref_losses, ref_params = reference(model, batches, lr)
    shape = tuple(int(x) for x in args.mesh.split("x"))
    results = {}
    for item in args.plans.split(";"):
        name, _, opts = item.partition("=")
        options = json.loads(opts) if opts else {}
        before = collective_counts()
        trainer = parallelize(copy.deepcopy(model), shape, example, optimizer=lambda p: torch.optim.AdamW(p, lr=lr),
                              **options)
        losses = [trainer.step(*b) for b in batches]
        after = collective_counts()
        per_step = {f"{k}|{ph}": (after.get((k, ph), 0) - before.get((k, ph), 0)) / STEPS
                    for (k, ph) in set(after) | set(before) if ph in ("forward", "backward")}
        per_step = {k: v for k, v in per_step.items() if v}
        planned = {f"{k}|{ph}": n for (k, ph), n in trainer.plan.collective_counts().items()}
        params = trainer.state_dict()
        err = max(float((params[k] - v).abs().max()) for k, v in ref_params.items())
        scale = max(float(v.abs().max()) for v in ref_params.values())
        results[name] = {"losses": losses, "ref_losses": ref_losses, "max_param_err": err, "param_scale": scale,
                         "runtime_counts": per_step, "plan_counts": planned, "param_specs": trainer.plan.param_specs}
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
