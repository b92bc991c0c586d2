"""``alpa_lite.tools.verify`` / ``alpa-lite verify``: "equal" on good plans, "differs" on broken ones.

The good plans (data parallel, Megatron, ZeRO-3, a 4-stage pipeline, Ulysses) must come out equal to one
process; plans broken on purpose (one gradient all-reduce removed from ``Plan.grad_sync``, one
parameter stored with another spec, one pending partial sum dropped) must come out "differs",
each naming the tensors that moved. All cases run in one torchrun launch (4 gloo ranks).
"""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from alpa_lite import LogicalMesh, plan
from alpa_lite.runtime.launch import torchrun
from alpa_lite.zoo.models import build_model
from alpa_lite.tools.verify import FLOOR, RTOL, _judge, _reference, _Trace, sgd

WORKER = str(Path(__file__).parent / "workers" / "verify_cases.py")
ROOT = Path(__file__).resolve().parents[1]

MLP = {"model": "mlp", "overrides": {"hidden": 32, "num_layers": 4}}
W = [f"layers.{i}.weight" for i in range(4)]
CASES = {
    "dp": (MLP | {"options": {"force_data_parallel": True}}, "equal"),
    "megatron": (MLP | {"options": {"batch_axis": 0, "param_specs": {w: ("S1R", "RS1")[i % 2]
                                                                      for i, w in enumerate(W)}}}, "equal"),
    "zero3": (MLP | {"options": {"force_data_parallel": True, "param_specs": {w: "S01R" for w in W}}}, "equal"),
    "pipeline-4x1": (MLP | {"options": {"pipeline": 4, "num_microbatches": 2}}, "equal"),
    "pipeline-2x2": (MLP | {"options": {"pipeline": 2, "num_microbatches": 2, "force_data_parallel": True}}, "equal"),
    "no-grad-sync": (MLP | {"options": {"force_data_parallel": True}, "break": "drop-grad-sync"}, "differs"),
    "spec-changed": (MLP | {"options": {"force_data_parallel": True}, "break": "spec:layers.1.weight=S0R"}, "differs"),
    "partial-dropped": (MLP | {"options": {"batch_axis": 0, "param_specs": {"layers.0.weight": "S1R",
                                                                            "layers.1.weight": "RS1"}},
                               "break": "drop-partial"}, "differs"),
}
# DeepSpeed-Ulysses (Jacobs et al. 2023, issue 11 item 3): the ILP's own plan for a 2-sequence
# batch of 64 tokens once latency is free (alpha 0) splits the batch on mesh axis 0 and moves
# attention to a head split on axis 1 by all-to-alls (tests/test_ulysses.py: where it is the optimum)
ULYSSES = {"model": "gpt-tiny", "batch": 2, "seq": 64, "steps": 3,
           "plan_mesh": {"cluster": "cpu-gloo", "mesh_alpha": [0, 0]}}
CASES |= {"ulysses-sgd": (ULYSSES, "equal"), "ulysses-adamw": (ULYSSES | {"optimizer": "adamw"}, "adamw")}
# a plan made from the meta-device copy of the model (README: plan for a cluster you do not have),
# run by trainers of the CPU model: the two capture the same graph (export kept a .contiguous()
# after attention on meta only, and the trainers refused the plan as one for another model)
# (attention's output projection split by rows: the view after attention runs on head shards)
CASES["gpt-planned-on-meta"] = ({"model": "gpt-tiny", "batch": 4, "seq": 16, "plan_device": "meta", "options": {
    "batch_axis": 0, "param_specs": {f"blocks.{i}.attn.proj.weight": "RS1" for i in range(2)}}}, "equal")

# a torch.autocast region inside forward (no mixed_precision option): both runs compute the MLP in
# bf16, the sharded one rounding other partial sums, so the bounds are bf16's (verify held it to
# fp32's and called every plan different); a plan without a gradient all-reduce still differs
AUTOCAST = {"model": "patterns:autocast", "seq": 8}
CASES |= {"autocast-dp": (AUTOCAST | {"options": {"force_data_parallel": True}}, "equal"),
          "autocast-megatron": (AUTOCAST | {"options": {"batch_axis": 0, "param_specs": {
              "fc1.weight": "S1R", "fc2.weight": "RS1"}}}, "equal"),
          "autocast-no-grad-sync": (AUTOCAST | {"options": {"force_data_parallel": True}, "break": "drop-grad-sync"},
                                    "differs")}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("verify") / "results.json"
    cases = {k: c for k, (c, _) in CASES.items()}
    code = torchrun([WORKER, "--cases", json.dumps(cases), "--out", str(out)], nproc=4, timeout_s=900)
    assert code == 0, f"torchrun exited with {code}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", list(CASES))
def test_verdict(results, name):
    r = results[name]
    assert "error" not in r, r
    expected = CASES[name][1]
    bad = [(x["kind"], x["name"], x["max_diff"], x["bound"]) for x in r["rows"] if not x["ok"]]
    if expected == "adamw":  # verify's bounds are SGD's (tools/verify.py); test_runtime.py's for AdamW:
        # the first step's gradients within verify's bounds, later ones off by rounding that AdamW
        # turned into whole steps of near-zero gradients, parameters within 2e-4 (2% of one step)
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5)
        grads = [x for x in r["rows"] if x["kind"] == "grad" and not x["ok"]]
        assert all(x["step"] > 0 and x["max_diff"] <= 100 * x["bound"] for x in grads), bad
        assert max(x["max_diff"] for x in r["rows"] if x["kind"] == "param") <= 2e-4, bad
        return
    assert r["verdict"] == expected, bad
    if expected == "equal":  # the autocast cases' losses: bf16's rounding (measured 2e-5 relative)
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-3 if name.startswith("autocast") else 1e-5)
        kinds = {x["kind"] for x in r["rows"]}
        assert kinds >= {"loss", "param"} and ("grad" in kinds or name.startswith("pipeline"))
    else:  # the broken tensor is named, and it is off by far more than rounding (bf16's: 28x its bound)
        factor = 10 if name.startswith("autocast") else 100
        assert any(x["max_diff"] > factor * x["bound"] for x in r["rows"] if not x["ok"]), bad


@pytest.mark.parametrize("name", ["ulysses-sgd", "ulysses-adamw"])
def test_ulysses_plan_trains_equal_to_one_process(results, name):
    """Each attention's query, key and value arrive by an all-to-all forward and leave their
    gradients by one backward (test_verdict: equal to one process over 3 steps)."""
    into = [(kind, phase) for kind, phase, node in results[name]["plan_collectives"]
            if node.startswith("scaled_dot_product_attention")]
    assert sorted(into) == [("all-to-all", "backward")] * 6 + [("all-to-all", "forward")] * 6  # 2 layers x q, k, v
    assert len(results[name]["losses"]) == 3


def test_broken_plans_name_the_tensor(results):
    moved = {x["name"] for x in results["spec-changed"]["rows"] if x["kind"] == "grad" and not x["ok"]}
    assert "layers.1.weight" in moved


def _trace(losses, grads, init, params, buffers=None):
    t = _Trace(init, list(losses), [grads], params, buffers or {})
    return t


def test_judge_bounds_follow_the_dtype_and_the_update():
    w0 = torch.ones(4)
    ref = _trace([1.0], {"w": torch.full((4,), 0.5)}, {"w": w0}, {"w": w0 - 5e-3},
                 {"n": torch.tensor(3), "m": torch.zeros(4)})
    same = _judge(ref, ref, "p")
    assert same.equal and {r.kind for r in same.rows} == {"loss", "grad", "param", "buffer"}
    grad_row = next(r for r in same.rows if r.kind == "grad")
    assert grad_row.bound == pytest.approx(RTOL[torch.float32] * 0.5 + 4 * torch.finfo(torch.float32).eps * 0.5)
    # a parameter is held to its update (5e-3), not to its value (1): 1e-6 off is a difference
    off = _trace([1.0], {"w": torch.full((4,), 0.5)}, {"w": w0}, {"w": w0 - 5e-3 + 1e-6},
                 {"n": torch.tensor(3), "m": torch.zeros(4)})
    assert [r.name for r in _judge(ref, off, "p").differing] == ["w"]
    # integer buffers must be equal
    cnt = _trace([1.0], {"w": torch.full((4,), 0.5)}, {"w": w0}, {"w": w0 - 5e-3},
                 {"n": torch.tensor(4), "m": torch.zeros(4)})
    assert [r.name for r in _judge(ref, cnt, "p").differing] == ["n"]


def test_judge_flags_missing_and_unexpected_gradients():
    w0 = {"w": torch.ones(2), "frozen": torch.ones(2)}
    ref = _trace([1.0], {"w": torch.ones(2)}, w0, dict(w0))
    trained = _trace([1.0], {"w": torch.ones(2), "frozen": torch.ones(2)}, w0, dict(w0))
    rows = _judge(ref, trained, "p").differing
    assert [(r.kind, r.name, r.note) for r in rows] == [("grad", "frozen", "only the parallel run has it")]
    # a parameter no op uses: one process leaves its gradient None, the trainer reports zeros
    # (Trainer.gradients): equal (it was "only the parallel run has it")
    unused = _trace([1.0], {"w": torch.ones(2), "frozen": torch.zeros(2)}, w0, dict(w0))
    assert _judge(ref, unused, "p").equal
    lost = _trace([1.0], {}, w0, {"w": w0["w"]})
    notes = {(r.kind, r.name): r.note for r in _judge(ref, lost, "p").differing}
    assert notes == {("grad", "w"): "absent from the parallel run", ("param", "frozen"): "absent from the parallel run"}


def test_judge_floor_tolerates_cancellation_noise():
    """A gradient that is rounding noise (1e-9 next to gradients of 1) is held to FLOOR of the largest."""
    w0 = {"big": torch.zeros(2), "tiny": torch.zeros(2)}
    ref = _trace([1.0], {"big": torch.ones(2), "tiny": torch.full((2,), 1e-9)}, w0, dict(w0))
    par = _trace([1.0], {"big": torch.ones(2), "tiny": torch.full((2,), -1e-9)}, w0, dict(w0))
    assert _judge(ref, par, "p").equal
    assert 2e-9 < RTOL[torch.float32] * FLOOR


def test_judge_reads_infinite_buffers():
    """A float mask buffer holding ``-inf`` (ALiBi with a sliding window, a causal ``-inf`` mask):
    ``inf - inf`` made its row NaN, so every such model "differed", and its infinite scale made
    the bound of every buffer infinite through FLOOR (a wrong running mean beside it passed).
    Equal infinities now count 0; one in a single run, or a NaN, still differs."""
    w0 = {"w": torch.zeros(2)}
    mask = torch.tensor([0.0, -math.inf, 0.5])
    ref = _trace([1.0], {"w": torch.ones(2)}, w0, dict(w0), {"mask": mask, "mean": torch.ones(2)})
    assert _judge(ref, ref, "p").equal
    wrong = _trace([1.0], {"w": torch.ones(2)}, w0, dict(w0), {"mask": mask, "mean": torch.full((2,), 1.5)})
    rows = {r.name: r for r in _judge(ref, wrong, "p").differing}
    assert list(rows) == ["mean"] and rows["mean"].bound < 1e-3
    for bad in ([0.0, 0.0, 0.5], [0.0, math.inf, 0.5], [0.0, math.nan, 0.5]):
        par = _trace([1.0], {"w": torch.ones(2)}, w0, dict(w0), {"mask": torch.tensor(bad), "mean": torch.ones(2)})
        assert [r.name for r in _judge(ref, par, "p").differing] == ["mask"], bad
    # a NaN gradient the reference lacks is no unused parameter's zeros
    nan_grad = _trace([1.0], {"w": torch.ones(2), "spare": torch.full((2,), math.nan)}, w0, dict(w0))
    plain = _trace([1.0], {"w": torch.ones(2)}, w0, dict(w0))
    assert [r.name for r in _judge(plain, nan_grad, "p").differing] == ["spare"]


def test_low_precision_reads_an_autocast_region():
    """An autocast region inside forward computes in bf16 (verify's bounds then are bf16's); an fp32
    model none."""
    from alpa_lite.core.capture import capture
    from alpa_lite.tools.verify import _low_precision
    sys.path.insert(0, str(Path(__file__).parent / "workers"))
    import patterns
    assert _low_precision(capture(*patterns.autocast(4))) == torch.bfloat16
    assert _low_precision(capture(*patterns.buffers(4))) is None


def test_judge_compares_complex_tensors_whole():
    """A complex gradient is compared by its real and imaginary parts, to its parts' dtype's bound
    (sweep 12: ``.double()`` dropped the imaginary part, and the bound of a complex tensor was 0:
    an FNO's lost imaginary gradient passed unseen, rounding of the real part "differed")."""
    w0 = {"w": torch.zeros(2, dtype=torch.cfloat)}
    g = torch.tensor([1 + 2j, -0.5 + 1j], dtype=torch.cfloat)
    ref = _trace([1.0], {"w": g}, w0, {"w": w0["w"] - 1e-2 * g})
    rounded = _trace([1.0], {"w": g * (1 + 1e-7)}, w0, {"w": w0["w"] - 1e-2 * g})
    assert _judge(ref, rounded, "p").equal
    real_only = _trace([1.0], {"w": g.real.to(torch.cfloat)}, w0, {"w": w0["w"] - 1e-2 * g})
    rows = _judge(ref, real_only, "p").differing
    assert [(r.kind, r.name) for r in rows] == [("grad", "w")] and rows[0].max_diff == pytest.approx(2.0)


def test_low_precision_reads_mixed_float_dtypes():
    """A float64 head after fp32 layers: its float64 gradients carry fp32 rounding, so verify holds
    the model to fp32's bounds (they were held to float64's and "differed" under every plan);
    a complex parameter over fp32 values computes in fp32 too."""
    from alpa_lite.core.capture import capture
    from alpa_lite.tools.verify import _low_precision
    sys.path.insert(0, str(Path(__file__).parent / "workers"))
    import patterns
    assert _low_precision(capture(*patterns.float64_head(4))) == torch.float32
    assert _low_precision(capture(*patterns.spectral(4))) in (None, torch.float32)
    assert _low_precision(capture(*patterns.buffers(4))) is None


def test_random_ops_are_named():
    """verify names the random ops it cannot compare, by module; identity dropouts (``p=0``,
    ``training=False``) and attention without dropout are left out."""
    from alpa_lite.core.capture import capture
    from alpa_lite.tools.verify import random_ops
    sys.path.insert(0, str(Path(__file__).parent / "workers"))
    import patterns
    assert random_ops(capture(*patterns.dropout(4))) == ["aten.dropout in drop (Dropout)"]
    assert random_ops(capture(*patterns.encoder_layers(4))) == []
    assert random_ops(capture(*patterns.mha_pad(4))) == []


def test_reference_densifies_sparse_gradients():
    """``nn.Embedding(sparse=True)`` gives the one-process reference a sparse gradient; the
    trainer's are dense. verify died comparing them ("Could not run 'aten::...' with arguments
    from the 'SparseCPU' backend", on rank 0, raised on every rank); now the reference's is dense."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4, sparse=True), torch.nn.Linear(4, 1))
    batch = ((torch.tensor([[1, 2], [2, 5]]),), {})
    ref = _reference(model, [batch], lambda out: out.pow(2).mean(), 1, sgd, "cpu")
    g = ref.grads[0]["0.weight"]
    assert g.layout == torch.strided and g[[1, 2, 5]].abs().sum() > 0 and not g[[0, 3, 4, 6, 7]].any()
    assert _judge(ref, ref, "p").equal


def test_cli_rejects_a_mesh_that_is_not_nproc():
    proc = subprocess.run([sys.executable, "-m", "alpa_lite.cli", "verify", "mlp", "--mesh", "2x2", "--nproc", "3"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "--nproc is 3" in proc.stderr


def test_cli_answers_differs_on_a_plan_file_without_a_gradient_sync(tmp_path):
    model, example = small_mlp(8)  # on the CPU: a plan made on 'meta' marks the MSE target as needing a gradient
    d = json.loads(plan(model, example, LogicalMesh((2, 2), cluster="cpu-gloo"), force_data_parallel=True).to_json())
    d["grad_sync"].pop(sorted(d["grad_sync"])[0])
    (tmp_path / "plan.json").write_text(json.dumps(d))
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "alpa_lite.cli", "verify", "tests.test_verify:small_mlp",
                           "--mesh", "2x2", "--steps", "1", "--plan", str(tmp_path / "plan.json"), "--json", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["verdict"] == "differs" and "differs" in proc.stdout
    assert all(math.isfinite(r["max_diff"]) for r in report["rows"])


def test_cli_exits_2_when_a_rank_fails():
    """A rank that raises is an error (2), not the verdict "differs" (1)."""
    proc = subprocess.run([sys.executable, "-m", "alpa_lite.cli", "verify", "tests.test_verify:broken_model",
                           "--mesh", "1x1", "--steps", "1"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no verdict" in proc.stderr and "broken on purpose" in proc.stdout + proc.stderr


def broken_model(batch, seq=None, device="cpu"):
    raise RuntimeError("broken on purpose")


def small_mlp(batch, seq=None, device="cpu"):
    """The CLI's module:callable form (2 layers of 32)."""
    return build_model("mlp", batch, device=device, hidden=32, num_layers=2)
