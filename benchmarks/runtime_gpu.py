"""alpa-lite's runtime vs plain PyTorch on the devices at hand (CUDA; CPU for a smoke run).

    python benchmarks/runtime_gpu.py [--models gpt2-small,gpt2-medium] [--dtypes fp32,bf16]
                                     [--batch 8] [--seq 1024] [--out docs/runtime_gpu.md]
    python benchmarks/runtime_gpu.py --smoke --out /tmp/x.md     # tiny GPT on CPU, seconds

- one device (world size 1, mesh 1x1): the interpreted alpa-lite step (``parallelize``) and the
  compiled one (``parallelize(..., compile=backend)``: the rank's step lowered to one
  ``torch.fx.GraphModule`` under ``torch.compile``, ``runtime/program.py``) vs eager PyTorch and
  ``torch.compile``d PyTorch on the same model, AdamW, same batches. The runners take turns
  (``--repeats`` rounds of ``--steps`` steps each, after ``--warmup`` steps), so a slow phase of
  a shared machine hits all of them; the table gives each one's median step and the spread of
  its steps (the 25th to 75th percentile, relative to the median) and peak memory growth during
  its steps (CUDA only).
- with >= 2 ranks (``--dp-ranks``, default: every GPU): alpa-lite's data-parallel plan vs
  ``DistributedDataParallel``, and alpa-lite's Megatron plan (each block's FFN fc column-split
  ``S1R``, proj row-split ``RS1``, the rest replicated, the batch replicated) vs DTensor
  ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` on the same layers,
  over all ranks, the same way (each alpa-lite row's ratio is to its PyTorch counterpart).
Parameters are cast to the dtype (bf16: pure bf16 weights and optimizer state, the same for all
runners).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _runners(args, name: str, dtype: str, n: int):
    """``{label: step(batch)}`` and the batches, for one model and dtype on this rank."""
    import torch
    import torch.distributed as dist

    from alpa_lite import parallelize
    from alpa_lite.runtime.launch import default_device
    from alpa_lite.zoo.models import build_model

    device = default_device()
    dt = getattr(torch, DTYPES[dtype])
    over = dict(hidden=64, num_layers=2, num_heads=4, vocab_size=128) if args.smoke else {}
    model, example = build_model(name, args.batch, args.seq, device="cpu", **over)
    model = model.to(dt)
    batches = [tuple(t.to(device) for t in build_model(name, args.batch, args.seq, device="cpu",
                                                       seed=10 + i, **over)[1]) for i in range(4)]
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-4)  # noqa: E731
    rank = dist.get_rank()
    lo, hi = rank * args.batch // n, (rank + 1) * args.batch // n
    runners = {}

    def torch_step(module, opt, shard: bool):
        def step(b):
            opt.zero_grad(set_to_none=True)
            module(*((t[lo:hi] for t in b) if shard else b)).backward()
            opt.step()
        return step

    if n == 1:
        eager = copy.deepcopy(model).to(device)
        runners["eager PyTorch"] = torch_step(eager, adamw(eager.parameters()), False)
        compiled = copy.deepcopy(model).to(device)
        runners["torch.compile"] = torch_step(torch.compile(compiled, backend=args.compile_backend),
                                              adamw(compiled.parameters()), False)
        trainer = parallelize(copy.deepcopy(model), (1, 1), example, optimizer=adamw)
        runners["alpa-lite interpreted"] = lambda b: trainer.step(*b)
        program = parallelize(copy.deepcopy(model), (1, 1), example, optimizer=adamw, plan=trainer.plan,
                              compile=args.compile_backend)
        runners["alpa-lite compiled"] = lambda b: program.step(*b)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model).to(device))
        runners["DDP"] = torch_step(ddp, adamw(ddp.parameters()), True)
        trainer = parallelize(copy.deepcopy(model), (1, n), example, optimizer=adamw, force_data_parallel=True)
        runners["alpa-lite DP"] = lambda b: trainer.step(*b)
        layers = len(model.blocks)
        tp = copy.deepcopy(model).to(device)
        parallelize_module(tp, init_device_mesh(device.type, (n,)), {
            f"blocks.{i}.ffn.{name}": style for i in range(layers)
            for name, style in (("fc", ColwiseParallel()), ("proj", RowwiseParallel()))})
        runners["DTensor TP"] = torch_step(tp, adamw(tp.parameters()), False)
        specs = {fqn: "R" * p.dim() for fqn, p in model.named_parameters()}
        for i in range(layers):
            specs |= {f"blocks.{i}.ffn.fc.weight": "S1R", f"blocks.{i}.ffn.fc.bias": "S1",
                      f"blocks.{i}.ffn.proj.weight": "RS1"}
        megatron = parallelize(copy.deepcopy(model), (1, n), example, optimizer=adamw, param_specs=specs,
                               input_specs={"0": "RR", "1": "RR"})
        runners["alpa-lite Megatron TP"] = lambda b: megatron.step(*b)
    return runners, batches, device


BASELINES = {"torch.compile": "eager PyTorch", "alpa-lite interpreted": "eager PyTorch",
             "alpa-lite compiled": "torch.compile", "alpa-lite DP": "DDP", "alpa-lite Megatron TP": "DTensor TP"}


def _measure(args, runners, batches, device) -> dict:
    """Per runner: median step seconds, relative spread (p75 - p25) / median, peak bytes growth."""
    import torch
    import torch.distributed as dist

    times = {k: [] for k in runners}
    peak = {k: 0 for k in runners}
    for label, step in runners.items():
        for i in range(args.warmup):
            step(batches[i % len(batches)])
    for _ in range(args.repeats):
        for label, step in runners.items():
            _sync(device)
            if device.type == "cuda":
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            for i in range(args.steps):
                dist.barrier()
                _sync(device)
                t0 = time.perf_counter()
                step(batches[i % len(batches)])
                _sync(device)
                times[label].append(time.perf_counter() - t0)
            if device.type == "cuda":
                peak[label] = max(peak[label], torch.cuda.max_memory_allocated() - base)
    out = {}
    for label, ts in times.items():
        q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
        med = statistics.median(ts)
        out[label] = {"median_s": med, "spread": (q[2] - q[0]) / med, "peak_bytes": peak[label] or None,
                      "steps": len(ts)}
    return out


def worker(args) -> None:
    import torch.distributed as dist

    from alpa_lite.runtime.launch import init_distributed

    init_distributed(600)
    n = dist.get_world_size()
    results = {}
    for name in args.models.split(","):
        for dtype in args.dtypes.split(","):
            runners, batches, device = _runners(args, name, dtype, n)
            results[f"{name}|{dtype}"] = _measure(args, runners, batches, device)
            del runners
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps({"device": _device_name(), "world": n, "results": results}))
    dist.barrier()
    dist.destroy_process_group()


def _device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"CPU ({torch.get_num_threads()} threads per process)"


def _table(r: dict) -> list[str]:
    """The markdown rows of one run: each runner's time ratio is to its ``BASELINES`` entry (a
    runner without one: 1)."""
    lines = ["| model | dtype | runner | median step ms | spread | time ratio | vs | peak MiB |",
             "|---|---|---|---|---|---|---|---|"]
    for key, runs in r["results"].items():
        model, dtype = key.split("|")
        for label, m in runs.items():
            base = BASELINES.get(label, label)
            peak = "-" if m["peak_bytes"] is None else f"{m['peak_bytes'] / 2**20:.0f}"
            lines.append(f"| {model} | {dtype} | {label} | {m['median_s'] * 1e3:.2f} | ±{m['spread'] * 50:.1f}% | "
                         f"{m['median_s'] / runs[base]['median_s']:.3f} | {'-' if base == label else base} | {peak} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt2-small,gpt2-medium")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per runner per round")
    ap.add_argument("--repeats", type=int, default=3, help="rounds: the runners take turns")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dp-ranks", type=int, default=None, help="ranks of the DP vs DDP run (default: the GPUs; "
                                                                 "skipped below 2)")
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument("--smoke", action="store_true", help="a tiny GPT on CPU, 2+2 steps: the script still runs")
    ap.add_argument("--out", default="docs/runtime_gpu.md")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--result", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.models, args.dtypes, args.batch, args.seq = "gpt-tiny", "fp32", 4, 16
        args.steps, args.repeats, args.warmup = 2, 1, 1
        args.compile_backend = "eager"  # dynamo still traces; no C++ toolchain needed
    if args.worker:
        worker(args)
        return 0
    import torch

    from alpa_lite.runtime.launch import torchrun

    argv = sys.argv[1:]
    result = Path(args.out).with_suffix(".json")
    dp = args.dp_ranks if args.dp_ranks is not None else torch.cuda.device_count()
    env = {} if torch.cuda.is_available() else {"CUDA_VISIBLE_DEVICES": ""}
    sections = []
    for nproc in [1] + ([dp] if dp >= 2 else []):
        code = torchrun([__file__, "--worker", "--result", str(result), *argv], nproc=nproc, env=env)
        if code:
            return code
        r = json.loads(result.read_text())
        result.unlink()
        title = "One device (world size 1, mesh 1x1)" if nproc == 1 else f"DP and TP over {nproc} ranks"
        sections.append(f"## {title}: {r['device']}\n\n" + "\n".join(_table(r)))
    text = ("# Runtime on GPUs\n\nCommand: `python benchmarks/runtime_gpu.py " + " ".join(argv) + "`: batch "
            f"{args.batch}, seq {args.seq}; per runner {args.repeats} rounds of {args.steps} timed steps after "
            f"{args.warmup} warm-up steps, the runners taking turns; spread: half the 25th-75th percentile range "
            "of its steps, relative to the median.\n\n" + "\n\n".join(sections) + "\n")
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
