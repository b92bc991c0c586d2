"""The single-process reference run the parallel workers compare against."""
import copy

import torch


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
