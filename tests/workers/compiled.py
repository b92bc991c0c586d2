"""Run on every rank by torchrun: each plan trains 3 AdamW (or SGD) steps twice from the same weights, in
the interpreter and as the compiled per-rank program (``parallelize(..., compile=backend)``).
Rank 0 writes, per plan: both runs' losses, the largest parameter difference, per rank the
collectives in its traced graphs (an SPMD step's one GraphModule; a pipeline stage's forward and
backward GraphModules) next to what its plan issues there (the forward and backward collectives
of one microbatch, a pipeline stage's all-gathers of its sent values to replicated included),
per rank the collectives counted outside the program during the compiled steps (the gradient
buckets, but an SPMD step's all-reduce buckets of one microbatch, which its graph holds, and the
loss's deferred all-reduce of every microbatch, started after the program's graph: the program's
own collectives are not counted) next to its plan's buckets and deferred loss, per
rank the buckets of the last step that started during backward, of its buckets, per rank the
seeds its random ops drew with in each step (``LocalExecutor.seeded``; a GPT with dropout:
``model_dropout``), and per rank and graph the compute nodes between each collective and its
wait (``overlap.overlap_windows``)."""
import argparse
import copy
import json
from collections import Counter

import torch
import torch.distributed as dist

from alpa_lite import parallelize
from alpa_lite.core.aten import is_random
from alpa_lite.core.resharding import forward_steps
from alpa_lite.core.spec import ShardingSpec
from alpa_lite.runtime import collective_counts
from alpa_lite.runtime.launch import init_distributed
from alpa_lite.runtime.overlap import overlap_windows
from alpa_lite.zoo.models import build_model
from single_process import finish

STEPS = 3


OPTIMIZERS = {"adamw": lambda p: torch.optim.AdamW(p, lr=1e-2), "sgd": lambda p: torch.optim.SGD(p, lr=0.1)}


def train(model, example, batches, options: dict, optimizer: str):
    trainer = parallelize(copy.deepcopy(model), (2, 2), example, optimizer=OPTIMIZERS[optimizer], **options)
    drawn = []  # per step, the seeds the random ops drew with (a recomputation's again)
    for ex in {id(c["executor"]): c["executor"] for c in getattr(trainer, "chunks", [])}.values() or [trainer.executor]:
        ex.seeded = recording(ex.seeded, drawn)
    before = collective_counts()
    losses = []
    for b in batches:
        drawn.append(set())
        losses.append(trainer.step(*b))
    after = collective_counts()
    interpreted = {f"{k}|{ph}": n - before.get((k, ph), 0) for (k, ph), n in after.items()
                   if ph in ("forward", "backward") and n != before.get((k, ph), 0)}
    return trainer, losses, interpreted, [sorted(d) for d in drawn]


def recording(seeded, drawn: list[set]):
    """``seeded`` (``LocalExecutor.seeded``) adding each seed to the last set of ``drawn``."""
    def wrapped(seed):
        drawn[-1].add(seed)
        return seeded(seed)
    return wrapped


def expected(trainer) -> tuple[Counter, Counter]:
    """This rank's plan: (collectives of one microbatch by kind, by "kind|phase" for a pipeline
    stage's two graphs; the gradient buckets and the deferred loss all-reduces of the 3 steps by
    "kind|phase", run outside the program)."""
    pipelined = trainer.plan.kind == "pipeline"
    stage = trainer.plan.stages[trainer.stages[0]] if pipelined else None
    plan = stage.plan if pipelined else trainer.plan
    key = (lambda kind, phase: f"{kind}|{phase}") if pipelined else (lambda kind, phase: kind)
    counts, outside = Counter(), Counter()
    for c in plan.collectives:
        if c.node.startswith("gradient bucket") and c.kind == "all-reduce" and not pipelined \
                and trainer.num_microbatches == 1:  # summed in the graph, launched during its backward
            counts[c.kind] += 1
        elif c.node.startswith("gradient bucket"):
            outside[f"{c.kind}|{c.phase}"] += STEPS
        elif c.deferred:  # once per microbatch
            outside[f"{c.kind}|{c.phase}"] += STEPS * trainer.num_microbatches
        elif c.phase in ("forward", "backward", "recompute"):  # a stage recomputes in its backward graph
            counts[key(c.kind, "backward" if c.phase == "recompute" else c.phase)] += 1
    ex = trainer.program.executor
    for k, shape in ex.outside.uses.items():  # ZeRO-3 copies the program keeps for backward
        if k not in ex.outside.member:
            for step in forward_steps(k[1], k[2], shape, 4, ex.mesh.shape):
                counts[key(step.kind, "backward")] -= step.is_collective
    for _ in ex.outside.groups:  # a group's flat all-gather and reduce-scatter, as the plan's, its copies kept:
        counts[key("all-gather", "backward")] -= 1  # none gathered again in backward (the plan: 1)
    for name in stage.send if pipelined else ():  # each value the stage computed, gathered to replicated
        if name not in stage.recv:
            spec, shape = plan.nodes[name].out_specs[0], tuple(trainer.cg.node(name).meta["val"].shape)
            for step in forward_steps(spec, ShardingSpec.replicated(spec.ndim), shape, 4, ex.mesh.shape):
                counts[key(step.kind, "forward")] += step.is_collective
    return +counts, outside


def traced(program, pipelined: bool) -> tuple[list, dict[str, int]]:
    """This rank's traced graphs, and their collectives keyed as ``expected`` keys them."""
    if not pipelined:
        return [program.graph_module], dict(program.collectives())
    return [program.forward_module, program.backward_module], {
        f"{k}|{ph}": n for ph in ("forward", "backward") for k, n in program.collectives(ph).items()}


def every_rank(x):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plans", required=True, help="JSON object: plan name -> parallelize options (and "
                                                   "model_X: the GPT's option X, e.g. model_num_layers (default 1), "
                                                   "model_dropout, model_qkv_layout; optimizer: adamw (default) "
                                                   "or sgd)")
    ap.add_argument("--backend", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    init_distributed(60)
    results = {}
    for name, options in json.loads(args.plans).items():
        model_options = {"num_layers": 1} | {k[6:]: options.pop(k) for k in list(options) if k.startswith("model_")}
        model, example = build_model("gpt-tiny", 8, 16, device="cpu", **model_options)
        batches = [build_model("gpt-tiny", 8, 16, device="cpu", seed=100 + s, **model_options)[1]
                   for s in range(STEPS)]
        optimizer = options.pop("optimizer", "adamw")
        plain, plain_losses, _, plain_seeds = train(model, example, batches, options, optimizer)
        runtime = {k: options[k] for k in ("accumulate",) if k in options}
        compiled, losses, interpreted, seeds = train(model, example, batches,
                                                     runtime | {"plan": plain.plan, "compile": args.backend}, optimizer)
        got, want = compiled.state_dict(), plain.state_dict()
        plan_counts, outside = expected(compiled)
        graphs, graph_counts = traced(compiled.program, plain.plan.kind == "pipeline")
        plan = compiled.sp.plan if plain.plan.kind == "pipeline" else compiled.plan  # this rank's (stage's)
        results[name] = {"losses": losses, "plain_losses": plain_losses,
                         "param_diff": max(float((got[k] - v).abs().max()) for k, v in want.items()),
                         "graph_collectives": every_rank(graph_counts),
                         "plan_collectives": every_rank(dict(plan_counts)),
                         "interpreted_during_compiled": every_rank(interpreted),
                         "outside_3_steps": every_rank(dict(outside)),
                         "deferred_loss": every_rank(sum(c.deferred for c in plan.collectives)),
                         "early_buckets": every_rank((compiled.bucket_sync.launched_in_backward,
                                                      len(compiled.bucket_sync.buckets))),
                         "stage_devices": [len(s.ranks) for s in getattr(plain.plan, "stages", [])],
                         "schedule": getattr(plain.plan, "schedule", None),
                         "seeds": every_rank(seeds), "plain_seeds": every_rank(plain_seeds),
                         "random_ops": every_rank(sum(is_random(compiled.cg.node(n).target) for n in plan.nodes)),
                         "recompute_collectives": every_rank(sum(c.phase == "recompute" for c in plan.collectives)),
                         "windows": every_rank([overlap_windows(g) for g in graphs]),
                         "graph_module": all(every_rank(all(isinstance(g, torch.fx.GraphModule) for g in graphs)))}
    finish(results, args.out)


if __name__ == "__main__":
    main()
