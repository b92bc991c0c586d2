"""alpa_lite.tools.profile (alpha-beta fits, `alpa-lite profile`) and the cluster-file / curve parts of mesh.py."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math

import numpy as np
import pytest

from alpa_lite.core.mesh import ClusterSpec, Link, LogicalMesh, bytes_factor, interpolate_curve
from alpa_lite.tools.profile import (FitResult, _rank_error, add_arguments, effective_bytes, fit_alpha_beta, mesh_groups,
                               parse_size, run)

SIZES = [4096 * 4**i for i in range(6)]  # 4 KiB .. 4 MiB


# ---------------------------------------------------------------------------------- fitting


def test_effective_bytes_match_mesh_formulas():
    assert effective_bytes("all-reduce", 4, 1000) == pytest.approx(2 * 3 / 4 * 1000)
    for kind in ("all-gather", "reduce-scatter", "all-to-all"):
        assert effective_bytes(kind, 4, 1000) == pytest.approx(3 / 4 * 1000)
    assert effective_bytes("send-recv", 2, 1000) == 1000
    with pytest.raises(ValueError, match="unknown collective"):
        bytes_factor("broadcast", 4)


@pytest.mark.parametrize("kind,n", [("all-reduce", 4), ("all-gather", 2), ("all-to-all", 8), (None, None)])
def test_fit_recovers_exact_alpha_beta(kind, n):
    alpha, beta = 50e-6, 1 / 2e9
    x = [effective_bytes(kind, n, b) if kind else b for b in SIZES]
    t = [alpha + beta * xi for xi in x]
    f = fit_alpha_beta(SIZES, t, kind=kind, n=n)
    assert isinstance(f, FitResult)
    assert f.alpha == pytest.approx(alpha, rel=1e-9)
    assert f.beta == pytest.approx(beta, rel=1e-9)
    assert f.bandwidth == pytest.approx(2e9, rel=1e-9)
    assert f.residual < 1e-9
    assert f.link() == Link(f.alpha, f.beta)


@pytest.mark.parametrize("relative", [True, False])
def test_fit_with_noise(relative):
    rng = np.random.default_rng(0)
    alpha, beta = 100e-6, 1 / 1e9
    sizes = np.repeat(SIZES, 5)  # 5 noisy samples per size
    x = 2 * 3 / 4 * sizes
    t = (alpha + beta * x) * (1 + 0.02 * rng.standard_normal(len(x)))
    f = fit_alpha_beta(sizes, t, kind="all-reduce", n=4, relative=relative)
    assert f.beta == pytest.approx(beta, rel=0.05)
    assert f.alpha == pytest.approx(alpha, rel=0.15 if relative else 1.0)  # absolute LSQ: alpha is loose
    assert 0.005 < f.residual < 0.05


def test_fit_clips_negative_alpha_and_refits_through_origin():
    x = np.array([1e3, 1e4, 1e5, 1e6])
    t = 1e-9 * x - 1e-6  # intercept < 0
    t[0] = 1e-7  # keep times positive
    f = fit_alpha_beta(x, t)
    assert f.alpha == 0.0
    assert f.beta > 0
    w = 1 / t  # least squares of the relative error through the origin
    assert f.beta == pytest.approx(np.dot(w * x, w * t) / np.dot(w * x, w * x))


def test_bad_fits_raise():
    with pytest.raises(ValueError, match="beta"):  # times fall with size
        fit_alpha_beta([1e3, 1e4, 1e5], [3e-3, 2e-3, 1e-3])
    with pytest.raises(ValueError, match="2 distinct sizes"):
        fit_alpha_beta([1e3, 1e3], [1e-3, 2e-3])
    with pytest.raises(ValueError, match="> 0"):
        fit_alpha_beta([1e3, 1e4], [0.0, 1e-3])
    with pytest.raises(ValueError, match="equally many"):
        fit_alpha_beta([1e3, 1e4, 1e5], [1e-3, 2e-3])
    with pytest.raises(ValueError, match="group size"):
        fit_alpha_beta([1e3, 1e4], [1e-3, 2e-3], kind="all-reduce")


def test_mesh_groups_rows_and_columns():
    g = mesh_groups((2, 3))
    assert g["1"] == [[0, 1, 2], [3, 4, 5]]
    assert g["0"] == [[0, 3], [1, 4], [2, 5]]
    assert g["01"] == [list(range(6))]
    assert mesh_groups((1, 4)) == {"1": [[0, 1, 2, 3]]}
    assert mesh_groups((4, 1)) == {"0": [[0, 1, 2, 3]]}


def test_parse_size():
    assert parse_size("4K") == parse_size("4KiB") == parse_size("4096") == 4096
    assert parse_size("1M") == 2**20 and parse_size("1g") == 2**30
    with pytest.raises(ValueError, match="size"):
        parse_size("lots")


# ------------------------------------------------------------------------- cluster files


def _measured_cluster(use_curves=False) -> ClusterSpec:
    curve = {"n": 2, "alpha": 1e-4, "beta": 1e-9, "residual": 0.01,
             "bytes": [1000, 2000, 4000], "seconds": [1e-4, 3e-4, 4e-4]}
    meas = {"compute": {"peak_flops": 5e10},
            "meshes": {"2x2": {"collectives": {"all-reduce": {"0": curve, "1": dict(curve, seconds=[2e-4, 4e-4, 8e-4])},
                                               "all-gather": {"01": dict(curve, n=4)}},
                               "p2p": {"src": 0, "dst": 3, "alpha": 5e-5, "beta": 2e-10, "residual": 0.1,
                                       "bytes": [1000, 2000], "seconds": [5e-5, 6e-5]}}}}
    return ClusterSpec("profiled-test", num_nodes=1, devices_per_node=4, peak_flops=5e10, mem_bandwidth=1e10,
                       memory_bytes=2**32, intra_node=Link(1e-4, 1e-9), inter_node=Link(1e-4, 1e-9),
                       mesh_links={"2x2": (Link(2e-4, 2e-9), Link(1e-4, 1e-9))},
                       use_curves=use_curves, measurements=meas)


@pytest.mark.parametrize("use_curves", [False, True])
def test_cluster_round_trip(tmp_path, use_curves):
    spec = _measured_cluster(use_curves)
    path = tmp_path / "cluster.json"
    path.write_text(spec.to_json())
    back = ClusterSpec.load(path)
    assert back == spec
    assert back.measurements["meshes"]["2x2"]["p2p"]["dst"] == 3
    m = back.logical_mesh((2, 2))
    assert m.mesh_alpha == (2e-4, 1e-4) and m.mesh_beta == (2e-9, 1e-9)
    assert (m.collective_curves is not None) == use_curves
    assert LogicalMesh.from_dict(json.loads(json.dumps(m.to_dict()))) == m


def test_unprofiled_cluster_json_unchanged():
    d = json.loads(ClusterSpec("c", 1, 2, 1e12, 1e11, 1e9, Link(1e-5, 1e-10), Link(1e-5, 1e-10)).to_json())
    assert "measurements" not in d and "use_curves" not in d and "kernel_flops" not in d


def test_kernel_flops_round_trip_and_compute_cost(tmp_path):
    spec = dataclasses.replace(_measured_cluster(), kernel_flops={"attention": 1e10, "pointwise": 1e8})
    path = tmp_path / "cluster.json"
    path.write_text(spec.to_json())
    back = ClusterSpec.load(path)
    assert back == spec
    m = back.logical_mesh((2, 2))
    assert LogicalMesh.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    # roofline: max(flops / rate, bytes / mem_bandwidth) with the class's rate, else the matmul peak 5e10
    assert m.compute_cost(1e9, 0.0, "attention") == pytest.approx(0.1)
    assert m.compute_cost(1e6, 0.0, "pointwise") == pytest.approx(0.01)
    assert m.compute_cost(1e6, 1e9, "pointwise") == pytest.approx(0.1)  # bytes / 1e10 B/s
    assert m.compute_cost(1e9, 0.0) == m.compute_cost(1e9, 0.0, "matmul") == pytest.approx(0.02)
    assert LogicalMesh((2, 2), cluster="cpu-gloo").kernel_flops == ()  # presets: every kernel at the peak


def test_kernel_flops_validation():
    d = _base_dict()
    d["kernel_flops"] = {"conv": 1e9}
    with pytest.raises(ValueError, match="unknown kernel class 'conv'"):
        ClusterSpec.from_dict(d)
    d["kernel_flops"] = {"attention": -1.0}
    with pytest.raises(ValueError, match=r"kernel_flops\['attention'\] must be a positive"):
        ClusterSpec.from_dict(d)


def _base_dict() -> dict:
    return json.loads(_measured_cluster().to_json())


def test_validation_missing_field():
    d = _base_dict()
    del d["peak_flops"]
    with pytest.raises(ValueError, match="peak_flops"):
        ClusterSpec.from_dict(d)


def test_validation_missing_mesh_axis():
    d = _base_dict()
    d["mesh_links"]["2x2"] = d["mesh_links"]["2x2"][:1]
    with pytest.raises(ValueError, match=r"mesh_links\['2x2'\].*one link per mesh axis"):
        ClusterSpec.from_dict(d)
    d = _base_dict()
    del d["mesh_links"]["2x2"][1]["beta"]
    with pytest.raises(ValueError, match=r"mesh_links\['2x2'\]\[1\].*beta"):
        ClusterSpec.from_dict(d)


def test_validation_negative_bandwidth():
    d = _base_dict()
    d["mem_bandwidth"] = -1.0
    with pytest.raises(ValueError, match="mem_bandwidth"):
        ClusterSpec.from_dict(d)
    d = _base_dict()
    d["intra_node"]["beta"] = -1e-9
    with pytest.raises(ValueError, match="intra_node"):
        ClusterSpec.from_dict(d)


def test_validation_bad_curve_named(tmp_path):
    d = _base_dict()
    d["use_curves"] = True
    d["measurements"]["meshes"]["2x2"]["collectives"]["all-reduce"]["1"]["bytes"] = [1000, 500, 4000]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"bad.json.*all-reduce.*'1'.*increasing"):
        ClusterSpec.load(path)
    d["use_curves"] = "yes"
    with pytest.raises(ValueError, match="use_curves"):
        ClusterSpec.from_dict(d)


# --------------------------------------------------------------------------------- curves


def test_interpolate_curve_hand_computed():
    xs, ts = (1000.0, 2000.0, 4000.0), (1e-4, 3e-4, 4e-4)
    assert interpolate_curve(xs, ts, 1500) == pytest.approx(2e-4)
    assert interpolate_curve(xs, ts, 3000) == pytest.approx(3.5e-4)
    assert interpolate_curve(xs, ts, 2000) == pytest.approx(3e-4)
    assert interpolate_curve(xs, ts, 500) == pytest.approx(1e-4)  # below the first point: first time
    assert interpolate_curve(xs, ts, 6000) == pytest.approx(4e-4 + 2000 * (1e-4 / 2000))  # last two points
    assert interpolate_curve(xs, (1e-4, 3e-4, 2e-4), 8000) == pytest.approx(2e-4)  # falling tail: flat


def test_mesh_costs_use_curves_when_asked():
    m = _measured_cluster(use_curves=True).logical_mesh((2, 2))
    assert m.all_reduce_cost(1500, (0,)) == pytest.approx(2e-4)
    assert m.collective_cost("all-reduce", 3000, (1,)) == pytest.approx(6e-4)
    assert m.all_gather_cost(6000, (0, 1)) == pytest.approx(5e-4)
    # no curve for this kind / axis group: the alpha-beta formula on the mesh links
    assert m.reduce_scatter_cost(1e6, (0,)) == pytest.approx(2e-4 + 0.5 * 1e6 * 2e-9)
    assert m.all_reduce_cost(1e6, (0, 1)) == pytest.approx(2e-4 + 1.5 * 1e6 * 2e-9)
    hash(m)  # stays hashable (plans may key caches on meshes)


def test_curves_given_directly_and_size_one_axes_ignored():
    curves = {"all-reduce": {(1,): ([1000, 2000], [1e-4, 2e-4])}}
    m = LogicalMesh((1, 4), mesh_alpha=(1e-5, 1e-5), mesh_beta=(1e-9, 1e-9), peak_flops=1e12,
                    mem_bandwidth=1e11, memory_bytes=1e9, collective_curves=curves)
    assert m.all_reduce_cost(1500, (1,)) == pytest.approx(1.5e-4)
    assert m.all_reduce_cost(1500, (0, 1)) == pytest.approx(1.5e-4)  # axis 0 has one device
    assert m.all_to_all_cost(1500, (1,)) == pytest.approx(1e-5 + 0.75 * 1500 * 1e-9)
    with pytest.raises(ValueError, match="unknown collective"):
        LogicalMesh((1, 4), collective_curves={"broadcast": {"1": ([1, 2], [1, 2])}})
    with pytest.raises(ValueError, match="unknown collective"):
        m.collective_cost("broadcast", 1.0, (1,))


def test_default_costs_are_the_formulas():
    m = LogicalMesh((2, 4), cluster="a100")
    assert m.collective_curves is None
    a0, a1 = m.mesh_alpha
    b0, b1 = m.mesh_beta
    B = 12345678.0
    assert m.all_reduce_cost(B, (1,)) == a1 + 2 * (4 - 1) / 4 * B * b1
    assert m.all_gather_cost(B, (0,)) == a0 + (2 - 1) / 2 * B * b0
    assert m.reduce_scatter_cost(B, (0, 1)) == max(a0, a1) + (8 - 1) / 8 * B * max(b0, b1)
    assert m.all_to_all_cost(B, (1,)) == a1 + (4 - 1) / 4 * B * b1
    assert "collective_curves" not in m.to_dict()


# ------------------------------------------------------------------------------ real run


def _args(*argv) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_run_rejects_bad_arguments(tmp_path, capsys):
    assert run(_args("--nproc", "4", "--mesh", "2x3", "--out", str(tmp_path / "c.json"))) == 2
    assert "2x3" in capsys.readouterr().out
    assert run(_args("--nproc", "0", "--out", str(tmp_path / "c.json"))) == 2
    assert run(_args("--nproc", "1", "--base", "no-such-cluster", "--out", str(tmp_path / "c.json"))) == 2
    assert "unknown cluster 'no-such-cluster'" in capsys.readouterr().out


def test_rank_error_shows_the_traceback_not_the_launcher_summary():
    log = "\n".join(["profile starting", "Traceback (most recent call last):", '  File "profile.py", line 1, in <module>',
                     "    ar_link(whole)", "ValueError: all-reduce on mesh axis 01: the fitted beta is -1e-12 s/byte",
                     "E1201 torch.distributed.elastic: failed", *[f"summary line {i}" for i in range(40)]])
    shown = _rank_error(log)
    assert shown.splitlines()[0] == "Traceback (most recent call last):"
    assert shown.splitlines()[-1].startswith("ValueError: all-reduce on mesh axis 01")
    assert _rank_error("\n".join(f"line {i}" for i in range(50)), lines=3) == "line 47\nline 48\nline 49"


def test_profile_two_processes(tmp_path):
    out = tmp_path / "cluster.json"
    rc = run(_args("--nproc", "2", "--out", str(out), "--sizes", "4K", "256K", "4M", "--warmup", "1",
                   "--repeats", "3", "--use-curves", "--timeout", "120"))
    assert rc == 0
    spec = ClusterSpec.load(out)
    assert spec.num_devices == 2 and spec.name.startswith("profiled-")
    assert spec.peak_flops > 1e8 and spec.mem_bandwidth > 1e8 and spec.memory_bytes > 2**20
    assert spec.use_curves
    a0, a1 = spec.mesh_links["1x2"]
    assert a1.beta > 0 and a1.alpha >= 0
    mesh = spec.measurements["meshes"]["1x2"]
    for kind in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"):
        e = mesh["collectives"][kind]["1"]
        assert e["bytes"] == [4096, 262144, 4194304]
        assert all(s > 0 for s in e["seconds"])
    assert mesh["p2p"]["dst"] == 1 and len(mesh["p2p"]["seconds"]) == 3
    m = spec.logical_mesh((1, 2))
    e = mesh["collectives"]["all-reduce"]["1"]
    assert m.all_reduce_cost(262144, (1,)) == pytest.approx(e["seconds"][1])
    assert math.isfinite(m.all_reduce_cost(2**30, (1,)))
    assert set(spec.kernel_flops) == {"attention", "pointwise"}
    assert 0 < spec.kernel_flops["pointwise"] < spec.kernel_flops["attention"] < 10 * spec.peak_flops
    assert dict(m.kernel_flops) == spec.kernel_flops


# ------------------------------------------------------------------ calibrated cost terms


def test_strategies_price_kernel_classes_and_the_optimizer_update():
    from alpa_lite.core.capture import capture
    from alpa_lite.zoo.models import build_model
    from alpa_lite.compiler.strategies import ADAM_UPDATE_BYTES_FACTOR, BACKWARD_FLOPS_FACTOR, build_strategies, kernel_class

    model, example = build_model("gpt-tiny", 4, 16, device="meta")
    cg = capture(model, example)
    mesh = LogicalMesh((1, 2), mesh_alpha=(1e-4, 1e-4), mesh_beta=(1e-9, 1e-9), peak_flops=1e12, mem_bandwidth=1e15,
                       memory_bytes=2**34, kernel_flops={"attention": 1e9, "pointwise": 1e6})
    table = build_strategies(cg, mesh)
    classes = {kernel_class(n) for n in cg.graph.nodes if n.op == "call_function"}
    assert classes == {None, "attention", "pointwise"}
    gelu = next(n for n in cg.graph.nodes if str(n.target) == "aten.gelu.default")
    numel = gelu.meta["val"].numel()  # [4, 16, 256] on one device of the replicated strategy
    replicated = next(s for s in table[gelu.name].strategies if not any(sp.axes() for sp in s.out_specs))
    assert replicated.compute == pytest.approx((1 + BACKWARD_FLOPS_FACTOR) * numel / 1e6)
    wte = next(ph for ph, fqn in cg.param_fqns.items() if "wte.weight" in (fqn, *cg.tied.get(fqn, [])))  # [65, 64]
    by_spec = {str(s.out_spec): s for s in table[wte].strategies}
    assert by_spec["RR"].compute == pytest.approx(ADAM_UPDATE_BYTES_FACTOR * 65 * 64 * 4 / 1e15)
    assert by_spec["RS1"].compute == pytest.approx(by_spec["RR"].compute / 2)  # ZeRO: half the update
    x = cg.input_names[0]
    assert all(s.compute == 0 for s in table[x].strategies)
