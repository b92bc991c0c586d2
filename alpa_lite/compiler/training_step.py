"""What a plan stores for chosen strategies: node plans, deferred gradient syncs and the
collectives of one training step. The one place both plan kinds (an SPMD plan and a pipeline
stage's) derive them."""
from __future__ import annotations

from dataclasses import replace

import torch

from ..core.aten import bind_args
from ..core.capture import CapturedGraph
from ..core.losses import SUM
from ..core.mesh import LogicalMesh
from ..core.plan import (Collective, NodePlan, gradient_buckets, local_bytes, update_buckets, zero3_groups,
                         zero3_uses)
from ..core.resharding import backward_steps, forward_steps, is_gradient_sync, step_cost
from .ops import STAT_TARGETS, signature, stat_reductions
from .strategies import NodeStrategies, Strategy


def defer_gradient_sync(cg: CapturedGraph, nodes: dict[str, NodePlan]
                        ) -> tuple[dict[str, NodePlan], dict[str, tuple[int, ...]]]:
    """Move data-parallel gradient all-reduces out of the graph: a parameter whose every use is a
    gradient sync over the same axes (``is_gradient_sync``) gets its gradient reduced once, in a
    bucket, after backward (after the last microbatch of a pipeline).

    ``nodes`` are the strategies as chosen, every gradient sync still on its edge (an ILP's
    ``node_plan``s, or the union of a chained stage's per-layer solutions); they are not edited.
    Deciding on the whole program at once is what makes it right: a parameter used by two layers
    is deferred only if both uses are syncs over the same axes.

    Under mixed precision a parameter's uses are those of its low-precision casts
    (``CapturedGraph.param_casts``): the fp32 gradient is what the bucket reduces.

    A parameter read only by a row lookup (``CapturedGraph.param_lookups``: GPT's position
    embedding) that reads it as stored, without a gradient sync of its own, has as uses the
    lookup's readers: when each of them syncs the lookup's output gradient over the same axes
    (the output replicated under a split batch), the lookup back-propagates that partial sum
    unsynchronized, its backward being linear, and the weight's local gradient, a partial sum
    over those axes, is reduced in a bucket instead (as DDP buckets the weight's gradient). A
    lookup whose output is also read outside ``nodes`` (sent to a later pipeline stage, whose
    gradient arrives complete, the same on every device) keeps its readers' syncs: the bucket
    would add that gradient once per device.

    Returns:
        ``(nodes with those uses' grad_partial emptied, parameter placeholder -> axes)``.
    """
    uses: dict[str, list[tuple[str, int]]] = {ph: [] for ph in cg.param_fqns}
    casts = cg.param_casts  # a cast that keeps the spec passes the gradient through: its uses are the parameter's
    through = {c: ph for c, ph in casts.items() if c in nodes and nodes[c].in_specs[0] == nodes[c].out_specs[0]
               and not nodes[c].grad_partial[0]}
    spec = {ph: nodes[ph].out_specs[0] for ph in uses if ph in nodes}
    # a lookup that reads its weight as stored: its readers' edges are the weight's uses, in the lookup's output spec;
    # not when a reader is outside ``nodes`` (a later pipeline stage, its gradient received complete: it is no sync)
    for e, ph in cg.param_lookups.items():
        read = nodes[e].inputs[0] if e in nodes else None  # the parameter, or its cast
        if (ph in nodes and (read == ph or read in through) and nodes[e].in_specs[0] == spec[ph]
                and not nodes[e].grad_partial[0] and not nodes[e].partial_axes
                and all(u.name in nodes for u in cg.node(e).users if u.op == "call_function")):
            through[e], spec[ph] = ph, nodes[e].out_specs[0]
    for name, np_ in nodes.items():
        for i, src in enumerate(np_.inputs):
            if name in through and through.get(src, src) == through[name]:
                continue  # a cast's or a lookup's read of its parameter (or of the parameter's cast)
            if src in through:
                uses[through[src]].append((name, i))
            elif src in uses:
                uses[src].append((name, i))
    out, deferred = dict(nodes), {}
    for ph, edges in uses.items():
        parts = {nodes[n].grad_partial[i] for n, i in edges}
        if len(parts) != 1 or not all(
                is_gradient_sync(spec[ph], nodes[n].in_specs[i], nodes[n].grad_partial[i])
                for n, i in edges) or not is_gradient_sync(nodes[ph].out_specs[0], nodes[ph].out_specs[0], *parts):
            continue
        deferred[ph] = tuple(sorted(parts.pop()))
        for n, i in edges:
            gp = list(out[n].grad_partial)
            gp[i] = ()
            out[n] = replace(out[n], grad_partial=tuple(gp))
    return out, deferred


def deferred_loss_axes(cg: CapturedGraph, name: str, in_specs, out_spec, partial_axes: tuple[int, ...],
                       recomputed: bool) -> tuple[int, ...]:
    """The mesh axes (one or both) of the all-reduce of node ``name``'s result (its strategy's
    ``in_specs``, ``out_spec`` and ``partial_axes``) that the SPMD runtime defers: starts in
    forward and waits for after backward (docs/runtime.md, "the loss's all-reduce";
    ``executor.LocalExecutor.defer_loss``), as the pipeline runtime does on its last stage for
    every microbatch; ``()`` where it reduces as usual. Deferred: the
    graph's loss, a scalar read only by the graph's output, outside a recomputed layer
    (``recomputed`` False), reduced over one or both mesh axes (one all-reduce), but a
    vocab-parallel cross-entropy's sum (reduced where computed). The one decision both the listing
    (``plan_collectives``, ``Collective.deferred``) and the ILP (``cost_graph``'s loss pool)
    read, and the runtime reads from the plan (the compiled program too, ``compile=True``);
    under gradient accumulation and in a pipeline it defers each microbatch's. Under mixed
    precision the graph's loss is the fp32 cast of the reduced value, which is not deferred."""
    node = cg.node(name)
    if name != cg.loss_name or recomputed or node.meta["val"].dim() or any(u.op != "output" for u in node.users):
        return ()
    axes = tuple(a for a in partial_axes if a not in out_spec.partial)
    if not axes:
        return ()
    if (node.target is torch.ops.aten.cross_entropy_loss.default and in_specs[0].dims[1]
            and bind_args(node.target, node.args, node.kwargs)["reduction"] == SUM):
        return ()
    return axes


def training_step(cg: CapturedGraph, nodes: dict[str, NodePlan], mesh: LogicalMesh, bucket_bytes: float = 25 * 2**20,
                  reduce_dtype: torch.dtype | None = None, remat: list[list[str]] = ()
                  ) -> tuple[dict[str, NodePlan], dict[str, tuple[int, ...]], list[Collective]]:
    """What a ``Plan`` (an SPMD plan or one pipeline stage's) stores for the chosen strategies
    ``nodes`` (gradient syncs on their edges): ``(nodes, grad_sync, collectives)`` with the
    data-parallel gradient syncs deferred to buckets (``defer_gradient_sync``) and every
    collective of one training step (``plan_collectives``; ``remat``: the recomputed layers). The
    one place both plan kinds derive their gradient synchronization."""
    nodes, grad_sync = defer_gradient_sync(cg, nodes)
    return nodes, grad_sync, plan_collectives(cg, nodes, mesh, grad_sync, bucket_bytes, reduce_dtype, remat)


def plan_collectives(cg: CapturedGraph, nodes: dict[str, NodePlan], mesh: LogicalMesh,
                     grad_sync: dict[str, tuple[int, ...]] | None = None,
                     bucket_bytes: float = 25 * 2**20, reduce_dtype: torch.dtype | None = None,
                     remat: list[list[str]] = ()) -> list[Collective]:
    """Every collective of one training step for the chosen strategies: partial-sum all-reduces
    inside ops (not of a result left partial: its edges reduce it), the all-reduces of shared
    statistics (``ops.stat_reductions``), the resharding of every value to each (spec, gradient
    partial axes) its readers want, once however many read it there (forward, then backward in
    reverse; a ZeRO-3 parameter's gather again in backward, ``resharding.regathers``), the
    bucketed gradient all-reduces (reduce-scatters for ZeRO-2), then the bucketed all-gathers
    of the ZeRO-1/2 parameters after the update; gradient buckets in ``reduce_dtype`` (None: the
    parameter's dtype).

    A layer of ``remat`` (node names; the runtime checkpoints it, ``executor.LocalExecutor``)
    moves its operands itself, once per value and wanted spec inside the layer, and runs its
    forward collectives again in backward: those are listed once more in phase ``"recompute"``
    (layers in reverse order, as backward reaches them).

    The loss's all-reduce the runtime defers (``deferred_loss_axes``) is listed ``deferred``."""
    forward, backward = [], []
    layer_of = {n: i for i, layer in enumerate(remat) for n in layer}
    recompute: list[list[Collective]] = [[] for _ in remat]
    moved = set()
    grouped = _grouped_collectives(cg, nodes, mesh, bucket_bytes, remat)
    regathered = zero3_uses(cg, nodes, mesh.shape, remat)  # outside recomputed layers: gathered again in backward
    for name, np_ in nodes.items():
        node = cg.node(name)
        layer = layer_of.get(name)
        first = len(forward)
        for i, (src_name, r) in enumerate(zip(np_.inputs, np_.input_results)):
            dst, gp = np_.in_specs[i], np_.grad_partial[i]
            if (layer, src_name, r, dst, gp) in moved:
                continue
            moved.add((layer, src_name, r, dst, gp))
            val = cg.node(src_name).meta["val"]
            val = val[r] if isinstance(val, (tuple, list)) else val
            src = nodes[src_name].out_specs[r]
            args = (tuple(val.shape), val.element_size(), mesh.shape)
            if (layer, (src_name, src, dst, gp)) in grouped:  # its group's collectives, listed once
                fwd, bwd = grouped[(layer, (src_name, src, dst, gp))]
                forward += [replace(c, node=name) for c in fwd]
                backward += [replace(c, node=name) for c in bwd]
                continue
            # a ZeRO-3 use outside a recomputed layer is gathered again in backward, before its gradient moves
            again = (src_name, src, dst, gp) in regathered
            for phase, steps, out in (("forward", forward_steps(src, dst, *args), forward),
                                      ("backward", [] if gp is None else backward_steps(src, dst, gp, *args)
                                       + (forward_steps(src, dst, *args) if again else ()), backward)):
                out.extend(Collective(s.kind, (s.axis,), s.nbytes, phase, name, src_name, step_cost(s, mesh))
                           for s in steps if s.is_collective)
        sig = signature(node) if node.target in STAT_TARGETS else None
        if sig is not None and sig.stats:
            shapes = [tuple(cg.node(n).meta["val"].shape) for n in np_.inputs]
            itemsize = cg.node(np_.inputs[0]).meta["val"].element_size()
            for phase, axes, nbytes in stat_reductions(sig, np_.in_specs, shapes, itemsize, mesh.shape):
                (forward if phase == "forward" else backward).append(Collective(
                    "all-reduce", axes, nbytes, phase, name, name, mesh.all_reduce_cost(nbytes, axes)))
        if np_.partial_axes:
            vals = node.meta["val"] if isinstance(node.meta["val"], (tuple, list)) else [node.meta["val"]]
            deferred = bool(deferred_loss_axes(cg, name, np_.in_specs, np_.out_specs[0], np_.partial_axes,
                                               layer is not None))
            for spec, val in zip(np_.out_specs, vals):
                local = local_bytes(val, spec, mesh.shape)
                axes = tuple(a for a in np_.partial_axes if a not in spec.partial)
                if axes:  # one all-reduce over the devices of every axis (``collectives.AllReducePartial``)
                    forward.append(Collective("all-reduce", axes, float(local), "forward", name, name,
                                              mesh.all_reduce_cost(local, axes), deferred))
        if layer is not None:
            recompute[layer] += [replace(c, phase="recompute") for c in forward[first:]]
    buckets = []
    for k, (kind, axes, members) in enumerate(gradient_buckets(cg, nodes, grad_sync or {}, mesh.shape, bucket_bytes)):
        nbytes = float(sum(local_bytes(cg.node(ph).meta["val"], nodes[ph].out_specs[0], mesh.shape, reduce_dtype)
                           for ph in members))
        buckets.append(Collective(kind, axes, nbytes, "backward", f"gradient bucket {k}",
                                  f"{len(members)} parameters", mesh.collective_cost(kind, nbytes, axes)))
    for k, (axes, members) in enumerate(update_buckets(cg, nodes, mesh.shape, bucket_bytes)):
        nbytes = float(sum(local_bytes(cg.node(ph).meta["val"], nodes[ph].out_specs[0], mesh.shape) for ph in members))
        buckets.append(Collective("all-gather", axes, nbytes, "update", f"parameter bucket {k}",
                                  f"{len(members)} parameters", mesh.all_gather_cost(nbytes, axes)))
    return forward + [c for cs in recompute[::-1] for c in cs] + backward[::-1] + buckets


def _grouped_collectives(cg: CapturedGraph, nodes: dict[str, NodePlan], mesh: LogicalMesh, bucket_bytes: float,
                         remat) -> dict[tuple, tuple[list[Collective], list[Collective]]]:
    """``(recomputed layer or None, ZeRO-3 use)`` (``zero3_uses`` keys) -> the collectives listed
    at it, forward and backward (in forward order, reversed with the rest), for the uses of
    ``core.plan.zero3_groups``, those outside recomputed layers (numbered first) and those of each
    recomputed layer: a group's all-gather at its first use forward (a recomputed layer's listed
    again as it recomputes); its gradients' reduce-scatter at that use and, outside recomputed
    layers, its all-gather again at its last use backward (backward reaches the last use first)."""
    out = {}
    scopes = [(layer, keys) for layer in (None, *range(len(remat)))
              for keys in zero3_groups(cg, nodes, mesh.shape, bucket_bytes, remat, layer)]
    for g, (layer, keys) in enumerate(scopes):
        gather = reduce = 0.0
        for src, spec, dst, gp in keys:
            val = cg.node(src).meta["val"]
            args = (tuple(val.shape), val.element_size(), mesh.shape)
            step = forward_steps(spec, dst, *args)[0]
            gather += step.nbytes
            reduce += backward_steps(spec, dst, gp, *args)[0].nbytes
        where = "" if layer is None else f", recomputed layer {layer}"
        axis, what = (step.axis,), f"ZeRO-3 group {g} ({len(keys)} parameters{where})"
        ag = Collective("all-gather", axis, gather, "forward", "", what, mesh.collective_cost("all-gather", gather, axis))
        rs = Collective("reduce-scatter", axis, reduce, "backward", "", what,
                        mesh.collective_cost("reduce-scatter", reduce, axis))
        out |= {(layer, key): ([], []) for key in keys}
        out[(layer, keys[0])][0].append(ag)
        out[(layer, keys[0])][1].append(rs)
        if layer is None:
            out[(layer, keys[-1])][1].append(replace(ag, phase="backward"))
    return out


def param_specs_of(cg: CapturedGraph, nodes: dict[str, NodePlan]) -> dict[str, str]:
    """Parameter FQN (every name of a tied weight) -> its storage spec string."""
    specs = {}
    for ph, fqn in cg.param_fqns.items():
        for name in [fqn, *cg.tied.get(fqn, [])]:
            specs[name] = nodes[ph].out_specs[0]
    return specs


def node_plan(s: Strategy, ns: NodeStrategies) -> NodePlan:
    """The ``NodePlan`` of strategy ``s`` of node ``ns``."""
    return NodePlan(s.name, tuple(s.in_specs), tuple(s.out_specs), s.partial_axes, s.reduce,
                    s.grad_partial, tuple(ns.inputs), tuple(ns.input_results), s.zero_stage, s.zero_axes)
