"""Run a captured graph on local shards under a ``Plan``.

For every node: reshard each operand from its producer's spec to the spec the node's strategy
wants (``Reshard``, autograd-aware; once per value and wanted spec in a run, shared by its
readers, so their gradients are summed before the move's one backward), run the aten op on the
local shards, and reduce a partial result (``AllReducePartial``) unless its spec leaves it partial (``ShardingSpec.partial``: a
consumer's edge reduces it, or a linear consumer runs on it as is). Most ops run unchanged on shards; a few need a local variant:
shape arguments become local shapes, a mean over a split dim of equal shards is scaled by
1/shards before the all-reduce, a mean cross-entropy / nll is the all-reduced sum of its losses
over the all-reduced count of its valid targets (``losses.ratio_parts``: shards may hold
different counts of ``ignore_index``), a bias is added after the reduction, a vocab-parallel embedding looks up only
its own rows and a vocab-parallel cross-entropy all-reduces per-sample statistics instead of
gathering the logits (Megatron-LM, Shoeybi et al. 2019, section 3), a grouped convolution split
by groups runs its share of the groups, and a training batch norm over a split batch is a
synchronized one (statistics all-reduced). Arguments are read and set by their schema names
(``core.aten.bind_args``).

Random ops (dropout, bernoulli, ``rand_like``, attention dropout) draw from a generator seeded per
shard: from the run's seed, a call counter, the node and this rank's shard coordinates along the
mesh axes that split the op's result. Shards of a split value draw independent numbers; ranks
holding the same (replicated) values draw the same ones (Megatron-LM's model-parallel RNG tracker,
Shoeybi et al. 2019, section 3; Korthikanti et al. 2022, section 4.2). While a compiled program
traces a run (``program.py``), each takes its seed from the program's input (``seeds``) as one
opaque op instead (``lowering.seeded_call``).

The layers of ``plan.remat`` run under ``torch.utils.checkpoint`` (non-reentrant, without early
stop: a layer runs again whole, as the plan lists it): their activations are not kept but
recomputed on the local shards during backward, collectives and random draws included (the same
seeds: the recomputation runs with its forward's run count; the collectives count in phase
``"recompute"``, as the plan lists them); activation checkpointing, Chen et al. 2016. Traced,
a layer is ``lowering.recomputed`` instead, which a trace records (the checkpoint's saved-tensor
hooks are not).

A ZeRO-3 use (a parameter stored split and all-gathered for an op, ``resharding.regathers``)
outside those layers is not kept gathered for backward: forward drops the gathered copy after its
last reader and prefetches the next use's all-gather; ``collectives.GatheredParameters`` saves
the shard in its place and gathers it again in backward (ZeRO-3, Rajbhandari et al., SC'20,
section 5; FSDP's ``reshard_after_forward=True``). Inside a recomputed layer the uses are grouped
the same way (``Zero3Scope``): a group's one flat all-gather in forward and again in the
recomputation, whose copies are what backward reads (none gathered again), the next group of the
layer prefetched, and the gradients summed by the group's one asynchronous reduce-scatter (the
backward that runs is the forward's autograd graph, so the forward's group receives them).

An in-place op on a stored tensor (``embedding_renorm_`` of ``max_norm`` on a detached weight)
that ran on a resharded copy is written back to the stored shard. An operand written in place
that its reshard sliced without autograd (a view made under ``no_grad``: the batch rows of a
constant made in forward) is copied first; autograd refuses an in-place write with grad into it.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import math
import operator
import zlib

import torch
import torch.fx
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from ..core.aten import CONV_OPS, alias_root, bind_args, is_random, op_args, with_arg, written_args
from ..core.capture import CapturedGraph
from ..core.losses import MEAN, SUM, is_ratio, ratio_parts
from ..core.plan import NodePlan, Plan, zero3_groups, zero3_uses
from ..core.resharding import forward_steps
from .collectives import (AllReducePartial, AllReduceShared, GatheredParameters, GatherGroup, GroupGather,
                          MeshGroups, all_reduce_async, all_reduce_max, disagree, failed, functional, recomputing,
                          reshard)
from .lowering import recomputed, seeded_call

aten = torch.ops.aten
_SHAPE_ARG = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
              aten.unflatten.int}  # unflatten runs as a reshape to its local shape
_BIAS_AFTER = {aten.linear.default: "bias", aten.addmm.default: "self", aten.baddbmm.default: "self",
               aten.addmv.default: "self",
               **{conv: "bias" for conv in CONV_OPS}}


_BATCH_NORMS = {aten._native_batch_norm_legit_functional.default, aten._native_batch_norm_legit.default,
                aten._native_batch_norm_legit_no_training.default, aten.native_batch_norm.default,
                aten.batch_norm.default}
_LOCAL_ARGS = _BATCH_NORMS | set(CONV_OPS) | {aten.group_norm.default}  # the ops ``local_arguments`` rewrites


def local_arguments(target, args: tuple, kwargs: dict, in_specs, mesh_shape) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of ``target`` run on operands arriving in ``in_specs``: a grouped
    convolution (batched or not) or a group norm split by whole groups (``compiler.ops``'s rules) runs
    ``groups / shards`` of them; in a traced run (``functional()``: a compiled program) a batch
    norm gets a contiguous input (the CPU kernel returns a contiguous result whatever its input's
    strides, while its fake kernel keeps them: the graph, traced on fake tensors, viewed the result
    of a transposed input where the real result cannot be viewed, "view size is not compatible
    with input tensor's size and stride"); other calls are unchanged."""
    if target in _BATCH_NORMS and functional():
        x = bind_args(target, args, kwargs)["input"]
        return (args, kwargs) if x.is_contiguous() else with_arg(target, args, kwargs, "input", x.contiguous())
    if target in CONV_OPS:  # the channels: dim 1, or 0 of an unbatched input (its spatial dims: the weight's)
        a = bind_args(target, args, kwargs)
        name, dim = "groups", a["input"].dim() - a["weight"].dim() + 1
    elif target is aten.group_norm.default:
        a, name, dim = bind_args(target, args, kwargs), "num_groups", 1
    else:
        return args, kwargs
    if in_specs[0].dims[dim] and a[name] > 1:
        return with_arg(target, args, kwargs, name, a[name] // in_specs[0].shards(dim, mesh_shape))
    return args, kwargs


class Dispatch:
    """What running one node takes, worked out once: the op, its arguments with local shapes
    written in (graph ``Node`` operands), the operands to reshard (``moves``; those that arrive
    in the spec they are read in, ``checks``, only have their ``requires_grad`` checked against
    the plan), and which variant runs (``variant``: None for the op itself on its local operands;
    ``local_args``: whether ``local_arguments`` rewrites its arguments)."""

    __slots__ = ("plan", "target", "args", "kwargs", "moves", "checks", "getitem", "random", "written",
                 "writes", "mutates", "early", "variant", "local_args")

    def __init__(self, node: torch.fx.Node, np_: NodePlan | None, operands: list[tuple], local_shape, device,
                 mutates: str | None, early: bool):
        self.plan = np_
        # (producer, its spec, wanted spec, gradient partial axes, shape): ``reshard`` is a no-op
        # where the specs are equal and no partial gradient comes back
        moving = [op[1] != op[2] or bool(op[3]) for op in operands]
        self.moves = [op for op, m in zip(operands, moving) if m]
        self.checks = [(op[0], op[3] is not None, op[4]) for op, m in zip(operands, moving) if not m]
        self.mutates = mutates  # the parameter placeholder whose new value this node computes, if any
        self.early = early  # a ZeRO-3 group member's cast, run when its group starts
        self.getitem = (node.args[0].name, node.args[1]) if node.target is operator.getitem else None
        args, kwargs = node.args, {k: (device if k == "device" else v) for k, v in node.kwargs.items()}
        target = node.target
        if np_ is not None and target is aten.unflatten.int:  # (self, dim, sizes): sizes of the whole dim
            target, args, kwargs = aten.reshape.default, (bind_args(target, args, kwargs)["self"], local_shape), {}
        elif np_ is not None and target in _SHAPE_ARG:  # (self, size or shape, ...)
            args, kwargs = with_arg(target, args, kwargs, target._schema.arguments[1].name, local_shape)
            if target in (aten.view.default, aten._unsafe_view.default):
                # a view that was valid on the captured layout may not be on a resharded shard
                # (export drops a no-op .contiguous()): reshape copies only when it must
                target, args, kwargs = aten.reshape.default, (bind_args(target, args, kwargs)["self"], local_shape), {}
        if np_ is not None and target is aten.embedding.default:  # a dense gradient, as every synchronized one
            args, kwargs = with_arg(target, args, kwargs, "sparse", False)
        self.target, self.args, self.kwargs = target, args, kwargs
        self.random = is_random(target)
        self.written = written_args(target)
        self.writes = {op_args(node)[a].name for a in self.written}  # the nodes it writes in place
        self.local_args = target in _LOCAL_ARGS
        self.variant = None if np_ is None else (
            "sync_bn" if target is aten._native_batch_norm_legit_functional.default and np_.in_specs[0].dims[0]
            else "vocab_ce" if target is aten.cross_entropy_loss.default and np_.in_specs[0].dims[1]
            else "ratio" if is_ratio(target, args, kwargs) else "partial" if np_.partial_axes else None)


class Zero3Scope:
    """The ZeRO-3 uses the executor moves in one scope, worked out once: outside recomputed
    layers (``layer`` None: a gathered copy is gathered again in backward) or inside recomputed
    layer ``plan.remat[layer]`` (its recomputation gathers the copies again; the copies it makes
    are what backward reads). Each unit (a group of ``core.plan.zero3_groups``, moved by its flat
    collectives, or a use moved alone) prefetches the next one's all-gather in forward (and in a
    recomputation), and a gathered copy is dropped after its last reader.

    Attributes:
        uses: ``core.plan.zero3_uses`` of the scope (key -> global shape, graph order).
        last_reads: key -> the node after which its gathered copy is dropped.
        groups: the scope's groups (lists of keys); member: key -> (group index, position).
        next_gather: unit (group index, or the key of a use moved alone) -> the next unit.
    """

    def __init__(self, captured: CapturedGraph, plan: Plan, mesh_shape, layer: int | None):
        self.layer = layer
        self.uses = zero3_uses(captured, plan.nodes, mesh_shape, plan.remat, layer)
        names = [n.name for n in captured.graph.nodes if (layer is None or n.name in set(plan.remat[layer]))]
        self.last_reads = {(src, plan.nodes[src].out_specs[r], dst, gp): name for name in names if name in plan.nodes
                           for src, r, dst, gp in zip(plan.nodes[name].inputs, plan.nodes[name].input_results,
                                                      plan.nodes[name].in_specs, plan.nodes[name].grad_partial)
                           if (src, plan.nodes[src].out_specs[r], dst, gp) in self.uses}
        self.groups = zero3_groups(captured, plan.nodes, mesh_shape, plan.bucket_bytes, plan.remat, layer)
        self.member = {key: (g, i) for g, keys in enumerate(self.groups) for i, key in enumerate(keys)}
        units = list(dict.fromkeys(self.member[k][0] if k in self.member else k for k in self.uses))
        self.next_gather = dict(zip(units, units[1:]))


class LocalExecutor:
    """Interprets ``captured``'s graph on this rank's shards under ``plan``; ``seed`` seeds the
    random ops (module docstring). Everything about a node that does not depend on the values
    (local shapes, operand specs, which variant runs) is worked out once, here.

    Attributes:
        denominators: mean cross-entropy / nll node -> the denominator of its last run (count or
            class-weight sum of its valid targets over the whole batch; 0-dim, no gradient).
        defer_loss: while True (``ParallelTrainer`` sets it for a run it back-propagates), the
            loss's all-reduce the plan lists ``deferred`` (``Collective.deferred``, decided by
            the compiler: ``training_step.deferred_loss_axes``) is started asynchronously and
            not waited on (``DeferredLoss``): the loss node then returns the local partial sum
            (of a ratio: of its numerator), whose backward is the all-reduce's (identity), and
            its value is ``pending_loss``'s. In a traced run (the compiled program's,
            functional collectives) it is recorded not started (the program starts it after its
            graph). Any other reduction, and every one without autograd, is reduced as usual.
        pending_loss: the ``DeferredLoss`` of each such run, in run order (the trainer pops them).
    """

    defer_loss = False

    def __init__(self, captured: CapturedGraph, plan: Plan, mesh: MeshGroups, device: torch.device, seed: int = 0):
        self.cg, self.plan, self.mesh, self.device, self.seed = captured, plan, mesh, device, seed
        self.calls = 0  # runs so far: every run draws new random numbers
        self.remat = {n: i for i, layer in enumerate(plan.remat) for n in layer}  # node -> recomputed layer
        # per recomputed layer, the values read after it (by a later node, as a graph output, or as
        # the loss's denominator): only these outlive the layer, the rest are freed and recomputed
        kept = {plan.loss_reduction.denominator}
        self._outlive = [{n for n in layer if n in kept or any(self.remat.get(u.name) != i for u in captured.node(n).users)}
                         for i, layer in enumerate(plan.remat)]
        self._reads = [sorted({i.name for n in layer for i in captured.node(n).all_input_nodes} - set(layer))
                       for layer in plan.remat]
        self.specs = specs = {name: np_.out_specs for name, np_ in plan.nodes.items()}
        # per node, per operand: (producer, producer's spec, wanted spec, gradient partial axes, global shape)
        self.denominators: dict[str, torch.Tensor] = {}
        self.pending_loss: list[DeferredLoss] = []
        self._deferred_axes = {(c.node, c.mesh_axes) for c in plan.collectives if c.deferred}
        self.operands: dict[str, list[tuple]] = {}
        for name, np_ in plan.nodes.items():
            ops = []
            for i, (src, r) in enumerate(zip(np_.inputs, np_.input_results)):
                val = captured.node(src).meta["val"]
                shape = tuple((val[r] if isinstance(val, (tuple, list)) else val).shape)
                ops.append((src, specs[src][r], np_.in_specs[i], np_.grad_partial[i], shape))
            self.operands[name] = ops
        # ZeRO-3 uses (``core.plan.zero3_uses``) outside recomputed layers and inside each one
        # (``Zero3Scope``); a low-precision cast a group gathers runs when the group starts.
        self.outside = Zero3Scope(captured, plan, mesh.shape, None)
        self.layers = [Zero3Scope(captured, plan, mesh.shape, i) for i in range(len(plan.remat))]
        casts = captured.param_casts
        members = [src for z in (self.outside, *self.layers) for keys in z.groups for src, *_ in keys]
        self.early = {src for src in members if src in casts}
        self._param_of = {src: casts.get(src, src) for src in members}
        self.dispatch: dict[str, Dispatch] = {}
        self._placeholders = [n.name for n in captured.graph.nodes if n.op == "placeholder"]
        self._calls = [n for n in captured.graph.nodes if n.op == "call_function"]  # ``run``'s nodes, in order
        for node in captured.graph.nodes:
            if node.op != "call_function":
                continue
            np_ = plan.nodes.get(node.name)
            local_shape = (list(specs[node.name][0].local_shape(tuple(node.meta["val"].shape), mesh.shape))
                           if np_ is not None and node.target in _SHAPE_ARG else None)
            self.dispatch[node.name] = Dispatch(node, np_, self.operands.get(node.name, []), local_shape, device,
                                                 captured.param_mutations.get(node.name), node.name in self.early)
        gen = torch.cuda.default_generators[device.index or 0] if device.type == "cuda" else torch.default_generator
        self._generator = gen  # the one random ops on this device draw from (seeded per op, below)
        # while a compiled program traces the run (program.py): random node -> its seed (a 0-dim
        # int64 input of the graph)
        self.seeds: dict[str, torch.Tensor] = {}

    def run(self, env: dict[str, torch.Tensor]) -> dict[str, object]:
        """Run the graph; ``env`` maps placeholder names to local shards. Returns every value."""
        values: dict[str, object] = {name: env.get(name) for name in self._placeholders}
        self.calls += 1
        gathered = self.gathered_parameters()
        with gathered.hooks() if gathered is not None else contextlib.nullcontext():
            self.run_nodes(self._calls, values, {}, gathered)
        return values

    def run_nodes(self, nodes, values: dict[str, object], moved: dict, gathered: GatheredParameters | None = None):
        """Run ``nodes`` (graph order) on ``values``, adding their results: the whole graph
        (``run``) or a pipeline stage's nodes. The layers of ``plan.remat`` among them run under
        ``torch.utils.checkpoint`` (only what is read after a layer is added); ``moved`` and
        ``gathered`` as in ``_call``."""
        if not self.remat:
            return self._run_nodes(nodes, values, moved, gathered)
        for layer, group in itertools.groupby(nodes, key=lambda n: self.remat.get(n.name)):
            if layer is None or not torch.is_grad_enabled():
                self._run_nodes(group, values, moved, gathered)
                continue
            reads, run = self._reads[layer], (self.calls, self.seeds)
            if functional():  # traced (program.py): the recomputation traced in backward (lowering.py)
                values.update(recomputed(functools.partial(self._run_layer, list(group), reads, run, layer),
                                         [values[n] for n in reads], sorted(self._outlive[layer]),
                                         self._outlive[layer] - self.cg.requires_grad))
                continue
            with set_checkpoint_early_stop(False):  # the whole layer runs again, as planned
                values.update(checkpoint(self._run_layer, list(group), reads, run, layer,
                                         *(values[n] for n in reads), use_reentrant=False,
                                         context_fn=lambda: (contextlib.nullcontext(), recomputing())))

    def gathered_parameters(self) -> GatheredParameters | None:
        """A run's record of its ZeRO-3 gathered copies (``collectives.GatheredParameters``;
        its ``hooks()`` open around the run), or None where nothing is gathered again (no ZeRO-3
        use, or no autograd), or where the run is traced (``functional()``: a compiled program keeps
        its copies for backward; ``program.py``)."""
        return GatheredParameters() if self.outside.uses and torch.is_grad_enabled() and not functional() else None

    def _run_layer(self, nodes, reads: list[str], run: tuple[int, dict], layer: int, *inputs) -> dict[str, object]:
        """A recomputed layer run on ``inputs``, the values of ``reads`` (what it reads from
        outside: all the checkpoint holds until its backward); returns the values read after the
        layer (the others are freed: that is the memory remat saves). It moves its operands itself,
        again when it is recomputed (the recomputation must run the same ops; its ZeRO-3 uses by
        their groups, ``Zero3Scope``), and seeds its random ops as its forward did (``run``: the
        forward's run count and traced seeds, ``calls`` and ``seeds``: a recomputation after later
        runs, or after a trace's forward, draws the same dropout masks)."""
        current, (self.calls, self.seeds) = (self.calls, self.seeds), run
        scope = dict(zip(reads, inputs))
        zero3 = self.layers[layer]
        gathered = GatheredParameters() if zero3.uses and not functional() else None
        try:
            self._run_nodes(nodes, scope, {}, gathered, zero3)
        finally:
            self.calls, self.seeds = current
        return {name: scope[name] for name in self._outlive[layer]}

    def _run_nodes(self, nodes, values: dict[str, object], moved: dict, gathered=None, zero3=None) -> None:
        for node in nodes:
            values[node.name] = self._call(node, values, moved, gathered, zero3)

    def _call(self, node: torch.fx.Node, values, moved: dict, gathered: GatheredParameters | None = None,
              zero3: Zero3Scope | None = None):
        """Run ``node`` on ``values``; ``moved`` holds this run's resharded operands, keyed by
        (value, its spec, wanted spec, gradient partial axes): each is moved once per run (a
        ZeRO-3 use of ``zero3``, the scope of the nodes run (default: outside recomputed layers),
        with ``gathered``, by ``gathered.move`` and dropped after its last reader)."""
        d = self.dispatch[node.name]
        if d.early and (gathered is not None or functional()) and node.name in values:
            return values[node.name]  # run ahead for its ZeRO-3 group
        if d.getitem is not None:
            return values[d.getitem[0]][d.getitem[1]]
        if d.checks and torch.is_grad_enabled():  # ``reshard``'s check, for the operands it would not move
            for src, needs_grad, shape in d.checks:
                if values[src].requires_grad != needs_grad:
                    raise disagree(shape, needs_grad)
        zero3 = zero3 or self.outside
        local = {}
        written = d.writes
        for src, src_spec, dst_spec, grad_partial, shape in d.moves:
            key = (src, src_spec, dst_spec, grad_partial)
            if key not in moved:
                try:
                    if gathered is not None and key in zero3.uses:
                        member = zero3.member.get(key)
                        if member is not None:
                            self._start(gathered, values, moved, member[0], zero3)
                        moved[key] = gathered.move(key, values[src], src_spec, dst_spec, grad_partial, shape,
                                                   self.mesh, member)
                        self._prefetch(gathered, values, moved, member[0] if member is not None else key, zero3)
                    elif functional() and key in zero3.member:  # traced: the group's flat collectives
                        self._gather_traced(values, moved, zero3.member[key][0], zero3)
                    else:
                        moved[key] = reshard(values[src], src_spec, dst_spec, grad_partial, shape, self.mesh)
                except RuntimeError as e:
                    raise RuntimeError(f"node {node.name} ({node.target}), operand {src}: {e}") from e
            if src in written and moved[key] is not values[src] and moved[key]._is_view():
                moved[key] = moved[key].clone()  # a slice taken without autograd: it refuses in-place writes with grad
            local[src] = moved[key]
            if zero3.last_reads.get(key) == node.name:
                del moved[key]
        lookup = (lambda n: local[n.name] if n.name in local else values[n.name]) if local else (lambda n: values[n.name])
        args = torch.fx.node.map_arg(d.args, lookup)
        kwargs = torch.fx.node.map_arg(d.kwargs, lookup) if d.kwargs else {}
        np_ = d.plan
        if np_ is None:
            return d.target(*args, **kwargs)
        seed = self.seeds.get(node.name)
        if seed is not None:  # traced (program.py): one op, seeded by the graph's input
            out = seeded_call(lambda a, k: self._local(node, d, a, k), args, kwargs, seed, self.seeded, node.name,
                              node.name in self.cg.requires_grad)
        elif d.random:
            with self.seeded(self.shard_seed(node.name)):
                out = self._local(node, d, args, kwargs)
        else:
            out = self._local(node, d, args, kwargs)
        if gathered is not None and zero3.layer is None:  # a recomputed layer's copies: recomputed instead
            gathered.read([lookup(n) for n in node.all_input_nodes], out)
        for name in d.written:
            self._write_back(node, name, out, values)
        if d.mutates is not None:  # the new value of a parameter (a functionalized in-place op)
            self._store(node.name, np_.out_specs[0], out, d.mutates, values)
        return out

    def _start(self, gathered: GatheredParameters, values, moved: dict, g: int, zero3: Zero3Scope) -> None:
        """Start ZeRO-3 group ``g`` of ``zero3``'s forward all-gather in this run (once); a
        low-precision cast of a member not run yet runs now (``early``: its node then returns
        this value)."""
        def make():
            keys, steps = self._members(values, moved, g, zero3, gathered)
            return GatherGroup([values[k[0]] for k in keys], [st.dim for st in steps],
                               [values[self._param_of[k[0]]] for k in keys], steps[0].axis, self.mesh)
        gathered.start_group(g, make)

    def _members(self, values, moved: dict, g: int, zero3: Zero3Scope, gathered: GatheredParameters | None = None
                 ) -> tuple[list[tuple], list]:
        """ZeRO-3 group ``g`` of ``zero3``: its keys and their forward all-gather steps; a
        low-precision cast of a member not run yet runs now (``early``: its node then returns
        this value)."""
        keys = zero3.groups[g]
        for src in (k[0] for k in keys if k[0] not in values):
            values[src] = self._call(self.cg.node(src), values, moved, gathered, zero3)
        return keys, [forward_steps(k[1], k[2], zero3.uses[k], values[k[0]].element_size(), self.mesh.shape)[0]
                      for k in keys]

    def _gather_traced(self, values, moved: dict, g: int, zero3: Zero3Scope) -> None:
        """ZeRO-3 group ``g`` of ``zero3`` moved in a traced run (``functional()``) by its flat
        collectives (``collectives.GroupGather``): every member's gathered copy into ``moved``."""
        keys, steps = self._members(values, moved, g, zero3)
        fulls = GroupGather.apply([st.dim for st in steps], steps[0].axis, self.mesh, *(values[k[0]] for k in keys))
        moved.update(zip(keys, fulls))

    def _prefetch(self, gathered: GatheredParameters, values, moved: dict, unit, zero3: Zero3Scope) -> None:
        """Start the all-gather of the ZeRO-3 unit after ``unit`` (a group's index or a use's key;
        ``Zero3Scope.next_gather``), unless a use's shard is not computed yet (a low-precision
        cast that has not run)."""
        nxt = zero3.next_gather.get(unit)
        if isinstance(nxt, int):
            self._start(gathered, values, moved, nxt, zero3)
        elif nxt is not None and values.get(nxt[0]) is not None and nxt not in gathered.started:
            gathered.prefetch(nxt, values[nxt[0]], nxt[1], nxt[2], zero3.uses[nxt], self.mesh)

    def _local(self, node, d: Dispatch, args, kwargs):
        np_, target = d.plan, d.target
        if d.local_args:
            args, kwargs = local_arguments(target, args, kwargs, np_.in_specs, self.mesh.shape)
        if d.variant is None:
            return target(*args, **kwargs)
        if d.variant == "sync_bn":
            return self._sync_batch_norm(np_, **bind_args(target, args, kwargs))
        if d.variant == "vocab_ce":
            a = bind_args(target, args, kwargs)
            loss, valid = self._vocab_parallel_cross_entropy(np_, a)
            if a["reduction"] == MEAN:
                return self._ratio(node, np_, loss.sum(), valid.sum().to(loss.dtype))
            if a["reduction"] == SUM:
                return AllReducePartial.apply(loss.sum(), np_.partial_axes, self.mesh)
            return loss
        if d.variant == "ratio":
            return self._ratio(node, np_, *ratio_parts(target, args, kwargs))
        return self._partial(node, np_, args, kwargs)

    def shard_seed(self, name: str) -> int:
        """Seed of random op ``name`` (in the plan) on this rank in the current run: (run seed,
        run count, node, coordinates along the mesh axes that split the op's result); equal on
        the ranks that hold the same values."""
        split = set().union(*(s.axes() for s in self.plan.nodes[name].out_specs))
        coord = tuple(self.mesh.coord[a] if a in split else -1 for a in range(len(self.mesh.shape)))
        return zlib.crc32(repr((self.seed, self.calls, name, coord)).encode())

    @contextlib.contextmanager
    def seeded(self, seed: int):
        """While open, the generator random ops on this device draw from is seeded with ``seed``;
        its state before is restored after."""
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            self._generator.manual_seed(seed)
            yield

    def _write_back(self, node: torch.fx.Node, arg: str, out: torch.Tensor, values) -> None:
        """``out``, written in place into argument ``arg`` of ``node``, into the stored tensor that
        argument aliases (a placeholder behind ``detach``/``alias``) when the op ran on a
        resharded copy of it."""
        src = op_args(node)[arg]
        root = alias_root(src)
        stored = values[root.name]
        if root.op != "placeholder" or out.untyped_storage().data_ptr() == stored.untyped_storage().data_ptr():
            return
        wanted = next(dst for name, _, dst, _, _ in self.operands[node.name] if name == src.name)
        self._store(node.name, wanted, out, root.name, values)

    def _store(self, name: str, spec, out: torch.Tensor, placeholder: str, values) -> None:
        """Write ``out`` (node ``name``'s value, local in ``spec``) into the stored shard of
        ``placeholder``, resharded to its storage spec (no autograd: an in-place state update)."""
        shape = tuple(self.cg.node(placeholder).meta["val"].shape)
        with torch.no_grad():
            values[placeholder].copy_(reshard(out.detach(), spec, self.specs[placeholder][0], None, shape, self.mesh))

    @contextlib.contextmanager
    def deferring(self, on: bool = True):
        """While open, ``defer_loss`` is ``on`` (then False again): with True, the loss's all-reduce
        the plan lists ``deferred`` is recorded as a ``DeferredLoss`` (traced: not started)."""
        self.defer_loss = on
        try:
            yield
        finally:
            self.defer_loss = False

    def _deferred(self, node, axes: tuple[int, ...], local: torch.Tensor, *parts: torch.Tensor) -> bool:
        """Whether the all-reduce of the loss ``node`` over ``axes`` is deferred (``defer_loss``):
        then it is recorded on ``parts`` (detached, stacked) as a ``DeferredLoss`` whose local
        partial sum for backward is ``local``, started here; in a traced run (``functional()``)
        not started: the program returns the parts and starts it after its graph (``program.py``)."""
        if not (self.defer_loss and (node.name, tuple(axes)) in self._deferred_axes and torch.is_grad_enabled()):
            return False
        deferred = DeferredLoss(local, torch.stack([t.detach() for t in parts]).contiguous().clone(),
                                len(parts) == 2, tuple(axes))
        self.pending_loss.append(deferred if functional() else deferred.start(self.mesh))
        return True

    def _ratio(self, node, np_: NodePlan, num, den):
        """A mean cross-entropy / nll from its local loss sum ``num`` and valid-target count
        ``den``, all-reduced together (one collective) along the split axes, then divided
        (deferred: ``num`` returned, ``_deferred``)."""
        if np_.partial_axes and self._deferred(node, np_.partial_axes, num, num, den):
            return num
        if np_.partial_axes:
            both = AllReducePartial.apply(torch.stack([num, den]), np_.partial_axes, self.mesh)
            num, den = both[0], both[1]
        self.denominators[node.name] = den.detach()
        return num / den

    def _partial(self, node, np_: NodePlan, args, kwargs):
        """An op whose local result is a partial sum along ``np_.partial_axes``: all-reduced
        along those its result spec does not keep partial; a bias is added after that, on the
        devices at coordinate 0 of the axes the result leaves partial along (zeros elsewhere)."""
        left = np_.out_specs[0].partial
        axes = tuple(a for a in np_.partial_axes if a not in left)
        bias = None
        if node.target in _BIAS_AFTER:
            name = _BIAS_AFTER[node.target]
            bias = bind_args(node.target, args, kwargs)[name]
            if name == "self":  # addmm / baddbmm / addmv: beta * self
                bias = bias * bind_args(node.target, args, kwargs)["beta"]
                args, kwargs = with_arg(node.target, args, kwargs, "beta", 0)
            elif bias is not None:
                args, kwargs = with_arg(node.target, args, kwargs, name, None)
        if node.target is aten.embedding.default:
            out = self._vocab_parallel_embedding(np_, **bind_args(node.target, args, kwargs))
        else:
            out = node.target(*args, **kwargs)
        if np_.reduce == "mean":  # a local mean over a split dim: 1/shards of the sum, reduced here or left partial
            out = out / math.prod(self.mesh.shape[a] for a in np_.partial_axes)
        if axes and bias is None and out.dim() == 0 and self._deferred(node, axes, out, out):
            return out
        if axes:
            out = AllReducePartial.apply(out, axes, self.mesh)
        if bias is not None and any(self.mesh.coord[a] for a in left):
            bias = bias * 0  # in the autograd graph: its gradient is 0 here, summed over the axes
        if bias is not None:
            if node.target in CONV_OPS:
                bias = bias.view(-1, *([1] * (out.dim() - 2)))
            out = out + bias
        return out

    def _vocab_parallel_cross_entropy(self, np_: NodePlan, a: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample cross-entropy losses (zero at ``ignore_index``) and the valid-target mask of
        logits split on the class dim (``a``: the call's arguments by schema name; no class
        weights), Megatron-LM's vocab-parallel cross-entropy (Shoeybi et al. 2019, section 3):
        the per-sample max, sum of exponentials and target logit (and, with label smoothing, the
        logits' sum) are all-reduced over the class-splitting axes, the logits never gathered."""
        x, target, eps = a["self"], a["target"], a["label_smoothing"]
        axes = np_.in_specs[0].dims[1]
        classes = x.shape[1]
        start = self.mesh.shard_index(axes) * classes
        z = x - all_reduce_max(x.detach().amax(1), axes, self.mesh).unsqueeze(1)
        lse = AllReducePartial.apply(z.exp().sum(1), axes, self.mesh).log()
        local = target - start
        inside = (local >= 0) & (local < classes)
        picked = torch.where(inside, z.gather(1, torch.where(inside, local, 0).unsqueeze(1)).squeeze(1), 0.0)
        loss = lse - AllReducePartial.apply(picked, axes, self.mesh)
        if eps:
            total = classes * math.prod(self.mesh.shape[ax] for ax in axes)
            loss = (1 - eps) * loss + eps * (lse - AllReducePartial.apply(z.sum(1), axes, self.mesh) / total)
        valid = target != a["ignore_index"]
        return torch.where(valid, loss, 0.0), valid

    def _sync_batch_norm(self, np_: NodePlan, input, weight, bias, running_mean, running_var, training, momentum, eps):
        """Training batch norm over a batch split along ``np_.in_specs[0].dims[0]``: the mean and
        the biased variance of the whole batch per channel from all-reduced sums (two-pass), the
        running statistics updated with the unbiased variance, as ``_native_batch_norm_legit``
        returns ``(out, mean, rstd, running_mean, running_var)``. A low-precision input (mixed
        precision) is normalized in fp32, its result cast back, as torch's kernel does."""
        axes = np_.in_specs[0].dims[0]
        dims = [0] + list(range(2, input.dim()))
        count = input.numel() // input.shape[1] * math.prod(self.mesh.shape[a] for a in axes)
        shape = (1, -1) + (1,) * (input.dim() - 2)
        dtype, x = input.dtype, input if input.dtype in (torch.float32, torch.float64) else input.float()
        mean = AllReduceShared.apply(x.sum(dims), axes, self.mesh) / count
        centered = x - mean.view(shape)
        var = AllReduceShared.apply((centered * centered).sum(dims), axes, self.mesh) / count
        rstd = torch.rsqrt(var + eps)
        out = centered * rstd.view(shape)
        if weight is not None:
            out = out * weight.view(shape)
        if bias is not None:
            out = out + bias.view(shape)
        with torch.no_grad():
            new_mean = (1 - momentum) * running_mean + momentum * mean
            new_var = (1 - momentum) * running_var + momentum * var * (count / max(count - 1, 1))
        return out.to(dtype), mean, rstd, new_mean, new_var

    def _vocab_parallel_embedding(self, np_: NodePlan, weight, indices, padding_idx, scale_grad_by_freq, sparse):
        """This rank's rows ``[start, start + rows)`` of a vocab-split table: the lookup of its own
        indices, zero elsewhere; ``padding_idx`` (a global row, -1 for none) stays without a
        gradient where this rank holds it. ``scale_grad_by_freq`` never reaches here (the rule
        keeps the vocabulary whole for it)."""
        entry = np_.in_specs[0].dims[0]
        rows = weight.shape[0]
        start = self.mesh.shard_index(entry) * rows
        mask = (indices >= start) & (indices < start + rows)
        local_pad = padding_idx - start if start <= padding_idx < start + rows else -1
        out = aten.embedding(weight, (indices - start) * mask, local_pad, scale_grad_by_freq, sparse)
        return out * mask.unsqueeze(-1).to(out.dtype)


class DeferredLoss:
    """A loss whose all-reduce is deferred (``LocalExecutor.defer_loss``): started in the
    microbatch's forward (a compiled program's: after its graph), waited for once backward ran.

    Attributes:
        local: the loss node's local partial sum (a ratio's numerator), in autograd's graph: its
            backward is the all-reduce's (identity), so back-propagating it gives each rank's
            share of the gradient of the summed loss (of a ratio: of its numerator, to be divided
            by the denominator after, ``ParallelTrainer._train_step``).
        parts: ``[2]`` (a ratio's numerator and denominator) or ``[1]`` (the loss), this rank's
            local values, detached; summed over ``axes`` in place once started and waited for.
        ratio: whether it is a ratio (numerator and denominator reduced together).
        axes: the mesh axes it is all-reduced over (named when it fails).
    """

    def __init__(self, local: torch.Tensor, parts: torch.Tensor, ratio: bool, axes: tuple[int, ...]):
        self.local, self.parts, self.ratio, self.axes, self._work = local, parts, ratio, axes, None

    def start(self, mesh) -> DeferredLoss:
        """Start the all-reduce of ``parts`` over ``axes`` of ``mesh`` (``MeshGroups``),
        asynchronously (``collectives.all_reduce_async``, counted in phase "forward"); returns self."""
        self._work = all_reduce_async(self.parts, self.axes, mesh, "forward")
        return self

    def wait(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(numerator, denominator)`` summed over the ranks (denominator None unless a ratio),
        0-dim, detached; waits for the all-reduce (started: ``start``)."""
        if self._work is not None:
            try:
                self._work.wait()
            except RuntimeError as e:
                raise failed(f"the all-reduce of the loss over mesh axes {self.axes}", e) from e
            self._work = None
        return self.parts[0], (self.parts[1] if self.ratio else None)

    def weighted(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w_m L_m, w_m)`` of the microbatch (``pipeline.py``'s module docstring): the summed
        numerator and denominator of a ratio, else the summed loss and 1; waits (``wait``)."""
        term, den = self.wait()
        return term, torch.ones_like(term) if den is None else den
