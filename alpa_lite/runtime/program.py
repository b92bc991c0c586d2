"""One rank's training step lowered to ``torch.fx`` graphs and run under ``torch.compile``
(``parallelize(..., compile=True)``); the interpreter (``executor.py``) stays the debug path.

An SPMD plan (``RankProgram``): the lowering traces (``make_fx`` on fake tensors of this rank's
local shapes) what the interpreter runs for one microbatch: the forward on local shards with the
plan's collectives, the loss weighted as ``ParallelTrainer._accumulate`` weighs it, and its
backward through the collectives' explicit duals (``collectives.py``), every collective issued
as a ``torch.distributed._functional_collectives`` op (``functional_collectives``). The result
is one graph per rank: aten ops on local shapes and ``_c10d_functional`` collectives, each
followed by its ``wait_tensor``, in the interpreter's order, so its values are the
interpreter's; then ``overlap.py`` moves prefetchable collectives earlier and waits read only by
the outputs later (``RankProgram.overlap``; the same values). It takes the placeholders' local values and the loss scale, and returns the
weighted loss, its weight, the trainable parameters' gradients, the new values of the mutated
buffers and the loss denominators. A step of one microbatch sums the deferred data-parallel
gradient buckets' all-reduces in the graph (``RankProgram.buckets``): each is traced where
backward completes its gradients, as ``grad_sync.BucketSync``'s hooks launch it, and the graph
returns the sums in place of those gradients. ZeRO's collectives (its reduce-scatter buckets
included), the buckets of accumulated microbatches and the optimizer stay outside it, in the
trainer. So does the loss's all-reduce where the plan defers it (``Collective.deferred``;
``LocalExecutor.defer_loss``): the graph back-propagates the local partial sum (of a token mean,
its numerator) as the interpreter does, returns the loss's local parts in place of its weight,
and the all-reduce of those starts after the graph, before the trainer's buckets, waited for
once the step's microbatches ran.

A pipeline stage (``StageProgram``): its forward of one microbatch (the stage's nodes with its
intra-stage collectives, and the all-gathers of the values it sends to replicated) is traced by
AOT autograd (``torch._functorch.aot_autograd.aot_function``) with its backward, through the
same explicit duals and functional collectives, into one joint graph, which the default
partitioner splits as eager autograd runs it (the forward's ops, collectives included, in the
forward graph; the tensors backward reads saved): a forward and a backward ``GraphModule`` on
local shapes, each reordered by ``overlap.py`` (``StageProgram.overlap``), compiled with the
backend and run as one ``torch.autograd.Function``. So the pipeline runtime (``pipeline.py``)
keeps the schedule, the sends and receives between stages, the gradient buckets and a deferred
loss's all-reduce (the last stage's forward graph returns the loss's local parts, whose
all-reduce starts after it, as the interpreter's in its forward): it calls the program where it
ran the stage's nodes, and its ``torch.autograd.backward`` from the received gradients (or the weighted loss) runs the
compiled backward, whose parameter gradients accumulate into ``.grad`` over the microbatches
(the bucket hooks fire as in the interpreter). A schedule that splits the backward (ZB-H1) is
refused: the compiled backward is one graph giving the input and the weight gradients together.

Random ops and recomputed layers are traced as ``lowering.py`` describes. A random op that draws
(a dropout, an attention's dropout) is one opaque ``alpa_lite::seeded`` op whose seed is an
input of the graph: each call of a program passes the seeds the interpreter would seed its ops
with in that run (``LocalExecutor.shard_seed``: rank's shard coordinates, run count, node; a
program call is a run, a pipeline microbatch too), so every rank draws the interpreter's masks,
new ones every microbatch and step, the same on the ranks holding the same values; its backward
runs the op again after the same seed. A layer of ``Plan.remat`` runs in forward without
keeping its activations and again in backward, its collectives there (the plan's
``"recompute"`` phase), and its random ops drawing as in its forward: in the SPMD graph where
the gradient reaches the layer, in a stage's backward graph. The default partitioner copies
into each graph every node it can compute from the graph's inputs, so the partitioned graphs
are dead-code eliminated (``_has_effect``): a recomputed layer's forward would otherwise run
again, collectives included, with nothing reading it.

A ZeRO-3 parameter's gathered copy is kept for backward in both programs (the interpreter
gathers it again, ``collectives.GatheredParameters``, whose saved-tensor hooks key on storage
addresses that traced tensors do not have): the programs' backward lacks those re-gathers of the
plan. A ZeRO-3 group (``core.plan.zero3_groups``) moves by the plan's flat collectives, one
all-gather and one gradient reduce-scatter (``collectives.GroupGather``; in a recomputed layer:
the all-gather in its forward and again in its recomputation), as the interpreter moves it.

Not lowered (``ValueError`` when the program is built): in-place writes to stored tensors (an
``embedding_renorm_`` of ``max_norm``, which the interpreter writes back into the stored shard
outside autograd), and in the pipeline runtime a schedule that splits the backward (ZB-H1).
"""
from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from functools import partial

import torch
from torch._functorch.aot_autograd import aot_function, make_boxed_func
from torch._functorch.partitioners import default_partition
from torch.fx.experimental.proxy_tensor import make_fx

from ..core.aten import alias_root, bind_args, op_args
from .collectives import all_reduce_sum, functional_collectives, named
from .executor import DeferredLoss, Dispatch, LocalExecutor
from .grad_sync import bucket_dtype
from .overlap import overlap_collectives

_KINDS = {"all_reduce": "all-reduce", "all_gather_into_tensor": "all-gather",
          "reduce_scatter_tensor": "reduce-scatter", "all_to_all_single": "all-to-all"}


def _draws(d: Dispatch) -> bool:
    """Whether a random op's values depend on its draws: not a dropout of probability 0 (an
    attention without dropout, a ``Dropout(0)``) nor one outside training."""
    args = bind_args(d.target, d.args, d.kwargs)
    p = args.get("dropout_p", args.get("p"))
    return not (isinstance(p, (int, float)) and p == 0) and args.get("train") is not False


def _random_nodes(executor: LocalExecutor) -> list[str]:
    """The plan's random ops that draw, in graph order: each takes its seed from the graph's input."""
    return [n for n, d in executor.dispatch.items() if d.random and d.plan is not None and _draws(d)]


def _check_lowerable(executor: LocalExecutor) -> None:
    """Raise ``ValueError`` naming what of ``executor``'s plan the lowering does not cover
    (module docstring): in-place writes to stored tensors (a parameter or buffer, or a view of
    one); a write into an activation is traced as it runs."""
    def stored(node: str, arg: str) -> bool:
        return alias_root(op_args(executor.cg.node(node))[arg]).op == "placeholder"

    problems = [f"in-place write {n}" for n, d in executor.dispatch.items()
                if d.mutates or any(stored(n, a) for a in d.written or ())]
    if problems:
        raise ValueError("compile=True cannot lower this plan (run it without compile): "
                         + ", ".join(problems[:5]) + (" ..." if len(problems) > 5 else ""))


def _has_effect(node: torch.fx.Node) -> bool:
    """Whether a node of a partitioned graph is kept unused: its inputs, its output and in-place
    ops. The partitioner copies into a graph every node it can compute from the graph's inputs
    and keeps those a ``wait_tensor`` reads (``torch.fx`` counts it impure): a recomputed layer's
    forward, computable from its saved inputs, would run a second time, its collectives included,
    with nothing reading it. The graphs are functional (collectives included), so nothing else
    that is unused has an effect."""
    return node.op in ("placeholder", "output") or (isinstance(node.target, torch._ops.OpOverload)
                                                    and node.target._schema.is_mutable)


class _Seeds:
    """The seeds of ``executor``'s random ops that draw (``_random_nodes``) in its current run,
    a graph input (``seeds()``: int64 ``[ops]``), and while ``tracing(seeds)`` is open, the
    executor's random ops take theirs from it (``LocalExecutor.seeds``; ``lowering.seeded_call``)."""

    def __init__(self, executor: LocalExecutor):
        self.executor, self.nodes = executor, _random_nodes(executor)

    def seeds(self) -> torch.Tensor:
        return torch.tensor([self.executor.shard_seed(n) for n in self.nodes], dtype=torch.int64)

    @contextlib.contextmanager
    def tracing(self, seeds: torch.Tensor):
        self.executor.seeds = {n: seeds[i] for i, n in enumerate(self.nodes)}
        try:
            yield
        finally:
            self.executor.seeds = {}


def _compiled(graph_module: torch.fx.GraphModule, backend: str | None) -> Callable:
    """``graph_module`` under ``torch.compile(backend=backend)`` (one graph), or as is for None.
    Its ``forward`` is compiled, not the module: a module's call (``torch.fx``'s wrapper) walks the
    traceback of an error raised in the graph (a collective's timeout) inside the compiled frame,
    and dynamo then raised "Attempt to trace generator" in its place."""
    return torch.compile(graph_module.forward, backend=backend, fullgraph=True) if backend else graph_module


class _Named:
    """``run`` (a compiled graph) failing as a collective once it has run: after a first call
    that succeeded (its trace and compilation done), a ``RuntimeError`` it raises is one of its
    collectives' (a peer died, stopped or timed out: gloo and NCCL raise plain ``RuntimeError``
    s), re-raised naming this rank and ``what`` (``collectives.named``), as the pipeline names its
    waits; memory errors are raised as they are. ``boxed``: ``run`` takes its
    arguments as one list (AOT autograd's calling convention)."""

    def __init__(self, run: Callable, what: str, boxed: bool = False):
        self.run, self.what, self.ran = run, what, False
        self._boxed_call = boxed

    def __call__(self, *args):
        with named(self.what) if self.ran else contextlib.nullcontext():
            out = self.run(*args)
        self.ran = True
        return out


def _graph_collectives(*graph_modules: torch.fx.GraphModule) -> Counter:
    """The ``_c10d_functional`` collectives in ``graph_modules`` by kind (``"all-reduce"`` ...)."""
    kinds = Counter()
    for gm in graph_modules:
        for node in gm.graph.nodes:
            name = getattr(node.target, "_opname", None) if node.op == "call_function" else None
            if name in _KINDS and node.target.namespace == "_c10d_functional":
                kinds[_KINDS[name]] += 1
    return kinds


class RankProgram:
    """This rank's step of an SPMD plan as a ``torch.fx.GraphModule`` (module docstring), traced
    on its first call and compiled with ``torch.compile(backend=backend)`` (None: the GraphModule
    runs as is).

    Args:
        executor: the rank's interpreter of the plan (its dispatch tables are what is lowered).
        weight: ``(values, loss) -> w``: the microbatch's loss weight (0-dim, detached).
        kept: names of the values returned besides the loss (the mutated buffers' new values).
        backend: a ``torch.compile`` backend name, or None.
        buckets: gradient all-reduce buckets the graph sums, ``(mesh axes, [parameter
            placeholders])`` in launch order (``grad_sync.BucketSync.in_program``), each launched
            during backward once its gradients are computed (``_BucketHooks``); their members'
            gradients are returned as the buckets' sums instead.
        dtype: the dtype the buckets are summed in (None: their first member's).

    Attributes:
        graph_module: the traced ``GraphModule`` (None before the first call).
        overlap: reorder its collectives to overlap compute (``overlap.py``) when it is traced
            (default); False: as traced.

    Raises:
        ValueError: the plan has in-place writes to stored tensors (the message names them).
    """

    def __init__(self, executor: LocalExecutor, weight: Callable, kept: list[str], backend: str | None,
                 buckets: list[tuple[tuple[int, ...], list[str]]] = (), dtype: torch.dtype | None = None):
        _check_lowerable(executor)
        self.executor, self.weight, self.kept, self.backend = executor, weight, list(kept), backend
        self.buckets, self.dtype = [(tuple(axes), list(members)) for axes, members in buckets], dtype
        self._seeds = _Seeds(executor)
        self.graph_module: torch.fx.GraphModule | None = None
        self.overlap = True
        self._compiled = None
        self._names: list[str] = []  # placeholder order of the graph's inputs
        self._grads: list[str] = []  # placeholders whose gradient the graph returns, in order
        self._denominators: list[str] = []
        self._deferred: DeferredLoss | None = None  # the traced run's (not started): its ratio and axes

    def __call__(self, env: dict[str, torch.Tensor], scale: float
                 ) -> tuple[tuple[torch.Tensor, torch.Tensor] | DeferredLoss, dict[str, torch.Tensor],
                            dict[str, torch.Tensor], list[torch.Tensor]]:
        """Run one microbatch: ``env`` maps placeholder names to local shards, ``scale`` seeds
        the backward (the fp16 loss scale, else 1). Returns ``(loss, gradients by placeholder,
        kept values by name, the buckets' sums)``, ``loss`` being ``(w L, w)``, or where the plan
        defers the loss's all-reduce the ``DeferredLoss`` started after the graph (its backward
        ran from the local partial sum, as the interpreter's); the gradients are those of the
        placeholders in no bucket, each bucket's sum a 1-D tensor of its members' gradients
        concatenated (``buckets``); the executor's ``denominators`` are set as a run sets them."""
        if self.graph_module is None:
            self._names = list(env)
        self.executor.calls += 1  # a run, as the interpreter's: new random draws
        flat = [env[n] for n in self._names] + [torch.tensor(float(scale)), self._seeds.seeds()]
        if self.graph_module is None:
            self.graph_module = make_fx(self._step, tracing_mode="fake")(*flat)
            if self.overlap:
                overlap_collectives(self.graph_module)
            self._compiled = _Named(_compiled(self.graph_module, self.backend),
                                    "a collective of the compiled step (forward, backward or a gradient bucket)")
        with torch.no_grad():
            out = list(self._compiled(*flat))
        loss = (out[0], out[1]) if self._deferred is None else DeferredLoss(
            out[0], out[1], self._deferred.ratio, self._deferred.axes).start(self.executor.mesh)
        grads = dict(zip(self._grads, out[2:2 + len(self._grads)]))
        rest = out[2 + len(self._grads):]
        values = dict(zip(self.kept, rest))
        self.executor.denominators.update(zip(self._denominators, rest[len(self.kept):]))
        return loss, grads, values, rest[len(self.kept) + len(self._denominators):]

    def _step(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The traced function: forward, weight, backward of one microbatch (``__call__``); of a
        deferred loss (``LocalExecutor.defer_loss``) the backward from its local partial sum,
        and its parts returned in place of the weight."""
        *inputs, scale, seeds = flat
        env = dict(zip(self._names, inputs))
        calls = self.executor.calls
        with functional_collectives(), self._seeds.tracing(seeds), self.executor.deferring():
            values = self.executor.run(env)
            self.executor.calls = calls  # the trace is not a run (``__call__`` counts it)
            self._deferred = self.executor.pending_loss.pop() if self.executor.pending_loss else None
            if self._deferred is None:
                weight = self.weight(values, values[self.executor.cg.loss_name])
                term = values[self.executor.cg.loss_name] * weight
            else:
                term, weight = self._deferred.local, self._deferred.parts
            wrt = [n for n in self._names if env[n].requires_grad]
            with _BucketHooks(self.buckets, env, self.executor.mesh, self.dtype) as buckets:
                grads = torch.autograd.grad(term, [env[n] for n in wrt], scale.to(term), allow_unused=True)
            summed = buckets.finish()
        self._grads = [n for n, g in zip(wrt, grads) if g is not None and n not in buckets.members]
        self._denominators = list(self.executor.denominators)
        return (term.detach(), weight, *(g for n, g in zip(wrt, grads) if n in self._grads),
                *(values[n].detach() for n in self.kept), *(self.executor.denominators[n] for n in self._denominators),
                *summed)

    def collectives(self) -> Counter:
        """Collectives in the graph by kind (``"all-reduce"`` ...): the plan's forward and
        backward ones (``Plan.collectives`` of those phases, gradient buckets excluded) and the
        all-reduces of ``buckets``, less the backward re-gathers of ZeRO-3 copies (module
        docstring)."""
        return _graph_collectives(self.graph_module)


class _BucketHooks:
    """While open, hooks on the gradients of ``RankProgram.buckets``' members (placeholders of
    ``env`` requiring grad) launch each bucket's all-reduce as soon as its members' gradients are
    computed, in the buckets' order (a complete bucket waits for those before it), as
    ``grad_sync.BucketSync`` launches them; ``finish`` launches the rest, a gradient backward
    never reached as zeros, and returns every bucket's sum. Under ``make_fx`` the launches are
    traced where backward computes the gradients, so each all-reduce runs in the graph during
    the rest of backward (``overlap.py`` defers its wait). The gradients and their order are
    the interpreter's, so are the concatenation and the sum."""

    def __init__(self, buckets, env: dict[str, torch.Tensor], mesh, dtype: torch.dtype | None):
        self.buckets, self.env, self.mesh, self.dtype = buckets, env, mesh, dtype
        self.members = {ph for _, members in buckets for ph in members}
        self.grads: dict[str, torch.Tensor] = {}
        self.sums: list[torch.Tensor] = []
        self._missing = [sum(env[ph].requires_grad for ph in members) for _, members in buckets]
        self._handles = []

    def __enter__(self):
        for k, (_, members) in enumerate(self.buckets):
            for ph in (ph for ph in members if self.env[ph].requires_grad):
                self._handles.append(self.env[ph].register_hook(partial(self._computed, k, ph)))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()

    def _computed(self, k: int, ph: str, grad: torch.Tensor) -> None:
        self.grads[ph] = grad
        self._missing[k] -= 1
        while len(self.sums) < len(self.buckets) and self._missing[len(self.sums)] == 0:
            self._launch()

    def _launch(self) -> None:
        axes, members = self.buckets[len(self.sums)]
        dtype = bucket_dtype(self.dtype, self.env[members[0]].dtype)
        flat = torch.cat([self.grads.get(ph, torch.zeros_like(self.env[ph])).reshape(-1).to(dtype)
                          for ph in members])
        self.sums.append(all_reduce_sum(flat, axes, self.mesh))

    def finish(self) -> list[torch.Tensor]:
        while len(self.sums) < len(self.buckets):
            self._launch()
        return self.sums


class StageProgram:
    """One pipeline stage's forward of a microbatch, and its backward, as two compiled
    ``torch.fx.GraphModule`` s on this rank's local shapes (module docstring): traced by AOT
    autograd on the first call, split by the default partitioner, each compiled with
    ``torch.compile(backend=backend)`` (None: run as traced), and run as one autograd function,
    so ``torch.autograd.backward`` from its outputs runs the compiled backward.

    Args:
        executor: the stage's interpreter of its plan (what is refused is read from it).
        run: ``env -> sent``: the stage's forward as the interpreter runs it
            (``PipelineTrainer._run_stage``): ``env`` maps placeholder and received value names
            to local tensors, gets every value it computes added, and the values sent to the
            next stage are returned (a list of tensors).
        kept: names of computed values returned besides the sent ones (the loss, the loss's
            denominator, the mutated buffers' new values).
        backend: a ``torch.compile`` backend name, or None.

    Attributes:
        forward_module, backward_module: the partitioned ``GraphModule`` s (None before the
            first call).
        overlap: reorder their collectives to overlap compute (``overlap.py``) when they are
            traced (default); False: as partitioned.

    Raises:
        ValueError: the stage's plan has in-place writes to stored tensors (the message names
            them).
    """

    def __init__(self, executor: LocalExecutor, run: Callable, kept: list[str], backend: str | None):
        _check_lowerable(executor)
        self.executor, self.run, self.kept, self.backend = executor, run, list(kept), backend
        self._seeds = _Seeds(executor)
        self.forward_module: torch.fx.GraphModule | None = None
        self.backward_module: torch.fx.GraphModule | None = None
        self.overlap = True
        self._function = None
        self._names: list[str] = []  # the tensors of ``env``, in the order the function takes them
        self._fixed: dict[str, object] = {}  # the rest of ``env`` (not tensors), fixed at the trace
        self._sent = 0
        self._denominators: list[str] = []
        self._deferred: DeferredLoss | None = None  # the traced run's (not started): its ratio and axes

    def __call__(self, env: dict[str, object]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        """Run the stage's forward of one microbatch on ``env`` (as ``run``'s). Returns ``(sent
        values, kept values by name)``, in autograd's graph through the compiled backward; the
        executor's ``denominators`` are set as a run sets them. Where the stage plan defers the
        loss's all-reduce (``LocalExecutor.defer_loss``), the kept loss is its local partial
        sum, and the ``DeferredLoss`` is started after the forward graph and appended to the
        executor's ``pending_loss``, as a run of the interpreter appends it."""
        if self._function is None:
            self._names = [n for n, v in env.items() if isinstance(v, torch.Tensor)]
            self._fixed = {n: v for n, v in env.items() if not isinstance(v, torch.Tensor)}
            self._function = aot_function(self._forward, fw_compiler=partial(self._compile, "forward"),
                                          bw_compiler=partial(self._compile, "backward"), partition_fn=self._partition)
        with functional_collectives(), self.executor.deferring():  # the first call traces the joint graph
            out = list(self._function(*(env[n] for n in self._names), self._seeds.seeds()))
        sent, rest = out[:self._sent], out[self._sent:]
        kept = dict(zip(self.kept, rest))
        self.executor.denominators.update(zip(self._denominators, rest[len(self.kept):]))
        if self._deferred is not None:
            self.executor.pending_loss.append(DeferredLoss(kept[self.executor.cg.loss_name], rest[-1],
                                                           self._deferred.ratio, self._deferred.axes
                                                           ).start(self.executor.mesh))
        return sent, kept

    def _forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The traced function: the stage's forward on ``tensors`` (``__call__``), and a deferred
        loss's parts last."""
        *tensors, seeds = tensors
        env = dict(zip(self._names, tensors)) | self._fixed
        with self._seeds.tracing(seeds):
            sent = self.run(env)
        self._deferred = self.executor.pending_loss.pop() if self.executor.pending_loss else None
        self._sent, self._denominators = len(sent), list(self.executor.denominators)
        return (*sent, *(env[n] for n in self.kept), *(self.executor.denominators[n] for n in self._denominators),
                *([] if self._deferred is None else [self._deferred.parts]))

    def _compile(self, phase: str, graph_module: torch.fx.GraphModule, _example_inputs) -> Callable:
        """AOT autograd's compiler of the forward and the backward graph: ``_compiled``, taking
        its arguments as one list (AOT autograd's boxed calling convention), its collectives'
        failures named (``_Named``)."""
        return _Named(make_boxed_func(_compiled(graph_module, self.backend)),
                      f"a collective of the compiled stage's {phase}", boxed=True)

    def _partition(self, joint: torch.fx.GraphModule, inputs, **kwargs):
        """The default partitioner's split of the joint graph, kept as ``forward_module`` and
        ``backward_module``."""
        self.forward_module, self.backward_module = default_partition(joint, inputs, **kwargs)
        for gm in (self.forward_module, self.backward_module):
            gm.graph.eliminate_dead_code(is_impure_node=_has_effect)
            if self.overlap:
                overlap_collectives(gm)
            gm.recompile()
        return self.forward_module, self.backward_module

    def collectives(self, phase: str | None = None) -> Counter:
        """Collectives in the forward graph (``phase="forward"``), the backward graph
        (``"backward"``) or both (None), by kind (``"all-reduce"`` ...): one microbatch's of the
        stage plan in that phase (``Plan.collectives``, gradient buckets excluded), the forward's
        all-gathers of the sent values to replicated, less the backward re-gathers of ZeRO-3
        copies (module docstring)."""
        graphs = {"forward": [self.forward_module], "backward": [self.backward_module]}
        return _graph_collectives(*graphs.get(phase, [self.forward_module, self.backward_module]))
