"""Run a captured graph on local shards under a ``Plan``.

For every node: reshard each operand from its producer's spec to the spec the node's strategy
wants (``Reshard``, autograd-aware), run the aten op on the local shards, and reduce a partial
result (``AllReducePartial``). Most ops run unchanged on shards; a few need a local variant:
shape arguments become local shapes, a mean over a split dim of equal shards is scaled by
1/shards before the all-reduce, a mean cross-entropy / nll is the all-reduced sum of its losses
over the all-reduced count of its valid targets (``losses.ratio_parts``: shards may hold
different counts of ``ignore_index``), a bias is added after the reduction, and a
vocab-parallel embedding looks up only its own rows (Megatron-LM, Shoeybi et al. 2019, section 3).
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx
import torch.nn.functional as F

from ..capture import CapturedGraph
from ..losses import is_ratio, ratio_parts
from ..plan import NodePlan, Plan
from ..spec import ShardingSpec
from .collectives import AllReducePartial, MeshGroups, reshard

aten = torch.ops.aten
_SHAPE_ARG = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}
_BIAS_AFTER = {aten.linear.default: 2, aten.conv2d.default: 2, aten.conv1d.default: 2, aten.convolution.default: 2,
               aten.addmm.default: 0, aten.baddbmm.default: 0}


class LocalExecutor:
    """Interprets ``captured``'s graph on this rank's shards under ``plan``.

    Attributes:
        denominators: mean cross-entropy / nll node -> the denominator of its last run (count or
            class-weight sum of its valid targets over the whole batch; 0-dim, no gradient).
    """

    def __init__(self, captured: CapturedGraph, plan: Plan, mesh: MeshGroups, device: torch.device):
        self.cg, self.plan, self.mesh, self.device = captured, plan, mesh, device
        specs = {name: tuple(ShardingSpec.parse(s) for s in np_.out_specs) for name, np_ in plan.nodes.items()}
        # per node, per operand: (producer, producer's spec, wanted spec, gradient partial axes, global shape)
        self.denominators: dict[str, torch.Tensor] = {}
        self.operands: dict[str, list[tuple]] = {}
        self.local_shapes: dict[str, list[int]] = {}
        for name, np_ in plan.nodes.items():
            ops = []
            for i, (src, r) in enumerate(zip(np_.inputs, np_.input_results)):
                val = captured.node(src).meta["val"]
                shape = tuple((val[r] if isinstance(val, (tuple, list)) else val).shape)
                ops.append((src, specs[src][r], ShardingSpec.parse(np_.in_specs[i]), np_.grad_partial[i], shape))
            self.operands[name] = ops
            node = captured.node(name)
            if node.target in _SHAPE_ARG:
                self.local_shapes[name] = list(specs[name][0].local_shape(tuple(node.meta["val"].shape), mesh.shape))

    def run(self, env: dict[str, torch.Tensor]) -> dict[str, object]:
        """Run the graph; ``env`` maps placeholder names to local shards. Returns every value."""
        values: dict[str, object] = {}
        for node in self.cg.graph.nodes:
            if node.op == "placeholder":
                values[node.name] = env.get(node.name)
            elif node.op == "call_function":
                values[node.name] = self._call(node, values)
        return values

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
        if target in _SHAPE_ARG:
            args = (args[0], self.local_shapes[node.name]) + tuple(args[2:])
            if target in (aten.view.default, aten._unsafe_view.default):
                # a view that was valid on the captured layout may not be on a resharded shard
                # (export drops a no-op .contiguous()): reshape copies only when it must
                target = aten.reshape.default
        if is_ratio(target, args, kwargs):
            return self._ratio(node, np_, args, kwargs)
        if not np_.partial_axes:
            return target(*args, **kwargs)
        return self._partial(node, np_, args, kwargs)

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
            pos = _BIAS_AFTER[node.target]
            args = list(args)
            if node.target in (aten.addmm.default, aten.baddbmm.default):
                beta = kwargs.pop("beta", 1)
                bias, args[0] = args[0] * beta, torch.zeros((), dtype=args[0].dtype, device=args[0].device)
            elif len(args) > pos and args[pos] is not None:
                bias, args[pos] = args[pos], None
            args = tuple(args)
        if node.target is aten.embedding.default:
            out = self._vocab_parallel_embedding(node, np_, *args[:2])
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

    def _vocab_parallel_embedding(self, node, np_, weight, idx):
        entry = ShardingSpec.parse(np_.in_specs[0]).dims[0]
        rows = weight.shape[0]
        start = self.mesh.shard_index(entry) * rows
        mask = (idx >= start) & (idx < start + rows)
        out = F.embedding((idx - start) * mask, weight)
        return out * mask.unsqueeze(-1).to(out.dtype)
