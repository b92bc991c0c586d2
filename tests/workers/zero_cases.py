"""Run on every rank by torchrun: ZeRO-1/2/3 plans (and ZeRO-2 with tensor parallelism on 2x2,
and ZeRO-1/2 inside the stages of pipelined plans) trained against one process, SGD and AdamW;
the bytes the trainer holds for parameters, gradients and optimizer states vs the plan's
prediction; the shapes of the tensors autograd saves for backward in the first step (kept as
they are, or replaced by a ZeRO-3 shard to gather again) and its prefetched all-gathers per
phase. A case with ``"checkpoint"`` saves after the second step and takes the third with a new
trainer of the same plan that loaded it. Rank 0 writes one record per case."""
import argparse
import copy
import json
from pathlib import Path

import torch
import torch.distributed as dist

from alpa_lite import parallelize
from alpa_lite.compiler.strategies import training_state_bytes
from alpa_lite.core.plan import local_bytes
from alpa_lite.runtime import collective_counts, collectives
from alpa_lite.runtime.collectives import GatheredParameters, GatherGroup
from alpa_lite.runtime.executor import LocalExecutor
from alpa_lite.runtime.launch import init_distributed
from single_process import finish, reference

STEPS, LR, HIDDEN, LAYERS, BATCH = 3, 1e-2, 64, 4, 16


def adamw_groups(params, lr):
    """nanoGPT's ``configure_optimizers``: weight decay for the matrices (``dim() >= 2``) only."""
    params = list(params)
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.5},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=lr)


# Adagrad makes its state (``sum``) when built, on the parameters it is given
OPTIMIZERS = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW, "adamw_groups": adamw_groups,
              "adagrad": torch.optim.Adagrad}


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(LAYERS))

    def forward(self, x, y):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            x = torch.relu(x) if i < LAYERS - 1 else x
        return torch.nn.functional.mse_loss(x, y)


class TemperatureMLP(MLP):
    """The MLP with its output scaled by a learned 0-dim temperature (CLIP's ``logit_scale``)."""

    def __init__(self):
        super().__init__()
        self.temperature = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x, y):
        return super().forward(x, y / self.temperature)


def held_bytes(trainer) -> dict[str, int]:
    """Bytes of the distinct storages the trainer holds for parameters, gradients and optimizer
    states (a ZeRO slice is a view of its parameter: counted once)."""
    seen, out = set(), {"params": 0, "grads": 0, "optimizer": 0}

    def add(kind, t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            out[kind] += storage.nbytes()
    tensors = list(trainer.params.values()) + [p for g in trainer.optimizer.param_groups for p in g["params"]]
    for p in tensors:
        add("params", p)
    for p in tensors:
        if p.grad is not None:
            add("grads", p.grad)
    for state in trainer.optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:  # AdamW's step count is a scalar
                add("optimizer", v)
    return out


def predicted_bytes(plan, model) -> float:
    """Parameters + gradients + Adam states per device the plan predicts (``training_state_bytes``;
    a pipelined plan: its stages' ``weight_bytes``, the largest)."""
    if plan.kind == "pipeline":
        return max(s.weight_bytes for s in plan.stages)
    total = 0.0
    for fqn, p in model.named_parameters():
        stage, axes = plan.zero_stages[fqn]
        n = 1
        for a in axes:
            n *= plan.mesh.shape[a]
        total += sum(training_state_bytes(local_bytes(p, plan.param_specs[fqn], plan.mesh.shape),
                                          stage if stage in (1, 2) else 0, n))
    return total


def step_counts(trainer, before, after) -> dict[str, int]:
    """The collectives of one step by ``"kind|phase"``: this rank's; a pipelined plan's: summed
    over one rank of each stage."""
    mine = {f"{k}|{ph}": after[(k, ph)] - before.get((k, ph), 0) for (k, ph) in after
            if ph in ("forward", "backward", "update") and after[(k, ph)] != before.get((k, ph), 0)}
    if trainer.plan.kind != "pipeline":
        return mine
    first = any(s.ranks[0] == dist.get_rank() for s in trainer.plan.stages)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine if first else {})
    out: dict[str, int] = {}
    for counts in every:
        for k, n in counts.items():
            out[k] = out.get(k, 0) + n
    return out


def send_gathers(plan) -> int:
    """All-gathers a pipelined step issues outside its stage plans: each sent value a stage
    produced split is gathered to replicated on its submesh before it crosses, per microbatch
    (one axis of more than one device per stage here)."""
    if plan.kind != "pipeline":
        return 0
    return plan.num_microbatches * sum(bool(s.plan.nodes[n].out_specs[0].axes()) for s in plan.stages for n in s.send
                                       if s.plan.nodes[n].strategy != "boundary")


class SavedShapes:
    """Wraps ``GatheredParameters.pack`` and ``collectives.all_gather_async``: the shapes of the
    tensors saved for backward while ``on``, kept as they are or replaced by a gathered copy's
    shard, and the prefetched all-gathers by phase."""

    def __init__(self):
        self.on, self.kept, self.replaced, self.prefetched = False, [], [], {}
        pack, start = GatheredParameters.pack, collectives.all_gather_async

        def recording(gathered, t):
            out = pack(gathered, t)
            if self.on:
                (self.kept if out is t else self.replaced).append(list(t.shape))
            return out

        def starting(x, dim, axes, mesh, phase):
            if self.on:
                self.prefetched[phase] = self.prefetched.get(phase, 0) + 1
            return start(x, dim, axes, mesh, phase)
        GatheredParameters.pack, collectives.all_gather_async = recording, starting
        # a ZeRO-3 group's all-gather is prefetched when it starts from the executor's forward
        # prefetch or backward's (not at the group's first use)
        self.ahead = False
        issue = GatherGroup.issue

        def issuing(group, phase):
            issued = issue(group, phase)
            if issued and self.on and self.ahead:
                self.prefetched[phase] = self.prefetched.get(phase, 0) + 1
            return issued
        GatherGroup.issue = issuing
        for cls, name in ((LocalExecutor, "_prefetch"), (GatheredParameters, "prefetch_backward")):
            setattr(cls, name, self._ahead(getattr(cls, name)))

    def _ahead(self, fn):
        def wrapped(*args):
            self.ahead = True
            try:
                return fn(*args)
            finally:
                self.ahead = False
        return wrapped


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", required=True, help="JSON: name -> {mesh, optimizer, options, model (default mlp)}")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    init_distributed(60)
    torch.manual_seed(0)
    models = {"mlp": MLP(), "temperature": TemperatureMLP()}
    batches = [(torch.randn(BATCH, HIDDEN), torch.randn(BATCH, HIDDEN)) for _ in range(STEPS)]
    results = {}
    saved = SavedShapes()
    for name, case in json.loads(args.cases).items():
        opt = OPTIMIZERS[case["optimizer"]]
        model = models[case.get("model", "mlp")]
        ref_losses, _, ref_params = reference(model, batches, LR, opt)
        trainer = parallelize(copy.deepcopy(model), tuple(case["mesh"]), batches[0],
                              optimizer=lambda p, opt=opt: opt(p, lr=LR), **case["options"])
        before = collective_counts()
        saved.on, saved.kept, saved.replaced, saved.prefetched = True, [], [], {}
        losses = [trainer.step(*batches[0])]
        saved.on = False
        after = collective_counts()
        losses += [trainer.step(*b) for b in batches[1:-1]]
        if case.get("checkpoint"):
            path = Path(args.out).parent / f"checkpoint-{name.replace('/', '-')}"
            trainer.save(path)
            trainer = parallelize(copy.deepcopy(model), tuple(case["mesh"]), batches[0], plan=trainer.plan,
                                  optimizer=lambda p, opt=opt: opt(p, lr=LR))
            trainer.load(path)
        losses.append(trainer.step(*batches[-1]))
        held = held_bytes(trainer)
        measured = torch.tensor([float(sum(held.values()))])
        dist.all_reduce(measured, op=dist.ReduceOp.MAX)
        params = trainer.state_dict()
        runtime = step_counts(trainer, before, after)
        results[name] = {
            "losses": losses, "ref_losses": ref_losses,
            "param_err": max(float((params[k] - v).abs().max()) for k, v in ref_params.items()),
            "runtime_counts": runtime, "send_gathers": send_gathers(trainer.plan),
            "plan_counts": {f"{k}|{ph}": n for (k, ph), n in trainer.plan.collective_counts().items()},
            "zero_stages": {k: [z, list(a)] for k, (z, a) in trainer.plan.zero_stages.items()},
            "param_specs": {k: str(v) for k, v in trainer.plan.param_specs.items()},
            "held": held, "held_max": float(measured), "predicted": predicted_bytes(trainer.plan, model),
            "saved_kept": saved.kept, "saved_replaced": saved.replaced, "prefetched": saved.prefetched}
    finish(results, args.out)


if __name__ == "__main__":
    main()
