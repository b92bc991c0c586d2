"""Run on every rank by torchrun: mixed-precision training (fp32 master parameters, bf16 / fp16
compute) under several plans vs a single-process run of the same recipe and, for bf16, vs one
under ``torch.autocast``; the fp16 loss scaler's skips and growth on every rank; rank 0 writes JSON."""
import argparse
import copy
import json

import torch
import torch.distributed as dist

from alpa_lite import parallelize
from alpa_lite.runtime.launch import init_distributed
from alpa_lite.zoo.models import build_model
from single_process import finish

STEPS = 3
LR = 0.1
OPTIMIZER = lambda params: torch.optim.SGD(params, lr=LR, momentum=0.9)  # noqa: E731 - fp32 state
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


def reference(model, batches, dtype):
    """One process: forward and backward with every parameter cast to ``dtype`` (the loss cast
    to fp32), SGD with momentum on the fp32 parameters; (losses, first-step gradients, final parameters)."""
    model = copy.deepcopy(model)
    opt = OPTIMIZER(model.parameters())
    losses, grads = [], None
    for batch in batches:
        opt.zero_grad()
        low = {n: p.to(dtype) for n, p in model.named_parameters()}
        loss = torch.func.functional_call(model, low, batch).float()
        loss.backward()
        grads = grads or {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        losses.append(float(loss.detach()))
    return losses, grads, {k: v.detach() for k, v in model.named_parameters(remove_duplicate=False)}


def autocast_reference(model, batches):
    """One process under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (its op lists decide the
    dtypes: matmuls and attention in bf16; embedding, the residual adds, layer norm and the
    cross-entropy in fp32), SGD with momentum on the fp32 parameters; as ``reference`` returns."""
    model = copy.deepcopy(model)
    opt = OPTIMIZER(model.parameters())
    losses, grads = [], None
    for batch in batches:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(*batch)
        loss.float().backward()
        grads = grads or {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        losses.append(float(loss.detach()))
    return losses, grads, {k: v.detach() for k, v in model.named_parameters(remove_duplicate=False)}


def differences(losses, grads, params, ref) -> dict:
    """How far a run's ``(losses, first-step gradients, final parameters)`` are from ``ref``'s:
    the largest relative loss difference, the largest gradient difference over the largest
    reference gradient, the largest parameter difference."""
    ref_losses, ref_grads, ref_params = ref
    return {"loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "grad_rel": max(float((grads[k] - v).abs().max()) for k, v in ref_grads.items())
            / max(float(v.abs().max()) for v in ref_grads.values()),
            "param_err": max(float((params[k] - v).abs().max()) for k, v in ref_params.items())}


def all_ranks(x):
    """``x`` of every rank, in rank order."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, x)
    return values


def recording_all_reduce():
    """Patch ``dist.all_reduce`` to record the (dtype, numel) of every call; returns the list."""
    seen, original = [], dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        seen.append((str(tensor.dtype), tensor.numel()))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce
    return seen


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plans", required=True, help="JSON object: plan name -> parallelize options")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    init_distributed(60)
    model, example = build_model("gpt-tiny", 8, 16, device="cpu")
    batches = [build_model("gpt-tiny", 8, 16, device="cpu", seed=100 + s)[1] for s in range(STEPS)]
    seen = recording_all_reduce()
    # a plan with "untied": the model with lm_head a parameter of its own (a copy of the embedding),
    # which pipelined ZeRO-1/2 needs (a weight two stages hold is not offered ZeRO-1/2)
    untied = copy.deepcopy(model)
    untied.lm_head.weight = torch.nn.Parameter(model.wte.weight.detach().clone())
    nets = {False: model, True: untied}
    autocast = {k: autocast_reference(m, batches) for k, m in nets.items()}
    bf16 = {k: reference(m, batches, torch.bfloat16) for k, m in nets.items()}
    results = {"recipe_vs_autocast": differences(*bf16[False], autocast[False])}  # the same recipe, one process
    for name, options in json.loads(args.plans).items():
        options = dict(options)
        untie = options.pop("untied", False)
        net = nets[untie]
        trainer = parallelize(copy.deepcopy(net), (2, 2), example, optimizer=OPTIMIZER,
                              **options)
        dtype = LOW[options["mixed_precision"]]
        r = {}
        if options["mixed_precision"] == "fp16":  # an inf in one gradient shard of rank 0 only
            ph = next(ph for ph, fqn in trainer.cg.param_fqns.items() if trainer.plan.param_specs[fqn] == "S1R")
            p = trainer.params[trainer.cg.param_fqns[ph]]
            before = {k: v.detach().clone() for k, v in trainer.params.items()}
            hook = p.register_hook(lambda g: g * float("inf")) if dist.get_rank() == 0 else None
            trainer.step(*batches[0])
            r["skipped"] = all_ranks(all(torch.equal(v.detach(), before[k]) for k, v in trainer.params.items()))
            r["scale_after_skip"] = all_ranks(trainer.scaler.scale)
            if hook is not None:
                hook.remove()
            # the 3 clean steps below: the scale doubles after the third (with 2, the last one runs at
            # 2^16, overflows for real and is skipped, which the reference without a scaler does not do)
            trainer.scaler.growth_interval = 3
        seen.clear()
        losses = [trainer.step(*batches[0])]
        first = trainer.gradients()
        scales = [trainer.scaler.scale] if trainer.scaler is not None else []
        for b in batches[1:]:
            losses.append(trainer.step(*b))
            scales += [trainer.scaler.scale] if trainer.scaler is not None else []
        r["scales"] = all_ranks(scales)
        buckets = [sum(trainer.params[trainer.view.param_fqns[ph]].numel() for ph in members)
                   for _, _, members in trainer.buckets]
        r["bucket_dtypes"] = sorted({d for d, n in seen if n in buckets})
        local = trainer.sp.plan if hasattr(trainer, "sp") else trainer.plan  # this rank's SPMD plan (its stage's)
        r["bucket_bytes_plan"] = sum(c.nbytes for c in local.collectives if c.node.startswith("gradient bucket"))
        r["param_bytes"] = sum(4 * trainer.params[trainer.view.param_fqns[ph]].numel() for ph in local.grad_sync)
        ref_losses, ref_grads, ref_params = bf16[untie] if dtype is torch.bfloat16 else reference(net, batches, dtype)
        r["grad_err"] = max(float((first[k] - v).abs().max()) for k, v in ref_grads.items())
        r["grad_scale"] = max(float(v.abs().max()) for v in ref_grads.values())
        got = trainer.state_dict()
        r["losses"], r["ref_losses"] = losses, ref_losses
        r["param_err"] = max(float((got[k] - v).abs().max()) for k, v in ref_params.items())
        if dtype is torch.bfloat16:
            r["vs_autocast"] = differences(losses, first, got, autocast[untie])
        r["master_dtypes"] = sorted({str(p.dtype) for p in trainer.params.values()})
        r["zero_stages"] = sorted({str(z) for z in local.zero_stages.values()})
        r["state_numel"] = sum(v.numel() for s in trainer.optimizer.state.values() for v in s.values()
                               if torch.is_tensor(v) and v.dim() > 0)
        r["param_numel"] = sum(p.numel() for p in trainer.params.values())
        r["state_dtypes"] = sorted({str(v.dtype) for s in trainer.optimizer.state.values() for v in s.values()
                                   if torch.is_tensor(v) and v.dim() > 0})
        results[name] = r
    finish(results, args.out)


if __name__ == "__main__":
    main()
