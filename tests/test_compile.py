"""The compiled per-rank program (``parallelize(..., compile=...)``, ``runtime/program.py``): on
4 gloo ranks, 3 AdamW steps of the plan lowered to one ``torch.fx.GraphModule`` per rank (a
pipeline stage: a forward and a backward one, AOT autograd) and run under ``torch.compile`` give
the interpreter's losses and parameters, with dropout (the interpreter's masks, new every
microbatch and step) and with recomputed layers, and each rank's graphs hold the plan's forward,
backward and recompute collectives; what the lowering does not cover is refused."""
import json
from pathlib import Path

import pytest
import torch

from alpa_lite.runtime.launch import torchrun
from test_overlap import SMALL, megatron

WORKERS = Path(__file__).parent / "workers"
PLANS = {  # test_overlap's plans, of a one-block GPT (tracing and compiling take most of the time)
    "dp": {"force_data_parallel": True, "bucket_bytes": SMALL},
    # the buckets summed in the graph in bf16 (the reduce dtype) and cast back; fp16: the loss scale seeds backward
    "dp-bf16": {"force_data_parallel": True, "bucket_bytes": SMALL, "mixed_precision": "bf16"},
    "dp-fp16": {"force_data_parallel": True, "bucket_bytes": SMALL, "mixed_precision": "fp16"},
    "megatron": {"batch_axis": 0, "param_specs": megatron(1), "bucket_bytes": SMALL},
    "2d": {"param_specs": megatron(1, "S01"), "bucket_bytes": SMALL},
    "zero3": {"force_data_parallel": True, "bucket_bytes": SMALL,
              "param_specs": {k: "S01R" for k, v in megatron(1).items() if v == "S1R"}},
    # ZeRO-3 groups (core.plan.zero3_groups) over axis 0 of 2 x 2, the batch axis, SGD
    "zero3-groups-sgd": {"batch_axis": 0, "zero_stage": 3, "bucket_bytes": SMALL, "optimizer": "sgd"},
    # 2 stages of one block each (model_num_layers: the worker's GPT), 2 devices each, Megatron inside a stage
    "pipeline": {"model_num_layers": 2, "num_stages": 2, "num_layers": 2, "num_microbatches": 2, "schedule": "1f1b",
                 "param_specs": megatron(2), "bucket_bytes": SMALL},
    # data parallel inside the 2 stages: the last stage defers its loss's all-reduce of each microbatch
    "pipeline-dp": {"model_num_layers": 2, "num_stages": 2, "num_layers": 2, "num_microbatches": 2,
                    "schedule": "1f1b", "force_data_parallel": True, "bucket_bytes": SMALL},
}
# the GPT with attention and residual dropout (model_dropout); remat: every layer recomputed.
# Megatron's qkv layout splits the attention by heads (GPTConfig): each shard draws its own mask
HEADS = {"model_qkv_layout": "megatron"}
DROPOUT = {"dp-dropout": PLANS["dp"] | {"accumulate": 2},  # 2 microbatches a step
           "megatron-dropout": PLANS["megatron"] | HEADS,
           "megatron-remat": PLANS["megatron"] | {"remat": "all"},
           "zero3-groups-remat": PLANS["zero3-groups-sgd"] | {"remat": "all", "optimizer": "adamw"},
           "pipeline-dropout": PLANS["pipeline"] | HEADS,
           "pipeline-remat": PLANS["pipeline"] | {"remat": "all"}}
PLANS |= {name: options | {"model_dropout": 0.1} for name, options in DROPOUT.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile") / "results.json"
    assert torchrun([str(WORKERS / "compiled.py"), "--plans", json.dumps(PLANS), "--backend", "aot_eager",
                     "--out", str(out)], nproc=4, timeout_s=600) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", list(PLANS))
def test_compiled_step_equals_interpreted_step(results, name):
    r = results[name]
    assert r["graph_module"]  # every rank traced its torch.fx.GraphModule(s)
    assert r["losses"] == r["plain_losses"]
    assert r["param_diff"] == 0.0  # the same ops on the same shards, the same collectives in the same order
    # each rank's plan communicates in forward / backward, inside the program or outside (dp: only its deferred loss)
    assert all(inside or outside for inside, outside in zip(r["plan_collectives"], r["outside_3_steps"]))
    # per rank: its graph(s) hold its plan's collectives (a stage's forward and backward graph each its phase's)
    assert r["graph_collectives"] == r["plan_collectives"]
    # outside the program, only the plan's gradient buckets and its deferred loss all-reduces ran (through the
    # interpreter's counted collectives), the loss's once per microbatch
    assert r["interpreted_during_compiled"] == r["outside_3_steps"]
    # the plans whose loss is split over the batch defer it (not in a recomputed layer: docs/runtime.md; not
    # under mixed precision, where the graph's loss is the fp32 cast of the reduced cross-entropy)
    if name.startswith(("dp", "zero3", "pipeline-dp")) and not name.endswith(("remat", "bf16", "fp16")):
        holders = [n for n in r["deferred_loss"] if n]
        assert holders and all(n == 1 for n in holders), r["deferred_loss"]


def test_compiled_pipeline_has_two_stages_of_two_devices_and_overlaps_its_buckets(results):
    r = results["pipeline"]
    assert r["stage_devices"] == [2, 2] and r["schedule"] == "1f1b"
    stage0 = r["graph_collectives"][0]  # rank 0's: stage 0 communicates inside both of its graphs
    assert any(k.endswith("|forward") for k in stage0) and any(k.endswith("|backward") for k in stage0), stage0
    # the compiled backward accumulates into .grad as autograd does: each bucket's all-reduce starts
    # from its hook during the stage's last backward (rank 0's stage synchronizes a bucket)
    assert all(n == t for n, t in r["early_buckets"]) and r["early_buckets"][0][1] >= 1, r["early_buckets"]


def test_compile_refuses_a_split_backward_schedule():
    from alpa_lite import LogicalMesh, plan
    from alpa_lite.runtime.pipeline import PipelineTrainer

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    pl = plan(model, torch.randn(8, 8), LogicalMesh((1, 2), cluster="cpu-gloo"), lambda y: y.mean(), num_stages=2,
              num_microbatches=2, num_layers=2, schedule="zb-h1", workers=1)
    with pytest.raises(ValueError, match="compile=True cannot run the zb-h1 schedule: a compiled stage's backward is "
                                         "one graph"):
        PipelineTrainer(model, pl.captured, pl, None, compile="aot_eager")


@pytest.mark.parametrize("name", list(DROPOUT))
def test_compiled_dropout_draws_the_interpreters_masks(results, name):
    """Each random op draws after the seed the interpreter seeds it with (rank, run, node), so the
    masks are the interpreter's: new ones every microbatch and step, shared by the ranks that hold
    the same values, their own on ranks holding different shards."""
    r, options = results[name], PLANS[name]
    microbatches = options.get("accumulate", options.get("num_microbatches", 1))
    assert r["seeds"] == r["plain_seeds"]  # per rank, per step: the seeds drawn with (a recomputation's again)
    for rank, steps in enumerate(r["seeds"]):
        assert r["random_ops"][rank] >= 3  # attention dropout and two residual dropouts (per block it holds)
        assert [len(s) for s in steps] == [r["random_ops"][rank] * microbatches] * 3, steps
        assert not set(steps[0]) & set(steps[1]) and not set(steps[1]) & set(steps[2])
    first = [set(steps[0]) for steps in r["seeds"]]
    if name == "dp-dropout":  # every value split over all 4 ranks (batch S01): 4 ranks, 4 sets of masks
        assert all(not first[a] & first[b] for a in range(4) for b in range(a))
        return
    # ranks 0 and 1 (one mesh row or stage, the Megatron axis): the residual dropouts' masks
    # (replicated values) shared, the attention's too when it runs replicated (GPT-2's qkv layout
    # gathers q, k, v), each its own when split by heads
    if options.get("model_qkv_layout") == "megatron":
        assert first[0] & first[1] and first[0] != first[1]
    else:
        assert first[0] == first[1]
    assert not first[0] & first[2]  # another batch shard (SPMD) or another stage's ops


@pytest.mark.parametrize("name", [n for n in DROPOUT if "remat" in n])
def test_compiled_remat_recomputes_in_backward(results, name):
    """A recomputed layer's forward runs again in the graph's backward, its collectives the plan's
    recompute phase: every rank's plan recomputes collectives, which its graphs hold (the
    equality in ``test_compiled_step_equals_interpreted_step`` counts them)."""
    r = results[name]
    assert all(n > 0 for n in r["recompute_collectives"]), r["recompute_collectives"]
    assert r["graph_collectives"] == r["plan_collectives"]


@pytest.mark.parametrize("name", ["zero3-groups-sgd", "zero3-groups-remat"])
def test_compiled_zero3_collectives_overlap_compute(results, name):
    """The program's graph is reordered (``runtime/overlap.py``): on every rank each ZeRO-3 group's
    gradient reduce-scatter waits after compute that does not read it, and at least 3 in 4 of the
    parameter all-gathers are prefetched (compute between the all-gather and its wait). The values
    are equal (``test_compiled_step_equals_interpreted_step``)."""
    for rank, graphs in enumerate(results[name]["windows"]):
        windows = [w for graph in graphs for w in graph]
        gathers = [n for op, n in windows if op == "all_gather_into_tensor"]
        scatters = [n for op, n in windows if op == "reduce_scatter_tensor"]
        assert scatters and all(n > 0 for n in scatters), (rank, windows)
        assert len(gathers) >= 4 and sum(n > 0 for n in gathers) >= 0.75 * len(gathers), (rank, windows)


def test_compiled_buckets_run_during_backward(results):
    """With one microbatch the data-parallel gradient buckets are summed in the program's graph
    (``test_compiled_step_equals_interpreted_step`` counts them there, not outside), each launched
    where backward completes it: on every rank of the dp plan each bucket's all-reduce has compute
    before its wait, and outside the graph only the deferred loss's all-reduce runs."""
    r = results["dp"]
    for rank, graphs in enumerate(r["windows"]):
        (graph,) = graphs
        assert len(graph) >= 3 and all(op == "all_reduce" and n > 0 for op, n in graph), (rank, graph)
        assert r["graph_collectives"][rank] == {"all-reduce": len(graph)}
    assert all(outside == {"all-reduce|forward": 3} for outside in r["outside_3_steps"]), r["outside_3_steps"]


@pytest.mark.parametrize("name", ["pipeline", "pipeline-remat"])
def test_compiled_stage_collectives_overlap_compute(results, name):
    """A stage's forward and backward graphs are reordered too: on every rank each of its two graphs
    has a collective with compute before its wait."""
    for rank, graphs in enumerate(results[name]["windows"]):
        assert len(graphs) == 2 and all(any(n > 0 for _, n in graph) for graph in graphs), (rank, graphs)


def test_lowering_refuses_in_place_writes_only():
    """An in-place write to a stored tensor (``embedding_renorm_`` of ``max_norm``) is refused;
    writes into activations, dropout and recomputed layers are lowered."""
    from alpa_lite import LogicalMesh, plan
    from alpa_lite.runtime.collectives import MeshGroups
    from alpa_lite.runtime.executor import LocalExecutor
    from alpa_lite.runtime.program import RankProgram, StageProgram

    class Model(torch.nn.Module):
        def __init__(self, max_norm):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8, max_norm=max_norm)
            self.fc = torch.nn.Linear(8, 1)

        def forward(self, idx):
            return self.fc(torch.nn.functional.dropout(self.emb(idx), 0.5)).mean()

    def executor(max_norm, **options):
        pl = plan(Model(max_norm), torch.randint(0, 16, (8, 4)), LogicalMesh((2, 2), cluster="cpu-gloo"),
                  lambda y: y, force_data_parallel=True, **options)
        return LocalExecutor(pl.captured, pl, MeshGroups((2, 2), (0, 0), (None, None)), torch.device("cpu"))

    for program in (RankProgram, StageProgram):
        with pytest.raises(ValueError, match="cannot lower this plan .*in-place write embedding_renorm"):
            program(executor(1.0), None, [], None)
    class Activations(Model):  # in-place writes into activations only: lowered
        def forward(self, idx):
            h = self.emb(idx)
            h.mul_(0.5)
            return self.fc(torch.relu_(h)).mean()

    pl = plan(Activations(None), torch.randint(0, 16, (8, 4)), LogicalMesh((2, 2), cluster="cpu-gloo"),
              lambda y: y, force_data_parallel=True)
    ex = LocalExecutor(pl.captured, pl, MeshGroups((2, 2), (0, 0), (None, None)), torch.device("cpu"))
    assert sum(bool(d.written) for d in ex.dispatch.values()) == 2
    RankProgram(ex, None, [], None)
    lowered = executor(None, remat="all")
    assert lowered.plan.remat and any(d.random for d in lowered.dispatch.values())
    assert RankProgram(lowered, None, [], None).graph_module is None  # traced on its first call


def test_an_error_raised_in_a_compiled_graph_is_raised_as_itself():
    # a collective's timeout inside a compiled graph must reach collectives.named as gloo raised
    # it: compiling the fx module itself turned any error in the graph into dynamo's "Attempt to
    # trace generator" (torch.fx's wrapper walks the traceback inside the compiled frame)
    from alpa_lite.runtime.program import _compiled

    graph = torch.fx.symbolic_trace(lambda x, i: torch.index_select(x * 2, 0, i))
    run = _compiled(graph, "aot_eager")
    assert run(torch.ones(3), torch.tensor([2])).tolist() == [2.0]
    with pytest.raises(IndexError, match="out of range"):
        run(torch.ones(3), torch.tensor([7]))
