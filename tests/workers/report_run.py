"""Run on every rank by torchrun: train one model under several plans with
``parallelize(..., report=True)`` and write each plan's predicted-vs-measured record from rank 0.

    --plans "dp={\"force_data_parallel\": true};tp={\"mesh\": \"1x4\", \"param_specs\": {...}}"

Each plan is ``name=JSON options``: ``mesh`` (default ``--mesh``) picks the device mesh, the rest
goes to ``parallelize`` (planner options). Output: ``{name: record}`` as JSON in ``--out``.
"""
import argparse
import copy
import json
import sys

import torch
import torch.distributed as dist

from alpa_lite.runtime.launch import init_distributed
from alpa_lite.zoo.models import build_model
from alpa_lite import parallelize


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--overrides", default="{}", help="JSON model overrides (hidden, num_layers, ...)")
    ap.add_argument("--mesh", default="2x2")
    ap.add_argument("--cluster", default="cpu-gloo", help="preset or cluster JSON to plan with")
    ap.add_argument("--plans", required=True)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per plan")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    init_distributed(120)
    torch.manual_seed(0)
    model, example = build_model(args.model, args.batch, args.seq, device="cpu", **json.loads(args.overrides))
    records = {}
    for item in args.plans.split(";"):
        name, _, opts = item.partition("=")
        options = json.loads(opts) if opts else {}
        shape = tuple(int(x) for x in options.pop("mesh", args.mesh).split("x"))
        trainer = parallelize(copy.deepcopy(model), shape, example, cluster=args.cluster, report=True,
                              report_warmup=args.warmup, report_steps=args.steps, **options)
        for _ in range(args.warmup + args.steps):  # the last step prints the report
            trainer.step(*example)
        records[name] = trainer.report(name=name, show=False)
        records[name]["param_specs"] = trainer.plan.param_specs
        del trainer
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
