"""``alpa-lite train``: the main job. Plan and train a GPT on tinyshakespeare on N CPU processes.

Run outside torchrun, it relaunches itself with ``torchrun`` (``alpa_lite.runtime.launch.torchrun``).
On every rank: build the model (same seed everywhere), plan it with the auto planner (rank 0
plans, the plan is broadcast), train with AdamW on character-level text, and on rank 0 print the
plan, a progress bar with loss and step time, and write ``plan.json``, ``log.jsonl`` (one record
per step) and ``summary.json`` under ``--out``. The summary records what ran, as the ranks saw it:
``processes`` (the world size), ``mesh``, ``device`` (``cpu``/``cuda``), ``backend``
(``gloo``/``nccl``), ``dtype`` (of the parameters), ``cluster`` (what the planner priced),
``plan_file`` (the ``--plan`` given, or null when the run planned itself), the losses and the
parameter specs.

``--compile`` runs each rank's step under ``torch.compile`` (``parallelize(..., compile=True)``).
``--accumulate K`` trains each ``--batch`` as K microbatches with one update; ``--max-grad-norm``
clips by the global norm (logged as ``grad_norm``); ``--save DIR`` writes a sharded checkpoint
(``Trainer.save``) with the step count after the last step; ``--resume DIR`` loads one (saved
under any mesh or plan), skips the batches already trained on and continues to ``--steps``, so
a run saved at step k and resumed gives the uninterrupted run's losses.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt-tiny", choices=("gpt-tiny", "gpt2-hf"),
                   help="gpt-tiny (built-in GPT) or gpt2-hf (HuggingFace GPT-2), character-level")
    p.add_argument("--nproc", type=int, default=4, help="processes (devices)")
    p.add_argument("--mesh", default="2x2", help="logical mesh over the processes")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences; default 16, `plan`'s 8)")
    p.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--cluster", default="cpu-gloo", help="cluster preset or JSON file used for planning")
    p.add_argument("--plan", default=None, help="run this plan JSON instead of planning")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mixed-precision", choices=("bf16", "fp16"), default=None,
                   help="fp32 master weights, compute in this dtype (fp16: dynamic loss scaling)")
    p.add_argument("--remat", choices=("auto", "all"), default=None,
                   help="activation checkpointing: the planner chooses per layer (auto) or recomputes every layer")
    p.add_argument("--report", action="store_true",
                   help="print predicted vs measured step and collective times after 2 warm-up + 5 timed steps")
    p.add_argument("--accumulate", type=int, default=1, metavar="K",
                   help="gradient accumulation: --batch is K microbatches, one optimizer update per step")
    p.add_argument("--max-grad-norm", type=float, default=None, help="clip gradients to this global L2 norm")
    p.add_argument("--compile", action="store_true",
                   help="run each rank's step as its plan lowered to torch.fx graphs under torch.compile "
                        "(inductor; a pipeline stage's forward and backward as two graphs); plans without "
                        "dropout or remat, pipeline schedules other than zb-h1")
    p.add_argument("--save", default=None, metavar="DIR",
                   help="write a sharded checkpoint (parameters, optimizer state, step) here at the end")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="resume from a --save checkpoint (any mesh or plan) and train up to --steps in all")
    p.add_argument("--out", default="runs/train", help="directory for plan.json, log.jsonl, summary.json "
                                                         "(replaced by a new run)")


def _overrides(args) -> dict:
    if args.model == "gpt2-hf":
        return {"n_layer": args.layers, "n_embd": args.hidden}
    return {"num_layers": args.layers, "hidden": args.hidden}


def _worker(args) -> int:
    import torch
    import torch.distributed as dist
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from .zoo.data import batches, load_tokens
    from .tools.explain import plan_tables
    from .runtime.launch import init_distributed
    from .core.mesh import parse_mesh_shape
    from .zoo.models import build_model
    from .api import parallelize

    init_distributed(120)
    rank, world = dist.get_rank(), dist.get_world_size()
    console = Console()
    tok, tokens = load_tokens()
    split = int(0.9 * tokens.numel())
    train, val = tokens[:split], tokens[split:]
    model, _ = build_model(args.model, args.batch, args.seq, device="cpu", seed=args.seed, **_overrides(args))
    stream = batches(train, args.batch, args.seq, seed=args.seed)
    first = next(stream)
    shape = parse_mesh_shape(args.mesh)
    t0 = time.perf_counter()
    trainer = parallelize(model, shape, first, optimizer=lambda ps: torch.optim.AdamW(ps, lr=args.lr),
                          plan=args.plan, cluster=args.cluster, report=args.report or None,
                          accumulate=args.accumulate, max_grad_norm=args.max_grad_norm, compile=args.compile,
                          mixed_precision=args.mixed_precision, remat=args.remat)
    plan_s = time.perf_counter() - t0
    start = int(trainer.load(args.resume).get("step", 0)) if args.resume else 0
    if start >= args.steps:
        raise ValueError(f"--resume {args.resume} is at step {start}: nothing to train up to --steps {args.steps}")
    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        trainer.plan.to_json(out / "plan.json")
        for table in plan_tables(trainer.plan, f"{args.model} on {world} {trainer.device.type.upper()} "
                                               f"process{'es' if world > 1 else ''}, mesh {args.mesh}"):
            console.print(table)  # a pipelined plan (a --plan of `alpa-lite plan --pipeline`): its stages
    log = open(out / "log.jsonl", "a" if start else "w") if rank == 0 else None
    losses = []
    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                        TimeRemainingColumn(), console=console, disable=rank != 0)
    with progress:
        task = progress.add_task("train", total=args.steps, completed=start, info="")
        batch = first
        for _ in range(start):  # the batches a resumed run trained on already
            batch = next(stream)
        for step in range(start, args.steps):
            t = time.perf_counter()
            loss = trainer.step(*batch)
            dt = time.perf_counter() - t
            losses.append(loss)
            if log:
                norm = {} if trainer.last_grad_norm is None else {"grad_norm": trainer.last_grad_norm}
                log.write(json.dumps({"step": step, "loss": loss, "step_s": dt} | norm) + "\n")
            progress.update(task, advance=1, info=f"loss {loss:.3f}  step {dt * 1e3:.0f} ms")
            batch = next(stream)
    if args.save:
        trainer.save(args.save, extra={"step": args.steps})
    with torch.no_grad():
        vx, vy = next(batches(val, args.batch, args.seq, seed=1234))
        val_loss = float(trainer.loss(vx, vy))
    if rank == 0:
        log.close()
        k = max(1, min(20, len(losses) // 5))
        summary = {"model": args.model, "processes": world, "mesh": args.mesh, "device": trainer.device.type,
                   "backend": dist.get_backend(), "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
                   "cluster": trainer.plan.mesh.cluster, "plan_file": args.plan, "steps": args.steps,
                   "resumed_at": start, "accumulate": args.accumulate, "max_grad_norm": args.max_grad_norm,
                   "plan_seconds": plan_s, "first_loss": losses[0], "final_loss_avg": sum(losses[-k:]) / k,
                   "val_loss": val_loss, "param_specs": trainer.plan.param_specs}
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        console.print(f"loss {losses[0]:.3f} -> {summary['final_loss_avg']:.3f} (mean of last {k} steps), "
                      f"validation {val_loss:.3f}; plan, log and summary in {out}/")
    dist.barrier()  # every rank tears its connections down together (not while rank 0 still writes)
    dist.destroy_process_group()
    return 0


def main(args) -> int:
    """Entry of ``alpa-lite train``: relaunch under torchrun unless already a rank."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _worker(args)
    from .runtime.launch import torchrun
    from .core.mesh import parse_mesh_shape
    from .core.plan import load_plan

    n0, n1 = parse_mesh_shape(args.mesh)  # bad input fails here, once, not on every rank
    if n0 * n1 != args.nproc:
        raise ValueError(f"mesh {args.mesh} has {n0 * n1} devices but --nproc is {args.nproc}")
    if args.accumulate < 1 or args.batch % args.accumulate:
        raise ValueError(f"--accumulate {args.accumulate} must be a positive divisor of --batch {args.batch}")
    if args.resume and not (Path(args.resume) / ".metadata").is_file():
        raise ValueError(f"--resume {args.resume}: no checkpoint there (no .metadata file)")
    shape = None if args.plan is None else load_plan(args.plan).mesh.shape
    if shape is not None and shape != (n0, n1):
        raise ValueError(f"plan {args.plan} is for a {shape[0]}x{shape[1]} mesh, not {args.mesh}")
    return torchrun(["-m", "alpa_lite.train", *_as_argv(args)], nproc=args.nproc)


def _as_argv(args) -> list[str]:
    """The options again, for the ranks (``--nproc`` stays with the launcher: torchrun would take
    it for its own abbreviated ``--nproc-per-node``)."""
    out = []
    for key, value in vars(args).items():
        if key in ("func", "command", "nproc") or value is None or value is False:
            continue
        out += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="alpa-lite train")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
