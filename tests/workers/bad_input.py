"""Bad input to parallelize, on every rank (torchrun): each case's error goes to a JSON file."""
import argparse
import datetime
import json
import os
import signal
import time

import torch.distributed as dist

from alpa_lite import LogicalMesh, plan
from alpa_lite.runtime.launch import init_distributed
from alpa_lite.zoo.models import build_model
from alpa_lite import parallelize


def error_of(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def stamp(out: str) -> None:
    """Write the time to ``out``: when this rank fails (the test times the job's end from it)."""
    with open(out, "w") as f:
        f.write(repr(time.time()))


def stop_here(out: str) -> None:
    """``stamp``, then stop this process (SIGSTOP: alive, never answering)."""
    stamp(out)
    os.kill(os.getpid(), signal.SIGSTOP)


def first_step(trainer, example):
    """The first step (tracing, compiling: under load one rank may keep its peers waiting longer
    than 15 s), then every group's collectives time out after 15 s: the failures tested come after."""
    trainer.step(*example)
    dist.barrier()
    for group in dist.distributed_c10d._world.pg_map:
        group.set_timeout(datetime.timedelta(seconds=15))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    init_distributed(timeout_s=120)
    rank = dist.get_rank()
    model, example = build_model("gpt-tiny", 8, 16, device="cpu")
    if args.case == "raising-rank":  # a pipeline stage raises between steps; its time goes to --out
        trainer = parallelize(model, (2, 2), example, num_stages=2, num_layers=2, num_microbatches=2)
        trainer.step(*example)  # the collective timeout stays 120 s, which the job must not wait out
        if rank == 1:
            stamp(args.out)
            raise RuntimeError("rank 1 fails on purpose")
        trainer.step(*example)
        return
    if args.case == "dead-rank":
        trainer = parallelize(model, (2, 2), example, force_data_parallel=True)
        first_step(trainer, example)
        if rank == 1:  # dies between steps; the others block in the next step's collectives
            stamp(args.out)
            os._exit(3)
        trainer.step(*example)
        return
    # one rank stops (SIGSTOP: alive, never answering) as a parameter's gradient accumulates in
    # the second step's backward: the others must fail on their own collective timeout, not on
    # the launcher tearing them down. DP on 2x2: rank 1, bucket all-reduces in flight; 2 stages x
    # 2 data-parallel devices, 1F1B, B = 2: rank 3 (last stage), its loss's deferred all-reduce in flight
    stopped = {"stopped-in-backward": (1, "blocks.0.attn.qkv.weight", {}),
               "stopped-in-backward-pipeline": (3, "ln_f.weight",
                                                {"num_stages": 2, "num_layers": 2, "num_microbatches": 2})}
    if args.case in stopped:
        who, param, options = stopped[args.case]
        trainer = parallelize(model, (2, 2), example, force_data_parallel=True, bucket_bytes=8192, **options)
        first_step(trainer, example)
        if rank == who:
            trainer.params[param].register_post_accumulate_grad_hook(lambda p: stop_here(args.out))
        trainer.step(*example)
        return
    # the compiled programs (compile="aot_eager"): a rank stops as its second step's graph starts. DP
    # on 2x2: rank 1, the others' gradient buckets' all-reduces in flight in their graphs; 2 Megatron
    # stages x 2 devices: rank 3, its stage peer's forward graph all-reducing with it
    megatron = {f"blocks.{i}.{layer}.weight": spec for i in range(2)
                for layer, spec in (("attn.qkv", "S1R"), ("attn.proj", "RS1"), ("ffn.fc", "S1R"), ("ffn.proj", "RS1"))}
    in_graph = {"stopped-in-graph": (1, {"force_data_parallel": True}),
                "stopped-in-graph-pipeline": (3, {"num_stages": 2, "num_layers": 2, "num_microbatches": 2,
                                                  "param_specs": megatron})}
    if args.case in in_graph:
        who, options = in_graph[args.case]
        trainer = parallelize(model, (2, 2), example, bucket_bytes=8192, compile="aot_eager", **options)
        first_step(trainer, example)
        if rank == who:
            program, graph = trainer.program, "_function" if options.get("num_stages") else "_compiled"
            run = getattr(program, graph)

            def stopping(*a, **kw):
                stop_here(args.out)
                return run(*a, **kw)
            setattr(program, graph, stopping)
        trainer.step(*example)
        return
    if args.case == "stopped-in-backward-zero3":
        # ZeRO-3 groups on 1x4: rank 1 stops as it starts its first gradient reduce-scatter of the
        # second step's backward, with the next group's all-gather prefetched
        trainer = parallelize(model, (1, 4), example, force_data_parallel=True, zero_stage=3, bucket_bytes=8192)
        first_step(trainer, example)
        if rank == 1:
            start = dist.reduce_scatter_single

            def stop(*a, **kw):
                stop_here(args.out)
                return start(*a, **kw)
            dist.reduce_scatter_single = stop
        trainer.step(*example)
        return
    other_model, other_example = build_model("gpt-tiny", 4, 16, device="meta")
    other_plan = plan(other_model, other_example, LogicalMesh((2, 2), cluster="cpu-gloo")).to_json()
    wrong_mesh = plan(model, example, LogicalMesh((1, 4), cluster="cpu-gloo")).to_json()
    errors = {
        "mesh-size": error_of(lambda: parallelize(model, (2, 4), example)),
        "other-model": error_of(lambda: parallelize(model, (2, 2), example, plan=other_plan)),
        "other-mesh": error_of(lambda: parallelize(model, (2, 2), example, plan=wrong_mesh)),
        "corrupt-plan": error_of(lambda: parallelize(model, (2, 2), example, plan='{"version": 1}')),
        "bad-batch": error_of(lambda: parallelize(model, (2, 2), example, force_data_parallel=True).step(
            *build_model("gpt-tiny", 4, 16, device="cpu")[1])),
    }
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(errors, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
