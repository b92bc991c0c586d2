"""Partial sums as a spec state (DTensor's ``Partial``, docs/planner.md): which strategies leave
a result partial or pass one through, and Megatron-SP (Korthikanti et al., MLSys'23) emerging
from the ILP on a long-sequence GPT whose weights dwarf its activations. The resharding of every
partial edge is simulated in test_resharding.py; training with it equals one process in
test_runtime.py (``megatron-sp``)."""
import pytest
import torch
import torch.nn as nn

from alpa_lite import LogicalMesh, plan
from alpa_lite.compiler.strategies import build_strategies
from alpa_lite.core.capture import capture
from alpa_lite.core.mesh import bytes_factor
from alpa_lite.zoo.models import GPT, GPTConfig

aten = torch.ops.aten
MESH = LogicalMesh((2, 2), mesh_alpha=(1e-5, 1e-5), mesh_beta=(1e-9, 2e-9), peak_flops=1e12,
                   mem_bandwidth=1e15, memory_bytes=1e12)


class RowParallel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)
        self.y = nn.Parameter(torch.zeros(4, 8))

    def forward(self, x):
        h, y = self.fc(x), self.y
        return ((h + y) * y + (h * h) + (h + 1.0)).sum()


def table_of(model, inputs):
    cg = capture(model, inputs)
    return cg, build_strategies(cg, MESH)


def strategies(cg, table, target, nth=0):
    node = [n for n in cg.graph.nodes if n.target == target][nth]
    return {(tuple(map(str, s.in_specs)), str(s.out_spec)): s for s in table[node.name].strategies}


def test_a_partial_result_may_leave_the_op():
    cg, table = table_of(RowParallel(), (torch.zeros(4, 16),))
    s = strategies(cg, table, aten.linear.default)
    reduced, left = s[(("RS1", "RS1", "R"), "RR")], s[(("RS1", "RS1", "R"), "RRP1")]
    assert reduced.comm > 0 and left.comm == 0 and left.partial_axes == reduced.partial_axes == (1,)
    # the bias is added to one share of the partial sum: its gradient is partial along axis 1 too
    assert reduced.grad_partial[2] == () and left.grad_partial[2] == (1,)
    assert left.grad_partial[1:2] == reduced.grad_partial[1:2] == ((),) and left.grad_partial[0] is None


def test_linear_consumers_pass_a_partial_sum_through():
    cg, table = table_of(RowParallel(), (torch.zeros(4, 16),))
    add = strategies(cg, table, aten.add.Tensor, 0)          # h + y: linear in both jointly
    assert (("RRP1", "RRP1"), "RRP1") in add and add[(("RRP1", "RRP1"), "RRP1")].grad_partial == ((), ())
    assert (("S0RP1", "S0RP1"), "S0RP1") in add and (("RRP01", "RRP01"), "RRP01") in add
    mul = strategies(cg, table, aten.mul.Tensor, 0)          # (h + y) * y: linear in either factor
    assert mul[(("RRP1", "RR"), "RRP1")].grad_partial == ((), (1,))  # y's gradient sums the shares
    assert (("RRP1", "RRP1"), "RRP1") not in mul
    square = strategies(cg, table, aten.mul.Tensor, 1)       # h * h is not linear
    assert not any("P" in out for _, out in square)
    affine = strategies(cg, table, aten.add.Tensor, 2)       # h + 1.0 is not linear
    assert not any("P" in out for _, out in affine)
    total = strategies(cg, table, aten.sum.default)          # the loss is read whole
    assert not any("P" in out for _, out in total)


class PassThrough(RowParallel):
    """A row-parallel result ``h [4, 8]`` read by each linear op but add (tested above) and mul."""

    def forward(self, x):
        h, y = self.fc(x), self.y
        return ((h - y).sum() + (-h).sum() + h.view(2, 2, 8).sum() + h.reshape(32).sum()
                + h.transpose(0, 1).sum() + (h - 1.0).sum())


def test_sub_neg_view_reshape_transpose_pass_a_partial_sum_through():
    cg, table = table_of(PassThrough(), (torch.zeros(4, 16),))
    cases = [(aten.sub.Tensor, 0, ("RRP1", "RRP1"), "RRP1"),      # h - y: linear in both jointly
             (aten.neg.default, 0, ("RRP1",), "RRP1"),
             (aten.neg.default, 0, ("S0RP1",), "S0RP1"),
             (aten.view.default, 0, ("RRP1",), "RRRP1"),          # [4, 8] -> [2, 2, 8]
             (aten.view.default, 0, ("S0RP1",), "S0RRP1"),        # the split dim 0 is the view's dim 0
             (aten.reshape.default, 0, ("RRP1",), "RP1"),         # [4, 8] -> [32]
             (aten.reshape.default, 0, ("S0RP1",), "S0P1"),
             (aten.transpose.int, 0, ("RRP1",), "RRP1"),
             (aten.transpose.int, 0, ("S0RP1",), "RS0P1")]        # the split moves with its dim
    for target, nth, ins, out in cases:
        s = strategies(cg, table, target, nth)
        assert (ins, out) in s, (target, ins, out)
        # the gradient of a partial sum is the same on every device of the axis: nothing to reduce
        assert s[(ins, out)].grad_partial == ((),) * len(ins) and s[(ins, out)].comm == 0
    assert (("RRP1", "RRP1"), "RRP1") in strategies(cg, table, aten.sub.Tensor, 0)
    affine = strategies(cg, table, aten.sub.Tensor, 1)       # h - 1.0 is not linear
    assert not any("P" in out for _, out in affine)


def test_megatron_sequence_parallelism_emerges():
    """2 layers, hidden 4096, seq 2048, batch 1 on 1 x 4 A100s, Megatron's per-head qkv layout
    (``GPTConfig.qkv_layout``): Megatron weights with reduce-scatters after the row-parallel
    linears (attention and MLP output projections), LayerNorms on sequence shards, all-gathers
    before the column-parallel linears, no forward all-reduce of an activation, and the bytes of
    a step: Korthikanti et al., MLSys'23, section 4.2.2's per layer, forward 2 all-gathers + 2
    reduce-scatters of the ``b s h`` activation and the same backward, plus the embedding and
    the vocabulary projection (derived below) and the gradients of the parameters the sequence
    shards share."""
    b, s, h, vocab, layers, n = 1, 2048, 4096, 1024, 2, 4
    cfg = GPTConfig(vocab_size=vocab, seq_len=s, hidden=h, num_layers=layers, num_heads=32, qkv_layout="megatron")
    with torch.device("meta"):
        model = GPT(cfg)
        idx = torch.zeros(b, s, dtype=torch.long)
    p = plan(model, (idx, idx), LogicalMesh((1, n), cluster="a100"))
    activation = b * s * h * 4
    forward = [c for c in p.collectives if c.phase == "forward"]
    rows = [n_ for n_, np_ in p.nodes.items() if p.captured.node(n_).target is aten.linear.default
            and str(np_.out_specs[0]) == "RRRP1"]
    weight = {n_: p.captured.param_fqns.get(p.captured.node(n_).args[1].name, "") for n_ in rows}
    block_rows = sorted(n_ for n_ in rows if weight[n_].startswith("blocks."))
    assert [weight[n_].split(".", 2)[2] for n_ in block_rows] == ["attn.proj.weight", "ffn.proj.weight"] * layers
    norms = [np_ for n_, np_ in p.nodes.items() if p.captured.node(n_).target is aten.layer_norm.default]
    assert len(norms) == 2 * layers + 1 and all(str(np_.out_specs[0]) == "RS1R" for np_ in norms)
    # Megatron-SP's collectives, each of one activation on axis 1: forward a reduce-scatter after
    # each row-parallel linear, an all-gather before each column-parallel one (qkv, fc); backward
    # their duals (all-gather of the gradient, reduce-scatter of the input's gradient)
    sp = [c for c in p.collectives if c.nbytes == activation and c.kind in ("all-gather", "reduce-scatter")]
    assert all(c.mesh_axes == (1,) for c in sp)
    assert sorted(c.tensor for c in sp if c.kind == "reduce-scatter" and c.phase == "forward") == block_rows
    gathers = {c.node for c in sp if c.kind == "all-gather" and c.phase == "forward"}
    assert len(gathers) == 2 * layers and all(p.captured.node(g).target is aten.linear.default for g in gathers)
    assert sorted((c.phase, c.kind) for c in sp) == sorted(
        [(phase, kind) for phase in ("forward", "backward") for kind in ("all-gather", "reduce-scatter")] * 2 * layers)
    wire = lambda cs: sum(bytes_factor(c.kind, n) * c.nbytes for c in cs)  # noqa: E731 (bytes over the ring)
    megatron_sp = layers * 2 * 4 * (n - 1) / n * activation
    assert wire(sp) == megatron_sp
    assert not [c for c in forward if c.kind == "all-reduce" and c.nbytes >= activation]
    # The rest. The vocabulary is small (V = h / 4), so the tied embedding / vocabulary projection
    # is split on the hidden dim, not on the vocabulary (Megatron's vocab-parallel form would
    # move a whole activation each way at both ends): its output reaches the sequence shards by
    # one all-to-all of a device's b s h / n (the dual backward), the final LayerNorm's output
    # leaves them the same way, and the partial logits (b s V) are reduced: an all-reduce, or a
    # reduce-scatter forward and an all-gather backward (the same bytes; HiGHS's tie goes either
    # way). The parameters every sequence shard reads whole (LayerNorms, the row-parallel
    # linears' biases) have their gradients all-reduced on axis 1, as in Megatron-SP.
    assert str(p.param_specs["wte.weight"]) == "RS1"
    shared = sum(prm.numel() for f, prm in model.named_parameters() if str(p.param_specs[f]) == "R")
    assert shared == (2 * 2 + 2) * h * layers + 2 * h  # 2 LayerNorms + 2 biases per layer, ln_f
    embedding_and_head = 2 * 2 * (n - 1) / n * activation / n + 2 * (n - 1) / n * b * s * vocab * 4
    # the loss, over the sequence shards: its 4-byte all-reduce, deferred behind backward (hidden)
    loss, = [c for c in p.collectives if c.nbytes < activation / n and c.phase == "forward"]
    assert (loss.kind, loss.nbytes, loss.deferred) == ("all-reduce", 4, True)
    assert wire(p.collectives) == pytest.approx(megatron_sp + embedding_and_head + 2 * (n - 1) / n * shared * 4
                                                + wire([loss]), rel=1e-12)
