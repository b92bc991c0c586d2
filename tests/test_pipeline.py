"""Pipelined execution: schedules, displays, and 4-process training equal to one process.

Tolerances as in tests/test_runtime.py (fp32, AdamW lr 1e-2, 3 steps): losses to 1e-5 relative,
parameters to 2e-4 absolute. A lost microbatch, a gradient sent to the wrong stage or a tied
weight updated from one stage only moves parameters by O(lr) = 1e-2 per step.
"""
import json
from pathlib import Path

import pytest
from rich.console import Console

from alpa_lite import LogicalMesh, load_plan, plan
from alpa_lite.runtime.launch import torchrun
from alpa_lite.zoo.models import build_model
from alpa_lite.compiler.stage_dp import PipelinePlanError, StageOption, bubble_fraction, stage_dp
from alpa_lite.core.schedules import (SCHEDULES, ZBH1, GPipe, Interleaved, OneFOneB, get_schedule, simulate,
                                      step_seconds)
from alpa_lite.tools.display import schedule_chart, stages_table

WORKER = str(Path(__file__).parent / "workers" / "pipeline_equivalence.py")


def compute(actions):
    return [(a.kind[0].upper(), a.microbatch) for a in actions if a.kind in ("forward", "backward")]


def test_1f1b_order_and_in_flight():
    s = OneFOneB()
    assert compute(s.actions(0, 2, 4)) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
    assert compute(s.actions(1, 2, 4)) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)]
    assert [s.peak_in_flight(i, 4, 8) for i in range(4)] == [4, 3, 2, 1]
    assert [GPipe().peak_in_flight(i, 4, 8) for i in range(4)] == [8, 8, 8, 8]
    kinds = [a.kind for a in s.actions(1, 3, 1)]
    assert kinds == ["recv_act", "forward", "send_act", "recv_grad", "backward", "send_grad"]
    with pytest.raises(ValueError, match="unknown schedule"):
        get_schedule("zero-bubble")


def test_zb_h1_order():
    # 1F1B's F / B order; stage s runs each W once s more Bs have run, the rest at the end
    z = ZBH1()
    assert [(k[0].upper(), m) for k, m, _ in z.compute_order(0, 2, 4)] == [
        ("F", 0), ("F", 1), ("B", 0), ("W", 0), ("F", 2), ("B", 1), ("W", 1), ("F", 3), ("B", 2), ("W", 2),
        ("B", 3), ("W", 3)]
    assert [(k[0].upper(), m) for k, m, _ in z.compute_order(1, 2, 4)] == [
        ("F", 0), ("B", 0), ("F", 1), ("B", 1), ("W", 0), ("F", 2), ("B", 2), ("W", 1), ("F", 3), ("B", 3),
        ("W", 2), ("W", 3)]
    kinds = [a.kind for a in z.actions(1, 3, 1)]
    assert kinds == ["recv_act", "forward", "send_act", "recv_grad", "backward", "send_grad", "weight"]


@pytest.mark.parametrize("name", [n for n in SCHEDULES if n != "interleaved"])
@pytest.mark.parametrize("stages,b", [(1, 3), (2, 1), (2, 4), (3, 2), (4, 4), (4, 8), (5, 7)])
def test_schedule_tables(name, stages, b):
    sched = get_schedule(name)
    kinds = ("forward", "backward", "weight") if sched.split_backward else ("forward", "backward")
    for s in range(stages):
        order = sched.compute_order(s, stages, b)
        # every pass of every microbatch exactly once, a microbatch's passes in order F, B, W
        assert sorted(order) == sorted((k, m, 0) for k in kinds for m in range(b)), (s, order)
        for m in range(b):
            assert [k for k, mb, _ in order if mb == m] == list(kinds), (s, m)
        # the peak the runtime meets is the closed form the stage DP uses: ZB-H1 holds 1F1B's
        # first-stage peak min(S, B) on every stage, 1F1B min(S - s, B), GPipe B
        want = {"gpipe": b, "1f1b": min(stages - s, b), "zb-h1": min(stages, b)}[name]
        assert sched.peak_in_flight(s, stages, b) == sched.in_flight(s, stages, b) == want
    # dependencies across stages hold in the simulated timeline (simulate raises on a deadlock)
    slots = {(x.stage, x.kind, x.microbatch): x for x in simulate(sched, [1.0] * stages, [2.0] * stages, b)}
    assert len(slots) == stages * b * len(kinds)
    for (s, kind, m), x in slots.items():
        if kind == "forward" and s > 0:
            assert x.start >= slots[(s - 1, "forward", m)].end
        if kind == "backward":
            assert x.start >= (slots[(s + 1, "backward", m)] if s < stages - 1 else slots[(s, "forward", m)]).end
        if kind == "weight":
            assert x.start >= slots[(s, "backward", m)].end


@pytest.mark.parametrize("stages,b", [(2, 2), (2, 5), (4, 4), (4, 8), (3, 9)])
def test_bubble_formulas_match_the_simulation(stages, b):
    # unit times F = 1, B = 2 (ZB-H1: input-gradient 1, weight 1); B >= S. The closed forms:
    # GPipe and 1F1B (B + S - 1) 3, ZB-H1 3 B + (S - 1)(F + B - W) = 3 B + S - 1 (Qi et al., section 3.1)
    want = {"gpipe": 3 * (b + stages - 1), "1f1b": 3 * (b + stages - 1), "zb-h1": 3 * b + stages - 1}
    for name, total in want.items():
        sched = get_schedule(name)
        end = max(x.end for x in simulate(sched, [1.0] * stages, [2.0] * stages, b))
        assert end == pytest.approx(total) == pytest.approx(step_seconds(sched, [3.0] * stages, b)), name


@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (2, 2, 4), (2, 3, 6), (3, 2, 3), (3, 2, 9), (4, 2, 4), (4, 2, 8),
                                   (4, 3, 12)])
def test_interleaved_tables(p, v, m):
    sched, S = Interleaved(v), p * v
    for d in range(p):
        order = sched.compute_order(d, p, m)
        # every forward and backward of every microbatch once per chunk, the forward first
        assert sorted(order) == sorted((k, mb, c) for k in ("forward", "backward") for mb in range(m) for c in range(v))
        for mb in range(m):
            for c in range(v):
                assert [k for k, x, y in order if (x, y) == (mb, c)] == ["forward", "backward"]
        # Megatron's peak: the warm-up forwards 2 (p - d - 1) + (v - 1) p, plus the first steady
        # forward; group 0 holds p v + p - 1 chunk-microbatches once m >= 2p (Korthikanti et al.)
        assert sched.peak_in_flight(d, p, m) == min(2 * (p - d - 1) + (v - 1) * p + 1, v * m)
    if m >= 2 * p:
        assert sched.peak_in_flight(0, p, m) == p * v + p - 1
    slots = {(x.stage, x.kind, x.microbatch): x for x in simulate(sched, [1.0] * S, [2.0] * S, m)}
    assert len(slots) == 2 * S * m
    for (s, kind, mb), x in slots.items():  # stage s runs on group s mod p, after its producer
        dep = (s - 1, "forward", mb) if kind == "forward" else (s + 1, "backward", mb) if s < S - 1 else \
            (s, "forward", mb)
        if dep[0] >= 0:
            assert x.start >= slots[dep].end, (s, kind, mb)
    # F = 1, B = 2 per stage: the step is (v m + p - 1) 3, 1F1B's bubble (p - 1) v 3 divided by v
    end = max(x.end for x in slots.values())
    assert end == pytest.approx(3 * (v * m + p - 1)) == pytest.approx(step_seconds(sched, [3.0] * S, m))
    assert bubble_fraction([3.0] * S, m, "interleaved", v) == pytest.approx((p - 1) / (v * m + p - 1))


def test_interleaved_transfers_and_errors():
    # group 0 of 2 holds stages 0 and 2: chunk 1 receives activations, chunk 0 sends them
    acts = Interleaved(2).actions(0, 2, 2)
    assert [(a.kind, a.microbatch, a.chunk) for a in acts[:6]] == [
        ("forward", 0, 0), ("send_act", 0, 0), ("forward", 1, 0), ("send_act", 1, 0), ("recv_act", 0, 1),
        ("forward", 0, 1)]
    with pytest.raises(ValueError, match="multiple of the device groups"):
        Interleaved(2).compute_order(0, 2, 3)
    with pytest.raises(ValueError, match="chunks >= 2"):
        get_schedule("interleaved", 1)


def test_stage_dp_prices_interleaved():
    # a layer costs 1 s on one device, 0.75 s on two (no perfect scaling); 4 layers, 2 devices, B = 4:
    # one stage on 2 devices 4 * 3 = 12, 1F1B on 2 x 2 layers (4 + 1) 2 = 10, interleaved 4 stages
    # of 1 layer on groups 0, 1, 0, 1: 4 * 2 + (4 - 2) / 2 = 9 (and in flight: its chunks' peaks)
    def cost(k, i, shape):
        return [StageOption((i - k) * (1.0 if shape == (1, 1) else 0.75), 0.0, 1.0)]

    one = stage_dp(4, (1, 2), cost, 100.0, 4, schedule="1f1b")
    il = stage_dp(4, (1, 2), cost, 100.0, 4, schedule="interleaved")
    assert one.objective == pytest.approx(10.0) and il.objective == pytest.approx(9.0)
    assert [(s.start, s.end, s.submesh) for s in il.stages] == [(k, k + 1, (1, 1)) for k in range(4)]
    assert [s.in_flight for s in il.stages] == [Interleaved(2).in_flight(s, 4, 4) for s in range(4)] == [4, 3, 2, 1]
    # each chunk gets half a device: 4 microbatches of 1 byte need 4 <= M / 2
    with pytest.raises(PipelinePlanError, match="no pipeline fits"):
        stage_dp(4, (1, 2), cost, 7.0, 4, schedule="interleaved")
    with pytest.raises(PipelinePlanError, match="interleaved 1F1B with 2 chunks has no layout"):
        stage_dp(4, (1, 2), cost, 100.0, 3, schedule="interleaved")


@pytest.mark.parametrize("schedule", [GPipe(), OneFOneB()])
def test_simulated_step_matches_the_dp_formula(schedule):
    # equal stages: (B + S - 1) t; the DP's sum t_i + (B - 1) max t_i says the same
    slots = simulate(schedule, [1.0] * 4, [2.0] * 4, 6)
    assert max(s.end for s in slots) == pytest.approx((6 + 4 - 1) * 3.0)
    assert len(slots) == 4 * 6 * 2
    # unequal stages: the slowest stage sets the pace of the steady state
    slots = simulate(schedule, [1.0, 2.0], [2.0, 4.0], 4)
    assert max(s.end for s in slots) == pytest.approx(3.0 + 6.0 + 3 * 6.0)


def test_stages_table_and_chart(tmp_path):
    model, example = build_model("gpt-tiny", 8, 16, device="meta", num_layers=2)
    p = plan(model, example, LogicalMesh((1, 2), cluster="cpu-gloo"), num_stages=2, num_microbatches=4,
             schedule="gpipe")
    console = Console(record=True, width=200)
    console.print(stages_table(p))
    text = console.export_text()
    assert "2 stages, gpipe, 4 microbatches" in text and "bubble" in text
    assert text.count("1x1") == 4  # per stage: submesh and logical mesh
    out = schedule_chart(p, tmp_path / "chart.png")
    assert out.stat().st_size > 5000
    with pytest.raises(ValueError, match="no pipeline stages"):
        stages_table(plan(model, example, LogicalMesh((1, 2), cluster="cpu-gloo")))


def megatron(blocks):
    specs = {}
    for i in blocks:
        b = f"blocks.{i}"
        specs |= {f"{b}.attn.qkv.weight": "S1R", f"{b}.attn.proj.weight": "RS1",
                  f"{b}.ffn.fc.weight": "S1R", f"{b}.ffn.proj.weight": "RS1"}
    return specs


def test_pipelined_training_equals_single_process(tmp_path):
    two = {"num_stages": 2, "num_microbatches": 4, "num_layers": 4, "param_specs": megatron(range(4))}
    four = {"num_stages": 4, "num_microbatches": 8, "num_layers": 4}
    cases = {"gpipe_2x2": {"schedule": "gpipe"} | two, "1f1b_2x2": {"schedule": "1f1b"} | two,
             "gpipe_4x1": {"schedule": "gpipe"} | four, "1f1b_4x1": {"schedule": "1f1b"} | four}
    out = tmp_path / "result.json"
    arg = ";".join(f"{k}={json.dumps(v)}" for k, v in cases.items())
    rc = torchrun([WORKER, "--model", "gpt-tiny", "--seq", "16", "--layers", "4", "--cases", arg, "--out", str(out)],
                  nproc=4, timeout_s=420)
    assert rc == 0
    res = json.loads(out.read_text())
    for name, r in res.items():
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5), name
        assert r["max_param_err"] < 2e-4, name
    for name in ("gpipe_2x2", "1f1b_2x2"):
        stages = res[name]["stages"]
        assert [s["ranks"] for s in stages] == [[0, 1], [2, 3]]
        assert all(s["logical"] == [1, 2] for s in stages)
        # intra-op sharding inside each stage: Megatron's column / row split on the stage's axis 1
        assert stages[0]["param_specs"]["blocks.0.attn.qkv.weight"] == "S1R"
        assert stages[1]["param_specs"]["blocks.3.ffn.proj.weight"] == "RS1"
    for name in ("gpipe_4x1", "1f1b_4x1"):
        assert [s["ranks"] for s in res[name]["stages"]] == [[0], [1], [2], [3]]
    # on the first stage 1F1B keeps min(S, B) microbatches in flight, GPipe all B: 2 of 4, 4 of 8
    first = lambda r: max(b for stage, b in r["peak_activation_bytes"] if stage == 0)
    for layout in ("2x2", "4x1"):
        assert first(res[f"1f1b_{layout}"]) == pytest.approx(first(res[f"gpipe_{layout}"]) / 2, rel=0.05), layout


def test_auto_schedule_picks_the_least_predicted_step(tmp_path):
    # memory is ample on 2 stages: ZB-H1's weight passes shorten the drain, so auto picks it
    model, example = build_model("gpt-tiny", 8, 16, device="meta", num_layers=2)
    mesh = LogicalMesh((1, 2), cluster="cpu-gloo")
    kw = {"num_stages": 2, "num_microbatches": 4, "num_layers": 2}
    auto = plan(model, example, mesh, schedule="auto", **kw)
    one = plan(model, example, mesh, schedule="1f1b", **kw)
    assert auto.schedule == "zb-h1" and auto.options["pipeline"]["schedule"] == "auto"
    t = [s.seconds for s in auto.stages]
    assert auto.step_seconds == pytest.approx(sum(s.once_seconds for s in auto.stages) + step_seconds(ZBH1(), t, 4))
    assert auto.step_seconds < one.step_seconds
    assert [s.in_flight for s in auto.stages] == [2, 2] and [s.in_flight for s in one.stages] == [2, 1]
    assert schedule_chart(auto, tmp_path / "zb.png").stat().st_size > 5000


def test_interleaved_plan(tmp_path):
    # 4 layers on 2 devices, 2 chunks: stage s on device s mod 2; the plan's step is the
    # interleaved model's, its memory the sum of each device's chunks; it round-trips through JSON
    model, example = build_model("mlp", 64, None, device="meta", num_layers=4, hidden=16)
    p = plan(model, example, LogicalMesh((1, 2), cluster="cpu-gloo"), schedule="interleaved", num_microbatches=4,
             num_layers=4)
    assert p.schedule == "interleaved" and p.chunks == 2
    assert [s.ranks for s in p.stages] == [[0], [1], [0], [1]]
    t = [s.seconds for s in p.stages]
    assert p.step_seconds == pytest.approx(sum(s.once_seconds for s in p.stages) + step_seconds(Interleaved(2), t, 4))
    assert p.memory_bytes == pytest.approx(max(p.stages[d].memory_bytes + p.stages[d + 2].memory_bytes for d in (0, 1)))
    assert load_plan(p.to_json()).chunks == 2
    assert schedule_chart(p, tmp_path / "il.png").stat().st_size > 5000


def test_interleaved_refuses_a_weight_shared_within_a_device_group():
    # gpt-tiny ties lm_head to the embedding; cut into 4 layers, its 4 interleaved stages on 2
    # devices put the tied weight on two stages of one device group, which the runtime cannot run:
    # the planner says so by name instead of returning that plan; 6 layers leave valid splits, and
    # the DP returns the best of them (the best split overall shares it)
    model, example = build_model("gpt-tiny", batch=8, device="meta")
    mesh = LogicalMesh((1, 2), cluster="cpu-gloo")
    with pytest.raises(PipelinePlanError, match="one device group on layers holding lm_head.weight"):
        plan(model, example, mesh, schedule="interleaved", num_stages=4, num_layers=4, num_microbatches=2)
    p = plan(model, example, mesh, schedule="interleaved", num_stages=4, num_layers=6, num_microbatches=2)
    for d in (0, 1):
        held = [{n for n in p.stages[i].plan.nodes if n in p.captured.param_fqns} for i in (d, d + 2)]
        assert not held[0] & held[1]


@pytest.mark.parametrize("holders", [(0, 5), (1, 5), (1, 3), (0, 2, 5)])
@pytest.mark.parametrize("seed", range(4))
def test_interleaved_dp_keeps_shared_state_off_one_device_group_and_is_optimal(holders, seed):
    """``stage_dp(..., shared=)`` under interleaved 1F1B (p = 2 groups, v = 2 chunks, 6 layers,
    B = 4): a split into 4 stages where no two stages of one group hold the shared layers (brute
    force over the 10 splits), at most the step (``step_seconds``) of the valid split least in the
    DP's recursion (``sum(r t + o) + (B - r) t_max``, ``r = 1 / v``: the answer of that split's
    own placement), or the error naming the state when no split is valid."""
    import itertools
    import random

    from alpa_lite.core.schedules import step_seconds

    rng = random.Random(seed)
    t, o = [rng.uniform(0.5, 2.0) for _ in range(6)], [rng.uniform(0.0, 0.3) for _ in range(6)]

    def cost(k, i, shape):
        return [StageOption(sum(t[k:i]) * (1 + 0.1 * (i - k)), once_seconds=sum(o[k:i]))]

    valid = {}
    for cuts in itertools.combinations(range(1, 6), 3):
        bounds = list(zip((0, *cuts), (*cuts, 6)))
        stage_of = {h: j for j, (k, i) in enumerate(bounds) for h in range(k, i)}
        held = {stage_of[h] for h in holders}
        if len({j % 2 for j in held}) == len(held):
            options = [cost(k, i, (1, 1))[0] for k, i in bounds]
            valid[tuple(bounds)] = (sum(0.5 * x.seconds + x.once_seconds for x in options)
                                    + (4 - 0.5) * max(x.seconds for x in options),
                                    step_seconds(get_schedule("interleaved", 2), [x.seconds for x in options], 4)
                                    + sum(x.once_seconds for x in options))
    free = stage_dp(6, (1, 2), cost, float("inf"), 4, schedule="interleaved", chunks=2, submeshes=[(1, 1)])
    if not valid:
        with pytest.raises(PipelinePlanError, match="holding w"):
            stage_dp(6, (1, 2), cost, float("inf"), 4, schedule="interleaved", chunks=2, submeshes=[(1, 1)],
                     shared={"w": holders})
        return
    res = stage_dp(6, (1, 2), cost, float("inf"), 4, schedule="interleaved", chunks=2, submeshes=[(1, 1)],
                   shared={"w": holders})
    got = tuple((s.start, s.end) for s in res.stages)
    assert got in valid and res.objective == pytest.approx(valid[got][1], rel=1e-12)
    assert res.objective <= min(valid.values())[1] * (1 + 1e-12)
    assert len(valid) < 10 or res.objective <= free.objective * (1 + 1e-12)
