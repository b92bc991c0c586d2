"""Run on every rank by torchrun: plans with activation checkpointing (``remat``) train as one
process does, issuing the plan's collectives (a recomputed layer's again, in phase "recompute");
the bytes autograd keeps from the forward are measured. Rank 0 writes JSON."""
import argparse
import copy
import json

import torch

from alpa_lite import parallelize
from alpa_lite.runtime import collective_counts
from alpa_lite.runtime.launch import init_distributed
from alpa_lite.zoo.models import build_model
from single_process import finish, reference

STEPS = 3
LR = 1e-2


def state_bytes(trainer) -> int:
    """Bytes of this rank's training state after a step: parameter shards, their gradients and
    the optimizer's states (ZeRO slices' included), each storage once."""
    params = list(trainer.params.values()) + list(trainer.zero.slices.values())
    tensors = params + [p.grad for p in params] + [t for st in trainer.optimizer.state.values() for t in st.values()]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
                if isinstance(t, torch.Tensor) and t.dim() > 0}.values())


def saved_bytes(trainer, batch) -> int:
    """Bytes of the distinct tensors autograd saves in the forward of ``batch``, parameters left
    out (a recomputed layer saves nothing here: the checkpoint holds only its inputs, which count)."""
    params = {p.untyped_storage().data_ptr() for p in trainer.params.values()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = trainer.loss(*batch)
    loss.backward()  # recomputes the checkpointed layers: every rank runs their collectives again
    # (and starts the ZeRO-3 groups' reduce-scatters, which the next step() waits on and drops)
    return sum(seen.values())


def recomputed_bytes(trainer, batch) -> int:
    """The most bytes one recomputed layer saves when it runs again in backward: a forward of
    ``batch`` without checkpoints, each saved tensor counted for the layer of the node that saves
    it unless another layer's node produced it (the checkpoint holds that one already)."""
    ex = trainer.executor
    params = {p.untyped_storage().data_ptr() for p in trainer.params.values()}
    layer_of, ex.remat = ex.remat, {}
    current, producer, per_layer = [None], {}, {}
    call = ex._call

    def traced(node, values, moved, *rest):
        current[0] = layer_of.get(node.name)
        out = call(node, values, moved, *rest)
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                producer.setdefault(t.untyped_storage().data_ptr(), current[0])
        return out

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if current[0] is not None and ptr not in params and producer.get(ptr, current[0]) == current[0]:
            per_layer.setdefault(current[0], {})[ptr] = t.untyped_storage().nbytes()
        return t

    ex._call = traced
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            trainer.loss(*batch)
    finally:
        ex.remat = layer_of
        del ex._call
    return max((sum(v.values()) for v in per_layer.values()), default=0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plans", required=True, help="JSON object: plan name -> parallelize options (and \"mesh\", "
                    "default [2, 2])")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    init_distributed(60)
    model, example = build_model("gpt-tiny", args.batch, args.seq, device="cpu")
    batches = [build_model("gpt-tiny", args.batch, args.seq, device="cpu", seed=100 + s)[1] for s in range(STEPS)]
    ref_losses, _, ref_params = reference(model, batches, LR)
    results = {}
    for name, options in json.loads(args.plans).items():
        options = dict(options)
        trainer = parallelize(copy.deepcopy(model), tuple(options.pop("mesh", (2, 2))), example,
                              optimizer=lambda p: torch.optim.AdamW(p, lr=LR), **options)
        acts, recomputed = saved_bytes(trainer, batches[0]), recomputed_bytes(trainer, batches[0])
        before = collective_counts()
        losses = [trainer.step(*batches[0])]
        after = collective_counts()
        losses += [trainer.step(*b) for b in batches[1:]]
        got = trainer.state_dict()
        state = state_bytes(trainer)
        results[name] = {"losses": losses, "ref_losses": ref_losses,
                         "param_err": max(float((got[k] - v).abs().max()) for k, v in ref_params.items()),
                         "remat_layers": len(trainer.plan.remat), "predicted": trainer.plan.memory_bytes,
                         "measured": state + acts + recomputed, "saved_activations": acts, "recomputed": recomputed,
                         "runtime_counts": {f"{k}|{ph}": n - before.get((k, ph), 0) for (k, ph), n in after.items()
                                            if n != before.get((k, ph), 0)},
                         "plan_counts": {f"{k}|{ph}": n for (k, ph), n in trainer.plan.collective_counts().items()}}
    finish(results, args.out)


if __name__ == "__main__":
    main()
