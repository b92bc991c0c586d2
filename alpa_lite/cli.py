"""The ``alpa-lite`` command line: plan, train, run, verify, profile, diff."""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from rich.console import Console
from .core.options import PlanOptions
from .core.schedules import SCHEDULES


def _plan_args(p: argparse.ArgumentParser) -> None:
    from .zoo.models import MODEL_NAMES
    p.add_argument("model", help=f"built-in model ({', '.join(MODEL_NAMES)}) or module:callable "
                                 "returning (model, example_inputs)")
    p.add_argument("--mesh", default="1x4", help="logical mesh shape, e.g. 2x4 (default 1x4)")
    p.add_argument("--cluster", default="a100", help="preset (a100, v100, cpu-gloo, unit) or cluster JSON file")
    p.add_argument("--batch", type=int, default=8, help="global batch size (default 8; `train` defaults to 16)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (language models; default: the model's)")
    p.add_argument("--memory-budget", type=float, default=None, help="GiB per device (default: the device's)")
    p.add_argument("--force-dp", action="store_true", help="pure data parallel")
    p.add_argument("--batch-axis", type=int, choices=(0, 1), default=None, help="force the batch onto a mesh axis")
    p.add_argument("--zero-stage", type=int, choices=(1, 2, 3), default=None,
                   help="force every parameter to this ZeRO stage (needs --force-dp or --batch-axis)")
    p.add_argument("--time-limit", type=float, default=60.0, help="ILP solver wall-clock seconds (a backstop)")
    p.add_argument("--node-limit", type=int, default=PlanOptions.node_limit,
                   help="ILP branch-and-bound nodes per solve (reproducible; 0: no limit)")
    p.add_argument("--json", default=None, help="write the plan JSON here")
    p.add_argument("--cache", default=None, metavar="DIR",
                   help="keep ILP answers and the captured graph in DIR between runs: re-planning the same model "
                        "with other pipeline options (schedule, stages, microbatches at the same batch) reuses the "
                        "answers, at another batch or microbatch count the graph (no torch.export); same plan")
    p.add_argument("--all-params", action="store_true", help="list every parameter (no folding of layers)")
    p.add_argument("--pipeline", default=None, metavar="auto|K",
                   help="pipeline stages on submeshes of the mesh (Alpa's inter-op pass): 'auto' or a stage count")
    p.add_argument("--schedule", default=None, choices=(*SCHEDULES, "auto"),
                   help="pipeline schedule (default 1f1b; 'auto': the least predicted step time that fits memory)")
    p.add_argument("--chunks", type=int, default=2, help="stages per device group under --schedule interleaved")
    p.add_argument("--microbatches", type=int, default=None, help="pipeline microbatches (default: chosen)")
    p.add_argument("--layers", type=int, default=None, help="layers to cluster the graph into (default: chosen)")
    p.add_argument("--schedule-chart", default=None, metavar="PNG", help="save a Gantt chart of one pipelined step")
    p.add_argument("--explain", default=None, metavar="NODE",
                   help="list every strategy of a graph node or parameter FQN with its costs")


def cmd_plan(args) -> int:
    import torch  # noqa: F401  (import before rich status so the spinner is not stuck on import)

    from .api import plan
    from .core.mesh import LogicalMesh, get_cluster, parse_mesh_shape
    from .core.plan import PipelinePlan
    from .tools.explain import node_table, plan_tables
    from .tools.progress import PlanProgress
    from .zoo.models import build_model

    console = Console(width=None if sys.stdout.isatty() else 140)
    shape = parse_mesh_shape(args.mesh)
    cluster = get_cluster(args.cluster)
    mesh = cluster.logical_mesh(shape) if shape[0] * shape[1] <= cluster.num_devices else LogicalMesh(shape, cluster=cluster)
    model, example = build_model(args.model, args.batch, args.seq, device="meta")
    if args.memory_budget is not None and not args.memory_budget > 0:
        raise ValueError(f"--memory-budget must be a positive number of GiB, got {args.memory_budget}")
    budget = None if args.memory_budget is None else args.memory_budget * 2**30
    given = [f"--{k.replace('_', '-')}" for k in ("schedule", "microbatches", "layers", "schedule_chart")
             if getattr(args, k) is not None]
    if given and args.pipeline is None:
        raise ValueError(f"{', '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to a pipeline: add --pipeline "
                         "auto (or a stage count)")
    if args.schedule_chart:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ImportError("--schedule-chart needs matplotlib: pip install 'alpa-lite[plot]'") from None
    for out in (args.json, args.schedule_chart):  # fail before planning, not after
        if out and not Path(out).resolve().parent.is_dir():
            raise ValueError(f"cannot write {out}: the directory {Path(out).parent} does not exist")
        if out and Path(out).is_dir():
            raise ValueError(f"cannot write {out}: it is a directory; give a file name")
    with PlanProgress(console) as progress, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        pipelined = {} if args.pipeline is None else dict(
            pipeline=args.pipeline, schedule=args.schedule or "1f1b", chunks=args.chunks,
            num_microbatches=args.microbatches, num_layers=args.layers)
        result = plan(model, example, mesh, memory_budget=budget, force_data_parallel=args.force_dp,
                      batch_axis=args.batch_axis, zero_stage=args.zero_stage, time_limit=args.time_limit,
                      node_limit=args.node_limit or None, **pipelined,
                      progress=progress, cache=args.cache)
    package = Path(__file__).parent
    for w in caught:  # alpa-lite's own warnings (not torch's), on stderr so that stdout keeps the tables
        if Path(w.filename).resolve().is_relative_to(package):
            Console(stderr=True).print(f"[yellow]warning:[/] {w.message}")
    if args.explain:
        explained = node_table(result, args.explain)  # an unknown name fails before the tables
    for table in plan_tables(result, f"{args.model} on a {shape[0]}x{shape[1]} mesh, batch {args.batch}",
                             max_rows=10**6 if args.all_params else 40):
        console.print(table)
    if isinstance(result, PipelinePlan) and args.schedule_chart:
        from .tools.display import schedule_chart
        console.print(f"schedule chart written to {schedule_chart(result, args.schedule_chart)}")
    if args.explain:
        console.print(explained)
    if args.json:
        Path(args.json).write_text(result.to_json())
        console.print(f"plan written to {args.json}")
    return 0


def cmd_run(args) -> int:
    from .runtime.launch import torchrun

    if not args.target:
        print("alpa-lite run: give a script (and its arguments) to run on every rank", file=sys.stderr)
        return 2
    target = args.target[1:] if args.target[0] == "--" else args.target
    if target[0].endswith(".py") and not Path(target[0]).is_file():
        raise ValueError(f"no script {target[0]}")
    env = {"ALPA_LITE_REPORT": "1"} if args.report else {}
    return torchrun(target, nproc=args.nproc, env=env)


def cmd_train(args) -> int:
    from .train import main as train_main

    return train_main(args)


def cmd_verify(args) -> int:
    from .tools.verify import main as verify_main

    return verify_main(args)


def cmd_diff(args) -> int:
    from .core.plan import load_plan
    from .tools.diff import diff_plans, diff_tables

    console = Console(width=None if sys.stdout.isatty() else 160)
    for table in diff_tables(diff_plans(load_plan(args.a), load_plan(args.b)), (args.a, args.b)):
        console.print(table)
    return 0


def cmd_profile(args) -> int:
    from .tools.profile import run

    return run(args)


# Examples shown by ``alpa-lite SUBCOMMAND --help``: commands of README.md, which tests/test_docs.py runs.
EXAMPLES = {
    "plan": ["alpa-lite plan gpt3-2.6b --mesh 2x4 --cluster a100 --batch 16 --json plan.json",
             "alpa-lite plan mlp --mesh 1x4 --cluster unit --memory-budget 0.002 --explain linear_1",
             "alpa-lite plan gpt-tiny --mesh 2x4 --cluster cluster.json"],
    "run": ["alpa-lite run --report --nproc 4 examples/parallel_mlp.py"],
    "train": ["alpa-lite train --model gpt-tiny --nproc 4 --mesh 2x2 --steps 200",
              "alpa-lite train --nproc 1 --mesh 1x1 --cluster cpu.json --steps 10 --report"],
    "verify": ["alpa-lite verify llama --mesh 2x2 --seq 8 --steps 3"],
    "diff": ["alpa-lite diff free.json tight.json"],
    "profile": ["alpa-lite profile --nproc 4 --mesh 2x2 --out cluster.json",
                "alpa-lite profile --nproc 1 --out cpu.json"],
}


def _subparser(sub, name: str, what: str) -> argparse.ArgumentParser:
    epilog = "example" + ("s" if len(EXAMPLES[name]) > 1 else "") + ":\n" + "\n".join(f"  {c}" for c in EXAMPLES[name])
    return sub.add_parser(name, help=what, description=what[0].upper() + what[1:] + ".", epilog=epilog,
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def build_parser() -> argparse.ArgumentParser:
    """The ``alpa-lite`` parser: one subcommand per ``cmd_*`` above, each ``--help`` ending with its examples."""
    parser = argparse.ArgumentParser(prog="alpa-lite", description="Alpa-style automatic parallelization for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    p = _subparser(sub, "plan", "plan a model on a (possibly hypothetical) device mesh and show the plan")
    _plan_args(p)
    p.set_defaults(func=cmd_plan)
    r = _subparser(sub, "run", "run a script on N processes with torchrun")
    r.add_argument("--nproc", type=int, default=4, help="processes (default 4)")
    r.add_argument("--report", action="store_true", help="print predicted vs measured times (sets ALPA_LITE_REPORT=1)")
    r.add_argument("target", nargs=argparse.REMAINDER, help="script.py [args...]")
    r.set_defaults(func=cmd_run)
    from .train import add_arguments as train_args
    t = _subparser(sub, "train", "train a GPT on tinyshakespeare with the auto plan on N processes")
    train_args(t)
    t.set_defaults(func=cmd_train)
    from .tools.verify import add_arguments as verify_args
    v = _subparser(sub, "verify", "train a plan and one process on the same batches; compare losses, "
                                  "gradients, parameters and buffers")
    verify_args(v)
    v.set_defaults(func=cmd_verify)
    from .tools.profile import add_arguments as profile_args
    f = _subparser(sub, "profile", "measure collectives and compute; write a cluster JSON")
    profile_args(f)
    f.set_defaults(func=cmd_profile)
    d = _subparser(sub, "diff", "compare two plan JSON files: changed parameter specs, collectives added or "
                                "removed, predicted time and memory")
    d.add_argument("a", help="the first plan (JSON)")
    d.add_argument("b", help="the second plan (JSON)")
    d.set_defaults(func=cmd_diff)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, RuntimeError, ImportError) as e:  # clear one-line errors for bad input
        Console(stderr=True).print(f"[red]alpa-lite {args.command}: {type(e).__name__}: {e}[/]")
        return 2


if __name__ == "__main__":
    sys.exit(main())
