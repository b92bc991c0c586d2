"""Losses that are not a plain mean over equal parts: a split batch (SPMD) or microbatches
(pipeline) give the loss and the gradients of the whole batch (docs/runtime.md, docs/pipeline.md).

Multi-rank tolerances as in tests/test_runtime.py: losses to 1e-5 relative, gradients to 1e-4 of
the largest, parameters to 2e-4 absolute (SGD lr 0.1 and AdamW lr 1e-2, 3 steps). A token mean
taken as a mean of shard or microbatch means is off by percents (the counts differ by up to 6x
here), a sum divided by B by half: both far outside.
"""
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from alpa_lite import LogicalMesh, plan
from alpa_lite.core.capture import capture
from alpa_lite.runtime.launch import torchrun
from alpa_lite.compiler.loss_reduction import loss_reduction
from alpa_lite.core.losses import LossReduction, ratio_parts
from alpa_lite.core.plan import load_plan
from alpa_lite.zoo.models import build_model

WORKER = str(Path(__file__).parent / "workers" / "loss_equivalence.py")
sys.path.insert(0, str(Path(__file__).parent / "workers"))
import patterns  # noqa: E402
LOSSES = ("ce_ignore", "nll_ignore", "ce_sum", "masked_mean", "plain_mean")
aten = torch.ops.aten


# ----------------------------------------------------------------------------- one process

@pytest.mark.parametrize("options", [{}, {"weight": "w"}, {"label_smoothing": 0.1}, {"weight": "w", "label_smoothing": 0.2}])
@pytest.mark.parametrize("op", ["ce", "nll"])
def test_ratio_parts_over_uneven_parts_give_the_whole_mean(op, options):
    """Sum of numerators over sum of denominators of uneven parts = torch's mean of the whole."""
    if op == "nll" and "label_smoothing" in options:
        pytest.skip("nll has no label smoothing")
    torch.manual_seed(0)
    x, t = torch.randn(12, 5), torch.randint(0, 5, (12,))
    t[[0, 1, 2, 3, 7]] = 3  # ignored: parts [0:4] none valid, [4:8] three, [8:12] four
    kw = {"ignore_index": 3} | ({"weight": torch.rand(5) + 0.5} if "weight" in options else {}) | \
        {k: v for k, v in options.items() if k == "label_smoothing"}
    target, x = (aten.cross_entropy_loss.default, x) if op == "ce" else (aten.nll_loss_nd.default, x.log_softmax(-1))
    fn = F.cross_entropy if op == "ce" else F.nll_loss
    want = fn(x, t, **kw)

    def parts(xs, ts):
        return ratio_parts(target, (xs, ts), {"weight": kw.get("weight"), "ignore_index": 3} |
                           ({"label_smoothing": kw["label_smoothing"]} if "label_smoothing" in kw else {}))

    split = [parts(x[i:i + 4], t[i:i + 4]) for i in range(0, 12, 4)]
    num, den = (sum(p[k] for p in split) for k in range(2))
    assert float(split[0][1]) == 0.0
    assert float(num / den) == pytest.approx(float(want), rel=1e-6)
    means = [fn(x[i:i + 4], t[i:i + 4], **kw) for i in range(4, 12, 4)]
    assert abs(float(sum(means) / 2) - float(want)) > 1e-3  # the mean of part means differs


def test_ratio_parts_of_class_probability_targets():
    torch.manual_seed(0)
    x, p = torch.randn(6, 4), torch.softmax(torch.randn(6, 4), -1)
    num, den = ratio_parts(aten.cross_entropy_loss.default, (x, p), {})
    assert float(den) == 6
    assert float(num / den) == pytest.approx(float(F.cross_entropy(x, p)), rel=1e-6)


class _Net(nn.Module):
    def __init__(self, bn=False):
        super().__init__()
        self.emb, self.fc = nn.Embedding(11, 8), nn.Linear(8, 11)
        self.bn = nn.BatchNorm1d(8) if bn else None

    def forward(self, x):
        h = self.emb(x)
        if self.bn is not None:
            h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        return self.fc(h)


def _ce(o, y, **kw):
    return F.cross_entropy(o.reshape(-1, 11), y.reshape(-1), **kw)


def _aux(o, y):  # an MoE-style load-balancing term: a product of batch means
    f = o.softmax(-1).reshape(-1, 11).mean(0)
    return _ce(o, y, ignore_index=0) + 0.1 * (f * f).sum()


def _masked(o, y):
    m = (y != 0).reshape(-1)
    return (_ce(o, y, reduction="none") * m).sum() / m.sum()


def _inplace_sum(o, y):  # combined in place, as HF adds its MoE aux loss (loss += coef * aux_loss)
    loss = _ce(o, y, reduction="sum")
    loss *= 0.5
    loss += 0.1 * o.sum()
    loss -= o.sum() * 0.01
    loss /= 2
    return loss.neg_()


def _inplace_aux(o, y):
    f = o.softmax(-1).reshape(-1, 11).mean(0)
    loss = _ce(o, y, ignore_index=0)
    loss += 0.1 * (f * f).sum()
    return loss


READS = {
    "token mean": (lambda o, y: _ce(o, y, ignore_index=0), "ratio", "cross_entropy_loss", 0),
    "nll": (lambda o, y: F.nll_loss(o.log_softmax(-1).reshape(-1, 11), y.reshape(-1), ignore_index=0), "ratio",
            "nll_loss_nd", 0),
    "sum": (lambda o, y: _ce(o, y, reduction="sum"), "sum", None, 0),
    "masked token mean": (_masked, "ratio", "sum_2", 0),
    "scaled mean plus constant": (lambda o, y: 2 * _ce(o, y, reduction="none").mean() + 1, "mean", None, 0),
    "mse": (lambda o, y: F.mse_loss(o, torch.zeros_like(o)), "mean", None, 0),
    "sum plus constant": (lambda o, y: _ce(o, y, reduction="sum") + 1, "sum", None, 1),
    "sum plus mean": (lambda o, y: _ce(o, y, reduction="sum") + o.mean(), "mean", None, 1),
    "square of a mean": (lambda o, y: o.mean() ** 2, "mean", None, 1),
    "load balancing": (_aux, "ratio", "cross_entropy_loss", 1),
    # in-place arithmetic on the loss (add_ / sub_ / mul_ / div_ / neg_) was read as nonlinear: a sum
    # loss was taken for a mean, and a pipeline or accumulate=2 averaged the microbatches' losses,
    # half the loss and gradients (patterns' inplace_sum_loss)
    "in-place sum": (_inplace_sum, "sum", None, 0),
    "in-place load balancing": (_inplace_aux, "ratio", "cross_entropy_loss", 1),
    "centered": (lambda o, y: (o - o.mean(0)).pow(2).mean(), "mean", None, 1),
    # a sum over the number of its elements is a mean: export bakes y.numel() (B x T) in as the
    # number of a microbatch's graph, as it does x.size(0) (these were read as sums: K microbatches
    # or accumulated steps gave K times the loss)
    "sum over numel": (lambda o, y: _ce(o, y, reduction="sum") / y.numel(), "mean", None, 0),
    "sum over B x T": (lambda o, y: _ce(o, y, reduction="none").sum() / (y.shape[0] * y.shape[1]), "mean", None, 0),
    "row sums over numel": (lambda o, y: 2 * _ce(o, y, reduction="none").view(4, 6).sum(-1).sum() / y.numel(),
                            "mean", None, 0),
    "mse sum over numel": (lambda o, y: F.mse_loss(o, torch.zeros_like(o), reduction="sum") / o.numel(), "mean",
                           None, 0),
    "sum over another number": (lambda o, y: _ce(o, y, reduction="sum") / 7, "sum", None, 0),
    # a loss summed in a loop from a Python 0 (a chunked cross-entropy): the 0 was a constant term,
    # the ratio read as nonlinear and microbatches averaged (patterns' chunked_ce)
    "chunks from 0": (lambda o, y: (0.0 + _ce(o[:, :3], y[:, :3], ignore_index=0, reduction="sum")
                                    + _ce(o[:, 3:], y[:, 3:], ignore_index=0, reduction="sum")) / (y != 0).sum(),
                      "ratio", "sum_1", 0),
    "sum from 0": (lambda o, y: 0 + _ce(o, y, reduction="sum"), "sum", None, 0),
    # the same from a zero tensor (torch.zeros, new_zeros, a torch.tensor(0.0) literal, a full of 0):
    # read as a sum with "a term that does not depend on the batch", K microbatches K times the loss
    "halves from zeros over numel": (lambda o, y: (torch.zeros(()) + _ce(o[:, :3], y[:, :3], reduction="sum")
                                                   + _ce(o[:, 3:], y[:, 3:], reduction="sum")) / y.numel(),
                                     "mean", None, 0),
    "halves from a zero literal over numel": (lambda o, y: (torch.tensor(0.0) + _ce(o[:, :3], y[:, :3], reduction="sum")
                                                            + _ce(o[:, 3:], y[:, 3:], reduction="sum")) / y.numel(),
                                              "mean", None, 0),
    "sum from new_zeros": (lambda o, y: o.new_zeros(()) + _ce(o, y, reduction="sum"), "sum", None, 0),
    "sum from full of 0": (lambda o, y: torch.full((), 0.0) + _ce(o, y, reduction="sum"), "sum", None, 0),
    "sum from a one literal": (lambda o, y: torch.tensor(1.0) + _ce(o, y, reduction="sum"), "sum", None, 1),
    # chunk sums added (or stacked and summed) over the number of elements of all chunks: a mean
    # (two halves were read as a sum, and K microbatches gave K times the loss, silently)
    "halves over numel": (lambda o, y: (_ce(o[:, :3], y[:, :3], reduction="sum")
                                        + _ce(o[:, 3:], y[:, 3:], reduction="sum")) / y.numel(), "mean", None, 0),
    "stacked chunks over numel": (lambda o, y: 0.5 * torch.stack([_ce(o[:, i:i + 2], y[:, i:i + 2], reduction="sum")
                                                                  for i in (0, 2, 4)]).sum() / y.numel(),
                                  "mean", None, 0),
    "stacked chunk ratio": (lambda o, y: torch.stack([_ce(o[:, i:i + 2], y[:, i:i + 2], ignore_index=0,
                                                          reduction="sum") for i in (0, 2, 4)]).sum() / (y != 0).sum(),
                            "ratio", "sum_2", 0),
    # loss ops with a reduction argument whose mean divides by the samples or elements (these
    # were read as nonlinear: a plan-time warning that microbatches change the loss, for none)
    "multi margin": (lambda o, y: F.multi_margin_loss(o.reshape(-1, 11), y.reshape(-1)), "mean", None, 0),
    "triplet": (lambda o, y: F.triplet_margin_loss(o[:, 0], o[:, 1], o[:, 2]), "mean", None, 0),
    "cosine embedding": (lambda o, y: F.cosine_embedding_loss(o[:, 0], o[:, 1], (y[:, 0] > 5) * 2.0 - 1), "mean",
                         None, 0),
    "margin ranking": (lambda o, y: F.margin_ranking_loss(o[..., 0], o[..., 1], (y > 5) * 2.0 - 1), "mean", None, 0),
    "hinge embedding": (lambda o, y: F.hinge_embedding_loss(o, torch.ones_like(o)), "mean", None, 0),
    "poisson nll": (lambda o, y: F.poisson_nll_loss(o, o.detach().exp()), "mean", None, 0),
    # in-batch negatives (CLIP, InfoNCE): logits between every pair of samples; per microbatch only
    # the microbatch's pairs (it was read as a plain token mean, no problem reported)
    "in-batch negatives": (lambda o, y: F.cross_entropy(o.mean(1) @ o.mean(1).t(), torch.arange(4)), "ratio",
                           "cross_entropy_loss", 1),
}


@pytest.mark.parametrize("case", sorted(READS))
def test_loss_reduction_reads_the_graph(case):
    fn, kind, den, problems = READS[case]
    x, y = torch.randint(0, 11, (4, 6)), torch.randint(0, 11, (4, 6))
    r = loss_reduction(capture(_Net(), (x,), fn, (y,)))
    assert (r.kind, r.denominator, len(r.problems)) == (kind, den, problems), r


def test_a_sum_over_a_count_input_is_a_sum():
    """HF's gradient-accumulation loss: ``cross_entropy(reduction="sum") / num_items_in_batch``,
    the count a 0-dim input computed over the whole batch, passed whole to every microbatch: the
    microbatches' losses add. The input was read as depending on the batch and the loss as
    nonlinear (a problem, kind "mean"), so 2 accumulated microbatches averaged them: half the loss."""
    x, y = torch.randint(0, 11, (4, 6)), torch.randint(0, 11, (4, 6))
    n = (y != 0).sum().float()
    r = loss_reduction(capture(_Net(), (x,), lambda o, y, n: _ce(o, y, ignore_index=0, reduction="sum") / n, (y, n)))
    assert (r.kind, r.denominator, r.problems) == ("sum", None, ()), r


def test_batch_norm_is_a_problem_for_microbatches():
    x, y = torch.randint(0, 11, (4, 6)), torch.randint(0, 11, (4, 6))
    r = loss_reduction(capture(_Net(bn=True), (x,), lambda o, y: _ce(o, y), (y,)))
    assert r.kind == "ratio" and len(r.problems) == 1 and "batch_norm" in r.problems[0]


class _Counted(nn.Module):
    """Two layers and a step counter written in forward (``self.steps += 1``)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.steps += 1
        return self.fc2(torch.relu(self.fc1(x))).pow(2).mean()


def test_a_buffer_written_in_forward_is_a_problem_for_microbatches():
    """A counter in forward is written once per microbatch: K times a step (2 SGD steps of K = 2
    microbatches left ``steps`` at 4, one process at 2, without a warning before)."""
    r = loss_reduction(capture(_Counted(), (torch.randn(8, 8),)))
    assert r.kind == "mean" and len(r.problems) == 1 and "buffer 'steps' is written in forward" in r.problems[0]
    with pytest.warns(UserWarning, match=r"2 microbatches change the loss: buffer 'steps' is written in forward"):
        plan(_Counted(), (torch.randn(8, 8),), LogicalMesh((1, 2)), num_stages=2, num_microbatches=2, num_layers=2)
    # batch-norm statistics stay one problem (their op's), not two
    x, y = torch.randint(0, 11, (4, 6)), torch.randint(0, 11, (4, 6))
    assert len(loss_reduction(capture(_Net(bn=True), (x,), lambda o, y: _ce(o, y), (y,))).problems) == 1


class _Teacher(nn.Module):
    """BYOL / DINO: a frozen teacher ``t`` updated in forward as an EMA of the student ``s``."""

    def __init__(self, renorm=False):
        super().__init__()
        self.s, self.t = nn.Linear(8, 8), nn.Linear(8, 8).requires_grad_(False)
        self.emb = nn.Embedding(11, 8, max_norm=1.0) if renorm else None

    def forward(self, x, y):
        if self.emb is not None:
            return (self.s(x) - self.emb(y)).pow(2).mean()
        with torch.no_grad():
            self.t.weight.mul_(0.9).add_(self.s.weight, alpha=0.1)
        return (self.s(x) - self.t(y)).pow(2).mean()


def test_a_parameter_written_in_forward_is_a_problem_for_microbatches():
    """An EMA teacher written in forward is updated once per microbatch: K times a step (sweep 8:
    a 2-stage pipeline of 2 microbatches on 2x2, 2 SGD steps, trained it silently off one process,
    student gradients up to 1.1e-5 against a bound of 9e-7). ``max_norm``'s renorm is not named:
    per microbatch it gives what the whole batch does."""
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    r = loss_reduction(capture(_Teacher(), (x, y)))
    assert len(r.problems) == 1 and "parameter 't.weight' is written in forward" in r.problems[0], r.problems
    with pytest.warns(UserWarning, match=r"2 microbatches change the loss: parameter 't.weight' is written in forward"):
        plan(_Teacher(), (x, y), LogicalMesh((1, 2)), num_stages=2, num_microbatches=2, num_layers=2)
    assert loss_reduction(capture(_Teacher(renorm=True), (x, torch.randint(0, 11, (8,))))).problems == ()


class _RowEmbedding(nn.Module):
    """An embedding of each sample's row number: ``emb(torch.arange(B))`` added to the batch."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.emb = nn.Linear(8, 8), nn.Linear(8, 8), nn.Embedding(16, 8)

    def forward(self, x):
        h = self.fc1(x) + self.emb(torch.arange(x.shape[0]))
        return self.fc2(torch.relu(h)).pow(2).mean()


class _RowWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return (self.fc(x) * (torch.arange(x.shape[0]).float().unsqueeze(1) / x.shape[0])).pow(2).mean()


class _RowIndex(nn.Module):
    """``h[torch.arange(B), y]``: the row numbers index the batch itself, right per microbatch."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, y):
        return self.fc(x)[torch.arange(x.shape[0]), y].pow(2).mean()


def test_row_numbers_of_the_batch_are_a_problem_for_microbatches():
    """``torch.arange(B)`` as values (an embedding of it, a float weight) numbers each microbatch's
    rows from 0: 2 SGD steps of accumulate=2 (1 rank) or a 2-stage pipeline of 2 microbatches
    gave a step-2 loss of 1.2138 for _RowEmbedding's one-layer version against one process's
    0.9051, without a warning before. As an index into the batch it is right and not reported
    (nor HF GPT-2 / LLaMA / BERT / Mixtral / T5, whose masks take ``torch.arange(B)`` as an index)."""
    x = torch.randn(8, 8)
    for model in (_RowEmbedding(), _RowWeight()):
        r = loss_reduction(capture(model, (x,)))
        assert len(r.problems) == 1 and "numbers the rows of the batch" in r.problems[0], r
    index = loss_reduction(capture(_RowIndex(), (x, torch.randint(0, 8, (8,))))).problems
    assert not [p for p in index if "numbers the rows" in p], index
    with pytest.warns(UserWarning, match=r"2 microbatches change the loss: embedding .* numbers the rows"):
        plan(_RowEmbedding(), (x,), LogicalMesh((1, 2)), num_stages=2, num_microbatches=2, num_layers=2)


class _Picked(nn.Module):
    """``h.gather(-1, idx[..., None]).squeeze(-1)`` squared and averaged (the masks pattern's
    loss), or ``h.gather(0, rows)``: rows picked across the batch by another sample's index."""

    def __init__(self, across: bool = False):
        super().__init__()
        self.fc, self.across = nn.Linear(8, 8), across

    def forward(self, x, idx):
        h = self.fc(x)
        picked = h.gather(0, idx) if self.across else h.gather(-1, idx[..., None]).squeeze(-1)
        return (picked ** 2).mean()


def test_a_gathered_loss_keeps_the_batch():
    """gather had no sharding rule, so its result lost the batch dim and the loss read
    ``(picked ** 2).mean()`` as "pow_1 ... is not a sum, mean or ratio of batch reductions": a
    2-stage pipeline warned that its microbatches change the loss (the masks pattern on 2x2),
    though it trains equal to one process. A gather across the batch's rows still warns."""
    x = torch.randn(8, 4, 8)
    assert loss_reduction(capture(_Picked(), (x, torch.randint(0, 8, (8, 4))))) == LossReduction("mean", None, ())
    across = loss_reduction(capture(_Picked(across=True), (x, torch.randint(0, 8, (8, 4, 8))))).problems
    assert len(across) == 1 and "is not a sum, mean or ratio of batch reductions" in across[0], across
    pipe = {"pipeline": 2, "num_microbatches": 2, "num_layers": 2}
    for name in ("masks", "convs"):  # convs: its convolutions had no rule ("cross_entropy_loss ... nonlinear")
        model, inputs = getattr(patterns, name)(8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            p = plan(model, inputs, LogicalMesh((2, 2), cluster="cpu-gloo"), **pipe)
        assert not [str(w.message) for w in caught if "microbatches change the loss" in str(w.message)], name
        assert p.loss_reduction.kind in ("mean", "ratio"), name


class _BatchBranch(nn.Module):
    """Python control flow on the batch size (``if x.shape[0] >= 8``): export records the branch of
    the size it saw, so a microbatch of 4 rows runs the other one."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc1(x)
        if x.shape[0] >= 8:
            h = h * 0.5
        return self.fc2(torch.relu(h)).pow(2).mean()


def test_a_branch_on_the_batch_size_is_a_problem_for_microbatches():
    """A 2-stage pipeline of 2 microbatches (and accumulate=2: test_accumulation_warns_...) of a
    model that branches on the batch size trained silently another model than one process's
    (sweep 7: 2 SGD steps on 2x2, step-2 loss 0.9961 against 0.9475, gradients 2e-2 off). The plan
    now compares the microbatch's ops with the whole batch's and names the first difference. A
    microbatch of one row differs from the batch only in layout ops (HF GPT-2's ``expand`` of a
    size-1 dim), which are not compared."""
    x = torch.randn(8, 8)
    with pytest.warns(UserWarning, match=r"2 microbatches change the loss: the graph captured for a microbatch of 4 "
                                         r"rows is not the graph of the whole batch of 8 rows .*aten.mul.Tensor"):
        plan(_BatchBranch(), (x,), LogicalMesh((1, 2)), num_stages=2, num_microbatches=2, num_layers=2)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*microbatches change the loss")
        plan(_BatchBranch(), (torch.randn(16, 8),), LogicalMesh((1, 2)), num_stages=2, num_microbatches=2,
             num_layers=2)  # microbatches of 8 rows take the whole batch's branch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, inputs = build_model("gpt2-hf", 8, 8, device="meta")
        plan(model, inputs, LogicalMesh((1, 2)), num_stages=2, num_microbatches=8)  # rows of one: layout only
    assert not [w for w in caught if "branches on the batch size" in str(w.message)]


class _Mixup(nn.Module):
    """Mixup over the batch's rows: ``x[perm]`` (``index_select``, ``gather(0, ...)``) with the
    permutation given as an input (``how`` ends in ``-input``) or drawn in forward."""

    def __init__(self, how: str):
        super().__init__()
        self.fc1, self.fc2, self.how = nn.Linear(8, 8), nn.Linear(8, 8), how

    def forward(self, x, perm):
        if self.how == "forward":
            perm = torch.randperm(x.shape[0])
        rows = perm[:, None].expand(x.shape)
        writes = {"index_add-input": lambda z: z.index_add(0, perm, x),
                  "index_copy-input": lambda z: z.index_copy(0, perm, x),
                  "index_reduce-input": lambda z: z.index_reduce(0, perm, x, "amax", include_self=False),
                  "index_put-input": lambda z: z.index_put((perm,), x, accumulate=True),
                  "scatter-input": lambda z: z.scatter(0, rows, x),
                  "scatter_reduce-input": lambda z: z.scatter_reduce(0, rows, x, "sum"),
                  "scatter_add-input": lambda z: z.scatter_add(0, rows, x)}
        if self.how == "gather-input":
            xm = x.gather(0, rows)
        elif self.how == "index_select-input":
            xm = x.index_select(0, perm)
        elif self.how == "take_along_dim-input":
            xm = torch.take_along_dim(x, rows, 0)
        elif self.how == "index_fill-input":
            xm = x.index_fill(0, perm % 3, 0.0)
        elif self.how == "setitem-input":
            xm = torch.zeros_like(x)
            xm[perm] = x
        elif self.how in writes:
            xm = writes[self.how](torch.zeros_like(x))
        else:
            xm = x[perm]
        return self.fc2(torch.relu(self.fc1(0.7 * x + 0.3 * xm))).pow(2).mean()


_BATCH_INDEX_OPS = {"index-input": "aten.index.Tensor", "index_select-input": "aten.index_select.default",
                    "gather-input": "aten.gather.default", "take_along_dim-input": "aten.take_along_dim.default",
                    "index_add-input": "aten.index_add.default", "index_copy-input": "aten.index_copy.default",
                    "index_fill-input": "aten.index_fill.int_Scalar", "index_reduce-input": "aten.index_reduce.default",
                    "index_put-input": "aten.index_put.default", "setitem-input": "aten.index_put_.default",
                    "scatter-input": "aten.scatter.src", "scatter_reduce-input": "aten.scatter_reduce.two",
                    "scatter_add-input": "aten.scatter_add.default"}


@pytest.mark.parametrize("how", list(_BATCH_INDEX_OPS))
def test_an_index_into_the_batch_from_an_input_is_refused_for_microbatches(how):
    """Mixup with its permutation as an input (sweep 7): a 2-stage pipeline of 2 microbatches
    warned, then died on one stage with ``IndexError: index 7 is out of bounds for dimension 0 with
    size 4`` while the other waited out the 120 s collective timeout (accumulate=2 alike:
    test_accumulation_warns_...). Planning refuses it now, naming the op and the input. Without
    microbatches it plans (data parallel keeps the indexed dim whole: 2 SGD steps on 2x2 equal one
    process for x[perm], index_select and gather), and a permutation drawn in forward numbers the
    microbatch's own rows (a warning, no error). Sweep 11: the check knew only ``index``,
    ``index_select``, ``gather`` and ``scatter_add`` (and, needing a sharding rule, not ``index_put``
    / ``scatter``): ``index_add``, ``index_copy``, ``index_fill``, ``index_reduce``, ``x[perm] = v``,
    ``scatter`` / ``scatter_reduce`` and ``take_along_dim`` with the permutation an input planned
    with a warning only."""
    x, perm = torch.randn(8, 8), torch.randperm(8)
    pipe = {"num_stages": 2, "num_microbatches": 2, "num_layers": 2}
    op = _BATCH_INDEX_OPS[how]
    verb = "writes" if how.startswith(("index_add", "index_copy", "index_fill", "index_reduce", "index_put", "setitem",
                                       "scatter")) else "picks"
    with pytest.raises(ValueError, match=rf"2 microbatches cannot cut this batch: \w+ \({op}\) {verb} rows of the "
                                         r"batch with indices from input args_1 \(tensor input 1 of the call\).*"
                                         r"torch.randperm\(x.shape\[0\]\)"):
        plan(_Mixup(how), (x, perm), LogicalMesh((1, 2)), **pipe)
    plan(_Mixup(how), (x, perm), LogicalMesh((1, 2)), force_data_parallel=True)
    with pytest.warns(UserWarning, match="2 microbatches change the loss: index"):
        plan(_Mixup("forward"), (x, perm), LogicalMesh((1, 2)), **pipe)


class _DPO(nn.Module):
    """DPO: the batch is chosen rows then rejected rows; ``-logsigmoid`` of their margin."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x):
        logp = self.fc2(torch.relu(self.fc1(x))).squeeze(-1)
        n = x.shape[0] // 2
        return -F.logsigmoid(logp[:n] - logp[n:]).mean()


def test_halves_of_the_batch_are_named_for_microbatches():
    """DPO's ``logp[:B // 2] - logp[B // 2:]`` pairs chosen and rejected rows that microbatches put
    apart (sweep 7: 2-stage pipeline and accumulate=2 on 2x2, step-2 loss 0.7768 against one
    process's 0.6315). The warning blamed ``log_sigmoid`` ("not a sum, mean or ratio"), which had
    no sharding rule and so lost the batch dim; it names the slice now."""
    with pytest.warns(UserWarning) as caught:
        plan(_DPO(), (torch.randn(8, 8),), LogicalMesh((1, 2)), num_stages=2, num_microbatches=2, num_layers=2)
    [message] = [str(w.message) for w in caught if "microbatches change the loss" in str(w.message)]
    assert "slice_1 (aten.slice.Tensor) cuts the batch dim into parts" in message, message
    assert "log_sigmoid" not in message, message


def test_a_one_row_microbatch_keeps_the_batch_through_reshapes():
    """HF GPT-2 at microbatches of one row: ``(1, T, V) -> (T, V)`` gave the size-1 batch dim a
    label of its own, so the logits lost the batch and the token mean read as "cross_entropy_loss
    ... nonlinear function of the batch": a false warning and a loss combined as a mean of
    microbatch means, not a token mean. Labels with -100 past 1 to 7 valid tokens per row, 2-stage
    pipeline of 8 microbatches on 2x2, 2 SGD steps: losses 4.2674 / 4.2504 against one process's
    4.2363 / 4.2272, gradients up to 0.26 off; now equal (ratio over cross_entropy_loss)."""
    model, inputs = build_model("gpt2-hf", 8, 8, device="meta")
    for rows in (1, 2):
        r = loss_reduction(capture(model, tuple(x[:rows] for x in inputs)))
        assert r == LossReduction("ratio", "cross_entropy_loss", ()), (rows, r)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*microbatches change the loss")
        p = plan(model, inputs, LogicalMesh((1, 2)), num_stages=2, num_microbatches=8)
    assert p.loss_reduction == LossReduction("ratio", "cross_entropy_loss", ())


@pytest.mark.parametrize("name", ["bert", "t5"])
def test_hf_masks_and_decoder_inputs_keep_the_batch(name):
    """BERT's attention mask cast with ``to(device)`` and indexed ``mask[arange(B)[:, None, None,
    None], kv]``, T5's decoder inputs shifted right with ``slice_scatter`` / ``select_scatter``: each
    lost the batch dim ("has no sharding rule, so alpa-lite cannot tell whether it combines
    samples"), a false warning: 2-stage pipeline, 4 microbatches of 2 rows on 2x2, 2 SGD steps,
    equal to one process (loss 0 / 4.8e-7 off, bounds 7.0e-4 / 5.8e-4)."""
    model, inputs = build_model(name, 4, 16, device="meta")
    for rows in (1, 2, 4):
        r = loss_reduction(capture(model, tuple(x[:rows] for x in inputs)))
        assert r == LossReduction("ratio", "cross_entropy_loss", ()), (name, rows, r)


class _DPO3(nn.Module):
    """DPO with chosen and rejected rows as two inputs concatenated in forward (TRL's
    concatenated forward), split back at ``n = chosen.shape[0]`` or, wrongly, elsewhere."""

    def __init__(self, cut):
        super().__init__()
        self.fc1, self.fc2, self.cut = nn.Linear(8, 8), nn.Linear(8, 1), cut

    def forward(self, chosen, rejected):
        logp = self.fc2(torch.relu(self.fc1(torch.cat([chosen, rejected])))).squeeze(-1)
        n = self.cut(chosen.shape[0])
        return -F.logsigmoid(logp[:n] - logp[n:2 * n]).mean()


def test_chosen_and_rejected_inputs_concatenated_pair_their_rows():
    """A microbatch concatenates its own chosen and rejected rows and splits them back at its own
    row count: the pairs are the whole batch's (sweep 7's ``dpo3`` trains equal to one process).
    It was reported as "cat (aten.cat.default) combines the samples of the batch"; a split of the
    concatenation inside a block still pairs other rows and is reported."""
    for rows in (1, 2, 4):
        x = (torch.randn(rows, 8), torch.randn(rows, 8))
        assert loss_reduction(capture(_DPO3(lambda b: b), x)) == LossReduction("mean", None, ()), rows
    [problem] = loss_reduction(capture(_DPO3(lambda b: b // 2), (torch.randn(4, 8), torch.randn(4, 8)))).problems
    assert "slice_1 (aten.slice.Tensor) cuts the batch dim into parts" in problem, problem


class _MergedRows(nn.Module):
    """The batch merged into a dim as a minor factor, ``(B, T, H) -> (T, B, H) -> (T B, H)`` (as
    ``nn.MultiheadAttention`` does around its output projection), then back, or mixed while merged."""

    def __init__(self, mix):
        super().__init__()
        self.fc1, self.fc2, self.mix = nn.Linear(8, 8), nn.Linear(8, 8), mix

    def forward(self, x):
        b, t, h = x.shape
        m = self.fc1(x).transpose(0, 1).reshape(t * b, h)  # rows t * B + b: the batch a minor factor
        m = m.softmax(0) if self.mix else torch.relu(m)  # softmax over all the T B rows mixes samples
        return self.fc2(m.view(t, b, h).transpose(0, 1)).pow(2).mean()


def test_a_batch_merged_into_a_dim_keeps_its_rows():
    """``nn.MultiheadAttention(batch_first=True)`` with a ``key_padding_mask`` reshapes ``(T, B H, d)
    -> (T B, E)`` for its output projection: the batch, a minor factor of the merged dim, had no dim
    the strategies could follow, and the merge read as "reduces over the batch" (a false warning
    under any pipeline; before the rules for ``unflatten`` and ``masked_fill_``, "has no sharding
    rule" too). The reader follows it through the merge, the ops that keep that dim and the
    reshape that gives it back; mixing the merged dim (a softmax over it) is still named."""
    for rows in (1, 2, 4, 8):
        model, inputs = patterns.mha_pad(rows, 8)
        assert loss_reduction(capture(model, inputs)) == LossReduction("mean", None, ()), rows
        assert loss_reduction(capture(_MergedRows(False), (torch.randn(rows, 6, 8),))) == \
            LossReduction("mean", None, ()), rows
    [problem] = loss_reduction(capture(_MergedRows(True), (torch.randn(4, 6, 8),))).problems
    assert problem.startswith("softmax (aten.softmax.int) combines the samples of the batch"), problem
    model, inputs = patterns.mha_pad(8, 8)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(microbatches change the loss|no sharding strategy)")
        plan(model, inputs, LogicalMesh((1, 2)), num_stages=2, num_microbatches=2, num_layers=2)


def test_pipeline_plan_warns_when_microbatches_change_the_loss():
    x, y = torch.randint(0, 11, (4, 6)), torch.randint(0, 11, (4, 6))
    mesh = LogicalMesh((1, 2))
    with pytest.warns(UserWarning, match=r"2 microbatches change the loss: mul .*aten.mul.Tensor"):
        p = plan(_Net(), (x,), mesh, _aux, targets=(y,), num_stages=2, num_microbatches=2, num_layers=2)
    assert p.loss_reduction.kind == "ratio"
    assert load_plan(p.to_json()).loss_reduction == p.loss_reduction
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*microbatches change the loss")
        q = plan(_Net(), (x,), mesh, lambda o, y: _ce(o, y, ignore_index=0), targets=(y,), num_stages=2,
                 num_microbatches=2, num_layers=2)
    assert q.loss_reduction == LossReduction("ratio", "cross_entropy_loss", ())


# ----------------------------------------------------------------------------- 4 gloo ranks

def _run(tmp_path, cases: dict) -> dict:
    out = tmp_path / "result.json"
    rc = torchrun([WORKER, "--cases", json.dumps(cases), "--out", str(out)], nproc=4, timeout_s=900)
    assert rc == 0
    return json.loads(out.read_text())


def _check(res: dict) -> None:
    for name, r in res.items():
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5), name
        if r["grad_err"] is not None:
            assert r["grad_err"] < 1e-4 * r["grad_scale"], name
        assert r["first_step_param_err"] < 2e-4, name
        assert r["param_err"] < 2e-4, name


ZERO3 = {k: "S01R" for k in ("emb.weight", "fc1.weight", "fc2.weight", "head.weight")} | \
    {k: "S01" for k in ("fc1.bias", "fc2.bias", "head.bias")}
MEGATRON = {"emb.weight": "RS1", "fc1.weight": "S1R", "fc1.bias": "S1", "fc2.weight": "RS1", "fc2.bias": "S1",
            "head.weight": "S1R", "head.bias": "S1"}


def test_spmd_losses_equal_single_process(tmp_path):
    """Data parallel, 2D (data x tensor) and ZeRO-3 on 2x2: every shard holds a different number
    of valid targets (one none in the last step). On 1 x 4 the data-parallel loss is reduced over
    one axis, so its all-reduce is deferred to the step's end and backward runs from the local
    sum (a token mean's gradients divided by the count after their sync, runtime/executor.py):
    data parallel, ZeRO-2 and ZeRO-3 there, each loss kind (ratio, sum, static mean)."""
    plans = {"dp": {"force_data_parallel": True}, "2d": {"batch_axis": 0, "param_specs": MEGATRON},
             "zero3": {"force_data_parallel": True, "param_specs": ZERO3}}
    cases = {f"{p}_{loss}_sgd": {"loss": loss, "optimizer": "sgd", "options": o}
             for p, o in plans.items() for loss in LOSSES}
    cases |= {f"{p}_{loss}_adamw": {"loss": loss, "optimizer": "adamw", "options": o}
              for p, o in plans.items() for loss in ("ce_ignore", "masked_mean")}
    line = {"dp_1x4": {"force_data_parallel": True}, "zero2_1x4": {"force_data_parallel": True, "zero_stage": 2},
            "zero3_1x4": {"force_data_parallel": True, "param_specs": ZERO3}}
    cases |= {f"{p}_{loss}_{opt}": {"loss": loss, "optimizer": opt, "options": o, "mesh": [1, 4]}
              for p, o in line.items() for loss in ("ce_ignore", "ce_sum", "plain_mean") for opt in ("sgd", "adamw")}
    _check(_run(tmp_path, cases))


def test_pipelined_losses_equal_single_process(tmp_path):
    """2 stages x 2 devices (tensor parallel inside; data parallel inside, its loss's all-reduce
    deferred), GPipe, 1F1B and ZB-H1, B = 2 and 4: microbatches hold different numbers of valid
    targets (one none in the last step at B = 4)."""
    base = {"num_stages": 2, "num_layers": 2, "param_specs": MEGATRON}
    layouts = {"gpipe_b2": {"schedule": "gpipe", "num_microbatches": 2},
               "1f1b_b4": {"schedule": "1f1b", "num_microbatches": 4}}
    cases = {f"{k}_{loss}_sgd": {"loss": loss, "optimizer": "sgd", "options": base | o}
             for k, o in layouts.items() for loss in LOSSES}
    more = {"gpipe_b4": {"schedule": "gpipe", "num_microbatches": 4},
            "1f1b_b2": {"schedule": "1f1b", "num_microbatches": 2}}
    cases |= {f"{k}_{loss}_sgd": {"loss": loss, "optimizer": "sgd", "options": base | o}
              for k, o in more.items() for loss in ("ce_ignore", "ce_sum")}
    cases |= {f"{k}_ce_ignore_adamw": {"loss": "ce_ignore", "optimizer": "adamw", "options": base | o}
              for k, o in layouts.items()}
    # data parallel inside the stages: the last stage defers its loss's all-reduce of every
    # microbatch (runtime/pipeline.py), backward runs from the local sum
    dp = {"num_stages": 2, "num_layers": 2, "force_data_parallel": True}
    split = {"dp_1f1b_b4": {"schedule": "1f1b", "num_microbatches": 4},
             "dp_zbh1_b2": {"schedule": "zb-h1", "num_microbatches": 2}}
    cases |= {f"{k}_{loss}_{opt}": {"loss": loss, "optimizer": opt, "options": dp | o}
              for k, o in split.items() for loss in ("ce_ignore", "ce_sum", "plain_mean") for opt in ("sgd", "adamw")}
    res = _run(tmp_path, cases)
    _check(res)
    for name, r in res.items():
        if name.startswith("dp_"):
            assert r["deferred"] == [[1]], name  # a stage's 1 x 2 mesh
    _check_kinds(res)


def test_compiled_deferred_losses_equal_single_process(tmp_path):
    """The compiled program (``compile="aot_eager"``, runtime/program.py) defers the loss's
    all-reduce as the interpreter does: backward from the local sum inside the graph, the
    all-reduce started after it, a token mean's gradients divided by the count after their sync
    (with one microbatch the all-reduce buckets are summed inside the graph, the division after).
    Data parallel on 1 x 4 (with 2 accumulated microbatches too) and 2 x 2 (one all-reduce over
    both axes), ZeRO-1 and ZeRO-2 on 1 x 4, and 2 data-parallel stages of 1F1B, B = 4 (each microbatch's
    deferred; one without a valid target in the last step)."""
    compiled = {"compile": "aot_eager", "force_data_parallel": True}
    setups = {"dp_1x4": (compiled, [1, 4]), "dp_k2_1x4": (compiled | {"accumulate": 2}, [1, 4]),
              "dp_2x2": (compiled, [2, 2]), "zero1_1x4": (compiled | {"zero_stage": 1}, [1, 4]),
              "zero2_1x4": (compiled | {"zero_stage": 2}, [1, 4]),
              "dp_1f1b_b4": (compiled | {"num_stages": 2, "num_layers": 2, "schedule": "1f1b",
                                         "num_microbatches": 4}, [2, 2])}
    cases = {f"{k}_{loss}_{opt}": {"loss": loss, "optimizer": opt, "options": o, "mesh": mesh}
             for k, (o, mesh) in setups.items() for loss in ("ce_ignore", "ce_sum", "plain_mean")
             for opt in ("sgd", "adamw") if opt == "sgd" or loss == "ce_ignore"}
    res = _run(tmp_path, cases)
    _check(res)
    _check_kinds(res)
    for name, r in res.items():
        assert r["compiled"], name
        assert r["deferred"] == [[0, 1] if name.startswith("dp_2x2") else [1]], name


def test_sum_over_numel_over_microbatches_equals_single_process(tmp_path):
    """``loss.sum() / y.numel()`` (export bakes in the microbatch's ``B x T``): 2 and 4 pipeline
    microbatches (2 stages x 2 devices) and 2 accumulated microbatches (data parallel) give the
    whole batch's mean. It was read as a sum, and the losses and gradients came out K times
    larger (the loss 2x at K = 2)."""
    pipe = {"num_stages": 2, "num_layers": 2, "param_specs": MEGATRON}
    setups = {"gpipe_b2": pipe | {"schedule": "gpipe", "num_microbatches": 2},
              "1f1b_b4": pipe | {"schedule": "1f1b", "num_microbatches": 4},
              "dp_k2": {"force_data_parallel": True, "accumulate": 2}}
    res = _run(tmp_path, {f"{k}_sum_numel_sgd": {"loss": "sum_numel", "optimizer": "sgd", "options": o}
                          for k, o in setups.items()})
    _check(res)
    _check_kinds(res)


def test_accumulation_warns_when_microbatches_change_the_loss(tmp_path):
    """``accumulate=K`` warns when its K microbatches change the loss: in-batch negatives (read as
    a plain token mean before, trained silently) and a square of the batch mean; a token mean does
    not warn. An unbatched input of the batch's size, cut, is named in the error, and so is a
    permutation of the batch's rows given as an input."""
    out = tmp_path / "warnings.json"
    assert torchrun([str(Path(WORKER).parent / "accumulate_warning.py"), "--out", str(out)], nproc=1,
                    timeout_s=300) == 0
    caught = json.loads(out.read_text())
    assert len(caught["Pairs"]) == 1 and caught["Pairs"][0].startswith("accumulating 2 microbatches changes the loss")
    assert "pairs the samples of the batch" in caught["Pairs"][0]
    assert len(caught["MeanSquared"]) == 1 and "nonlinear function of the batch" in caught["MeanSquared"][0]
    assert caught["TokenMean"] == []
    assert len(caught["Counter"]) == 1 and "buffer 'steps' is written in forward" in caught["Counter"][0]
    # sweep 7: the microbatch's graph lacked the whole batch's branch (2 SGD steps, DP 2x2, K = 2: loss 0.9961
    # against one process's 0.9475, gradients 2e-2 off, without a warning before)
    assert len(caught["BatchBranch"]) == 1 and "branches on the batch size" in caught["BatchBranch"][0]
    assert "aten.mul.Tensor" in caught["BatchBranch"][0]
    # position ids (T,) as an input, T = B = 8: cut to 4 rows, the capture died with torch's broadcast error alone
    assert caught["cut"].startswith("the model captures with the whole batch of 8 but not with a microbatch of its "
                                    "first 4 rows"), caught["cut"]
    assert "Attempting to broadcast" in caught["cut"]
    # mixup's x[perm] with perm an input: the microbatch of 4 rows died with IndexError: index 7 is out of bounds
    assert caught["mixup"].startswith("accumulate=2 cannot cut this batch: index (aten.index.Tensor) picks rows of "
                                      "the batch with indices from input args_1"), caught["mixup"]


def _check_kinds(res: dict) -> None:
    kinds = {"ce_ignore": "ratio", "nll_ignore": "ratio", "ce_sum": "sum", "masked_mean": "ratio",
             "plain_mean": "mean", "sum_numel": "mean"}
    for name, r in res.items():
        assert r["loss_reduction"] == next(v for k, v in kinds.items() if k in name), name


def test_one_row_microbatches_of_a_model_routing_across_rows_warn():
    """The zoo MoE routes tokens in groups of 64 over several rows (capacity and drops per group):
    8 microbatches of one row trained 9.1e-3 off one process's loss without a warning, as the
    one-row graph has no rows to combine; the whole batch's graph shows it."""
    model, inputs = build_model("moe", 8, 16, device="meta")
    with pytest.warns(UserWarning, match=r"8 microbatches change the loss: .*holds the batch.s 8 rows in groups of 4 .*microbatches of 1 rows cut"):
        plan(model, inputs, LogicalMesh((1, 2)), num_stages=2, num_microbatches=8)


class _PerSampleOps(nn.Module):
    """An op the correctness sweep found running replicated (no sharding rule) ahead of a
    nonlinear per-sample term, so its result lost the batch dim and microbatches warned
    "cannot tell whether it combines samples" (or "not a sum, mean or ratio"): ``op(h)`` acts
    along a dim that is not the batch's; along the batch's (``across``) it does combine samples."""

    def __init__(self, op, across=False):
        super().__init__()
        self.fc, self.op, self.dim = nn.Linear(6, 6), op, 0 if across else 1

    def forward(self, x):
        h = self.fc(x)  # (B, 8, 6)
        d = self.dim
        if self.op == "argsort":
            h = h + h.argsort(d).float()
        elif self.op == "scatter_add":
            h = torch.zeros_like(h).scatter_add(d, torch.arange(h.shape[d]).flip(0).view(-1, 1, 1)
                                                .movedim(0, d).expand_as(h), h)
        elif self.op == "index_add":
            h = torch.zeros_like(h).index_add(d, torch.arange(h.shape[d]).flip(0), h, alpha=0.5)
        elif self.op == "repeat_interleave":
            h = h.repeat_interleave(2, dim=1)
        elif self.op == "kl_div":
            h = F.kl_div(h.log_softmax(-1), x.softmax(-1), reduction="none")
        elif self.op == "gqa":
            q = h.view(-1, 4, 2, 6)
            h = F.scaled_dot_product_attention(q, q[:, :2], q[:, 2:], enable_gqa=True)
        elif self.op == "addmv":
            h = torch.addmv(h[:, 0, 0], h[:, 1], self.fc.bias, beta=0.5)[:, None]
        return h.pow(2).flatten(1).sum(-1).sqrt().mean()


@pytest.mark.parametrize("op", ["argsort", "scatter_add", "index_add", "repeat_interleave", "kl_div", "gqa", "addmv"])
def test_ops_along_another_dim_keep_the_batch(op):
    """Per sample along the batch, the op now has a rule that carries the batch dim: a plain mean,
    no microbatch problem (each problem named the op, or a ``pow`` read as nonlinear, before)."""
    assert loss_reduction(capture(_PerSampleOps(op), (torch.randn(4, 8, 6),))) == LossReduction("mean", None, ())


@pytest.mark.parametrize("op", ["argsort", "scatter_add", "index_add"])
def test_ops_along_the_batch_dim_combine_samples(op):
    """Sorting the batch's rows, or adding them into other rows, combines samples: the warning
    stays, naming the op (not "no sharding rule, cannot tell")."""
    [problem] = loss_reduction(capture(_PerSampleOps(op, across=True), (torch.randn(4, 8, 6),))).problems
    assert problem.startswith(f"{op} (aten.{op}.") and "combines the samples of the batch" in problem, problem


@pytest.mark.parametrize("name,problem", [
    ("seq_ops", None), ("sdpa_options", None), ("rope_gqa", None), ("alpha_beta", None),
    ("moe", "argsort (aten.argsort.default) combines the samples of the batch"),
    ("inst_running", "instance_norm (aten.instance_norm.default) updates its running statistics")])
def test_sweep10_microbatch_warnings_name_what_combines_samples(name, problem):
    """Sweep 10's models under a 2-stage pipeline of 2 microbatches: ``repeat_interleave`` (seq_ops,
    rope_gqa's GQA heads), sdpa with ``enable_gqa`` (sdpa_options) had no rule, and the planner
    warned "has no sharding rule, so alpa-lite cannot tell whether it combines samples": a false
    warning, now none. The MoE's ``argsort`` over every token of the batch and its load-balancing
    loss, and an ``InstanceNorm1d(track_running_stats=True)``'s running statistics do combine
    samples: the warning stays, naming them."""
    model, inputs = getattr(patterns, name)(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan(model, inputs, LogicalMesh((1, 2)), num_stages=2, num_microbatches=2, num_layers=2)
    found = [str(w.message) for w in caught if "microbatches change the loss" in str(w.message)]
    assert not any("cannot tell" in m for m in found), found
    if problem is None:
        assert found == [], found
    else:
        assert len(found) == 1 and problem in found[0], found


class _FreqEmb(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.fc = nn.Embedding(16, 8, scale_grad_by_freq=True), nn.Linear(8, 8)

    def forward(self, ids):
        return self.fc(self.tok(ids)).pow(2).mean()


def test_scale_grad_by_freq_is_named_for_microbatches():
    """Sweep 11: an ``Embedding(scale_grad_by_freq=True)`` under ``accumulate=2`` trained off one
    process (``tok.weight``'s gradient 2.5e-3 off, bound 1.9e-7), as warned, but the warning said
    the lookup "combines the samples of the batch", which its forward does not: it names the
    per-batch counts now."""
    with pytest.warns(UserWarning, match=r"2 microbatches change the loss: embedding \(aten\.embedding\.default\) "
                                         r"divides each row's gradient by the row's count in the batch's indices"):
        plan(_FreqEmb(), (torch.randint(0, 16, (8, 4)),), LogicalMesh((1, 2)), num_stages=2, num_microbatches=2,
             num_layers=2)
