"""``alpa-lite diff``: two known plans differ in exactly the parameters, collectives, time and
memory that changed (SPMD and pipelined)."""
import torch
import torch.nn as nn

from alpa_lite import LogicalMesh, load_plan, plan
from alpa_lite.cli import main
from alpa_lite.tools.diff import diff_plans

FORCED = {"2.weight": "S1R"}  # one weight column-split instead of replicated (over the data axis: ZeRO-3)


def _plan(**options):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    x = torch.zeros(16, 32, device="meta")
    return plan(model, (x,), LogicalMesh((1, 4), cluster="unit"), loss_fn=lambda out: out.sum(),
                force_data_parallel=True, **options)


def test_spmd_diff_lists_exactly_the_changed_parameter(tmp_path, capsys):
    a, b = _plan(), _plan(param_specs=FORCED)
    d = diff_plans(a, b)
    assert d.params == {"2.weight": ("RR", "S1R ZeRO-3 over 1")}  # split over the data-parallel axis
    assert diff_plans(a, a).params == {} and not diff_plans(a, a).added and not diff_plans(a, a).removed
    # the split weight's gradient leaves the data-parallel bucket, and its output is gathered
    assert d.added and d.removed
    assert d.step_seconds == (a.step_seconds, b.step_seconds) and d.memory_bytes == (a.memory_bytes, b.memory_bytes)
    assert diff_plans(load_plan(a.to_json()), load_plan(b.to_json())) == d
    a.to_json(tmp_path / "a.json")
    b.to_json(tmp_path / "b.json")
    assert main(["diff", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "1 parameter spec changed" in out and "2.weight" in out and "0.weight" not in out


def test_pipeline_diff_names_the_stage_of_the_changed_parameter():
    fixed = dict(pipeline=2, num_microbatches=2, num_layers=2, workers=1)
    a, b = _plan(**fixed), _plan(param_specs=FORCED, **fixed)
    assert [s.layers for s in a.stages] == [s.layers for s in b.stages]
    stage = next(i for i, s in enumerate(b.stages) if "2.weight" in s.plan.param_specs)
    d = diff_plans(a, b)
    assert d.params == {"2.weight": (f"stage {stage}: RR", f"stage {stage}: S1R ZeRO-3 over 1")}
    assert {c[0] for c in d.added + d.removed} == {stage}  # only that stage's collectives change


def test_diff_lists_a_changed_zero_stage():
    """ZeRO-2 changes no storage spec (every weight stays ``RR``, every bias ``R``) but its gradients and states:
    the diff lists every trainable weight with its stage, and the reduce-scatters it adds."""
    a, b = _plan(), _plan(zero_stage=2)
    assert set(b.param_specs.values()) == {"R", "RR"} and all(z == 2 for z, _ in b.zero_stages.values())
    d = diff_plans(a, b)
    axes = {f: ",".join(map(str, ax)) for f, (_, ax) in b.zero_stages.items()}
    assert d.params == {f: (a.param_specs[f], f"{a.param_specs[f]} ZeRO-2 over {axes[f]}") for f in b.zero_stages}
    assert any(c[1] == "reduce-scatter" for c in d.added)
