"""Deterministic parameter initialization, one module at a time.

``init_parameters(model, seed)`` gives every module a real copy of its own parameters and
buffers and initializes them with ``module.reset_parameters()`` (or ``init_fn(module)``), the
RNG seeded from ``seed`` and the module's name. The value of a parameter therefore depends only
on (seed, name), not on how many other modules were built before it: a rank that materializes
one module at a time, keeps its shards and frees the rest gets exactly the values a
single-process ``init_parameters`` call gives.
"""
from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator

import torch

from .collectives import local_slice, reshard


def module_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def _materialize(module: torch.nn.Module, device, shared: dict[int, torch.Tensor]) -> None:
    """Give ``module``'s own meta tensors real storage; a tensor in ``shared`` (tied weights) gets
    one real tensor for all its owners."""
    for table in (module._parameters, module._buffers):
        for key, t in list(table.items()):
            if t is None or not t.is_meta:
                continue
            real = shared.get(id(t))
            if real is None:
                real = torch.empty_like(t, device=device)
                if isinstance(t, torch.nn.Parameter):
                    real = torch.nn.Parameter(real, requires_grad=t.requires_grad)
                if id(t) in shared:
                    shared[id(t)] = real
            table[key] = real


def init_module(name: str, module: torch.nn.Module, seed: int, device, init_fn: Callable | None,
                shared: dict[int, torch.Tensor] | None = None) -> None:
    """Materialize ``module``'s own (non-recursive) meta tensors on ``device`` and initialize them."""
    _materialize(module, device, {} if shared is None else shared)
    state = torch.random.get_rng_state()
    torch.manual_seed(module_seed(seed, name))
    try:
        with torch.no_grad():
            if init_fn is not None:
                init_fn(module)
            elif hasattr(module, "reset_parameters") and any(True for _ in module.parameters(recurse=False)):
                module.reset_parameters()
    finally:
        torch.random.set_rng_state(state)


def iter_init(model: torch.nn.Module, seed: int = 0, device="cpu", init_fn: Callable | None = None
              ) -> Iterator[tuple[str, torch.nn.Module]]:
    """Yield ``(name, module)`` after initializing each module that owns parameters or buffers.

    ``reset_parameters`` of a module must touch only its own tensors (true for torch.nn layers);
    ``init_fn(module)`` likewise (the ``model.apply(fn)`` style of GPT-2 and HuggingFace).
    """
    owners: dict[int, int] = {}
    for _, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        owners[id(t)] = owners.get(id(t), 0) + 1
    shared = {k: None for k, n in owners.items() if n > 1}
    for name, module in model.named_modules():
        if next(module.parameters(recurse=False), None) is None and next(module.buffers(recurse=False), None) is None:
            continue
        init_module(name, module, seed, device, init_fn, shared)
        yield name, module


def init_parameters(model: torch.nn.Module, seed: int = 0, device="cpu", init_fn: Callable | None = None) -> torch.nn.Module:
    """Initialize every parameter in place (the single-process reference of the runtime's init)."""
    for _ in iter_init(model, seed, device, init_fn):
        pass
    return model


def materialize_shards(model: torch.nn.Module, wanted: dict[str, str], take: Callable, seed: int = 0,
                       init_fn: Callable | None = None) -> None:
    """Call ``take(fqn, full_tensor)`` for every parameter or buffer FQN in ``wanted``: sliced from
    a real model, or, for a meta model, initialized one module at a time (``iter_init``) with
    each module's full tensors freed right after ``take`` kept what it needs."""
    full = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    if not any(t.is_meta for t in full.values()):
        for fqn in wanted:
            take(fqn, full[fqn])
        return
    for name, module in iter_init(model, seed, "cpu", init_fn):
        own = dict(module.named_parameters(recurse=False)) | dict(module.named_buffers(recurse=False))
        for short, tensor in own.items():
            fqn = f"{name}.{short}" if name else short
            if fqn in wanted:
                take(fqn, tensor)
        for table in (module._parameters, module._buffers):  # free the full copies
            for key, t in table.items():
                if t is not None:
                    table[key] = t.to("meta")


def local_shards(model: torch.nn.Module, cg, plan, groups, device, seed: int = 0,
                 init_fn: Callable | None = None) -> tuple[dict[str, torch.nn.Parameter], dict[str, torch.Tensor]]:
    """This rank's shards of the parameters and buffers of ``cg`` (the whole graph, or a stage's
    view of it) in the specs ``plan`` gives them: ``(FQN -> Parameter, FQN -> buffer)``, built
    with ``materialize_shards``."""
    params: dict[str, torch.nn.Parameter] = {}
    buffers: dict[str, torch.Tensor] = {}
    by_fqn = {fqn: ph for ph, fqn in {**cg.param_fqns, **cg.buffer_fqns}.items()}

    def take(fqn: str, full: torch.Tensor) -> None:
        spec = plan.nodes[by_fqn[fqn]].out_specs[0]
        shard = local_slice(full.detach(), spec, groups).to(device).clone()
        if by_fqn[fqn] in cg.param_fqns:
            params[fqn] = torch.nn.Parameter(shard)
        else:
            buffers[fqn] = shard

    materialize_shards(model, by_fqn, take, seed, init_fn)
    return params, buffers


def local_constants(cg, plan, groups, device) -> dict[str, torch.Tensor]:
    """This rank's slices of the lifted tensor constants (tensor literals in ``forward``) that
    ``plan``'s nodes read: placeholder name -> tensor in the spec ``plan`` gives it."""
    return {ph: local_slice(value.detach(), plan.nodes[ph].out_specs[0], groups).to(device)
            for ph, value in cg.constants.items() if ph in plan.nodes}


def store_buffer_mutations(cg, plan, values: dict, buffers: dict[str, torch.Tensor], groups) -> None:
    """Write the new values of mutated buffers (``cg.buffer_mutations``: batch-norm running
    statistics ...) into this rank's stored shards: each value is resharded from the spec its
    producer computed it in to the buffer's storage spec, so the stored shard gets the new value
    whatever spec the op that updated it used. The new shard replaces the old tensor (autograd
    may have saved the old one for backward)."""
    by_fqn = {fqn: ph for ph, fqn in cg.buffer_fqns.items()}
    with torch.no_grad():
        for out_name, fqn in cg.buffer_mutations.items():
            node = plan.nodes[out_name]
            stored = plan.nodes[by_fqn[fqn]].out_specs[0]
            shape = tuple(cg.node(out_name).meta["val"].shape)
            x = reshard(values[out_name].detach(), node.out_specs[0], stored, None, shape, groups)
            buffers[fqn] = x.clone()
