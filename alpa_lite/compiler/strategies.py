"""Sharding strategies of every node, with their cost tables (Alpa, OSDI'22, section 4.2).

A strategy of a node assigns mesh axes to the labels of its signature (``ops.py``): each mesh
axis of size > 1 splits at most one label, a label split by both axes is ``S01``. That fixes the
spec every operand must arrive in, the spec of every result, and the mesh axes along which the
result is a partial sum (split contraction labels), reduced by an all-reduce inside the op, or
left unreduced (a second strategy, its result spec partial: ``S0RP1``) for the edges to its
consumers to reduce, each as it needs (``resharding.py``: all-reduce, reduce-scatter, or
nothing for a consumer linear in it). A consumer linear in an operand (``OpSignature.linear_in``)
also has strategies taking it partial along the mesh axes its labels leave free and leaving its
result partial there (Megatron-SP's reduce-scatter then falls out of the ILP: Korthikanti et al.,
MLSys'23, section 4.2).
For ``linear`` on a 2D mesh this yields Alpa's dot strategies: ``SS = SR x RS``, ``SR = SS x SR``
with an all-reduce, ``RS = RS x SS`` with an all-reduce, batch splits, and their 2D mixes.

Cost per strategy (seconds and bytes, for one training step):
- compute: roofline of the local kernel, forward plus backward (2x forward FLOPs), at the
  measured rate of its kernel class (``kernel_class``: attention, compute-heavy pointwise) when
  the mesh has one, else at the matmul peak;
- communication: forward all-reduce of a partial result reduced in the op (0 when it leaves
  partial; its backward dual is the identity), and the all-reduces of the statistics a local
  variant shares (``ops.stat_reductions``: vocab-parallel cross-entropy, synchronized batch norm);
- memory: the local result kept for backward (parameters count their weights, gradients and
  Adam states, ``training_state_bytes``: 4x the local bytes when none is partitioned); the cost
  graph leaves out a result autograd does not keep (``kept_for_backward``);
- a parameter's storage spec also carries the optimizer update of its local shard, memory-bound:
  ``ADAM_UPDATE_BYTES_FACTOR`` x local bytes / ``mem_bandwidth`` (so ZeRO's sharded update is cheaper).
The gradient an operand receives is itself a partial sum along every mesh axis on which the
operand is replicated but the op's result is split or partial (the other factor of a product of
a partial sum, a bias added to a partial result): that all-reduce (or reduce-scatter) is
charged on the edge, by ``resharding.py``, together with the edge's resharding.
"""
from __future__ import annotations

import functools
import itertools
import math
import operator
from dataclasses import dataclass, replace

import torch
import torch.fx

from ..core.capture import CapturedGraph, nbytes_of
from ..core.mesh import LogicalMesh
from .ops import FOLLOWER_TARGETS, OpSignature, flops, signature, stat_reductions
from ..core.spec import ShardingSpec

BACKWARD_FLOPS_FACTOR = 2.0
aten = torch.ops.aten
_TRANSCENDENTAL = {aten.gelu.default, aten.tanh.default, aten.sigmoid.default, aten.silu.default, aten.exp.default,
                   aten.log.default, aten.erf.default, aten._softmax.default, aten.softmax.int,
                   aten._log_softmax.default, aten.log_softmax.int, aten.cross_entropy_loss.default,
                   aten.layer_norm.default, aten.native_layer_norm.default}
_RATIO_LOSSES = {aten.cross_entropy_loss.default, aten.nll_loss_nd.default, aten.nll_loss.default}
ADAM_STATES = 2  # Adam's two moments, each the parameter's dtype and shape
ADAM_UPDATE_BYTES_FACTOR = 7.0  # one Adam(W) update reads parameter, gradient, 2 moments; writes parameter, 2 moments


@dataclass(frozen=True)
class Strategy:
    """One way to run a node.

    Attributes:
        name: readable label -> axis assignment, e.g. ``"k:S1"`` or ``"R"``.
        in_specs: spec each tensor operand must arrive in (``node.all_input_nodes`` order).
        out_specs: spec of each result.
        partial_axes: mesh axes along which the raw local result is a partial sum.
        reduce: ``"sum"`` or ``"mean"``: how the partial result is formed.
        grad_partial: per operand, the mesh axes along which its gradient is a partial sum
            (None for an operand that needs no gradient: data, or values computed from data only).
        compute: seconds, forward + backward; comm: seconds of the forward all-reduce and of the
            statistics' all-reduces (``ops.stat_reductions``; of a ZeRO-1/2 parameter: its
            all-gather after the update);
        memory: bytes per device.
        zero_stage / zero_axes: a parameter's ZeRO-1/2 partitioning (``compiler/zero.py``).
    """

    name: str
    in_specs: tuple[ShardingSpec, ...]
    out_specs: tuple[ShardingSpec, ...]
    partial_axes: tuple[int, ...] = ()
    reduce: str = "sum"
    grad_partial: tuple[tuple[int, ...] | None, ...] = ()
    compute: float = 0.0
    comm: float = 0.0
    memory: float = 0.0
    zero_stage: int = 0
    zero_axes: tuple[int, ...] = ()

    @property
    def out_spec(self) -> ShardingSpec:
        return self.out_specs[0]

    @property
    def cost(self) -> float:
        return self.compute + self.comm


def tensor_values(val) -> list[torch.Tensor]:
    """The tensors of a node's ``meta["val"]``: itself, or those of a tuple or list (others dropped)."""
    if isinstance(val, torch.Tensor):
        return [val]
    return [v for v in val if isinstance(v, torch.Tensor)] if isinstance(val, (tuple, list)) else []


def _nbytes_local(shape, itemsize, spec: ShardingSpec, mesh_shape) -> float:
    n = itemsize
    for s in spec.local_shape(shape, mesh_shape):
        n *= s
    return float(n)


def training_state_bytes(local: float, stage: int = 0, shards: int = 1) -> tuple[float, float, float]:
    """``(parameter, gradient, optimizer state)`` bytes per device of a trainable parameter whose
    stored shard has ``local`` bytes, under ZeRO ``stage`` 0, 1 or 2 over ``shards`` devices
    (Rajbhandari et al., SC'20, section 5.1: stage 1 partitions the optimizer states, stage 2 the
    gradients too; Adam keeps ``ADAM_STATES`` moments). ZeRO-3 is a split storage spec: its
    ``local`` is already the partition."""
    return local, local / shards if stage >= 2 else local, ADAM_STATES * local / (shards if stage >= 1 else 1)


def _label_assignments(labels: list[str], mesh_shape: tuple[int, int]):
    """Every map label -> mesh axes tuple with each axis (of size > 1) used at most once."""
    axes = [a for a in (0, 1) if mesh_shape[a] > 1]
    options = [None] + labels
    for choice in itertools.product(options, repeat=len(axes)):
        assign: dict[str, tuple[int, ...]] = {}
        for axis, lab in zip(axes, choice):
            if lab is not None:
                assign[lab] = assign.get(lab, ()) + (axis,)
        yield assign


def _shards(axes: tuple[int, ...], mesh_shape) -> int:
    return math.prod(mesh_shape[a] for a in axes)


def _spec(labels, assign) -> ShardingSpec:
    return ShardingSpec(tuple(assign.get(lab, ()) for lab in labels))


def _describe(assign: dict[str, tuple[int, ...]]) -> str:
    if not assign:
        return "R"
    return ",".join(f"{lab}:S{''.join(map(str, ax))}" for lab, ax in sorted(assign.items()))


_VIEW_RESULTS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int}
_SAVES_NO_OPERAND = {aten.add.Tensor, aten.sub.Tensor, aten.neg.default}  # backward needs no operand values


def kept_for_backward(node: torch.fx.Node) -> bool:
    """Whether autograd keeps ``node``'s result until backward, so that it counts in a
    strategy's ``memory``: not when it is a view of its operand (``split``, ``chunk``: its
    operand's bytes), nor when every reader, through views (``FOLLOWER_TARGETS``), only adds or
    subtracts it (a residual branch's projection: its gradient needs no values). Placeholders
    and graph outputs are kept."""
    if node.op == "placeholder":
        return True
    if node.target in _VIEW_RESULTS:
        return False
    return any(u.op == "output" or u.target not in _SAVES_NO_OPERAND
               and (u.target not in FOLLOWER_TARGETS or kept_for_backward(u)) for u in node.users)


def kernel_class(node: torch.fx.Node) -> str | None:
    """The kernel class whose measured rate prices ``node`` (``LogicalMesh.kernel_flops``):
    ``"attention"`` for scaled-dot-product attention, ``"pointwise"`` for elementwise ops that
    compute more than they move (GELU, tanh, exp, softmax, cross-entropy, layer norm), None for
    the rest (matmul peak; cheap elementwise ops are memory-bound anyway)."""
    if node.target is aten.scaled_dot_product_attention.default:
        return "attention"
    return "pointwise" if node.target in _TRANSCENDENTAL else None


def enumerate_strategies(node: torch.fx.Node, sig: OpSignature, mesh: LogicalMesh) -> list[Strategy]:
    """All strategies of ``node`` under ``sig`` whose split dims divide evenly, with costs."""
    ins = [n.meta["val"] for n in node.all_input_nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    tensors = tuple((tuple(v.shape), v.element_size()) for v in ins + tensor_values(node.meta["val"]))
    key = (tuple(sig.inputs), tuple(sig.outputs), frozenset(sig.fixed), sig.reduce, frozenset(sig.post_reduce),
           sig.linear_in, can_leave_partial(node, sig), tuple(sig.stats.items()), tuple(sig.units.items()))
    return list(_enumerate(key, tensors, flops(node, sig), kernel_class(node), node.target in FOLLOWER_TARGETS, mesh))


def can_leave_partial(node: torch.fx.Node, sig: OpSignature) -> bool:
    """Whether ``node``'s result may be a partial sum (left unreduced, or passed through a linear
    op): one result, not a graph output (the loss is read whole), not a mean loss (its sum and
    count are reduced together)."""
    return (len(sig.outputs) == 1 and not any(u.op == "output" for u in node.users)
            and node.target not in _RATIO_LOSSES)


@functools.lru_cache(maxsize=4096)
def _enumerate(sig_key: tuple, tensors: tuple, fl: float, kernel: str | None, follower: bool,
               mesh: LogicalMesh) -> tuple[Strategy, ...]:
    """``enumerate_strategies`` from what it depends on (hashable: repeated blocks hit the cache).
    ``tensors``: ``(shape, itemsize)`` of the tensor operands, then of the results."""
    sig = OpSignature(list(sig_key[0]), list(sig_key[1]), set(sig_key[2]), sig_key[3], set(sig_key[4]), sig_key[5],
                      dict(sig_key[7]), dict(sig_key[8]))
    leave_partial = sig_key[6]
    contraction = sig.contraction
    labels = list(sig.inputs) + list(sig.outputs)
    shardable = [lab for lab in sig.labels if lab not in sig.fixed and not lab.startswith("#")]
    result: dict[tuple, Strategy] = {}
    for assign in _label_assignments(shardable, mesh.shape):
        specs = tuple(_spec(labs, assign) for labs in labels)
        in_specs, out_specs = specs[:len(sig.inputs)], specs[len(sig.inputs):]
        if not all(s.divides(shape, mesh.shape) for s, (shape, _) in zip(specs, tensors)):
            continue
        if any(units % _shards(assign.get(lab, ()), mesh.shape) for lab, units in sig.units.items()):
            continue
        partial = tuple(sorted(a for lab in contraction for a in assign.get(lab, ())))
        varying = set(partial) | {a for s in out_specs for a in s.axes()}
        grad_partial = tuple(
            tuple(sorted(varying - s.axes() - (set(partial) if i in sig.post_reduce else set())))
            for i, s in enumerate(in_specs))
        shards = 1
        for ax in assign.values():
            for a in ax:
                shards *= mesh.shape[a]
        local = [_nbytes_local(shape, itemsize, s, mesh.shape) for s, (shape, itemsize) in zip(specs, tensors)]
        compute = (1 + BACKWARD_FLOPS_FACTOR) * mesh.compute_cost(fl / shards, sum(local), kernel)
        out_local = sum(local[len(sig.inputs):])
        comm = mesh.all_reduce_cost(out_local, partial) if partial else 0.0
        comm += sum(mesh.all_reduce_cost(nbytes, axes) for _, axes, nbytes in stat_reductions(
            sig, in_specs, [shape for shape, _ in tensors], tensors[0][1], mesh.shape))
        memory = 0.0 if follower else out_local
        key = (in_specs, out_specs, partial)
        if key not in result:
            result[key] = Strategy(_describe(assign), in_specs, out_specs, partial, sig.reduce, grad_partial,
                                   compute, comm, memory)
            if partial and leave_partial:
                gp = tuple(tuple(sorted(varying - s.axes())) for s in in_specs)  # a bias is added to a partial
                left = tuple(s.with_partial(partial) for s in out_specs)
                result[(in_specs, left, partial)] = Strategy(_describe(assign) + ",P" + "".join(map(str, partial)),
                                                             in_specs, left, partial, sig.reduce, gp, compute, 0.0, memory)
    for s in list(result.values()) if sig.linear_in and leave_partial else ():
        if s.partial_axes or s.out_spec.partial:
            continue
        used = set().union(*(x.axes() for x in s.in_specs + s.out_specs))
        free = [a for a in (0, 1) if mesh.shape[a] > 1 and a not in used]
        for axes in (c for k in range(1, len(free) + 1) for c in itertools.combinations(free, k)):
            for linear in sig.linear_in:
                ins = tuple(x.with_partial(axes) if i in linear else x for i, x in enumerate(s.in_specs))
                gp = tuple(g if i in linear else tuple(sorted(set(g) | set(axes))) for i, g in enumerate(s.grad_partial))
                outs = tuple(x.with_partial(axes) for x in s.out_specs)
                result[(ins, outs, ())] = replace(s, name=f"{s.name},P{''.join(map(str, axes))}", in_specs=ins,
                                                  out_specs=outs, grad_partial=gp)
    return tuple(result.values())


def replicated_strategy(node: torch.fx.Node, mesh: LogicalMesh) -> Strategy:
    """The fallback: every operand and result replicated, the op computed on every device."""
    ins = [n for n in node.all_input_nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    outs = tensor_values(node.meta.get("val"))
    in_specs = tuple(ShardingSpec.replicated(v.meta["val"].dim()) for v in ins)
    out_specs = tuple(ShardingSpec.replicated(v.dim()) for v in outs)
    nbytes = sum(nbytes_of(v.meta["val"]) for v in ins) + nbytes_of(node.meta.get("val"))
    compute = (1 + BACKWARD_FLOPS_FACTOR) * mesh.compute_cost(flops(node, None), nbytes, kernel_class(node))
    return Strategy("R", in_specs, out_specs, (), "sum", tuple(() for _ in ins), compute, 0.0,
                    float(nbytes_of(node.meta.get("val"))))


def placeholder_strategies(node: torch.fx.Node, mesh: LogicalMesh, is_param: bool) -> list[Strategy]:
    """Storage specs of a parameter (ZeRO-3 when split along the batch axis) or of an input; a
    parameter's strategies cost its optimizer update on the local shard (module docstring)."""
    val = node.meta["val"]
    shape = tuple(val.shape)
    labels = tuple(f"d{i}" for i in range(len(shape)))
    out = []
    seen = set()
    for assign in _label_assignments(list(labels), mesh.shape):
        spec = _spec(labels, assign)
        if spec in seen or not spec.divides(shape, mesh.shape):
            continue
        seen.add(spec)
        local = _nbytes_local(shape, val.element_size(), spec, mesh.shape)
        update = mesh.compute_cost(0.0, ADAM_UPDATE_BYTES_FACTOR * local) if is_param else 0.0
        out.append(Strategy(str(spec), (), (spec,), compute=update,
                            memory=sum(training_state_bytes(local)) if is_param else local))
    return out


@dataclass
class NodeStrategies:
    """The strategies of one node and what the generator knew about it."""

    node: str
    strategies: list[Strategy]
    inputs: list[str]          # producer node names, one per operand
    input_results: list[int]   # which result of the producer each operand reads (getitem)
    follower: bool             # cheap op, may be merged into its operand's variable
    supported: bool = True
    requires_grad: bool = False  # the result depends on a parameter
    batch_dims: tuple[int | None, ...] = (None,)  # per result: the dim that carries the inputs' batch


def build_strategies(cg: CapturedGraph, mesh: LogicalMesh, *, warn=None, nodes: set[str] | None = None,
                     context: dict[str, NodeStrategies] | None = None) -> dict[str, NodeStrategies]:
    """Strategies for every tensor node of the captured graph, keyed by node name.

    ``getitem`` nodes select one result of a multi-result op and follow it. Ops without a
    generator get the replicated strategy; ``warn(message)`` is called once per such op (not for
    ops that create a tensor from no tensor operand, such as ``arange``: nothing to split).
    ``nodes`` restricts the table to those nodes (a pipeline stage's layer; a getitem's parent
    must be among them); what it reads of an operand produced outside them (its batch dims)
    comes from ``context``, a table of the whole graph on any mesh.
    """
    table: dict[str, NodeStrategies] = {}
    producer = lambda name: table[name] if name in table else context[name]  # noqa: E731
    one_row = {cg.node(n).meta["val"].shape[0] for n in cg.input_names if cg.node(n).meta["val"].dim() > 0} == {1}
    warned = set()
    for node in cg.graph.nodes:
        if nodes is not None and node.name not in nodes:
            continue
        if node.op == "placeholder":
            is_param = node.name in cg.param_fqns
            batch = 0 if node.name in cg.input_names and node.meta["val"].dim() > 0 else None
            table[node.name] = NodeStrategies(node.name, placeholder_strategies(node, mesh, is_param), [], [], False,
                                              requires_grad=node.name in cg.requires_grad, batch_dims=(batch,))
            continue
        if node.op != "call_function" or not tensor_values(node.meta.get("val")):
            continue
        if node.target is operator.getitem:
            src, idx = node.args
            parent = table[src.name]
            gp = (() if node.name in cg.requires_grad else None,)
            strategies = [Strategy(s.name, (s.out_specs[idx],), (s.out_specs[idx],), grad_partial=gp)
                          for s in parent.strategies]
            strategies = list({s.in_specs: s for s in strategies}.values())
            table[node.name] = NodeStrategies(node.name, strategies, [src.name], [idx], True,
                                              requires_grad=node.name in cg.requires_grad,
                                              batch_dims=(parent.batch_dims[idx],))
            continue
        ins = [n for n in node.all_input_nodes if isinstance(n.meta.get("val"), torch.Tensor)]
        sig = signature(node)
        strategies = enumerate_strategies(node, sig, mesh) if sig is not None else []
        supported = sig is not None
        if not strategies:
            strategies = [replicated_strategy(node, mesh)]
            if not supported and ins and warn is not None and str(node.target) not in warned:
                warned.add(str(node.target))
                warn(f"no sharding strategy for {node.target}: it runs replicated")
        needs = [n.name in cg.requires_grad for n in ins]
        strategies = [s if gp == s.grad_partial else replace(s, grad_partial=gp) for s, gp in
                      ((s, tuple(g if need else None for g, need in zip(s.grad_partial, needs))) for s in strategies)]
        table[node.name] = NodeStrategies(node.name, strategies, [n.name for n in ins], [0] * len(ins),
                                          node.target in FOLLOWER_TARGETS or _unary_pointwise(node), supported,
                                          requires_grad=node.name in cg.requires_grad,
                                          batch_dims=_batch_dims(node, sig, ins, [producer(n.name) for n in ins],
                                                                 len(strategies[0].out_specs), one_row))
    return table


_RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}


def _batch_dims(node, sig: OpSignature | None, operands: list[torch.fx.Node], producers: list[NodeStrategies],
                n_out: int, one_row: bool = False) -> tuple[int | None, ...]:
    """Follow the inputs' batch dim through the op's labels (Alpa's batch-dim tracking).

    In a graph of one row (``one_row``: a microbatch of one sequence) a reshape gives a dim of
    size 1 a label of its own (a dim of one splits nowhere), so the batch would be lost where the
    same code merges it at more rows: ``(1, T, V) -> (T, V)`` as ``(B, T, V) -> (B T, V)``, and
    ``(T, H) -> (1, T, H)`` as ``(B T, H) -> (B, T, H)``. There the batch follows the dim it merges
    into, and comes back to the size-1 dims split off before it."""
    if sig is None:
        return (None,) * n_out
    for labels, producer, operand in zip(sig.inputs, producers, operands):
        b = producer.batch_dims[0] if len(producer.batch_dims) == 1 else None
        if b is not None and b < len(labels):
            if not (one_row and node.target in _RESHAPES):
                return tuple(out.index(labels[b]) if labels[b] in out else None for out in sig.outputs)
            shape, out, out_shape = operand.meta["val"].shape, sig.outputs[0], node.meta["val"].shape
            k = next((k for k in range(b, len(labels)) if shape[k] != 1 or labels[k] in out), None)
            if k is None or labels[k] not in out:
                return (None,)
            j = out.index(labels[k])
            while j > 0 and out_shape[j - 1] == 1 and out[j - 1] not in labels:
                j -= 1
            return (j,)
    return (None,) * n_out


def _unary_pointwise(node) -> bool:
    return (isinstance(node.target, torch._ops.OpOverload) and torch.Tag.pointwise in node.target.tags
            and len([n for n in node.all_input_nodes if isinstance(n.meta.get("val"), torch.Tensor)]) == 1)
