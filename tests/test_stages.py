"""The inter-op pass: stage DP vs exhaustive search on fixed cost tables, layer clustering,
and a real GPT planned into pipeline stages."""
import math
import random

import pytest

from alpa_lite import LogicalMesh, load_plan, plan
from alpa_lite.zoo.models import build_model
from alpa_lite.compiler.ilp import highs_available
from alpa_lite.compiler.stage_dp import (
    PipelinePlanError,
    StageOption,
    bubble_fraction,
    exhaustive_stage_search,
    in_flight,
    stage_dp,
    submesh_shapes,
)
from alpa_lite.core.options import PipelineOptions
from alpa_lite.core.schedules import get_schedule, step_seconds
from test_inter_op_search import partitions


def synthetic_cost(num_layers, seed, options=2):
    """A fixed table: per (range, submesh) a few options with made-up times and memory."""
    rng = random.Random(seed)
    base = [rng.uniform(1.0, 3.0) for _ in range(num_layers)]
    table = {}

    def cost(k, i, shape):
        key = (k, i, shape)
        if key not in table:
            d = shape[0] * shape[1]
            work = sum(base[k:i])
            opts = []
            for j in range(options):
                speedup = d ** rng.uniform(0.6, 1.0)
                opts.append(StageOption(seconds=work / speedup * (1 + 0.3 * j), weight_bytes=(i - k) * rng.uniform(1, 3) / d,
                                        act_bytes=rng.uniform(0.2, 1.0) / (1 + j), once_seconds=rng.uniform(0, 0.2)))
            table[key] = opts
        return table[key]

    return cost


CASES = [  # layers, cluster, microbatches, memory, schedule, fixed stages
    (3, (1, 4), 4, 1e9, "1f1b", None),
    (4, (1, 4), 8, 4.0, "1f1b", None),
    (4, (2, 2), 4, 7.0, "gpipe", None),
    (5, (1, 4), 2, 5.0, "1f1b", 3),
    (4, (2, 4), 6, 4.5, "1f1b", None),
    (3, (3, 2), 3, 6.0, "1f1b", None),
    (4, (1, 4), 8, 4.0, "zb-h1", None),  # in flight min(S, B) on every stage: one DP per stage count
    (4, (2, 2), 4, 7.0, "zb-h1", None),
    (5, (1, 4), 2, 5.0, "zb-h1", 3),
]


@pytest.mark.parametrize("layers,cluster,b,memory,schedule,stages", CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dp_equals_exhaustive_search(layers, cluster, b, memory, schedule, stages, seed):
    cost = synthetic_cost(layers, seed)
    dp = stage_dp(layers, cluster, cost, memory, b, num_stages=stages, schedule=schedule)
    ex = exhaustive_stage_search(layers, cluster, cost, memory, b, num_stages=stages, schedule=schedule)
    assert dp.objective == pytest.approx(ex.objective, rel=1e-12)
    # the DP's own stages reproduce its objective and respect devices, order and memory
    assert sum(s.submesh[0] * s.submesh[1] for s in dp.stages) == cluster[0] * cluster[1]
    assert [s.start for s in dp.stages] == [0] + [s.end for s in dp.stages[:-1]] and dp.stages[-1].end == layers
    n = len(dp.stages)
    for idx, s in enumerate(dp.stages):
        assert s.in_flight == in_flight(n - idx, n, b, schedule)
        assert s.option.weight_bytes + s.in_flight * s.option.act_bytes <= memory
    t = [s.option.seconds for s in dp.stages]
    r = 1 / 3 if schedule == "zb-h1" else 1.0  # ZB-H1's weight passes fill 2/3 of each drain step
    once = sum(s.option.once_seconds for s in dp.stages)
    assert dp.objective == pytest.approx(once + r * sum(t) + (b - r) * max(t))
    if stages is not None:
        assert n == stages


def test_dp_prefers_pipeline_when_communication_is_dear():
    # two layers: on 2 devices one stage costs 1.0 (intra-op has to communicate), two stages 0.3 each
    def cost(k, i, shape):
        d = shape[0] * shape[1]
        return [StageOption(1.0 if (i - k == 2 and d == 2) else 0.3 * (i - k) / d * (2 if d == 2 else 1))]

    res = stage_dp(2, (1, 2), cost, 1.0, 4)
    assert [(s.start, s.end, s.submesh) for s in res.stages] == [(0, 1, (1, 1)), (1, 2, (1, 1))]
    assert res.objective == pytest.approx(0.3 + 0.3 + 3 * 0.3)
    assert bubble_fraction([0.3, 0.3], 4) == pytest.approx(1 / 5)


def test_memory_forces_more_stages_under_1f1b_than_gpipe_allows():
    # one stage holding 4 microbatches does not fit; two stages (in flight 2 and 1) do under 1F1B
    def cost(k, i, shape):
        return [StageOption((i - k) * 1.0, weight_bytes=(i - k) * 1.0, act_bytes=(i - k) * 1.0)]

    res = stage_dp(2, (1, 2), cost, 3.5, 4, num_stages=None, submeshes=[(1, 1), (1, 2)])
    assert [s.in_flight for s in res.stages] == [2, 1]
    with pytest.raises(PipelinePlanError, match="no pipeline fits"):
        stage_dp(2, (1, 2), cost, 3.5, 4, schedule="gpipe", submeshes=[(1, 1), (1, 2)])


def test_bad_stage_counts_name_the_limits():
    cost = synthetic_cost(3, 0)
    with pytest.raises(PipelinePlanError, match=r"3 layers and 4 devices \(so 1 <= num_stages <= 3\)"):
        stage_dp(3, (1, 4), cost, 1e9, 2, num_stages=4)
    with pytest.raises(ValueError, match="unknown schedule"):
        stage_dp(3, (1, 4), cost, 1e9, 2, schedule="zb")


def test_zb_h1_trades_memory_for_bubble():
    # equal stage times: ZB-H1's step is B t + (S - 1) t / 3. It holds min(S, B) = 2 microbatches
    # on the last stage where 1F1B holds 1: a last layer with large activations fits only 1F1B
    def cost(k, i, shape):
        return [StageOption((i - k) * 3.0, weight_bytes=1.0, act_bytes=0.5 if k == 0 else 1.5)]

    zb = stage_dp(2, (1, 2), cost, 4.0, 4, schedule="zb-h1", submeshes=[(1, 1)])
    assert zb.objective == pytest.approx(4 * 3.0 + 3.0 / 3) and [s.in_flight for s in zb.stages] == [2, 2]
    assert stage_dp(2, (1, 2), cost, 4.0, 4, submeshes=[(1, 1)]).objective == pytest.approx(5 * 3.0)
    with pytest.raises(PipelinePlanError, match="no pipeline fits"):
        stage_dp(2, (1, 2), cost, 2.5, 4, schedule="zb-h1", submeshes=[(1, 1)])
    assert [s.in_flight for s in stage_dp(2, (1, 2), cost, 2.5, 4, submeshes=[(1, 1)]).stages] == [2, 1]
    assert bubble_fraction([3.0, 3.0], 4, "zb-h1") == pytest.approx(1 / 13)  # r (S-1) / (B + r (S-1)), r = 1/3


def test_submesh_shapes():
    assert submesh_shapes((2, 8)) == [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8)]
    assert submesh_shapes((3, 2)) == [(1, 1), (1, 2), (2, 2), (3, 2)]
    assert submesh_shapes((8, 8), power_of_two=True) == [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (4, 8), (8, 8)]


def test_gpt_planned_into_stages(tmp_path):
    model, example = build_model("gpt-tiny", 8, 16, device="meta", num_layers=4)
    mesh = LogicalMesh((1, 4), cluster="cpu-gloo")
    p = plan(model, example, mesh, num_stages=2, schedule="1f1b", num_microbatches=4, num_layers=4)
    assert len(p.stages) == 2 and p.num_microbatches == 4 and p.schedule == "1f1b"
    ranks = [r for s in p.stages for r in s.ranks]
    assert sorted(ranks) == [0, 1, 2, 3]
    nodes = [n for s in p.stages for n in s.nodes]
    assert len(nodes) == len(set(nodes))  # every node in exactly one stage
    # the stages' own intra-op plans cover their nodes, on meshes of their submesh's size
    for s in p.stages:
        assert set(s.nodes) <= set(s.plan.nodes)
        assert s.plan.mesh.num_devices == len(s.ranks)
    t = [s.seconds for s in p.stages]
    assert p.step_seconds == pytest.approx(sum(t) + sum(s.once_seconds for s in p.stages) + 3 * max(t))
    assert p.bubble_fraction == pytest.approx(bubble_fraction(t, 4))
    back = load_plan(p.to_json())
    assert back.to_json() == p.to_json()
    assert [s.ranks for s in back.stages] == [s.ranks for s in p.stages]
    with pytest.raises(PipelinePlanError, match="num_stages=9"):
        plan(model, example, mesh, num_stages=9, num_microbatches=4, num_layers=4)


def test_stage_count_reachable_only_without_the_balance_pruning():
    """gpt-tiny's layers are far from equal in FLOPs: 4 stages on 4 devices exist only among the
    (range, submesh) pairs the FLOPs-balance pruning drops; the planner then uses them all."""
    model, example = build_model("gpt-tiny", 8, None, device="meta")
    p = plan(model, example, LogicalMesh((1, 4), cluster="a100"), num_stages=4, num_microbatches=4)
    assert len(p.stages) == 4 and sorted(r for s in p.stages for r in s.ranks) == [0, 1, 2, 3]


def _tiny_stage_costs(cluster_shape=(2, 2), batch=8, seq=16, options=None):
    from alpa_lite.core.capture import capture
    from alpa_lite.compiler.clustering import cluster_layers
    from alpa_lite.compiler.stage_costs import GraphStageCosts

    model, example = build_model("gpt-tiny", batch, seq, device="meta", num_layers=4)
    cg = capture(model, example)
    mesh = LogicalMesh(cluster_shape, cluster="a100")
    return GraphStageCosts(cg, cluster_layers(cg, 4), mesh.as_cluster(), mesh.memory_bytes, max_in_flight=4,
                           num_microbatches=4, options=options)


def test_ilp_answer_reused_only_when_provably_the_same():
    """An answer under memory constraint w + s a <= M is reused for (s', M') only when s' >= s,
    M' <= M and it satisfies the new constraint (or it was infeasible)."""
    costs = _tiny_stage_costs()
    calls = []

    def solver(answer, terms):
        def solve():
            calls.append(answer)
            if answer is None:
                from alpa_lite.compiler.stage_costs import _Infeasible
                raise _Infeasible("no fit")
            return answer, terms, []
        return solve

    assert costs._solve("k", 1, 100.0, solver("A", (40.0, 20.0))) == "A"
    assert costs._solve("k", 2, 90.0, solver("B", (0.0, 0.0))) == "A"  # 40 + 2 * 20 <= 90: same optimum
    assert costs._solve("k", 4, 90.0, solver("C", (10.0, 10.0))) == "C"  # 40 + 4 * 20 > 90: solved
    assert costs._solve("k", 1, 200.0, solver("D", (0.0, 0.0))) == "D"  # looser: solved
    assert costs._solve("k", 1, 30.0, solver("A", (40.0, 20.0))) == "D"  # D (0 bytes) fits 30 too
    assert costs._solve("j", 1, 30.0, solver(None, None)) is None
    assert costs._solve("j", 2, 20.0, solver("E", (0.0, 0.0))) is None  # tighter than an infeasible one
    assert costs._solve("j", 1, 40.0, solver("F", (0.0, 0.0))) == "F"  # looser than it: solved
    assert calls == ["A", "C", "D", None, "F"]


def test_kept_layer_answer_not_reused_where_it_does_not_fit():
    """``remat="auto"``: a layer kept under a loose budget has its activations in the answer's
    ``a`` (counted per microbatch in flight), so a budget they do not fit at 2 in flight is solved
    again (the layer recomputed: its activations once, in ``w``); the loose one is then reused."""
    from alpa_lite.core.options import PlanOptions

    costs = _tiny_stage_costs(options=PlanOptions(remat="auto"))
    names = costs.subset(1, 2)
    assert costs.remat(1, 2) == [costs.layers[1].nodes]
    kept = costs._layer_part(1, names, (2, 2), 2, costs.memory_bytes, {})
    (w, a), = [e[3] for e in costs._cache.values() for e in e]
    assert not kept[6] and kept[5] == 0 and a == kept[3] > 0
    tight = w + 1.5 * a
    again = costs._layer_part(1, names, (2, 2), 2, tight, {})
    assert costs.stats["ilp_solves"] == 2 and costs.stats["cache_hits"] == 0
    w2, a2 = next(iter(costs._cache.values()))[-1][3]
    assert again[6] and again[5] > 0 and a2 == again[3] < a and w2 == again[2] + again[5]
    assert w2 + 2 * a2 <= tight
    assert costs._layer_part(1, names, (2, 2), 2, costs.memory_bytes, {}) == kept
    assert costs.stats["cache_hits"] == 1


def test_stage_costs_from_worker_processes_equal_serial():
    """The worker processes (one per submesh and logical shape) give the options, ILP count and
    limits of a serial run; at 2 MB some options hold 2 microbatches in flight (solved after the
    workers', in this process), the others one."""
    from alpa_lite.compiler.stage_costs import GraphStageCosts

    keys = [(k, i, q) for k in range(4) for i in range(k + 1, 5) for q in submesh_shapes((2, 2))]
    tiny = _tiny_stage_costs()
    serial, forked = (GraphStageCosts(tiny.cg, tiny.layers, tiny.cluster, 2e6, max_in_flight=4, num_microbatches=4)
                      for _ in range(2))
    serial.prefetch(keys, workers=1)
    forked.prefetch(keys, workers=2)
    timeless = [{k: v for k, v in c.stats.items() if k != "ilp_s"} for c in (serial, forked)]
    assert timeless[0] == timeless[1] and timeless[0]["ilp_solves"] > 0
    assert serial.limits == forked.limits and serial.refusals == forked.refusals
    for key in keys:
        a, b = serial(*key), forked(*key)
        assert [(o.seconds, o.once_seconds, o.weight_bytes, o.act_bytes, o.payload) for o in a] == \
               [(o.seconds, o.once_seconds, o.weight_bytes, o.act_bytes, o.payload) for o in b]
    assert any(serial(*key) for key in keys)
    scales = {o.payload[1] for key in keys for o in serial(*key)}
    assert scales == {1, 2}


def test_stage_pays_the_gather_of_what_it_sends():
    """A stage sends its values on replicated: a batch-split value costs one all-gather of the
    whole value (its gradient comes back whole), a replicated one nothing; the exact stage ILP
    and the chain both carry it."""
    from alpa_lite.core.spec import ShardingSpec
    from alpa_lite.compiler.stage_costs import send_gather_seconds, solve_stage

    costs = _tiny_stage_costs((1, 4), batch=64, seq=256)
    cg = costs.cg
    sent = costs.sends(0, 2)
    layer_of = {n: j for j, layer in enumerate(costs.layers) for n in layer.nodes}
    assert sent and all(layer_of[n] < 2 and any(layer_of.get(u.name, -1) >= 2 for u in cg.node(n).users)
                        for n in sent)
    assert costs.sends(0, 4) == [] and costs.sends(2, 3) != sent
    mesh = costs.cluster.logical_mesh((1, 4))
    hidden = next(n for n in sent if len(cg.node(n).meta["val"].shape) == 3)
    val = cg.node(hidden).meta["val"]
    nbytes = val.numel() * val.element_size()
    assert send_gather_seconds(cg, hidden, ShardingSpec.parse("RRR"), mesh) == 0.0
    assert send_gather_seconds(cg, hidden, ShardingSpec.parse("S1RR"), mesh) == pytest.approx(
        mesh.all_gather_cost(nbytes, (1,)))
    names = costs.subset(0, 2)
    free = solve_stage(cg, names, mesh, mesh.memory_bytes, table=costs.table((1, 4), 0, 2))
    paid = solve_stage(cg, names, mesh, mesh.memory_bytes, table=costs.table((1, 4), 0, 2), sends=sent)
    def gathers(sol):
        return sum(send_gather_seconds(cg, n, ShardingSpec.parse(sol.nodes[n].out_specs[0]), mesh) for n in sent)

    assert gathers(free) > 0  # unpriced, the stage leaves what it sends split
    # paid is optimal with the gathers, free without them: each bounds the other
    assert free.seconds - 1e-12 <= paid.seconds - gathers(paid)
    assert paid.seconds <= free.seconds + gathers(free) + 1e-12
    assert paid.seconds > free.seconds


@pytest.mark.parametrize("mode", ["chain", "exact"])
def test_stage_plans_carry_the_gradient_syncs_of_their_specs(mode):
    """A stage's gradient syncs are derived once, from the whole stage (``training_step.training_step``):
    a chained stage's per-layer solutions leave them on their edges. Under data parallelism every
    parameter of every stage is all-reduced after the last microbatch, over the stage's batch
    axes; a weight two layers of one stage use (the tied embedding) once. The position table's
    lookup is not split by batch, but its output's gradient is a partial sum over the batch axes,
    so its weight's local gradient is bucketed too (``CapturedGraph.param_lookups``)."""
    model, example = build_model("gpt-tiny", 8, 16, device="meta")
    for cluster, stages in (((2, 2), 2), ((2, 2), 1)):
        p = plan(model, example, LogicalMesh(cluster, cluster="cpu-gloo"), force_data_parallel=True,
                 pipeline=PipelineOptions(num_stages=stages, num_microbatches=2, stage_solve=mode, workers=1))
        for s in p.stages:
            params = [ph for ph in s.plan.nodes if ph in p.captured.param_fqns]
            axes = tuple(a for a in (0, 1) if s.plan.mesh.shape[a] > 1)
            assert "p_model_wpe_weight" in params or stages == 2
            assert s.plan.grad_sync == {ph: axes for ph in params}, (mode, cluster, stages)
            assert not [n for n, np_ in s.plan.nodes.items() for src, gp in zip(np_.inputs, np_.grad_partial)
                        if src in params and gp]  # none left in the graph: each is synced once
            assert s.once_seconds > 0 and any(c.node.startswith("gradient bucket") for c in s.plan.collectives)


def test_layers_that_differ_only_in_a_keyword_argument_do_not_share_an_ilp_answer():
    """``_node_signature`` reads arguments by schema name with defaults: sdpa's ``scale`` given by
    keyword (it is keyword-only) differs from the default scale, and ``is_causal`` counts the same
    given by keyword or by position."""
    import torch.fx
    from alpa_lite.compiler.stage_costs import _node_signature

    aten = torch.ops.aten
    sdpa = aten.scaled_dot_product_attention.default
    g = torch.fx.Graph()
    q, k, v = (g.placeholder(n) for n in "qkv")
    calls = {"default": g.call_function(sdpa, (q, k, v)),
             "kw-scale": g.call_function(sdpa, (q, k, v), {"scale": 0.5}),
             "kw-causal": g.call_function(sdpa, (q, k, v), {"is_causal": True}),
             "pos-causal": g.call_function(sdpa, (q, k, v, None, 0.0, True)),
             "pos-default": g.call_function(sdpa, (q, k, v, None, 0.0, False))}
    cg = type("CG", (), {"param_fqns": {}, "buffer_fqns": {}, "input_names": [], "requires_grad": set()})()
    sig = {name: _node_signature(n, cg) for name, n in calls.items()}
    assert sig["kw-scale"] != sig["default"] == sig["pos-default"]
    assert sig["kw-causal"] == sig["pos-causal"] != sig["default"]


def test_lower_bound_is_below_every_option():
    """``GraphStageCosts.lower_bound`` (each node's least compute over every device, plus the
    input transfer) never exceeds an option's time: the pipeline search drops (range, submesh)
    pairs by it without pricing them."""
    keys = [(k, i, q) for k in range(4) for i in range(k + 1, 5) for q in submesh_shapes((2, 2))]
    costs = _tiny_stage_costs()
    costs.prefetch(keys, workers=1)
    priced = [(costs.lower_bound(*key), min(o.seconds for o in costs(*key))) for key in keys if costs(*key)]
    assert len(priced) > len(keys) // 2
    assert all(0 < bound <= seconds * (1 + 1e-12) for bound, seconds in priced)  # float rounding
    assert max(bound / seconds for bound, seconds in priced) > 0.1  # a bound that can prune
    acts = [(costs.least_act_bytes(*key), min(o.act_bytes for o in costs(*key))) for key in keys if costs(*key)]
    assert all(0 < least <= a * (1 + 1e-12) for least, a in acts)
    weights = [(costs.least_weight_bytes(*key), min(o.weight_bytes for o in costs(*key))) for key in keys if costs(*key)]
    assert all(0 < least <= w * (1 + 1e-12) for least, w in weights)
    assert max(least / w for least, w in weights) > 0.99  # ZeRO-3 over every device reaches it


@pytest.mark.parametrize("name,overrides", [("gpt-tiny", {"num_layers": 2}), ("moe", {}), ("wide-resnet", {}),
                                            ("mlp", {})])
def test_least_compute_and_activations_are_below_every_strategy(name, overrides):
    """``stage_costs.least_compute_seconds`` over the mesh's devices is at most the compute of every
    strategy of its node (ZeRO-1/2 ones included), on meshes of 1 to 8 devices, and equals the
    least one for many nodes (an op split over every device, a parameter's update under ZeRO-3);
    so does ``least_activation_bytes`` against the memory the cost graph counts for each result."""
    from alpa_lite.core.capture import capture
    from alpa_lite.compiler.stage_costs import least_activation_bytes, least_compute_seconds
    from alpa_lite.compiler.strategies import build_strategies, kept_for_backward
    from alpa_lite.compiler.zero import add_zero_strategies

    model, example = build_model(name, 8, 16, device="meta", **overrides)
    cg = capture(model, example)
    for shape in [(1, 1), (1, 2), (2, 2), (2, 4)]:
        mesh = LogicalMesh(shape, cluster="a100")
        table = build_strategies(cg, mesh)
        add_zero_strategies(cg, table, mesh, 25 * 2**20, list(cg.param_fqns))
        pairs = [(least_compute_seconds(cg, cg.node(n), mesh) / mesh.num_devices, min(s.compute for s in ns.strategies))
                 for n, ns in table.items()]
        assert all(bound <= least * (1 + 1e-12) for bound, least in pairs), shape
        assert sum(least > 0 and bound >= least * (1 - 1e-12) for bound, least in pairs) > len(pairs) / 3, shape
        acts = [(least_activation_bytes(cg, cg.node(n), mesh.num_devices),
                 min(s.memory for s in ns.strategies) * kept_for_backward(cg.node(n)))
                for n, ns in table.items() if n not in cg.param_fqns and n not in cg.buffer_fqns]
        assert all(bound <= least * (1 + 1e-12) for bound, least in acts), shape
        assert sum(least > 0 and bound >= least * (1 - 1e-12) for bound, least in acts) > len(acts) / 5, shape


def test_range_whose_weights_and_activations_exceed_memory_gets_no_ilp():
    """A (range, submesh) whose weights and activations split over all its devices already exceed
    the memory has no option: ``GraphStageCosts`` returns none without an ILP, as pricing it finds
    after its ILPs, and its lower bound is inf (the floors drop every pipeline holding it)."""
    costs = _tiny_stage_costs()
    key = (0, 4, (1, 1))
    least = costs.least_weight_bytes(*key) + costs.least_act_bytes(*key)
    assert costs.least_act_bytes(*key) > 0
    costs.memory_bytes = least * 0.99
    assert costs(*key) == [] and costs.stats["ilp_solves"] == 0 and costs.lower_bound(*key) == math.inf
    priced = _tiny_stage_costs()
    priced.memory_bytes = least * 0.99
    priced.least_weight_bytes = priced.least_act_bytes = lambda *a: 0.0
    priced._check_memory = lambda *a, **k: None
    assert priced(*key) == [] and priced.stats["ilp_solves"] > 0


def test_stage_ilp_that_cannot_meet_its_memory_row_is_not_built():
    """Under a budget some layers cannot meet, ``GraphStageCosts._check_memory`` refuses the stage
    ILPs whose nodes' least memory alone exceeds the row (no cost graph, no solve), and every
    (range, submesh) gets the options of the search that builds and solves them all."""
    keys = [(k, i, q) for k in range(4) for i in range(k + 1, 5) for q in submesh_shapes((2, 2))]
    full = _tiny_stage_costs()
    full.memory_bytes = 3 * min(full.least_weight_bytes(*key) for key in keys)
    full._check_memory = lambda *a, **k: None
    checked = _tiny_stage_costs()
    checked.memory_bytes = full.memory_bytes
    full._may_fit = checked._may_fit = lambda *a: True  # every pair to its ILPs (else most are refused before)
    for key in keys:
        assert checked(*key) == full(*key), key
    assert checked.stats["memory_skips"] > 0
    assert checked.stats["ilp_solves"] == full.stats["ilp_solves"]  # a refused ILP counts as tried
    assert any(full(*key) for key in keys) and not all(full(*key) for key in keys)


def test_a_limit_reached_while_pricing_stages_is_in_the_plan_and_its_summary(monkeypatch):
    """Every stage-pricing ILP whose solver stops at a limit is listed in the pipelined plan
    (layer range, submesh, logical mesh, gap), survives JSON, and is printed by the summary; the
    stages' own re-solves are listed per stage as before."""
    from rich.console import Console

    from alpa_lite.compiler import stage_costs
    from alpa_lite.tools.explain import summary_table

    real = stage_costs.solve

    def stopped_early(*args, **kwargs):
        sol = real(*args, **kwargs)
        sol.status, sol.gap = "TimeLimit", 0.25
        return sol

    model, example = build_model("gpt-tiny", 8, 16, device="meta", num_layers=2)
    mesh = LogicalMesh((1, 4), cluster="a100")
    pipe = PipelineOptions(num_microbatches=2, workers=1)
    assert plan(model, example, mesh, pipeline=pipe).solver_limits == []
    monkeypatch.setattr(stage_costs, "solve", stopped_early)
    p = plan(model, example, mesh, pipeline=pipe, time_limit=5.0)
    pricing = [e for e in p.solver_limits if "stage" not in e]
    assert pricing == p.pricing_limits and len(pricing) == p.stats["ilp_solves"] > 0  # every solve stopped early
    # a real solve stopped by the 5 s wall clock before any answer (a loaded machine) is listed with no gap
    assert {e["gap"] for e in pricing} - {None} == {0.25} and {e["microbatches"] for e in pricing} == {2}
    assert all(e["limit"] == "time" for e in pricing if e["gap"] is None)
    # the submeshes priced: the whole mesh (its one-stage pair first), the others as the floors let them
    assert (1, 4) in {tuple(e["submesh"]) for e in pricing} <= {(1, 1), (1, 2), (1, 4)}
    last = p.stats["layers"] - 1
    assert (0, last) in {tuple(e["layers"]) for e in pricing}  # the whole model: one ILP
    two = plan(model, example, mesh, pipeline=PipelineOptions(num_stages=2, num_microbatches=2, workers=1),
               time_limit=5.0)  # no whole-model stage: the stages' ranges are chains of per-layer ILPs
    assert {tuple(e["layers"]) for e in two.pricing_limits} >= {(j, j) for j in range(last + 1)}
    one = next(e for e in pricing if e["layers"] == [0, last])
    assert one["ilp"].startswith(f"stage pricing B=2: layers 0-{last} on submesh 1x4 (logical ")
    per_stage = [e for e in p.solver_limits if "stage" in e]
    assert per_stage and {e["stage"] for e in per_stage} == set(range(len(p.stages)))
    assert load_plan(p.to_json()).solver_limits == p.solver_limits
    console = Console(width=400, record=True)
    console.print(summary_table(p))
    text = console.export_text()
    assert f"{one['ilp']}: time limit, gap 25.00%" in text and "stage 0 " in text


@pytest.mark.parametrize("layers,cluster,b,memory,stages", [(4, (1, 4), 8, 4.0, None), (4, (2, 2), 4, 7.0, None),
                                                            (5, (1, 4), 2, 5.0, 3), (4, (2, 4), 6, 4.5, None),
                                                            (3, (1, 4), 4, 1e9, None)])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_gpipe_is_dominated_by_1f1b(layers, cluster, b, memory, stages, seed):
    """``inter_op.dp_schedules("auto")`` leaves GPipe out: on the same options every pipeline that
    fits under GPipe fits under 1F1B with the same step (checked on each of them, by brute
    force), so 1F1B's optimum is at most GPipe's, and where it is equal the search keeps 1F1B's
    (it comes first in ``SCHEDULES``); where GPipe fits nothing 1F1B may still."""
    from alpa_lite.compiler.inter_op import dp_schedules
    from alpa_lite.core.schedules import SCHEDULES

    assert dp_schedules("auto") == [s for s in SCHEDULES if s != "gpipe"] and dp_schedules("gpipe") == ["gpipe"]
    assert list(SCHEDULES).index("1f1b") < list(SCHEDULES).index("gpipe")
    cost = synthetic_cost(layers, seed)
    one = exhaustive_stage_search(layers, cluster, cost, memory, b, num_stages=stages, schedule="1f1b")
    assert stage_dp(layers, cluster, cost, memory, b, num_stages=stages, schedule="1f1b").objective == \
        pytest.approx(one.objective, rel=1e-12)
    try:
        gpipe = exhaustive_stage_search(layers, cluster, cost, memory, b, num_stages=stages, schedule="gpipe")
    except PipelinePlanError:
        return
    assert one.objective <= gpipe.objective
    n = len(gpipe.stages)  # GPipe's pipeline, run under 1F1B: fits, the same step
    assert all(s.option.fits(in_flight(n - i, n, b, "1f1b"), memory) for i, s in enumerate(gpipe.stages))
    t = [s.option.seconds for s in gpipe.stages]
    assert step_seconds(get_schedule("1f1b"), t, b) == step_seconds(get_schedule("gpipe"), t, b)


@pytest.mark.parametrize("schedule", [("1f1b",), ("zb-h1",), ("interleaved",), ("gpipe",),
                                      ("1f1b", "zb-h1", "interleaved")])
def test_in_flight_need_is_the_most_any_pipeline_holds(schedule):
    """``GraphStageCosts.in_flight_need`` of every (range, submesh) of 4 layers on 2x2 that a
    pipeline holds is the most microbatches its stage holds over every such pipeline (brute force
    over the stage DP's pipelines, B = 4); under interleaved (its pipelines on equal groups of
    ``p >= 2``) at least that, B on a half of the devices or less."""
    from alpa_lite.compiler.stage_costs import GraphStageCosts

    L, cluster, b = 4, (2, 2), 4
    shapes = submesh_shapes(cluster)
    costs = object.__new__(GraphStageCosts)  # only what in_flight_need reads
    costs.layers, costs.max_in_flight, costs.schedules = [None] * L, b, schedule
    costs.cluster = type("Cluster", (), {"num_devices": 4})()
    most = {}
    for name in schedule:
        sched = get_schedule(name)
        pipes = partitions(L, shapes, 4)
        if name == "interleaved":  # 2 chunks on each of p = 4 / |q| >= 2 groups dividing B: 2 p stages on q
            pipes = [p for p in partitions(L, shapes, 8) if len({q for _, _, q in p}) == 1
                     and 4 // _size(p[0][2]) >= 2 and len(p) == 2 * (4 // _size(p[0][2]))]
            assert pipes
        for p in pipes:
            for idx, key in enumerate(p):
                most[key] = max(most.get(key, 1), sched.in_flight(idx, len(p), b))
    for k in range(L):
        for i in range(k + 1, L + 1):
            for q in shapes:
                need = costs.in_flight_need(k, i, q)
                if "interleaved" in schedule:  # every pair on a quarter or half of the devices: up to B
                    assert need >= most.get((k, i, q), 1) and need == (b if 2 * _size(q) <= 4 else 1), (k, i, q)
                elif (k, i, q) in most:  # elsewhere the pair is in no pipeline: any count is safe
                    assert need == most[k, i, q], (k, i, q)
    assert costs.in_flight_need(0, L, cluster) == (b if "gpipe" in schedule else 1)  # the one-stage pair


def _size(q):
    return q[0] * q[1]


def test_chain_gives_each_layer_its_least_memory_before_one_ilp(monkeypatch):
    """Where no equal split of the memory fits (gpt-tiny's layers 0-2 on 2x2 at 1.05x their least
    memory), each layer gets its least memory and a third of the rest (``split_budgets``): that
    chain fits, and no ILP over the whole range is solved; that ILP, searching a superset, is
    at least as fast."""
    probe = _tiny_stage_costs()
    least = [probe.least_weight_bytes(j, j + 1, (2, 2)) + probe.least_act_bytes(j, j + 1, (2, 2)) for j in range(3)]
    costs = _tiny_stage_costs()
    costs.memory_bytes = 1.05 * sum(least)
    split = costs.split_budgets(0, 3, (2, 2), 1)
    assert sum(split) == pytest.approx(costs.memory_bytes, rel=1e-12)
    assert [b - m for b, m in zip(split, least)] == pytest.approx([0.05 * sum(least) / 3] * 3, rel=1e-9)
    for j in range(2):  # the equal splits do not fit
        opt = costs._chain_option(0, 3, (2, 2), 1, costs.memory_bytes / 2 ** j, (2, 2))
        assert opt is None or not opt.fits(1, costs.memory_bytes)
    whole = []
    monkeypatch.setattr(costs, "_solve_cached", lambda *a, **k: whole.append(a))
    options = costs(0, 3, (2, 2))
    assert not whole and options
    chained = [o for o in options if o.payload[2] == split]
    assert chained and all(o.fits(1, costs.memory_bytes) for o in chained)
    monkeypatch.undo()
    exact = costs._solve_cached(costs._signature(costs.subset(0, 3)), costs.subset(0, 3), (2, 2), 1, 0, 3, (2, 2))
    best = min(o.seconds + o.once_seconds for o in chained) - costs.transfer_seconds(0, (2, 2))
    assert exact.seconds + exact.once_seconds <= best * (1 + 1e-9)


def test_no_stage_ilp_for_more_microbatches_in_flight_than_the_range_can_hold(monkeypatch):
    """gpt-tiny's layers 0-1 on a 1x2 submesh of 2x2 hold up to 3 microbatches in flight (1F1B).
    With the memory at their least weights and 1.5x their least activations, one microbatch may
    fit and two cannot (``least_weight_bytes + 2 least_act_bytes`` is above it), though each layer
    alone can: no ILP is solved for two in flight (each layer's ILP under the whole memory was),
    and the options are those of the search that solved them."""
    from alpa_lite.compiler import stage_costs

    key = (0, 2, (1, 2))
    probe = _tiny_stage_costs()
    w, a = probe.least_weight_bytes(*key), probe.least_act_bytes(*key)
    assert probe.in_flight_need(*key) == 3
    solve_stage = stage_costs.solve_stage

    def options(prune: bool):
        costs = _tiny_stage_costs()
        costs.memory_bytes = w + 1.5 * a
        if not prune:  # every scale tried, as before the bound
            monkeypatch.setattr(costs, "_may_fit", lambda *k: True)
        scales = []
        monkeypatch.setattr(stage_costs, "solve_stage", lambda *args, **kw: scales.append(args[4]) or solve_stage(*args, **kw))
        return costs(*key), scales

    pruned, scales = options(True)
    full, full_scales = options(False)
    assert pruned and set(scales) == {1}
    assert max(full_scales) > 1  # the ILPs the bound saves
    assert pruned == full


def test_stage_ilp_weighs_a_cast_parameters_gradient_sync_once_per_step():
    """Under mixed precision a weight's uses read its bf16 cast; their data-parallel gradient
    syncs run once per step (bucketed after the last microbatch) as an fp32 weight's do, so the
    stage ILP weighs every one of them ``1 / B`` (before, only the syncs on a parameter's own
    edges were: none under bf16)."""
    import torch

    from alpa_lite.compiler import stage_costs
    from alpa_lite.compiler.cost_graph import build_cost_graph
    from alpa_lite.compiler.strategies import build_strategies
    from alpa_lite.core.capture import capture
    from alpa_lite.core.resharding import reshard_costs

    model, example = build_model("gpt-tiny", 8, 16, device="meta")
    mesh = LogicalMesh((1, 4), cluster="cpu-gloo")
    discounted = {}
    for dtype in (None, torch.bfloat16):
        cg = capture(model, example, compute_dtype=dtype)
        table = build_strategies(cg, mesh)
        names = list(table)
        graph, where = build_cost_graph(cg, table, mesh, nodes=set(names))
        added = []
        graph.add_edge = lambda u, v, m: added.append(min(map(min, m)))  # noqa: B023 - used at once
        stage_costs._discount_gradient_sync(cg, table, where, graph, names, reshard_costs(mesh), 0.25)
        discounted[dtype] = len(added)
        assert all(c < 0 for c in added)
    uses = sum(len(cg.node(ph).users) for ph in cg.param_fqns)  # the bf16 graph: one cast per use
    assert discounted[None] == discounted[torch.bfloat16] == uses


@pytest.mark.skipif(not highs_available(), reason="needs highspy")
def test_memory_tight_moe_chain_same_with_highs_and_cbc():
    """V100 MoE 27B / 4x8 at B = 64 (benchmarks/plan_quality.py's case: batch 1024, seq 1024):
    layers 0-3 as a chain on submesh 2x8, logical 4x4, one then two microbatches in flight (the
    split budgets). HiGHS with its dominated-column presolve rejected the optimum of a layer's
    ILP after postsolve and returned one 2.26x slower as "Optimal" (docs/plan_time.md, tenth
    round): every chain part (a layer's ILP) must price as CBC's."""
    from alpa_lite.compiler.clustering import cluster_layers
    from alpa_lite.compiler.stage_costs import GraphStageCosts
    from alpa_lite.core.capture import capture
    from alpa_lite.core.options import PlanOptions

    model, example = build_model("moe-27b", 1024 // 64, 1024, device="meta")
    cg = capture(model, example)
    layers = cluster_layers(cg, 8)
    mesh = LogicalMesh((4, 8), cluster="v100")
    found = {}
    for solver in ("highs", "cbc"):
        costs = GraphStageCosts(cg, layers, mesh.as_cluster(), mesh.memory_bytes, max_in_flight=64, num_microbatches=64,
                                options=PlanOptions(time_limit=120.0, solver=solver))
        for scale in (1, 2):
            costs._shape_options(0, 4, (2, 8), (4, 4), scale)
        found[solver] = {key: [part[0] for part in chain["parts"]] for key, chain in costs._chains.items()}
    assert found["highs"].keys() == found["cbc"].keys() and sum(map(len, found["cbc"].values())) >= 6, found
    assert found["highs"] == {k: pytest.approx(v, rel=1e-5) for k, v in found["cbc"].items()}, found
