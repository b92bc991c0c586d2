"""Run on every rank by torchrun: small models exercising every placeholder kind and state
update (frozen parameters, buffers written by batch norm, tensor literals, no-grad regions,
reentrant checkpoints, autocast regions, dict / nested / keyword inputs, a mean left a partial sum) trained under several plans against one
process. Rank 0 writes one JSON record per (model, plan, optimizer)."""
import argparse
import copy
import json

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from alpa_lite.runtime.launch import init_distributed
from alpa_lite import parallelize
from single_process import finish

STEPS = 3
LR = 1e-2
B = 8


class Frozen(nn.Module):
    """A frozen embedding (``requires_grad_(False)``) feeding trainable layers."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.emb.weight.requires_grad_(False)
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, idx, y):
        h = torch.relu(self.fc1(self.emb(idx).mean(1)))
        return F.cross_entropy(self.fc2(h), y)

    @staticmethod
    def batch(g):
        return (torch.randint(0, 16, (B, 4), generator=g), torch.randint(0, 4, (B,), generator=g)), {}


class Norm(nn.Module):
    """Conv + BatchNorm2d: running statistics (and the batch counter) written every step."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)  # a bias before batch norm has gradient 0
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x, y):
        return F.cross_entropy(self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3))), y)

    @staticmethod
    def batch(g):
        return (torch.randn(B, 3, 4, 4, generator=g), torch.randint(0, 4, (B,), generator=g)), {}


class Literals(nn.Module):
    """Tensor literals in forward (lifted constants), nanoGPT's ``x[:, [-1], :]`` and a
    non-persistent buffer."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 4)
        self.register_buffer("shift", torch.linspace(-1, 1, 8), persistent=False)

    def forward(self, x):
        h = torch.relu(self.fc1(x * torch.tensor([1.0, 2.0, 3.0, 4.0])) + self.shift)
        return self.fc2(h)[:, [-1], :].pow(2).mean()

    @staticmethod
    def batch(g):
        return (torch.randn(B, 6, 4, generator=g),), {}


class Regions(nn.Module):
    """A ``torch.no_grad()`` block over values that need gradients and a reentrant checkpoint."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)
        self.fc3 = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        with torch.no_grad():
            scale = 1 + h.mean(-1, keepdim=True).sigmoid() + self.fc3.weight.mean()
        h = checkpoint(lambda t: torch.relu(self.fc2(t)), h * scale, use_reentrant=True)
        return self.fc3(h).pow(2).mean()

    @staticmethod
    def batch(g):
        return (torch.randn(B, 8, generator=g),), {}


class Autocast(nn.Module):
    """The loss comes out of an autocast region (the region's result is the graph's output),
    another autocast region returns two values, a no-grad region updates a buffer (an average of
    activations), and the target ``y`` is a keyword-only input. The autocast regions hold only ops
    that autocast runs in fp32 (layer norm, elementwise), so a sharded run equals one process
    (the bf16 casts are checked on one process, tests/test_placeholders.py)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.fc2 = nn.Linear(8, 8)
        self.register_buffer("avg", torch.zeros(8))

    def forward(self, x, *, y):
        h = torch.relu(self.fc1(x))
        with torch.no_grad():
            self.avg.mul_(0.9).add_(0.1 * h.mean(0))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            z = self.norm(h)
            err = (z - y).pow(2)
        h = self.fc2(z + self.avg)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return err.mean() + h.pow(2).mean()

    @staticmethod
    def batch(g):
        return (torch.randn(B, 8, generator=g),), {"y": torch.randn(B, 8, generator=g)}


class Structured(nn.Module):
    """A dict input, a nested tuple input and HF-style keyword inputs (``labels=``, a flag)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, feats, pair, labels=None, scale=1.0):
        h = torch.relu(self.fc1(feats["a"] + pair[0] * pair[1][0])) * scale
        return F.cross_entropy(self.fc2(h), labels)

    @staticmethod
    def batch(g):
        x = lambda: torch.randn(B, 8, generator=g)  # noqa: E731
        return ({"a": x()}, (x(), (x(),))), {"labels": torch.randint(0, 4, (B,), generator=g), "scale": 2.0}


class Pooled(nn.Module):
    """A mean over the sequence dim whose consumers are linear in it (a scale, a view, a sum):
    with the sequence split, the mean can leave its result a partial sum (each rank's local sum
    over the shards) that they pass through, so that only the small logits are all-reduced."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 64)
        self.scale = nn.Parameter(torch.randn(64))

    def forward(self, x, y):
        pooled = torch.relu(self.fc(x)).mean(1) * self.scale
        return F.cross_entropy(pooled.view(-1, 16, 4).sum(1), y, reduction="sum")

    @staticmethod
    def batch(g):
        return (torch.randn(B, 8, 8, generator=g), torch.randint(0, 4, (B,), generator=g)), {}


MODELS = {m.__name__.lower(): m for m in (Frozen, Norm, Literals, Regions, Autocast, Structured, Pooled)}
OPTIMIZERS = {"sgd": lambda p: torch.optim.SGD(p, lr=LR), "adamw": lambda p: torch.optim.AdamW(p, lr=LR)}


def reference(model, batches, make_opt):
    """One process: (losses, first-step gradients, final parameters and buffers)."""
    model = copy.deepcopy(model)
    opt = make_opt([p for p in model.parameters() if p.requires_grad])
    losses, grads = [], None
    for args, kwargs in batches:
        opt.zero_grad()
        loss = model(*args, **kwargs)
        loss.backward()
        if grads is None:
            grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        opt.step()
        losses.append(float(loss.detach()))
    return losses, grads, {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_err(got: dict, want: dict) -> float:
    missing = set(want) - set(got)
    if missing:
        raise AssertionError(f"missing {sorted(missing)}")
    return max((float((got[k].double() - v.double()).abs().max()) for k, v in want.items()), default=0.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", required=True, help="JSON list of [model, plan name, parallelize options]")
    ap.add_argument("--mesh", default="2x2")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    init_distributed(120)
    shape = tuple(int(x) for x in args.mesh.split("x"))
    results = {}
    for model_name, plan_name, options in json.loads(args.cases):
        cls = MODELS[model_name]
        torch.manual_seed(0)
        model = cls()
        g = torch.Generator().manual_seed(1)
        batches = [cls.batch(g) for _ in range(STEPS)]
        example, example_kwargs = batches[0]
        options = dict(options)  # "mesh": this case's mesh shape ("1x4") instead of --mesh
        case_shape = tuple(int(x) for x in options.pop("mesh").split("x")) if "mesh" in options else shape
        for opt_name, make_opt in OPTIMIZERS.items():
            ref_losses, ref_grads, ref_state = reference(model, batches, make_opt)
            trainer = parallelize(copy.deepcopy(model), case_shape, example, example_kwargs=example_kwargs,
                                  optimizer=make_opt, timeout_s=120, **options)
            a, k = batches[0]
            losses = [trainer.step(*a, **k)]
            grads = trainer.gradients() if hasattr(trainer, "gradients") else None
            snapshot = trainer.state_dict()  # after step 1: a snapshot to return to (early stopping's best weights)
            held = {k: v.clone() for k, v in snapshot.items()}
            losses += [trainer.step(*a, **k) for a, k in batches[1:]]
            state = trainer.state_dict()
            snapshot_moved = max_err(snapshot, held)
            trainer.load_state_dict(snapshot)
            rollback_err = max_err(trainer.state_dict(), held)
            results[f"{model_name}|{plan_name}|{opt_name}"] = {
                "losses": losses, "ref_losses": ref_losses,
                "grad_err": None if grads is None else max_err(grads, ref_grads),
                "grad_names": None if grads is None else sorted(grads),
                "ref_grad_names": sorted(ref_grads),
                "state_err": max_err(state, ref_state),
                "state_names": sorted(state), "ref_state_names": sorted(ref_state),
                "snapshot_moved": snapshot_moved, "rollback_err": rollback_err,
                "optimizer_tensors": sum(len(g["params"]) for g in trainer.optimizer.param_groups) if trainer.optimizer else 0,
                "ref_trainable": sum(1 for p in model.parameters() if p.requires_grad),
                "pipelined": trainer.plan.kind == "pipeline",
            }
    finish(results, args.out)


if __name__ == "__main__":
    main()
