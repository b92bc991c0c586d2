"""alpa-lite's runtime vs PyTorch's own parallel wrappers, same model, same 4 ranks, one run.

    python benchmarks/runtime_cpu.py [--nproc 4] [--steps 20] [--out docs/runtime_cpu.md]

- data parallel: alpa-lite's forced DP plan vs ``torch.nn.parallel.DistributedDataParallel``;
- tensor parallel: alpa-lite's Megatron plan (the FFN's fc column-split ``S1R``, proj row-split
  ``RS1``, the rest replicated, the batch replicated, no all-gather allowed: one all-reduce per
  block forward and one backward) vs DTensor ``parallelize_module`` with ``ColwiseParallel`` /
  ``RowwiseParallel`` on the same two layers of every block;
- ZeRO-3: alpa-lite's ``zero_stage=3`` DP plan vs FSDP2 ``fully_shard`` on every block and the
  root, in fp32, in bf16 (``mixed_precision="bf16"`` vs ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=bf16)``) and with every block recomputed (``remat="all"`` vs ``checkpoint_wrapper``
  on every block);
- the auto plan (nothing forced) vs the fastest of DDP, DTensor TP and FSDP2;
- (``--rows compiled``) the ZeRO-3 plan's compiled per-rank program (``compile="aot_eager"``) with
  its collectives reordered to overlap compute (``runtime/overlap.py``) vs the same program as
  traced, and the DP plan's compiled program (its gradient buckets' all-reduces in its graph,
  launched during backward) vs DDP.
Every alpa-lite plan is made for a cluster measured on this machine: ``--cluster FILE`` (a cluster
JSON), else ``alpa-lite profile`` runs first on the same ranks and mesh (measured collective
curves, written next to ``--out`` as ``*_cluster.json``); the ``cpu-gloo`` preset (100 us latency
and 1 GB/s for every collective kind) is not this machine's gloo. Rank 0 prints each plan's
predicted step and the auto plan's listing.
Every rank trains the built-in GPT (``--hidden``, ``--layers``) with AdamW on the same batches.
All configurations are built first, then every step index runs each of them once, in an order
rotated each step, so a change of machine load falls on all of them alike. Per configuration:
the median step time after warm-up (with its spread) and the peak memory per rank (the largest
over the ranks), compared as ratios alpa-lite / PyTorch. Peak memory = the parameter and
optimizer-state bytes the rank holds (local shards of DTensors) + the largest growth of its
resident set during one step after warm-up (sampled every millisecond, from a base taken after returning freed
heap pages to the OS), which holds gradients, activations, gathered parameters and communication
buffers. torch has no peak-allocation counter on CPU, and ``tracemalloc`` does not see tensor
storage.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path


NOTE = ("Ratios are alpa-lite / baseline (PyTorch; in the compiled row the same program as traced; below 1: "
        "alpa-lite is faster or smaller). Peak MiB per rank (the largest over the ranks) = parameters + optimizer "
        "states the rank holds (a DTensor's local shard) + the largest resident-set growth during one step after "
        "warm-up (gradients, activations, gathered parameters, communication buffers), sampled every millisecond; "
        "torch keeps no peak-allocation counter on CPU and tracemalloc does not see tensor storage. The resident set "
        "moves in whole pages and the allocator keeps some freed memory, so differences of a few MiB are noise; "
        "persistent buffers outside parameters and optimizer states (DDP's gradient buckets) are not counted. Both "
        "data-parallel runs all-reduce the gradients in buckets of the same size, each started during backward once "
        "its gradients are ready. The tensor-parallel runs split the same layers. The ZeRO-3 rows shard every "
        "parameter over the 4 ranks on both sides (FSDP2: one group per block and one for the rest).")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class StepMemory:
    """Peak resident-set growth (bytes) of one step over the resident set just before it, sampled
    every millisecond by one thread for the whole run."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self.lock = threading.Lock()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            with self.lock:
                self.peak = max(self.peak, _rss())
            time.sleep(0.001)

    def reset(self):
        """Start a new step: the current resident set is the new base."""
        with self.lock:
            self.base = self.peak = _rss()

    def growth(self) -> int:
        return max(self.peak, _rss()) - self.base

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()


def _release_free_memory():
    """Return freed heap pages to the OS so each step's growth starts from a clean base."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _local_bytes(tensors) -> int:
    """Bytes this rank holds of ``tensors`` (a DTensor counts its local shard)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def _state_bytes(params, optimizer) -> int:
    """Parameters plus optimizer states held by this rank, bytes."""
    import torch

    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
    return _local_bytes(params) + _local_bytes(states)


def _run_interleaved(runners, batches, warmup):
    """Every step index runs every runner once, in an order rotated each step; returns
    name -> (median step s, spread, peak bytes: state + largest growth of a step after warm-up,
    predicted step s)."""
    import torch.distributed as dist

    names = list(runners)
    times = {k: [] for k in names}
    growth = dict.fromkeys(names, 0)
    with StepMemory() as mem:
        for i, b in enumerate(batches):
            for k in names[i % len(names):] + names[:i % len(names)]:
                _release_free_memory()
                dist.barrier()
                mem.reset()
                t = time.perf_counter()
                runners[k][0](b)
                dt = time.perf_counter() - t
                if i >= warmup:  # a warm-up step's one-time allocations (a compilation's) are not the step's
                    growth[k] = max(growth[k], mem.growth())
                    times[k].append(dt)
    out = {}
    for k in names:
        q = statistics.quantiles(times[k], n=4) if len(times[k]) > 1 else [times[k][0]] * 3
        med = statistics.median(times[k])
        out[k] = (med, (q[2] - q[0]) / 2 / med, runners[k][1]() + growth[k], runners[k][2])
    return out


def _print_plan(plan) -> None:
    """The auto plan's summary, parameter specs with ZeRO stages and collectives (rich tables)."""
    from rich.console import Console

    from alpa_lite.tools.explain import collective_table, param_table, summary_table

    console = Console(width=160)
    for table in (summary_table(plan, "alpa-lite auto"), param_table(plan), collective_table(plan)):
        console.print(table)


def _profile(nproc: int, out: Path) -> Path:
    """Measure this machine's 1 x ``nproc`` cluster with ``alpa-lite profile`` (collective curves)."""
    from alpa_lite.tools.profile import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    if run(parser.parse_args(["--nproc", str(nproc), "--mesh", f"1x{nproc}", "--out", str(out), "--use-curves"])):
        raise SystemExit("profiling the cluster failed")
    return out


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from alpa_lite.runtime.launch import init_distributed
    from alpa_lite.zoo.models import build_model
    from alpa_lite import parallelize

    init_distributed(600)
    n, rank = dist.get_world_size(), dist.get_rank()
    model, example = build_model("gpt-tiny", args.batch, args.seq, device="cpu", hidden=args.hidden,
                                 num_layers=args.layers, num_heads=args.heads)
    batches = [build_model("gpt-tiny", args.batch, args.seq, device="cpu", hidden=args.hidden, num_layers=args.layers,
                           num_heads=args.heads, seed=10 + i)[1] for i in range(args.steps)]
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    lo, hi = rank * args.batch // n, (rank + 1) * args.batch // n
    mesh = init_device_mesh("cpu", (n,))
    runners = {}  # name -> (step(batch), state bytes(), predicted step s or None)

    def torch_runner(module, data_parallel):
        opt = adamw(module.parameters())

        def step(b):
            opt.zero_grad(set_to_none=True)
            module(*(t[lo:hi] for t in b) if data_parallel else b).backward()
            opt.step()
        return step, lambda: _state_bytes(module.parameters(), opt), None

    def alpa_runner(program_overlap=True, **kw):
        t = parallelize(copy.deepcopy(model), (1, n), example, optimizer=adamw, bucket_bytes=args.bucket_mib * 2**20,
                        cluster=args.cluster, **kw)
        if getattr(t, "program", None) is not None:  # compiled: reorder its graph's collectives (runtime/overlap.py) or not
            t.program.overlap = program_overlap
        if rank == 0 and not kw:
            _print_plan(t.plan)
        return lambda b: t.step(*b), lambda: _state_bytes(t.params.values(), t.optimizer), t.plan.step_seconds

    def fsdp2(mp=None, remat=False):
        m = copy.deepcopy(model)
        for i, block in enumerate(m.blocks):
            if remat:
                block = m.blocks[i] = checkpoint_wrapper(block)
            fully_shard(block, mesh=mesh, **({"mp_policy": mp} if mp else {}))
        fully_shard(m, mesh=mesh, **({"mp_policy": mp} if mp else {}))
        return torch_runner(m, True)

    rows = set(args.rows.split(","))
    if rows & {"dp", "auto", "compiled"}:
        runners["DDP"] = torch_runner(torch.nn.parallel.DistributedDataParallel(
            copy.deepcopy(model), bucket_cap_mb=args.bucket_mib), True)
    if "dp" in rows:
        runners["alpa-lite DP"] = alpa_runner(force_data_parallel=True)
    if rows & {"tp", "auto"}:
        tp_model = copy.deepcopy(model)
        parallelize_module(tp_model, mesh, {f"blocks.{i}.ffn.{name}": style for i in range(args.layers)
                                            for name, style in (("fc", ColwiseParallel()), ("proj", RowwiseParallel()))})
        runners["DTensor TP"] = torch_runner(tp_model, False)
    if "tp" in rows:
        specs = {fqn: "R" * p.dim() for fqn, p in model.named_parameters()}
        for i in range(args.layers):
            specs |= {f"blocks.{i}.ffn.fc.weight": "S1R", f"blocks.{i}.ffn.fc.bias": "S1",
                      f"blocks.{i}.ffn.proj.weight": "RS1"}
        # no all-gather: with one the ILP gathers the split weights for a data-parallel step (ZeRO-3) instead
        runners["alpa-lite Megatron TP"] = alpa_runner(param_specs=specs, input_specs={"0": "RR", "1": "RR"},
                                                       allow_all_gather=False)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    if rows & {"zero3", "auto"}:
        runners["FSDP2"] = fsdp2()
    if "zero3" in rows:
        runners["alpa-lite ZeRO-3"] = alpa_runner(force_data_parallel=True, zero_stage=3)
    if "bf16" in rows:
        runners["FSDP2 bf16"] = fsdp2(mp=bf16)
        runners["alpa-lite ZeRO-3 bf16"] = alpa_runner(force_data_parallel=True, zero_stage=3, mixed_precision="bf16")
    if "remat" in rows:
        runners["FSDP2 remat"] = fsdp2(remat=True)
        runners["alpa-lite ZeRO-3 remat"] = alpa_runner(force_data_parallel=True, zero_stage=3, remat="all")
    if "auto" in rows:
        runners["alpa-lite auto"] = alpa_runner()
    if "compiled" in rows:
        for label, overlap in (("alpa-lite ZeRO-3 compiled", True), ("alpa-lite ZeRO-3 compiled, as traced", False)):
            runners[label] = alpa_runner(force_data_parallel=True, zero_stage=3, compile="aot_eager",
                                         program_overlap=overlap)
        runners["alpa-lite DP compiled"] = alpa_runner(force_data_parallel=True, compile="aot_eager")
    results = _run_interleaved(runners, batches, args.warmup)
    gathered = [None] * n
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(args.result).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


def model_arguments(ap: argparse.ArgumentParser, steps: int, warmup: int) -> None:
    """The run's options shared with ``step_phases.py``: ranks, steps, the GPT and the bucket size."""
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--bucket-mib", type=float, default=4.0, help="gradient bucket size of both DP runs, MiB")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--result", default=None)


def main() -> int:
    ap = argparse.ArgumentParser()
    model_arguments(ap, steps=25, warmup=5)
    ap.add_argument("--out", default="docs/runtime_cpu.md")
    ap.add_argument("--cluster", default=None, help="cluster JSON the alpa-lite plans are made for (default: profile "
                    "this machine first, into the --out file's *_cluster.json)")
    ap.add_argument("--rows", default="dp,tp,zero3,bf16,remat,auto",
                    help="comparisons to run (comma-separated of dp, tp, zero3, bf16, remat, auto, compiled); auto "
                    "builds DDP, DTensor TP and FSDP2 for its fastest manual setup; compiled: the ZeRO-3 plan's "
                    "compiled program (aot_eager) with its collectives reordered (runtime/overlap.py) vs as traced, and the DP "
                    "plan's compiled program vs DDP")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    from rich.console import Console
    from rich.table import Table

    from alpa_lite.runtime.launch import torchrun

    result = Path(args.out).with_suffix(".json")
    argv = [a for a in sys.argv[1:]]
    t0 = time.monotonic()
    cluster = Path(args.cluster) if args.cluster else _profile(args.nproc, Path(args.out).with_name(
        Path(args.out).stem + "_cluster.json"))
    t_profile = time.monotonic() - t0
    load = os.getloadavg()[0]
    code = torchrun([__file__, "--worker", "--result", str(result), *argv, "--cluster", str(cluster.resolve())],
                    nproc=args.nproc)
    if code:
        return code
    per_rank = json.loads(result.read_text())
    result.unlink()
    # rank 0's median step time (every step starts at a barrier); the largest peak over the ranks
    r = {k: (t, s, max(rr[k][2] for rr in per_rank), pred) for k, (t, s, _, pred) in per_rank[0].items()}
    fastest = min((k for k in ("DDP", "DTensor TP", "FSDP2") if k in r), key=lambda k: r[k][0], default=None)
    rows = [row for row in [  # label, alpa-lite, PyTorch, time target, memory target (issues 12 and 13)
        ("data parallel", "alpa-lite DP", "DDP", 1.00, None),
        ("tensor parallel", "alpa-lite Megatron TP", "DTensor TP", 1.00, None),
        ("ZeRO-3", "alpa-lite ZeRO-3", "FSDP2", 1.05, None),
        ("bf16 mixed, ZeRO-3", "alpa-lite ZeRO-3 bf16", "FSDP2 bf16", 1.10, 1.00),
        ("remat, ZeRO-3", "alpa-lite ZeRO-3 remat", "FSDP2 remat", 1.10, 1.00),
        ("auto vs fastest manual", "alpa-lite auto", fastest, 1.00, None),
        ("compiled ZeRO-3, overlap pass vs none", "alpa-lite ZeRO-3 compiled", "alpa-lite ZeRO-3 compiled, as traced",
         1.00, None),
        ("compiled data parallel", "alpa-lite DP compiled", "DDP", 1.00, None)] if row[1] in r]
    table = Table(title=f"runtime on {args.nproc} CPU processes (gloo): GPT hidden {args.hidden}, {args.layers} layers, "
                        f"batch {args.batch}, seq {args.seq}")
    heads = ["", "alpa-lite step ms", "alpa-lite predicted ms", "baseline step ms", "time ratio", "alpa-lite peak MiB",
             "baseline peak MiB", "memory ratio", "target", "holds"]
    for h in heads:
        table.add_column(h, justify="right")
    lines = ["| " + " | ".join(heads[1:]).join(["comparison | ", ""]) + " |", "|" + "---|" * len(heads)]
    for label, ours, theirs, t_goal, m_goal in rows:
        (t1, s1, m1, p1), (t2, s2, m2, _) = r[ours], r[theirs]
        holds = t1 / t2 <= t_goal and (m_goal is None or m1 / m2 <= m_goal)
        goal = f"time <= {t_goal:.2f}x" + ("" if m_goal is None else f", memory <= {m_goal:.2f}x")
        cells = [f"{label} ({ours} vs {theirs})", f"{t1 * 1e3:.1f} ±{s1:.0%}", f"{p1 * 1e3:.1f}",
                 f"{t2 * 1e3:.1f} ±{s2:.0%}", f"{t1 / t2:.2f}", f"{m1 / 2**20:.1f}", f"{m2 / 2**20:.1f}", f"{m1 / m2:.2f}",
                 goal, "yes" if holds else "no"]
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    Console(width=200).print(table)
    Path(args.out).write_text(
        "# Runtime on CPU processes\n\nCommand: `python benchmarks/runtime_cpu.py " + " ".join(argv) + "` "
        f"({args.nproc} gloo ranks on a 2-core machine shared with other jobs, so the figures are noisy; every step "
        f"index runs every configuration once, in an order rotated each step; median of {args.steps - args.warmup} "
        f"steps after {args.warmup} warm-up steps on rank 0, ± half the 25th-75th percentile range relative to the "
        f"median; gradient buckets of {args.bucket_mib:g} MiB in the DP runs). The alpa-lite plans are made for "
        f"cluster `{cluster.name}` ({'given' if args.cluster else f'profiled first, {t_profile:.0f} s'}; predicted: "
        f"`Plan.step_seconds`); load average {load:.1f} at the start of the run, {os.getloadavg()[0]:.1f} at its end."
        "\n\n"
        + "\n".join(lines) + "\n\n" + NOTE + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
