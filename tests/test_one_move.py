"""One move per value, not per reader (docs/planner.md, "One move per value"): a value several
ops read in the same spec is resharded once and its gradient reduced once, in the ILP's prices,
in the plan's collective list and at run time (the run-time half: tests/test_runtime.py,
``bert-qkv``)."""
import sys
from pathlib import Path

import pytest

from alpa_lite import LogicalMesh, plan
from alpa_lite.zoo.models import build_model

sys.path.insert(0, str(Path(__file__).parent / "workers"))
import bert_layer  # noqa: E402


@pytest.fixture(scope="module")
def megatron_plan():
    model, example = build_model("bert_layer:build", 8, 8, device="cpu")
    # no all-gather: with one, the ILP gathers every split weight by one ZeRO-3 group (3
    # collectives, 0.90 ms on cpu-gloo) instead of Megatron's 8 all-reduces (1.29 ms)
    return plan(model, example, LogicalMesh((1, 4), cluster="cpu-gloo"), batch_axis=0,
                param_specs=bert_layer.megatron_specs(), allow_all_gather=False)


def test_separate_qkv_take_megatrons_collectives(megatron_plan):
    """Megatron-LM's count (Shoeybi et al. 2019, section 3, Figure 3): per layer, one all-reduce
    forward after each row-parallel linear (g) and one backward before each column-parallel
    block (f): 2 + 2 per layer. The q, k and v projections read one hidden state: its gradient,
    summed over the three, is all-reduced once (per reader it was 3 + 1 backward per layer)."""
    p = megatron_plan
    assert {fqn: p.param_specs[fqn] for fqn in bert_layer.megatron_specs()} == bert_layer.megatron_specs()
    layers = bert_layer.LAYERS
    assert p.collective_counts() == {("all-reduce", "forward"): 2 * layers, ("all-reduce", "backward"): 2 * layers}
    act = 8 * 8 * bert_layer.HIDDEN * 4  # bytes of one [batch, seq, hidden] fp32 activation
    assert all(c.nbytes == act and c.mesh_axes == (1,) for c in p.collectives)
    backward = [c.tensor for c in p.collectives if c.phase == "backward"]
    assert len(set(backward)) == len(backward)  # each value's gradient reduced once


def test_ilp_prices_each_move_once(megatron_plan):
    """The ILP's optimum is the plan's predicted step (no gradient sync on a 1 x 4 mesh with
    the batch on the size-1 axis): the shared hidden state's move is in the objective once, as
    in the plan's collective list; the ILP holds one shared move per layer input, shared by the
    repeated layers."""
    p = megatron_plan
    assert p.stats["ilp_objective"] == pytest.approx(p.compute_seconds + p.comm_seconds, rel=1e-9)
    assert p.stats["ilp_moves"] >= 1
