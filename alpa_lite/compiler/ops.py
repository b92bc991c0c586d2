"""Operator signatures: which dims of an op's operands and results move together.

Every supported op is described einsum-style (as Alpa's and DTensor's einsum strategies do):
each tensor dim of each operand and result gets a *label*; dims with the same label are cut
together. A label that appears in no result is a *contraction* (matmul's ``k``, a reduced dim):
splitting it leaves partial sums, reduced by an all-reduce inside the op. A *fixed* label may
not be split at all (a softmax dim, a convolution's spatial dims, a broadcast size-1 dim).
An op *linear* in some operands (add, sub, neg, mul / div by a value that is not a partial sum,
views, transposes, sum) may also take them as partial sums and leave its result one
(``OpSignature.linear_in``; DTensor's ``Partial`` propagation).
The strategy generator (``strategies.py``) enumerates mesh-axis assignments over the labels,
so one routine covers matmul, elementwise, reductions, views, attention, embedding, losses,
convolution and pooling.
"""
from __future__ import annotations

import itertools
import math
import operator
import re
from dataclasses import dataclass, field

import torch
import torch.fx

from ..core.aten import CONV_OPS, is_transposed_conv, op_args, stats_written, written_args

aten = torch.ops.aten
Labels = tuple[str, ...]


@dataclass
class OpSignature:
    """Labels for one node.

    Attributes:
        inputs: labels per tensor input, in ``node.all_input_nodes`` order.
        outputs: labels per result (one entry for single-tensor ops).
        fixed: labels that must stay replicated.
        reduce: semantics of partial sums over contraction labels: ``"sum"`` or ``"mean"``
            (a mean over a split dim is a local mean scaled by 1/shards, then summed).
        post_reduce: input positions added after the reduction (a matmul's bias).
        linear_in: alternative sets of input positions the op is linear in jointly (``((0, 1),)``
            for add, ``((0,), (1,))`` for a product): each set may arrive as a partial sum along
            mesh axes no label uses, and the result leaves as one (``linear_inputs``).
        stats: label -> the statistics the op's local variant all-reduces over the mesh axes that
            split that label, each ``(phase, labels of the statistic)`` (``"forward"`` or
            ``"backward"``): a vocab-parallel cross-entropy's max and sum-exp per sample, a
            synchronized batch norm's mean and variance per channel. Such a label is no
            contraction: the result is complete after those all-reduces.
        units: label -> how many indivisible units the dim holds (a grouped convolution's
            channels split by whole groups): a split of the label must divide it.
    """

    inputs: list[Labels]
    outputs: list[Labels]
    fixed: set[str] = field(default_factory=set)
    reduce: str = "sum"
    post_reduce: set[int] = field(default_factory=set)
    linear_in: tuple[tuple[int, ...], ...] = ()
    stats: dict[str, tuple[tuple[str, Labels], ...]] = field(default_factory=dict)
    units: dict[str, int] = field(default_factory=dict)

    @property
    def contraction(self) -> set[str]:
        out = {lab for labs in self.outputs for lab in labs}
        return {lab for labs in self.inputs for lab in labs} - out - set(self.stats)

    @property
    def labels(self) -> list[str]:
        seen: dict[str, None] = {}
        for labs in itertools.chain(self.inputs, self.outputs):
            for lab in labs:
                seen.setdefault(lab)
        return list(seen)


def _val(n):
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else None


def _shape(n) -> tuple[int, ...]:
    return tuple(int(s) for s in _val(n).shape)


class _Fresh:
    """Source of unique labels that can never be split (broadcast and fixed dims)."""

    def __init__(self):
        self.count = itertools.count()

    def __call__(self) -> str:
        return f"#{next(self.count)}"


def _dims(prefix: str, n: int) -> Labels:
    return tuple(f"{prefix}{i}" for i in range(n))


def _broadcast(inp_shape, out_labels: Labels, out_shape, fresh) -> Labels:
    """Labels of an operand broadcast (numpy rules) to a result labelled ``out_labels``."""
    r, q = len(out_shape), len(inp_shape)
    labs = []
    for i in range(q):
        o = r - q + i
        labs.append(out_labels[o] if inp_shape[i] == out_shape[o] else fresh())
    return tuple(labs)


def _fixed_in(labs: Labels, dims) -> set[str]:
    return {labs[d % len(labs)] for d in dims} if labs else set()


def _tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [n for n in node.all_input_nodes if isinstance(_val(n), torch.Tensor)]


# ----------------------------------------------------------------------------- op families

def _pointwise(node, fresh) -> OpSignature:
    out_shape = _shape(node)
    out = _dims("d", len(out_shape))
    ins = [_broadcast(_shape(n), out, out_shape, fresh) for n in _tensor_inputs(node)]
    return OpSignature(ins, [out])


def _broadcast_tensors(node, fresh) -> OpSignature:
    out_shape = tuple(_val(node)[0].shape)
    out = _dims("d", len(out_shape))
    ins = [_broadcast(_shape(n), out, out_shape, fresh) for n in _tensor_inputs(node)]
    return OpSignature(ins, [out] * len(_val(node)))


def _same_labels(node, fresh) -> OpSignature:
    """Single input, same shape result (contiguous, clone, dropout ...)."""
    out = _dims("d", len(_shape(node)))
    return OpSignature([out for _ in _tensor_inputs(node)], [out])


def _normalize(node, fresh, dims) -> OpSignature:
    sig = _same_labels(node, fresh)
    sig.fixed |= _fixed_in(sig.outputs[0], dims)
    return sig


def _softmax(node, fresh):
    return _normalize(node, fresh, [op_args(node)["dim"]])


def _layer_norm(node, fresh):
    a = op_args(node)
    x, shape = a["input"], a["normalized_shape"]
    r = len(_shape(x))
    out = _dims("d", r)
    norm = out[r - len(shape):]
    ins = [out] + [norm for n in _tensor_inputs(node)[1:]]
    return OpSignature(ins, [out], fixed=set(norm))


def _mm(node, fresh):
    return OpSignature([("m", "k"), ("k", "n")], [("m", "n")])


def _mv(node, fresh):
    """``mv(matrix, vector)`` (spectral norm's power iteration): ``k`` contracted."""
    return OpSignature([("m", "k"), ("k",)], [("m",)])


def _vdot(node, fresh):
    """``vdot`` of two vectors (spectral norm's ``sigma``): ``k`` contracted to a 0-dim result."""
    return OpSignature([("k",), ("k",)], [()])


def _weight_norm(node, fresh):
    """``_weight_norm(v, g, dim)``: ``g * v / ||v||`` with the norm over every dim of ``v`` but
    ``dim`` (``dim=-1``: over the whole tensor, ``weight_norm(dim=None)``). ``dim`` splits, with ``g``
    (size 1 elsewhere); the normed dims stay whole."""
    a = op_args(node)
    shape = _shape(a["v"])
    out = _dims("d", len(shape))
    dim = a["dim"]
    g = _broadcast(_shape(a["g"]), out, shape, fresh)
    return OpSignature([out, g], [out], fixed={lab for i, lab in enumerate(out) if dim == -1 or i != dim})


def _bmm(node, fresh):
    return OpSignature([("b", "m", "k"), ("b", "k", "n")], [("b", "m", "n")])


def _addmm_like(core):
    def sig(node, fresh):
        s = core(node, fresh)
        bias = _broadcast(_shape(op_args(node)["self"]), s.outputs[0], _shape(node), fresh)
        return OpSignature([bias] + s.inputs, s.outputs, post_reduce={0})
    return sig


def _linear(node, fresh):
    a = op_args(node)
    x = _shape(a["input"])
    batch = _dims("d", len(x) - 1)
    ins = [batch + ("k",), ("n", "k")]
    post = set()
    if a["bias"] is not None:
        ins.append(("n",))
        post = {2}
    return OpSignature(ins, [batch + ("n",)], post_reduce=post)


def _matmul(node, fresh):
    """``torch.matmul``, vectors included: a 1-D operand has only its ``k`` (the dot product
    contracts it), a 1-D left operand drops ``m`` from the result, a 1-D right one ``n``."""
    a, b = (_shape(v) for v in op_args(node).values())
    out_shape = _shape(node)
    if len(a) == 1 and len(b) == 1:
        return OpSignature([("k",), ("k",)], [()])
    if len(a) == 1:
        out = _dims("d", len(out_shape) - 1) + ("n",)
        return OpSignature([("k",), _broadcast(b[:-2], out[:-1], out_shape[:-1], fresh) + ("k", "n")], [out])
    if len(b) == 1:
        out = _dims("d", len(out_shape) - 1) + ("m",)
        return OpSignature([_broadcast(a[:-2], out[:-1], out_shape[:-1], fresh) + ("m", "k"), ("k",)], [out])
    out = _dims("d", len(out_shape) - 2) + ("m", "n")
    la = _broadcast(a[:-2], out[:-2], out_shape[:-2], fresh) + ("m", "k")
    lb = _broadcast(b[:-2], out[:-2], out_shape[:-2], fresh) + ("k", "n")
    return OpSignature([la, lb], [out])


def _einsum(node, fresh):
    a = op_args(node)
    eq, operands = a["equation"].replace(" ", ""), a["tensors"]
    lhs, rhs = eq.split("->") if "->" in eq else (eq, None)
    terms = lhs.split(",")
    if "." in eq or rhs is None or len(terms) != len(operands):
        return None
    if len(set(map(id, operands))) != len(operands):
        return None
    ins = [tuple(t) for t in terms]
    for term in ins:
        if len(term) != len(set(term)):  # diagonals: not supported
            return None
    return OpSignature(ins, [tuple(rhs)])


def _reduced(node) -> tuple[Labels, set[int], bool]:
    """Input labels, reduced dims and keepdim of a reduction (``dim`` None or empty: all dims)."""
    a = op_args(node)
    r = len(_shape(a["self"]))
    dims = a["dim"]
    dims = [dims] if isinstance(dims, int) else list(dims or range(r))
    return _dims("d", r), {d % r for d in dims} if r else set(), bool(a["keepdim"])


def _reduction(reduce):
    """sum / mean over dims: a split reduced dim leaves partial sums (or scaled partial means)."""
    def sig(node, fresh):
        inp, dims, keep = _reduced(node)
        out = tuple(fresh() if i in dims else lab for i, lab in enumerate(inp)) if keep else \
            tuple(lab for i, lab in enumerate(inp) if i not in dims)
        return OpSignature([inp], [out], reduce=reduce)
    return sig


def _full_reduction(reduce):
    def sig(node, fresh):
        return OpSignature([_dims("d", len(_shape(op_args(node)["self"])))], [()], reduce=reduce)
    return sig


def _fixed_reduction(node, fresh):
    """amax / max.dim / argmax / var / std: the reduced dims may not be split."""
    inp, dims, keep = _reduced(node)
    out = tuple(lab for i, lab in enumerate(inp) if keep or i not in dims)
    n_out = len(_val(node)) if isinstance(_val(node), (tuple, list)) else 1
    return OpSignature([inp], [out] * n_out, fixed=_fixed_in(inp, dims))


def _sorted(node, fresh):
    """sort / topk / argsort: values and indices (argsort: the indices only) along ``dim``, which
    stays whole (topk's result holds ``k`` of it: a dim of its own); the other dims split. Along
    the batch dim the fixed label reads as combining samples (an MoE's tokens sorted by expert)."""
    a = op_args(node)
    inp = _dims("d", len(_shape(a["self"])))
    out = inp
    if node.target is aten.topk.default and inp:
        d = a["dim"] % len(inp)
        out = inp[:d] + (fresh(),) + inp[d + 1:]
    n_out = len(_val(node)) if isinstance(_val(node), (tuple, list)) else 1
    return OpSignature([inp], [out] * n_out, fixed=_fixed_in(inp, [a["dim"]]))


def _accumulate_into(node, fresh):
    """``scatter_add(self, dim, index, src)`` and ``index_add(self, dim, index, source)``: rows of
    ``src`` added into ``self`` at positions along ``dim`` that the index picks. ``dim`` stays whole
    in every operand (an index may point anywhere in it; a split of the added rows would add
    ``self`` once per shard). Every other dim splits where ``self``, the result and the added
    tensor (and scatter's index) have one size; a smaller one (scatter's index may cover a prefix
    of ``src`` and ``self``) keeps that dim whole. Along the batch dim the fixed label reads as
    combining samples (tokens put back into other rows); along another dim the op is per sample."""
    a = op_args(node)
    shape = _shape(a["self"])
    if not shape:
        return None
    d = a["dim"] % len(shape)
    added = a["src"] if node.target is aten.scatter_add.default else a["source"]
    others = [_shape(added)] + ([_shape(a["index"])] if node.target is aten.scatter_add.default else [])
    out = tuple("s" if i == d else lab if all(len(o) == len(shape) and o[i] == size for o in others) else fresh()
                for i, (lab, size) in enumerate(zip(_dims("d", len(shape)), shape)))
    rows = [lab if lab.startswith("d") else fresh() for lab in out]  # the added rows: "s" and the whole dims fresh
    src = tuple(rows) if len(_shape(added)) == len(shape) else tuple(fresh() for _ in _shape(added))
    if node.target is aten.scatter_add.default:
        ins = [out, src, src]  # all_input_nodes: self, index, src
    else:
        ins = [out, (fresh(),) * len(_shape(a["index"])), src]  # self, the 1-D index, source
    return OpSignature(ins, [out], fixed={"s"})


def _repeat_interleave(node, fresh):
    """``repeat_interleave(self, repeats: int, dim)``: each element of ``dim`` repeated ``repeats``
    times in place, so a block of ``dim``'s rows gives the matching block of the result's: every
    dim splits, ``dim`` with the result's (unless ``output_size`` fixes the whole size). Without a
    ``dim`` (the flattened tensor) there is no rule."""
    a = op_args(node)
    if a["dim"] is None:
        return None
    sig = _same_labels(node, fresh)
    if a["output_size"] is not None:
        sig.fixed |= _fixed_in(sig.outputs[0], [a["dim"]])
    return sig


def _roll(node, fresh):
    """roll along ``dims`` (none: the flattened tensor, every dim) keeps those dims whole."""
    dims = op_args(node)["dims"]
    return _normalize(node, fresh, dims or range(len(_shape(node))))


def _group_norm(node, fresh):
    """group_norm of ``(N, C, *)``: the batch splits, the channels by whole groups (a group's
    statistics are its own; the executor runs ``num_groups / shards`` of them), the other dims
    stay whole; weight and bias ``(C,)`` follow the channels."""
    a = op_args(node)
    out = _dims("d", len(_shape(a["input"])))
    ins = [out] + [out[1:2] for _ in _tensor_inputs(node)[1:]]
    return OpSignature(ins, [out], fixed=set(out[2:]), units={out[1]: a["num_groups"]})


def _instance_norm(node, fresh):
    """instance_norm of ``(N, C, *)`` without running statistics: per sample and channel, so both
    split and the other dims stay whole. With running statistics updated inside the op from the
    batch's mean (written in place, which a shard's copy would not reach) every dim stays whole:
    it runs replicated, and its result keeps the batch dim for the loss reader, which reports the
    statistics as combining samples (``loss_reduction``)."""
    a = op_args(node)
    out = _dims("d", len(_shape(a["input"])))
    ins = [out] + [out[1:2] for _ in _tensor_inputs(node)[1:]]
    if stats_written(node):
        return OpSignature(ins, [out], fixed=set(out))
    return OpSignature(ins, [out], fixed=set(out[2:]))


def _cosine_similarity(node, fresh):
    """cosine_similarity of two broadcast operands along ``dim``, which stays whole and leaves the
    result."""
    a = op_args(node)
    shape = tuple(torch.broadcast_shapes(_shape(a["x1"]), _shape(a["x2"])))
    full = _dims("d", len(shape))
    d = a["dim"] % len(shape)
    ins = [_broadcast(_shape(n), full, shape, fresh) for n in _tensor_inputs(node)]
    return OpSignature(ins, [full[:d] + full[d + 1:]], fixed={full[d]})


def _cdist(node, fresh):
    """cdist of ``(*B, P, M)`` and ``(*B, R, M)`` to ``(*B, P, R)``: the batch, the rows of each
    side split; the features ``M`` stay whole (a p-norm over them is no sum). One tensor on both
    sides has no rule (its rows are both ``P`` and ``R``)."""
    a = op_args(node)
    if a["x1"] is a["x2"]:
        return None
    s1, s2 = _shape(a["x1"]), _shape(a["x2"])
    shape = tuple(torch.broadcast_shapes(s1[:-2], s2[:-2]))
    b = _dims("b", len(shape))
    ins = [_broadcast(s1[:-2], b, shape, fresh) + ("p", "m"), _broadcast(s2[:-2], b, shape, fresh) + ("r", "m")]
    return OpSignature(ins, [b + ("p", "r")], fixed={"m"})


def _transpose(node, fresh):
    a = op_args(node)
    r = len(_shape(a["self"]))
    inp = _dims("d", r)
    out = list(inp)
    if r >= 2:
        d0, d1 = (a["dim0"] % r, a["dim1"] % r) if node.target != aten.t.default else (0, 1)
        out[d0], out[d1] = out[d1], out[d0]
    return OpSignature([inp], [tuple(out)])


def _permute(node, fresh):
    a = op_args(node)
    inp = _dims("d", len(_shape(a["self"])))
    return OpSignature([inp], [tuple(inp[d % len(inp)] for d in a["dims"])])


def _unsqueeze(node, fresh):
    a = op_args(node)
    inp = _dims("d", len(_shape(a["self"])))
    d = a["dim"] % (len(inp) + 1)
    return OpSignature([inp], [inp[:d] + (fresh(),) + inp[d:]])


def _squeeze(node, fresh):
    """squeeze of every size-1 dim, or of ``dim`` / ``dims`` only (other size-1 dims stay)."""
    a = op_args(node)
    x = _shape(a["self"])
    dims = a.get("dim", a.get("dims"))
    dims = range(len(x)) if dims is None else [dims] if isinstance(dims, int) else dims
    dropped = {d % len(x) for d in dims if x[d % len(x)] == 1} if x else set()
    inp = tuple(lab if i not in dropped else fresh() for i, lab in enumerate(_dims("d", len(x))))
    out_shape = _shape(node)
    out = tuple(lab for i, lab in enumerate(inp) if i not in dropped)
    if len(out) != len(out_shape):  # squeeze of a dim that is not size 1 in some positions
        return None
    return OpSignature([inp], [out])


def _view(node, fresh):
    """Reshape: dims map in groups of equal product; a group's major dims share a label."""
    src, dst = _shape(op_args(node)["self"]), _shape(node)
    inp, out = [None] * len(src), [None] * len(dst)
    i = j = 0
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            inp[i] = fresh(); i += 1; continue
        if j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            out[j] = fresh(); j += 1; continue
        gi, gj = [i], [j]
        pi, pj = src[i], dst[j]
        while pi != pj:
            if pi < pj:
                i += 1; gi.append(i); pi *= src[i]
            else:
                j += 1; gj.append(j); pj *= dst[j]
        shared = f"g{gi[0]}"
        for k, d in enumerate(gi):
            inp[d] = shared if k == 0 else fresh()
        for k, d in enumerate(gj):
            out[d] = shared if k == 0 else fresh()
        i, j = gi[-1] + 1, gj[-1] + 1
    return OpSignature([tuple(inp)], [tuple(out)])


def _expand(node, fresh):
    out = _dims("d", len(_shape(node)))
    return OpSignature([_broadcast(_shape(op_args(node)["self"]), out, _shape(node), fresh)], [out])


def _split(node, fresh):
    a = op_args(node)
    r = len(_shape(a["self"]))
    dim = a["dim"] % r
    inp = _dims("d", r)
    return OpSignature([inp], [inp] * len(_val(node)), fixed={inp[dim]})


def _unbind(node, fresh):
    a = op_args(node)
    r = len(_shape(a["self"]))
    dim = a["dim"] % r
    inp = _dims("d", r)
    out = inp[:dim] + inp[dim + 1:]
    return OpSignature([inp], [out] * len(_val(node)), fixed={inp[dim]})


def _cat(node, fresh):
    out_shape = _shape(node)
    r = len(out_shape)
    dim = op_args(node)["dim"] % r
    out = _dims("d", r)
    return OpSignature([out for _ in _tensor_inputs(node)], [out], fixed={out[dim]})


def _slice(node, fresh):
    a = op_args(node)
    x = _shape(a["self"])
    r = len(x)
    dim = a["dim"] % r
    inp = _dims("d", r)
    if _shape(node)[dim] == x[dim]:
        return OpSignature([inp], [inp])
    return OpSignature([inp], [inp], fixed={inp[dim]})


def _select(node, fresh):
    a = op_args(node)
    r = len(_shape(a["self"]))
    dim = a["dim"] % r
    inp = _dims("d", r)
    return OpSignature([inp], [inp[:dim] + inp[dim + 1:]], fixed={inp[dim]})


def _sdpa(node, fresh):
    """Attention splits batch and heads; ``is_causal``, ``scale`` and ``dropout_p`` act within a
    (batch, head) slice, so they run unchanged on every shard (dropout with the shard's RNG).
    With ``enable_gqa`` (``H`` query heads over ``G`` key/value heads, query head ``h`` reading
    head ``h // (H / G)``) a block of query heads reads the matching block of key/value heads, so
    ``h`` splits in both (the split must divide ``G``)."""
    a = op_args(node)
    q, k = _shape(a["query"]), _shape(a["key"])
    if len(q) != 4 or q[1] != k[1] and not (a["enable_gqa"] and q[1] % k[1] == 0):
        return None
    ins = [("b", "h", "s", "d"), ("b", "h", "t", "d"), ("b", "h", "t", "e")]
    if isinstance(a["attn_mask"], torch.fx.Node):
        ins.append(_broadcast(_shape(a["attn_mask"]), ("b", "h", "s", "t"), (q[0], q[1], q[2], k[2]), fresh))
    return OpSignature(ins, [("b", "h", "s", "e")], fixed={"s", "t", "d", "e"})


def _embedding(node, fresh):
    """The vocab label ``v`` is a contraction: a vocab-parallel lookup (Megatron) leaves partial
    sums, and its local variant honours ``padding_idx``. ``scale_grad_by_freq`` divides a row's
    gradient by its count in the whole index tensor, which a shard of the indices or of the
    vocabulary does not see: then only the hidden dim may be split."""
    a = op_args(node)
    idx = _dims("d", len(_shape(a["indices"])))
    fixed = {"v", *idx} if a["scale_grad_by_freq"] else set()
    return OpSignature([("v", "h"), idx], [idx + ("h",)], fixed=fixed)


def _cross_entropy(node, fresh):
    """Cross-entropy and nll (arguments by schema): a mean over split targets is reduced as sum
    and count separately by the runtime (``losses.ratio_parts``), so every option splits.

    Cross-entropy without class weights may also split the classes (vocab-parallel, Megatron-LM:
    Shoeybi et al. 2019, section 3): each shard all-reduces per sample the max of its logits, the
    sum of their exponentials and the target's logit (and, with label smoothing, the logits' sum)
    instead of gathering the logits; nll and weighted cross-entropy keep the classes whole."""
    a = op_args(node)
    logits = _shape(a["self"])
    if len(logits) < 2 or _shape(a["target"]) != (logits[0],) + logits[2:]:
        return None  # one sample, or class-probability targets: replicated
    x = ("n", "c") + _dims("d", len(logits) - 2)
    t = ("n",) + x[2:]
    ins = [x, t] + ([("c",)] if isinstance(a["weight"], torch.fx.Node) else [])
    vocab = node.target is aten.cross_entropy_loss.default and len(ins) == 2
    stats = {"c": (("forward", t),) * (4 if a["label_smoothing"] else 3)} if vocab else {}
    fixed = set() if vocab else {"c"}
    if a["reduction"] == 0:
        return OpSignature(ins, [t], fixed=fixed, stats=stats)
    return OpSignature(ins, [()], fixed=fixed, stats=stats,  # 1: at::Reduction::Mean
                       reduce="mean" if a["reduction"] == 1 else "sum")


def _elementwise_loss(node, fresh):
    """A loss of one term per element of ``self`` (``mse_loss``, ``l1_loss``, ``smooth_l1_loss``,
    ``huber_loss``, ``soft_margin_loss``, ``hinge_embedding_loss``,
    ``binary_cross_entropy[_with_logits]``, ``kl_div`` (``"batchmean"`` is its sum, divided after);
    ``margin_ranking_loss``'s ``input1`` and ``input2``):
    ``target`` of its shape, any ``weight`` / ``pos_weight`` broadcast to it. ``reduction="none"``
    is pointwise; a mean or sum of a split dim leaves partial means or sums."""
    a = op_args(node)
    if a["reduction"] == 0:
        return _pointwise(node, fresh)
    shape = _shape(a["self"] if "self" in a else a["input1"])
    if _shape(a["target"]) != shape:
        return None
    x = _dims("d", len(shape))
    return OpSignature([_broadcast(_shape(n), x, shape, fresh) for n in _tensor_inputs(node)], [()],
                       reduce="mean" if a["reduction"] == 1 else "sum")


def _conv(node, fresh):
    """Every convolution (``CONV_OPS``: 1-3 spatial dims, a string padding such as ``"same"``,
    transposed). Channels split (output channels, or input channels as a contraction) for
    ``groups`` 1; a transposed convolution's weight is (in, out / groups, kernel). A grouped (or
    depthwise) convolution splits by whole groups: input channels, output channels and the
    weight's first dim share the label ``g`` (``groups`` units), and a shard runs
    ``groups / shards`` of them (the executor's local variant). Spatial dims stay whole, so
    stride, padding, dilation and output padding run unchanged on every shard. An unbatched
    ``(C, *spatial)`` input has no batch label (the spatial dims are counted from the weight: they
    were taken as ``ndim - 2``, and an unbatched ``(C, H, W)`` input of ``conv2d`` had its ``H``
    split)."""
    a = op_args(node)
    nd = len(_shape(a["weight"])) - 2
    batch = ("n",) if len(_shape(a["input"])) == nd + 2 else ()
    sp_in = tuple(fresh() for _ in range(nd))
    sp_out = tuple(fresh() for _ in range(nd))
    kern = tuple(fresh() for _ in range(nd))
    units = {}
    if a["groups"] == 1:
        c, o = "c", "o"
        weight = (c, o) if is_transposed_conv(node.target, a) else (o, c)
    else:
        c = o = "g"
        weight = ("g", fresh())
        units = {"g": a["groups"]}
    ins = [batch + (c,) + sp_in, weight + kern]
    post = set()
    if isinstance(a["bias"], torch.fx.Node):
        ins.append((o,))
        post = {2}
    return OpSignature(ins, [batch + (o,) + sp_out], post_reduce=post, units=units)


def _batch_norm(node, fresh):
    """Batch norm. Training ``_native_batch_norm_legit_functional`` splits the batch as a
    synchronized batch norm (Ioffe and Szegedy 2015; the batch statistics of the whole batch):
    per channel, the mean and the variance are all-reduced forward, and the two gradient sums
    backward, over the mesh axes that split the batch. Another training batch norm keeps the
    batch whole; in evaluation it splits freely."""
    a = op_args(node)
    x = _shape(a["input"])
    spatial = tuple(fresh() for _ in range(len(x) - 2))
    sync = bool(a["training"]) and node.target is aten._native_batch_norm_legit_functional.default
    n = "n" if sync or not a["training"] else fresh()
    ins = [(n, "c") + spatial] + [("c",) for _ in _tensor_inputs(node)[1:]]
    val = _val(node)
    outs = [(n, "c") + spatial] + ([("c",)] * (len(val) - 1) if isinstance(val, (tuple, list)) else [])
    stats = {"n": (("forward", ("c",)),) * 2 + (("backward", ("c",)),) * 2} if sync else {}
    return OpSignature(ins, outs, stats=stats)


def _one_hot(node, fresh):
    """``one_hot`` splits its input's dims; the class dim stays whole (export needs the class
    count: with ``num_classes=-1`` it would come from the data)."""
    inp = _dims("d", len(_shape(op_args(node)["self"])))
    return OpSignature([inp], [inp + (fresh(),)])


def _index(node, fresh):
    """``x[..., idx, ...]`` with one integer index tensor at dim ``k``: a gather along ``k``, which
    stays whole; every other dim of ``x`` and every dim of ``idx`` may be split."""
    a = op_args(node)
    idx = a["indices"]
    pos = [i for i, t in enumerate(idx) if t is not None]
    if len(pos) != 1 or _val(idx[pos[0]]).dtype not in (torch.int64, torch.int32):
        return None  # several index tensors (broadcast together) or a boolean mask
    k = pos[0]
    inp = _dims("d", len(_shape(a["self"])))
    il = _dims("i", len(_shape(idx[k])))
    return OpSignature([inp, il], [inp[:k] + il + inp[k + 1:]], fixed={inp[k]})


def _gather(node, fresh):
    """``gather(self, dim, index)``: the result has the index's shape and labels; ``self``'s ``dim``
    stays whole (an index may pick any position of it), the index's splits freely. Every other dim
    splits with ``self``'s where both have the same size; where the index's is smaller it reads a
    prefix of ``self``'s, and neither splits."""
    a = op_args(node)
    x, idx = _shape(a["self"]), _shape(a["index"])
    if not x or len(x) != len(idx):
        return None
    d = a["dim"] % len(x)
    out = tuple(lab if i == d or x[i] == idx[i] else fresh() for i, lab in enumerate(_dims("d", len(idx))))
    return OpSignature([tuple("s" if i == d else lab for i, lab in enumerate(out)), out], [out], fixed={"s"})


def _index_select(node, fresh):
    """``index_select(self, dim, index)``: a gather along ``dim``, which stays whole (as ``x[:, idx]``,
    ``_index``); the other dims of ``self`` and the 1-D index split."""
    a = op_args(node)
    inp = _dims("d", len(_shape(a["self"])))
    if not inp:
        return None
    d = a["dim"] % len(inp)
    il = ("i",) if _shape(a["index"]) else ()
    return OpSignature([inp, il], [inp[:d] + (il or (fresh(),)) + inp[d + 1:]], fixed={inp[d]})


def _select_scatter(node, fresh):
    """``select_scatter(self, src, dim, index)``: ``src`` (``self`` less ``dim``) written at one
    position of ``dim``, which stays whole; the other dims split with ``src``'s."""
    a = op_args(node)
    inp = _dims("d", len(_shape(a["self"])))
    d = a["dim"] % len(inp)
    return OpSignature([inp, inp[:d] + inp[d + 1:]], [inp], fixed={inp[d]})


def _pad(node, fresh):
    """``pad`` / ``constant_pad_nd``: the padded dims stay whole, the others split."""
    a = op_args(node)
    pad, r = a["pad"], len(_shape(a["self"]))
    return _normalize(node, fresh, [r - 1 - i // 2 for i, p in enumerate(pad) if p])


def _pool(node, fresh):
    """Pooling and upsampling of ``(N, C, *spatial)`` or an unbatched ``(C, *spatial)``: per sample
    and channel, so those split; the ``k`` spatial dims of a ``kd`` op (a window, an
    interpolation) stay whole. (``k`` was taken as ``ndim - 2``: an unbatched ``(C, H, W)`` input
    of a 2d pooling had ``H`` split.)"""
    x = _shape(_tensor_inputs(node)[0])
    nd = int(re.search(r"(\d)d", node.target._opname).group(1))
    lead = ("n", "c")[2 - (len(x) - nd):]
    inp = lead + tuple(fresh() for _ in range(nd))
    val = _val(node)
    outs = [lead + tuple(fresh() for _ in range(nd))]
    if isinstance(val, (tuple, list)):
        outs = outs * len(val)
    return OpSignature([inp], outs)


# Views and layout ops: cheap, merged into their operand's ILP variable (Alpa's "follower" ops).
FOLLOWER_TARGETS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int, aten.t.default,
    aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
    aten.contiguous.default, aten.clone.default, aten.alias.default, aten.detach.default,
    aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.type_as.default, aten.expand.default,
    aten.flatten.using_ints, aten.unflatten.int, operator.getitem,
}

_ELEMENTWISE_LOSSES = (aten.mse_loss.default, aten.l1_loss.default, aten.smooth_l1_loss.default,
                       aten.huber_loss.default, aten.soft_margin_loss.default, aten.binary_cross_entropy.default,
                       aten.binary_cross_entropy_with_logits.default, aten.hinge_embedding_loss.default,
                       aten.margin_ranking_loss.default, aten.kl_div.default)
_TABLE = {
    aten.mm.default: _mm, aten.bmm.default: _bmm, aten.addmm.default: _addmm_like(_mm),
    aten.addmv.default: _addmm_like(_mv), aten.baddbmm.default: _addmm_like(_bmm), aten.linear.default: _linear,
    aten.matmul.default: _matmul,
    aten.einsum.default: _einsum, aten.mv.default: _mv, aten.vdot.default: _vdot, aten.dot.default: _vdot,
    aten._weight_norm.default: _weight_norm, aten.fill.Scalar: _same_labels,
    aten.sum.dim_IntList: _reduction("sum"), aten.mean.dim: _reduction("mean"),
    aten.sum.default: _full_reduction("sum"), aten.mean.default: _full_reduction("mean"),
    aten.amax.default: _fixed_reduction, aten.max.dim: _fixed_reduction, aten.argmax.default: _fixed_reduction,
    aten.var.correction: _fixed_reduction, aten.var.dim: _fixed_reduction, aten.std.correction: _fixed_reduction,
    aten.std.dim: _fixed_reduction, aten.amin.default: _fixed_reduction, aten.min.dim: _fixed_reduction,
    aten.argmin.default: _fixed_reduction, aten.logsumexp.default: _fixed_reduction,
    aten.special_logsumexp.default: _fixed_reduction, aten.prod.dim_int: _fixed_reduction,
    aten.linalg_vector_norm.default: _fixed_reduction, aten.any.dim: _fixed_reduction,
    aten.any.dims: _fixed_reduction, aten.all.dim: _fixed_reduction, aten.all.dims: _fixed_reduction,
    aten.__and__.Tensor: _pointwise, aten.__or__.Tensor: _pointwise,  # bool masks' & and |: no pointwise tag
    aten.log_sigmoid.default: _pointwise,  # F.logsigmoid (DPO's loss): no pointwise tag
    aten.fill.Tensor: _pointwise,  # a 0-dim value broadcast over self (T5's decoder start token): no pointwise tag
    aten.masked_fill.Tensor: _pointwise,  # a 0-dim value where the (broadcast) mask is set: no pointwise tag
    # torch.where with a Python number on either side: no pointwise tag
    aten.where.Scalar: _pointwise, aten.where.ScalarSelf: _pointwise, aten.where.ScalarOther: _pointwise,
    aten.softmax.int: _softmax, aten._softmax.default: _softmax, aten.log_softmax.int: _softmax,
    aten._log_softmax.default: _softmax,
    aten.layer_norm.default: _layer_norm, aten.rms_norm.default: _layer_norm,
    aten.transpose.int: _transpose, aten.t.default: _transpose, aten.permute.default: _permute,
    aten.unsqueeze.default: _unsqueeze, aten.squeeze.dim: _squeeze, aten.squeeze.dims: _squeeze,
    aten.squeeze.default: _squeeze,
    aten.view.default: _view, aten.reshape.default: _view, aten._unsafe_view.default: _view,
    aten.flatten.using_ints: _view, aten.unflatten.int: _view, aten.expand.default: _expand,
    aten.contiguous.default: _same_labels, aten.clone.default: _same_labels, aten.alias.default: _same_labels,
    aten.detach.default: _same_labels, aten._to_copy.default: _same_labels, aten.to.dtype: _same_labels,
    aten.to.dtype_layout: _same_labels, aten.to.device: _same_labels, aten.dropout.default: _same_labels, aten.type_as.default: _pointwise,
    aten.split.Tensor: _split, aten.split_with_sizes.default: _split, aten.chunk.default: _split,
    aten.unbind.int: _unbind, aten.cat.default: _cat, aten.slice.Tensor: _slice, aten.select.int: _select,
    aten.scaled_dot_product_attention.default: _sdpa, aten.embedding.default: _embedding,
    aten.broadcast_tensors.default: _broadcast_tensors, aten.cross_entropy_loss.default: _cross_entropy,
    aten.nll_loss_nd.default: _cross_entropy, aten.nll_loss.default: _cross_entropy,
    **{loss: _elementwise_loss for loss in _ELEMENTWISE_LOSSES},
    **{conv: _conv for conv in CONV_OPS},
    aten.batch_norm.default: _batch_norm, aten._native_batch_norm_legit_functional.default: _batch_norm,
    **{pool: _pool for pool in (aten.max_pool1d.default, aten.max_pool2d.default, aten.max_pool3d.default,
                                aten.max_pool2d_with_indices.default, aten.max_pool3d_with_indices.default,
                                aten.avg_pool1d.default, aten.avg_pool2d.default, aten.avg_pool3d.default,
                                aten.adaptive_avg_pool1d.default, aten.adaptive_avg_pool2d.default,
                                aten.adaptive_avg_pool3d.default, aten.adaptive_max_pool1d.default,
                                aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default)},
    **{up: _pool for up in (aten.upsample_nearest1d.vec, aten.upsample_nearest2d.vec, aten.upsample_nearest3d.vec,
                            aten._upsample_nearest_exact1d.vec, aten._upsample_nearest_exact2d.vec,
                            aten._upsample_nearest_exact3d.vec, aten.upsample_linear1d.vec,
                            aten.upsample_bilinear2d.vec, aten.upsample_trilinear3d.vec, aten.upsample_bicubic2d.vec,
                            aten._upsample_bilinear2d_aa.vec, aten._upsample_bicubic2d_aa.vec)},
    aten.triu.default: lambda n, f: _normalize(n, f, [-1, -2]), aten.tril.default: lambda n, f: _normalize(n, f, [-1, -2]),
    aten.cumsum.default: lambda n, f: _normalize(n, f, [op_args(n)["dim"]]), aten.one_hot.default: _one_hot,
    aten.slice_scatter.default: lambda n, f: _normalize(n, f, [op_args(n)["dim"]]),  # src into self along dim
    aten.select_scatter.default: _select_scatter,
    aten.ones_like.default: _same_labels, aten.zeros_like.default: _same_labels, aten.full_like.default: _same_labels,
    aten.empty_like.default: _same_labels, aten.index.Tensor: _index, aten.pad.default: _pad,
    aten.gather.default: _gather, aten.index_select.default: _index_select,
    aten.constant_pad_nd.default: _pad, aten.cumprod.default: lambda n, f: _normalize(n, f, [op_args(n)["dim"]]),
    aten.logcumsumexp.default: lambda n, f: _normalize(n, f, [op_args(n)["dim"]]),
    aten.flip.default: lambda n, f: _normalize(n, f, op_args(n)["dims"]), aten.roll.default: _roll,
    aten.sort.default: _sorted, aten.sort.stable: _sorted, aten.topk.default: _sorted,
    aten.argsort.default: _sorted, aten.argsort.stable: _sorted,
    aten.scatter_add.default: _accumulate_into, aten.index_add.default: _accumulate_into,
    aten.repeat_interleave.self_int: _repeat_interleave,
    aten.group_norm.default: _group_norm, aten.instance_norm.default: _instance_norm,
    aten.cosine_similarity.default: _cosine_similarity, aten.cdist.default: _cdist,
    aten.expand_as.default: _pointwise,
}


_LINEAR_UNARY = {
    aten.neg.default, aten.mul.Scalar, aten.div.Scalar, aten.view.default, aten.reshape.default,
    aten._unsafe_view.default, aten.flatten.using_ints, aten.unflatten.int, aten.transpose.int, aten.t.default, aten.permute.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default,
    aten.contiguous.default, aten.clone.default, aten.alias.default, aten._to_copy.default, aten.to.dtype,
    aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default,
}


def linear_inputs(node: torch.fx.Node) -> tuple[tuple[int, ...], ...]:
    """The ``OpSignature.linear_in`` of ``node``: sum and difference of two distinct tensors are
    linear in both jointly, a product in either factor, a quotient in its numerator, the ops of
    ``_LINEAR_UNARY`` (and ``* c``, ``/ c`` by a number) in their one tensor. ``x + c`` by a
    number is affine, ``x * x`` quadratic: neither passes a partial sum through."""
    t, args = node.target, node.args
    tensors = [a for a in args[:2] if isinstance(_val(a), torch.Tensor)]
    distinct = len(tensors) == len(set(tensors)) == len(_tensor_inputs(node))
    if t in (aten.add.Tensor, aten.sub.Tensor):
        return ((0, 1),) if len(tensors) == 2 and distinct else ()
    if t is aten.mul.Tensor:
        return tuple((i,) for i in range(len(tensors))) if distinct else ()
    if t is aten.div.Tensor:
        return ((0,),) if distinct and args[0] is tensors[0] else ()
    return ((0,),) if t in _LINEAR_UNARY and len(_tensor_inputs(node)) == 1 else ()


# functional ops whose rule also holds for their in-place variant (``x.tril_()``: the same arguments,
# the result written into ``self``, of ``self``'s shape); pointwise ones need no entry
_INPLACE_OF = {aten.tril.default, aten.triu.default, aten.cumsum.default, aten.cumprod.default, aten.fill.Tensor,
               aten.fill.Scalar, aten.masked_fill.Tensor}


def _rule(target):
    """The rule of an op: its entry of ``_TABLE``, ``_pointwise`` for an op tagged pointwise, or
    for an in-place op without either (``masked_fill_``, ``gelu_``, ``threshold_``, ``eq_``,
    ``tril_``, ``cumsum_``: torch tags most in-place variants ``inplace`` only, so MHA's
    ``key_padding_mask`` fill ran replicated and microbatches were reported to change the loss)
    the rule of its functional op when that one is pointwise or in ``_INPLACE_OF``. Not in-place
    views (``t_``, ``squeeze_``) or ``addmm_`` (a bias added after the reduction is ``self``)."""
    rule = _TABLE.get(target)
    if rule is not None or not isinstance(target, torch._ops.OpOverload):
        return rule
    if torch.Tag.pointwise in target.tags:
        return _pointwise
    name = target._schema.name.split("::")[-1]
    if torch.Tag.inplace not in target.tags or not name.endswith("_") or target.is_view:
        return None
    functional = getattr(getattr(aten, name[:-1], None), target._overloadname, None)
    if functional is None or written_args(functional):
        return None
    if torch.Tag.pointwise in functional.tags or functional in _INPLACE_OF:
        return _rule(functional)
    return None


def signature(node: torch.fx.Node) -> OpSignature | None:
    """The label signature of ``node``, or None when alpa-lite has no generator for its op
    (the node then runs replicated)."""
    fresh = _Fresh()
    rule = _rule(node.target)
    if rule is None or not isinstance(_val(node), (torch.Tensor, tuple, list)):
        return None
    if not all(isinstance(_val(n), torch.Tensor) for n in _tensor_inputs(node)):
        return None
    sig = rule(node, fresh)
    if sig is None or len(sig.inputs) != len(_tensor_inputs(node)):
        return None
    sig.linear_in = linear_inputs(node)
    return sig


HEAVY_TARGETS = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default, aten.linear.default,
                 aten.matmul.default, aten.einsum.default, aten.scaled_dot_product_attention.default} | CONV_OPS
"""Compute-heavy ops (matmul, convolution, einsum, attention): ``PlanOptions.allow_replicated_heavy_ops``."""

STAT_TARGETS = {aten.cross_entropy_loss.default, aten._native_batch_norm_legit_functional.default}
"""The ops whose rules may share statistics (``OpSignature.stats``)."""


def stat_reductions(sig: OpSignature, in_specs, in_shapes, itemsize: int, mesh_shape
                    ) -> list[tuple[str, tuple[int, ...], float]]:
    """The all-reduces of the statistics (``OpSignature.stats``) of a strategy whose operands
    arrive in ``in_specs`` (global ``in_shapes``): ``(phase, mesh axes, bytes per device)``,
    one per statistic of a split dim, over the devices of all the axes it is split along (one
    collective, as the local variant issues it)."""
    axes_of, local = {}, {}
    for labs, spec, shape in zip(sig.inputs, in_specs, in_shapes):
        for lab, entry, size in zip(labs, spec.dims, shape):
            axes_of.setdefault(lab, entry)
            local.setdefault(lab, size // math.prod(mesh_shape[a] for a in entry))
    return [(phase, tuple(axes_of[lab]), float(itemsize * math.prod(local[lab] for lab in labs)))
            for lab, stats in sig.stats.items() for phase, labs in stats if axes_of.get(lab)]


def flops(node: torch.fx.Node, sig: OpSignature | None) -> float:
    """Forward FLOPs of ``node``: 2 x product of all label sizes for contractions (matmul,
    einsum, conv), else one per result element."""
    sizes: dict[str, int] = {}
    ins = _tensor_inputs(node)
    if sig is not None:
        for labs, n in zip(sig.inputs, ins):
            for lab, s in zip(labs, _shape(n)):
                sizes[lab] = max(sizes.get(lab, 1), s)
        if node.target in CONV_OPS:
            a = op_args(node)
            w = _shape(a["weight"])
            per_element = math.prod(w[1:])  # MACs per output element; per input element if transposed
            return 2.0 * _val(a["input"] if is_transposed_conv(node.target, a) else node).numel() * per_element
        if node.target is aten.scaled_dot_product_attention.default:
            a = op_args(node)
            b, h, s, d = _shape(a["query"])
            t = _shape(a["key"])[2]
            return 4.0 * b * h * s * t * d
        if sig.contraction and node.target in _TABLE and _TABLE[node.target] in (_mm, _bmm, _linear, _matmul, _einsum, _mv, _vdot) \
                or node.target in (aten.addmm.default, aten.baddbmm.default, aten.addmv.default):
            return 2.0 * math.prod(sizes.values())
    val = _val(node)
    if isinstance(val, torch.Tensor):
        return float(max(val.numel(), max((_val(n).numel() for n in ins), default=0)))
    return 0.0
