"""One rank's training step of an SPMD plan lowered to a ``torch.fx.GraphModule`` and run under
``torch.compile`` (``parallelize(..., compile=True)``); the interpreter (``executor.py``) stays
the debug path.

The lowering traces (``make_fx`` on fake tensors of this rank's local shapes) what the
interpreter runs for one microbatch: the forward on local shards with the plan's collectives,
the loss weighted as ``ParallelTrainer._accumulate`` weighs it, and its backward through the
collectives' explicit duals (``collectives.py``), every collective issued as a
``torch.distributed._functional_collectives`` op (``functional_collectives``). The result is
one graph per rank: aten ops on local shapes and ``_c10d_functional`` collectives, each followed
by its ``wait_tensor``, in the interpreter's order, so its values are the interpreter's. It
takes the placeholders' local values and the loss scale, and returns the weighted loss, its
weight, the trainable parameters' gradients, the new values of the mutated buffers and the
loss denominators. The deferred data-parallel gradient buckets, ZeRO's collectives and the
optimizer stay outside it, in the trainer (the buckets all start after the step's backward).

A ZeRO-3 parameter's gathered copy is kept for backward in the program (the interpreter gathers
it again, ``collectives.GatheredParameters``, whose saved-tensor hooks key on storage addresses
that traced tensors do not have): the program's backward lacks those re-gathers of the plan,
and it moves the members of a ZeRO-3 group (``core.plan.zero3_groups``) one by one, an all-gather
and a gradient reduce-scatter each, where the plan lists the group's flat collectives.

Not lowered (``ValueError`` when the program is built): random ops that draw (the interpreter
seeds each with its per-shard seed between ops; a dropout of probability 0 is lowered),
activation checkpointing (``Plan.remat``) and in-place writes to stored tensors. Pipelined plans
are refused by ``parallelize``.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ..core.aten import bind_args
from .collectives import functional_collectives
from .executor import LocalExecutor, Dispatch

_KINDS = {"all_reduce": "all-reduce", "all_gather_into_tensor": "all-gather",
          "reduce_scatter_tensor": "reduce-scatter", "all_to_all_single": "all-to-all"}


def _draws(d: Dispatch) -> bool:
    """Whether a random op's values depend on its draws: not a dropout of probability 0 (an
    attention without dropout, a ``Dropout(0)``)."""
    args = bind_args(d.target, d.args, d.kwargs)
    p = args.get("dropout_p", args.get("p"))
    return not (isinstance(p, (int, float)) and p == 0)


class RankProgram:
    """This rank's step as a ``torch.fx.GraphModule`` (module docstring), traced on its first
    call and compiled with ``torch.compile(backend=backend)`` (None: the GraphModule runs as is).

    Args:
        executor: the rank's interpreter of the plan (its dispatch tables are what is lowered).
        weight: ``(values, loss) -> w``: the microbatch's loss weight (0-dim, detached).
        kept: names of the values returned besides the loss (the mutated buffers' new values).
        backend: a ``torch.compile`` backend name, or None.

    Attributes:
        graph_module: the traced ``GraphModule`` (None before the first call).

    Raises:
        ValueError: the plan has random ops that draw, recomputed layers or in-place writes to
            stored tensors (the message names them).
    """

    def __init__(self, executor: LocalExecutor, weight: Callable, kept: list[str], backend: str | None):
        unsupported = [f"random op {n}" for n, d in executor.dispatch.items() if d.random and _draws(d)]
        unsupported += [f"in-place write {n}" for n, d in executor.dispatch.items() if d.written or d.mutates]
        unsupported += ["activation checkpointing (remat)"] if executor.plan.remat else []
        if unsupported:
            raise ValueError("compile=True cannot lower this plan (run it without compile): "
                             + ", ".join(unsupported[:5]) + (" ..." if len(unsupported) > 5 else ""))
        self.executor, self.weight, self.kept, self.backend = executor, weight, list(kept), backend
        self.graph_module: torch.fx.GraphModule | None = None
        self._compiled = None
        self._names: list[str] = []  # placeholder order of the graph's inputs
        self._grads: list[str] = []  # placeholders whose gradient the graph returns, in order
        self._denominators: list[str] = []

    def __call__(self, env: dict[str, torch.Tensor], scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Run one microbatch: ``env`` maps placeholder names to local shards, ``scale`` seeds
        the backward (the fp16 loss scale, else 1). Returns ``(w L, w, gradients by placeholder,
        kept values by name)``; the executor's ``denominators`` are set as a run sets them."""
        if self.graph_module is None:
            self._names = list(env)
        flat = [env[n] for n in self._names] + [torch.tensor(float(scale))]
        if self.graph_module is None:
            self.graph_module = make_fx(self._step, tracing_mode="fake")(*flat)
            self._compiled = (torch.compile(self.graph_module, backend=self.backend, fullgraph=True)
                              if self.backend else self.graph_module)
        with torch.no_grad():
            out = list(self._compiled(*flat))
        term, weight = out[0], out[1]
        grads = dict(zip(self._grads, out[2:2 + len(self._grads)]))
        rest = out[2 + len(self._grads):]
        values = dict(zip(self.kept, rest))
        self.executor.denominators.update(zip(self._denominators, rest[len(self.kept):]))
        return term, weight, grads, values

    def _step(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The traced function: forward, weight, backward of one microbatch (``__call__``)."""
        *inputs, scale = flat
        env = dict(zip(self._names, inputs))
        with functional_collectives():
            values = self.executor.run(env)
            loss = values[self.executor.cg.loss_name]
            weight = self.weight(values, loss)
            term = loss * weight
            wrt = [n for n in self._names if env[n].requires_grad]
            grads = torch.autograd.grad(term, [env[n] for n in wrt], scale.to(term), allow_unused=True)
        self._grads = [n for n, g in zip(wrt, grads) if g is not None]
        self._denominators = list(self.executor.denominators)
        return (term.detach(), weight, *(g for g in grads if g is not None), *(values[n].detach() for n in self.kept),
                *(self.executor.denominators[n] for n in self._denominators))

    def collectives(self) -> Counter:
        """Collectives in the graph by kind (``"all-reduce"`` ...): the plan's forward and
        backward ones (``Plan.collectives`` of those phases, gradient buckets excluded), less the
        backward re-gathers of ZeRO-3 copies, with a ZeRO-3 group's moved per member (module
        docstring)."""
        kinds = Counter()
        for node in self.graph_module.graph.nodes:
            name = getattr(node.target, "_opname", None) if node.op == "call_function" else None
            if name in _KINDS and node.target.namespace == "_c10d_functional":
                kinds[_KINDS[name]] += 1
        return kinds
