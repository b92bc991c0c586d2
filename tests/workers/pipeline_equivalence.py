"""Run on every rank by torchrun: pipelined training (GPipe / 1F1B, several stage layouts) vs the
single-process run of the same model, same seed, same batches. Rank 0 writes one JSON result
per case: losses, parameter error, and each stage's measured peak activation bytes."""
import argparse
import copy
import json
import sys

import torch
import torch.distributed as dist

from alpa_lite.runtime.launch import init_distributed
from alpa_lite.zoo.models import build_model
from alpa_lite import parallelize
from single_process import finish, reference

STEPS = 3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--mesh", default="1x4")
    ap.add_argument("--cases", required=True)  # name=json-options;...
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    init_distributed(60)
    torch.manual_seed(0)
    over = {"num_layers": args.layers} if args.layers else {}
    model, example = build_model(args.model, args.batch, args.seq, device="cpu", **over)
    batches = [build_model(args.model, args.batch, args.seq, device="cpu", seed=100 + s, **over)[1] for s in range(STEPS)]
    lr = 1e-2
    ref_losses, _, ref_params = reference(model, batches, lr)
    shape = tuple(int(x) for x in args.mesh.split("x"))
    results = {}
    for item in args.cases.split(";"):
        name, _, opts = item.partition("=")
        trainer = parallelize(copy.deepcopy(model), shape, example, optimizer=lambda p: torch.optim.AdamW(p, lr=lr),
                              **json.loads(opts))
        losses = [trainer.step(*b) for b in batches]
        params = trainer.state_dict()
        err = max(float((params[k] - v).abs().max()) for k, v in ref_params.items())
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, (trainer.stage, trainer.peak_activation_bytes))
        results[name] = {"losses": losses, "ref_losses": ref_losses, "max_param_err": err,
                         "stages": [{"ranks": s.ranks, "logical": list(s.plan.mesh.shape), "layers": list(s.layers),
                                     "param_specs": s.plan.param_specs} for s in trainer.plan.stages],
                         "peak_activation_bytes": peaks}
    finish(results, args.out)


if __name__ == "__main__":
    sys.exit(main())
