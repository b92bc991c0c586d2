"""What the executor runs differently while a compiled program traces it (``program.py``): a
random op as one opaque op seeded by a graph input, and a recomputed layer as an autograd
function whose backward runs the layer again.

Random ops (``seeded_call``). The interpreter (``executor.py``) runs a random op after
``manual_seed`` of its shard's seed, a side effect a trace does not record. In a trace the op
is instead ``alpa_lite::seeded(key, seed, tensors)``: at run time it seeds the generator with
``seed`` (a 0-dim int64 input of the graph, computed per run as the interpreter computes it),
runs the same aten call on ``tensors`` (the call's distinct tensor arguments; the rest of the
call is registered under ``key``) and restores the generator (``torch.random.fork_rng``): the
same kernel after the same seed, so the interpreter's numbers. Its backward,
``alpa_lite::seeded_grad``, runs the call again after the same seed under autograd and returns
``torch.autograd.grad`` of it: the interpreter's backward (the same derivative formulas on the
same values), at the cost of running the op again (a dropout's draw, an attention's forward).
Both ops are opaque to ``make_fx``, AOT autograd and ``torch.compile`` (a fallback kernel under
inductor): no pass merges, reorders or decomposes a draw.

Recomputed layers (``recomputed``): a layer of ``Plan.remat`` runs in forward without autograd,
keeping only its inputs, and its backward runs it again with autograd (under
``collectives.recomputing``) and back-propagates through that run, as ``torch.utils.checkpoint``
does in the interpreter (Chen et al. 2016). A trace records that backward where it runs: in the
traced step (``make_fx``) the recomputation, its collectives included, sits in the backward
where the gradient reaches the layer; AOT autograd's default partitioner puts it in the backward
graph (it computes nothing the forward returns), reading the saved inputs.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
import torch.utils._pytree as pytree

from .collectives import recomputing

# key -> (call: tensors -> list of tensors, seeding: seed -> context manager)
_CALLS: dict[str, tuple[Callable, Callable[[int], AbstractContextManager]]] = {}
_KEYS = itertools.count()
_KEY = torch._C.DispatchKey


def _tensor_leaves(tree) -> tuple[list[torch.Tensor], Callable]:
    """The distinct tensors among ``tree``'s leaves (by identity, first-seen order), and
    ``rebuild(tensors) -> tree`` with those tensors put back in their places."""
    leaves, spec = pytree.tree_flatten(tree)
    index: dict[int, int] = {}
    tensors = []
    for x in leaves:
        if isinstance(x, torch.Tensor) and id(x) not in index:
            index[id(x)] = len(tensors)
            tensors.append(x)
    slots = [(i, index[id(x)]) for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

    def rebuild(given) -> object:
        filled = list(leaves)
        for i, j in slots:
            filled[i] = given[j]
        return pytree.tree_unflatten(filled, spec)
    return tensors, rebuild


def seeded_call(call: Callable, args: tuple, kwargs: dict, seed: torch.Tensor,
                seeding: Callable[[int], AbstractContextManager], name: str, grad: bool = True):
    """``call(args, kwargs)`` (a random op of one node) as one ``alpa_lite::seeded`` op that
    draws after ``seeding(int(seed))`` (module docstring). ``seed``: a 0-dim int64 tensor;
    ``seeding``: ``int -> context manager`` that seeds the generator the call draws from and
    restores it after; ``name`` names the registered call. Returns what ``call`` returns (a
    tensor, or a tuple of tensors), contiguous; detached where ``grad`` is False (the node has no
    gradient in the captured graph: ``randn_like(h)`` noise, ``rand_like(h) > p`` masks), as the
    custom op's results need a gradient once a tensor it reads does (sweep 10: noise added to
    ``fc1``'s output under ``compile="aot_eager"`` died "plan and autograd disagree on whether a
    (8, 8, 64) tensor needs a gradient (plan: False)" under data parallel and Megatron)."""
    tensors, rebuild = _tensor_leaves((args, kwargs))
    single = []

    def run(*given: torch.Tensor) -> list[torch.Tensor]:
        out = call(*rebuild(given))
        single[:] = [isinstance(out, torch.Tensor)]
        return [o.contiguous() for o in ([out] if single[0] else out)]

    key = f"{name}#{next(_KEYS)}"
    _CALLS[key] = (run, seeding)
    out = torch.ops.alpa_lite.seeded(key, seed, tensors)
    out = out if grad else [o.detach() for o in out]
    return out[0] if single[0] else tuple(out)


@torch.library.custom_op("alpa_lite::seeded", mutates_args=())
def _seeded(key: str, seed: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    run, seeding = _CALLS[key]
    with seeding(int(seed)):
        return run(*tensors)


@_seeded.register_fake
def _(key, seed, tensors):
    return _CALLS[key][0](*tensors)


@torch.library.custom_op("alpa_lite::seeded_grad", mutates_args=())
def _seeded_grad(key: str, seed: torch.Tensor, tensors: list[torch.Tensor], grads: list[torch.Tensor]
                 ) -> list[torch.Tensor]:
    """The gradients of the floating-point ``tensors`` (in order) of the seeded call ``key``,
    given ``grads``, those of its floating-point outputs."""
    run, seeding = _CALLS[key]
    inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in tensors]
    with seeding(int(seed)), _autograd(), torch.enable_grad():
        outs = [o for o in run(*inputs) if o.is_floating_point()]
    wrt = [t for t in inputs if t.requires_grad]
    return [torch.zeros_like(t) if g is None else g.contiguous() for t, g in zip(wrt, _vjp(outs, grads, wrt))]


def _vjp(outs, grads, wrt: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """``torch.autograd.grad`` of the tensors among ``outs`` that require grad, given ``grads``
    (None for an output without one), with respect to ``wrt`` (None where nothing reaches one)."""
    pairs = [(o, g) for o, g in zip(outs, grads) if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
    if not pairs or not wrt:
        return [None] * len(wrt)
    return list(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True))


def _autograd() -> AbstractContextManager:
    """Autograd inside a custom op's implementation, which the dispatcher runs below autograd
    (the autograd keys excluded from the thread's dispatch keys): that exclusion lifted."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (_KEY.AutogradFunctionality, _KEY.AutogradOther, _KEY.AutogradNestedTensor):
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


@_seeded_grad.register_fake
def _(key, seed, tensors, grads):
    return [t.new_empty(t.shape) for t in tensors if t.is_floating_point()]


def _setup(ctx, inputs, output):
    key, seed, tensors = inputs
    ctx.key = key
    ctx.save_for_backward(seed, *tensors)
    ctx.outputs = [(o.shape, o.dtype, o.device) if o.is_floating_point() else None for o in output]


def _backward(ctx, grads):
    """The floating-point outputs' gradients (zeros for one not used) to ``seeded_grad``."""
    seed, *tensors = ctx.saved_tensors
    grads = [torch.zeros(like[0], dtype=like[1], device=like[2]) if g is None else g
             for g, like in zip(grads, ctx.outputs) if like is not None]
    got = iter(torch.ops.alpa_lite.seeded_grad(ctx.key, seed, tensors, grads))
    return None, None, [next(got) if t.is_floating_point() else None for t in tensors]


_seeded.register_autograd(_backward, setup_context=_setup)


class _Recomputed(torch.autograd.Function):
    """``run(*tensors) -> tuple`` kept without its activations: run again in backward.

    A result that is a view (``linear`` of a 3-d input views its 2-d ``mm``; a resharded local
    value) or one of ``tensors`` is returned detached: autograd refuses an in-place write into a
    custom function's view output ("Output 0 of _Recomputed is a view and is being modified
    inplace"), and the op after a recomputed layer may write its result in place (sweep 10: the
    ``inplace`` pattern's ``mul_`` of ``fc1``'s output under ``compile="aot_eager"``,
    ``remat="all"`` and Megatron specs died so; the interpreter's ``checkpoint`` ran it). The
    graph's writes through views are functionalized at capture, so no other value sees one.

    The results at the positions of ``frozen`` have no gradient (a ``torch.no_grad()`` block in
    the layer: a distillation target): marked non-differentiable, as autograd would mark every
    result of the function as needing a gradient once an input does (sweep 10: the ``nograd``
    pattern under ``compile="aot_eager"`` and ``remat="all"`` died "plan and autograd disagree on
    whether a (8, 8, 16) tensor needs a gradient (plan: False)")."""

    @staticmethod
    def forward(ctx, run, frozen, *tensors):
        ctx.run = run
        ctx.save_for_backward(*tensors)
        outs = tuple(o.detach() if isinstance(o, torch.Tensor) and (o._is_view() or any(o is t for t in tensors))
                     else o for o in run(*tensors))
        ctx.mark_non_differentiable(*(o for i, o in enumerate(outs) if i in frozen and isinstance(o, torch.Tensor)))
        return outs

    @staticmethod
    def backward(ctx, *grads):
        needs = ctx.needs_input_grad[2:]
        inputs = [t.detach().requires_grad_(n) for t, n in zip(ctx.saved_tensors, needs)]
        with torch.enable_grad(), recomputing():
            outs = ctx.run(*inputs)
        got = iter(_vjp(outs, grads, [t for t in inputs if t.requires_grad]))
        return (None, None, *(next(got) if t.requires_grad else None for t in inputs))


def recomputed(run: Callable, inputs: list, names: list[str], frozen: set[str] = frozenset()) -> dict[str, object]:
    """``run(*inputs)`` (a recomputed layer: ``inputs`` -> its values by name) under autograd as
    a layer kept without its activations (module docstring); returns the values of ``names``,
    those in ``frozen`` without a gradient."""
    tensors, rebuild = _tensor_leaves(inputs)
    out = _Recomputed.apply(lambda *given: tuple(run(*rebuild(given))[n] for n in names),
                            frozenset(i for i, n in enumerate(names) if n in frozen), *tensors)
    return dict(zip(names, out))
