"""Where a data-parallel step's time goes: alpa-lite's DP plan vs DDP, per phase, on rank 0.

    python benchmarks/step_phases.py [--nproc 4] [--steps 20] [--warmup 4] [--cluster FILE]

Both train the built-in GPT of ``benchmarks/runtime_cpu.py`` (same sizes, AdamW, gradient
buckets of ``--bucket-mib``) on the same batches, one step of each per step index, in an order
alternated each step, every step started at a barrier. Per phase, the median over the steps
after warm-up of rank 0's wall and CPU milliseconds (``time.perf_counter`` /
``time.process_time``; the CPU time is the process's, gloo's threads included):

- forward: alpa-lite ``LocalExecutor.run`` (the graph interpreted on local shards, its
  collectives included), DDP the module's call;
- backward: ``loss.backward()`` (alpa-lite: the bucket all-reduces start from its hooks; DDP's
  end-of-backward wait for its buckets is inside it);
- wait: alpa-lite's ``_sync_buckets`` after backward (the buckets not launched yet, every
  all-reduce waited on, the sums copied back into ``.grad``); DDP: none (inside backward);
- optimizer: ``optimizer.step()``;
- step: the whole step, as ``runtime_cpu.py`` times it (``zero_grad`` and the loss's ``float``
  included).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

from runtime_cpu import model_arguments  # this directory is on sys.path when run as a script

PHASES = ("forward", "backward", "wait", "optimizer", "step")


class Clock:
    """Wall and CPU seconds of named phases of the current step."""

    def __init__(self):
        self.now: dict[str, list[float]] = {}

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            w, c = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                acc = self.now.setdefault(name, [0.0, 0.0])
                acc[0] += time.perf_counter() - w
                acc[1] += time.process_time() - c
        return timed


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from alpa_lite import parallelize
    from alpa_lite.runtime.launch import init_distributed
    from alpa_lite.zoo.models import build_model

    init_distributed(600)
    n, rank = dist.get_world_size(), dist.get_rank()
    sizes = dict(device="cpu", hidden=args.hidden, num_layers=args.layers, num_heads=args.heads)
    model, example = build_model("gpt-tiny", args.batch, args.seq, **sizes)
    batches = [build_model("gpt-tiny", args.batch, args.seq, seed=10 + i, **sizes)[1] for i in range(args.steps)]
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    lo, hi = rank * args.batch // n, (rank + 1) * args.batch // n
    clocks = {"DDP": Clock(), "alpa-lite DP": Clock()}

    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=args.bucket_mib)
    opt = adamw(ddp.parameters())
    ck = clocks["DDP"]
    ddp_forward, ddp_step = ck.wrap("forward", ddp), ck.wrap("optimizer", opt.step)
    ddp_backward = ck.wrap("backward", lambda loss: loss.backward())

    def ddp_train(b):
        opt.zero_grad(set_to_none=True)
        loss = ddp_forward(*(t[lo:hi] for t in b))
        ddp_backward(loss)
        ddp_step()
        return float(loss.detach())

    t = parallelize(copy.deepcopy(model), (1, n), example, optimizer=adamw, bucket_bytes=args.bucket_mib * 2**20,
                    cluster=args.cluster, force_data_parallel=True)
    ck = clocks["alpa-lite DP"]
    t._run = ck.wrap("forward", t._run)
    t._sync_buckets = ck.wrap("wait", t._sync_buckets)
    t.optimizer.step = ck.wrap("optimizer", t.optimizer.step)
    backward = torch.Tensor.backward
    steps = {"DDP": ddp_train, "alpa-lite DP": lambda b: t.step(*b)}
    samples = {k: {p: [] for p in PHASES} for k in steps}
    for i, b in enumerate(batches):
        for k in list(steps)[i % 2:] + list(steps)[:i % 2]:
            clocks[k].now = {}
            if k == "alpa-lite DP":  # the trainer's loss.backward(), timed
                torch.Tensor.backward = ck.wrap("backward", backward)
            dist.barrier()
            w, c = time.perf_counter(), time.process_time()
            steps[k](b)
            clocks[k].now["step"] = [time.perf_counter() - w, time.process_time() - c]
            torch.Tensor.backward = backward
            if i >= args.warmup:
                for p in PHASES:
                    samples[k][p].append(clocks[k].now.get(p, [0.0, 0.0]))
    if rank == 0:
        out = {k: {p: [statistics.median(x[j] for x in v) * 1e3 for j in (0, 1)] for p, v in s.items()}
               for k, s in samples.items()}
        Path(args.result).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser()
    model_arguments(ap, steps=20, warmup=4)
    ap.add_argument("--cluster", default="docs/runtime_cpu_cluster.json", help="cluster JSON the DP plan is made for")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    import os
    import tempfile

    from alpa_lite.runtime.launch import torchrun

    result = Path(tempfile.mkdtemp()) / "phases.json"
    argv = [a for a in sys.argv[1:] if a != "--cluster" and a != args.cluster]
    load = os.getloadavg()[0]
    code = torchrun([__file__, "--worker", "--result", str(result), *argv, "--cluster",
                     str(Path(args.cluster).resolve())], nproc=args.nproc, timeout_s=1800)
    if code:
        return code
    out = json.loads(result.read_text())
    print(f"rank 0, median of {args.steps - args.warmup} steps, wall / CPU ms; load average {load:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end")
    print("| phase | " + " | ".join(f"{k} wall | {k} CPU" for k in out) + " |")
    print("|---|" + "---|" * 2 * len(out))
    for p in PHASES:
        print(f"| {p} | " + " | ".join(f"{out[k][p][0]:.1f} | {out[k][p][1]:.1f}" for k in out) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
