"""Run a captured graph on local shards under a ``Plan``.

For every node: reshard each operand from its producer's spec to the spec the node's strategy
wants (``Reshard``, autograd-aware), run the aten op on the local shards, and reduce a partial
result (``AllReducePartial``). Most ops run unchanged on shards; a few need a local variant:
shape arguments become local shapes, a mean over a split dim of equal shards is scaled by
1/shards before the all-reduce, a mean cross-entropy / nll is the all-reduced sum of its losses
over the all-reduced count of its valid targets (``losses.ratio_parts``: shards may hold
different counts of ``ignore_index``), a bias is added after the reduction, and a vocab-parallel embedding looks up only
its own rows (Megatron-LM, Shoeybi et al. 2019, section 3). Arguments are read and set by their
schema names (``core.aten.bind_args``).

Random ops (dropout, bernoulli, ``rand_like``, attention dropout) draw from a generator seeded per
shard: from the run's seed, a call counter, the node and this rank's shard coordinates along the
mesh axes that split the op's result. Shards of a split value draw independent numbers; ranks
holding the same (replicated) values draw the same ones (Megatron-LM's model-parallel RNG tracker,
Shoeybi et al. 2019, section 3; Korthikanti et al. 2022, section 4.2).

The layers of ``plan.remat`` run under ``torch.utils.checkpoint`` (non-reentrant): their
activations are not kept but recomputed on the local shards during backward, collectives and
random draws included (the same seeds: the run counter has not moved); activation checkpointing,
Chen et al. 2016.

An in-place op on a stored tensor (``embedding_renorm_`` of ``max_norm`` on a detached weight)
that ran on a resharded copy is written back to the stored shard.
"""
from __future__ import annotations

import itertools
import math
import operator
import zlib

import torch
import torch.fx
from torch.utils.checkpoint import checkpoint

from ..core.aten import alias_root, bind_args, is_random, op_args, with_arg, written_args
from ..core.capture import CapturedGraph
from ..core.losses import is_ratio, ratio_parts
from ..core.plan import NodePlan, Plan
from .collectives import AllReducePartial, MeshGroups, reshard

aten = torch.ops.aten
_SHAPE_ARG = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}
_BIAS_AFTER = {aten.linear.default: "bias", aten.conv2d.default: "bias", aten.conv1d.default: "bias",
               aten.convolution.default: "bias", aten.addmm.default: "self", aten.baddbmm.default: "self"}


class LocalExecutor:
    """Interprets ``captured``'s graph on this rank's shards under ``plan``; ``seed`` seeds the
    random ops (module docstring).

    Attributes:
        denominators: mean cross-entropy / nll node -> the denominator of its last run (count or
            class-weight sum of its valid targets over the whole batch; 0-dim, no gradient).
    """

    def __init__(self, captured: CapturedGraph, plan: Plan, mesh: MeshGroups, device: torch.device, seed: int = 0):
        self.cg, self.plan, self.mesh, self.device, self.seed = captured, plan, mesh, device, seed
        self.calls = 0  # runs so far: every run draws new random numbers
        self.remat = {n: i for i, layer in enumerate(plan.remat) for n in layer}  # node -> recomputed layer
        self.specs = specs = {name: np_.out_specs for name, np_ in plan.nodes.items()}
        # per node, per operand: (producer, producer's spec, wanted spec, gradient partial axes, global shape)
        self.denominators: dict[str, torch.Tensor] = {}
        self.operands: dict[str, list[tuple]] = {}
        self.local_shapes: dict[str, list[int]] = {}
        for name, np_ in plan.nodes.items():
            ops = []
            for i, (src, r) in enumerate(zip(np_.inputs, np_.input_results)):
                val = captured.node(src).meta["val"]
                shape = tuple((val[r] if isinstance(val, (tuple, list)) else val).shape)
                ops.append((src, specs[src][r], np_.in_specs[i], np_.grad_partial[i], shape))
            self.operands[name] = ops
            node = captured.node(name)
            if node.target in _SHAPE_ARG:
                self.local_shapes[name] = list(specs[name][0].local_shape(tuple(node.meta["val"].shape), mesh.shape))

    def run(self, env: dict[str, torch.Tensor]) -> dict[str, object]:
        """Run the graph; ``env`` maps placeholder names to local shards. Returns every value."""
        values: dict[str, object] = {n.name: env.get(n.name) for n in self.cg.graph.nodes if n.op == "placeholder"}
        self.calls += 1
        ops = (n for n in self.cg.graph.nodes if n.op == "call_function")
        for layer, nodes in itertools.groupby(ops, key=lambda n: self.remat.get(n.name)):
            if layer is not None and torch.is_grad_enabled():
                checkpoint(self._run_nodes, list(nodes), values, use_reentrant=False)
            else:
                self._run_nodes(nodes, values)
        return values

    def _run_nodes(self, nodes, values: dict[str, object]) -> None:
        for node in nodes:
            values[node.name] = self._call(node, values)

    def _call(self, node: torch.fx.Node, values):
        np_ = self.plan.nodes.get(node.name)
        if node.target is operator.getitem:
            return values[node.args[0].name][node.args[1]]
        local = {}
        for src, src_spec, dst_spec, grad_partial, shape in self.operands.get(node.name, ()):
            try:
                local[src] = reshard(values[src], src_spec, dst_spec, grad_partial, shape, self.mesh)
            except RuntimeError as e:
                raise RuntimeError(f"node {node.name} ({node.target}), operand {src}: {e}") from e
        lookup = lambda n: local[n.name] if n.name in local else values[n.name]  # noqa: E731
        args = torch.fx.node.map_arg(node.args, lookup)
        kwargs = {k: (self.device if k == "device" else v) for k, v in torch.fx.node.map_arg(node.kwargs, lookup).items()}
        if np_ is None:
            return node.target(*args, **kwargs)
        target = node.target
        if target in _SHAPE_ARG:  # (self, size or shape, ...)
            local_shape = self.local_shapes[node.name]
            args, kwargs = with_arg(target, args, kwargs, target._schema.arguments[1].name, local_shape)
            if target in (aten.view.default, aten._unsafe_view.default):
                # a view that was valid on the captured layout may not be on a resharded shard
                # (export drops a no-op .contiguous()): reshape copies only when it must
                target, args, kwargs = aten.reshape.default, (bind_args(target, args, kwargs)["self"], local_shape), {}
        if target is aten.embedding.default:  # a dense gradient, as every synchronized gradient is
            args, kwargs = with_arg(target, args, kwargs, "sparse", False)
        if is_random(target):
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                torch.manual_seed(self._shard_seed(node, np_))
                out = self._local(node, np_, target, args, kwargs)
        else:
            out = self._local(node, np_, target, args, kwargs)
        for name in written_args(target):
            self._write_back(node, name, out, values)
        if node.name in self.cg.param_mutations:  # the new value of a parameter (a functionalized in-place op)
            self._store(node.name, np_.out_specs[0], out, self.cg.param_mutations[node.name], values)
        return out

    def _local(self, node, np_: NodePlan, target, args, kwargs):
        if is_ratio(target, args, kwargs):
            return self._ratio(node, np_, args, kwargs)
        return self._partial(node, np_, args, kwargs) if np_.partial_axes else target(*args, **kwargs)

    def _shard_seed(self, node, np_: NodePlan) -> int:
        """Seed of a random op on this rank: (run seed, run count, node, coordinates along the mesh
        axes that split the op's result); equal on the ranks that hold the same values."""
        split = set().union(*(s.axes() for s in np_.out_specs))
        coord = tuple(self.mesh.coord[a] if a in split else -1 for a in range(len(self.mesh.shape)))
        return zlib.crc32(repr((self.seed, self.calls, node.name, coord)).encode())

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

    def _ratio(self, node, np_: NodePlan, args, kwargs):
        """A mean cross-entropy / nll: local loss sum and valid-target count, all-reduced together
        (one collective) along the split axes, then divided."""
        num, den = ratio_parts(node.target, args, kwargs)
        if np_.partial_axes:
            both = AllReducePartial.apply(torch.stack([num, den]), np_.partial_axes, self.mesh)
            num, den = both[0], both[1]
        self.denominators[node.name] = den.detach()
        return num / den

    def _partial(self, node, np_: NodePlan, args, kwargs):
        """An op whose local result is a partial sum along ``np_.partial_axes``."""
        axes = np_.partial_axes
        bias = None
        if node.target in _BIAS_AFTER:
            name = _BIAS_AFTER[node.target]
            bias = bind_args(node.target, args, kwargs)[name]
            if node.target in (aten.addmm.default, aten.baddbmm.default):
                bias = bias * bind_args(node.target, args, kwargs)["beta"]
                args, kwargs = with_arg(node.target, args, kwargs, "beta", 0)
            elif bias is not None:
                args, kwargs = with_arg(node.target, args, kwargs, name, None)
        if node.target is aten.embedding.default:
            out = self._vocab_parallel_embedding(np_, **bind_args(node.target, args, kwargs))
        else:
            out = node.target(*args, **kwargs)
        if np_.reduce == "mean":
            out = out / math.prod(self.mesh.shape[a] for a in axes)
        out = AllReducePartial.apply(out, axes, self.mesh)
        if bias is not None:
            if node.target in (aten.conv2d.default, aten.conv1d.default, aten.convolution.default):
                bias = bias.view(-1, *([1] * (out.dim() - 2)))
            out = out + bias
        return out

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
