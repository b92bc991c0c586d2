"""Plan quality: alpa-lite's pipelined plan vs hand-tuned configurations, under one cost model.

For Alpa's three suites (OSDI'22, Table 4 / Fig. 7): GPT-3 (350M on 1 GPU ... 39B on 64),
GShard MoE (380M on 1 ... 27B on 32) and Wide-ResNet (250M on 1 ... 13B on 64), and for long
sequences (``gpt-8k``, ``gpt-32k``: GPT-3 1.3B on 8 and 2.6B on 64 GPUs, seq 8192 / 32768, global
batch 8), on the ``a100`` and ``v100`` cluster presets, the predicted training-step time of

- **alpa-lite**: ``alpa_lite.plan(..., pipeline=PipelineOptions(...))`` (layer clustering, stage DP, per-stage
  intra-op ILP; the pipeline schedule ``--schedule``, default ``auto``: the stage DP's choice);
- **hand-tuned grid**: the best ``dp x tp x pp x B`` point: ``pp`` stages of equal layer counts
  on submeshes of ``D / pp`` devices, each with logical mesh ``(dp, tp)``, the batch split along
  axis 0, every weight replicated except, along axis 1, GPT's Megatron column / row /
  vocab-parallel weights (Narayanan et al., SC21) and, for MoE, the same plus the experts split
  over their expert dim (expert parallelism, GShard / DeepSpeed-MoE); Wide-ResNet has no tensor
  parallelism (``tp = 1``: Alpa's PP-DP baseline); 1F1B; the long-sequence suites add, for
  ``tp > 1``, Megatron-SP and Ulysses points (``grid_points``) and report the best ``tp`` point
  alone too ("tp grid": the grid without sequence parallelism);
- **no pipeline**: ``alpa_lite.plan`` without ``pipeline`` (the intra-op plan on the whole mesh,
  one microbatch); the pipelined search holds it (B = 1, one stage), so alpa-lite is never slower;
- **data parallel**: one stage, batch over every device, weights replicated;
- **ZeRO-1 / ZeRO-2 / ZeRO-3**: data parallel with every parameter at that ZeRO stage over every
  device (``PlanOptions(zero_stage=...)``);
- **equal-layer pipeline**: the best ``pp`` with equal layer counts per stage and ``D / pp``
  devices each, the stages' intra-op plans (and logical meshes) free;

all priced by the same machinery: the same captures (one per microbatch count), the same layer
clustering, ``compiler.stage_costs.GraphStageCosts`` (per-layer intra-op ILPs with forced specs for the
baselines) and the same step-time formula ``sum(t_i + o_i) + (B - 1) max t_i`` with 1F1B's
in-flight memory. A configuration that does not fit the device memory is left out ("-").

Run:  python benchmarks/plan_quality.py [--suites gpt,moe,wresnet,gpt-8k,gpt-32k] [--presets a100,v100] [--models ...]
"""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from alpa_lite.core.capture import capture
from alpa_lite.core.mesh import LogicalMesh, get_cluster
from alpa_lite.zoo.models import build_model
from alpa_lite import plan
from alpa_lite.compiler.clustering import cluster_layers
from alpa_lite.compiler.ilp import MemoryBudgetError
from alpa_lite.compiler.stage_costs import GraphStageCosts
from alpa_lite.compiler.stage_dp import PipelinePlanError, in_flight
from alpa_lite.core.options import PipelineOptions, PlanOptions

def megatron_specs(cg, tp: int) -> dict[str, str]:
    """Megatron-LM tensor parallelism of the built-in GPT along mesh axis 1 (weights ``[out, in]``),
    and for the MoE model its experts split over the expert dim (expert parallelism)."""
    if tp == 1:
        return {}
    specs = {}
    for fqn in cg.param_fqns.values():
        if fqn.endswith(("attn.qkv.weight", "ffn.fc.weight")):
            specs[fqn] = "S1R"  # column parallel
        elif fqn.endswith(("attn.proj.weight", "ffn.proj.weight")):
            specs[fqn] = "RS1"  # row parallel
        elif fqn == "wte.weight":
            specs[fqn] = "S1R"  # vocab parallel embedding / head
        elif fqn.endswith(("ffn.w1", "ffn.w2")):
            specs[fqn] = "S1RR"  # expert parallel: [experts, in, out]
        elif fqn.endswith(("ffn.b1", "ffn.b2")):
            specs[fqn] = "S1R"
    return specs


@dataclass(frozen=True)
class Suite:
    """A benchmark suite: ``cases`` (model, cluster shape), the global batch, the sequence length
    (None: not a language model), the grid's tensor-parallel degrees, whether the grid adds,
    for every ``tp > 1``, Megatron-SP and Ulysses points (``sequence_grid``), and the models'
    config overrides (``build_model``)."""

    title: str
    cases: tuple[tuple[str, tuple[int, int]], ...]
    global_batch: int
    seq: int | None
    tp_degrees: tuple[int, ...]
    sequence_grid: bool = False
    overrides: tuple[tuple[str, object], ...] = ()


SUITES = {  # OSDI'22, Table 4 and section 8.1
    "gpt": Suite("GPT-3", (("gpt3-350m", (1, 1)), ("gpt3-1.3b", (1, 4)), ("gpt3-2.6b", (1, 8)),
                           ("gpt3-6.7b", (2, 8)), ("gpt3-15b", (4, 8)), ("gpt3-39b", (8, 8))), 1024, 1024, (1, 2, 4, 8)),
    "moe": Suite("GShard MoE", (("moe-380m", (1, 1)), ("moe-1.3b", (1, 4)), ("moe-2.4b", (1, 8)),
                                ("moe-10b", (2, 8)), ("moe-27b", (4, 8))), 1024, 1024, (1, 2, 4, 8)),
    "wresnet": Suite("Wide-ResNet", (("wide-resnet-250m", (1, 1)), ("wide-resnet-1b", (1, 4)),
                                     ("wide-resnet-2b", (1, 8)), ("wide-resnet-4b", (2, 8)),
                                     ("wide-resnet-6.8b", (4, 8)), ("wide-resnet-13b", (8, 8))), 1536, None, (1,)),
}
# long sequences (Korthikanti et al. 2022; Jacobs et al. 2023): 8 and 64 A100s, Megatron's per-head
# qkv layout (GPTConfig.qkv_layout: a column-parallel qkv gives whole heads, as in Megatron-LM)
for _seq in (8192, 32768):
    SUITES[f"gpt-{_seq // 1024}k"] = Suite("GPT-3 long sequence", (("gpt3-1.3b", (1, 8)), ("gpt3-2.6b", (8, 8))), 8,
                                           _seq, (1, 2, 4, 8), sequence_grid=True,
                                           overrides=(("qkv_layout", "megatron"),))


def sequence_split(example, dp: int) -> dict[str, str]:
    """Every ``[batch, seq]`` input: batch along mesh axis 0 (when ``dp > 1``), sequence along axis 1."""
    return {str(i): ("S0" if dp > 1 else "R") + "S1" for i in range(len(example))}


def grid_points(cg, example, suite: Suite, dp: int, tp: int, time_limit: float):
    """The hand-tuned grid's ``(name, PlanOptions)`` at logical mesh ``(dp, tp)``: Megatron's tensor
    parallelism and, for a ``sequence_grid`` suite with ``tp > 1``, Megatron-SP (the same weights,
    the inputs split along the sequence on axis 1, partial sums reduce-scattered: Korthikanti et
    al. 2022, section 4.2.2) and Ulysses (every weight replicated, the inputs split along the
    sequence on axis 1, attention free to take heads by all-to-all: Jacobs et al. 2023). The
    activations' specs are the ILP's in every point."""
    common = dict(replicate_params=True, batch_axis=0 if dp > 1 else None, time_limit=time_limit)
    points = [("tp", PlanOptions(param_specs=megatron_specs(cg, tp), **common))]
    if suite.sequence_grid and tp > 1:
        seq = sequence_split(example, dp)
        points += [("sp", PlanOptions(param_specs=megatron_specs(cg, tp), input_specs=seq,
                                      prefer_reduce_scatter=True, **common)),
                   ("ulysses", PlanOptions(input_specs=seq, **common))]
    return points


def submesh_of(devices: int, m: int) -> tuple[int, int]:
    return (1, devices) if devices <= m else (devices // m, m)


def evaluate(costs: GraphStageCosts, num_layers: int, pp: int, devices: int, b: int, m: int):
    """Step seconds of ``pp`` equal-layer stages on ``devices / pp`` devices each (None: infeasible)."""
    if num_layers % pp or devices % pp:
        return None
    per, sub = num_layers // pp, submesh_of(devices // pp, m)
    stages = []
    for k in range(pp):
        fl = in_flight(pp - k, pp, b, "1f1b")
        fit = [o for o in costs(k * per, (k + 1) * per, sub) if o.fits(fl, costs.memory_bytes)]
        if not fit:
            return None
        stages.append(fit)
    best = math.inf
    for t_max in sorted({o.seconds for fit in stages for o in fit}):  # the DP's t_max loop, fixed stages
        picks = [[o for o in fit if o.seconds <= t_max] for fit in stages]
        if all(picks):
            best = min(best, sum(min(o.seconds + o.once_seconds for o in p) for p in picks) + (b - 1) * t_max)
    return best


def baselines(model, example, suite: Suite, cluster_shape, preset, microbatches, num_layers, time_limit):
    """Best step seconds (and its configuration) of every baseline family."""
    n, m = cluster_shape
    devices = n * m
    mesh = LogicalMesh(cluster_shape, cluster=preset)
    cluster, budget = mesh.as_cluster(), mesh.memory_bytes
    free_options = PlanOptions(time_limit=time_limit)
    best = {k: (math.inf, None) for k in ("grid", *(("tp grid",) if suite.sequence_grid else ()), "data parallel",
                                          "zero-1", "zero-2", "zero-3", "equal-layer pipeline")}

    def offer(kind, value, config):
        if value is not None and value < best[kind][0]:
            best[kind] = (value, config)

    for b in microbatches:
        size = suite.global_batch // b
        cg = capture(model, tuple(x[:size] for x in example))
        layers = cluster_layers(cg, num_layers)
        L = len(layers)
        free = GraphStageCosts(cg, layers, cluster, budget, max_in_flight=min(b, L, devices), options=free_options,
                               num_microbatches=b)
        pps = [p for p in range(1, min(L, devices) + 1) if L % p == 0 and devices % p == 0]
        free.prefetch([(k * (L // p), (k + 1) * (L // p), submesh_of(devices // p, m)) for p in pps for k in range(p)],
                      workers=len(os.sched_getaffinity(0)))
        for pp in pps:
            offer("equal-layer pipeline", evaluate(free, L, pp, devices, b, m), f"pp={pp} B={b}")
            for tp in suite.tp_degrees:
                d = devices // pp
                if tp > min(d, m) or d % tp:
                    continue
                dp = d // tp
                if size % dp:  # a microbatch of fewer sequences than data-parallel ranks
                    continue
                for point, grid in grid_points(cg, example, suite, dp, tp, time_limit):
                    costs = GraphStageCosts(cg, layers, cluster, budget, max_in_flight=min(b, pp), options=grid,
                                            shapes=lambda sub, s=(dp, tp): [s], num_microbatches=b)
                    value = evaluate(costs, L, pp, devices, b, m)
                    offer("grid", value, f"{point} dp={dp} tp={tp} pp={pp} B={b}")
                    if suite.sequence_grid and point == "tp":  # the grid without its SP / Ulysses points
                        offer("tp grid", value, f"dp={dp} tp={tp} pp={pp} B={b}")
        shape = submesh_of(devices, m) if devices <= m else (n, m)
        for kind, stage in (("data parallel", None), ("zero-1", 1), ("zero-2", 2), ("zero-3", 3)):
            if size % devices:
                continue
            options = PlanOptions(force_data_parallel=True, zero_stage=stage if devices > 1 else None,
                                  time_limit=time_limit)
            costs = GraphStageCosts(cg, layers, cluster, budget, max_in_flight=1, options=options,
                                    shapes=lambda sub, s=shape: [s], num_microbatches=b)
            offer(kind, evaluate(costs, L, 1, devices, b, m), f"B={b}")
    return best


def run(suites, models, presets, microbatches, num_layers, schedule, time_limit, console, out: Path):
    rows = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").exists() else []
    done = {(r["suite"], r["preset"], r["model"]) for r in rows}
    for preset in presets:
        for key in suites:
            suite = SUITES[key]
            for name, shape in suite.cases:
                if (models and name not in models) or (key, preset, name) in done:
                    continue
                model, example = build_model(name, suite.global_batch, suite.seq, device="meta",
                                             **dict(suite.overrides))
                t0 = time.perf_counter()
                try:
                    p = plan(model, example, LogicalMesh(shape, cluster=preset), time_limit=time_limit,
                             pipeline=PipelineOptions(num_layers=num_layers, schedule=schedule,
                                                      microbatch_candidates=tuple(microbatches)))
                    ours, plan_s, chosen = p.step_seconds, time.perf_counter() - t0, p.schedule
                    config = (f"{len(p.stages)} stages " + " ".join(
                        f"{s.submesh[0]}x{s.submesh[1]}:{'x'.join(map(str, s.plan.mesh.shape))}" for s in p.stages)
                        + f" B={p.num_microbatches}")
                except PipelinePlanError as e:
                    ours, plan_s, config, chosen = math.inf, time.perf_counter() - t0, f"infeasible: {e}", None
                limits = [] if math.isinf(ours) else p.solver_limits
                try:
                    spmd = plan(model, example, LogicalMesh(shape, cluster=preset), time_limit=time_limit).step_seconds
                except MemoryBudgetError:
                    spmd = math.inf
                base = baselines(model, example, suite, shape, preset, microbatches, num_layers, time_limit)
                row = {"suite": key, "preset": preset, "model": name, "devices": shape[0] * shape[1],
                       "alpa_lite_s": ours, "alpa_lite_config": config, "plan_time_s": plan_s,
                       "no_pipeline_s": spmd, "solver_limits": limits, "schedule": chosen}
                for kind, (value, cfg) in base.items():
                    row[kind] = value
                    row[kind + " config"] = cfg
                rows.append(row)
                out.with_suffix(".json").write_text(json.dumps(rows, indent=1))  # resumable
                console.print(f"{preset} {name}: alpa-lite {ours:.4f} s ({config}), plan {plan_s:.1f} s; "
                              + ", ".join(f"{k} {v[0]:.4f} s ({v[1]})" for k, v in base.items()))
    return rows


def suite_rows(rows, key: str, preset: str | None = None) -> list[dict]:
    """The rows of suite ``key`` (and ``preset``), by preset, then in the suite's case order."""
    order = {name: i for i, (name, _) in enumerate(SUITES[key].cases)}
    return sorted((r for r in rows if r["suite"] == key and preset in (None, r["preset"])),
                  key=lambda r: (r["preset"], order.get(r["model"].split()[0], 0), r["model"]))


def table(rows, key: str) -> Table:
    suite = SUITES[key]
    seq = f", seq {suite.seq}" if suite.seq else ""
    t = Table(title=f"{suite.title} suite, global batch {suite.global_batch}{seq}: predicted step time (s)")
    grid_point = ("grid point",) if suite.sequence_grid else ()
    tp_grid = ("tp grid", "ratio (tp grid)") if suite.sequence_grid else ()
    for col in ("cluster", "model", "GPUs", "alpa-lite", "schedule", "no pipeline", "grid best", *grid_point, "ratio",
                *tp_grid, "data parallel", "ZeRO-1", "ZeRO-2", "ZeRO-3", "equal-layer PP", "plan time",
                "ILPs at time limit"):
        t.add_column(col, justify="left" if col in ("cluster", "model", "schedule", "grid point") else "right")
    fmt = lambda x: "-" if x is None or not math.isfinite(x) else f"{x:.3f}"
    measured = lambda r, k: fmt(r[k]) if k in r else "?"  # noqa: E731 (rows measured before ZeRO-1/2 were)
    ratio = lambda r, k: (f"{r['alpa_lite_s'] / r[k]:.3f}x" if math.isfinite(r.get(k, math.inf))  # noqa: E731
                          and math.isfinite(r["alpa_lite_s"]) else "-")
    for r in suite_rows(rows, key):
        limits = r.get("solver_limits")  # rows measured before these were recorded: "?"
        point = (r["grid config"] or "-",) if suite.sequence_grid else ()
        tp = ((fmt(r["tp grid"]), ratio(r, "tp grid")) if "tp grid" in r else ("?", "?")) if suite.sequence_grid else ()
        t.add_row(r["preset"], r["model"], str(r["devices"]), fmt(r["alpa_lite_s"]),
                  r.get("schedule", "1f1b") if math.isfinite(r["alpa_lite_s"]) else "-",  # older rows: 1F1B only
                  fmt(r.get("no_pipeline_s")), fmt(r["grid"]), *point, ratio(r, "grid"), *tp,
                  fmt(r["data parallel"]), measured(r, "zero-1"), measured(r, "zero-2"), fmt(r["zero-3"]),
                  fmt(r["equal-layer pipeline"]), f"{r['plan_time_s']:.1f} s",
                  "?" if limits is None else str(len(limits)))
    return t


KINDS = [("alpa_lite_s", "alpa-lite"), ("grid", "hand-tuned grid best"), ("data parallel", "data parallel"),
         ("zero-1", "ZeRO-1"), ("zero-2", "ZeRO-2"), ("zero-3", "ZeRO-3"), ("equal-layer pipeline", "equal-layer PP")]


def plot(rows, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = sorted({r["preset"] for r in rows})
    suites = [k for k in SUITES if any(r["suite"] == k for r in rows)]
    fig, axes = plt.subplots(len(suites), len(presets), figsize=(6 * len(presets), 3.6 * len(suites)), squeeze=False)
    for row_axes, key in zip(axes, suites):
        for ax, preset in zip(row_axes, presets):
            rs = suite_rows(rows, key, preset)
            width = 0.8 / len(KINDS)
            for j, (kind, label) in enumerate(KINDS):
                # throughput relative to the best configuration found for the case (1 = the best)
                best = [min(r.get(k, math.inf) for k, _ in KINDS) for r in rs]  # ZeRO-1/2: "-" in older rows
                vals = [b / r.get(kind, math.inf) for b, r in zip(best, rs)]
                ax.bar([i + j * width for i in range(len(rs))], vals, width, label=label)
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rs))])
            ax.set_xticklabels([f"{r['model'].split('-')[-1]}\n{r['devices']} GPUs" for r in rs], fontsize=8)
            ax.set_ylabel("relative throughput (1 = best)")
            ax.set_title(f"{preset}: predicted throughput, {SUITES[key].title}")
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--suites", default=",".join(SUITES))
    ap.add_argument("--presets", default="a100,v100")
    ap.add_argument("--models", default="", help="only these models of the suites (default: all)")
    ap.add_argument("--microbatches", default="1,2,4,8,16,32,64", help="candidate microbatch counts B")
    ap.add_argument("--layers", type=int, default=8, help="layers L of the clustering")
    ap.add_argument("--schedule", default="auto", help="alpa-lite's pipeline schedule (the grid's is 1F1B)")
    ap.add_argument("--time-limit", type=float, default=30.0, help="ILP seconds per solve")
    ap.add_argument("--out", default="docs/plan_quality", help="writes OUT.json (cases done so far: a rerun "
                    "resumes), OUT.png and OUT.md")
    ap.add_argument("--report-only", action="store_true", help="only rewrite the table and plot from OUT.json")
    args = ap.parse_args()
    console = Console(width=160)
    for preset in args.presets.split(","):
        get_cluster(preset)
    out = Path(args.out)
    if args.report_only:
        rows = json.loads(out.with_suffix(".json").read_text())
    else:
        rows = run(args.suites.split(","), [m for m in args.models.split(",") if m], args.presets.split(","),
                   [int(b) for b in args.microbatches.split(",")], args.layers, args.schedule, args.time_limit, console,
                   out)
    record = Console(record=True, width=200, file=io.StringIO())
    for key in SUITES:
        if any(r["suite"] == key for r in rows):
            console.print(table(rows, key))
            record.print(table(rows, key))
    plot(rows, out.with_suffix(".png"))
    md = out.with_suffix(".md")
    head = md.read_text().split("<!-- table -->")[0] if md.exists() else "# Plan quality\n\n"
    md.write_text(head + "<!-- table -->\n```\n" + record.export_text() + "```\n")

if __name__ == "__main__":
    main()
