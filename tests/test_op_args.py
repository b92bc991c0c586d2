"""Op arguments are read by their schema names, every option reaches the local variant, and random
ops draw per-shard masks.

Single-process checks of the rules, then one 4-rank gloo launch (``workers/op_args.py``): every
op family with each optional argument away from its default, under data-parallel, Megatron
column-split, ZeRO-3 (S01R), vocab-parallel, hidden-split and auto plans, trained 2 SGD steps
against one process. SGD keeps exact zeros zero (a padding row's gradient). Tolerances as in
``test_runtime.py``: losses 1e-5 relative, gradients 1e-4 of the largest, parameters 2e-5.
"""
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from alpa_lite import plan
from alpa_lite.core.capture import capture
from alpa_lite.runtime.launch import torchrun
from alpa_lite.core.mesh import LogicalMesh
from alpa_lite.compiler.ops import signature
from alpa_lite.core.aten import bind_args, with_arg

WORKERS = Path(__file__).parent / "workers"
sys.path.insert(0, str(WORKERS))
from op_args import MODELS  # noqa: E402

aten = torch.ops.aten


def _node(loss_fn, *inputs, target=aten.cross_entropy_loss.default):
    class Wrap(torch.nn.Module):
        def forward(self, *xs):
            return loss_fn(*xs)
    cg = capture(Wrap(), inputs)
    return next(n for n in cg.graph.nodes if n.target is target)


def test_bind_args_fills_defaults_and_reads_keywords():
    a = bind_args(aten.cross_entropy_loss.default, ("x", "y", None, 2), {})
    assert a == {"self": "x", "target": "y", "weight": None, "reduction": 2, "ignore_index": -100,
                 "label_smoothing": 0.0}
    assert bind_args(aten.var.correction, ("x", [1]), {"correction": 0})["keepdim"] is False
    assert with_arg(aten.embedding.default, ("w", "i"), {}, "sparse", False) == (("w", "i"), {"sparse": False})
    assert with_arg(aten.embedding.default, ("w", "i", 3, False, True), {}, "sparse", False)[0][4] is False


@pytest.mark.parametrize("options, output, reduce", [
    ({"label_smoothing": 0.1}, (), "mean"),
    ({"reduction": "sum"}, (), "sum"),
    ({"reduction": "none"}, ("n",), "sum"),
    ({"ignore_index": 0}, (), "mean"),
    ({"ignore_index": 0, "reduction": "sum", "label_smoothing": 0.3}, (), "sum"),
])
def test_cross_entropy_rule_reads_every_option(options, output, reduce):
    node = _node(lambda x, y: F.cross_entropy(x, y, **options).sum(), torch.randn(8, 5), torch.randint(0, 5, (8,)))
    sig = signature(node)
    assert sig.outputs == [output] and sig.reduce == reduce and sig.fixed == set()
    # vocab-parallel: per sample max, sum-exp, target logit (and the logits' sum when smoothing)
    assert len(sig.stats["c"]) == (4 if options.get("label_smoothing") else 3)


def test_cross_entropy_weighted_mean_and_sum_split_the_batch():
    """A weighted mean divides by the batch's weight sum: the runtime all-reduces the local loss
    sum and the local weight sum separately (``losses.ratio_parts``), so it splits like a sum."""
    x, y, w = torch.randn(8, 5), torch.randint(0, 5, (8,)), torch.rand(5)
    sig = signature(_node(lambda x, y, w: F.cross_entropy(x, y, weight=w), x, y, w))
    assert sig.inputs == [("n", "c"), ("n",), ("c",)] and sig.reduce == "mean"
    sig = signature(_node(lambda x, y, w: F.cross_entropy(x, y, weight=w, reduction="sum"), x, y, w))
    assert sig.inputs == [("n", "c"), ("n",), ("c",)] and sig.reduce == "sum"


def test_embedding_scale_grad_by_freq_keeps_indices_and_vocab_whole():
    w, i = torch.randn(16, 8), torch.randint(0, 16, (4, 3))
    plain = signature(_node(lambda w, i: F.embedding(i, w).sum(), w, i, target=aten.embedding.default))
    freq = signature(_node(lambda w, i: F.embedding(i, w, scale_grad_by_freq=True).sum(), w, i,
                           target=aten.embedding.default))
    assert plain.fixed == set() and "v" in plain.contraction
    assert freq.fixed == {"v", "d0", "d1"}


@pytest.mark.parametrize("fn, target, fixed", [
    (lambda x: torch.softmax(x, dim=0).sum(), aten.softmax.int, {"d0"}),
    (lambda x: torch.log_softmax(x, 1).sum(), aten.log_softmax.int, {"d1"}),
    (lambda x: x.var(dim=1, correction=0, keepdim=True).sum(), aten.var.correction, {"d1"}),
    (lambda x: x.std(0).sum(), aten.std.dim, {"d0"}),
    (lambda x: x.amax(dim=1, keepdim=True).sum(), aten.amax.default, {"d1"}),
])
def test_dim_arguments_by_name(fn, target, fixed):
    sig = signature(_node(fn, torch.randn(4, 6, 2), target=target))
    assert sig.fixed == fixed


def test_reductions_keepdim_by_keyword():
    sig = signature(_node(lambda x: x.sum(dim=1, keepdim=True).sum(), torch.randn(4, 6), target=aten.sum.dim_IntList))
    assert sig.outputs[0][0] == "d0" and sig.outputs[0][1].startswith("#") and sig.contraction == {"d1"}


def test_convolution_groups_and_transposed_weight_layout():
    x = torch.randn(2, 4, 8, 8)
    grouped = signature(_node(lambda x, w: F.conv2d(x, w, stride=2, padding=1, dilation=2, groups=2).sum(),
                              x, torch.randn(4, 2, 3, 3), target=aten.conv2d.default))
    assert grouped.inputs[0][1] == grouped.inputs[1][0] == "g" and grouped.units == {"g": 2}  # by whole groups
    conv = next(n for n in capture(torch.nn.Sequential(torch.nn.ConvTranspose2d(4, 6, 3), torch.nn.Flatten(0)),
                                   (x,), lambda out: out.sum()).graph.nodes
                if "conv" in str(n.target))
    assert conv.target is aten.conv_transpose2d.input  # no "transposed" argument: the op says it
    assert signature(conv).inputs[1][:2] == ("c", "o")


def test_ignore_index_plans_on_the_issue_example():
    """issue 9: ignore_index=0 crashed planning (IndexError in planner._apply_constraints)."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    x, y = torch.randn(8, 16), torch.randint(0, 8, (8,))
    p = plan(model, (x,), LogicalMesh((2, 2), cluster="cpu-gloo"), lambda out, t: F.cross_entropy(out, t, ignore_index=0),
             targets=(y,), force_data_parallel=True)
    assert p.nodes["cross_entropy_loss"].reduce == "mean"


# ----------------------------------------------------------------------------- 4 gloo ranks

@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("op_args") / "results.json"
    assert torchrun([str(WORKERS / "op_args.py"), "--out", str(out)], nproc=4, timeout_s=1200) == 0
    return json.loads(out.read_text())


def test_every_option_trains_equal_to_one_process(results):
    res = results["equivalence"]
    assert set(res) == {f"{m}/{p}" for m, (_, _, plans) in MODELS.items() for p in plans}
    for key, r in res.items():
        assert "error" not in r, (key, r.get("error"))
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5), key
        assert r["grad_err"] <= 1e-4 * r["grad_scale"], (key, r["grad_err"])
        assert r["param_err"] <= 2e-5, (key, r["param_err"])


def test_padding_row_gets_no_gradient(results):
    res = results["equivalence"]
    for key in (k for k in res if k.startswith("emb-padding")):
        assert res[key]["ref_pad_grad"] == 0.0 and res[key]["pad_grad"] == 0.0, key
    assert res["emb-padding/vocab"]["param_specs"]["emb.weight"] == "S01R"


def _agreement(a, b):
    return sum(x == y for x, y in zip(a, b)) / len(a)


@pytest.mark.parametrize("plan_name", ["dp", "batch-only"])
def test_dropout_masks_per_shard(results, plan_name):
    """Masks of p=0.5 are i.i.d. over the global tensor: ranks holding different shards agree on
    about half the elements (a shared seed would agree on all), ranks holding the same shard
    agree on all, the keep rate is 1 - p, and each step draws a new mask. Not equal to one
    process's mask: that is not expected of dropout (docs/runtime.md)."""
    r = results["dropout"][plan_name]
    spec = r["spec"]
    split = {int(a) for a in spec.replace("R", "").replace("S", "")}
    ranks = r["ranks"]
    same_pairs = 0
    for i, a in enumerate(ranks):
        keep = [m for step in a["masks"] for m in step]
        assert abs(sum(keep) / len(keep) - 0.5) < 4 * math.sqrt(0.25 / len(keep)), keep
        assert _agreement(a["masks"][0], a["masks"][1]) < 0.8  # a new mask every step
        for b in ranks[i + 1:]:
            same_shard = all(a["coord"][x] == b["coord"][x] for x in split)
            agree = _agreement(a["masks"][0], b["masks"][0])
            same_pairs += same_shard
            assert agree == 1.0 if same_shard else agree < 0.8, (spec, a["coord"], b["coord"], agree)
    if plan_name == "batch-only":
        assert same_pairs > 0, spec  # values replicated along an axis: the check above is not vacuous


def test_dropout_masks_per_microbatch_in_a_pipeline(results):
    """A pipeline stage draws a new mask for every microbatch of every step (two steps of two
    microbatches, one stage of 4 devices), at the keep rate 1 - p."""
    masks = results["dropout"]["pipeline"]["masks"]
    assert len(masks) == 4
    keep = [m for mask in masks for m in mask]
    assert abs(sum(keep) / len(keep) - 0.5) < 4 * math.sqrt(0.25 / len(keep)), keep
    for i, a in enumerate(masks):
        for b in masks[i + 1:]:
            assert _agreement(a, b) < 0.8
