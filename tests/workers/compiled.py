"""Run on every rank by torchrun: each plan trains 3 AdamW steps twice from the same weights, in
the interpreter and as the compiled per-rank program (``parallelize(..., compile=backend)``).
Rank 0 writes, per plan: both runs' losses, the largest parameter difference, the collectives in
each rank's traced GraphModule next to the plan's forward and backward ones, and whether the
collectives counted outside the program during the compiled steps (only the gradient buckets:
the program's collectives are not counted) next to the plan's buckets."""
import argparse
import copy
import json
from collections import Counter

import torch
import torch.distributed as dist

from alpa_lite import parallelize
from alpa_lite.core.resharding import forward_steps
from alpa_lite.runtime import collective_counts
from alpa_lite.runtime.launch import init_distributed
from alpa_lite.zoo.models import build_model
from single_process import finish

STEPS = 3


def train(model, example, batches, options: dict):
    trainer = parallelize(copy.deepcopy(model), (2, 2), example, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
                          **options)
    before = collective_counts()
    losses = [trainer.step(*b) for b in batches]
    after = collective_counts()
    interpreted = {f"{k}|{ph}": n - before.get((k, ph), 0) for (k, ph), n in after.items()
                   if ph in ("forward", "backward") and n != before.get((k, ph), 0)}
    return trainer, losses, interpreted


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plans", required=True, help="JSON object: plan name -> parallelize options")
    ap.add_argument("--backend", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    init_distributed(60)
    model, example = build_model("gpt-tiny", 8, 16, device="cpu", num_layers=1)
    batches = [build_model("gpt-tiny", 8, 16, device="cpu", seed=100 + s, num_layers=1)[1] for s in range(STEPS)]
    results = {}
    for name, options in json.loads(args.plans).items():
        plain, plain_losses, _ = train(model, example, batches, options)
        compiled, losses, interpreted = train(model, example, batches, {"plan": plain.plan, "compile": args.backend})
        got, want = compiled.state_dict(), plain.state_dict()
        graph = dict(compiled.program.collectives())
        graphs = [None] * dist.get_world_size()
        dist.all_gather_object(graphs, graph)
        plan_counts, buckets = Counter(), Counter()
        for c in plain.plan.collectives:
            if c.node.startswith("gradient bucket"):
                buckets[f"{c.kind}|{c.phase}"] += STEPS
            elif c.phase in ("forward", "backward"):
                plan_counts[c.kind] += 1
        ex = compiled.program.executor
        for key, shape in ex.regathered.items():  # ZeRO-3 copies the program keeps for backward
            if key not in ex.member:
                for step in forward_steps(key[1], key[2], shape, 4, ex.mesh.shape):
                    plan_counts[step.kind] -= step.is_collective
        for keys in ex.groups:  # the program moves a group's m members one by one, keeping their copies:
            plan_counts["all-gather"] += len(keys) - 2  # m forward, none again in backward (the plan: 1 and 1)
            plan_counts["reduce-scatter"] += len(keys) - 1  # m (the plan: 1)
        traced = [None] * dist.get_world_size()
        dist.all_gather_object(traced, isinstance(compiled.program.graph_module, torch.fx.GraphModule))
        results[name] = {"losses": losses, "plain_losses": plain_losses,
                         "param_diff": max(float((got[k] - v).abs().max()) for k, v in want.items()),
                         "graph_collectives": graphs, "plan_collectives": dict(plan_counts),
                         "interpreted_during_compiled": interpreted, "buckets_3_steps": dict(buckets),
                         "graph_module": all(traced)}
    finish(results, args.out)


if __name__ == "__main__":
    main()
