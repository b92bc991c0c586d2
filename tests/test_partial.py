"""Partial sums as a spec state (DTensor's ``Partial``, docs/planner.md): which strategies leave
a result partial or pass one through, and Megatron-SP (Korthikanti et al., MLSys'23) emerging
from the ILP on a long-sequence GPT whose weights dwarf its activations. The resharding of every
partial edge is simulated in test_resharding.py; training with it equals one process in
test_runtime.py (``megatron-sp``)."""
import torch
import torch.nn as nn

from alpa_lite import LogicalMesh, plan
from alpa_lite.compiler.strategies import build_strategies
from alpa_lite.core.capture import capture
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


def test_megatron_sequence_parallelism_emerges():
    """2 layers, hidden 4096, seq 2048, batch 1 on 1 x 4 A100s: Megatron weights with
    reduce-scatters after the row-parallel linears (attention and MLP output projections),
    LayerNorms on sequence shards, all-gathers before the column-parallel linears, and no
    forward all-reduce of an activation (Korthikanti et al., MLSys'23, section 4.2.2). The
    vocabulary projection may be row-parallel too, reducing its logits (HiGHS's tie between
    reduce-scatter and all-reduce there goes either way)."""
    cfg = GPTConfig(vocab_size=1024, seq_len=2048, hidden=4096, num_layers=2, num_heads=32)
    with torch.device("meta"):
        model = GPT(cfg)
        idx = torch.zeros(1, 2048, dtype=torch.long)
    p = plan(model, (idx, idx), LogicalMesh((1, 4), cluster="a100"))
    activation = 2048 * 4096 * 4
    forward = [c for c in p.collectives if c.phase == "forward"]
    scatters = [c for c in forward if c.kind == "reduce-scatter"]
    rows = [n for n, np_ in p.nodes.items() if p.captured.node(n).target is aten.linear.default
            and str(np_.out_specs[0]) == "RRRP1"]
    weight = {n: p.captured.param_fqns.get(p.captured.node(n).args[1].name, "") for n in rows}
    block_rows = sorted(n for n in rows if weight[n].startswith("blocks."))
    assert [weight[n].split(".", 2)[2] for n in block_rows] == ["attn.proj.weight", "ffn.proj.weight"] * 2
    full = [c for c in scatters if c.nbytes == activation]
    assert sorted(c.tensor for c in full) == block_rows and all(c.mesh_axes == (1,) for c in full)
    # besides, at most the vocabulary projection is row-parallel: its logits (a quarter of an
    # activation here) reduced, cheaper than gathering its weight in forward and backward
    assert all(c.nbytes <= activation / 4 for c in scatters if c not in full)
    assert set(rows) - set(block_rows) <= {n for n, f in weight.items() if f == "lm_head.weight"}
    head = {n for n in p.nodes if p.captured.node(n).target is aten.linear.default  # the vocabulary projection:
            and p.captured.param_fqns.get(p.captured.node(n).args[1].name) == "lm_head.weight"}  # its logits reduced
    assert not [c for c in forward if c.kind == "all-reduce" and c.nbytes >= activation / 4 and c.tensor not in head]
    norms = [np_ for n, np_ in p.nodes.items() if p.captured.node(n).target is aten.layer_norm.default]
    assert len(norms) == 5 and all(str(np_.out_specs[0]) == "RS1R" for np_ in norms)
    gathers = {c.node for c in forward if c.kind == "all-gather" and c.nbytes == activation}
    assert len(gathers) == 2 * 2  # before the qkv and fc linears of each layer
    assert all(p.captured.node(n).target is aten.linear.default for n in gathers)
