"""Identical repeated blocks share one ILP variable per place (``cost_graph``, ``share_layers``),
at the outermost level of numbered modules where copies with the same strategies exist: GPT's
``blocks.i``, and Wide-ResNet's ``stages.i.j`` blocks inside a stage (whose stages differ)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from alpa_lite import LogicalMesh, plan
from alpa_lite.compiler.cost_graph import build_cost_graph
from alpa_lite.compiler.strategies import build_strategies
from alpa_lite.core.capture import capture
from alpa_lite.zoo.models import build_model


def variables(model, example, mesh=(2, 2)):
    """``{parameter fqn: ILP variable}`` of the cost graph with and without sharing, and the
    variable counts."""
    cg = capture(model, example)
    lm = LogicalMesh(mesh, cluster="a100")
    table = build_strategies(cg, lm)
    out = []
    for share in (True, False):
        graph, where = build_cost_graph(cg, table, lm, share_layers=share)
        out.append(({fqn: where[ph].var for ph, fqn in cg.param_fqns.items() if ph in where}, len(graph.costs)))
    return out


def test_blocks_inside_the_stages_of_a_wide_resnet_share():
    model, example = build_model("wide-resnet", 4, device="meta", stage_sizes=(3, 3))
    (var, n_shared), (alone, n_alone) = variables(model, example)
    for s in (0, 1):
        assert var[f"stages.{s}.1.conv1.weight"] == var[f"stages.{s}.2.conv1.weight"]
        assert var[f"stages.{s}.1.bn2.bias"] == var[f"stages.{s}.2.bn2.bias"]
        assert var[f"stages.{s}.0.conv1.weight"] != var[f"stages.{s}.1.conv1.weight"]  # other input channels
    assert var["stages.0.1.conv1.weight"] != var["stages.1.1.conv1.weight"]  # other channels
    assert len(set(alone.values())) == len(alone) and n_alone > n_shared


class _Expert(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return self.fc(x).relu()


class _Block(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.experts = nn.ModuleList(_Expert(d) for _ in range(n))

    def forward(self, x):
        h = self.norm(x)
        return x + sum(e(h) for e in self.experts)


class _Nested(nn.Module):
    def __init__(self, d=16, layers=3, experts=2):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(d, experts) for _ in range(layers))

    def forward(self, x, y):
        for b in self.blocks:
            x = b(x)
        return ((x - y) ** 2).mean()


def test_nested_lists_share_the_outer_blocks():
    """Experts numbered inside numbered blocks: expert k of every block is one variable (the
    outer level), as the blocks are identical; the experts of one block are too small to be
    blocks of their own (``MIN_SHARED_LAYER_NODES``)."""
    model = _Nested()
    example = (torch.randn(8, 16), torch.randn(8, 16))
    (var, _), _ = variables(model, example)
    for k in range(2):
        assert var[f"blocks.0.experts.{k}.fc.weight"] == var[f"blocks.1.experts.{k}.fc.weight"] \
            == var[f"blocks.2.experts.{k}.fc.weight"]
    assert var["blocks.0.experts.0.fc.weight"] != var["blocks.0.experts.1.fc.weight"]
    assert var["blocks.0.norm.weight"] == var["blocks.2.norm.weight"]


@pytest.mark.parametrize("mesh", [(2, 2), (1, 4)])
def test_sharing_keeps_the_optimum_of_a_wide_resnet(mesh):
    """Without a memory limit the shared ILP of a Wide-ResNet with 3 blocks per stage has the
    optimum of the unshared one, with fewer variables."""
    model, example = build_model("wide-resnet", 8, device="meta", stage_sizes=(3, 3))
    shared = plan(model, example, LogicalMesh(mesh, cluster="a100"), solver="highs")
    alone = plan(model, example, LogicalMesh(mesh, cluster="a100"), solver="highs", share_layers=False)
    assert shared.stats["ilp_variables"] < alone.stats["ilp_variables"]
    assert shared.stats["ilp_objective"] == pytest.approx(alone.stats["ilp_objective"], rel=1e-9)
    assert shared.step_seconds == pytest.approx(alone.step_seconds, rel=1e-9)
