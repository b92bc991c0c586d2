"""alpa-lite's runtime vs PyTorch's own parallel wrappers, same model, same 4 ranks, one run.

    python benchmarks/runtime_cpu.py [--nproc 4] [--steps 20] [--out docs/runtime_cpu.md]

- data parallel: alpa-lite's forced DP plan vs ``torch.nn.parallel.DistributedDataParallel``;
- tensor parallel: alpa-lite's Megatron plan (the FFN's fc column-split ``S1R``, proj row-split
  ``RS1``, the rest replicated) vs DTensor ``parallelize_module`` with ``ColwiseParallel`` /
  ``RowwiseParallel`` on the same two layers of every block.
Every rank trains the built-in GPT (``--hidden``, ``--layers``) with AdamW on the same batches;
the median step time after warm-up (with its spread) and the peak growth of the resident set during the steps
(sampled every millisecond, after returning freed heap
pages to the OS) are compared as ratios alpa-lite / PyTorch.
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


NOTE = ('Ratios are alpa-lite / PyTorch (below 1: alpa-lite is faster or smaller). Both data-parallel runs all-reduce the gradients in buckets of the same size, each started during backward once its gradients are ready. The tensor-parallel runs split the same layers; DTensor pays its per-op dispatch and sharding propagation on every call, alpa-lite runs plain aten ops on local shards with the collectives decided at planning time.')


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Peak resident-set growth (bytes) while the block runs, sampled every millisecond."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, _rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.growth = self.peak - self.base


def _release_free_memory():
    """Return freed heap pages to the OS so each configuration's growth starts from a clean base."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _time_steps(step, batches, warmup):
    import torch.distributed as dist

    _release_free_memory()
    times = []
    with PeakRSS() as mem:
        for i, b in enumerate(batches):
            dist.barrier()
            t = time.perf_counter()
            step(b)
            dt = time.perf_counter() - t
            if i >= warmup:
                times.append(dt)
    q = statistics.quantiles(times, n=4)
    med = statistics.median(times)
    return med, (q[2] - q[0]) / 2 / med, mem.growth


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from alpa_lite.runtime.launch import init_distributed
    from alpa_lite.zoo.models import build_model
    from alpa_lite import parallelize

    init_distributed(300)
    n = dist.get_world_size()
    model, example = build_model("gpt-tiny", args.batch, args.seq, device="cpu", hidden=args.hidden,
                                 num_layers=args.layers, num_heads=args.heads)
    batches = [build_model("gpt-tiny", args.batch, args.seq, device="cpu", hidden=args.hidden, num_layers=args.layers,
                           num_heads=args.heads, seed=10 + i)[1] for i in range(args.steps)]
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    results = {}

    # data parallel
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=args.bucket_mib)
    opt = adamw(ddp.parameters())

    def ddp_step(b):
        opt.zero_grad(set_to_none=True)
        lo, hi = dist.get_rank() * args.batch // n, (dist.get_rank() + 1) * args.batch // n
        ddp(*(t[lo:hi] for t in b)).backward()
        opt.step()

    results["DDP"] = _time_steps(ddp_step, batches, args.warmup)
    alpa_dp = parallelize(copy.deepcopy(model), (1, n), example, optimizer=adamw, force_data_parallel=True,
                          bucket_bytes=args.bucket_mib * 2**20)
    results["alpa-lite DP"] = _time_steps(lambda b: alpa_dp.step(*b), batches, args.warmup)

    # tensor parallel (Megatron FFN)
    tp_model = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (n,))
    plan = {}
    for i in range(args.layers):
        plan[f"blocks.{i}.ffn.fc"] = ColwiseParallel()
        plan[f"blocks.{i}.ffn.proj"] = RowwiseParallel()
    parallelize_module(tp_model, mesh, plan)
    tp_opt = adamw(tp_model.parameters())

    def dtensor_step(b):
        tp_opt.zero_grad(set_to_none=True)
        tp_model(*b).backward()
        tp_opt.step()

    results["DTensor TP"] = _time_steps(dtensor_step, batches, args.warmup)
    specs = {}
    for fqn, p in model.named_parameters():
        specs[fqn] = "R" * p.dim()
    for i in range(args.layers):
        specs |= {f"blocks.{i}.ffn.fc.weight": "S1R", f"blocks.{i}.ffn.fc.bias": "S1",
                  f"blocks.{i}.ffn.proj.weight": "RS1"}
    alpa_tp = parallelize(copy.deepcopy(model), (1, n), example, optimizer=adamw, param_specs=specs,
                          input_specs={"0": "RR", "1": "RR"})
    results["alpa-lite Megatron TP"] = _time_steps(lambda b: alpa_tp.step(*b), batches, args.warmup)
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--bucket-mib", type=float, default=4.0, help="gradient bucket size of both DP runs, MiB")
    ap.add_argument("--out", default="docs/runtime_cpu.md")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--result", default=None)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    from rich.console import Console
    from rich.table import Table

    from alpa_lite.runtime.launch import torchrun

    result = Path(args.out).with_suffix(".json")
    argv = [a for a in sys.argv[1:]]
    code = torchrun([__file__, "--worker", "--result", str(result), *argv], nproc=args.nproc)
    if code:
        return code
    r = json.loads(result.read_text())
    result.unlink()
    rows = [("data parallel", "alpa-lite DP", "DDP"), ("tensor parallel", "alpa-lite Megatron TP", "DTensor TP")]
    table = Table(title=f"runtime on {args.nproc} CPU processes (gloo): GPT hidden {args.hidden}, {args.layers} layers, "
                        f"batch {args.batch}, seq {args.seq}")
    heads = ["", "alpa-lite step ms", "PyTorch step ms", "time ratio", "alpa-lite peak MiB", "PyTorch peak MiB",
             "memory ratio"]
    for h in heads:
        table.add_column(h, justify="right")
    lines = ["| " + " | ".join(heads[1:]).join(["comparison | ", ""]) + " |", "|" + "---|" * len(heads)]
    for label, ours, theirs in rows:
        (t1, s1, m1), (t2, s2, m2) = r[ours], r[theirs]
        cells = [f"{label} ({ours} vs {theirs})", f"{t1 * 1e3:.1f} ±{s1:.0%}", f"{t2 * 1e3:.1f} ±{s2:.0%}", f"{t1 / t2:.2f}",
                 f"{m1 / 2**20:.1f}", f"{m2 / 2**20:.1f}", f"{m1 / max(m2, 1):.2f}"]
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    Console(width=160).print(table)
    Path(args.out).write_text(
        "# Runtime on CPU processes\n\nCommand: `python benchmarks/runtime_cpu.py " + " ".join(argv) + "` "
        f"({args.nproc} gloo ranks on a 2-core machine shared with other jobs, so the figures are noisy; median of "
        f"{args.steps - args.warmup} steps after {args.warmup} warm-up steps, ± half the 25th-75th percentile range "
        f"relative to the median; gradient buckets of {args.bucket_mib:g} MiB in both DP runs; peak = growth of each "
        "rank-0 resident set during the steps).\n\n"
        + "\n".join(lines) + "\n\n" + NOTE + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
