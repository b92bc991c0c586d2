"""DeepSpeed-Ulysses (Jacobs et al. 2023) emerges where it is the optimum: a long-sequence GPT
layer (sequence 16k, hidden 256, 16 heads, batch 1) on a 1x4 A100 description (plan only). The
sequence is split on mesh axis 1 through the layer; attention runs head-split, reached by one
all-to-all per query, key and value (sequence -> heads) and left by one for its output (heads ->
sequence): 4 forward, 4 backward, and no all-reduce of an activation (Megatron's tensor
parallelism would pay two per layer). The plan is cheaper than Megatron's forced specs."""
import pytest
import torch

from alpa_lite import LogicalMesh, plan
from alpa_lite.zoo.models import build_model

SDPA = torch.ops.aten.scaled_dot_product_attention.default
MEGATRON = {"blocks.0.attn.qkv.weight": "S1R", "blocks.0.attn.proj.weight": "RS1",
            "blocks.0.ffn.fc.weight": "S1R", "blocks.0.ffn.proj.weight": "RS1"}


def _plan(**options):
    model, example = build_model("gpt-tiny", 1, 16384, device="meta", hidden=256, num_layers=1, num_heads=16,
                                 vocab_size=256)
    return plan(model, example, LogicalMesh((1, 4), cluster="a100"), **options)


@pytest.fixture(scope="module")
def ulysses():
    return _plan()


def test_attention_is_head_split_between_sequence_splits(ulysses):
    sdpa = next(n for n in ulysses.captured.graph.nodes if n.target is SDPA)
    assert [str(s) for s in ulysses.nodes[sdpa.name].in_specs] == ["RS1RR"] * 3  # heads on axis 1
    users = [c for c in ulysses.collectives if c.kind == "all-to-all"]
    into = [c for c in users if c.node == sdpa.name]
    assert sorted(c.phase for c in into) == ["backward"] * 3 + ["forward"] * 3
    # the output goes back to the sequence split by one all-to-all before the output projection
    weight = next(ph for ph, fqn in ulysses.captured.param_fqns.items() if fqn == "blocks.0.attn.proj.weight")
    proj = next(n for n in ulysses.captured.graph.nodes if n.target is torch.ops.aten.linear.default
                and n.args[1].name == weight)
    out = [c for c in users if c.node == proj.name]
    assert sorted(c.phase for c in out) == ["backward", "forward"]
    assert all(c.mesh_axes == (1,) for c in into + out)
    # every activation keeps its sequence split: no all-reduce of an activation in forward
    assert not [c for c in ulysses.collectives if c.kind == "all-reduce" and c.phase == "forward"
                and c.nbytes >= 16384 * 256 * 4 / 4]


def test_ulysses_beats_megatron_tensor_parallelism(ulysses):
    megatron = _plan(param_specs=MEGATRON)
    assert ulysses.step_seconds < megatron.step_seconds


@pytest.fixture(scope="module")
def without_all_to_all():
    return _plan(allow_all_to_all=False)


def _kinds(p):
    return {(c.kind, c.phase) for c in p.collectives}


def test_forbidding_all_to_all_gives_up_ulysses(ulysses, without_all_to_all):
    assert ("all-to-all", "forward") in _kinds(ulysses)
    assert not [c for c in without_all_to_all.collectives if c.kind == "all-to-all"]
    # the sequence split now leaves attention by gathering: all-gathers forward and backward
    assert {("all-gather", "forward"), ("all-gather", "backward")} <= _kinds(without_all_to_all)
    assert without_all_to_all.step_seconds > ulysses.step_seconds
    assert without_all_to_all.options["allow_all_to_all"] is False


def test_forbidding_all_gather_too_leaves_all_reduces_only(without_all_to_all):
    neither = _plan(allow_all_to_all=False, allow_all_gather=False)
    assert ("all-gather", "update") in _kinds(without_all_to_all)  # a ZeRO-1/2 parameter's update
    assert {kind for kind, _ in _kinds(neither)} == {"all-reduce"}
    assert {stage for stage, _ in neither.zero_stages.values()} == {0}  # replicated optimizer states
    assert neither.step_seconds > without_all_to_all.step_seconds
