"""What the multi-rank test workers share: the single-process reference run they compare
against, and writing their results."""
import copy
import json

import torch
import torch.distributed as dist


def reference(model, batches, lr, optimizer=torch.optim.AdamW):
    """Train a copy of ``model`` with ``optimizer`` (a ``torch.optim`` class) on ``batches``:
    (losses, first-step gradients, final parameters by every name, tied ones included)."""
    model = copy.deepcopy(model)
    opt = optimizer(model.parameters(), lr=lr)
    losses, grads = [], None
    for batch in batches:
        opt.zero_grad()
        loss = model(*batch)
        loss.backward()
        if grads is None:
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        losses.append(float(loss.detach()))
    return losses, grads, {k: v.detach() for k, v in model.named_parameters(remove_duplicate=False)}


def finish(results: dict, path: str) -> None:
    """Rank 0 writes ``results`` as JSON to ``path``; every rank then leaves the process group."""
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
