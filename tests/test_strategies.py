"""Strategy generation: Alpa's dot strategies with their costs, attention, embedding, coverage
of the model zoo (every op of every built-in model gets strategies or runs replicated)."""
import re
import warnings

import pytest
import torch
import torch.nn as nn

from alpa_lite import LogicalMesh, plan
from alpa_lite.core.capture import capture
from alpa_lite.zoo.models import build_model
from alpa_lite.compiler.strategies import build_strategies

MESH = LogicalMesh((2, 2), mesh_alpha=(1e-5, 1e-5), mesh_beta=(1e-9, 2e-9), peak_flops=1e12,
                   mem_bandwidth=1e15, memory_bytes=1e12)


class MM(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(16, 32))

    def forward(self, x):
        return torch.mm(x, self.w).sum()


def strategies_of(model, inputs, target, loss_fn=None):
    cg = capture(model, inputs, loss_fn)
    table = build_strategies(cg, MESH)
    node = next(n for n in cg.graph.nodes if n.target == target)
    return {(tuple(map(str, s.in_specs)), str(s.out_spec)): s for s in table[node.name].strategies}


def test_alpa_dot_strategies_and_costs():
    s = strategies_of(MM(), (torch.zeros(8, 16),), torch.ops.aten.mm.default)
    ss = s[(("S0R", "RS1"), "S0S1")]                   # SS = SR x RS: no communication
    assert ss.partial_axes == () and ss.comm == 0
    sr = s[(("S0S1", "S1R"), "S0R")]                   # SR = SS x SR: all-reduce along axis 1
    assert sr.partial_axes == (1,)
    local_out = 8 * 32 * 4 / 2
    assert sr.comm == pytest.approx(1e-5 + 2 * 0.5 * local_out * 2e-9)
    rs = s[(("RS0", "S0S1"), "RS1")]                   # RS = RS x SS: all-reduce along axis 0
    assert rs.partial_axes == (0,) and rs.comm == pytest.approx(1e-5 + 2 * 0.5 * (8 * 32 * 4 / 2) * 1e-9)
    full = s[(("S01R", "RR"), "S01R")]                 # batch over the whole mesh
    assert full.grad_partial[1] == (0, 1)              # the weight's gradient sums over every device
    # compute: 2 M N K FLOPs forward, 2x backward, split over the devices that share the work
    assert ss.compute == pytest.approx(3 * 2 * 8 * 16 * 32 / 4 / 1e12)
    assert s[(("RR", "RR"), "RR")].compute == pytest.approx(4 * ss.compute)


def test_attention_is_head_or_batch_parallel():
    class Attn(nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum()

    q = torch.zeros(4, 8, 16, 8)
    s = strategies_of(Attn(), (q, q.clone(), q.clone()), torch.ops.aten.scaled_dot_product_attention.default)
    outs = {out for (_, out) in s}
    assert {"RS0RR", "S0S1RR", "RS01RR", "S01RRR"} <= outs
    assert all(spec.endswith("RR") for spec in outs)  # sequence and head dim stay whole


def test_vocab_parallel_embedding_is_a_partial_sum():
    emb = nn.Embedding(64, 16)
    s = strategies_of(emb, (torch.zeros(4, 8, dtype=torch.long),), torch.ops.aten.embedding.default,
                      loss_fn=lambda out: out.sum())
    vocab = s[(("S1R", "RR"), "RRR")]
    assert vocab.partial_axes == (1,)


@pytest.mark.parametrize("name", ["gpt-tiny", "moe", "wide-resnet", "mlp", "bert", "gpt2-hf", "llama"])
def test_model_zoo_plans(name):
    if name in ("bert", "gpt2-hf", "llama"):
        pytest.importorskip("transformers")
    model, example = build_model(name, 8, 16 if name != "wide-resnet" else None, device="meta")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = plan(model, example, LogicalMesh((2, 2), cluster="a100"))
    assert p.step_seconds > 0 and set(p.param_specs) >= {n for n, _ in model.named_parameters()}
    unsupported = {re.search(r"for (\S+):", str(w.message)).group(1) for w in caught
                   if "no sharding strategy" in str(w.message)}
    # only mask-building and bookkeeping ops on integer tensors run replicated
    assert unsupported <= {"aten.__and__.Tensor", "aten._assert_tensor_metadata.default", "aten.cumsum.default",
                           "aten.diff.default", "aten.index.Tensor", "aten.new_ones.default", "aten.pad.default",
                           "aten.gather.default", "aten.ge.Scalar", "aten.add_.Tensor", "aten.to.device"}, unsupported


def test_gpt3_39b_plans_on_meta_without_weights():
    model, example = build_model("gpt3-39b", 64, device="meta")
    p = plan(model, example, LogicalMesh((8, 8), cluster="a100"))
    assert p.memory_bytes <= 80 * 2**30
    # the 39B model cannot be replicated on 80 GB: its big matmul weights are split
    assert p.param_specs["blocks.0.ffn.fc.weight"] != "RR"
