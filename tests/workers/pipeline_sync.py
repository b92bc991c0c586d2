"""Run on every rank by torchrun: pipelined plans with several devices per stage vs one process.

For each case (``--cases``: JSON name -> {"model", "batch", "seq", "build", "plan", "schedules"})
the ranks share the planning (``alpa_lite.plan`` on a 2x2 ``cpu-gloo`` mesh, ``plan`` options).
Every rank trains each plan under each schedule of ``schedules`` (default: the plan's; the
schedule only orders the runtime's work, and these tiny stages fit memory under either), twice,
with SGD and with AdamW. Rank 0 writes per case, schedule and optimizer: the losses of every step,
the largest gradient error after step 1 and parameter error after the last step (each with the
reference's largest value, for scale), and per stage its ranks, parameters, gradient syncs and
number of recomputed layers.
The reference trains the model in one process on the same global batches.
"""
import argparse
import copy
import json
import sys
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from alpa_lite.core.capture import capture
from alpa_lite.runtime.launch import init_distributed
from alpa_lite.core.mesh import LogicalMesh
from alpa_lite.zoo.models import build_model
from alpa_lite import load_plan, plan as make_plan
from alpa_lite.runtime.pipeline import PipelineTrainer
from single_process import finish, reference

STEPS = 3
LR = 1e-2
OPTIMIZERS = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}


class ParameterFreeTail(nn.Module):
    """``Linear`` then a tail without parameters (batched matmuls of the activation with itself):
    with ``num_layers=2`` the clustering makes the tail a layer, so two stages leave the second
    one without parameters. ``forward(x [B, 16], y [B, 4, 4]) -> scalar``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.tail = _Tail()

    def forward(self, x, y):
        return F.mse_loss(self.tail(self.lin(x)), y)


class _Tail(nn.Module):
    def forward(self, h):
        a = h.reshape(h.shape[0], 4, 4)
        for _ in range(4):
            a = torch.tanh(a @ a.transpose(1, 2))
        return a


def build(spec: dict, seed: int = 0):
    """``(model, (inputs, targets))`` of a case; ``seed`` sets the weights and the batch."""
    if spec["model"] == "parameter-free-tail":
        torch.manual_seed(seed)
        b = spec["batch"]
        return ParameterFreeTail(), (torch.randn(b, 16), torch.randn(b, 4, 4))
    return build_model(spec["model"], spec["batch"], spec.get("seq"), device="cpu", seed=seed, **spec.get("build", {}))


def max_err(got: dict, want: dict) -> tuple[float, float]:
    return (max(float((got[k] - v).abs().max()) for k, v in want.items()),
            max(float(v.abs().max()) for v in want.values()))


def plan_all(cases: dict) -> dict[str, str]:
    """Case name -> plan JSON; each rank plans every ``world``-th case, then all exchange them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {}
    for name in list(cases)[rank::world]:
        model, example = build(cases[name])
        mine[name] = make_plan(model, example, LogicalMesh((2, 2), cluster="cpu-gloo"), **cases[name]["plan"]).to_json()
    every = [None] * world
    dist.all_gather_object(every, mine)
    return {k: v for part in every for k, v in part.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    init_distributed(120)
    cases = json.loads(args.cases)
    plans = plan_all(cases)
    references, captured = {}, {}
    results = {}
    for name, case in cases.items():
        model_key = json.dumps({k: case.get(k) for k in ("model", "batch", "seq", "build")}, sort_keys=True)
        if model_key not in references:
            model, example = build(case)
            batches = [build(case, seed=100 + s)[1] for s in range(STEPS)]
            references[model_key] = (model, example, batches,
                                     {o: reference(model, batches, LR, cls) for o, cls in OPTIMIZERS.items()})
        model, example, batches, refs = references[model_key]
        plan = load_plan(plans[name])
        b = plan.num_microbatches
        key = (model_key, b)
        if key not in captured:
            size = example[0].shape[0] // b
            captured[key] = capture(model, tuple(x[:size] for x in example))
        fqn = captured[key].param_fqns
        stages = [{"ranks": s.ranks, "params": sorted(s.plan.param_specs),
                   "grad_sync": sorted(fqn[ph] for ph in s.plan.grad_sync), "remat_layers": len(s.plan.remat)}
                  for s in plan.stages]
        for schedule in case.get("schedules", [plan.schedule]):
            record = {"num_microbatches": b, "stages": stages}
            for opt, cls in OPTIMIZERS.items():
                ref_losses, ref_grads, ref_params = refs[opt]
                trainer = PipelineTrainer(copy.deepcopy(model), captured[key], replace(plan, schedule=schedule),
                                          lambda p, cls=cls: cls(p, lr=LR))
                losses = [trainer.step(*batches[0])]
                grad_err = max_err(trainer.gradients(), ref_grads)
                losses += [trainer.step(*x) for x in batches[1:]]
                param_err = max_err(trainer.state_dict(), ref_params)
                peaks = [None] * dist.get_world_size()  # (stage, bytes saved for backward at most), every rank
                dist.all_gather_object(peaks, (trainer.stage, trainer.peak_activation_bytes))
                record[opt] = {"losses": losses, "ref_losses": ref_losses, "grad_err": grad_err, "param_err": param_err,
                               "peak_activation_bytes": peaks}
            results[f"{name}/{schedule}"] = record
    finish(results, args.out)


if __name__ == "__main__":
    sys.exit(main())
