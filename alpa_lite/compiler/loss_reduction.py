"""How a captured loss reduces over the batch (``LossReduction``), read from its graph.

The captured graph is read back from the loss node through affine scalar ops (add, sub, mul
or div by a value that does not depend on the batch, such as a 0-dim input, neg, casts) to its *leaves*, the nodes that reduce a per-sample tensor over the batch: a sum, a
mean, a loss op, or a quotient of two batch sums (a hand-written masked token mean
``(x * m).sum() / m.sum()``). A batch sum divided by the number the batch's rows had at capture
is a batch mean: export bakes ``x.size(0)`` into the graph as that number (``kl_div``'s
``"batchmean"``, ``loss.sum() / len(x)``), and a microbatch's graph holds the microbatch's size.
So is one batch sum divided by the number of elements it adds up (``loss.sum() / y.numel()``,
``/ (B * T)``: the microbatch's ``B x T`` in its graph).
Their kinds fix how microbatch losses combine:
``sum`` (add them), ``mean`` (average them) or ``ratio`` (weigh each by its denominator).
What cannot be combined exactly (a nonlinear function of a batch statistic such as an MoE
load-balancing loss, batch-norm statistics, terms of different kinds, a buffer the forward
writes such as a step counter: K writes per step) is reported in
``LossReduction.problems``; the planner warns with them when it cuts microbatches.
What microbatches cannot run at all, an index into the batch's rows whose values come from the
batch's inputs (mixup's ``x[perm]`` with ``perm`` an input), is refused by ``check_batch_indices``.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx

from ..core.aten import bind_args, stats_written
from ..core.capture import batch_specialization, shape_of
from ..core.losses import RATIO_OPS, SUM, LossReduction
from ..core.mesh import LogicalMesh
from .ops import signature
from .strategies import build_strategies

aten = torch.ops.aten
# loss ops whose "mean" divides by a count fixed by the shapes (elements or samples): a mean over equal parts
_MEAN_OPS = {aten.mse_loss.default, aten.l1_loss.default, aten.smooth_l1_loss.default, aten.huber_loss.default,
             aten.binary_cross_entropy.default, aten.binary_cross_entropy_with_logits.default,
             aten.soft_margin_loss.default, aten.kl_div.default, aten.multi_margin_loss.default,
             aten.multilabel_margin_loss.default, aten.triplet_margin_loss.default,
             aten.cosine_embedding_loss.default, aten.margin_ranking_loss.default,
             aten.hinge_embedding_loss.default, aten.poisson_nll_loss.default}
_REDUCTIONS = {aten.sum.default: "sum", aten.sum.dim_IntList: "sum", aten.mean.default: "mean",
               aten.mean.dim: "mean"}
# scalar ops that are linear in their (first) operand
_LINEAR = {aten.neg.default, aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.clone.default,
           aten.alias.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
           aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default,
           aten.contiguous.default, aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim,
           aten.expand.default, aten.type_as.default}
# in-place arithmetic on the loss (HF's ``loss += coef * aux_loss``, ``loss /= n``) is read as its out-of-place op
_INPLACE = {aten.add_.Tensor: aten.add.Tensor, aten.add_.Scalar: aten.add.Scalar, aten.sub_.Tensor: aten.sub.Tensor,
            aten.sub_.Scalar: aten.sub.Scalar, aten.mul_.Tensor: aten.mul.Tensor, aten.mul_.Scalar: aten.mul.Scalar,
            aten.div_.Tensor: aten.div.Tensor, aten.div_.Scalar: aten.div.Scalar, aten.neg_.default: aten.neg.default}
_IDEMPOTENT_WRITES = {aten.embedding_renorm.default}
_BATCH_NORMS = {aten.batch_norm.default, aten._native_batch_norm_legit_functional.default,
                aten.native_batch_norm.default, aten._native_batch_norm_legit.default}
# ops that take some of the rows of their operand's dim: on the batch dim, part of the batch
_CUTS = {aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.select.int,
         aten.narrow.default}
_VIEWS = {aten.unsqueeze.default, aten.view.default, aten.reshape.default, aten.expand.default}  # same values
_ARANGES = {aten.arange.default, aten.arange.start, aten.arange.start_step}
# ops that regroup the elements of their operand in order (row-major): they mix no samples
_RESHAPE_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
                aten.unflatten.int}
# ops that read or write their first operand at positions an integer tensor gives (every overload):
# along ``dim``, along the dims of the given ``indices`` (``x[i, :, j]``), or flat (``take``,
# ``take_along_dim`` without ``dim``). An index into the batch's rows is right per microbatch
_INDEX_OPS = {aten.index, aten._unsafe_index, aten.index_select, aten.gather, aten.take, aten.take_along_dim,
              aten.index_put, aten.index_put_, aten._unsafe_index_put, aten.scatter, aten.scatter_, aten.scatter_add,
              aten.scatter_add_, aten.scatter_reduce, aten.scatter_reduce_, aten.index_add, aten.index_add_,
              aten.index_copy, aten.index_copy_, aten.index_fill, aten.index_fill_, aten.index_reduce,
              aten.index_reduce_}
# of those, the ones whose result is their first operand written at the index: its rows are the result's
_INDEX_WRITES = {aten.index_put, aten.index_put_, aten._unsafe_index_put, aten.scatter, aten.scatter_,
                 aten.scatter_add, aten.scatter_add_, aten.scatter_reduce, aten.scatter_reduce_, aten.index_add,
                 aten.index_add_, aten.index_copy, aten.index_copy_, aten.index_fill, aten.index_fill_,
                 aten.index_reduce, aten.index_reduce_}
# ops whose result depends on an operand's shape only, not on its values
_SHAPE_ONLY = {aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
               aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default,
               aten.sym_size.int}


def loss_reduction(cg, table: dict | None = None) -> LossReduction:
    """Read how ``cg``'s loss reduces over the batch (module docstring).

    Args:
        cg: a ``CapturedGraph``.
        table: ``build_strategies`` of ``cg`` on any mesh, for the batch dim of each node (the
            same on every mesh); None: one is built on a 1x1 mesh.

    Returns:
        the ``LossReduction``; a loss with no batch leaf (or only problems) is ``"mean"``.
    """
    return _Reader(cg, table if table is not None else build_strategies(cg, LogicalMesh((1, 1)))).result()


def whole_batch_problems(whole, part, whole_rows: int, part_rows: int, found) -> list[str]:
    """What cutting a batch of ``whole_rows`` rows (graph ``whole``) into microbatches of
    ``part_rows`` rows (graph ``part``) changes that ``found`` (``loss_reduction(part).problems``)
    does not say: the microbatch computing other ops (``core.capture.batch_specialization``: a
    branch on the batch size), groups of rows the whole batch's graph makes that a microbatch cuts
    (the zoo MoE routes tokens in groups of 64, 4 rows of 16 tokens, and drops them per group over
    its capacity: 8 one-row microbatches trained 9.1e-3 off one process's loss, silently, as a
    one-row graph has no rows to combine), and, where the microbatch's graph shows no problem,
    those of the whole batch's."""
    branch = batch_specialization(whole, part, whole_rows, part_rows)
    reader = _Reader(whole, build_strategies(whole, LogicalMesh((1, 1))))
    out = [branch] if branch else []
    if reader.grouped and part_rows % reader.grouped[1]:
        what, unit = reader.grouped
        out.append(f"{what} holds the batch's {whole_rows} rows in groups of {unit} (a reshape that merges rows, "
                   f"such as tokens routed in groups): microbatches of {part_rows} rows cut those groups, so they "
                   f"compute other groups than the whole batch")
    return out + ([] if found else list(reader.result().problems))


def check_batch_indices(cg, what: str, table: dict | None = None) -> None:
    """Refuse to cut ``cg``'s batch into microbatches (``what``: a pipeline's, ``accumulate=K``)
    when an index op picks or writes rows of the batch (``x[perm]``, ``index_select(0, perm)``,
    ``gather(0, idx)``, ``take_along_dim``; ``index_add`` / ``index_copy`` / ``index_fill`` /
    ``index_reduce``, ``x[perm] = v``, ``scatter`` / ``scatter_add`` / ``scatter_reduce``: every
    op of ``_INDEX_OPS``, with a sharding rule or not) with index values read from the batch's inputs. They number rows of the
    whole batch (mixup's permutation given as an input), while a microbatch holds rows
    ``[m n, (m + 1) n)`` numbered from 0: its index points past its rows (an ``IndexError`` on the
    stage running it while the others wait) or at other rows. An index made in forward
    (``torch.randperm(x.shape[0])``, an ``argsort`` over the batch) numbers the microbatch's own
    rows; splitting the batch over devices (data parallel) keeps the indexed dim whole.
    ``table`` as for ``loss_reduction``.

    Raises:
        ValueError: naming each such op and the input its indices come from, and what to do.
    """
    found = _Reader(cg, table if table is not None else build_strategies(cg, LogicalMesh((1, 1)))).indices
    if found:
        raise ValueError(f"{what} cannot cut this batch: {'; '.join(found)}. These indices number the rows of the "
                         "whole batch, but each microbatch holds only its own rows, numbered from 0, so they point past "
                         "them or at other rows (mixup's x[perm] with perm an input). Make the index in forward from "
                         "the rows it sees (torch.randperm(x.shape[0])), or train without microbatches "
                         "(num_microbatches=1, accumulate=1; a data-parallel plan indexes the whole batch)")


class _Reader:
    def __init__(self, cg, table):
        self.cg = cg
        self.batch = {n: ns.batch_dims[0] for n, ns in table.items()}  # the dim of per-sample rows
        # depends on the batch's values; an input without a batch dim (a 0-dim count such as HF's
        # ``num_items_in_batch``, a temperature) is passed whole to every microbatch: a constant here
        self.depends: dict[str, bool] = {}
        self.mixed: dict[str, str | None] = {}  # first op upstream that combines samples (a message)
        self.counts: dict[str, bool] = {}  # an integer arange over the batch's rows (an index)
        self.counted: dict[str, bool] = {}  # values made from one (an embedding of it, a float cast)
        self.parts: dict[str, int | None] = {}  # blocks of the batch's rows stacked along its dim (_parts)
        self.merged: dict[str, tuple[int, int]] = {}  # the batch merged into a dim as a minor factor (_merge)
        self.problems: list[str] = []
        self.indices: list[str] = []  # check_batch_indices
        self.grouped: tuple[str, int] | None = None  # the first node holding several rows per index of its batch dim
        rows = {shape_of(cg.node(n))[self.batch[n]] for n in cg.input_names if self.batch.get(n) is not None}
        self.rows = rows.pop() if len(rows) == 1 else None  # the batch size the graph was captured at
        for node in cg.graph.nodes:
            ins = node.all_input_nodes
            self.depends[node.name] = (node.name in cg.input_names and self.batch.get(node.name) is not None) or (
                node.target not in _SHAPE_ONLY and any(self.depends[i.name] for i in ins))
            upstream = next((self.mixed[i.name] for i in ins if self.mixed[i.name]), None)
            sig = signature(node) if node.op == "call_function" else None
            self.parts[node.name] = self._parts(node)
            self._merge(node, sig)
            b = self.batch.get(node.name)
            if self.grouped is None and self.rows and b is not None and shape_of(node) and shape_of(node)[b] < self.rows:
                size = shape_of(node)[b]  # a reshape of rows into groups (tokens routed in groups of several rows)
                self.grouped = (f"{node.name} ({node.target})", self.rows // size if self.rows % size == 0 else self.rows)
            self.mixed[node.name] = upstream or self._mixes(node, sig)
            self.counts[node.name] = not self.depends[node.name] and (
                node.target in _ARANGES and shape_of(node) == (self.rows,) or node.target in _LINEAR
                and bool(ins) and self.counts[ins[0].name] and not _floating(node))
            self.counted[node.name] = not self.depends[node.name] and (
                any(self.counted[i.name] for i in ins) or bool(ins) and (
                    node.target is aten.embedding.default and self.counts[node.args[1].name]
                    or node.target in _LINEAR and self.counts[ins[0].name] and _floating(node)))
            self._row_positions(node, sig)
            self._batch_index(node)

    def _position(self, x) -> tuple[int, int] | None:
        """Where the batch's rows are in ``x``: ``(dim, inner)``, the batch a factor of dim ``dim``
        whose index is ``(outer * rows + row) * inner + i``; None without rows."""
        b = self.batch.get(x.name)
        if b is not None:
            shape = shape_of(x)
            return (b, shape[b] // self.rows) if shape and self.rows and shape[b] % self.rows == 0 else None
        return self.merged.get(x.name)

    def _merge(self, node, sig) -> None:
        """The batch's rows through an op that merges them into a dim with others (MHA's
        ``(T, B H, d) -> (T B, E)`` reshape: the batch is no dim of its own there, and ops on that
        dim row by row, the output projection, keep it so; a later reshape ``(T B, E) -> (T, B, E)``
        gives it back). The strategies' batch dims follow only a dim the mesh can split (the major
        factor of a merge), so the reader follows the rest itself (``merged``), and a reshape or an
        op that keeps such a dim, its label, whole: before, the merge read as "reduces over the
        batch", a false microbatch warning for every ``nn.MultiheadAttention``."""
        reshape = node.target in _RESHAPE_OPS and self.rows == 1  # the table guesses where a row of 1 goes
        if self.batch.get(node.name) is not None and not reshape or not self.rows or node.op != "call_function" \
                or sig is None:
            return
        out_shape = shape_of(node)
        if out_shape is None or len(sig.outputs) != 1:
            return
        if node.target in _RESHAPE_OPS:
            x = node.args[0]
            pos = self._position(x) if isinstance(x, torch.fx.Node) and self.depends[x.name] else None
            if pos is None:
                return
            stride = pos[1] * math.prod(shape_of(x)[pos[0] + 1:])  # of a row in the flat (row-major) index
            found = [(stride // step, j) for j, step in ((j, math.prod(out_shape[j + 1:])) for j in range(len(out_shape)))
                     if stride % step == 0 and (step * out_shape[j]) % (stride * self.rows) == 0]
            # a row of 1 fits several dims: a dim of its own (its size, its stride) first; then one it
            # is a minor factor of, as a batch of several rows would be ((T, 1 H, d) -> (T 1, E): T,
            # not E, whose major factor it also is); else the one it is the major factor of ((1, T, V)
            # -> (T, V): T)
            found.sort(key=lambda f: 0 if out_shape[f[1]] == self.rows and f[0] == 1 else
                       1 if f[0] * self.rows < out_shape[f[1]] else 2)
            inner, j = found[0] if found else (None, None)
            own = inner is not None and inner * self.rows == out_shape[j]  # the major factor: its own dim
            self.batch[node.name] = j if own else None
            if inner is not None and not own:
                self.merged[node.name] = (j, inner)
            return
        for labels, i in zip(sig.inputs, node.all_input_nodes):  # a merged batch, or one a reshape gave back
            pos = self._position(i) if self.depends[i.name] else None
            if pos is None or pos[0] >= len(labels):
                continue
            lab = labels[pos[0]]
            if lab not in sig.outputs[0]:
                return  # reduces that dim (_mixes); one it keeps whole (a softmax) combines its rows
            j = sig.outputs[0].index(lab)
            if out_shape[j] == shape_of(i)[pos[0]]:
                if pos[1] * self.rows == out_shape[j]:
                    self.batch[node.name] = j
                else:
                    self.merged[node.name] = (j, pos[1])
            return

    def _batch_index(self, node) -> None:
        """``check_batch_indices``: ``node`` (an op of ``_INDEX_OPS``, with a sharding rule or
        without) indexes the batch dim of its first operand with integer values from a batched input
        (not made by an op that combines samples, such as an argsort). The first operand of a write
        (``index_add``, ``scatter``, ``x[perm] = v``) may be made in forward without the batch
        (``torch.zeros(B, H)``): its rows are then the result's."""
        if not _is_index(node) or not isinstance(node.args[0], torch.fx.Node):
            return
        x = node.args[0]
        b = self.batch.get(x.name)
        if b is None and node.target.overloadpacket in _INDEX_WRITES:
            b = self.batch.get(node.name)
        for i in _row_indices(node, b):
            if not isinstance(i, torch.fx.Node):
                continue
            val = i.meta.get("val")
            if not (self.depends[i.name] and isinstance(val, torch.Tensor) and not val.is_floating_point()
                    and val.dtype != torch.bool and not self.mixed[i.name]):
                continue
            source = next(n for n in _upstream(i) if n.name in self.cg.input_names and self.batch.get(n.name) is not None)
            self.indices.append(
                f"{node.name} ({node.target}) {'writes' if node.target.overloadpacket in _INDEX_WRITES else 'picks'} "
                f"rows of the batch with indices from input {source.name} (tensor "
                f"input {self.cg.input_names.index(source.name)} of the call)")
            return

    def _row_positions(self, node, sig) -> None:
        """A value made without the batch (``torch.arange(x.shape[0])``, an embedding of it) meeting
        the batch's rows along their dim numbers the rows of the microbatch: each microbatch
        restarts it. As an index into the batch (``x[torch.arange(B), i]``) it stays right."""
        if sig is None or _is_index(node) or node.target in RATIO_OPS or not self.rows or self.rows < 2:
            return
        rows = {labels[self.batch[i.name]] for labels, i in zip(sig.inputs, node.all_input_nodes)
                if self.depends[i.name] and self.batch.get(i.name) is not None and self.batch[i.name] < len(labels)}
        for labels, i in zip(sig.inputs, node.all_input_nodes):
            shape = shape_of(i)
            if self.depends[i.name] or not self.counted[i.name] or shape is None:
                continue
            if any(lab in rows and d < len(shape) and shape[d] == self.rows for d, lab in enumerate(labels)):
                self.problems.append(f"{i.name} ({i.target}) numbers the rows of the batch (torch.arange over "
                                     f"the batch) and {node.name} ({node.target}) meets it with the batch's rows: "
                                     "each microbatch numbers its own rows from 0")
                self.counted[i.name] = False  # once

    def _mixes(self, node, sig) -> str | None:
        """Why ``node`` combines samples of the batch (a message), or None."""
        row_ins = [i for i in node.all_input_nodes if self._rows(i) and self.depends[i.name]]
        if not row_ins or node.target in _SHAPE_ONLY:
            return None
        what = f"{node.name} ({node.target})"
        if node.target in _BATCH_NORMS and bind_args(node.target, node.args, node.kwargs)["training"]:
            return f"{what} normalizes with statistics over the batch"
        if node.target is aten.instance_norm.default and stats_written(node):
            return f"{what} updates its running statistics with the mean of the batch's instance statistics"
        if node.target is aten.embedding.default and bind_args(node.target, node.args, node.kwargs)["scale_grad_by_freq"]:
            return (f"{what} divides each row's gradient by the row's count in the batch's indices "
                    "(scale_grad_by_freq): a microbatch counts its own")
        if self._row_pick(node):
            return None
        if not self._rows(node):
            return (f"{what} reduces over the batch" if sig is not None else
                    f"{what} has no sharding rule, so alpa-lite cannot tell whether it combines samples")
        if node.target in (aten.cat.default, aten.slice.Tensor) and self.parts[node.name]:
            return None
        at_rows = set()  # the labels of the operands' batch dims
        for labels, i in zip(sig.inputs if sig is not None else (), node.all_input_nodes):
            b = self.batch.get(i.name)
            if b is None and i.name in self.merged:
                b = self.merged[i.name][0]
            if b is not None and b < len(labels) and labels[b] in sig.fixed and node.target in _CUTS:
                return (f"{what} cuts the batch dim into parts: each microbatch cuts its own rows so, and its parts "
                        f"pair or pick other rows than the whole batch's (chosen rows then rejected rows, DPO's "
                        f"logp[:B // 2] - logp[B // 2:], fall into different microbatches)")
            if b is not None and b < len(labels) and labels[b] in sig.fixed:
                return f"{what} combines the samples of the batch"
            if b is not None and b < len(labels) and self.depends[i.name]:
                at_rows.add(labels[b])
        if len(at_rows) > 1:  # a @ b.T over the batch: in-batch negatives, a Gram matrix of the samples
            return f"{what} pairs the samples of the batch with each other"
        return None

    def _parts(self, node) -> int | None:
        """How many blocks of the batch's rows ``node`` holds along its batch dim, in order: a
        ``torch.cat`` of batched tensors along their batch dim (chosen and rejected rows given as two
        inputs, TRL's concatenated forward) stacks their blocks, a slice at whole blocks
        (``logp[:n]``, ``n`` the rows) takes some back: a microbatch stacks and takes the same
        blocks of its own rows. None: a cat or slice of the batch dim that does neither."""
        b = self.batch.get(node.name)
        ins = [i for i in node.all_input_nodes if self.batch.get(i.name) is not None and self.depends[i.name]]
        if node.target not in (aten.cat.default, aten.slice.Tensor) or b is None:
            return max((self.parts[i.name] or 1 for i in ins), default=1)
        if not self.rows:
            return None
        a = bind_args(node.target, node.args, node.kwargs)
        x = node.args[0][0] if node.target is aten.cat.default else node.args[0]
        if a["dim"] % len(shape_of(x)) != self.batch[x.name]:
            return max((self.parts[i.name] or 1 for i in ins), default=1)  # along another dim
        if node.target is aten.cat.default:
            if any(i not in ins or self.batch[i.name] != b or not self.parts[i.name]
                   or shape_of(i)[b] != self.parts[i.name] * self.rows for i in node.args[0]):
                return None
            return sum(self.parts[i.name] for i in node.args[0])
        size = shape_of(x)[b]
        start, end = (min(max(0, i + size if i < 0 else i), size) for i in (a["start"] or 0, size if a["end"] is None
                                                                              else a["end"]))
        if x not in ins or not self.parts[x.name] or a["step"] != 1 or start % self.rows or end % self.rows:
            return None
        return (end - start) // self.rows or None

    def _row_pick(self, node) -> bool:
        """``x[arange(B)[:, None], j]``: an index whose tensor along ``x``'s batch dim numbers the
        batch's rows in order (HF's attention-mask functions), so row ``r`` of the result is read
        from row ``r`` of ``x``: per sample, in a microbatch as in the whole batch."""
        if node.target is not aten.index.Tensor:
            return False
        x, idx = node.args[:2]
        b = self.batch.get(x.name)
        at = idx[b] if b is not None and b < len(idx) else None
        while isinstance(at, torch.fx.Node) and at.target in _VIEWS:
            at = at.args[0]
        return isinstance(at, torch.fx.Node) and at.target is aten.arange.default and shape_of(at) == (self.rows,) \
            and all(i is None or not self.depends[i.name] for i in idx)

    def result(self) -> LossReduction:
        self._buffer_writes()
        leaves = self._terms(self.cg.node(self.cg.loss_name))
        kinds = {leaf for leaf in leaves if leaf != "const"}
        if len(kinds) > 1:
            self.problems.append(f"the loss adds terms reduced differently over the batch ({_names(kinds)})")
            return LossReduction("mean", None, tuple(self.problems))
        kind = next(iter(kinds), ("mean", None))
        if kind[0] == "sum" and "const" in leaves:
            self.problems.append("the summed loss has a term that does not depend on the batch: it would count "
                                 "once per microbatch")
        return LossReduction(kind[0], kind[1], tuple(self.problems))

    def _buffer_writes(self) -> None:
        """A buffer the forward writes (a step counter ``self.steps += 1``, an EMA), or a parameter
        it writes under ``no_grad``, is written once per microbatch: K times per step. Batch-norm
        statistics are reported by their op."""
        writers = {}
        for name, fqn in sorted(self.cg.buffer_mutations.items()):
            node = self.cg.node(name)
            while node.target is operator.getitem:
                node = node.args[0]
            writers[fqn] = (name, node)
        norms = {fqn.rpartition(".")[0] for fqn, (_, node) in writers.items() if node.target in _BATCH_NORMS}
        for fqn, (name, node) in writers.items():  # a batch norm's num_batches_tracked is its own too
            if fqn.rpartition(".")[0] not in norms:
                self.problems.append(f"buffer {fqn!r} is written in forward ({name}, {node.target}): once per "
                                     "microbatch, so several times per step")
        # a parameter written in forward under no_grad (a frozen EMA teacher, BYOL / DINO: t.mul_(m).add_(s,
        # alpha=1 - m); a decay): K times per step too (sweep 8: a 2-stage pipeline of 2 microbatches
        # trained such a teacher silently off one process). max_norm's renorm is not named: it
        # rescales only the rows a microbatch looks up, to the same norm however often it runs
        fqns = {**self.cg.param_fqns, **self.cg.buffer_fqns}  # a frozen parameter is held with the buffers
        for name, ph in sorted(self.cg.param_mutations.items()):
            target = self.cg.node(name).target
            if target not in _IDEMPOTENT_WRITES:
                self.problems.append(f"parameter {fqns[ph]!r} is written in forward ({name}, {target}): "
                                     "once per microbatch, so several times per step")

    def _terms(self, node) -> list:
        """The leaves of the affine expression ``node``: ``(kind, denominator)`` or ``"const"``."""
        if not isinstance(node, torch.fx.Node) or not self.depends[node.name]:
            return ["const"]
        t, args = _INPLACE.get(node.target, node.target), node.args
        if self._rows(node):  # still per sample: the loss reduces it later, or it is not a loss
            return self._nonlinear(node)
        if node.op == "placeholder":
            return self._nonlinear(node)
        if t in _REDUCTIONS or t in RATIO_OPS or t in _MEAN_OPS:
            leaf = self._leaf(node)
            if leaf is not None:
                return [leaf]
        if t in _LINEAR:
            return self._terms(args[0])
        if t in (aten.stack.default, aten.cat.default):  # losses stacked to be summed or averaged:
            return [leaf for a in args[0] for leaf in self._terms(a)]  # torch.stack(chunk_losses).sum()
        if t in (aten.add.Tensor, aten.sub.Tensor, aten.add.Scalar, aten.sub.Scalar):
            # a zero is no term: a loss summed in a loop from ``total = 0.0`` (a chunked
            # cross-entropy, sweep 12: ``(0.0 + ce_1 + ... + ce_4) / n_valid`` read as nonlinear, a
            # pipeline and accumulate=2 averaged its microbatches' ratios under a false warning)
            return [leaf for a in args[:2] if not self._zero(a) for leaf in self._terms(a)]
        if t in (aten.mul.Tensor, aten.mul.Scalar):
            a, b = args[:2]
            if not self._depends(b):
                return self._terms(a)
            if not self._depends(a):
                return self._terms(b)
            return self._nonlinear(node)
        if t in (aten.div.Tensor, aten.div.Scalar):
            return self._quotient(node, *args[:2])
        return self._nonlinear(node)

    def _zero(self, a) -> bool:
        """Whether ``a`` is a zero that no batch changes: a Python 0, ``torch.zeros`` /
        ``new_zeros`` / ``zeros_like`` / a ``full`` of 0, or a tensor literal of zeros
        (``torch.tensor(0.0)``, a lifted constant), through copies and casts. A chunked loss summed
        from ``torch.zeros(())`` over ``y.numel()`` was read as a sum with "a term that does not
        depend on the batch" (after sweep 12): 2 microbatches gave twice the loss."""
        while isinstance(a, torch.fx.Node) and not self.depends[a.name] and (
                a.target in _LINEAR or a.target in (aten.lift_fresh_copy.default, aten.detach.default,
                                                    aten.detach_.default)):
            a = a.args[0]
        if isinstance(a, (int, float)):
            return a == 0
        if not isinstance(a, torch.fx.Node) or self.depends[a.name]:
            return False
        if a.target in (aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default):
            return True
        if a.target in (aten.full.default, aten.full_like.default, aten.new_full.default):
            return bind_args(a.target, a.args, a.kwargs)["fill_value"] == 0
        value = self.cg.constants.get(a.name)
        return value is not None and not bool(value.any())

    def _leaf(self, node):
        """``(kind, denominator)`` of a node reducing a per-sample operand over the batch, or None."""
        x = node.args[0]
        if not (isinstance(x, torch.fx.Node) and self._rows(x) and self.depends[x.name]):
            return None
        if self.mixed[x.name]:
            self.problems.append(f"{self.mixed[x.name]}: per microbatch it differs from the whole batch")
        t = node.target
        if t in _REDUCTIONS:
            return (_REDUCTIONS[t], None)
        reduction = bind_args(t, node.args, node.kwargs)["reduction"]
        if reduction == SUM:
            return ("sum", None)
        return ("ratio", node.name) if t in RATIO_OPS else ("mean", None)

    def _quotient(self, node, a, b) -> list:
        if not self._depends(b):
            num = self._terms(a)
            if num and all(leaf == ("sum", None) for leaf in num) and (
                    b == self.rows or b == self._summed_total(a)):
                return [("mean", None)]  # sum / x.size(0), sum / x.numel(): a batch mean
            return num
        num, den = self._terms(a), self._terms(b)
        if (len(den) == 1 and den[0] != "const" and den[0][0] in ("sum", "mean") and b.name not in self.cg.requires_grad
                and all(leaf != "const" and leaf[0] == den[0][0] for leaf in num)):
            return [("ratio", b.name)]
        return self._nonlinear(node)

    def _summed_total(self, node) -> int | None:
        """How many per-sample elements the batch sums of the affine expression ``node`` add up
        together: ``_summed_elements`` of one, or of each term of a sum of them (chunks of a
        cross-entropy, ``(ce(chunk_1, "sum") + ce(chunk_2, "sum")) / y.numel()``, also added from a
        zero (``_zero``) or stacked: ``torch.stack(chunks).sum()``), or None."""
        if not isinstance(node, torch.fx.Node):
            return None
        t = _INPLACE.get(node.target, node.target)
        stacked = (aten.stack.default, aten.cat.default)
        while node.args and self._depends(node.args[0]) and (
                t in _LINEAR and not self._rows(node.args[0]) and node.args[0].target not in stacked
                or t in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar)
                and len(node.args) > 1 and not self._depends(node.args[1])):
            node = node.args[0]  # a scaling (0.1 * sq) or a cast of the sums
            t = _INPLACE.get(node.target, node.target)
        if t in (aten.add.Tensor, aten.add.Scalar) and node.kwargs.get("alpha", 1) == 1:
            parts = [a for a in node.args[:2] if not self._zero(a)]
        elif t in stacked:
            parts = list(node.args[0])
        elif t in (aten.sum.default, aten.sum.dim_IntList) and isinstance(node.args[0], torch.fx.Node) \
                and not self._rows(node.args[0]) and node.args[0].target in stacked:
            parts = [node.args[0]]
        else:
            return self._summed_elements(node)
        counts = [self._summed_total(a) for a in parts]
        return None if not counts or None in counts else sum(counts)

    def _summed_elements(self, node) -> int | None:
        """How many per-sample elements the one batch sum of the affine expression ``node`` adds
        up, or None: ``x.sum()`` (also ``x.sum(-1).sum()``) of ``x.numel()``, a loss op's
        ``reduction="sum"`` of one per target (``cross_entropy``, ``nll``) or per element (``mse``
        ...). Divided by that number it is a mean over every element: export bakes
        ``x.numel()`` (``B * T``) in as the number a microbatch's graph holds, as ``x.size(0)``."""
        while isinstance(node, torch.fx.Node) and self._depends(node) and not self._rows(node):
            t, args = _INPLACE.get(node.target, node.target), node.args
            x = args[0] if args else None
            if isinstance(x, torch.fx.Node) and self._rows(x) and (t in _REDUCTIONS or t in RATIO_OPS
                                                                    or t in _MEAN_OPS):
                if t in RATIO_OPS:
                    x = bind_args(t, node.args, node.kwargs)["target"]
                while x.target in (aten.sum.dim_IntList, aten.sum.default) and self._rows(x.args[0]):
                    x = x.args[0]
                shape = shape_of(x)
                return None if shape is None else math.prod(shape)
            if t in _LINEAR or t in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar) and \
                    len(args) > 1 and not self._depends(args[1]):
                node = x
                continue
            return None
        return None

    def _rows(self, x) -> bool:
        return self.batch.get(x.name) is not None or x.name in self.merged

    def _depends(self, x) -> bool:
        return isinstance(x, torch.fx.Node) and self.depends[x.name]

    def _nonlinear(self, node) -> list:
        self.problems.append(f"{node.name} ({node.target}) is not a sum, mean or ratio of batch reductions: "
                             "the loss is a nonlinear function of the batch")
        return []


def _is_index(node) -> bool:
    return node.op == "call_function" and getattr(node.target, "overloadpacket", None) in _INDEX_OPS


def _row_indices(node, b: int | None) -> list:
    """The index tensors (nodes or None) of the index op ``node`` that number dim ``b`` of its first
    operand: ``indices[b]`` of ``x[i, :, j]``, ``index`` of an op along ``dim == b``, the flat
    index of ``take`` (and ``take_along_dim`` without ``dim``); none for another dim or ``b`` None."""
    if b is None:
        return []
    a = bind_args(node.target, node.args, node.kwargs)
    idx = a.get("indices", a.get("index"))
    if isinstance(idx, (list, tuple)):  # x[i, :, j]: one (optional) index per leading dim
        return [idx[b]] if b < len(idx) else []
    dim = a.get("dim")
    return [idx] if dim is None or dim % len(shape_of(node.args[0])) == b else []


def _upstream(node):
    """``node`` and the nodes it is computed from, nearest first."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop(0)
        if n.name not in seen:
            seen.add(n.name)
            yield n
            todo += n.all_input_nodes


def _floating(node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _names(kinds) -> str:
    return ", ".join(sorted(k if d is None else f"{k} over {d}" for k, d in kinds))
