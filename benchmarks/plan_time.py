"""Planning time and ILP size for Alpa's GPT-3 shapes (125M ... 39B) on meshes up to 8x8.

    python benchmarks/plan_time.py [--out docs/plan_time.md]
    python benchmarks/plan_time.py --case gpt3-39b:8x8:32 --pipeline auto [--microbatches 32] [--solver cbc]
    python benchmarks/plan_time.py --depth gpt3-1.3b:2x4:16 --layers 8,16,32,64 [--repeats 3] [--pipeline auto --microbatches 4]
    python benchmarks/plan_time.py --replan gpt3-2.6b:2x4:32 --batches 16,64 [--repeats 3]

For each case: capture (torch.export on meta tensors), strategy enumeration + cost graph, ILP
solve, with the graph size before and after merging (follower ops, shared repeated blocks).
Prints a table, writes it with the command as the first section of docs/plan_time.md (the
sections after it stay) and plots docs/plan_time.png.
``--depth``: one model width planned at several depths (``num_layers``), each the median of
``--repeats`` runs; prints a markdown table and the least-squares line of planning seconds
against layers (slope, intercept, R^2) for docs/plan_time.md.
``--replan``: each plan in a process of its own (as ``alpa-lite plan`` runs): a fresh plan at
each batch without a cache, then on a new cache directory the plan at the case's batch and
re-plans at ``--batches``; prints the medians over ``--repeats`` (wall and CPU seconds of model
build + plan, the stages of ``plan.stats``) as a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

from rich.console import Console
from rich.table import Table

from alpa_lite import LogicalMesh, plan
from alpa_lite.zoo.models import build_model, count_parameters

CASES = [  # (model, mesh, global batch)
    ("gpt3-125m", (1, 2), 16), ("gpt3-350m", (1, 4), 16), ("gpt3-1.3b", (1, 8), 32), ("gpt3-2.6b", (2, 4), 32),
    ("gpt3-6.7b", (2, 8), 32), ("gpt3-15b", (4, 8), 64), ("gpt3-39b", (8, 8), 64),
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/plan_time.md")
    ap.add_argument("--cluster", default="a100")
    ap.add_argument("--case", action="append", default=[], metavar="MODEL:NxM:BATCH",
                    help="time only these plans and print them (the doc is not written)")
    ap.add_argument("--pipeline", default=None, help="with --case: 'auto' or a stage count")
    ap.add_argument("--microbatches", type=int, default=None, help="with --case --pipeline: B (default: searched)")
    ap.add_argument("--solver", default="auto", choices=("auto", "cbc", "highs"))
    ap.add_argument("--depth", default=None, metavar="MODEL:NxM:BATCH", help="sweep this model's num_layers")
    ap.add_argument("--layers", default="8,16,32,64", help="with --depth: the depths")
    ap.add_argument("--repeats", type=int, default=3, help="with --depth / --replan: runs (the median is reported)")
    ap.add_argument("--cache", default=None, metavar="DIR", help="with --case: plan with this cache directory")
    ap.add_argument("--json", action="store_true", help="with --case: print one JSON line per plan (seconds, stats)")
    ap.add_argument("--replan", default=None, metavar="MODEL:NxM:BATCH", help="time re-plans at other batches")
    ap.add_argument("--batches", default="16,64", help="with --replan: the batches re-planned")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    console = Console(width=180)
    if args.depth:
        return _depth(args, console)
    if args.replan:
        return _replan(args, console)
    if args.case:
        return _cases(args, console)
    rows, load = [], os.getloadavg()[0]
    for name, shape, batch in CASES:
        t0 = time.perf_counter()
        model, example = build_model(name, batch)
        p = plan(model, example, LogicalMesh(shape, cluster=args.cluster))
        wall = time.perf_counter() - t0
        s = p.stats
        rows.append(dict(model=name, params=count_parameters(model) / 1e9, mesh=f"{shape[0]}x{shape[1]}", batch=batch,
                         nodes=s["nodes"], vars=s["ilp_variables"], cols=s["ilp_strategy_vars"] + s["ilp_edge_vars"],
                         capture=s["capture_s"], strategies=s["strategy_s"], ilp=s["ilp_s"], total=wall,
                         step=p.step_seconds, mem=p.memory_bytes / 2**30))
        console.print(f"{name} on {shape}: {wall:.1f} s")
    table = Table(title=f"planning time, cluster {args.cluster}")
    heads = ["model", "params (B)", "mesh", "batch", "graph nodes", "ILP vars", "ILP columns", "capture s",
             "strategies s", "ILP s", "total s", "pred. step s", "mem GiB"]
    for h in heads:
        table.add_column(h, justify="right")
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for r in rows:
        cells = [r["model"], f"{r['params']:.2f}", r["mesh"], str(r["batch"]), str(r["nodes"]), str(r["vars"]),
                 str(r["cols"]), f"{r['capture']:.2f}", f"{r['strategies']:.2f}", f"{r['ilp']:.2f}",
                 f"{r['total']:.2f}", f"{r['step']:.3f}", f"{r['mem']:.1f}"]
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    console.print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    largest = max(rows, key=lambda r: r["params"])
    rest = out.read_text().partition("\n## ")[1:] if out.exists() else ()  # the later sections stay
    out.write_text(
        "# Planning time\n\nCommand: `python benchmarks/plan_time.py` (2-core CPU machine, one process; models on the\n"
        f"meta device, cluster preset `{args.cluster}`; load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at "
        "the end: on a shared machine the seconds grow with the load). Total = model build + capture + strategies + "
        "ILP.\n\n"
        + "\n".join(lines) + "\n\n"
        f"Largest planned: {largest['model']} ({largest['params']:.1f} B parameters) on a {largest['mesh']} mesh in "
        f"{largest['total']:.1f} s.\nGraph nodes shrink to ILP variables by merging follower ops into their "
        "operand and sharing one variable across identical transformer blocks.\n\n![planning time](plan_time.png)\n"
        + "".join(rest))
    _plot(rows, out.with_suffix(".png"))
    console.print(f"written {out} and {out.with_suffix('.png')}")
    return 0


def _cases(args, console) -> int:
    for case in args.case:
        name, mesh, batch = case.split(":")
        shape = tuple(int(x) for x in mesh.split("x"))
        t0, c0 = time.perf_counter(), time.process_time()
        model, example = build_model(name, int(batch))
        pipe = {} if args.pipeline is None else {"pipeline": args.pipeline, "num_microbatches": args.microbatches}
        p = plan(model, example, LogicalMesh(shape, cluster=args.cluster), solver=args.solver, cache=args.cache, **pipe)
        wall = time.perf_counter() - t0
        if args.json:
            keys = ("capture_s", "strategy_s", "ilp_s", "total_s", "graph_hits", "disk_hits")
            print(json.dumps({"wall": wall, "cpu": time.process_time() - c0} | {k: p.stats.get(k) for k in keys}))
            continue
        layout = (f"{len(p.stages)} stages, B={p.num_microbatches}, {p.stats['ilp_solves']} stage ILPs, "
                  f"{p.stats['ilp_s']:.1f} s in them" if args.pipeline else f"ILP {p.stats['ilp_s']:.2f} s")
        console.print(f"{case} pipeline={args.pipeline} solver={args.solver}: {wall:.1f} s "
                      f"(predicted step {p.step_seconds:.4f} s; {layout}; {len(p.solver_limits)} ILPs at the time limit)")
    return 0


def _replan(args, console) -> int:
    import os
    import statistics
    import subprocess
    import tempfile

    name, mesh, batch = args.replan.split(":")
    batches = [int(batch), *(int(b) for b in args.batches.split(","))]

    def one(b: int, cache: str | None) -> dict:
        cmd = [sys.executable, __file__, "--case", f"{name}:{mesh}:{b}", "--cluster", args.cluster, "--json",
               *(["--cache", cache] if cache else [])]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    runs: dict[str, list[dict]] = {}
    for _ in range(args.repeats):
        for b in batches:
            runs.setdefault(f"fresh, no cache, batch {b}", []).append(one(b, None))
        with tempfile.TemporaryDirectory() as cache:
            for i, b in enumerate(batches):
                label = f"{'first plan' if i == 0 else 're-plan'} with the cache, batch {b}"
                runs.setdefault(label, []).append(one(b, cache))
        console.print(f"round done (load {os.getloadavg()[0]:.1f})")
    cols = ("wall", "cpu", "capture_s", "strategy_s", "ilp_s", "total_s")
    print(f"| {name} / {mesh} | wall s | CPU s | capture s | strategies s | ILP s | plan() total s | graph read |")
    print("|---|---|---|---|---|---|---|---|")
    for label, rs in runs.items():
        med = [statistics.median(r[c] for r in rs) for c in cols]
        spread = f" ({min(r['wall'] for r in rs):.2f}-{max(r['wall'] for r in rs):.2f})"
        print(f"| {label} | {med[0]:.2f}{spread} | " + " | ".join(f"{v:.2f}" for v in med[1:])
              + f" | {rs[0]['graph_hits']} |")
    print(f"\nmedian of {args.repeats}; load (1 min) at the end {os.getloadavg()[0]:.1f}")
    return 0


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least-squares ``y = slope x + intercept``: ``(slope, intercept, R^2)``."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    total = sum((y - my) ** 2 for y in ys)
    residual = sum((y - slope * x - intercept) ** 2 for x, y in zip(xs, ys))
    return slope, intercept, 1 - residual / total if total else 1.0


def _depth(args, console) -> int:
    import os
    import statistics

    name, mesh, batch = args.depth.split(":")
    shape = tuple(int(x) for x in mesh.split("x"))
    pipe = {} if args.pipeline is None else {"pipeline": args.pipeline, "num_microbatches": args.microbatches}
    rows = []
    for layers in (int(x) for x in args.layers.split(",")):
        runs = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            model, example = build_model(name, int(batch), num_layers=layers)
            p = plan(model, example, LogicalMesh(shape, cluster=args.cluster), solver=args.solver, **pipe)
            runs.append((time.perf_counter() - t0, p.stats.get("capture_s", 0.0), p.stats.get("ilp_s", 0.0)))
        wall, capture, ilp = (statistics.median(r[i] for r in runs) for i in range(3))
        rows.append((layers, wall, capture, ilp, p.step_seconds, os.getloadavg()[0]))
        console.print(f"{name} num_layers={layers}: {wall:.2f} s (runs {', '.join(f'{r[0]:.2f}' for r in runs)})")
    print("| layers | planning s (median) | capture s | ILP s | predicted step s | load (1 min) |")
    print("|---|---|---|---|---|---|")
    for layers, wall, capture, ilp, step, load in rows:
        print(f"| {layers} | {wall:.2f} | {capture:.2f} | {ilp:.2f} | {step:.4f} | {load:.1f} |")
    slope, intercept, r2 = linear_fit([r[0] for r in rows], [r[1] for r in rows])
    print(f"\nfit: planning s = {slope:.4f} x layers + {intercept:.2f}, R^2 = {r2:.4f}")
    return 0


def _plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(rows)
    for key, label in (("capture", "capture"), ("strategies", "strategies + cost graph"), ("ilp", "ILP solve")):
        vals = [r[key] for r in rows]
        ax.bar(range(len(rows)), vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(rows)), [f"{r['model'][5:]}\n{r['mesh']}" for r in rows])
    ax.set_ylabel("seconds")
    ax.set_title("alpa-lite planning time, GPT-3 shapes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
