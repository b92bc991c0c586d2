"""Run on every rank by torchrun: parallel training under several plans vs the single-process
run of the same model, same seed, same batches. Rank 0 writes one JSON record per plan."""
import argparse
import copy
import json

import torch

from alpa_lite.runtime.launch import init_distributed
from alpa_lite.zoo.models import build_model
from alpa_lite import LogicalMesh, init_parameters, parallelize
from alpa_lite import plan as alpa_plan
from alpa_lite.runtime import collective_counts
from single_process import finish, reference

STEPS = 3
LR = 1e-2


def max_err(got: dict, want: dict) -> tuple[float, float]:
    err = max(float((got[k] - v).abs().max()) for k, v in want.items())
    return err, max(float(v.abs().max()) for v in want.values())


def check_init(args, shape) -> dict:
    """A meta model materialized shard by shard equals init_parameters() of the same model in one
    process; load_state_dict of full tensors round-trips through state_dict."""
    meta, example = build_model(args.model, args.batch, args.seq, device="meta")
    full = init_parameters(build_model(args.model, args.batch, args.seq, device="meta")[0], seed=7)
    trainer = parallelize(meta, shape, example, seed=7, param_specs=megatron_specs(full))
    got = trainer.state_dict()
    init_err = max(float((got[k] - v).abs().max()) for k, v in full.state_dict().items())
    torch.manual_seed(123)  # the same full tensors on every rank
    fresh = {}  # random values, the same tensor for tied names
    other = {k: fresh.setdefault(v.data_ptr(), torch.randn_like(v)) for k, v in full.state_dict().items()}
    trainer.load_state_dict(other)
    got = trainer.state_dict()
    load_err = max(float((got[k] - v).abs().max()) for k, v in other.items())
    return {"init_err": init_err, "load_err": load_err, "param_specs": trainer.plan.param_specs}


def dtensor_mismatch(trainer, model) -> list[str]:
    """Parameters whose DTensor, built from the full tensor with the plan's placements on the
    trainer's DeviceMesh, holds another local shard than the runtime (``Plan.placements``)."""
    from torch.distributed.tensor import distribute_tensor

    full = dict(model.named_parameters(remove_duplicate=False))  # tied weights by every name
    return [fqn for fqn, shard in trainer.params.items()
            if not torch.equal(distribute_tensor(full[fqn].detach(), trainer.mesh, trainer.plan.placements(fqn))
                               .to_local(), shard.detach())]


def megatron_specs(model) -> dict:
    """Column-split every 2D weight along mesh axis 1 where it divides (so shards really differ)."""
    return {k: "S1R" for k, p in model.named_parameters() if p.dim() == 2 and p.shape[0] % 2 == 0}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--mesh", default="2x2")
    ap.add_argument("--plans", required=True, help="JSON object: plan name -> parallelize options")
    ap.add_argument("--out", required=True)
    ap.add_argument("--check-init", action="store_true", help="also check meta init and load_state_dict")
    args = ap.parse_args()
    init_distributed(60)
    optimizers = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
    runs = {}  # (model batch and overrides, optimizer) -> model, example, single-process reference

    def run_of(batch: int, overrides: dict, opt: str):
        key = (batch, json.dumps(overrides, sort_keys=True), opt)
        if key not in runs:
            model, example = build_model(args.model, batch, args.seq, device="cpu", **overrides)
            batches = [build_model(args.model, batch, args.seq, device="cpu", seed=100 + s, **overrides)[1]
                       for s in range(STEPS)]
            runs[key] = model, example, batches, reference(model, batches, LR, optimizers[opt])
        return runs[key]

    results = {}
    for name, options in json.loads(args.plans).items():
        # "optimizer": "sgd" | "adamw" (default); "plan_mesh": LogicalMesh fields (a cluster
        # description) to plan on, the same plan on every rank, instead of the run's cluster;
        # "mesh": this plan's mesh shape ("1x4") instead of --mesh; "model": {"batch": ...,
        # config overrides} of the model this plan trains instead of --batch and the defaults
        options = dict(options)
        opt_name = options.pop("optimizer", "adamw")
        opt = optimizers[opt_name]
        shape = tuple(int(x) for x in options.pop("mesh", args.mesh).split("x"))
        overrides = dict(options.pop("model", {}))
        model, example, batches, (ref_losses, ref_grads, ref_params) = run_of(
            overrides.pop("batch", args.batch), overrides, opt_name)
        if "plan_mesh" in options:
            mesh = LogicalMesh(shape, **options.pop("plan_mesh"))
            options = {"plan": alpa_plan(copy.deepcopy(model), example, mesh, **options)}
        trainer = parallelize(copy.deepcopy(model), shape, example, optimizer=lambda p: opt(p, lr=LR), **options)
        dtensor_bad = dtensor_mismatch(trainer, model)
        before = collective_counts()
        losses = [trainer.step(*batches[0])]
        after = collective_counts()
        grad_err, grad_scale = max_err(trainer.gradients(), ref_grads)
        losses += [trainer.step(*b) for b in batches[1:]]
        param_err, param_scale = max_err(trainer.state_dict(), ref_params)
        runtime = {f"{k}|{ph}": after[(k, ph)] - before.get((k, ph), 0) for (k, ph) in after
                   if ph in ("forward", "recompute", "backward", "update") and after[(k, ph)] != before.get((k, ph), 0)}
        results[name] = {"losses": losses, "ref_losses": ref_losses, "grad_err": grad_err, "grad_scale": grad_scale,
                         "param_err": param_err, "param_scale": param_scale, "runtime_counts": runtime,
                         "plan_counts": {f"{k}|{ph}": n for (k, ph), n in trainer.plan.collective_counts().items()},
                         "param_specs": trainer.plan.param_specs,
                         "collectives": [c.to_dict() for c in trainer.plan.collectives],
                         "dtensor_mismatch": dtensor_bad}
        if "plan" in options:  # planned here: the captured graph is at hand
            results[name]["layer_norm_in_specs"] = [
                str(trainer.plan.nodes[n.name].in_specs[0]) for n in options["plan"].captured.graph.nodes
                if n.target is torch.ops.aten.layer_norm.default]
    if args.check_init:
        results["init"] = check_init(args, tuple(int(x) for x in args.mesh.split("x")))
    finish(results, args.out)


if __name__ == "__main__":
    main()
