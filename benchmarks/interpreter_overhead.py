"""The interpreter's own work per step: alpa-lite's interpreted step vs eager PyTorch, CPU time.

    python benchmarks/interpreter_overhead.py [--steps 300] [--layers 4] [--hidden 64]

One process (a gloo group of one rank, mesh 1x1), the built-in GPT at a size where Python work
per node is a visible share of the step (default: hidden 64, 4 layers, batch 4 x 16), SGD. The
two runners take turns, one step each, for ``--steps`` rounds after 5 warm-up steps; each step
is timed in CPU seconds of this process (``time.process_time``: less sensitive than wall time
to other jobs on a shared machine). Prints, per runner, the median step and the spread (half
the 25th-75th percentile range, relative to the median), the ratio to eager and the difference
per step and per node of the captured graph (``call_function`` nodes run per forward).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    from alpa_lite import parallelize
    from alpa_lite.zoo.models import build_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0, world_size=1)
    model, example = build_model("gpt-tiny", 4, 16, device="cpu", hidden=args.hidden, num_layers=args.layers,
                                 num_heads=4, vocab_size=128)
    sgd = lambda ps: torch.optim.SGD(ps, lr=1e-3)  # noqa: E731
    eager = copy.deepcopy(model)
    opt = sgd(eager.parameters())

    def eager_step(*batch):
        opt.zero_grad(set_to_none=True)
        eager(*batch).backward()
        opt.step()

    trainer = parallelize(copy.deepcopy(model), (1, 1), example, optimizer=sgd)
    nodes = sum(n.op == "call_function" for n in trainer.executor.cg.graph.nodes)
    runners = {"eager PyTorch": eager_step, "alpa-lite interpreted": trainer.step}
    for step in runners.values():
        for _ in range(5):
            step(*example)
    times = {label: [] for label in runners}
    try:
        for _ in range(args.steps):
            for label, step in runners.items():
                t0 = time.process_time()
                step(*example)
                times[label].append(time.process_time() - t0)
    finally:
        dist.destroy_process_group()
    med = {label: statistics.median(ts) for label, ts in times.items()}
    base = med["eager PyTorch"]
    print(f"| runner | CPU ms per step | spread | ratio to eager | ms over eager | us per node ({nodes} nodes) |")
    print("|---|---|---|---|---|---|")
    for label, ts in times.items():
        q = statistics.quantiles(ts, n=4)
        over = med[label] - base
        print(f"| {label} | {med[label] * 1e3:.3f} | ±{(q[2] - q[0]) / 2 / med[label]:.0%} | {med[label] / base:.3f} "
              f"| {over * 1e3:.3f} | {over / nodes * 1e6:.1f} |")


if __name__ == "__main__":
    main()
