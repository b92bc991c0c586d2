"""Run on every rank by torchrun: losses that are not a plain mean over equal parts (a token mean
with ignore_index and uneven valid targets per shard / microbatch, reduction="sum", a masked
token mean written by hand, a plain mean, a sum divided by ``y.numel()``) trained under SPMD and pipelined plans vs one process.
Rank 0 writes one JSON record per case: losses, first-step gradient and final parameter errors."""
import argparse
import copy
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

from alpa_lite.runtime.launch import init_distributed
from alpa_lite import parallelize
from single_process import finish

V, H, BATCH, SEQ, STEPS = 16, 8, 8, 4, 3
IGNORE = -100
# valid targets per row and step: shards of 2 rows and microbatches of 2 or 4 rows hold different
# counts; in the last step the first two rows (a whole shard / microbatch of 2) hold none
VALID = [[4, 1, 0, 3, 2, 4, 1, 2], [1, 3, 4, 4, 0, 2, 3, 1], [0, 0, 2, 4, 1, 3, 4, 2]]


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.fc1 = nn.Linear(H, 2 * H)
        self.fc2 = nn.Linear(2 * H, H)
        self.head = nn.Linear(H, V)

    def forward(self, x):
        h = self.emb(x)
        h = h + self.fc2(torch.relu(self.fc1(h)))
        return self.head(h)


def _per_token(o, y):
    return F.cross_entropy(o.reshape(-1, V), y.clamp(min=0).reshape(-1), reduction="none")


def _masked_mean(o, y):
    m = (y != IGNORE).reshape(-1).to(o.dtype)
    return (_per_token(o, y) * m).sum() / m.sum()


LOSSES = {
    "ce_ignore": lambda o, y: F.cross_entropy(o.reshape(-1, V), y.reshape(-1), ignore_index=IGNORE),
    "nll_ignore": lambda o, y: F.nll_loss(F.log_softmax(o, -1).reshape(-1, V), y.reshape(-1), ignore_index=IGNORE),
    "ce_sum": lambda o, y: F.cross_entropy(o.reshape(-1, V), y.reshape(-1), ignore_index=IGNORE, reduction="sum"),
    "masked_mean": _masked_mean,
    "plain_mean": lambda o, y: _per_token(o, y).mean(),
    "sum_numel": lambda o, y: F.cross_entropy(o.reshape(-1, V), y.reshape(-1), ignore_index=IGNORE,
                                              reduction="sum") / y.numel(),
}
OPTIMIZERS = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1), "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2)}


def batches():
    g = torch.Generator().manual_seed(5)
    out = []
    for s in range(STEPS):
        x = torch.randint(0, V, (BATCH, SEQ), generator=g)
        y = torch.randint(0, V, (BATCH, SEQ), generator=g)
        for i, n in enumerate(VALID[s]):
            y[i, n:] = IGNORE
        out.append((x, y))
    return out


def reference(model, loss_fn, optimizer, data):
    """One process: (losses, first-step gradients, parameters after each step)."""
    model = copy.deepcopy(model)
    opt = optimizer(model.parameters())
    losses, grads, params = [], None, []
    for x, y in data:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        grads = grads or {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        losses.append(float(loss.detach()))
        params.append({k: p.detach().clone() for k, p in model.named_parameters()})
    return losses, grads, params


def max_err(got, want):
    return max(float((got[k] - v).abs().max()) for k, v in want.items())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", required=True, help="JSON object: name -> {loss, optimizer, options}")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    init_distributed(120)
    torch.manual_seed(0)
    model = TinyLM()
    data = batches()
    results, plans = {}, {}
    for name, case in json.loads(args.cases).items():
        loss_fn, optimizer = LOSSES[case["loss"]], OPTIMIZERS[case["optimizer"]]
        ref_losses, ref_grads, ref_params = reference(model, loss_fn, optimizer, data)
        key = json.dumps([case["loss"], case["options"], case.get("mesh")], sort_keys=True)  # SGD and AdamW share a plan
        runtime = {k: v for k, v in case["options"].items() if k in ("compile", "accumulate")}
        options = {"plan": plans[key]} | runtime if key in plans else case["options"]
        trainer = parallelize(copy.deepcopy(model), tuple(case.get("mesh", (2, 2))), (data[0][0],), loss_fn,
                              targets=(data[0][1],),
                              optimizer=optimizer, **options)
        plans[key] = trainer.plan
        losses = [trainer.step(*data[0])]
        # a pipeline trainer has no gradients(): under SGD the first step's parameters show them
        grads = trainer.gradients() if hasattr(trainer, "gradients") else None
        first = max_err(trainer.state_dict(), ref_params[0])
        losses += [trainer.step(*b) for b in data[1:]]
        results[name] = {"losses": losses, "ref_losses": ref_losses,
                         "grad_err": None if grads is None else max_err(grads, ref_grads),
                         "grad_scale": max(float(v.abs().max()) for v in ref_grads.values()),
                         "first_step_param_err": first, "param_err": max_err(trainer.state_dict(), ref_params[-1]),
                         "loss_reduction": getattr(trainer.plan.loss_reduction, "kind", None),
                         "compiled": trainer.program is not None,
                         "deferred": [c.mesh_axes for sp in getattr(trainer.plan, "stages", [trainer])
                                      for c in sp.plan.collectives if c.deferred]}
    finish(results, args.out)


if __name__ == "__main__":
    main()
